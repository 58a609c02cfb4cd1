//! The webhook's HTTPS server: `/validate` (AdmissionReview v1), `/healthz`, `/readyz`,
//! `/metrics`. A thin adapter: body → [`review::decode`] → facts ([`review::request_facts`]) →
//! [`pipeline::judge`] (plan, the lease reads it asks for, verdict) → [`review::response`].
//!
//! The port is reachable by more than the API server, so every connection is bounded: it speaks
//! HTTP/1.1 only (what its ALPN advertises; an HTTP/2 connection has no idle deadline), the
//! connections open at once are bounded in all and per source, a source whose connections fail
//! (a failed handshake, bytes without a request) is refused new ones beyond a budget
//! (`super::bounds`, `super::failures`), a quarter of the places is kept for sources that sent
//! genuine reviews recently (the API server: `remember_reviewers`) and the connections of other
//! sources are closed after `super::bounds::IDLE_WITHOUT_REVIEW` without a byte, the TLS
//! handshake, the first request, the headers of every later request (idle time included: longer
//! than the API server keeps an idle connection, so it is the one that closes it) and the body
//! each have a deadline, a body is at most [`MAX_BODY_BYTES`], and all
//! bodies in flight together at most [`BODY_BUDGET_BYTES`] (beyond that a request is refused at
//! once with 503, before any of its body is read). The reviews of one source that need a quorum
//! read are budgeted (`crate::admission::reads::ReadBudget`).

