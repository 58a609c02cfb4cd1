//! `kube-fence delete TYPE/NAME`: a fenced delete from the shell.
//!
//! A DELETE carries no token, so the fencing webhook admits a DELETE of a guarded object only
//! with a `resourceVersion` precondition — "delete the version you read" — which `kubectl delete`
//! cannot send. This reads the object and deletes exactly that version (and uid). With a grant
//! (`--lease`/`--token`, or the one delegated to the process) it first refuses, exit status 8,
//! when the object records a newer token than the grant's; on a holder-only object
//! (`kubefence.io/writer: holder`) the webhook admits it only from the lease's holder:
//!
//! ```sh
//! kube-fence delete configmap/report -n work                       # as the holder (holder-only)
//! kube-fence delete configmap/report --lease jobs --token "$TOKEN" -n work
//! ```

use std::io::Write;

use kube::ResourceExt;

use super::cluster::{Cluster, ClusterArgs};
use super::error::Error;
use super::grant::GrantArgs;
use super::patch::{Target, parse_object};
use crate::client::{self, delete_read_version};
use kube_fence_api::names::LEASE_LABEL;

/// Arguments of `kube-fence delete`.
#[derive(Debug, clap::Args)]
pub struct DeleteArgs {
    /// The object as TYPE/NAME: configmap/report, deployments.apps/web.
    #[arg(value_parser = parse_object)]
    pub object: (String, String),
    /// Namespace of the object (default: the kubeconfig context's namespace, or the delegated
    /// grant's).
    #[arg(short = 'n', long, env = "KUBE_FENCE_NAMESPACE")]
    pub namespace: Option<String>,
    #[command(flatten)]
    pub grant: GrantArgs,
}

pub async fn run(args: DeleteArgs, at: &ClusterArgs) -> Result<(), Error> {
    let cluster = Cluster::connect(at).await?;
    let grant = args.grant.resolve(args.namespace.as_deref(), &cluster.namespace)?.map(|(grant, _)| grant);
    let namespace = match (&grant, &args.namespace) {
        (Some(grant), _) => grant.namespace.clone(),
        (None, Some(ns)) => ns.clone(),
        (None, None) => cluster.namespace.clone(),
    };
    let (resource, name) = args.object;
    let target = Target::resolve(&cluster, &resource, &name, &namespace).await?;
    let fenced = |lease: String, source: client::Error| Error::WriteFenced {
        object: target.object.clone(),
        lease,
        server: cluster.server.clone(),
        source,
    };
    let read = match target.api.get(&name).await {
        Ok(read) => read,
        Err(source) => return Err(fenced(grant.map(|g| g.lease).unwrap_or_default(), client::Error::Kube(source))),
    };
    let version = read.resource_version().unwrap_or_default();
    let deleted = match &grant {
        Some(grant) => grant.delete(&target.api, &read).await,
        None => delete_read_version(&target.api, &name, &version, read.uid()).await,
    };
    match deleted {
        Ok(()) => {
            writeln!(std::io::stdout().lock(), "{}/{name} deleted (resourceVersion {version})", target.resource.plural)?;
            Ok(())
        }
        Err(source) => {
            let lease = grant.map(|g| g.lease).or_else(|| read.labels().get(LEASE_LABEL).cloned()).unwrap_or_default();
            Err(fenced(lease, source))
        }
    }
}
