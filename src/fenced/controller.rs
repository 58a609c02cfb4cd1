//! The FencedController status controller: thin glue around [`super::status::desired`].
//!
//! It reads only from watch caches — the FencedControllers, the `coordination.k8s.io` Leases,
//! the Pods (trimmed to their ServiceAccount and `hostNetwork`) and the one writers configuration
//! (`<configuration>-writers`) — so judging a fence costs the API server nothing; it writes only
//! a status that changed (server-side apply on the status subresource, field manager
//! [`FIELD_MANAGER`]), and publishes an Event on the FencedController only when Ready's status or
//! reason changes (through the crate's one publisher, within [`EVENTS_PER_SECOND`]).
//!
//! A fence is judged again when it changes, when a Lease a fence names changes holder, when a Pod
//! a holder names comes, goes or changes ServiceAccount or `hostNetwork`, when the writers
//! configuration changes, and every [`RESYNC`] in any case. Bounded: kube-runtime's applier runs
//! at most [`MAX_CONCURRENT_RECONCILES`] at once and merges the requests for one fence, so a flood
//! of 1,000 FencedControllers is at most that many status writes in flight.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::{StreamExt, TryStreamExt, stream};
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::{Lease as CoordinationLease, LeaseSpec};
use k8s_openapi::api::core::v1::{Pod, PodSpec};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, Patch, PatchParams};
use kube::runtime::controller::{self as runtime, Action};
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Client, Resource, ResourceExt};
use kube_fence_api::{FencedController, FencedControllerStatus};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use super::status::{self, Facts, LeaseFact, PodFact, Routing};
use crate::admission::judge::fence::Fence;
use crate::admission::judge::identity::IdentityRule;
use crate::admission::registration::routing;
use crate::events::{Event, EventType, Publisher, Reporter};
use crate::lease::controller::Beside;
use crate::limit::Buckets;
use crate::telemetry::Chain;

/// The field manager of the status writes.
pub const FIELD_MANAGER: &str = "kube-fence-fenced-status";
/// How often every fence is judged again without a change (routing changes show within it).
pub const RESYNC: Duration = Duration::from_secs(10);
/// Reconciles in flight at once (each reads caches, and writes at most one status).
pub const MAX_CONCURRENT_RECONCILES: u16 = 8;
/// Events a second, in all (and at most this many at once after a quiet spell).
pub const EVENTS_PER_SECOND: u32 = 20;
/// The `reportingController` of the Events.
pub const REPORTER: &str = "kube-fence-controller";
/// How long a reconcile waits for the caches' first lists before it is retried.
const SYNC_WAIT: Duration = Duration::from_secs(5);
/// Back-off after a failed reconcile.
const ERROR_RETRY: Duration = Duration::from_secs(2);
/// How long a stopping controller may take to finish its running reconciles.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// What the status controller watches and judges by.
#[derive(Clone, Debug)]
pub struct StatusOptions {
    /// FencedControllers (and Leases and Pods) of this namespace only; `None`: all.
    pub namespace: Option<String>,
    /// kube-fence's ValidatingWebhookConfiguration: the writers are routed in
    /// `<configuration>-writers` ([`routing::configuration_name`]).
    pub configuration: String,
    /// How a holder identity names a Pod (`--leader-identity-separator`).
    pub identity: IdentityRule,
    /// This replica, in the Events' `reportingInstance`.
    pub instance: String,
}

/// The status controller's metrics (no per-fence labels: fences are unbounded).
#[derive(Clone, Debug, Default)]
pub struct Metrics {
    pub status_writes: Counter,
    pub reconcile_errors: Counter,
    pub events_suppressed: Counter,
}

impl Metrics {
    /// Registers the metrics under `kube_fence_fenced_status_*`.
    pub fn register(registry: &mut Registry) -> Metrics {
        let metrics = Metrics::default();
        let r = registry.sub_registry_with_prefix("kube_fence_fenced_status");
        r.register("writes", "FencedController statuses written (each a change)", metrics.status_writes.clone());
        r.register("reconcile_errors", "FencedController reconciles that failed (retried)", metrics.reconcile_errors.clone());
        r.register(
            "events_suppressed",
            "Events on FencedControllers not published: over the Event budget",
            metrics.events_suppressed.clone(),
        );
        metrics
    }
}

