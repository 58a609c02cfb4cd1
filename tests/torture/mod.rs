//! The fault driver: many workers use leases and fenced writes while faults are injected, a
//! recorder keeps every grant and every accepted write, and the history checker
//! ([`kube_fence_test_support::history::check`]) judges the history afterwards.
//!
//! It owns its control plane (etcd + kube-apiserver on loopback, [`kube_fence_testenv`]) because
//! it restarts them; it runs the lease controller and the webhook in this process, so it can
//! kill, double and restart them. Used by the short run CI does (`tests/faults.rs`) and by the
//! long one (`hack/torture.sh`); only [`Config`] differs.
//!
//! A worker's cycle: acquire (`kube_fence::client`) → read a guarded object → write it with the
//! token (a merge patch without a resourceVersion precondition, so fencing is the only guard) →
//! release, with random short pauses in between. Some cycles are *pause cycles*: the worker
//! stops heartbeating and writing for longer than the lease duration (what SIGSTOP does to a
//! process), then lets its delayed write go. Some workers have a clock an hour off and write
//! their heartbeats by hand with it.
//!
//! Every grant is recorded twice — by a watch on the Leases and by the worker that received it
//! — and so is every accepted write (a watch on the guarded objects, and the response the
//! worker got, which carries the committed resourceVersion), so neither a missed watch event
//! nor a lost response hides anything from the checker.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, ObjectMeta, Patch, PatchParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Client, ResourceExt};
use kube_fence::admission::http::server::Metrics as WebhookMetrics;
use kube_fence::admission::local::{LocalOptions, LocalWebhook};
use kube_fence::client::{self as fence, AcquireOptions, Grant, Leases};
use kube_fence::lease::controller::{self, ControllerOptions};
use kube_fence_api::names::{LEASE_LABEL, TOKEN_ANNOTATION};
use kube_fence_api::token::Token;
use kube_fence_api::{Comparison, FencingPolicy, Lease, LeaseSpec, Phase};
use kube_fence_test_support::history::{self, Observation, Violation};
use prometheus_client::registry::Registry;
use serde_json::json;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::common;

pub mod ha;

/// How big a run is. Every loop is bounded by count and by `max_duration`.
#[derive(Clone, Debug)]
pub struct Config {
    pub workers: usize,
    /// Leases; every third one opts into `AllowEqual` (several writes per grant).
    pub leases: usize,
    /// Guarded ConfigMaps bound to each lease.
    pub objects_per_lease: usize,
    /// How many times a normal cycle writes each object under an `AllowEqual` lease (once under `Strict`).
    pub equal_rounds: usize,
    pub lease_seconds: u32,
    /// The run ends when all of these are reached (and every fault kind was injected)...
    pub min_writes: u64,
    pub min_pauses: u64,
    /// Rounds of control-plane faults (each round: every kind once).
    pub min_fault_rounds: u64,
    /// ...or fails when this much time passed first.
    pub max_duration: Duration,
    /// Chance that a worker's cycle is a pause cycle, in percent.
    pub pause_percent: u64,
    /// Chance that a cycle is run by a clock-skewed client, in percent.
    pub skew_percent: u64,
    /// Quiet time between two control-plane faults.
    pub fault_gap: Duration,
    pub seed: u64,
}

impl Config {
    /// The version CI runs on every change: every fault kind once, a few hundred writes.
    pub fn short() -> Config {
        Config {
            workers: 8,
            leases: 4,
            objects_per_lease: 3,
            equal_rounds: 4,
            lease_seconds: 1,
            min_writes: 250,
            min_pauses: 20,
            min_fault_rounds: 1,
            max_duration: Duration::from_secs(100),
            pause_percent: 25,
            skew_percent: 10,
            fault_gap: Duration::from_millis(1_500),
            seed: seed_from_env(),
        }
    }

    /// The long version; sizes from `KF_TORTURE_*` environment variables.
    pub fn long_from_env() -> Config {
        let n = |name: &str, default: u64| std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default);
        Config {
            workers: n("KF_TORTURE_WORKERS", 32) as usize,
            leases: n("KF_TORTURE_LEASES", 16) as usize,
            objects_per_lease: n("KF_TORTURE_OBJECTS", 4) as usize,
            equal_rounds: n("KF_TORTURE_EQUAL_ROUNDS", 4) as usize,
            lease_seconds: n("KF_TORTURE_LEASE_SECONDS", 1) as u32,
            min_writes: n("KF_TORTURE_WRITES", 10_000),
            min_pauses: n("KF_TORTURE_PAUSES", 1_000),
            min_fault_rounds: n("KF_TORTURE_FAULT_ROUNDS", 5),
            max_duration: Duration::from_secs(n("KF_TORTURE_MAX_SECONDS", 1_500)),
            pause_percent: n("KF_TORTURE_PAUSE_PERCENT", 35),
            skew_percent: n("KF_TORTURE_SKEW_PERCENT", 10),
            fault_gap: Duration::from_secs(n("KF_TORTURE_FAULT_GAP_SECONDS", 10)),
            seed: seed_from_env(),
        }
    }
}

