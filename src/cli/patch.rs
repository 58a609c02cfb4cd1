//! `kube-fence patch TYPE/NAME --lease L --token T -p PATCH`: a fenced write from the shell.
//!
//! The patch is stamped with the lease label and the token annotation, as the library's
//! [`crate::client::Grant::patch`] does, so the fencing webhook judges it; a stale token exits
//! with status 8. Without `--lease` and `--token` it writes with the grant delegated to the
//! process (`$KUBE_FENCE_GRANT`):
//!
//! ```sh
//! TOKEN=$(kube-fence lease acquire jobs --holder "$HOSTNAME" -n work)
//! kube-fence patch configmap/report --lease jobs --token "$TOKEN" -n work -p '{"data":{"total":"42"}}'
//! ```

use std::io::Write;

use kube::api::{Api, DynamicObject, Patch, PatchParams};
use kube::discovery::{ApiCapabilities, ApiResource, Discovery, Scope};

use super::cluster::{Cluster, ClusterArgs};
use super::error::{Error, Object};
use super::grant::GrantArgs;

/// Arguments of `kube-fence patch`.
#[derive(Debug, clap::Args)]
pub struct PatchArgs {
    /// The object as TYPE/NAME: configmap/report, deployments.apps/web.
    #[arg(value_parser = parse_object)]
    pub object: (String, String),
    /// Namespace of the object (default: the kubeconfig context's namespace).
    #[arg(short = 'n', long, env = "KUBE_FENCE_NAMESPACE")]
    pub namespace: Option<String>,
    #[command(flatten)]
    pub grant: GrantArgs,
    /// The patch, a JSON object: merged into the object, e.g. '{"data":{"total":"42"}}'.
    #[arg(short = 'p', long, value_parser = parse_patch)]
    pub patch: serde_json::Value,
    /// How the patch merges.
    #[arg(long = "type", value_enum, default_value_t = PatchType::Merge)]
    pub patch_type: PatchType,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum PatchType {
    /// JSON merge patch (RFC 7386).
    Merge,
    /// Kubernetes strategic merge patch (built-in types only).
    Strategic,
}

pub(super) fn parse_object(s: &str) -> Result<(String, String), String> {
    match s.split_once('/') {
        Some((kind, name)) if !kind.is_empty() && !name.is_empty() && !name.contains('/') => Ok((kind.to_string(), name.to_string())),
        _ => Err("write the object as TYPE/NAME, e.g. configmap/report".to_string()),
    }
}

fn parse_patch(s: &str) -> Result<serde_json::Value, String> {
    match serde_json::from_str::<serde_json::Value>(s) {
        Ok(value @ serde_json::Value::Object(_)) => Ok(value),
        Ok(_) => Err("the patch must be a JSON object, e.g. '{\"data\":{\"k\":\"v\"}}'".to_string()),
        Err(e) => Err(format!("not JSON ({e})")),
    }
}

pub async fn run(args: PatchArgs, at: &ClusterArgs) -> Result<(), Error> {
    let cluster = Cluster::connect(at).await?;
    let Some((grant, _)) = args.grant.resolve(args.namespace.as_deref(), &cluster.namespace)? else {
        return Err(Error::NoGrant);
    };
    let (resource, name) = args.object;
    let target = Target::resolve(&cluster, &resource, &name, &grant.namespace).await?;
    let patch = match args.patch_type {
        PatchType::Merge => Patch::Merge(args.patch),
        PatchType::Strategic => Patch::Strategic(args.patch),
    };
    match grant.patch(&target.api, &name, &PatchParams::default(), patch).await {
        Ok(_) => {
            writeln!(std::io::stdout().lock(), "{}/{name} patched with token {}", target.resource.plural, grant.token)?;
            Ok(())
        }
        Err(source) => Err(Error::WriteFenced { object: target.object, lease: grant.lease, server: cluster.server, source }),
    }
}

/// The object a command names, resolved: how to reach it, and how messages name it.
pub(super) struct Target {
    pub api: Api<DynamicObject>,
    pub object: Object,
    pub resource: ApiResource,
}

impl Target {
    pub(super) async fn resolve(cluster: &Cluster, resource: &str, name: &str, namespace: &str) -> Result<Target, Error> {
        let (ar, caps) = resolve(cluster, resource).await?;
        let (api, object) = match caps.scope {
            Scope::Namespaced => {
                (Api::namespaced_with(cluster.client.clone(), namespace, &ar), Object::namespaced(&ar.kind, namespace, name))
            }
            Scope::Cluster => (Api::all_with(cluster.client.clone(), &ar), Object::cluster_scoped(&ar.kind, name)),
        };
        Ok(Target { api, object, resource: ar })
    }
}

/// TYPE as kubectl takes it: plural, singular or kind, optionally `.group` (`deployments.apps`).
async fn resolve(cluster: &Cluster, resource: &str) -> Result<(ApiResource, ApiCapabilities), Error> {
    let (wanted, group) = match resource.split_once('.') {
        Some((r, g)) => (r.to_ascii_lowercase(), Some(g.to_string())),
        None => (resource.to_ascii_lowercase(), None),
    };
    let mut discovery = Discovery::new(cluster.client.clone());
    if let Some(group) = &group {
        discovery = discovery.filter(&[group.as_str()]);
    }
    let discovery = discovery.run().await.map_err(|source| Error::DiscoverResourceTypes { server: cluster.server.clone(), source })?;
    discovery
        .groups()
        .flat_map(|g| g.recommended_resources())
        .find(|(ar, _)| ar.plural == wanted || ar.kind.to_ascii_lowercase() == wanted)
        .ok_or_else(|| Error::ResolveResourceType { resource: resource.to_string(), server: cluster.server.clone() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_are_checked_before_any_request() {
        assert_eq!(parse_object("configmap/report"), Ok(("configmap".into(), "report".into())));
        for bad in ["report", "configmap/", "/report", "a/b/c"] {
            assert!(parse_object(bad).is_err(), "{bad}");
        }
        assert!(super::super::grant::parse_token("42").is_ok());
        assert!(super::super::grant::parse_token("-1").is_err() && super::super::grant::parse_token("x").is_err());
        assert!(parse_patch(r#"{"data":{}}"#).is_ok());
        assert!(parse_patch("[1]").is_err() && parse_patch("{").is_err());
    }
}