/// What can go wrong judging one FencedController.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("the watch caches of Leases, Pods and the writers configuration have not listed within {0:?}")]
    NotSynced(Duration),
    #[error("writing the status of FencedController {0}")]
    WriteStatus(String, #[source] kube::Error),
}

/// The answers of `routing::routes_in` for one version of the writers configuration: its match
/// condition can be large (hundreds of KiB), and every fence is judged every [`RESYNC`].
#[derive(Default)]
struct Routed {
    version: Option<String>,
    answers: HashMap<String, bool>,
}

struct Context {
    client: Client,
    writers: String,
    identity: IdentityRule,
    leases: Store<CoordinationLease>,
    pods: Store<Pod>,
    configurations: Store<ValidatingWebhookConfiguration>,
    routed: Mutex<Routed>,
    events: Publisher<()>,
    metrics: Metrics,
}

impl Context {
    fn routes(&self, applied: &ValidatingWebhookConfiguration, user: &str) -> bool {
        let mut memo = self.routed.lock().unwrap_or_else(PoisonError::into_inner);
        if memo.version != applied.metadata.resource_version {
            *memo = Routed { version: applied.metadata.resource_version.clone(), answers: HashMap::new() };
        }
        *memo.answers.entry(user.to_string()).or_insert_with(|| routing::routes_in(applied, user))
    }

    async fn synced(&self) -> Result<(), Error> {
        let all = async {
            let _ = self.leases.wait_until_ready().await;
            let _ = self.pods.wait_until_ready().await;
            let _ = self.configurations.wait_until_ready().await;
        };
        tokio::time::timeout(SYNC_WAIT, all).await.map_err(|_| Error::NotSynced(SYNC_WAIT))
    }
}

