//! The Lease controller: thin glue around [`state::decide`].
//!
//! One place reads (the watch behind kube-runtime's `Controller`), one place writes
//! (`write_status`: `replace_status` carrying the observed resourceVersion, i.e. a
//! compare-and-swap). A conflict means somebody wrote a newer version — a client, or another
//! controller replica — so the lease is judged again on that version; the controller never
//! overwrites what it did not see. Requeues happen exactly at expiry, never by polling.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use kube_fence::lease::controller::{self, ControllerOptions};
//! let client = kube::Client::try_default().await?;
//! let mut registry = prometheus_client::registry::Registry::default();
//! let options = ControllerOptions::new("controller-0");
//! // Registers the metrics now; the returned future borrows nothing, so the registry can be
//! // served (e.g. by `telemetry::serve_metrics`) while the controller runs.
//! let controller = controller::run(client, options, &mut registry, async { let _ = tokio::signal::ctrl_c().await; });
//! controller.await?;
//! # Ok(()) }
//! ```

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::{StreamExt, TryStreamExt};
use k8s_openapi::api::coordination::v1::Lease as CoordinationLease;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use kube::runtime::controller::{self as runtime, Action};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, ResourceExt};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use super::events::{LeaseEvents, Report};
use super::leader::{self, ElectionConfig};
use super::state::{self, Observed, Transition};
use crate::telemetry::Chain;
use kube_fence_api::{Lease, LeaseStatus};

/// Name of the controller in Events (`reportingController`) and of the leader-election Lease.
pub const CONTROLLER_NAME: &str = "kube-fence-controller";

/// How soon to judge a lease again after losing a compare-and-swap (the watch usually delivers
/// the newer version sooner; this is the fallback).
const CONFLICT_RETRY: Duration = Duration::from_millis(200);
/// Reconciles (each at most one status write) in flight at once. Unbounded, a burst of claims
/// opens one API server connection per concurrent write (hundreds under churn, each with its TLS
/// state and buffers); more than this does not make a 2-core API server write faster.
const MAX_CONCURRENT_RECONCILES: u16 = 32;
/// Back-off after an unexpected error.
const ERROR_RETRY: Duration = Duration::from_secs(1);

/// How the controller runs.
#[derive(Clone, Debug)]
pub struct ControllerOptions {
    /// Watch Leases in this namespace only; `None` for all namespaces.
    pub namespace: Option<String>,
    /// Identity of this replica (pod name): reported in Events and used for leader election.
    pub identity: String,
    /// Run only while leading (coordination.k8s.io/v1 Lease). For efficiency only.
    pub leader_election: bool,
    /// Namespace of the leader-election Lease; defaults to `namespace`, else `default`.
    pub leader_election_namespace: Option<String>,
    /// Name of the leader-election Lease.
    pub leader_election_name: String,
    /// Timing of the election.
    pub lease_duration: Duration,
    pub renew_deadline: Duration,
    pub retry_period: Duration,
    /// Keep the policy path's parameter ConfigMaps (`super::params`), while reconciling.
    pub policy_params: bool,
    /// Other work that runs while the reconciles do (under leader election, only while this
    /// replica leads): the FencedController status, composed by the command line.
    pub beside: Option<Beside>,
}

/// Work that runs beside the lease controller's reconciles: started with them (each leadership
/// term) and stopped with them, by the token it is given.
#[derive(Clone)]
pub struct Beside(Arc<dyn Fn(CancellationToken) -> BoxedWork + Send + Sync>);

type BoxedWork = std::pin::Pin<Box<dyn Future<Output = ()> + Send>>;

impl Beside {
    /// `work(stop)` is started with each run of the reconciles; it must end once `stop` is cancelled.
    pub fn new<F>(work: impl Fn(CancellationToken) -> F + Send + Sync + 'static) -> Beside
    where
        F: Future<Output = ()> + Send + 'static,
    {
        Beside(Arc::new(move |stop| Box::pin(work(stop))))
    }
}

impl std::fmt::Debug for Beside {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Beside(..)")
    }
}