fn seed_from_env() -> u64 {
    std::env::var("KF_TORTURE_SEED")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1))
}

/// A small deterministic generator (splitmix64): one per worker, seeded from the run's seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
    fn percent(&mut self, p: u64) -> bool {
        self.below(100) < p
    }
    fn millis(&mut self, from: u64, to: u64) -> Duration {
        Duration::from_millis(from + self.below(to.saturating_sub(from) + 1))
    }
}

/// The kinds of fault, as counted in the table.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Fault {
    /// A worker stopped past its lease, then sent its delayed write.
    WorkerPaused,
    /// A client with a clock an hour off heartbeated, then stopped past its lease and wrote.
    ClockSkewedClient,
    /// The lease controller killed (its task aborted mid-flight) and started again.
    ControllerKilled,
    /// Two controller replicas reconciling at once (no leader election).
    TwoControllers,
    /// The webhook stopped (fail closed) and started again with a new certificate.
    WebhookRestarted,
    /// kube-apiserver killed (SIGKILL) and started again.
    ApiServerRestarted,
    /// etcd killed (SIGKILL) and started again.
    EtcdRestarted,
}

impl Fault {
    pub const ALL: [Fault; 7] = [
        Fault::WorkerPaused,
        Fault::ClockSkewedClient,
        Fault::ControllerKilled,
        Fault::TwoControllers,
        Fault::WebhookRestarted,
        Fault::ApiServerRestarted,
        Fault::EtcdRestarted,
    ];
    /// The faults the driver's fault task injects, round after round.
    const CONTROL_PLANE: [Fault; 5] =
        [Fault::ControllerKilled, Fault::TwoControllers, Fault::WebhookRestarted, Fault::ApiServerRestarted, Fault::EtcdRestarted];

    fn describe(self) -> &'static str {
        match self {
            Fault::WorkerPaused => "worker paused past its lease, then wrote",
            Fault::ClockSkewedClient => "client clock skewed by 1 h (heartbeats, then paused)",
            Fault::ControllerKilled => "controller killed and restarted",
            Fault::TwoControllers => "two controller replicas at once",
            Fault::WebhookRestarted => "webhook restarted",
            Fault::ApiServerRestarted => "kube-apiserver killed (-9) and restarted",
            Fault::EtcdRestarted => "etcd killed (-9) and restarted",
        }
    }
}

/// What the workers saw, counted as it happens.
#[derive(Default)]
struct Counters {
    writes_ok: AtomicU64,
    stale_rejected: AtomicU64,
    pause_writes_rejected: AtomicU64,
    pause_writes_accepted: AtomicU64,
    skewed_heartbeats: AtomicU64,
    skew_expired: AtomicU64,
    write_errors: AtomicU64,
    acquire_errors: AtomicU64,
    faults: Mutex<BTreeMap<Fault, u64>>,
}

impl Counters {
    fn fault(&self, fault: Fault) {
        if let Ok(mut f) = self.faults.lock() {
            *f.entry(fault).or_default() += 1;
        }
    }
    fn faults_of(&self, fault: Fault) -> u64 {
        self.faults.lock().map(|f| f.get(&fault).copied().unwrap_or(0)).unwrap_or(0)
    }
}

/// The recorded history (from watches and from the workers).
#[derive(Clone, Default)]
struct Recorder {
    history: Arc<Mutex<Vec<Observation>>>,
    /// Newest resourceVersion the object watch delivered (to know when it caught up).
    watched: Arc<AtomicU64>,
}

impl Recorder {
    fn push(&self, o: Observation) {
        if let Ok(mut h) = self.history.lock() {
            h.push(o);
        }
    }
    fn snapshot(&self) -> Vec<Observation> {
        self.history.lock().map(|h| h.clone()).unwrap_or_default()
    }
    fn grant(&self, grant: &Grant) {
        // The token is the resourceVersion of the claim the grant was judged on, and the grant's
        // status write is that version's immediate successor: as a commit position it is exact.
        self.push(Observation::Grant {
            lease: grant.lease.clone(),
            holder: grant.holder.clone(),
            token: grant.token,
            resource_version: grant.token.get(),
        });
    }
    fn write(&self, cm: &ConfigMap) {
        let lease = cm.labels().get(LEASE_LABEL).cloned();
        let token = cm.annotations().get(TOKEN_ANNOTATION).and_then(|t| t.parse::<Token>().ok());
        let rv = version_of(cm);
        if let (Some(lease), Some(token), Some(resource_version)) = (lease, token, rv) {
            self.push(Observation::Write { object: cm.name_any(), lease, token, resource_version });
        }
    }
}

