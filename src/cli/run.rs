//! `kube-fence run`: the lease controller and the fencing webhook in one process.
//! `kube-fence run --local` serves the webhook on 127.0.0.1 with a CA made in-process and
//! registers it by URL on the cluster in `KUBECONFIG` (removed again on a clean exit / Ctrl-C).

use std::process::ExitCode;
use std::sync::Arc;

use anyhow::Context;
use futures::future::BoxFuture;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use super::webhook::{WebhookArgs, shutdown_on_signal};
use crate::admission::decision::Exemptions;
use crate::admission::local::{LocalOptions, LocalWebhook};
use crate::admission::server::Metrics;
use crate::telemetry::init_logging;

/// Arguments of `kube-fence run`.
#[derive(Clone, Debug, clap::Args)]
pub struct RunArgs {
    /// Serve the webhook on 127.0.0.1 with a self-made CA and register it by URL on the cluster
    /// in KUBECONFIG (for an API server on this machine).
    #[arg(long)]
    pub local: bool,

    /// Port on 127.0.0.1 for --local (0: any free port).
    #[arg(long, default_value_t = 9443)]
    pub local_port: u16,

    /// Name of the ValidatingWebhookConfiguration --local registers.
    #[arg(long, default_value = "kube-fence-local")]
    pub local_configuration: String,

    /// Only fence (and run the controller) in this namespace; default: all.
    #[arg(long = "watch-namespace")]
    pub watch_namespace: Option<String>,

    /// Identity of this controller replica (leader election, events).
    #[arg(long, env = "POD_NAME")]
    pub identity: Option<String>,

    /// Use leader election among controller replicas (efficiency only; safety never needs it).
    #[arg(long)]
    pub leader_election: bool,

    #[command(flatten)]
    pub webhook: WebhookArgs,
}

/// What the lease controller needs, as `run` has it.
#[derive(Clone, Debug)]
pub struct ControllerSettings {
    pub namespace: Option<String>,
    /// kube-fence's own namespace (leader election).
    pub own_namespace: String,
    pub identity: String,
    pub leader_election: bool,
}

/// The lease controller, as `run` starts it: its leader-election Lease lives in kube-fence's own
/// namespace (where the chart's Role allows it), whatever namespaces it watches.
fn lease_controller(
    client: kube::Client,
    settings: ControllerSettings,
    registry: &mut Registry,
    shutdown: CancellationToken,
) -> BoxFuture<'static, anyhow::Result<()>> {
    let mut options = crate::lease::controller::ControllerOptions::new(settings.identity).leader_election(settings.leader_election);
    options.namespace = settings.namespace;
    options.leader_election_namespace = Some(settings.own_namespace);
    let controller = crate::lease::controller::run(client, options, registry, shutdown.cancelled_owned());
    Box::pin(async move { controller.await.map_err(anyhow::Error::from) })
}

pub async fn run(args: RunArgs) -> anyhow::Result<ExitCode> {
    init_logging(args.webhook.log_format);
    if !args.local {
        args.webhook.check_tls()?;
    }
    let client = kube::Client::try_default().await.context("connecting to Kubernetes (KUBECONFIG or in-cluster)")?;
    let shutdown = shutdown_on_signal();
    let mut registry = Registry::default();
    let settings = ControllerSettings {
        namespace: args.watch_namespace.clone(),
        own_namespace: args.webhook.namespace.clone(),
        identity: args.identity.clone().unwrap_or_else(|| format!("kube-fence-{}", std::process::id())),
        leader_election: args.leader_election,
    };
    let controller = lease_controller(client.clone(), settings, &mut registry, shutdown.clone());
    run_with_controller(client, args, registry, controller, shutdown).await
}

/// Runs `controller` and the webhook side by side; either ending (or failing) stops both.
pub async fn run_with_controller(
    client: kube::Client,
    args: RunArgs,
    mut registry: Registry,
    controller: BoxFuture<'static, anyhow::Result<()>>,
    shutdown: CancellationToken,
) -> anyhow::Result<ExitCode> {
    let metrics = Metrics::register(&mut registry);
    let registry = Arc::new(registry);
    let controller = tokio::spawn(controller);

    let webhook_result = if args.local {
        let mut options = LocalOptions::new(args.local_configuration.clone());
        options.port = args.local_port;
        options.exempt = Exemptions::new(args.webhook.exempt.clone());
        options.only_namespaces = args.watch_namespace.clone().map(|ns| vec![ns]);
        let local = LocalWebhook::start(client.clone(), options, metrics, registry).await.context("starting the local webhook")?;
        eprintln!(
            "kube-fence: webhook on https://{} registered as ValidatingWebhookConfiguration {}; Ctrl-C to stop and unregister",
            local.addr, local.registration.name
        );
        shutdown.cancelled().await;
        local.stop(&client).await.context("removing the local webhook registration")
    } else {
        super::webhook::serve(client, args.webhook.clone(), metrics, registry, shutdown.clone()).await
    };
    shutdown.cancel();
    let controller_result = controller.await.context("the lease controller task panicked")?;
    webhook_result?;
    controller_result?;
    Ok(ExitCode::SUCCESS)
}
