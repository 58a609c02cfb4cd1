//! The webhook's HTTPS server: `/validate` (AdmissionReview v1), `/healthz`, `/readyz`,
//! `/metrics`. A thin adapter: body → [`review::decode`] → [`decision::plan`] → at most one
//! lease read → verdict → [`review::response`].
//!
//! The port is reachable by more than the API server, so every connection is bounded: it speaks
//! HTTP/1.1 only (what its ALPN advertises; an HTTP/2 connection has no idle deadline), the
//! connections open at once are bounded in all and per source (`super::bounds`), the TLS
//! handshake, the headers of every request (the first, and the next on an idle keep-alive
//! connection) and the body each have a deadline, a body is at most [`MAX_BODY_BYTES`], and all
//! bodies in flight together at most [`BODY_BUDGET_BYTES`] (beyond that a request is refused at
//! once with 503, before any of its body is read). The reviews of one source that need a quorum
//! read are budgeted (`super::bounds::ReadBudget`).

use std::future::Future;
use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, Path, Request, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum_server::tls_rustls::{RustlsAcceptor, RustlsConfig};
use prometheus_client::registry::Registry;
use tokio::sync::Semaphore;

use super::bounds::{Bounds, ConnectionGate, GatedAddr, GatedListener, ReadBudget};
use super::decision::{self, Exemptions, Judged, Plan, QuorumRead, Reason, Verdict};
use super::events::RejectionEvents;
use super::leader::{self, HolderRead, IdentityRule, LeaderPlan};
use super::leases::LeaseDirectory;
pub use super::metrics::Metrics;
use super::metrics::{LeaseReadKind, Refusal};
use super::review::{self, Unreadable};
use super::shared_reads::SharedReads;
use super::writer::{self, WriterPlan};

/// How long a client may take to complete its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client may take to send a request's headers (also the first request's), and how
/// long a keep-alive connection may stay idle between requests.
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client may take to send a request's body. The API server sends a review at once
/// and waits at most 30 s for the verdict.
pub const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// Kubernetes objects are at most 1.5 MiB; an AdmissionReview carries two of them.
pub const MAX_BODY_BYTES: usize = 3 * 1024 * 1024;
/// All request bodies being read or judged at once, together. The chart's memory limit is
/// 256 MiB; reviews of ordinary objects are a few KiB, so this admits thousands at once.
pub const BODY_BUDGET_BYTES: usize = 64 * 1024 * 1024;

/// Judges admission reviews.
pub struct Webhook {
    pub exempt: Exemptions,
    /// How a leader-election Lease's holder names a Pod (`--leader-identity-separator`).
    pub identity: IdentityRule,
    pub leases: LeaseDirectory,
    pub metrics: Metrics,
    /// Events on the guarded objects for rejected writes (`None`: no Events, e.g. benchmarks).
    pub events: Option<RejectionEvents>,
    /// Bytes of request bodies that may be in flight.
    pub body_budget: Arc<Semaphore>,
    /// Quorum reads of opted-in Leases, shared by the writes waiting for them.
    pub writer_reads: Arc<SharedReads<(String, String), Result<writer::WriterQuorum, String>>>,
    /// Reviews needing a quorum read, per source (`None`: unbudgeted).
    read_budget: Option<Mutex<ReadBudget>>,
}

impl Webhook {
    pub fn new(
        exempt: Exemptions,
        identity: IdentityRule,
        leases: LeaseDirectory,
        metrics: Metrics,
        events: Option<RejectionEvents>,
    ) -> Webhook {
        Webhook {
            exempt,
            identity,
            leases,
            metrics,
            events,
            body_budget: Arc::new(Semaphore::new(BODY_BUDGET_BYTES)),
            writer_reads: Arc::default(),
            read_budget: None,
        }
    }

    /// Budgets the reviews that need a quorum read: `per_second` per source address (`None`:
    /// unbudgeted).
    pub fn with_read_budget(mut self, per_second: Option<u32>) -> Webhook {
        self.read_budget = per_second.map(|n| Mutex::new(ReadBudget::new(n)));
        self
    }