use std::future::Future;
use std::net::{SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{ConnectInfo, Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum_server::tls_rustls::{RustlsAcceptor, RustlsConfig};
use prometheus_client::registry::Registry;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::admission::http::bounds::{Bounds, ConnectionGate, GatedAddr, GatedListener};
use crate::admission::http::events::RejectionEvents;
use crate::admission::http::failures::Watching;
use crate::admission::http::review::{self, Unreadable};
use crate::admission::judge::facts::Request as JudgedRequest;
use crate::admission::judge::fence::{Fence, Mode};
use crate::admission::judge::pipeline::{self, Judging, Sent};
use crate::admission::judge::verdict::{Held, Verdict};
use crate::admission::judge::writer;
pub use crate::admission::metrics::Metrics;
use crate::admission::metrics::Refusal;
use crate::admission::reads::Reader;
use crate::admission::reads::directory::LeaseDirectory;
use kube_fence_api::denial::Reason;
use kube_fence_api::fence_events;

/// The path of the guarded objects' webhook (the writer fence's is
/// `crate::admission::judge::writer::PATH`).
pub const PATH: &str = "/validate";
/// How long a client may take to complete its TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client may take, after its handshake, to send its first request. A connection
/// that has carried a request may then stay idle for `Bounds::keep_alive_idle` (its next
/// request's headers included), longer than the API server keeps it (`super::bounds::KEEP_ALIVE_IDLE`).
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
    /// Who is exempt, and how a leader-election Lease's holder names a Pod.
    pub judging: Judging,
    /// The lease reads judging makes: watch cache, quorum reads budgeted per source.
    pub reader: Reader,
    pub metrics: Metrics,
    /// Events on the guarded objects for rejected writes (`None`: no Events, e.g. benchmarks).
    pub events: Option<RejectionEvents>,
    /// Bytes of request bodies that may be in flight.
    pub body_budget: Arc<Semaphore>,
}

impl Webhook {
    pub fn new(judging: Judging, reader: Reader, metrics: Metrics, events: Option<RejectionEvents>) -> Webhook {
        Webhook { judging, reader, metrics, events, body_budget: Arc::new(Semaphore::new(BODY_BUDGET_BYTES)) }
    }

    /// A review in, its answer out: decode → facts → the pipeline (plan, reads, verdict) →
    /// response. `started` is when the request arrived; `peer` sent it to the webhook `sent`.
    async fn answer(&self, peer: SocketAddr, body: &[u8], sent: Sent, started: Instant) -> Response {
        let request = match review::decode(body) {
            Ok(request) => request,
            Err(unreadable) => return self.unreadable(unreadable, started),
        };
        let facts = review::request_facts(&request);
        let verdict = pipeline::judge(&facts, &self.judging, sent, &self.reader.from(peer.ip())).await;
        let answer = review::response(&request, &verdict).to_vec();
        self.metrics.decided(&verdict, started.elapsed().as_secs_f64());
        self.report(peer, &request, &facts, sent, &verdict);
        let mut answered = json(answer);
        // A genuine review was judged: its source may take the places kept for reviewing sources.
        answered.extensions_mut().insert(Reviewed);
        answered
    }

    /// The answer to a body that is not a readable AdmissionReview.
    fn unreadable(&self, unreadable: Unreadable, started: Instant) -> Response {
        match unreadable {
            Unreadable::NotAReview(message) => (StatusCode::BAD_REQUEST, format!("{message}\n")).into_response(),
            Unreadable::Malformed { uid, message } => {
                // The API server sent something we cannot read: deny (fail closed) and say why.
                let verdict = Verdict::deny(400, Reason::MalformedRequest, message.clone());
                self.metrics.decided(&verdict, started.elapsed().as_secs_f64());
                tracing::warn!(uid, error = %message, "malformed AdmissionReview denied");
                json(review::malformed(&uid, &message).to_vec())
            }
        }
    }

    /// Logs the verdict, and publishes an Event for a denial (on the written object, or on the
    /// FencedControllers that refused a fenced writer's write) and for a write an Audit fence
    /// admitted with a warning (on that FencedController).
    fn report(&self, peer: SocketAddr, request: &review::Admission<'_>, facts: &JudgedRequest, sent: Sent, verdict: &Verdict) {
        let (kind, ns, name) = (request.kind.kind.as_ref(), request.namespace.as_deref().unwrap_or(""), request.name.as_ref());
        let (user, op, sub) =
            (request.user_info.username.as_deref().unwrap_or(""), &request.operation, request.sub_resource.as_deref().unwrap_or(""));
        match verdict {
            Verdict::Allow { reason } => tracing::debug!(kind, ns, name, sub, user, ?op, %reason, "admitted"),
            Verdict::AllowHeld { reason, held } => {
                let Held { lease, holder, resource_version } = held;
                tracing::debug!(kind, ns, name, sub, user, ?op, %reason, lease, holder, resource_version, "admitted for the Lease's holder");
            }
            Verdict::AllowWithWarning { reason, message } => {
                tracing::warn!(kind, ns, name, sub, user, ?op, %reason, message, "admitted with a warning (enforcement Warn or audit mode)");
                if let (Some(events), Sent::Writer) = (&self.events, sent) {
                    for fence in self.fences_judging(facts, Mode::Audit) {
                        events.publish_on_fence(peer.ip(), &fence, request, fence_events::WOULD_REFUSE, message);
                    }
                }
            }
            Verdict::Deny { code, reason, message, .. } => {
                tracing::info!(kind, ns, name, sub, user, ?op, code, %reason, message, %peer, "denied");
                // An Event over its source's budget is counted in `events_suppressed` by the
                // publisher.
                if let Some(events) = &self.events {
                    match sent {
                        Sent::Objects => {
                            events.publish(peer.ip(), request, *reason, message);
                        }
                        Sent::Writer => {
                            for fence in self.fences_judging(facts, Mode::Enforce) {
                                events.publish_on_fence(peer.ip(), &fence, request, reason.as_str(), message);
                            }
                        }
                    }
                }
            }
        }
    }

    /// The fences in `mode` that judged the fenced writer's request `facts` (not letting it pass):
    /// whose FencedController an Event about the verdict goes on.
    fn fences_judging(&self, facts: &JudgedRequest, mode: Mode) -> Vec<Arc<Fence>> {
        let audit_all = self.judging.holder_fences == Mode::Audit;
        let fences = self.reader.leases().fences(&facts.user).unwrap_or_default();
        fences.into_iter().filter(|f| !f.passes(facts) && (if audit_all { Mode::Audit } else { f.mode }) == mode).collect()
    }

    /// The request's body, read within the body bounds and holding its share of the body budget
    /// until dropped; the refusal if it is too large, too slow, or the budget is used up.
    async fn body(&self, peer: SocketAddr, request: Request) -> Result<(Bytes, OwnedSemaphorePermit), Response> {
        let refuse = |refusal: Refusal, status: StatusCode, message: String| {
            self.metrics.refused(refusal);
            tracing::debug!(%peer, ?refusal, "request refused before judging");
            (status, message).into_response()
        };
        // Refuse an oversized body from its declared length, before reading any of it. (The
        // headers are read in place: the `HeaderMap` extractor would copy them for every review.)
        let (parts, body) = request.into_parts();
        let declared = parts.headers.get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|len| len > MAX_BODY_BYTES as u64) {
            return Err(refuse(Refusal::TooLarge, StatusCode::PAYLOAD_TOO_LARGE, format!("the body exceeds {MAX_BODY_BYTES} bytes\n")));
        }
        // Reserve the body's memory (all of MAX_BODY_BYTES when no length is declared).
        let reserve = declared.map_or(MAX_BODY_BYTES, |len| len as usize).max(1) as u32;
        let Ok(reservation) = self.body_budget.clone().try_acquire_many_owned(reserve) else {
            return Err(refuse(Refusal::Busy, StatusCode::SERVICE_UNAVAILABLE, "too many request bodies in flight; retry\n".into()));
        };
        match tokio::time::timeout(BODY_READ_TIMEOUT, axum::body::to_bytes(body, MAX_BODY_BYTES)).await {
            Ok(Ok(body)) => Ok((body, reservation)),
            Ok(Err(err)) => Err(refuse(
                Refusal::TooLarge,
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("cannot read the body (at most {MAX_BODY_BYTES} bytes): {err}\n"),
            )),
            Err(_) => Err(refuse(
                Refusal::SlowBody,
                StatusCode::REQUEST_TIMEOUT,
                format!("the body did not arrive within {BODY_READ_TIMEOUT:?}\n"),
            )),
        }
    }
}

