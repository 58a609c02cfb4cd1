//! `kube-fence webhook`: the fencing webhook alone (HTTPS only). `--ready-file` says where it
//! listens once the port is bound (`--addr 127.0.0.1:0`: a port the kernel picks, no race).

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum_server::tls_rustls::RustlsConfig;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::admission::http::bounds::{self, Bounds};
use crate::admission::http::server::Metrics;
use crate::admission::http::tls::{CertFiles, ClientAuth, SelfManaged};
use crate::admission::judge::exemptions::{DEFAULT_EXEMPT, Exemptions};
use crate::admission::judge::identity::IdentityRule;
use crate::admission::judge::preamble::Mode;
use crate::admission::registration::CONFIGURATION_NAME;
use crate::admission::registration::scope::{DEFAULT_TIMEOUT_SECONDS, MAX_TIMEOUT_SECONDS, Scope};
use crate::admission::start::{self, Port, WebhookConfig};
use crate::ready::Ready;
use crate::telemetry::{LogFormat, init_logging};

use super::cluster::{Cluster, ClusterArgs};
use super::error::{Error, Object};

/// The command line of `kube-fence webhook`: the webhook's arguments, and its ready file.
#[derive(Clone, Debug, clap::Args)]
pub struct WebhookCommand {
    #[command(flatten)]
    pub webhook: WebhookArgs,

    /// Once the webhook port is bound, write its address to this file as `webhook=IP:PORT`
    /// (atomically: it appears complete or not at all; with --addr 127.0.0.1:0 the port the
    /// kernel picked). Removed again on exit. /readyz on that port says when the lease cache
    /// is synced.
    #[arg(long, value_name = "PATH")]
    pub ready_file: Option<PathBuf>,
}

/// `--holder-fences`: whether the holder fences deny or only warn.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
#[value(rename_all = "PascalCase")]
pub enum HolderFences {
    Enforce,
    Audit,
}

/// Arguments of `kube-fence webhook` (also used by `kube-fence run`).
// These doc comments are `--help` text, where `<NAME>` is a placeholder, not an HTML tag.
#[allow(rustdoc::invalid_html_tags)]
#[derive(Clone, Debug, clap::Args)]
pub struct WebhookArgs {
    /// Address the HTTPS server listens on (port 0: one the kernel picks; see --ready-file).
    #[arg(long, default_value = "0.0.0.0:8443", env = "KUBE_FENCE_WEBHOOK_ADDR")]
    pub addr: SocketAddr,

    /// Also serve /metrics, /healthz and /readyz over plain HTTP on this address (port 0: one
    /// the kernel picks; see --ready-file), for a Prometheus that presents no client certificate
    /// (the chart's ServiceMonitor scrapes it, also with --client-ca-file). /readyz says what the
    /// webhook port's says: ready once the lease cache has synced. Metrics carry no secrets;
    /// reviews are served on --addr alone. Not with `run --local`.
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<SocketAddr>,

    /// PEM certificate chain to serve (re-read when it changes: cert-manager, a mounted Secret).
    #[arg(long, requires = "tls_key_file", conflicts_with = "self_managed_tls")]
    pub tls_cert_file: Option<std::path::PathBuf>,

    /// PEM private key of --tls-cert-file.
    #[arg(long, requires = "tls_cert_file")]
    pub tls_key_file: Option<std::path::PathBuf>,

    /// How often the certificate files are checked for change.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub tls_reload_interval: Duration,

    /// Make and keep the CA and serving certificate in a Secret shared by all replicas, and keep
    /// the webhook configuration's caBundle in step with it.
    #[arg(long)]
    pub self_managed_tls: bool,

    /// How long a self-managed serving certificate lasts (the CA lasts ten years); it is
    /// reissued under the same CA when a third of this is left.
    #[arg(long, default_value = "90days", value_parser = parse_lifetime)]
    pub self_managed_tls_lifetime: Duration,

    /// Namespace kube-fence runs in (holds the self-managed TLS Secret).
    #[arg(long, env = "POD_NAMESPACE", default_value = "kube-fence")]
    pub namespace: String,