/// The outcome of a run.
pub struct Report {
    pub config: Config,
    pub elapsed: Duration,
    pub writes_accepted: u64,
    pub grants: u64,
    pub faults: BTreeMap<Fault, u64>,
    pub stale_rejected: u64,
    pub pause_writes_rejected: u64,
    pub pause_writes_accepted: u64,
    pub skewed_heartbeats: u64,
    pub skew_expired: u64,
    pub write_errors: u64,
    pub acquire_errors: u64,
    pub observations: usize,
    pub violations: Vec<Violation>,
}

impl Report {
    pub fn fault(&self, fault: Fault) -> u64 {
        self.faults.get(&fault).copied().unwrap_or(0)
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let c = &self.config;
        writeln!(
            f,
            "kube-fence under faults: {} workers, {} leases x {} objects, lease {} s, seed {}, {:.0} s",
            c.workers,
            c.leases,
            c.objects_per_lease,
            c.lease_seconds,
            c.seed,
            self.elapsed.as_secs_f64()
        )?;
        writeln!(f)?;
        writeln!(f, "| measure | count |")?;
        writeln!(f, "| --- | ---: |")?;
        writeln!(f, "| writes accepted | {} |", self.writes_accepted)?;
        writeln!(f, "| grants | {} |", self.grants)?;
        for fault in Fault::ALL {
            writeln!(f, "| fault: {} | {} |", fault.describe(), self.fault(fault))?;
        }
        writeln!(f, "| stale writes rejected (409 StaleToken) | {} |", self.stale_rejected)?;
        writeln!(f, "| ... of them delayed writes after a pause | {} |", self.pause_writes_rejected)?;
        writeln!(f, "| delayed writes accepted (no newer write in between) | {} |", self.pause_writes_accepted)?;
        writeln!(f, "| clock-skewed heartbeats written | {} |", self.skewed_heartbeats)?;
        writeln!(f, "| skewed holders expired on the controller's clock | {} |", self.skew_expired)?;
        writeln!(f, "| writes failed closed / unavailable (not accepted) | {} |", self.write_errors)?;
        writeln!(f, "| acquires failed or timed out (retried) | {} |", self.acquire_errors)?;
        writeln!(f, "| observations checked | {} |", self.observations)?;
        writeln!(f, "| **violations** | **{}** |", self.violations.len())?;
        for v in self.violations.iter().take(20) {
            writeln!(f, "  - {v}")?;
        }
        Ok(())
    }
}

/// A control plane of the driver's own, owned by one long-lived thread: its processes are bound
/// to that thread with `PR_SET_PDEATHSIG`, so they die with the test however it ends, and
/// restarts are spawned from the same thread.
/// A restart request: the component's name, and where to send the outcome.
type RestartRequest = (String, tokio::sync::oneshot::Sender<Result<(), String>>);

struct Plane {
    commands: Option<std::sync::mpsc::Sender<RestartRequest>>,
    thread: Option<std::thread::JoinHandle<()>>,
    kubeconfig: PathBuf,
}

impl Plane {
    fn start() -> Result<Plane, String> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (tx, rx) = std::sync::mpsc::channel::<RestartRequest>();
        let thread = std::thread::Builder::new()
            .name("kube-fence-fault-plane".into())
            .spawn(move || {
                let options =
                    kube_fence_testenv::Options { die_with_parent: true, controller_manager: false, verbose: false, ..Default::default() };
                let mut cp = match kube_fence_testenv::ControlPlane::start(options) {
                    Ok(cp) => cp,
                    Err(e) => {
                        let _ = ready_tx.send(Err(format!("{e:#}")));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(cp.kubeconfig.clone()));
                while let Ok((component, reply)) = rx.recv() {
                    let _ = reply.send(cp.restart(&component).map_err(|e| format!("{e:#}")));
                }
                cp.stop();
            })
            .map_err(|e| e.to_string())?;
        let kubeconfig = ready_rx.recv().map_err(|e| e.to_string())??;
        Ok(Plane { commands: Some(tx), thread: Some(thread), kubeconfig })
    }

    async fn restart(&self, component: &str) -> Result<(), String> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.commands.as_ref().ok_or("stopped")?.send((component.to_string(), tx)).map_err(|e| e.to_string())?;
        rx.await.map_err(|e| e.to_string())?
    }
}