impl ControllerOptions {
    pub fn new(identity: impl Into<String>) -> Self {
        let election = ElectionConfig::new(CONTROLLER_NAME, "");
        ControllerOptions {
            namespace: None,
            identity: identity.into(),
            leader_election: false,
            leader_election_namespace: None,
            leader_election_name: CONTROLLER_NAME.to_string(),
            lease_duration: election.lease_duration,
            renew_deadline: election.renew_deadline,
            retry_period: election.retry_period,
            policy_params: false,
            beside: None,
        }
    }

    pub fn namespace(mut self, namespace: impl Into<String>) -> Self {
        self.namespace = Some(namespace.into());
        self
    }

    pub fn policy_params(mut self, enabled: bool) -> Self {
        self.policy_params = enabled;
        self
    }

    pub fn leader_election(mut self, enabled: bool) -> Self {
        self.leader_election = enabled;
        self
    }
}

/// What can go wrong while reconciling one Lease. The variants name the action that failed; the
/// message leaves the source out, which the chain of causes tells ([`crate::telemetry::Chain`]).
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("writing the status of Lease {lease}")]
    WriteStatus {
        lease: String,
        #[source]
        source: kube::Error,
    },
    #[error("the Lease has no name or namespace")]
    Unaddressable,
    #[error("the reconcile panicked")]
    Panicked,
}

impl Error {
    /// Metric label / log field for the variant.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::WriteStatus { .. } => "write_status",
            Error::Unaddressable => "unaddressable",
            Error::Panicked => "panicked",
        }
    }
}

/// The controller's metrics. Counters carry no per-lease labels (lease names are unbounded).
#[derive(Clone, Debug)]
pub struct Metrics {
    pub grants: Counter,
    pub renewals: Counter,
    pub releases: Counter,
    pub expiries: Counter,
    pub refusals: Counter,
    pub conflicts: Counter,
    pub reconcile_errors: Counter,
    /// Events not published: over the Event budget or too many in flight.
    pub events_suppressed: Counter,
    pub leases_held: Gauge,
    pub reconcile_duration: Histogram,
    /// 1 while this replica's reconciles run (it leads, or runs without leader election).
    pub leading: Gauge,
}

impl Metrics {
    /// Registers the metrics under `kube_fence_lease_*`.
    pub fn register(registry: &mut Registry) -> Metrics {
        let metrics = Metrics {
            grants: Counter::default(),
            renewals: Counter::default(),
            releases: Counter::default(),
            expiries: Counter::default(),
            refusals: Counter::default(),
            conflicts: Counter::default(),
            reconcile_errors: Counter::default(),
            events_suppressed: Counter::default(),
            leases_held: Gauge::default(),
            reconcile_duration: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            leading: Gauge::default(),
        };
        let r = registry.sub_registry_with_prefix("kube_fence_lease");
        r.register("grants", "Grants made (each with a fresh, greater token)", metrics.grants.clone());
        r.register("renewals", "Heartbeats observed by the controller (the token is kept)", metrics.renewals.clone());
        r.register("releases", "Leases released by their holder", metrics.releases.clone());
        r.register("expiries", "Leases expired because no heartbeat was observed within the duration", metrics.expiries.clone());
        r.register("refusals", "Claims not granted because no greater token could be derived", metrics.refusals.clone());
        r.register("status_conflicts", "Status compare-and-swaps lost to a newer version (judged again)", metrics.conflicts.clone());
        r.register("reconcile_errors", "Reconciles that failed", metrics.reconcile_errors.clone());
        r.register("events_suppressed", "Events on Leases not published: over the Event budget", metrics.events_suppressed.clone());
        r.register("held", "Leases currently held, as last observed", metrics.leases_held.clone());
        r.register("reconcile_duration_seconds", "Time to judge a Lease and write its status", metrics.reconcile_duration.clone());
        r.register(
            "leading",
            "1 while this replica's reconciles run (it leads, or runs without leader election), else 0",
            metrics.leading.clone(),
        );
        metrics
    }

