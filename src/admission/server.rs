//! The webhook's HTTPS server: `/validate` (AdmissionReview v1), `/healthz`, `/readyz`,
//! `/metrics`. A thin adapter: it reduces a review to [`decision::Request`], reads the lease as
//! [`decision::lease_read`] asks, and turns the [`Verdict`] into an AdmissionResponse.
//!
//! Bad input never panics: a body that is not an AdmissionReview gets a 400; a review whose
//! objects cannot be read gets a denial (code 400) naming the problem; bodies are bounded.

use std::borrow::Cow;
use std::future::Future;
use std::net::TcpListener;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum_server::tls_rustls::RustlsConfig;
use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview, Operation as KubeOperation};
use kube::core::{DynamicResourceScope, ObjectMeta, Resource, Status};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use super::decision::{self, Exemptions, LeaseRead, ObjectFacts, Operation, Reason, Verdict};
use super::leases::LeaseDirectory;
use crate::token::{LEASE_LABEL, TOKEN_ANNOTATION};

/// How long a client may take to send a request's headers (also the first request's).
pub const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);

/// Kubernetes objects are at most 1.5 MiB; an AdmissionReview carries two of them.
pub const MAX_BODY_BYTES: usize = 3 * 1024 * 1024;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    verdict: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReadLabels {
    read: &'static str,
}

/// The webhook's metrics.
#[derive(Clone)]
pub struct Metrics {
    decisions: Family<DecisionLabels, Counter>,
    lease_reads: Family<ReadLabels, Counter>,
    latency: Histogram,
    /// Certificate reloads (files changed, or the shared Secret changed).
    pub tls_reloads: Counter,
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Metrics {
        let m = Metrics {
            decisions: Family::default(),
            lease_reads: Family::default(),
            latency: Histogram::new(exponential_buckets(0.000_05, 2.0, 16)),
            tls_reloads: Counter::default(),
        };
        let r = registry.sub_registry_with_prefix("kube_fence_webhook");
        r.register("decisions", "Admission decisions by verdict (allowed, warned, denied) and reason", m.decisions.clone());
        r.register("lease_reads", "Lease reads by kind (cache, linearizable)", m.lease_reads.clone());
        r.register("decision_duration_seconds", "Time to judge one AdmissionReview, from body received to response", m.latency.clone());
        r.register("tls_reloads", "Serving certificate reloads", m.tls_reloads.clone());
        m
    }
}

/// Judges admission reviews.
pub struct Webhook {
    pub exempt: Exemptions,
    pub leases: LeaseDirectory,
    pub metrics: Metrics,
    /// Events on the guarded objects for rejected writes (`None`: no Events, e.g. benchmarks).
    pub events: Option<RejectionEvents>,
}

/// Publishes a Kubernetes Event on the guarded object for each write the fencing rules reject,
/// so `kubectl describe` shows who was fenced off and why. Bounded: at most
/// [`RejectionEvents::PER_SECOND`] a second — a storm of stale writes must not become a storm
/// of Events against the API server. Publishing runs in the background and never delays or
/// changes a verdict.
pub struct RejectionEvents {
    recorder: kube::runtime::events::Recorder,
    window: std::sync::Mutex<(Instant, u32)>,
}

impl RejectionEvents {
    pub const PER_SECOND: u32 = 20;

    pub fn new(client: kube::Client, instance: String) -> RejectionEvents {
        let reporter = kube::runtime::events::Reporter { controller: "kube-fence-webhook".into(), instance: Some(instance) };
        RejectionEvents {
            recorder: kube::runtime::events::Recorder::new(client, reporter),
            window: std::sync::Mutex::new((Instant::now(), 0)),
        }
    }

    fn admit_one(&self) -> bool {
        let Ok(mut window) = self.window.lock() else { return false };
        if window.0.elapsed() >= Duration::from_secs(1) {
            *window = (Instant::now(), 0);
        }
        window.1 += 1;
        window.1 <= Self::PER_SECOND
    }