/// `/validate`: a review of a write to a guarded object.
async fn validate(State(webhook): State<Arc<Webhook>>, ConnectInfo(peer): ConnectInfo<SocketAddr>, request: Request) -> Response {
    let started = Instant::now();
    match webhook.body(peer, request).await {
        Ok((body, _reservation)) => webhook.answer(peer, &body, Sent::Objects, started).await,
        Err(refused) => refused,
    }
}

/// `/writer`: a review of a write by a ServiceAccount a FencedController names.
async fn validate_writer(State(webhook): State<Arc<Webhook>>, ConnectInfo(peer): ConnectInfo<SocketAddr>, request: Request) -> Response {
    let started = Instant::now();
    match webhook.body(peer, request).await {
        Ok((body, _reservation)) => webhook.answer(peer, &body, Sent::Writer, started).await,
        Err(refused) => refused,
    }
}

/// Marks the answer to a genuine review (an AdmissionReview decoded and judged), for
/// [`remember_reviewers`].
#[derive(Clone, Copy, Debug)]
struct Reviewed;

/// Tells `gate` which sources' requests were genuine reviews (`super::bounds::Reviewers`): their
/// new connections may take the places kept for reviewing sources.
async fn remember_reviewers(State(gate): State<ConnectionGate>, request: Request, next: Next) -> Response {
    let peer = request.extensions().get::<ConnectInfo<SocketAddr>>().map(|ConnectInfo(peer)| peer.ip());
    let response = next.run(request).await;
    if let Some(peer) = peer
        && response.extensions().get::<Reviewed>().is_some()
    {
        gate.reviewed(peer);
    }
    response
}