    fn count(&self, transition: &Transition) {
        match transition {
            Transition::Grant { .. } => self.grants.inc(),
            Transition::Renew { .. } => self.renewals.inc(),
            Transition::Release { .. } => self.releases.inc(),
            Transition::Expire { .. } => self.expiries.inc(),
            Transition::Refuse { .. } => self.refusals.inc(),
            Transition::Nothing => 0,
        };
    }
}

struct Context {
    client: Client,
    events: LeaseEvents,
    metrics: Metrics,
}

/// Keeps `kube_fence_lease_held` equal to the number of held leases in the controller's cache,
/// from the change each watch event makes, rather than by scanning the cache per reconcile.
struct HeldGauge {
    store: Store<Lease>,
    gauge: Gauge,
}

impl HeldGauge {
    fn held(lease: Option<&Lease>) -> i64 {
        i64::from(lease.is_some_and(|l| kube_fence_api::state::held(l.status.as_ref()).is_some()))
    }

    /// Before the cache applies `event` (it still has the version the event replaces).
    fn before(&self, event: &watcher::Event<Lease>) {
        let (new, key) = match event {
            watcher::Event::Apply(lease) => (Some(lease), ObjectRef::from_obj(lease)),
            watcher::Event::Delete(lease) => (None, ObjectRef::from_obj(lease)),
            // A relist replaces the whole cache at InitDone: counted after it.
            _ => return,
        };
        let old = self.store.get(&key);
        self.gauge.inc_by(Self::held(new) - Self::held(old.as_deref()));
    }

    /// After the cache applied `event`: a relist is counted once, in full.
    fn after(&self, event: &watcher::Event<Lease>) {
        if let watcher::Event::InitDone = event {
            let held = self.store.state().iter().filter(|l| Self::held(Some(l)) == 1).count();
            self.gauge.set(i64::try_from(held).unwrap_or(i64::MAX));
        }
    }
}

/// Drops what the controller never reads from its cached Leases: managedFields (the largest
/// part of a small object) and annotations. The status write is a compare-and-swap on the
/// status subresource, which takes only `status` (and the resourceVersion) from what is sent.
fn trim(lease: &mut Lease) {
    lease.metadata.managed_fields = None;
    lease.metadata.annotations = None;
}

/// Registers the controller's metrics into `registry` now, and returns the controller as a
/// future that borrows nothing (so the caller can go on to serve the registry). The future runs
/// until `shutdown` resolves; with `leader_election` it reconciles only while this replica leads.
///
/// This is an `fn` returning a future rather than an `async fn` so that the `&mut Registry`
/// borrow ends at registration.
pub fn run(
    client: Client,
    options: ControllerOptions,
    registry: &mut Registry,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> impl Future<Output = Result<(), Error>> + Send + 'static {
    let metrics = Metrics::register(registry);
    async move {
        let stop = CancellationToken::new();
        let trigger = stop.clone();
        tokio::spawn(async move {
            shutdown.await;
            trigger.cancel();
        });
        if !options.leader_election {
            return reconcile_until(client, &options, metrics, stop).await;
        }
        let election_ns =
            options.leader_election_namespace.clone().or_else(|| options.namespace.clone()).unwrap_or_else(|| "default".to_string());
        let config = ElectionConfig {
            name: options.leader_election_name.clone(),
            identity: options.identity.clone(),
            lease_duration: options.lease_duration,
            renew_deadline: options.renew_deadline,
            retry_period: options.retry_period,
        };
        let api: Api<CoordinationLease> = Api::namespaced(client.clone(), &election_ns);
        // Each term gets its own child token: losing leadership drops the term's future, and
        // shutdown cancels them all.
        let work = || reconcile_until(client.clone(), &options, metrics.clone(), stop.child_token());
        leader::run_while_leader(api, config, work, stop.clone().cancelled_owned()).await.unwrap_or(Ok(()))
    }
}

