//! `kube-fence run`: the lease controller (with the FencedController status beside it) and the
//! fencing webhook in one process.
//! `kube-fence run --local` serves the webhook on 127.0.0.1 (a free port unless `--local-port`
//! names one) with a CA made in-process and registers it by URL on the cluster in `KUBECONFIG`
//! (removed again on a clean exit / Ctrl-C). `--ready-file` tells a script when it is ready.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use super::cluster::{Cluster, ClusterArgs};
use super::error::{Error, Object};
use super::webhook::WebhookArgs;
use crate::admission::http::server::Metrics;
use crate::admission::local::{LocalOptions, LocalWebhook};
use crate::admission::start::WebhookConfig;
use crate::fenced::controller::StatusOptions;
use crate::lease::controller::ControllerOptions;
use crate::telemetry::init_logging;

/// Arguments of `kube-fence run`.
#[derive(Clone, Debug, clap::Args)]
pub struct RunArgs {
    /// Serve the webhook on 127.0.0.1 with a self-made CA and register it by URL on the cluster
    /// in KUBECONFIG (for an API server on this machine).
    #[arg(long)]
    pub local: bool,

    /// Port on 127.0.0.1 for --local (default: a free port; the address is logged and written
    /// to --ready-file).
    #[arg(long, requires = "local")]
    pub local_port: Option<u16>,

    /// Name of the ValidatingWebhookConfiguration --local registers (give each kube-fence on
    /// one cluster its own).
    #[arg(long, default_value = "kube-fence-local")]
    pub local_configuration: String,

    /// With --local: once the webhook serves and is registered and the controller runs, write
    /// the webhook's URL to this file. Without: once the ports are bound, write where they are, as
    /// `kube-fence webhook --ready-file` does (`webhook=IP:PORT`, `metrics=IP:PORT` with
    /// --metrics-addr). Atomically (it appears complete or not at all); removed again on exit.
    #[arg(long, value_name = "PATH")]
    pub ready_file: Option<PathBuf>,

    /// Only fence (and run the controller) in this namespace; default: all.
    #[arg(long = "watch-namespace")]
    pub watch_namespace: Option<String>,

    /// Identity of this controller replica in leader election and Events (default: POD_NAME,
    /// else host name and process id).
    #[arg(long)]
    pub identity: Option<String>,

    /// Use leader election among controller replicas (efficiency only; safety never needs it).
    #[arg(long, alias = "leader-elect")]
    pub leader_election: bool,

    /// The policy path: the API server judges UPDATEs of guarded objects that present a fresh
    /// token itself (a ValidatingAdmissionPolicy, no webhook call) and the webhook skips them.
    /// The controller keeps its parameters (one LeaseTokens kube-fence-tokens per namespace with
    /// leases); with --local the policy and the webhook's skip condition are registered too (on
    /// a cluster the chart's `policyPath.enabled` renders them), and without it a policy left by
    /// an earlier --local run with it is removed.
    #[arg(long, env = "KUBE_FENCE_POLICY_PATH")]
    pub policy_path: bool,

    #[command(flatten)]
    pub webhook: WebhookArgs,
}

impl RunArgs {
    /// The webhook's configuration in local mode: the in-cluster one (`WebhookArgs::config`)
    /// registered as --local-configuration, fencing --watch-namespace when no --only-namespace
    /// is given (where the controller runs).
    pub fn local_config(&self) -> WebhookConfig {
        let mut config = self.webhook.config();
        config.scope.configuration_name = self.local_configuration.clone();
        if config.scope.only_namespaces.is_none() {
            config.scope.only_namespaces = self.watch_namespace.clone().map(|ns| vec![ns]);
        }
        config
    }
}

pub async fn run(args: RunArgs, at: &ClusterArgs) -> Result<(), Error> {
    init_logging(args.webhook.log_format);
    if args.local && args.webhook.metrics_addr.is_some() {
        return Err(Error::ParseArguments(
            "--metrics-addr is not served with --local: the local webhook serves /metrics on its own port (see --help)".into(),
        ));
    }
    if !args.local {
        args.webhook.check_tls()?;
    }
    let cluster = Cluster::connect(at).await?;
    let shutdown = crate::process::shutdown_on_signal();
    let mut registry = crate::telemetry::registry();
    // The leader-election Lease lives in kube-fence's own namespace (where the chart's Role
    // allows it), whatever namespaces the controller watches.
    let mut options =
        ControllerOptions::new(args.identity.clone().unwrap_or_else(crate::process::identity)).leader_election(args.leader_election);
    options.namespace = args.watch_namespace.clone();
    options.leader_election_namespace = Some(args.webhook.namespace.clone());
    options.policy_params = args.policy_path;
    // The FencedController status runs with the lease controller (while it leads), judging the
    // routing of the writers configuration that goes with the webhook's own.
    let webhook = if args.local { args.local_config() } else { args.webhook.config() };
    let status = StatusOptions {
        namespace: args.watch_namespace.clone(),
        configuration: webhook.scope.configuration_name.clone(),
        identity: webhook.leader_identity.clone(),
        instance: options.identity.clone(),
    };
    let status_metrics = crate::fenced::controller::Metrics::register(&mut registry);
    options.beside = Some(crate::fenced::controller::beside(cluster.client.clone(), status, status_metrics));
    let controller = crate::lease::controller::run(cluster.client.clone(), options, &mut registry, shutdown.clone().cancelled_owned());
    let metrics = Metrics::register(&mut registry);
    let registry = Arc::new(registry);
    let controller = tokio::spawn(controller);

    let webhook = if args.local {
        local(&cluster, &args, metrics, registry, &shutdown, &controller).await
    } else {
        super::webhook::serve(&cluster, args.webhook.clone(), metrics, registry, shutdown.clone(), args.ready_file.as_deref()).await
    };
    shutdown.cancel();
    if webhook.is_err() {
        // The webhook could not start (or stopped): its error is the one to report, now.
        controller.abort();
        // Dropped before the error is printed, so it logs nothing after it.
        let _ = controller.await;
        return webhook;
    }
    super::controller::stopped(controller, &cluster.server).await
}