    /// The webhook Service (its DNS names go into the self-managed serving certificate).
    #[arg(long, default_value = "kube-fence-webhook")]
    pub service_name: String,

    /// Secret holding the self-managed CA and serving certificate.
    #[arg(long, default_value = "kube-fence-webhook-tls")]
    pub tls_secret: String,

    /// kube-fence's ValidatingWebhookConfiguration (the chart's): self-managed TLS keeps its
    /// caBundle correct, and the writer webhooks, kept in step in <NAME>-writers, call kube-fence
    /// as its first webhook does.
    #[arg(long, value_name = "NAME", default_value = CONFIGURATION_NAME)]
    pub webhook_configuration: String,

    /// Seconds the API server waits for a verdict of the writer webhooks kube-fence keeps in step
    /// (with `run --local`, of its own configuration too) before it fails the write closed; 1 to
    /// 30, as Kubernetes allows. The chart passes webhook.timeoutSeconds, the timeout of the
    /// configuration it renders.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = DEFAULT_TIMEOUT_SECONDS,
        value_parser = clap::value_parser!(i32).range(1..=i64::from(MAX_TIMEOUT_SECONDS)),
    )]
    pub webhook_timeout_seconds: i32,

    /// Fence only this namespace (repeat the flag; default: every namespace not excluded): the
    /// writer webhooks are kept in step only for opted-in Leases of these namespaces (with `run
    /// --local`, its own configuration fences only them too). The chart passes
    /// webhook.onlyNamespaces, the namespaces of the configuration it renders.
    #[arg(long = "only-namespace", value_name = "NS")]
    pub only_namespaces: Vec<String>,

    /// Accept connections only from clients presenting a certificate signed by a CA in this PEM
    /// file: configure the API server to present one to webhooks (an AdmissionConfiguration
    /// kubeconfig, docs/operations/webhook-port.md), and nobody else can reach the webhook.
    #[arg(long, value_name = "PEM")]
    pub client_ca_file: Option<std::path::PathBuf>,

    /// Users that may write guarded objects without a token (repeat the flag; replaces the
    /// defaults: the garbage collector and the namespace controller).
    #[arg(long = "exempt", value_name = "USER", default_values_t = DEFAULT_EXEMPT.map(String::from))]
    pub exempt: Vec<String>,

    /// Users that may add or remove the kubefence.io/leader-lease label of an object (opting
    /// existing objects in, as Helm or an operator would), besides the Lease's holder Pod; every
    /// other write of a leader-bound object stays the holder's (repeat the flag; chart value
    /// leaseAdmins, which the holder policy exempts too).
    #[arg(long = "lease-admin", value_name = "USER")]
    pub lease_admins: Vec<String>,

    /// How the holderIdentity of a client-go leader-election Lease names a Pod (objects labelled
    /// kubefence.io/leader-lease are written only by the holder's Pod): the Pod's name, or the
    /// Pod's name, SEP and anything (client-go's usual <hostname>_<uuid>). `none`: the Pod's name
    /// exactly. SEP must not start with a character Pod names contain (a-z, 0-9, '-', '.'): with
    /// '-', Pod p1 would match Pod p1-x's identities. The holder policy (chart value
    /// leaderIdentity.separator; registered by `run --local`) must use the same rule.
    #[arg(long = "leader-identity-separator", value_name = "SEP", default_value = IdentityRule::DEFAULT_SEPARATOR)]
    pub leader_identity: IdentityRule,

    /// Connections the webhook port keeps open at once, all clients together; a connection
    /// beyond it is closed as soon as it is accepted. Each idle one costs some 20-40 KiB.
    #[arg(long, value_name = "N", default_value_t = bounds::MAX_CONNECTIONS as u32, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections: u32,

    /// Connections open at once from one source address (the API server needs one per review
    /// in flight).
    #[arg(long, value_name = "N", default_value_t = bounds::MAX_CONNECTIONS_PER_SOURCE as u32, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_connections_per_source: u32,

    /// Failed connections per second and source address (bursts of 16 times that): a TLS
    /// handshake that fails, or bytes that are not an HTTP/1.1 request (HTTP/2, garbage). Beyond
    /// it the source's new connections are closed as soon as they are accepted, before a
    /// handshake is spent on them, until its budget refills. The API server's connections carry
    /// requests and never count. 0: no budget.
    #[arg(long, value_name = "N", default_value_t = bounds::FAILED_CONNECTIONS_PER_SECOND)]
    pub failed_connections_per_source: u32,

    /// Quorum reads of leases one source address may start a second for the leases of one
    /// namespace (bursts of twice that), and ten times that in all. A read shared by concurrent
    /// reviews of one lease is charged once. Beyond it a review is denied with 429
    /// ReadsThrottled (the API server asks the writer to retry in a second) and costs the API
    /// server nothing. Every genuine review comes from the API server's address, so the budget
    /// is per namespace: a tenant or one busy controller uses up its own namespace's, never
    /// another's. 0: no budget. No budget applies with --client-ca-file: every caller is then the
    /// API server.
    #[arg(long, alias = "quorum-reads-per-source", value_name = "N", default_value_t = bounds::QUORUM_READS_PER_NAMESPACE)]
    pub quorum_reads_per_namespace: u32,

    /// How the holder fences act on a write by a Pod that does not hold the Lease (objects
    /// labelled kubefence.io/leader-lease, and every write of opted-in writers). Enforce: denied
    /// (409 NotHolder). Audit: admitted, with a warning to the writer saying what Enforce would
    /// have said, and counted in kube_fence_webhook_decisions_total{verdict="warned"} — to try a fence
    /// on a running controller before enforcing it. Token-guarded objects follow their lease's
    /// own spec.fencing.enforcement.
    #[arg(long, value_enum, default_value_t = HolderFences::Enforce)]
    pub holder_fences: HolderFences,

    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