    fn publish(&self, request: &AdmissionRequest<Guardable>, reason: Reason, message: &str) {
        if !self.admit_one() {
            return;
        }
        let group = request.kind.group.as_str();
        let reference = k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some(if group.is_empty() { request.kind.version.clone() } else { format!("{group}/{}", request.kind.version) }),
            kind: Some(request.kind.kind.clone()),
            namespace: request.namespace.clone(),
            name: Some(request.name.clone()),
            uid: request.old_object.as_ref().and_then(|o| o.metadata.uid.clone()),
            ..Default::default()
        };
        let user = request.user_info.username.clone().unwrap_or_default();
        let event = kube::runtime::events::Event {
            type_: kube::runtime::events::EventType::Warning,
            reason: reason.as_str().to_string(),
            note: Some(format!("{user}: {message}").chars().take(1024).collect()),
            action: format!("{:?}", request.operation),
            secondary: None,
        };
        let recorder = self.recorder.clone();
        tokio::spawn(async move {
            if let Err(err) = recorder.publish(&event, &reference).await {
                tracing::debug!(%err, "publishing a rejection event");
            }
        });
    }
}

impl Webhook {
    /// Reads the lease as the decision asks and judges.
    pub async fn judge(&self, req: &decision::Request) -> Verdict {
        let Some(lease) = decision::bound_lease(req) else { return decision::decide(req, &self.exempt, None) };
        let ns = req.namespace.as_str();
        let mut read = decision::lease_read(req, &self.exempt, None);
        let mut lookup = None;
        if read == LeaseRead::Cache {
            self.metrics.lease_reads.get_or_create(&ReadLabels { read: "cache" }).inc();
            let cached = self.leases.cached(ns, lease);
            read = decision::lease_read(req, &self.exempt, Some(&cached));
            lookup = Some(cached);
        }
        if read == LeaseRead::Linearizable {
            self.metrics.lease_reads.get_or_create(&ReadLabels { read: "linearizable" }).inc();
            match self.leases.linearizable(ns, lease).await {
                Ok(fresh) => lookup = Some(fresh),
                Err(err) => {
                    return Verdict::Deny {
                        code: 500,
                        reason: Reason::LeaseReadFailed,
                        message: format!("cannot read lease {ns}/{lease} (failing closed): {err}"),
                    };
                }
            }
        }
        decision::decide(req, &self.exempt, lookup.as_ref())
    }

    /// Judges one parsed review and builds the response.
    pub async fn review(&self, request: &AdmissionRequest<Guardable>) -> (Verdict, AdmissionResponse) {
        let facts = request_facts(request);
        let verdict = self.judge(&facts).await;
        let response = response(request, &verdict);
        (verdict, response)
    }
}

/// Why a body is not a review the webhook can judge.
#[derive(Debug)]
pub enum Unreadable {
    /// Not JSON, or no `request.uid`: answered with HTTP 400 (there is no uid to answer to).
    NotAReview(String),
    /// A review (its uid is known) whose request cannot be read: denied, code 400.
    Malformed { uid: String, message: String },
}

/// Reads an AdmissionReview body in one pass. Pure, and total on any bytes: the property tests
/// (`tests/admission_props.rs`) feed it arbitrary and mutated bodies.
///
/// It reads the body in one pass. Only when that fails is the body read again,
/// loosely, to find the uid a denial must carry — the common path builds no intermediate
/// `serde_json::Value` (for a 1 MiB object that copy was a large part of the decision's cost).
pub fn decode(body: &[u8]) -> Result<AdmissionRequest<Guardable>, Unreadable> {
    let error = match serde_json::from_slice::<AdmissionReview<Guardable>>(body) {
        Ok(review) => match TryInto::<AdmissionRequest<Guardable>>::try_into(review) {
            Ok(request) => return Ok(request),
            Err(err) => err.to_string(),
        },
        Err(err) => err.to_string(),
    };
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|err| Unreadable::NotAReview(format!("the body is not JSON: {err}")))?;
    match value.pointer("/request/uid").and_then(|u| u.as_str()) {
        Some(uid) => {
            Err(Unreadable::Malformed { uid: uid.to_string(), message: format!("kube-fence cannot read this AdmissionReview: {error}") })
        }
        None => Err(Unreadable::NotAReview("not an AdmissionReview: request.uid is missing".into())),
    }
}

/// The AdmissionResponse that carries `verdict`.
pub fn response<K: Resource>(request: &AdmissionRequest<K>, verdict: &Verdict) -> AdmissionResponse {
    let mut response = AdmissionResponse::from(request);
    match verdict {
        Verdict::Allow { .. } => {}
        Verdict::AllowWithWarning { message, .. } => response.warnings = Some(vec![message.clone()]),
        Verdict::Deny { code, reason, message } => {
            response.allowed = false;
            response.result = Status::failure(message, reason.as_str()).with_code(*code);
        }
    }
    response
}

