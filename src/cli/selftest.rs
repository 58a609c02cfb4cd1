//! `kube-fence selftest -n NS`: fencing checked end to end, as the chart's `helm test` runs it.
//! Two grants of one lease write one guarded ConfigMap: the older grant, released, writes it;
//! the newer grant writes it; the older grant's write again must be refused (409 StaleToken).
//! Exit status 0 when it was, 1 when it was admitted (fencing does not work in that namespace),
//! and the usual statuses when something else failed (RBAC, no lease controller...).
//!
//! It leaves the Lease and the ConfigMap (both named `--name`) in place: the next run's grants
//! are newer than every earlier one, so a later run writes the same objects again.

use std::io::Write;
use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, Patch, PatchParams};

use super::cluster::{Cluster, ClusterArgs};
use super::error::{Error, Object};
use crate::client::{AcquireOptions, Error as ClientError, Grant, Leases};

/// Arguments of `kube-fence selftest`.
#[derive(Debug, clap::Args)]
pub struct SelftestArgs {
    /// A fenced namespace to test in (not kube-fence's own, nor an excluded one: those are
    /// never fenced).
    #[arg(short = 'n', long, env = "KUBE_FENCE_NAMESPACE")]
    pub namespace: Option<String>,
    /// The name of the Lease and of the guarded ConfigMap it writes.
    #[arg(long, default_value = "kube-fence-selftest")]
    pub name: String,
    /// How long to wait for each grant.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration)]
    pub wait: Duration,
}

pub async fn run(args: SelftestArgs, at: &ClusterArgs) -> Result<(), Error> {
    let cluster = Cluster::connect(at).await?;
    let namespace = args.namespace.clone().unwrap_or_else(|| cluster.namespace.clone());
    let leases = Leases::new(cluster.client.clone(), &namespace);
    let configmaps: Api<ConfigMap> = Api::namespaced(cluster.client.clone(), &namespace);
    let object = Object::namespaced("ConfigMap", &namespace, &args.name);
    let lease = Object::namespaced("Lease", &namespace, &args.name);
    let mut out = std::io::stdout().lock();
    let acquire = |holder: &'static str| {
        let leases = leases.clone();
        let (name, lease, server, wait) = (args.name.clone(), lease.clone(), cluster.server.clone(), args.wait);
        async move {
            let options = AcquireOptions::default().duration(Duration::from_secs(60)).timeout(wait);
            leases.acquire(&name, holder, options).await.map_err(|source| Error::AcquireLease {
                lease,
                holder: holder.into(),
                wait,
                server,
                source,
            })
        }
    };
    let failed = |grant: &Grant, source| Error::WriteFenced {
        object: object.clone(),
        lease: grant.lease.clone(),
        server: cluster.server.clone(),
        source,
    };
    let write = |grant: Grant, by: &'static str| {
        let (configmaps, name) = (configmaps.clone(), args.name.clone());
        async move {
            let patch = Patch::Merge(serde_json::json!({"data": {"written-by": by, "token": grant.token.to_string()}}));
            match grant.patch(&configmaps, &name, &PatchParams::default(), patch).await {
                // The first run in a namespace: the grant creates it.
                Err(ClientError::Kube(kube::Error::Api(status))) if status.code == 404 => {
                    let cm = ConfigMap {
                        metadata: ObjectMeta { name: Some(name.clone()), ..Default::default() },
                        data: Some([("written-by".to_string(), by.to_string()), ("token".to_string(), grant.token.to_string())].into()),
                        ..Default::default()
                    };
                    grant.create(&configmaps, &cm).await.map(|_| ())
                }
                other => other.map(|_| ()),
            }
        }
    };

    let older = acquire("selftest-older").await?;
    write(older.clone(), "older").await.map_err(|source| failed(&older, source))?;
    leases.release(&older).await.map_err(|source| Error::ReleaseLease {
        lease: lease.clone(),
        holder: older.holder.clone(),
        server: cluster.server.clone(),
        source,
    })?;
    let newer = acquire("selftest-newer").await?;
    write(newer.clone(), "newer").await.map_err(|source| failed(&newer, source))?;
    writeln!(out, "guarded write with token {} (newer than {}): admitted", newer.token, older.token)?;
    let stale = write(older.clone(), "stale").await;
    let released = leases.release(&newer).await;
    match stale {
        Err(ClientError::StaleToken { .. }) => {
            writeln!(out, "stale write with token {}: refused (StaleToken), as it must be", older.token)?;
        }
        Ok(()) => return Err(Error::StaleWriteAdmitted { object: object.clone(), token: older.token.to_string() }),
        Err(source) => return Err(failed(&older, source)),
    }
    released.map_err(|source| Error::ReleaseLease { lease, holder: newer.holder.clone(), server: cluster.server.clone(), source })?;
    writeln!(out, "fencing works in namespace {namespace}")?;
    Ok(())
}