impl WebhookArgs {
    /// What one client of the port can cost.
    pub fn bounds(&self) -> Bounds {
        let authenticated = self.client_ca_file.is_some();
        Bounds {
            max_connections: self.max_connections as usize,
            max_connections_per_source: self.max_connections_per_source as usize,
            failed_connections_per_source: Some(self.failed_connections_per_source).filter(|n| *n > 0),
            quorum_reads_per_namespace: Some(self.quorum_reads_per_namespace).filter(|n| *n > 0 && !authenticated),
            keep_alive_idle: bounds::KEEP_ALIVE_IDLE,
            idle_without_review: bounds::IDLE_WITHOUT_REVIEW,
            // Set from the registration's timeout when serving (`admission::start`).
            quorum_read_timeout: bounds::QUORUM_READ_TIMEOUT,
        }
    }

    /// The webhook's configuration: what it judges, what one client may cost, and the scope of
    /// what it registers (the writer webhooks of --webhook-configuration, with
    /// --webhook-timeout-seconds and --only-namespace).
    pub fn config(&self) -> WebhookConfig {
        WebhookConfig {
            exempt: Exemptions::new(self.exempt.clone()).with_label_admins(self.lease_admins.clone()),
            leader_identity: self.leader_identity.clone(),
            bounds: self.bounds(),
            holder_fences: match self.holder_fences {
                HolderFences::Enforce => Mode::Enforce,
                HolderFences::Audit => Mode::Audit,
            },
            scope: Scope {
                configuration_name: self.webhook_configuration.clone(),
                timeout_seconds: self.webhook_timeout_seconds,
                only_namespaces: (!self.only_namespaces.is_empty()).then(|| self.only_namespaces.clone()),
            },
        }
    }

    /// HTTPS only: some source of certificates must be given.
    pub fn check_tls(&self) -> Result<(), Error> {
        if self.tls_cert_file.is_none() && !self.self_managed_tls {
            return Err(Error::ChooseTls);
        }
        Ok(())
    }
}