/// An object under admission as fencing reads it: name, namespace, labels and annotations.
///
/// Every other field (a ConfigMap's data, a Deployment's spec, managedFields) is skipped while
/// the review is parsed, never copied: the decision does not depend on it. Parsing whole objects
/// into `DynamicObject`s (a `serde_json::Value` per field, buffered twice by serde's flatten)
/// was most of the webhook's work for large objects; see benches/fence.
#[derive(Clone, Debug, Default, serde::Serialize, serde::Deserialize)]
#[serde(from = "GuardableWire")]
pub struct Guardable {
    pub metadata: ObjectMeta,
}

#[derive(serde::Deserialize)]
struct GuardableWire {
    #[serde(default)]
    metadata: MetadataWire,
}

/// The metadata fields fencing and logging read; the rest is skipped unread.
#[derive(Default, serde::Deserialize)]
struct MetadataWire {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    labels: Option<std::collections::BTreeMap<String, String>>,
    annotations: Option<std::collections::BTreeMap<String, String>>,
}

impl From<GuardableWire> for Guardable {
    fn from(wire: GuardableWire) -> Guardable {
        let MetadataWire { name, namespace, uid, labels, annotations } = wire.metadata;
        Guardable { metadata: ObjectMeta { name, namespace, uid, labels, annotations, ..ObjectMeta::default() } }
    }
}

/// Any kind: the webhook is registered for every resource, and judges them alike.
impl Resource for Guardable {
    type DynamicType = ();
    type Scope = DynamicResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }
    fn group(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }
    fn version(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }
    fn plural(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// Reduces a review to the facts the decision needs.
pub fn request_facts<K: Resource>(request: &AdmissionRequest<K>) -> decision::Request {
    let facts = |obj: &K| ObjectFacts {
        lease: obj.meta().labels.as_ref().and_then(|l| l.get(LEASE_LABEL)).cloned(),
        token: obj.meta().annotations.as_ref().and_then(|a| a.get(TOKEN_ANNOTATION)).cloned(),
    };
    let delete_precondition = request
        .options
        .as_ref()
        .and_then(|o| o.0.pointer("/preconditions/resourceVersion"))
        .and_then(|rv| rv.as_str())
        .is_some_and(|rv| !rv.is_empty());
    decision::Request {
        operation: match request.operation {
            KubeOperation::Create => Operation::Create,
            KubeOperation::Update => Operation::Update,
            KubeOperation::Delete => Operation::Delete,
            KubeOperation::Connect => Operation::Connect,
        },
        namespace: request.namespace.clone().unwrap_or_default(),
        old: request.old_object.as_ref().map(facts),
        new: request.object.as_ref().map(facts),
        user: request.user_info.username.clone().unwrap_or_default(),
        delete_precondition,
    }
}

fn record(metrics: &Metrics, verdict: &Verdict, started: Instant) {
    metrics.decisions.get_or_create(&DecisionLabels { verdict: verdict.kind(), reason: verdict.reason().as_str() }).inc();
    metrics.latency.observe(started.elapsed().as_secs_f64());
}

async fn validate(State(webhook): State<Arc<Webhook>>, headers: http::HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    // Refuse an oversized body from its declared length, before reading any of it.
    let declared = headers.get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > MAX_BODY_BYTES as u64) {
        return (StatusCode::PAYLOAD_TOO_LARGE, format!("the body exceeds {MAX_BODY_BYTES} bytes\n")).into_response();
    }
    let body: Bytes = match axum::body::to_bytes(body, MAX_BODY_BYTES).await {
        Ok(body) => body,
        Err(err) => {
            return (StatusCode::PAYLOAD_TOO_LARGE, format!("cannot read the body (at most {MAX_BODY_BYTES} bytes): {err}\n"))
                .into_response();
        }
    };
    let request = match decode(&body) {
        Ok(request) => request,
        Err(Unreadable::NotAReview(message)) => {
            return (
                StatusCode::BAD_REQUEST,
                format!(
                    "{message}
"
                ),
            )
                .into_response();
        }
        Err(Unreadable::Malformed { uid, message }) => {
            // The API server sent something we cannot read: deny (fail closed) and say why.
            let verdict = Verdict::Deny { code: 400, reason: Reason::MalformedRequest, message: message.clone() };
            record(&webhook.metrics, &verdict, started);
            tracing::warn!(uid, error = %message, "malformed AdmissionReview denied");
            let mut response = AdmissionResponse::invalid(message);
            response.uid = uid;
            response.result = response.result.with_code(400);
            response.result.reason = Reason::MalformedRequest.as_str().into();
            return axum::Json(response.into_review()).into_response();
        }
    };
    let (verdict, response) = webhook.review(&request).await;
    record(&webhook.metrics, &verdict, started);
    let (kind, ns, name) = (request.kind.kind.as_str(), request.namespace.as_deref().unwrap_or(""), request.name.as_str());
    let user = request.user_info.username.as_deref().unwrap_or("");
    match &verdict {
        Verdict::Allow { reason } => tracing::debug!(kind, ns, name, user, op = ?request.operation, %reason, "admitted"),
        Verdict::AllowWithWarning { reason, message } => {
            tracing::warn!(kind, ns, name, user, op = ?request.operation, %reason, message, "admitted with a warning (enforcement Warn)")
        }
        Verdict::Deny { code, reason, message } => {
            tracing::info!(kind, ns, name, user, op = ?request.operation, code, %reason, message, "denied");
            if let Some(events) = &webhook.events {
                events.publish(&request, *reason, message);
            }
        }
    }
    axum::Json(response.into_review()).into_response()
}