/// How long a stopping controller may take to finish its running reconciles.
const SHUTDOWN_GRACE: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs the kube-runtime Controller until `stop` is cancelled.
async fn reconcile_until(client: Client, options: &ControllerOptions, metrics: Metrics, stop: CancellationToken) -> Result<(), Error> {
    // 0 again when this ends, also when a lost leadership term drops it.
    struct Leading(Gauge);
    impl Drop for Leading {
        fn drop(&mut self) {
            self.0.set(0);
        }
    }
    metrics.leading.set(1);
    let _leading = Leading(metrics.leading.clone());
    let leases: Api<Lease> = match &options.namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    // Stopped with this function, also when a lost leadership term drops it.
    let _params = options.policy_params.then(|| {
        let params = stop.child_token();
        tokio::spawn(super::params::maintain(client.clone(), options.namespace.clone(), params.clone()));
        params.drop_guard()
    });
    let _beside = options.beside.as_ref().map(|Beside(work)| {
        let beside = stop.child_token();
        tokio::spawn(work(beside.clone()));
        beside.drop_guard()
    });
    // kube-runtime's `Controller` over a trimmed watch: the same applier (one reconcile per
    // Lease at a time, requeues, waiting for the first list), with a smaller cache.
    let (store, writer) = reflector::store();
    let held = Arc::new(HeldGauge { store: store.clone(), gauge: metrics.leases_held.clone() });
    let held_after = held.clone();
    let queue = watcher(leases, watcher::Config::default())
        .modify(trim)
        .default_backoff()
        .inspect_ok(move |event| held.before(event))
        .reflect(writer)
        .inspect_ok(move |event| held_after.after(event))
        .applied_objects()
        .map_ok(|lease| ObjectRef::from_obj(&lease))
        .take_until(stop.clone().cancelled_owned());
    let events = LeaseEvents::new(client.clone(), CONTROLLER_NAME, &options.identity, metrics.events_suppressed.clone());
    let context = Arc::new(Context { events, client, metrics });
    tracing::info!(namespace = options.namespace.as_deref().unwrap_or("<all>"), identity = %options.identity, "lease controller running");
    let config = runtime::Config::default().concurrency(MAX_CONCURRENT_RECONCILES);
    let running = runtime::applier(Spawned::reconcile, error_policy, context, store, queue, config).for_each(|result| async move {
        match result {
            Ok(_) => {}
            Err(runtime::Error::ReconcilerFailed(err, obj)) => {
                tracing::warn!(lease = %obj, reason = err.reason(), err = %Chain(&err), "reconcile failed")
            }
            Err(err) => tracing::warn!(%err, "lease controller"),
        }
    });
    // Graceful shutdown lets running reconciles finish; bound it, because a controller stopped
    // before its first list completed waits for a store that never fills.
    let bounded = async {
        stop.cancelled().await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    tokio::select! {
        _ = running => {}
        _ = bounded => tracing::warn!(grace = ?SHUTDOWN_GRACE, "the lease controller did not stop within its grace period; stopped"),
    }
    Ok(())
}

/// Judges one Lease at the controller's now, writes the decided status (compare-and-swap),
/// reports it, and schedules the next look exactly at expiry.
async fn reconcile(lease: Arc<Lease>, ctx: Arc<Context>) -> Result<Action, Error> {
    let started = Instant::now();
    let now = Timestamp::now();
    let decision = state::decide(&Observed::of(&lease), now);
    let result = match decision.status.clone() {
        None => Ok(true),
        Some(status) => write_status(&ctx.client, &lease, status).await,
    };
    ctx.metrics.reconcile_duration.observe(started.elapsed().as_secs_f64());

    match result? {
        false => {
            ctx.metrics.conflicts.inc();
            tracing::debug!(lease = %state::display_name(&lease), "status compare-and-swap lost; judging the newer version");
            return Ok(Action::requeue(CONFLICT_RETRY));
        }
        true if decision.status.is_some() => {
            ctx.metrics.count(&decision.transition);
            report(&ctx, &lease, &decision.transition);
        }
        true => {}
    }
    Ok(match decision.requeue_at {
        Some(at) => {
            let wait = now.duration_until(at);
            // A few ms past the (whole-second) expiry, so the next judgement sees now >= expiry.
            Action::requeue(Duration::try_from(wait).unwrap_or(Duration::ZERO) + Duration::from_millis(5))
        }
        None => Action::await_change(),
    })
}

/// The one place the controller writes: the status, as a compare-and-swap on the observed
/// resourceVersion. `Ok(false)` when a newer version exists (or the Lease is gone).
async fn write_status(client: &Client, lease: &Lease, status: LeaseStatus) -> Result<bool, Error> {
    let (Some(ns), Some(name)) = (lease.namespace(), lease.metadata.name.clone()) else {
        return Err(Error::Unaddressable);
    };
    let api: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let mut next = lease.clone();
    next.metadata.managed_fields = None;
    next.status = Some(status);
    match api.replace_status(&name, &PostParams::default(), &next).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.is_conflict() || s.is_not_found() => Ok(false),
        Err(source) => Err(Error::WriteStatus { lease: format!("{ns}/{name}"), source }),
    }
}

