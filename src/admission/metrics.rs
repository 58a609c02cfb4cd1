//! The webhook's metrics (Prometheus text on `/metrics`). No label is per lease or per object:
//! their number is unbounded.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;

use prometheus_client::metrics::gauge::Gauge;

use super::judge::verdict::Verdict;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    verdict: &'static str,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReadLabels {
    read: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RefusalLabels {
    cause: &'static str,
}

/// Which read of a lease judged a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseReadKind {
    Cache,
    Linearizable,
}

/// Why a connection's request was refused before it was judged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// The declared body exceeds the largest review.
    TooLarge,
    /// The in-flight body budget is used up.
    Busy,
    /// The body did not arrive within the deadline.
    SlowBody,
}

impl Refusal {
    fn label(self) -> &'static str {
        match self {
            Refusal::TooLarge => "too_large",
            Refusal::Busy => "busy",
            Refusal::SlowBody => "slow_body",
        }
    }
}

/// The metrics of the connection bounds.
#[derive(Clone, Debug, Default)]
pub struct ConnectionMetrics {
    pub open: Gauge,
    pub refused_total: Counter,
    pub refused_source: Counter,
    pub refused_failing: Counter,
    /// Connections of sources that sent no review recently, refused because the places not kept
    /// for reviewing sources were full (`super::http::bounds::RESERVE_DIVISOR`).
    pub refused_reserved: Counter,
    /// Connections that failed (charged to their source's `super::http::bounds::FailureBudget`).
    pub failed: Counter,
}

/// The webhook's metrics.
#[derive(Clone)]
pub struct Metrics {
    decisions: Family<DecisionLabels, Counter>,
    /// `lease_reads{read="cache"}` and `{read="linearizable"}`, looked up once: every review
    /// counts one.
    cache_reads: Counter,
    linearizable_reads: Counter,
    refusals: Family<RefusalLabels, Counter>,
    latency: Histogram,
    /// How long each quorum read of a lease took (once per read, however many reviews share it).
    quorum_read: Histogram,
    /// Rejection Events not published: the requester's source used up its budget, or too many
    /// Events were in flight (counted by `crate::events::Publisher`).
    pub events_suppressed: Counter,
    /// Certificate reloads (files changed, or the shared Secret changed).
    pub tls_reloads: Counter,
    /// Open connections, and connections closed at once because too many were open.
    pub connections: ConnectionMetrics,
    /// Reviews denied without their quorum read: their source used up its read budget.
    pub reads_throttled: Counter,
}

impl Metrics {
    pub fn register(registry: &mut Registry) -> Metrics {
        // One statement each: the guard `get_or_create` returns must be gone before the next call.
        let lease_reads = Family::<ReadLabels, Counter>::default();
        let cache_reads = lease_reads.get_or_create(&ReadLabels { read: "cache" }).clone();
        let linearizable_reads = lease_reads.get_or_create(&ReadLabels { read: "linearizable" }).clone();
        let refused_connections = Family::<RefusalLabels, Counter>::default();
        let refused_total = refused_connections.get_or_create(&RefusalLabels { cause: "total" }).clone();
        let refused_source = refused_connections.get_or_create(&RefusalLabels { cause: "per_source" }).clone();
        let refused_failing = refused_connections.get_or_create(&RefusalLabels { cause: "failing" }).clone();
        let refused_reserved = refused_connections.get_or_create(&RefusalLabels { cause: "reserved" }).clone();
        let connections = ConnectionMetrics {
            open: Default::default(),
            refused_total,
            refused_source,
            refused_failing,
            refused_reserved,
            failed: Counter::default(),
        };
        let m = Metrics {
            decisions: Family::default(),
            cache_reads,
            linearizable_reads,
            refusals: Family::default(),
            latency: Histogram::new(exponential_buckets(0.000_05, 2.0, 16)),
            quorum_read: Histogram::new(exponential_buckets(0.000_05, 2.0, 16)),
            events_suppressed: Counter::default(),
            tls_reloads: Counter::default(),
            connections,
            reads_throttled: Counter::default(),
        };
        let r = registry.sub_registry_with_prefix("kube_fence_webhook");
        r.register("decisions", "Admission decisions by verdict (allowed, warned, denied) and reason", m.decisions.clone());
        r.register("lease_reads", "Lease reads by kind (cache, linearizable)", lease_reads);
        r.register("refused_requests", "Requests refused before judging, by cause (too_large, busy, slow_body)", m.refusals.clone());
        r.register("decision_duration_seconds", "Time to judge one AdmissionReview, from body received to response", m.latency.clone());
        r.register(
            "quorum_read_duration_seconds",
            "Time of one quorum read of a lease through the API server (shared by the reviews that wait for it)",
            m.quorum_read.clone(),
        );
        r.register(
            "events_suppressed",
            "Rejection Events not published: the source's Event budget was used up, or too many were in flight",
            m.events_suppressed.clone(),
        );
        r.register("tls_reloads", "Serving certificate reloads", m.tls_reloads.clone());
        r.register("open_connections", "Connections open now", m.connections.open.clone());
        r.register(
            "refused_connections",
            "Connections closed as soon as they were accepted: too many open in all (total) or from their source (per_source), or their source used up its budget of failed connections (failing)",
            refused_connections,
        );
        r.register(
            "failed_connections",
            "Connections that failed their TLS handshake or sent bytes but no request, charged to their source's budget",
            m.connections.failed.clone(),
        );
        r.register(
            "reads_throttled",
            "Reviews denied (429 ReadsThrottled) without the quorum read they needed: their source used up its read budget",
            m.reads_throttled.clone(),
        );
        m
    }

    pub fn decided(&self, verdict: &Verdict, seconds: f64) {
        self.decisions.get_or_create(&DecisionLabels { verdict: verdict.kind(), reason: verdict.reason().as_str() }).inc();
        self.latency.observe(seconds);
    }

    pub fn lease_read(&self, kind: LeaseReadKind) {
        match kind {
            LeaseReadKind::Cache => self.cache_reads.inc(),
            LeaseReadKind::Linearizable => self.linearizable_reads.inc(),
        };
    }

    /// One quorum read ended after `seconds`.
    pub fn quorum_read(&self, seconds: f64) {
        self.quorum_read.observe(seconds);
    }

    pub fn refused(&self, refusal: Refusal) {
        self.refusals.get_or_create(&RefusalLabels { cause: refusal.label() }).inc();
    }
}