/// The routes.
pub fn router(webhook: Arc<Webhook>, registry: Arc<Registry>) -> Router {
    let ready = webhook.clone();
    Router::new()
        .route(super::registration::PATH, post(validate))
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
/// ten seconds).
pub async fn serve(
    listener: TcpListener,
    tls: RustlsConfig,
    router: Router,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    listener.set_nonblocking(true)?;
    let handle = axum_server::Handle::new();
    let stopper = handle.clone();
    tokio::spawn(async move {
        shutdown.await;
        stopper.graceful_shutdown(Some(Duration::from_secs(10)));
    });
    let mut server = axum_server::from_tcp_rustls(listener, tls)?.handle(handle).first_request_timeout(HEADER_READ_TIMEOUT);
    // The API server sends whole requests at once; a client that trickles its headers
    // (slowloris) must not keep the webhook's connections, so headers get a deadline.
    server.http_builder().http1().header_read_timeout(Some(HEADER_READ_TIMEOUT));
    server.serve(router.into_make_service()).await
}

/// Everything one webhook process serves, given its lease directory (whose cache future the
/// caller runs). Returns when `shutdown` resolves.
pub async fn run(
    leases: LeaseDirectory,
    listener: TcpListener,
    tls: RustlsConfig,
    exempt: Exemptions,
    metrics: Metrics,
    registry: Arc<Registry>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let events = Some(RejectionEvents::new(leases.client(), instance_name()));
    let webhook = Arc::new(Webhook { exempt, leases, metrics, events });
    serve(listener, tls, router(webhook, registry), shutdown).await
}

/// This replica's name for Events: the Pod name when running in a cluster, else host and pid.
pub fn instance_name() -> String {
    std::env::var("POD_NAME").ok().filter(|n| !n.is_empty()).unwrap_or_else(|| format!("kube-fence-{}", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn review(object: serde_json::Value) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
                        "resource": {"group": "", "version": "v1", "resource": "configmaps"},
                        "name": "x", "namespace": "ns", "operation": "CREATE", "userInfo": {"username": "alice"},
                        "object": object}
        }))
        .unwrap_or_default()
    }

    #[test]
    fn decode_reads_a_review_in_one_pass() {
        let body = review(
            serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "labels": {LEASE_LABEL: "work"}, "annotations": {TOKEN_ANNOTATION: "7"}}}),
        );
        let request = decode(&body).map_err(|e| format!("{e:?}")).unwrap();
        assert_eq!(request.uid, "u-1");
        let facts = request_facts(&request);
        assert_eq!(facts.new, Some(ObjectFacts::guarded("work", Some("7"))));
        let response = response(&request, &Verdict::Allow { reason: Reason::Fenced });
        assert!(response.allowed);
        assert_eq!(response.uid, "u-1");
    }

    #[test]
    fn decode_tells_unreadable_requests_from_non_reviews() {
        assert!(matches!(decode(b"not json"), Err(Unreadable::NotAReview(m)) if m.contains("not JSON")));
        assert!(
            matches!(decode(br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#), Err(Unreadable::NotAReview(m)) if m.contains("uid"))
        );
        // Annotations that are not strings: the review is known (uid), its object unreadable.
        let bad = review(
            serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "annotations": {TOKEN_ANNOTATION: 5}}}),
        );
        assert!(matches!(decode(&bad), Err(Unreadable::Malformed { uid, .. }) if uid == "u-1"));
    }
}