    /// Judges one request, sent from `source`: by the leader-election Lease it is bound to, if
    /// any ([`leader::plan`]), and by its kube-fence lease (an object may carry both guards:
    /// both must admit the write).
    pub async fn judge(&self, req: &decision::Request, source: IpAddr) -> Verdict {
        let by_holder = match leader::plan(req, &self.exempt, &self.identity) {
            LeaderPlan::Done(verdict) => verdict,
            LeaderPlan::Quorum(read) => self.judge_by_holder(read, source).await,
        };
        if !by_holder.is_allowed() {
            return by_holder;
        }
        let by_token = self.judge_by_token(req, source).await;
        if by_token.reason() == Reason::Unguarded { by_holder } else { by_token }
    }

    /// Judges one request sent by the writer webhook of opted-in Lease `lease` (`super::writer`).
    pub async fn judge_writer(&self, req: &decision::Request, lease: decision::LeaseRef<'_>, source: IpAddr) -> Verdict {
        match writer::plan(req, lease, &self.identity) {
            WriterPlan::Done(verdict) => verdict,
            WriterPlan::Quorum(read) => {
                if let Some(throttled) = self.throttled(source) {
                    return throttled;
                }
                let lease = read.lease();
                // Concurrent writes of one controller share the next quorum read of its Lease.
                let key = (lease.namespace.to_string(), lease.name.to_string());
                let (client, metrics, (namespace, name)) = (self.leases.client(), self.metrics.clone(), key.clone());
                let fresh = self
                    .writer_reads
                    .read(key, move || async move {
                        metrics.lease_read(LeaseReadKind::Linearizable);
                        writer::read_lease(client, decision::LeaseRef { namespace: &namespace, name: &name })
                            .await
                            .map_err(|e| e.to_string())
                    })
                    .await;
                match fresh {
                    Ok(fresh) => read.judge(fresh),
                    Err(err) => Verdict::deny(
                        500,
                        Reason::LeaseReadFailed,
                        format!("cannot read leader-election Lease {lease} (failing closed): {err}"),
                    ),
                }
            }
        }
    }

    /// `None` when `source` may cause one more quorum read; the denial if not.
    fn throttled(&self, source: IpAddr) -> Option<Verdict> {
        let budget = self.read_budget.as_ref()?;
        let mut budget = budget.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if budget.admit(source, Instant::now()) {
            return None;
        }
        self.metrics.reads_throttled.inc();
        Some(Verdict::deny(
            429,
            Reason::ReadsThrottled,
            format!("too many reviews needing a quorum read from {source} (at most {} a second); retry in a second", budget.per_second()),
        ))
    }

    async fn judge_by_holder(&self, read: HolderRead<'_>, source: IpAddr) -> Verdict {
        if let Some(throttled) = self.throttled(source) {
            return throttled;
        }
        self.metrics.lease_read(LeaseReadKind::Linearizable);
        let lease = read.lease();
        match leader::read_holder(self.leases.client(), lease).await {
            Ok(fresh) => read.judge(fresh),
            Err(err) => {
                Verdict::deny(500, Reason::LeaseReadFailed, format!("cannot read leader-election Lease {lease} (failing closed): {err}"))
            }
        }
    }

    /// The plan, then at most one read of the kube-fence lease.
    async fn judge_by_token(&self, req: &decision::Request, source: IpAddr) -> Verdict {
        match decision::plan(req, &self.exempt) {
            Plan::Done(verdict) => verdict,
            Plan::Cache(read) => {
                self.metrics.lease_read(LeaseReadKind::Cache);
                let cached = self.leases.cached(read.lease());
                match read.judge(cached) {
                    Judged::Done(verdict) => verdict,
                    Judged::Quorum(read) => self.judge_by_quorum(read, source).await,
                }
            }
            Plan::Quorum(read) => self.judge_by_quorum(read, source).await,
        }
    }

    async fn judge_by_quorum(&self, read: QuorumRead<'_>, source: IpAddr) -> Verdict {
        if let Some(throttled) = self.throttled(source) {
            return throttled;
        }
        self.metrics.lease_read(LeaseReadKind::Linearizable);
        let lease = read.lease();
        match self.leases.quorum(lease).await {
            Ok(fresh) => read.judge(fresh),
            Err(err) => Verdict::deny(500, Reason::LeaseReadFailed, format!("cannot read lease {lease} (failing closed): {err}")),
        }
    }
}

/// Which guard a review is sent for: guarded objects (`/validate`), or an opted-in writer
/// (`/writer/<namespace>/<name>`, `super::writer`).
enum Guard {
    Objects,
    Writer { namespace: String, name: String },
}

