//! The cluster a command talks to: found once, with the server's address kept for messages.

use super::error::Error;

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
    /// Finds the cluster as kubectl does: KUBECONFIG, else `~/.kube/config`, else in-cluster.
    /// Nothing is sent to the API server yet.
    pub async fn connect() -> Result<Cluster, Error> {
        let config = kube::Config::infer().await.map_err(|source| Error::FindCluster { source })?;
        let server = config.cluster_url.to_string().trim_end_matches('/').to_string();
        let namespace = config.default_namespace.clone();
        let client = kube::Client::try_from(config).map_err(|source| Error::ConnectCluster { server: server.clone(), source })?;
        Ok(Cluster { client, server, namespace })
    }
}