fn api<K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>>(client: &Client, namespace: Option<&str>) -> Api<K> {
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

/// Keeps only what a fence is judged by: who holds the Lease.
fn trim_lease(lease: &mut CoordinationLease) {
    let ObjectMeta { name, namespace, resource_version, .. } = std::mem::take(&mut lease.metadata);
    lease.metadata = ObjectMeta { name, namespace, resource_version, ..Default::default() };
    let holder_identity = lease.spec.take().and_then(|s| s.holder_identity);
    lease.spec = Some(LeaseSpec { holder_identity, ..Default::default() });
}

/// Keeps only what a holder Pod is judged by: its ServiceAccount and `hostNetwork`.
fn trim_pod(pod: &mut Pod) {
    let ObjectMeta { name, namespace, uid, resource_version, .. } = std::mem::take(&mut pod.metadata);
    pod.metadata = ObjectMeta { name, namespace, uid, resource_version, ..Default::default() };
    pod.spec = pod.spec.take().map(|s| PodSpec {
        service_account_name: s.service_account_name,
        host_network: s.host_network,
        ..Default::default()
    });
    pod.status = None;
}

fn pod_facts(pod: &Pod) -> (Option<&str>, bool) {
    let spec = pod.spec.as_ref();
    (spec.and_then(|s| s.service_account_name.as_deref()), spec.and_then(|s| s.host_network).unwrap_or(false))
}

fn holder_of(lease: &CoordinationLease) -> Option<&str> {
    lease.spec.as_ref().and_then(|s| s.holder_identity.as_deref())
}

/// What a watch event changed that fences are judged by.
enum Touched {
    /// A relist completed: anything may have.
    All,
    /// These objects (namespace, name).
    Some(Vec<(String, String)>),
}

/// What `event` touches, compared with what `store` had before it: `changed` says whether an
/// applied object differs from the cached one in what matters.
fn touched<K>(store: &Store<K>, event: &watcher::Event<K>, changed: impl Fn(&K, &K) -> bool) -> Touched
where
    K: Resource<DynamicType = ()> + Clone + 'static,
{
    let key = |obj: &K| (obj.meta().namespace.clone().unwrap_or_default(), obj.meta().name.clone().unwrap_or_default());
    match event {
        watcher::Event::Apply(obj) => match store.get(&ObjectRef::from_obj(obj)) {
            Some(before) if !changed(&before, obj) => Touched::Some(vec![]),
            _ => Touched::Some(vec![key(obj)]),
        },
        watcher::Event::Delete(obj) => Touched::Some(vec![key(obj)]),
        watcher::Event::InitDone => Touched::All,
        watcher::Event::Init | watcher::Event::InitApply(_) => Touched::Some(vec![]),
    }
}

/// The fences a trigger concerns.
fn fences_for(fences: &Store<FencedController>, which: impl Fn(&FencedController) -> bool) -> Vec<ObjectRef<FencedController>> {
    fences.state().iter().filter(|f| which(f)).map(|f| ObjectRef::from_obj(&**f)).collect()
}

/// Runs the status controller until `stop` is cancelled.
pub async fn run(client: Client, options: StatusOptions, metrics: Metrics, stop: CancellationToken) {
    let ns = options.namespace.as_deref();
    let (fences, fence_writer) = reflector::store::<FencedController>();
    let (leases, mut lease_writer) = reflector::store::<CoordinationLease>();
    let (pods, mut pod_writer) = reflector::store::<Pod>();
    let (configurations, configuration_writer) = reflector::store::<ValidatingWebhookConfiguration>();
    let writers = routing::configuration_name(&options.configuration);
    let identity = options.identity.clone();

    let fence_queue = watcher(api::<FencedController>(&client, ns), watcher::Config::default())
        .modify(|f: &mut FencedController| f.metadata.managed_fields = None)
        .default_backoff()
        .reflect(fence_writer)
        .applied_objects()
        .map_ok(|f| ObjectRef::from_obj(&f))
        .boxed();

    let lease_queue = {
        let (store, fences) = (leases.clone(), fences.clone());
        watcher(api::<CoordinationLease>(&client, ns), watcher::Config::default())
            .modify(trim_lease)
            .default_backoff()
            .map_ok(move |event| {
                let touched = touched(&store, &event, |a, b| holder_of(a) != holder_of(b));
                lease_writer.apply_watcher_event(&event);
                let refs = match touched {
                    Touched::All => fences_for(&fences, |_| true),
                    Touched::Some(keys) if keys.is_empty() => vec![],
                    Touched::Some(keys) => fences_for(&fences, |f| {
                        keys.iter().any(|(ns, name)| f.metadata.namespace.as_deref() == Some(ns) && &f.spec.lease == name)
                    }),
                };
                stream::iter(refs.into_iter().map(Ok))
            })
            .try_flatten()
            .boxed()
    };

    let pod_queue = {
        let (store, fences, leases, identity) = (pods.clone(), fences.clone(), leases.clone(), identity.clone());
        watcher(api::<Pod>(&client, ns), watcher::Config::default())
            .modify(trim_pod)
            .default_backoff()
            .map_ok(move |event| {
                let touched = touched(&store, &event, |a, b| pod_facts(a) != pod_facts(b));
                pod_writer.apply_watcher_event(&event);
                let refs = match touched {
                    Touched::All => fences_for(&fences, |_| true),
                    Touched::Some(keys) if keys.is_empty() => vec![],
                    Touched::Some(keys) => fences_for(&fences, |f| {
                        let Some(namespace) = f.metadata.namespace.as_deref() else { return false };
                        let lease = leases.get(&ObjectRef::new(&f.spec.lease).within(namespace));
                        let pod = lease.as_deref().and_then(holder_of).and_then(|h| status::holder_pod(&identity, h));
                        pod.is_some_and(|pod| keys.iter().any(|(ns, name)| ns == namespace && name == pod))
                    }),
                };
                stream::iter(refs.into_iter().map(Ok))
            })
            .try_flatten()
            .boxed()
    };

    let configuration_queue = {
        let fences = fences.clone();
        let by_name = watcher::Config::default().fields(&format!("metadata.name={writers}"));
        watcher(Api::<ValidatingWebhookConfiguration>::all(client.clone()), by_name)
            .modify(|c: &mut ValidatingWebhookConfiguration| c.metadata.managed_fields = None)
            .default_backoff()
            .reflect(configuration_writer)
            .map_ok(move |event| {
                let refs = match event {
                    watcher::Event::Init | watcher::Event::InitApply(_) => vec![],
                    _ => fences_for(&fences, |_| true),
                };
                stream::iter(refs.into_iter().map(Ok))
            })
            .try_flatten()
            .boxed()
    };

    let resync = {
        let fences = fences.clone();
        let ticks = tokio::time::interval_at(tokio::time::Instant::now() + RESYNC, RESYNC);
        stream::unfold(ticks, |mut ticks| async move {
            ticks.tick().await;
            Some(((), ticks))
        })
        .flat_map(move |()| stream::iter(fences_for(&fences, |_| true).into_iter().map(Ok)))
        .boxed()
    };

    let queue =
        stream::select_all([fence_queue, lease_queue, pod_queue, configuration_queue, resync]).take_until(stop.clone().cancelled_owned());
    let reporter = Reporter { controller: REPORTER.to_string(), instance: Some(options.instance.clone()) };
    let budget = Buckets::with_max_keys(EVENTS_PER_SECOND, EVENTS_PER_SECOND, 1);
    let events = Publisher::new(client.clone(), reporter, budget, metrics.events_suppressed.clone());
    let context = Arc::new(Context {
        client,
        writers,
        identity,
        leases,
        pods,
        configurations,
        routed: Mutex::new(Routed::default()),
        events,
        metrics,
    });
    tracing::debug!(namespace = ns.unwrap_or("<all>"), configuration = %context.writers, "FencedController status controller running");
    let config = runtime::Config::default().concurrency(MAX_CONCURRENT_RECONCILES);
    let running = runtime::applier(|f, ctx| Box::pin(reconcile(f, ctx)), error_policy, context, fences, queue, config).for_each(
        |result| async move {
            match result {
                Ok(_) | Err(runtime::Error::ReconcilerFailed(..)) => {}
                Err(err) => tracing::warn!(err = %Chain(&err), "FencedController status controller"),
            }
        },
    );
    // Graceful shutdown lets running reconciles finish; bounded, because a controller stopped
    // before its first list completed waits for a store that never fills.
    let bounded = async {
        stop.cancelled().await;
        tokio::time::sleep(SHUTDOWN_GRACE).await;
    };
    tokio::select! {
        _ = running => {}
        _ = bounded => tracing::warn!(grace = ?SHUTDOWN_GRACE, "the FencedController status controller did not stop within its grace period; stopped"),
    }
}

/// Judges one FencedController from the caches, writes its status if it changed, and reports a
/// transition of Ready.
async fn reconcile(fenced: Arc<FencedController>, ctx: Arc<Context>) -> Result<Action, Error> {
    ctx.synced().await?;
    let fence = Fence::of(&fenced);
    let namespace = fenced.namespace().unwrap_or_default();
    let lease = fence.as_ref().ok().and_then(|f| ctx.leases.get(&ObjectRef::new(&f.lease).within(&f.namespace)));
    let lease_fact = match &lease {
        None => LeaseFact::NotFound,
        Some(lease) => LeaseFact::Found { holder: holder_of(lease) },
    };
    let pod = lease_fact
        .holder()
        .and_then(|h| status::holder_pod(&ctx.identity, h))
        .and_then(|pod| ctx.pods.get(&ObjectRef::new(pod).within(&namespace)));
    let holder_pod = match pod.as_deref().map(pod_facts) {
        None => PodFact::NotFound,
        Some((service_account, host_network)) => PodFact::Found { service_account: service_account.unwrap_or("default"), host_network },
    };
    let applied = ctx.configurations.get(&ObjectRef::new(&ctx.writers));
    let routing = match &fence {
        Ok(fence) => Routing::of(fence, applied.as_deref(), |user| applied.as_deref().is_some_and(|a| ctx.routes(a, user))),
        Err(_) => Routing::NoConfiguration,
    };
    let facts = Facts { lease: lease_fact, holder_pod, routing, configuration: &ctx.writers, identity: &ctx.identity };
    let desired = status::desired(&fenced, &fence, &facts, Timestamp::now());
    if fenced.status.as_ref() == Some(&desired) {
        return Ok(Action::await_change());
    }
    if !write_status(&ctx.client, &fenced, &desired).await? {
        return Ok(Action::await_change());
    }
    ctx.metrics.status_writes.inc();
    if let Some(transition) = status::transition(fenced.status.as_ref(), &desired) {
        let name = fenced.name_any();
        tracing::info!(namespace, name, ready = transition.ready, reason = transition.reason, "FencedController Ready changed");
        let mut regarding = fenced.object_ref(&());
        // The object, not one version of it.
        regarding.resource_version = None;
        ctx.events.publish(
            (),
            Event {
                regarding,
                type_: if transition.ready { EventType::Normal } else { EventType::Warning },
                reason: transition.reason,
                action: "Reconcile".to_string(),
                note: transition.note,
            },
        );
    }
    Ok(Action::await_change())
}

/// The one place the controller writes: the status, by server-side apply. `Ok(false)` when the
/// FencedController is gone.
async fn write_status(client: &Client, fenced: &FencedController, desired: &FencedControllerStatus) -> Result<bool, Error> {
    let namespace = fenced.namespace().unwrap_or_default();
    let name = fenced.name_any();
    let api: Api<FencedController> = Api::namespaced(client.clone(), &namespace);
    let body = serde_json::json!({
        "apiVersion": FencedController::api_version(&()),
        "kind": FencedController::kind(&()),
        "metadata": {"name": name, "namespace": namespace},
        "status": desired,
    });
    match api.patch_status(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&body)).await {
        Ok(_) => Ok(true),
        Err(kube::Error::Api(s)) if s.is_not_found() => Ok(false),
        Err(source) => Err(Error::WriteStatus(format!("{namespace}/{name}"), source)),
    }
}