async fn validate(State(webhook): State<Arc<Webhook>>, ConnectInfo(peer): ConnectInfo<SocketAddr>, request: Request) -> Response {
    review_for(webhook, peer, request, Guard::Objects).await
}

async fn validate_writer(
    State(webhook): State<Arc<Webhook>>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    Path((namespace, name)): Path<(String, String)>,
    request: Request,
) -> Response {
    if writer::lease_of_path(&namespace, &name).is_none() {
        return (StatusCode::NOT_FOUND, format!("{}/{namespace}/{name} names no Lease\n", writer::PATH_PREFIX)).into_response();
    }
    review_for(webhook, peer, request, Guard::Writer { namespace, name }).await
}

async fn review_for(webhook: Arc<Webhook>, peer: SocketAddr, request: Request, guard: Guard) -> Response {
    let started = Instant::now();
    let refuse = |refusal: Refusal, status: StatusCode, message: String| {
        webhook.metrics.refused(refusal);
        tracing::debug!(%peer, ?refusal, "request refused before judging");
        (status, message).into_response()
    };
    // Refuse an oversized body from its declared length, before reading any of it. (The headers
    // are read in place: the `HeaderMap` extractor would copy them for every review.)
    let (parts, body) = request.into_parts();
    let declared = parts.headers.get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > MAX_BODY_BYTES as u64) {
        return refuse(Refusal::TooLarge, StatusCode::PAYLOAD_TOO_LARGE, format!("the body exceeds {MAX_BODY_BYTES} bytes\n"));
    }
    // Reserve the body's memory (all of MAX_BODY_BYTES when no length is declared).
    let reserve = declared.map_or(MAX_BODY_BYTES, |len| len as usize).max(1) as u32;
    let Ok(_reservation) = webhook.body_budget.clone().try_acquire_many_owned(reserve) else {
        return refuse(Refusal::Busy, StatusCode::SERVICE_UNAVAILABLE, "too many request bodies in flight; retry\n".into());
    };
    let body: Bytes = match tokio::time::timeout(BODY_READ_TIMEOUT, axum::body::to_bytes(body, MAX_BODY_BYTES)).await {
        Ok(Ok(body)) => body,
        Ok(Err(err)) => {
            return refuse(
                Refusal::TooLarge,
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("cannot read the body (at most {MAX_BODY_BYTES} bytes): {err}\n"),
            );
        }
        Err(_) => {
            return refuse(
                Refusal::SlowBody,
                StatusCode::REQUEST_TIMEOUT,
                format!("the body did not arrive within {BODY_READ_TIMEOUT:?}\n"),
            );
        }
    };
    let request = match review::decode(&body) {
        Ok(request) => request,
        Err(Unreadable::NotAReview(message)) => return (StatusCode::BAD_REQUEST, format!("{message}\n")).into_response(),
        Err(Unreadable::Malformed { uid, message }) => {
            // The API server sent something we cannot read: deny (fail closed) and say why.
            let verdict = Verdict::deny(400, Reason::MalformedRequest, message.clone());
            webhook.metrics.decided(&verdict, started.elapsed().as_secs_f64());
            tracing::warn!(uid, error = %message, "malformed AdmissionReview denied");
            return json(review::malformed(&uid, &message).to_vec());
        }
    };
    let facts = review::request_facts(&request);
    let verdict = match &guard {
        Guard::Objects => webhook.judge(&facts, peer.ip()).await,
        Guard::Writer { namespace, name } => webhook.judge_writer(&facts, decision::LeaseRef { namespace, name }, peer.ip()).await,
    };
    let answer = review::response(&request, &verdict).to_vec();
    webhook.metrics.decided(&verdict, started.elapsed().as_secs_f64());
    let (kind, ns, name) = (request.kind.kind.as_ref(), request.namespace.as_deref().unwrap_or(""), request.name.as_ref());
    let (user, op, sub) =
        (request.user_info.username.as_deref().unwrap_or(""), &request.operation, request.sub_resource.as_deref().unwrap_or(""));
    match &verdict {
        Verdict::Allow { reason } => tracing::debug!(kind, ns, name, sub, user, ?op, %reason, "admitted"),
        Verdict::AllowWithWarning { reason, message } => {
            tracing::warn!(kind, ns, name, sub, user, ?op, %reason, message, "admitted with a warning (enforcement Warn)")
        }
        Verdict::Deny { code, reason, message, .. } => {
            tracing::info!(kind, ns, name, sub, user, ?op, code, %reason, message, %peer, "denied");
            let published = webhook.events.as_ref().map(|events| match &guard {
                Guard::Objects => events.publish(peer.ip(), &request, *reason, message),
                Guard::Writer { namespace, name } => events.publish_on_lease(peer.ip(), namespace, name, &request, *reason, message),
            });
            if published == Some(false) {
                webhook.metrics.events_suppressed.inc();
            }
        }
    }
    json(answer)
}