pub async fn run(command: WebhookCommand, at: &ClusterArgs) -> Result<(), Error> {
    let WebhookCommand { webhook: args, ready_file } = command;
    init_logging(args.log_format);
    args.check_tls()?;
    let cluster = Cluster::connect(at).await?;
    let mut registry = crate::telemetry::registry();
    let metrics = Metrics::register(&mut registry);
    let shutdown = crate::process::shutdown_on_signal();
    serve(&cluster, args, metrics, Arc::new(registry), shutdown, ready_file.as_deref()).await
}

/// Serves the webhook as `args` say until `shutdown` is cancelled; once its port is bound, says
/// where in `ready_file` (removed again when it stops).
pub async fn serve(
    cluster: &Cluster,
    args: WebhookArgs,
    metrics: Metrics,
    registry: Arc<Registry>,
    shutdown: CancellationToken,
    ready_file: Option<&Path>,
) -> Result<(), Error> {
    let client = cluster.client.clone();
    let client_auth = match &args.client_ca_file {
        Some(path) => ClientAuth::require_file(path).map_err(|source| Error::LoadTls { source })?,
        None => ClientAuth::none(),
    };
    let tls = match (&args.tls_cert_file, &args.tls_key_file) {
        (Some(cert), Some(key)) => {
            let files = CertFiles { cert: cert.clone(), key: key.clone(), client_auth: client_auth.clone() };
            let (tls, loaded) = files.load().await.map_err(|source| Error::LoadTls { source })?;
            let watcher = files.watch(tls.clone(), loaded, args.tls_reload_interval, metrics.tls_reloads.clone());
            spawn_until(watcher, shutdown.clone());
            tls
        }
        _ if args.self_managed_tls => {
            let managed = SelfManaged {
                namespace: args.namespace.clone(),
                secret: args.tls_secret.clone(),
                dns_names: vec![
                    format!("{}.{}.svc", args.service_name, args.namespace),
                    format!("{}.{}.svc.cluster.local", args.service_name, args.namespace),
                ],
                webhook_configuration: args.webhook_configuration.clone(),
                client_auth: client_auth.clone(),
                serving_lifetime: args.self_managed_tls_lifetime,
            };
            let failed = |source| Error::ManageTls {
                secret: Object::namespaced("Secret", &args.namespace, &args.tls_secret),
                server: cluster.server.clone(),
                source,
            };
            let pair = managed.rotate_if_due(&client).await.map_err(failed)?;
            let tls = RustlsConfig::from_config(pair.server_config_for(&client_auth).map_err(failed)?);
            let interval = managed.maintain_interval();
            spawn_until(managed.maintain(client.clone(), tls.clone(), pair, interval, metrics.tls_reloads.clone()), shutdown.clone());
            tls
        }
        _ => return Err(Error::ChooseTls),
    };
    let listener = std::net::TcpListener::bind(args.addr).map_err(|source| Error::Listen { addr: args.addr, source })?;
    let bound = listener.local_addr().map_err(|source| Error::Listen { addr: args.addr, source })?;
    let metrics_port = match args.metrics_addr {
        Some(addr) => {
            let failed = |source| Error::ServeMetrics { addr, source };
            let listener = std::net::TcpListener::bind(addr).map_err(failed)?;
            listener.set_nonblocking(true).map_err(failed)?;
            let bound = listener.local_addr().map_err(failed)?;
            Some((tokio::net::TcpListener::from_std(listener).map_err(failed)?, bound))
        }
        None => None,
    };
    // Said at once, before anything runs that could still log after a failure here.
    if let Some(path) = ready_file {
        let ready = Ready { webhook: Some(bound), metrics: metrics_port.as_ref().map(|(_, bound)| *bound) };
        ready.write(path).map_err(|source| Error::WriteReadyFile { path: path.to_path_buf(), source })?;
    }
    let config = args.config();
    tracing::info!(
        addr = %bound,
        exempt = ?args.exempt,
        leader_identity_separator = %args.leader_identity,
        configuration = %config.scope.configuration_name,
        timeout_seconds = config.scope.timeout_seconds,
        only_namespaces = ?config.scope.only_namespaces,
        "fencing webhook serving"
    );
    let port = Port { listener, tls, metrics, registry: registry.clone() };
    // The chart registered kube-fence's own configuration: nothing to register before the writer
    // routing starts.
    let nothing = |_| std::future::ready(Ok::<(), std::convert::Infallible>(()));
    let Ok((running, ())) = start::start(client, &config, port, shutdown.clone(), nothing).await;
    if let Some((listener, addr)) = metrics_port {
        // The same readiness as the webhook port's (`server::router`).
        let leases = running.leases.clone();
        let ready = move || if leases.is_ready() { Ok(()) } else { Err("lease cache not synced yet") };
        let router = crate::telemetry::router(registry, ready);
        tokio::spawn(async move {
            let served = axum::serve(listener, router).with_graceful_shutdown(shutdown.cancelled_owned()).await;
            if let Err(err) = served {
                tracing::error!(%addr, err = %crate::telemetry::Chain(&err), "the metrics port stopped serving");
            }
        });
        tracing::info!(%addr, "metrics, health and readiness served over plain HTTP");
    }
    let served = running.served().await.map_err(|source| Error::ServeWebhook { source });
    if let Some(path) = ready_file {
        let _ = std::fs::remove_file(path);
    }
    served
}