fn error_policy(fenced: Arc<FencedController>, err: &Error, ctx: Arc<Context>) -> Action {
    ctx.metrics.reconcile_errors.inc();
    let name = format!("{}/{}", fenced.namespace().unwrap_or_default(), fenced.name_any());
    match err {
        Error::NotSynced(_) => tracing::debug!(fenced = name, err = %Chain(err), "waiting for the caches"),
        Error::WriteStatus(..) => tracing::warn!(fenced = name, err = %Chain(err), "FencedController status not written; retrying"),
    }
    Action::requeue(ERROR_RETRY)
}

/// The status controller as work beside the lease controller's reconciles: started with them
/// (under leader election, each term) and stopped with them.
pub fn beside(client: Client, options: StatusOptions, metrics: Metrics) -> Beside {
    Beside::new(move |stop| run(client.clone(), options.clone(), metrics.clone(), stop))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_caches_keep_only_what_a_fence_is_judged_by() {
        let mut pod: Pod = serde_json::from_value(serde_json::json!({"metadata": {"name": "p1", "namespace": "team", "uid": "u",
            "labels": {"a": "b"}, "annotations": {"c": "d"}},
            "spec": {"serviceAccountName": "ctl", "hostNetwork": true, "containers": [{"name": "c", "image": "i"}]},
            "status": {"phase": "Running"}}))
        .expect("a pod");
        trim_pod(&mut pod);
        assert_eq!(pod_facts(&pod), (Some("ctl"), true));
        assert_eq!((pod.metadata.labels, pod.status, pod.spec.map(|s| s.containers.len())), (None, None, Some(0)));
        let mut lease: CoordinationLease = serde_json::from_value(serde_json::json!({"metadata": {"name": "l", "namespace": "team",
            "annotations": {"a": "b"}}, "spec": {"holderIdentity": "p1_x", "leaseDurationSeconds": 15}}))
        .expect("a lease");
        trim_lease(&mut lease);
        assert_eq!(holder_of(&lease), Some("p1_x"));
        assert_eq!((lease.metadata.annotations, lease.spec.and_then(|s| s.lease_duration_seconds)), (None, None));
    }
}