/// A JSON response body.
fn json(body: Vec<u8>) -> Response {
    ([(http::header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// The routes.
pub fn router(webhook: Arc<Webhook>, registry: Arc<Registry>) -> Router {
    let ready = webhook.clone();
    Router::new()
        .route(super::registration::PATH, post(validate))
        .route(&format!("{}/{{namespace}}/{{name}}", writer::PATH_PREFIX), post(validate_writer))
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(move || {
                let ready = ready.clone();
                async move {
                    if ready.leases.is_ready() {
                        (StatusCode::OK, "ok")
                    } else {
                        (StatusCode::SERVICE_UNAVAILABLE, "lease cache not synced yet")
                    }
                }
            }),
        )
        .route(
            "/metrics",
            get(move || {
                let registry = registry.clone();
                async move {
                    (
                        [(http::header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")],
                        crate::telemetry::render(&registry),
                    )
                }
            }),
        )
        .with_state(webhook)
}

/// Serves `router` over TLS on `listener` until `shutdown` resolves (then drains for up to
/// ten seconds), with the connections open at once bounded by `gate`. Handlers may extract
/// the peer's address (`ConnectInfo<SocketAddr>`).
pub async fn serve(
    listener: TcpListener,
    tls: RustlsConfig,
    router: Router,
    gate: ConnectionGate,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let handle = axum_server::Handle::new();
    let stopper = handle.clone();
    tokio::spawn(async move {
        shutdown.await;
        stopper.graceful_shutdown(Some(Duration::from_secs(10)));
    });
    let trim = tokio::spawn(super::bounds::trim_after_bursts(gate.clone(), Duration::from_secs(5), 256));
    // The gate runs in the accept loop, before the handshake: a connection without a place costs
    // nothing more.
    let acceptor = RustlsAcceptor::new(tls).handshake_timeout(HANDSHAKE_TIMEOUT);
    let listener = GatedListener::new(listener, gate.clone())?;
    let server = axum_server::Server::<GatedAddr>::from_listener(listener)
        .acceptor(acceptor)
        .handle(handle)
        .first_request_timeout(HEADER_READ_TIMEOUT);
    // HTTP/1.1 only, as ALPN says: hyper's HTTP/2 server has no idle deadline, so a client that
    // spoke HTTP/2 by prior knowledge could keep a connection forever.
    let mut server = server.http1_only();
    // The API server sends whole requests at once; a client that trickles its headers
    // (slowloris) or idles between requests must not keep the webhook's connections, so the
    // headers of every request get a deadline.
    server.http_builder().http1().header_read_timeout(Some(HEADER_READ_TIMEOUT));
    let served = server.serve(router.into_make_service_with_connect_info::<SocketAddr>()).await;
    trim.abort();
    served
}

/// Everything one webhook process serves, given its lease directory (whose cache future the
/// caller runs), judging leader-election holders by `identity`, within `bounds`. Returns when
/// `shutdown` resolves.
#[allow(clippy::too_many_arguments)]
pub async fn run(
    leases: LeaseDirectory,
    listener: TcpListener,
    tls: RustlsConfig,
    exempt: Exemptions,
    identity: IdentityRule,
    bounds: Bounds,
    metrics: Metrics,
    registry: Arc<Registry>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let events = Some(RejectionEvents::new(leases.client(), crate::process::identity()));
    let gate = ConnectionGate::new(bounds, metrics.connections.clone());
    let webhook = Arc::new(Webhook::new(exempt, identity, leases, metrics, events).with_read_budget(bounds.quorum_reads_per_source));
    serve(listener, tls, router(webhook, registry), gate, shutdown).await
}