/// A JSON response body.
fn json(body: Vec<u8>) -> Response {
    ([(http::header::CONTENT_TYPE, "application/json")], body).into_response()
}

/// The routes: the reviews', and `/metrics`, `/healthz`, `/readyz` as every port serves them
/// (`crate::telemetry::router`), ready once the lease cache has synced.
pub fn router(webhook: Arc<Webhook>, registry: Arc<Registry>) -> Router {
    let synced = webhook.clone();
    let ready = move || if synced.reader.leases().is_ready() { Ok(()) } else { Err("lease cache not synced yet") };
    Router::new()
        .route(PATH, post(validate))
        .route(writer::PATH, post(validate_writer))
        .with_state(webhook)
        .merge(crate::telemetry::router(registry, ready))
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
    let trim = tokio::spawn(crate::admission::http::bounds::trim_after_bursts(gate.clone(), Duration::from_secs(5), 256));
    // The gate runs in the accept loop, before the handshake: a connection without a place costs
    // nothing more.
    // Connections that fail (their handshake, or bytes without a request) are charged to their
    // source's budget of failed connections (`super::failures`).
    let acceptor = Watching::new(RustlsAcceptor::new(tls).handshake_timeout(HANDSHAKE_TIMEOUT));
    let listener = GatedListener::new(listener, gate.clone())?;
    // Sources whose requests are genuine reviews get the places kept for them.
    let router = router.layer(axum::middleware::from_fn_with_state(gate.clone(), remember_reviewers));
    let server = axum_server::Server::<GatedAddr>::from_listener(listener)
        .acceptor(acceptor)
        .handle(handle)
        .first_request_timeout(HEADER_READ_TIMEOUT);
    // HTTP/1.1 only, as ALPN says: hyper's HTTP/2 server has no idle deadline, so a client that
    // spoke HTTP/2 by prior knowledge could keep a connection forever.
    let mut server = server.http1_only();
    // The first request has HEADER_READ_TIMEOUT (above); the wait for each later request's
    // headers — idle time included — is longer than the API server keeps an idle connection, so
    // the API server closes it and never sends a review on a connection kube-fence is closing.
    let keep_alive_idle = gate.limits().keep_alive_idle;
    server.http_builder().http1().header_read_timeout(Some(keep_alive_idle));
    let served = server.serve(router.into_make_service_with_connect_info::<SocketAddr>()).await;
    trim.abort();
    served
}

/// What one webhook process serves: how it judges, and on which port, with which certificate,
/// within which bounds. The part of the startup configuration (`crate::admission::start`) the
/// server needs.
pub struct Serving {
    /// Who is exempt, and how a leader-election Lease's holder names a Pod.
    pub judging: Judging,
    /// What one client of the port can cost.
    pub bounds: Bounds,
    pub listener: TcpListener,
    /// The serving certificate (kept current by whoever made it: a file watcher, the
    /// self-managed TLS loop).
    pub tls: RustlsConfig,
}

/// Serves what `serving` says, given its lease directory (whose cache future the caller runs),
/// counting into `metrics` (and `/metrics` rendering `registry`). Returns when `shutdown`
/// resolves.
pub async fn run(
    leases: LeaseDirectory,
    serving: Serving,
    metrics: Metrics,
    registry: Arc<Registry>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let Serving { judging, bounds, listener, tls } = serving;
    let events = Some(RejectionEvents::new(leases.client(), crate::process::identity(), metrics.events_suppressed.clone()));
    let gate = ConnectionGate::new(bounds, metrics.connections.clone());
    let reader = Reader::new(leases, metrics.clone(), bounds.quorum_reads_per_namespace, bounds.quorum_read_timeout);
    let webhook = Arc::new(Webhook::new(judging, reader, metrics, events));
    serve(listener, tls, router(webhook, registry), gate, shutdown).await
}