/// Runs `task` until it ends or `shutdown` is cancelled.
pub(crate) fn spawn_until(task: impl std::future::Future<Output = ()> + Send + 'static, shutdown: CancellationToken) {
    tokio::spawn(async move {
        tokio::select! {
            _ = task => {}
            _ = shutdown.cancelled() => {}
        }
    });
}

/// A serving certificate's lifetime: at least 6 s (the shortest a test forces), at most ten
/// years (the CA's).
fn parse_lifetime(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("not a duration ({e}); write e.g. 90days or 720h"))?;
    if d < Duration::from_secs(6) || d > Duration::from_secs(10 * 365 * 24 * 3600) {
        return Err("a certificate lifetime is from 6s to ten years".to_string());
    }
    Ok(d)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::cli::{Cli, Command};

    fn webhook(args: &[&str]) -> Result<super::WebhookArgs, clap::Error> {
        let cli = Cli::try_parse_from(["kube-fence", "webhook", "--self-managed-tls"].iter().chain(args))?;
        match cli.command {
            Command::Webhook(command) => Ok(command.webhook),
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn the_scope_flags_reach_the_configuration() {
        let args = webhook(&["--webhook-configuration=kf", "--webhook-timeout-seconds=9", "--only-namespace=a", "--only-namespace", "b"])
            .unwrap_or_else(|e| panic!("{e}"));
        let scope = args.config().scope;
        assert_eq!(scope.configuration_name, "kf");
        assert_eq!(scope.timeout_seconds, 9);
        assert_eq!(scope.only_namespaces, Some(vec!["a".to_string(), "b".to_string()]));
        // Without them: the default configuration and timeout, every namespace.
        let scope = webhook(&[]).unwrap_or_else(|e| panic!("{e}")).config().scope;
        assert_eq!(scope, crate::admission::registration::scope::Scope::new(crate::admission::registration::CONFIGURATION_NAME));
    }

    #[test]
    fn the_holder_fences_enforce_unless_audit_is_asked_for() {
        use crate::admission::judge::preamble::Mode;
        assert_eq!(webhook(&[]).unwrap_or_else(|e| panic!("{e}")).config().judging().holder_fences, Mode::Enforce);
        let audited = webhook(&["--holder-fences", "Audit"]).unwrap_or_else(|e| panic!("{e}")).config();
        assert_eq!(audited.judging().holder_fences, Mode::Audit);
        let refused = webhook(&["--holder-fences", "Warn"]).map(|_| ()).expect_err("not a mode");
        assert!(refused.to_string().contains("possible values: Enforce, Audit"), "{refused}");
    }

    #[test]
    fn the_timeout_is_one_kubernetes_accepts() {
        for ok in ["1", "30"] {
            assert!(webhook(&["--webhook-timeout-seconds", ok]).is_ok(), "{ok}");
        }
        for bad in ["0", "31", "-1", "5s"] {
            assert!(webhook(&["--webhook-timeout-seconds", bad]).is_err(), "{bad}");
        }
    }
}
