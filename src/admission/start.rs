//! Startup: the webhook as one process runs it, in a cluster (`kube-fence webhook`, `kube-fence
//! run`) and in local mode (`super::local`) alike. One configuration ([`WebhookConfig`]) says
//! what is judged, what one client of the port may cost, and the scope of what is registered;
//! one function ([`start`]) runs the lease cache, serves, and keeps the writer webhooks in step
//! with that scope. What only one of them does stays with it: local mode makes its CA and
//! registers its own configuration by URL (between serving and routing, [`start`]'s `register`);
//! the in-cluster binary loads or manages its certificate and says where it listens.

use std::future::Future;
use std::net::TcpListener;
use std::sync::Arc;
use std::time::Duration;

use axum_server::tls_rustls::RustlsConfig;
use prometheus_client::registry::Registry;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::admission::http::bounds::Bounds;
use crate::admission::http::server::{self, Serving};
use crate::admission::judge::exemptions::Exemptions;
use crate::admission::judge::identity::IdentityRule;
use crate::admission::judge::pipeline::Judging;
use crate::admission::judge::preamble::Mode;
use crate::admission::metrics::Metrics;
use crate::admission::reads::directory::LeaseDirectory;
use crate::admission::registration::routing;
use crate::admission::registration::scope::Scope;

/// What a webhook process judges, what one client of its port may cost, and the scope of the
/// webhooks it registers. Built from the command line (`kube-fence webhook`'s flags, which the
/// chart sets from its values) or by local mode's caller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WebhookConfig {
    /// Who may write guarded objects without a token, and who may opt objects into a leader
    /// Lease besides its holder.
    pub exempt: Exemptions,
    /// How a leader-election Lease's holder names a Pod: the webhook judges guarded writes and
    /// the holder policy judges claims by this one rule.
    pub leader_identity: IdentityRule,
    /// What one client of the port can cost (connections, quorum reads).
    pub bounds: Bounds,
    /// Whether the holder fences (leader-bound objects, opted-in writers) deny or only warn.
    pub holder_fences: Mode,
    /// The configuration the webhooks are registered under, their timeout, and the namespaces
    /// fenced: the writer webhooks [`start`] keeps in step carry them, and so does the
    /// configuration local mode registers.
    pub scope: Scope,
}

impl WebhookConfig {
    /// The defaults, registered under `configuration_name`.
    pub fn new(configuration_name: impl Into<String>) -> WebhookConfig {
        WebhookConfig {
            exempt: Exemptions::default(),
            leader_identity: IdentityRule::default(),
            bounds: Bounds::default(),
            holder_fences: Mode::Enforce,
            scope: Scope::new(configuration_name),
        }
    }

    /// How reviews are judged.
    pub fn judging(&self) -> Judging {
        Judging { exempt: self.exempt.clone(), identity: self.leader_identity.clone(), holder_fences: self.holder_fences }
    }
}

/// Where the webhook is served and with which certificate, and the metrics it counts into (the
/// registry `/metrics` renders).
pub struct Port {
    pub listener: TcpListener,
    pub tls: RustlsConfig,
    pub metrics: Metrics,
    pub registry: Arc<Registry>,
}

/// A started webhook: its lease cache, its server and its writer routing, each a task.
pub struct Running {
    /// The lease reads of the webhook (its cache synced or not).
    pub leases: LeaseDirectory,
    stop: CancellationToken,
    server: Option<JoinHandle<std::io::Result<()>>>,
    cache: JoinHandle<()>,
    /// Taken once stopped: a task's handle is awaited once.
    routing: Option<JoinHandle<()>>,
}

/// Starts the webhook `config` describes on `port`: runs the lease cache, serves until `stop` is
/// cancelled, then calls `register` with the lease reads and, once it succeeded, keeps the writer
/// webhooks of `config.scope` in step (`routing::keep_in_step`, with the scope's timeout and
/// namespaces). `register` is what the caller registers before the routing starts: the routing
/// copies the client configuration of the scope's own webhook configuration, so that must exist
/// by then (local mode registers it; in a cluster the chart did). If `register` fails, the
/// webhook stops again and its error is returned.
pub async fn start<T, E, F>(
    client: kube::Client,
    config: &WebhookConfig,
    port: Port,
    stop: CancellationToken,
    register: impl FnOnce(LeaseDirectory) -> F,
) -> Result<(Running, T), E>
where
    F: Future<Output = Result<T, E>>,
{
    let Port { listener, tls, metrics, registry } = port;
    let (leases, cache) = LeaseDirectory::new(client.clone());
    let cache = tokio::spawn(cache);
    // A quorum read is given as long as the API server gives the review it serves.
    let read_timeout = Duration::from_secs(u64::try_from(config.scope.timeout_seconds).unwrap_or(1).max(1));
    let serving =
        Serving { judging: config.judging(), bounds: Bounds { quorum_read_timeout: read_timeout, ..config.bounds }, listener, tls };
    let server = tokio::spawn(server::run(leases.clone(), serving, metrics, registry, stop.clone().cancelled_owned()));
    let registered = match register(leases.clone()).await {
        Ok(registered) => registered,
        Err(err) => {
            stop.cancel();
            cache.abort();
            return Err(err);
        }
    };
    // The writer webhooks (ServiceAccounts opted in on their leader-election Lease) call this
    // server too, at their own paths; every replica keeps their configuration in step, with the
    // same content.
    let routing = tokio::spawn(routing::keep_in_step(client, config.scope.clone(), stop.clone().cancelled_owned()));
    Ok((Running { leases, stop, server: Some(server), cache, routing: Some(routing) }, registered))
}

impl Running {
    /// Stops serving (cancels `stop`) and waits until the server has, but leaves the routing and
    /// the lease cache running.
    pub async fn stop_serving(&mut self) {
        self.stop.cancel();
        if let Some(server) = self.server.take() {
            let _ = server.await;
        }
    }

    /// Stops keeping the writer webhooks in step (their configuration stays as last applied).
    pub async fn stop_routing(&mut self) {
        if let Some(routing) = self.routing.take() {
            routing.abort();
            let _ = routing.await;
        }
    }

    /// Stops the routing, the server and the lease cache; what was registered stays in place.
    pub async fn stop(mut self) {
        self.stop_routing().await;
        self.stop_serving().await;
        self.cache.abort();
    }

    /// Waits until the server stops (`stop` was cancelled, or serving failed), then stops the
    /// routing and the lease cache; the server's result.
    pub async fn served(mut self) -> std::io::Result<()> {
        let served = match self.server.take() {
            Some(server) => server.await.unwrap_or_else(|joined| Err(std::io::Error::other(joined))),
            None => Ok(()),
        };
        self.stop_routing().await;
        self.cache.abort();
        served
    }
}
