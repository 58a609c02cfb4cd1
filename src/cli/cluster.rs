//! The cluster a command talks to: found once, with the server's address kept for messages.
//!
//! `--kubeconfig` and `--context` are kube-fence's own (global: before or after the subcommand),
//! because kubectl passes none of its flags to a plugin and refuses flags placed before the
//! plugin's name (`kubectl --context x fence ...`: "flags cannot be placed before plugin name").
//! As a plugin they go after it: `kubectl fence --context x status`.

use std::path::PathBuf;

use kube::config::{KubeConfigOptions, Kubeconfig};

use super::error::Error;

/// Which kubeconfig, and which of its contexts, a command uses.
#[derive(Clone, Debug, Default, PartialEq, Eq, clap::Args)]
pub struct ClusterArgs {
    /// The kubeconfig file to use (default: $KUBECONFIG, else ~/.kube/config, else the Pod's
    /// service account).
    #[arg(long, global = true, value_name = "FILE", help_heading = "Cluster options")]
    pub kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use (default: its current-context); its namespace is the
    /// default of -n.
    #[arg(long, global = true, value_name = "NAME", help_heading = "Cluster options")]
    pub context: Option<String>,
}

impl ClusterArgs {
    /// The client configuration these options name, as kubectl finds it: `--kubeconfig` (or
    /// `$KUBECONFIG`, or `~/.kube/config`) at `--context` (or its current-context); with neither
    /// flag, also in-cluster. Nothing is sent to the API server.
    pub async fn config(&self) -> Result<kube::Config, Error> {
        let options = KubeConfigOptions { context: self.context.clone(), ..Default::default() };
        match (&self.kubeconfig, &self.context) {
            (None, None) => kube::Config::infer().await.map_err(|source| Error::FindCluster { source }),
            (Some(path), _) => {
                let kubeconfig = Kubeconfig::read_from(path).map_err(|source| Error::LoadKubeconfig {
                    path: Some(path.clone()),
                    context: self.context.clone(),
                    source,
                })?;
                kube::Config::from_custom_kubeconfig(kubeconfig, &options).await.map_err(|source| Error::LoadKubeconfig {
                    path: Some(path.clone()),
                    context: self.context.clone(),
                    source,
                })
            }
            (None, Some(_)) => kube::Config::from_kubeconfig(&options).await.map_err(|source| Error::LoadKubeconfig {
                path: None,
                context: self.context.clone(),
                source,
            }),
        }
    }
}

/// A client for the cluster in KUBECONFIG (or the Pod's), and what messages say about it.
#[derive(Clone)]
pub struct Cluster {
    pub client: kube::Client,
    /// The API server's URL, as errors name it.
    pub server: String,
    /// The kubeconfig context's namespace (`default` when it names none).
    pub namespace: String,
}

impl Cluster {
    /// Finds the cluster as kubectl does ([`ClusterArgs::config`]). Nothing is sent to the API
    /// server yet.
    pub async fn connect(args: &ClusterArgs) -> Result<Cluster, Error> {
        let config = args.config().await?;
        let server = config.cluster_url.to_string().trim_end_matches('/').to_string();
        let namespace = config.default_namespace.clone();
        let client = kube::Client::try_from(config).map_err(|source| Error::ConnectCluster { server: server.clone(), source })?;
        Ok(Cluster { client, server, namespace })
    }
}
