//! `kube-fence controller`: the Lease controller with `/metrics`, `/healthz` and `/readyz`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use super::cluster::{Cluster, ClusterArgs};
use super::error::Error;

use crate::lease::controller::{self, ControllerOptions};
use crate::ready::Ready;
use crate::telemetry::{self, LogFormat};

/// Arguments of `kube-fence controller`.
#[derive(Debug, clap::Args)]
pub struct ControllerArgs {
    /// Watch Leases in this namespace only (default: all namespaces).
    #[arg(long, env = "KUBE_FENCE_NAMESPACE")]
    pub namespace: Option<String>,
    /// Where to serve /metrics, /healthz and /readyz (plain HTTP; port 0: one the kernel
    /// picks, see --ready-file).
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub metrics_addr: SocketAddr,
    /// Once the metrics port is bound, write its address to this file as `metrics=IP:PORT`
    /// (atomically: it appears complete or not at all). Removed again on exit.
    #[arg(long, value_name = "PATH")]
    pub ready_file: Option<PathBuf>,
    /// Reconcile only while leading among replicas (coordination.k8s.io/v1 Lease). For
    /// efficiency only: safety never depends on it.
    #[arg(long, alias = "leader-elect")]
    pub leader_election: bool,
    /// Namespace of the leader-election Lease (default: --namespace, else POD_NAMESPACE, else default).
    #[arg(long, alias = "leader-elect-namespace", env = "POD_NAMESPACE")]
    pub leader_election_namespace: Option<String>,
    /// Identity of this replica in Events and leader election (default: POD_NAME, else host
    /// name and process id).
    #[arg(long)]
    pub identity: Option<String>,
    /// Keep the policy path's parameters: one LeaseTokens kube-fence-tokens per namespace with
    /// leases, mapping each lease to its newest issued token, none elsewhere (see `kube-fence
    /// run --policy-path`).
    #[arg(long, env = "KUBE_FENCE_POLICY_PATH")]
    pub policy_path: bool,
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

pub async fn run(args: ControllerArgs, at: &ClusterArgs) -> Result<(), Error> {
    telemetry::init_logging(args.log_format);
    let cluster = Cluster::connect(at).await?;
    let mut options = ControllerOptions::new(args.identity.unwrap_or_else(crate::process::identity)).leader_election(args.leader_election);
    options.namespace = args.namespace;
    options.leader_election_namespace = args.leader_election_namespace;
    options.policy_params = args.policy_path;

    let stop = crate::process::shutdown_on_signal();
    let mut registry = crate::telemetry::registry();
    let controller = tokio::spawn(controller::run(cluster.client.clone(), options, &mut registry, stop.clone().cancelled_owned()));
    // Until a signal; a metrics port that cannot be bound stops the controller too, rather
    // than running blind, and is the error to report.
    let served = match telemetry::bind_metrics(args.metrics_addr).await {
        Ok(listener) => {
            let ready = match (&args.ready_file, listener.local_addr()) {
                (Some(path), Ok(bound)) => Ready { webhook: None, metrics: Some(bound) }
                    .write(path)
                    .map_err(|source| Error::WriteReadyFile { path: path.clone(), source }),
                (Some(_), Err(source)) => Err(Error::ServeMetrics { addr: args.metrics_addr, source }),
                (None, _) => Ok(()),
            };
            match ready {
                Ok(()) => telemetry::serve_metrics(listener, Arc::new(registry), stop.clone().cancelled_owned())
                    .await
                    .map_err(|source| Error::ServeMetrics { addr: args.metrics_addr, source }),
                Err(err) => Err(err),
            }
        }
        Err(source) => Err(Error::ServeMetrics { addr: args.metrics_addr, source }),
    };
    stop.cancel();
    if let Some(path) = &args.ready_file {
        let _ = std::fs::remove_file(path);
    }
    if let Err(err) = served {
        controller.abort();
        let _ = controller.await;
        return Err(err);
    }
    stopped(controller, &cluster.server).await
}

/// How long a stopping process waits for the lease controller.
const CONTROLLER_STOP: Duration = Duration::from_secs(5);

/// Waits for the (already told to stop) lease controller. It stops within moments, except
/// when stopped before its first list of Leases completed: kube-runtime's graceful shutdown
/// then waits for a store that never fills. A process that is ending must not hang on that:
/// wait a bounded time, then drop it.
pub(super) async fn stopped(mut controller: JoinHandle<Result<(), controller::Error>>, server: &str) -> Result<(), Error> {
    match tokio::time::timeout(CONTROLLER_STOP, &mut controller).await {
        Ok(Ok(result)) => result.map_err(|source| Error::RunController { server: server.to_string(), source }),
        Ok(Err(_)) => Err(Error::ControllerPanicked),
        Err(_) => {
            tracing::warn!(waited = ?CONTROLLER_STOP, "the lease controller did not stop in time; dropping it");
            controller.abort();
            let _ = controller.await;
            Ok(())
        }
    }
}