impl Drop for Plane {
    fn drop(&mut self) {
        self.commands.take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

async fn wait_api(client: &Client, ns: &str) {
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    let deadline = Instant::now() + Duration::from_secs(120);
    while leases.list(&Default::default()).await.is_err() {
        assert!(Instant::now() < deadline, "the API did not come back within 120 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A lease controller replica in this process; dropping or killing it aborts its task.
struct ControllerReplica {
    task: JoinHandle<()>,
    stop: CancellationToken,
}

impl ControllerReplica {
    fn start(client: &Client, ns: &str, identity: &str) -> ControllerReplica {
        let stop = CancellationToken::new();
        let run = controller::run(
            client.clone(),
            ControllerOptions::new(identity).namespace(ns).policy_params(common::policy_path()),
            &mut Registry::default(),
            stop.clone().cancelled_owned(),
        );
        let task = tokio::spawn(async move {
            if let Err(err) = run.await {
                eprintln!("controller ended with an error: {err}");
            }
        });
        ControllerReplica { task, stop }
    }

    /// Aborts the task where it is (a write in flight may or may not land), like `kill -9`.
    fn kill(self) {
        self.task.abort();
        self.stop.cancel();
    }
}

struct Hook {
    webhook: Option<LocalWebhook>,
    options: LocalOptions,
}

impl Hook {
    async fn start(client: &Client, ns: &str) -> Hook {
        let mut options = LocalOptions::new(format!("kf-faults-{ns}"));
        options.webhook.scope.only_namespaces = Some(vec![ns.to_string()]);
        options.policy_path = common::policy_path();
        let mut hook = Hook { webhook: None, options };
        hook.serve(client).await;
        hook
    }

    async fn serve(&mut self, client: &Client) {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let mut registry = Registry::default();
            let metrics = WebhookMetrics::register(&mut registry);
            match LocalWebhook::start(client.clone(), self.options.clone(), metrics, Arc::new(registry)).await {
                Ok(webhook) => {
                    // Serve the same URL again after a restart, as a restarted pod behind a Service would.
                    self.options.port = webhook.addr.port();
                    self.webhook = Some(webhook);
                    return;
                }
                Err(err) if Instant::now() < deadline => {
                    eprintln!("webhook start failed ({err}); retrying");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(err) => panic!("the webhook did not start within 120 s: {err}"),
            }
        }
    }

    async fn restart(&mut self, client: &Client, down: Duration) {
        if let Some(w) = self.webhook.take() {
            w.crash().await;
        }
        tokio::time::sleep(down).await;
        self.serve(client).await;
    }

    async fn stop(mut self, client: &Client) {
        if let Some(w) = self.webhook.take() {
            let _ = w.stop(client).await;
        }
    }
}

/// Records every Lease status that shows a holder, and every version of a guarded object.
fn record(client: &Client, ns: &str, recorder: &Recorder, stop: &CancellationToken) -> Vec<JoinHandle<()>> {
    record_with(client, ns, recorder, stop, watcher::DefaultBackoff::default, Recorder::write)
}

/// [`record`], with the watches' `backoff` (made for each watch) and what records a version of a
/// guarded object (`object`; it then counts as watched): the HA run's recorder is this one with
/// a steady backoff and holder-only writes recorded too.
fn record_with<B>(
    client: &Client,
    ns: &str,
    recorder: &Recorder,
    stop: &CancellationToken,
    backoff: fn() -> B,
    object: fn(&Recorder, &ConfigMap),
) -> Vec<JoinHandle<()>>
where
    B: kube::runtime::utils::Backoff + Send + 'static,
{
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let (r1, r2, s1, s2) = (recorder.clone(), recorder.clone(), stop.clone(), stop.clone());
    let lease_task = tokio::spawn(async move {
        let mut events = watcher::watcher(leases, watcher::Config::default()).backoff(backoff()).boxed();
        loop {
            let event = tokio::select! { _ = s1.cancelled() => return, e = events.next() => e };
            let Some(event) = event else { return };
            if let Ok(Event::Apply(lease) | Event::InitApply(lease)) = event {
                let status = lease.status.clone().unwrap_or_default();
                let rv = version_of(&lease);
                if let (Phase::Held, Some(holder), Some(token), Some(resource_version)) = (status.phase, status.holder, status.token, rv) {
                    r1.push(Observation::Grant { lease: lease.name_any(), holder, token, resource_version });
                }
            }
        }
    });
    let object_task = tokio::spawn(async move {
        let mut events = watcher::watcher(cms, watcher::Config::default().labels(LEASE_LABEL)).backoff(backoff()).boxed();
        loop {
            let event = tokio::select! { _ = s2.cancelled() => return, e = events.next() => e };
            let Some(event) = event else { return };
            if let Ok(Event::Apply(cm) | Event::InitApply(cm)) = event {
                object(&r2, &cm);
                if let Some(rv) = version_of(&cm) {
                    r2.watched.fetch_max(rv, Ordering::Relaxed);
                }
            }
        }
    });
    vec![lease_task, object_task]
}

/// An object's resourceVersion as a number (etcd's revision: the order the record keeps), or
/// `None` when it has none or another form.
pub fn version_of(object: &impl ResourceExt) -> Option<u64> {
    object.resource_version()?.parse().ok()
}

fn lease_name(i: usize) -> String {
    format!("work-{i}")
}
fn object_name(lease: usize, j: usize) -> String {
    format!("state-{lease}-{j}")
}
fn allows_equal(lease: usize) -> bool {
    lease % 3 == 2
}

struct World {
    client: Client,
    ns: String,
    config: Config,
    counters: Counters,
    recorder: Recorder,
    stop: CancellationToken,
}

impl World {
    fn leases(&self) -> Leases {
        Leases::new(self.client.clone(), &self.ns)
    }
    fn objects(&self) -> Api<ConfigMap> {
        Api::namespaced(self.client.clone(), &self.ns)
    }
    fn acquire_options(&self) -> AcquireOptions {
        AcquireOptions::default().duration(Duration::from_secs(u64::from(self.config.lease_seconds))).timeout(Duration::from_secs(10))
    }

    /// One fenced write: read the object, change it, merge-patch it with the token (no
    /// resourceVersion precondition: fencing alone decides). `Ok(true)`: accepted;
    /// `Ok(false)`: rejected as stale.
    async fn write(&self, grant: &Grant, object: &str, read: Option<ConfigMap>, note: &str) -> Result<bool, ()> {
        let api = self.objects();
        let read = match read {
            Some(r) => r,
            None => match bounded(api.get(object)).await {
                Some(Ok(r)) => r,
                _ => {
                    self.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                    return Err(());
                }
            },
        };
        let seq = read.data.as_ref().and_then(|d| d.get("seq")).and_then(|s| s.parse::<u64>().ok()).unwrap_or(0) + 1;
        let patch = json!({"data": {"seq": seq.to_string(), "writer": grant.holder, "note": note}});
        match bounded(grant.patch(&api, object, &PatchParams::default(), Patch::Merge(patch))).await {
            Some(Ok(written)) => {
                self.recorder.write(&written);
                self.counters.writes_ok.fetch_add(1, Ordering::Relaxed);
                Ok(true)
            }
            Some(Err(fence::Error::StaleToken { .. })) => {
                self.counters.stale_rejected.fetch_add(1, Ordering::Relaxed);
                Ok(false)
            }
            _ => {
                self.counters.write_errors.fetch_add(1, Ordering::Relaxed);
                Err(())
            }
        }
    }

    async fn acquire(&self, lease: &str, holder: &str) -> Option<Grant> {
        match bounded(self.leases().acquire(lease, holder, self.acquire_options())).await {
            Some(Ok(grant)) => {
                self.recorder.grant(&grant);
                Some(grant)
            }
            _ => {
                self.counters.acquire_errors.fetch_add(1, Ordering::Relaxed);
                None
            }
        }
    }

    async fn release(&self, grant: &Grant) {
        let _ = bounded(self.leases().release(grant)).await;
    }

    /// The lease duration plus a little: long enough that the controller expires the lease.
    fn past_the_lease(&self, rng: &mut Rng) -> Duration {
        Duration::from_secs(u64::from(self.config.lease_seconds)) + rng.millis(200, 1_200)
    }

    async fn worker(self: Arc<World>, id: usize) {
        let mut rng = Rng(self.config.seed ^ (id as u64).wrapping_mul(0xA24B_AED4_963E_E407));
        let holder = format!("worker-{id}");
        while !self.stop.is_cancelled() {
            let lease = rng.below(self.config.leases as u64) as usize;
            let objects: Vec<String> = (0..self.config.objects_per_lease).map(|j| object_name(lease, j)).collect();
            let Some(grant) = self.acquire(&lease_name(lease), &holder).await else {
                tokio::time::sleep(rng.millis(50, 300)).await;
                continue;
            };
            tokio::time::sleep(rng.millis(0, 20)).await;
            if rng.percent(self.config.skew_percent) {
                self.skewed_cycle(&grant, &objects, &mut rng).await;
            } else if rng.percent(self.config.pause_percent) {
                self.pause_cycle(&grant, &objects, &mut rng).await;
            } else {
                self.normal_cycle(&grant, &objects, allows_equal(lease), &mut rng).await;
            }
            self.release(&grant).await;
            tokio::time::sleep(rng.millis(0, 30)).await;
        }
    }

    /// Heartbeats in the background and writes each object (several times under AllowEqual).
    async fn normal_cycle(&self, grant: &Grant, objects: &[String], allow_equal: bool, rng: &mut Rng) {
        let keep_alive = self.leases().keep_alive(grant);
        let rounds = if allow_equal { self.config.equal_rounds } else { 1 };
        'writing: for _ in 0..rounds {
            for object in objects {
                if !matches!(keep_alive.holding(), fence::Holding::Held { .. }) {
                    break 'writing;
                }
                if self.write(grant, object, None, "normal").await != Ok(true) {
                    break 'writing;
                }
                tokio::time::sleep(rng.millis(0, 10)).await;
            }
        }
        keep_alive.stop().await;
    }

    /// Read, then stop — no heartbeat, no write — past the lease, then send the delayed write.
    async fn pause_cycle(&self, grant: &Grant, objects: &[String], rng: &mut Rng) {
        let object = &objects[rng.below(objects.len() as u64) as usize];
        let Some(Ok(read)) = bounded(self.objects().get(object)).await else {
            self.counters.write_errors.fetch_add(1, Ordering::Relaxed);
            return;
        };
        tokio::time::sleep(self.past_the_lease(rng)).await;
        self.counters.fault(Fault::WorkerPaused);
        match self.write(grant, object, Some(read), "delayed").await {
            Ok(true) => self.counters.pause_writes_accepted.fetch_add(1, Ordering::Relaxed),
            Ok(false) => self.counters.pause_writes_rejected.fetch_add(1, Ordering::Relaxed),
            Err(()) => 0,
        };
    }

    /// A client whose clock is an hour off: it heartbeats by hand with that clock (an hour
    /// ahead or behind), writes, then stops past the lease and writes again. The controller
    /// judges expiry on its own clock, so the lease expires regardless; the delayed write is
    /// fenced like any other.
    async fn skewed_cycle(&self, grant: &Grant, objects: &[String], rng: &mut Rng) {
        let skew = if rng.percent(50) { SignedDuration::from_hours(1) } else { SignedDuration::from_hours(-1) };
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), &self.ns);
        for beat in 0..2u32 {
            tokio::time::sleep(Duration::from_millis(u64::from(self.config.lease_seconds) * 1000 / 3)).await;
            match skewed_heartbeat(&leases, grant, skew, beat, BOUND).await {
                Some(true) => {
                    self.counters.skewed_heartbeats.fetch_add(1, Ordering::Relaxed);
                }
                Some(false) => return,
                None => {}
            }
        }
        let object = &objects[rng.below(objects.len() as u64) as usize];
        if self.write(grant, object, None, "skewed").await.is_err() {
            return;
        }
        let Some(Ok(read)) = bounded(self.objects().get(object)).await else { return };
        tokio::time::sleep(self.past_the_lease(rng)).await;
        self.counters.fault(Fault::ClockSkewedClient);
        if let Some(Ok(lease)) = bounded(leases.get(&grant.lease)).await
            && fence::loss(Some(&lease), grant).is_some()
        {
            self.counters.skew_expired.fetch_add(1, Ordering::Relaxed);
        }
        match self.write(grant, object, Some(read), "skewed-delayed").await {
            Ok(true) => self.counters.pause_writes_accepted.fetch_add(1, Ordering::Relaxed),
            Ok(false) => self.counters.pause_writes_rejected.fetch_add(1, Ordering::Relaxed),
            Err(()) => 0,
        };
    }
}

/// One heartbeat by hand from a client whose clock is `skew` off: `spec.heartbeatTime` set to its
/// (skewed) now, `beat` microseconds on so that two beats differ. `Some(true)`: written;
/// `Some(false)`: the grant is lost (nothing written); `None`: the read or the write failed or
/// took longer than `limit`. The controller notices that the heartbeat changed and judges expiry
/// on its own clock, so the value's skew must not matter.
pub(crate) async fn skewed_heartbeat(leases: &Api<Lease>, grant: &Grant, skew: SignedDuration, beat: u32, limit: Duration) -> Option<bool> {
    let mut lease = tokio::time::timeout(limit, leases.get(&grant.lease)).await.ok()?.ok()?;
    if fence::loss(Some(&lease), grant).is_some() {
        return Some(false);
    }
    let skewed = Timestamp::now().saturating_add(skew).unwrap_or(Timestamp::now());
    let beat_time = skewed.saturating_add(SignedDuration::from_micros(i64::from(beat))).unwrap_or(skewed);
    lease.spec.heartbeat_time = Some(MicroTime(beat_time));
    lease.metadata.managed_fields = None;
    tokio::time::timeout(limit, leases.replace(&grant.lease, &PostParams::default(), &lease)).await.ok()?.ok().map(|_| true)
}

/// How long a worker's API call may take.
const BOUND: Duration = Duration::from_secs(20);

/// Every API call of a worker is bounded: a call that hangs through a restart is given up.
async fn bounded<T>(f: impl Future<Output = T>) -> Option<T> {
    tokio::time::timeout(BOUND, f).await.ok()
}

struct Faults {
    plane: Plane,
    controllers: Vec<ControllerReplica>,
    hook: Hook,
    generation: u64,
}

impl Faults {
    fn new_controller(&mut self, world: &World) {
        self.generation += 1;
        self.controllers.push(ControllerReplica::start(&world.client, &world.ns, &format!("controller-{}", self.generation)));
    }

    async fn inject(&mut self, world: &World, fault: Fault, rng: &mut Rng) {
        match fault {
            Fault::ControllerKilled => {
                for c in self.controllers.drain(..) {
                    c.kill();
                }
                tokio::time::sleep(rng.millis(300, 1_500)).await;
                self.new_controller(world);
            }
            Fault::TwoControllers => {
                self.new_controller(world);
                tokio::time::sleep(rng.millis(2_000, 5_000)).await;
                // Keep one of the two, at random.
                let gone = self.controllers.remove(rng.below(self.controllers.len() as u64) as usize);
                gone.kill();
            }
            Fault::WebhookRestarted => self.hook.restart(&world.client, rng.millis(200, 1_000)).await,
            Fault::ApiServerRestarted => {
                self.plane.restart("kube-apiserver").await.expect("restart kube-apiserver");
                wait_api(&world.client, &world.ns).await;
            }
            Fault::EtcdRestarted => {
                self.plane.restart("etcd").await.expect("restart etcd");
                wait_api(&world.client, &world.ns).await;
            }
            Fault::WorkerPaused | Fault::ClockSkewedClient => {}
        }
        world.counters.fault(fault);
    }
}

/// Runs the driver: sets up its own control plane, controller, webhook, leases and guarded
/// objects; runs workers and faults until the config's targets are reached; checks the history.
pub async fn run(config: Config) -> Report {
    let started = Instant::now();
    eprintln!("[faults] starting a control plane of its own (seed {})", config.seed);
    let plane = tokio::task::spawn_blocking(Plane::start).await.expect("control plane thread").expect("start the control plane");
    let client = common::client_for(&plane.kubeconfig).await;
    common::install_crds(client.clone()).await;
    let ns = "faults".to_string();
    let namespaces: Api<k8s_openapi::api::core::v1::Namespace> = Api::all(client.clone());
    let namespace = k8s_openapi::api::core::v1::Namespace {
        metadata: ObjectMeta { name: Some(ns.clone()), ..Default::default() },
        ..Default::default()
    };
    namespaces.create(&PostParams::default(), &namespace).await.expect("create the namespace");

    let world = Arc::new(World {
        client: client.clone(),
        ns: ns.clone(),
        config: config.clone(),
        counters: Counters::default(),
        recorder: Recorder::default(),
        stop: CancellationToken::new(),
    });
    let watch_stop = CancellationToken::new();
    let watchers = record(&client, &ns, &world.recorder, &watch_stop);

    let mut faults = Faults { plane, controllers: vec![], hook: Hook::start(&client, &ns).await, generation: 0 };
    faults.new_controller(&world);
    common::wait_fenced(&client, &ns, &Default::default(), common::Fencing::Judged, Duration::from_secs(60)).await;
    if common::policy_path() {
        common::wait_policy_path(&client, &ns, Duration::from_secs(60)).await;
        eprintln!("[faults] policy path on: fresh-token updates are judged by the API server");
    }

    // The leases, and the guarded objects each one binds, created with a first grant.
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    for i in 0..config.leases {
        let mut spec = LeaseSpec { lease_duration_seconds: Some(config.lease_seconds), ..Default::default() };
        if allows_equal(i) {
            spec.fencing = Some(FencingPolicy { comparison: Some(Comparison::AllowEqual), ..Default::default() });
        }
        leases.create(&PostParams::default(), &Lease::new(&lease_name(i), spec)).await.expect("create a lease");
        let grant = world.acquire(&lease_name(i), "setup").await.expect("first grant");
        for j in 0..config.objects_per_lease {
            let cm = ConfigMap {
                metadata: ObjectMeta { name: Some(object_name(i, j)), ..Default::default() },
                data: Some([("seq".to_string(), "0".to_string())].into()),
                ..Default::default()
            };
            let created = grant.create(&world.objects(), &cm).await.expect("create a guarded object");
            world.recorder.write(&created);
        }
        world.release(&grant).await;
    }
    eprintln!("[faults] set up in {:.1}s; {} workers start", started.elapsed().as_secs_f64(), config.workers);

    let workers: Vec<JoinHandle<()>> = (0..config.workers).map(|id| tokio::spawn(world.clone().worker(id))).collect();
    let mut rng = Rng(config.seed ^ 0xFA17);
    let mut rounds = 0u64;
    let mut last_note = Instant::now();
    let reached = |world: &World, rounds: u64| {
        let c = &world.counters;
        c.writes_ok.load(Ordering::Relaxed) >= config.min_writes
            && c.faults_of(Fault::WorkerPaused) >= config.min_pauses
            && c.faults_of(Fault::ClockSkewedClient) >= 1
            && rounds >= config.min_fault_rounds
    };
    while !reached(&world, rounds) && started.elapsed() < config.max_duration {
        for fault in Fault::CONTROL_PLANE {
            if started.elapsed() >= config.max_duration {
                break;
            }
            tokio::time::sleep(config.fault_gap).await;
            faults.inject(&world, fault, &mut rng).await;
            if last_note.elapsed() > Duration::from_secs(15) {
                let c = &world.counters;
                eprintln!(
                    "[faults] {:.0}s: {} writes, {} pauses, {} stale rejected, {} rounds",
                    started.elapsed().as_secs_f64(),
                    c.writes_ok.load(Ordering::Relaxed),
                    c.faults_of(Fault::WorkerPaused),
                    c.stale_rejected.load(Ordering::Relaxed),
                    rounds
                );
                last_note = Instant::now();
            }
        }
        rounds += 1;
    }

    // Stop the workers (each finishes its cycle; bounded), let the watches catch up, check.
    world.stop.cancel();
    for w in workers {
        if tokio::time::timeout(Duration::from_secs(60), w).await.is_err() {
            eprintln!("[faults] a worker did not finish its cycle within 60 s");
        }
    }
    let newest_write = world
        .recorder
        .snapshot()
        .iter()
        .filter_map(|o| if let Observation::Write { resource_version, .. } = o { Some(*resource_version) } else { None })
        .max()
        .unwrap_or(0);
    let deadline = Instant::now() + Duration::from_secs(20);
    // The object watch has caught up when it delivered a version at least as new as any the workers got.
    while Instant::now() < deadline && world.recorder.watched.load(Ordering::Relaxed) < newest_write {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    watch_stop.cancel();
    for w in watchers {
        let _ = w.await;
    }
    let Faults { plane, controllers, hook, .. } = faults;
    for c in controllers {
        c.kill();
    }
    hook.stop(&client).await;

    let observations = world.recorder.snapshot();
    let equal_objects: HashSet<String> = (0..config.leases)
        .filter(|i| allows_equal(*i))
        .flat_map(|i| (0..config.objects_per_lease).map(move |j| object_name(i, j)))
        .collect();
    let violations = history::check(&observations, |object| equal_objects.contains(object));
    let mut writes = HashSet::new();
    let mut grants = HashSet::new();
    for o in &observations {
        match o {
            Observation::Write { object, resource_version, .. } | Observation::HolderWrite { object, resource_version, .. } => {
                writes.insert((object.clone(), *resource_version));
            }
            Observation::Grant { lease, token, .. } => {
                grants.insert((lease.clone(), *token));
            }
        }
    }
    let c = &world.counters;
    let report = Report {
        config,
        elapsed: started.elapsed(),
        writes_accepted: writes.len() as u64,
        grants: grants.len() as u64,
        faults: c.faults.lock().map(|f| f.clone()).unwrap_or_default(),
        stale_rejected: c.stale_rejected.load(Ordering::Relaxed),
        pause_writes_rejected: c.pause_writes_rejected.load(Ordering::Relaxed),
        pause_writes_accepted: c.pause_writes_accepted.load(Ordering::Relaxed),
        skewed_heartbeats: c.skewed_heartbeats.load(Ordering::Relaxed),
        skew_expired: c.skew_expired.load(Ordering::Relaxed),
        write_errors: c.write_errors.load(Ordering::Relaxed),
        acquire_errors: c.acquire_errors.load(Ordering::Relaxed),
        observations: observations.len(),
        violations,
    };
    drop(plane);
    report
}
