//! `kube-fence controller`: the Lease controller with `/metrics`, `/healthz` and `/readyz`.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context as _;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::lease::controller::{self, ControllerOptions};
use crate::telemetry::{self, LogFormat};

/// Arguments of `kube-fence controller`.
#[derive(Debug, clap::Args)]
pub struct ControllerArgs {
    /// Watch Leases in this namespace only (default: all namespaces).
    #[arg(long, env = "KUBE_FENCE_NAMESPACE")]
    pub namespace: Option<String>,
    /// Where to serve /metrics, /healthz and /readyz (plain HTTP).
    #[arg(long, default_value = "0.0.0.0:8080")]
    pub metrics_addr: SocketAddr,
    /// Reconcile only while leading among replicas (coordination.k8s.io/v1 Lease). For
    /// efficiency only: safety never depends on it.
    #[arg(long)]
    pub leader_elect: bool,
    /// Namespace of the leader-election Lease (default: --namespace, else POD_NAMESPACE, else default).
    #[arg(long, env = "POD_NAMESPACE")]
    pub leader_elect_namespace: Option<String>,
    /// Identity of this replica in Events and leader election (default: POD_NAME, else the host name).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// Resolves when SIGINT or SIGTERM arrives.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(term) => term,
            Err(_) => return std::future::pending().await,
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// This replica's identity when none is given: the host name (a pod's name), else the pid.
pub fn default_identity() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok().map(|s| s.trim().to_string()))
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| format!("kube-fence-{}", std::process::id()))
}

pub async fn run(args: ControllerArgs) -> anyhow::Result<ExitCode> {
    telemetry::init_logging(args.log_format);
    let client = kube::Client::try_default().await.context("connecting to the cluster")?;
    let mut options = ControllerOptions::new(args.identity.unwrap_or_else(default_identity)).leader_election(args.leader_elect);
    options.namespace = args.namespace;
    options.leader_election_namespace = args.leader_elect_namespace;

    let stop = CancellationToken::new();
    let trigger = stop.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        tracing::info!("shutting down");
        trigger.cancel();
    });
    let mut registry = Registry::default();
    let controller = controller::run(client, options, &mut registry, stop.clone().cancelled_owned());
    let serving = telemetry::serve_metrics(args.metrics_addr, Arc::new(registry), stop.clone().cancelled_owned());
    // A metrics port that cannot be bound stops the controller too, rather than running blind.
    let metrics = async {
        let served = serving.await;
        stop.cancel();
        served
    };
    let (controller, metrics) = tokio::join!(controller, metrics);
    controller?;
    metrics.with_context(|| format!("serving metrics on {}", args.metrics_addr))?;
    Ok(ExitCode::SUCCESS)
}