/// Every metric kube-fence registers, with no samples yet, in the text exposition format: the
/// build and process metrics, the FencedController status's, the lease controller's and the
/// webhook's — what `run` serves (`controller` and `webhook` serve a part of it). The metrics
/// reference (docs/reference/metrics.md) is generated from it (tests/reference.rs).
pub fn every_metric() -> String {
    let mut registry = crate::telemetry::registry();
    crate::fenced::controller::Metrics::register(&mut registry);
    crate::lease::controller::Metrics::register(&mut registry);
    let webhook = Metrics::register(&mut registry);
    // The families whose label values are made on first use, used once, so that they are listed
    // (with their label names) like the others.
    let fenced = kube_fence_api::denial::Reason::Fenced;
    webhook.decided(&crate::admission::judge::verdict::Verdict::Allow { reason: fenced }, 0.0);
    webhook.refused(crate::admission::metrics::Refusal::TooLarge);
    crate::telemetry::render(&registry)
}

/// `run --local`: serve and register, say so (log line and ready file), run until shutdown,
/// then unregister.
async fn local(
    cluster: &Cluster,
    args: &RunArgs,
    metrics: Metrics,
    registry: Arc<Registry>,
    shutdown: &CancellationToken,
    controller: &tokio::task::JoinHandle<Result<(), crate::lease::controller::Error>>,
) -> Result<(), Error> {
    let mut options = LocalOptions::new(args.local_configuration.clone());
    options.port = args.local_port.unwrap_or(0);
    options.webhook = args.local_config();
    options.policy_path = args.policy_path;
    let local = LocalWebhook::start(cluster.client.clone(), options, metrics, registry)
        .await
        .map_err(|source| Error::StartLocalWebhook { server: cluster.server.clone(), source })?;
    let ready = if controller.is_finished() {
        // The controller stopped before we got here; its error is reported by the caller.
        shutdown.cancel();
        Ok(())
    } else {
        eprintln!(
            "kube-fence: webhook on https://{} registered as ValidatingWebhookConfiguration {}; Ctrl-C to stop and unregister",
            local.addr, local.registration.name
        );
        match &args.ready_file {
            Some(path) => write_ready_file(path, &format!("https://{}\n", local.addr)),
            None => Ok(()),
        }
    };
    if ready.is_ok() {
        shutdown.cancelled().await;
    }
    if let Some(path) = &args.ready_file {
        let _ = std::fs::remove_file(path);
    }
    let configuration = Object::cluster_scoped("ValidatingWebhookConfiguration", &local.registration.name);
    let removed = local.stop(&cluster.client).await.map_err(|source| Error::UnregisterLocalWebhook {
        configuration,
        server: cluster.server.clone(),
        source,
    });
    ready.and(removed)
}

/// Writes `contents` to the ready file `path` (atomically: [`crate::ready::write_atomically`]).
fn write_ready_file(path: &Path, contents: &str) -> Result<(), Error> {
    crate::ready::write_atomically(path, contents).map_err(|source| Error::WriteReadyFile { path: path.to_path_buf(), source })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn local_config(args: &[&str]) -> WebhookConfig {
        use clap::Parser;
        let cli = crate::cli::Cli::try_parse_from(["kube-fence", "run", "--local"].iter().chain(args)).unwrap_or_else(|e| panic!("{e}"));
        match cli.command {
            crate::cli::Command::Run(run) => run.local_config(),
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn local_mode_registers_its_own_configuration_with_the_webhook_flags() {
        let config = local_config(&["--local-configuration=mine", "--webhook-timeout-seconds=7", "--only-namespace=a"]);
        assert_eq!((config.scope.configuration_name.as_str(), config.scope.timeout_seconds), ("mine", 7));
        assert_eq!(config.scope.only_namespaces, Some(vec!["a".to_string()]));
        // --watch-namespace fences where the controller runs, unless --only-namespace says otherwise.
        assert_eq!(local_config(&["--watch-namespace=w"]).scope.only_namespaces, Some(vec!["w".to_string()]));
        assert_eq!(local_config(&["--watch-namespace=w", "--only-namespace=a"]).scope.only_namespaces, Some(vec!["a".to_string()]));
        assert_eq!(local_config(&[]).scope.only_namespaces, None);
    }

    #[test]
    fn the_ready_file_appears_whole_and_leaves_no_temporary_behind() {
        let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("tempdir: {e}"));
        let path = dir.path().join("ready");
        write_ready_file(&path, "https://127.0.0.1:1234\n").unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(std::fs::read_to_string(&path).ok().as_deref(), Some("https://127.0.0.1:1234\n"));
        let names: Vec<_> = std::fs::read_dir(dir.path()).into_iter().flatten().flatten().map(|e| e.file_name()).collect();
        assert_eq!(names, vec![std::ffi::OsString::from("ready")]);

        let err = write_ready_file(&dir.path().join("no-such-dir/ready"), "x").err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.starts_with("cannot write the ready file") && err.contains("no such file or directory"), "{err}");
    }
}