/// Logs the transition and publishes an Event for grants, expiries, releases and refusals (not
/// for renewals: they happen every few seconds per lease and would drown the rest). Events are
/// published off the reconcile path and within a budget ([`LeaseEvents`]).
fn report(ctx: &Context, lease: &Lease, transition: &Transition) {
    let name = state::display_name(lease);
    let (warning, note) = match transition {
        Transition::Grant { holder, token } => {
            tracing::info!(lease = %name, %holder, %token, "granted");
            (false, format!("granted to {holder} with token {token}"))
        }
        Transition::Release { holder, token } => {
            tracing::info!(lease = %name, %holder, %token, "released");
            (false, format!("released by {holder} (token {token})"))
        }
        Transition::Expire { holder, token } => {
            tracing::info!(lease = %name, %holder, %token, "expired");
            (false, format!("{holder} did not renew in time; token {token} is no longer held"))
        }
        Transition::Refuse { holder, refusal } => {
            tracing::warn!(lease = %name, %holder, %refusal, "grant refused");
            (true, format!("cannot grant to {holder}: {refusal}"))
        }
        Transition::Renew { holder, token } => {
            tracing::debug!(lease = %name, %holder, %token, "renewed");
            return;
        }
        Transition::Nothing => return,
    };
    ctx.events.publish(lease, Report { warning, reason: transition.reason(), note });
}

/// A reconcile running as its own task (as kube-runtime's `Controller` runs them), so reconciles
/// use every worker thread. Dropped (the controller stopped), the task is aborted; a panic in it
/// is a failed reconcile, not a crash.
struct Spawned(tokio::task::JoinHandle<Result<Action, Error>>);

impl Spawned {
    fn reconcile(lease: Arc<Lease>, ctx: Arc<Context>) -> Spawned {
        Spawned(tokio::spawn(reconcile(lease, ctx)))
    }
}

impl Future for Spawned {
    type Output = Result<Action, Error>;
    fn poll(mut self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> std::task::Poll<Self::Output> {
        std::pin::Pin::new(&mut self.0).poll(cx).map(|joined| joined.unwrap_or(Err(Error::Panicked)))
    }
}

impl Drop for Spawned {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn error_policy(lease: Arc<Lease>, err: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics.reconcile_errors.inc();
    tracing::warn!(lease = %state::display_name(&lease), reason = err.reason(), err = %Chain(err), "reconcile failed; retrying");
    Action::requeue(ERROR_RETRY)
}
