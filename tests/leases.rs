//! Leases and fencing tokens on a real control plane.
//!
//! Every test runs in a namespace of its own with a controller scoped to it, running in this
//! process as a tokio task (so a test can kill and restart it). Properties are asserted from a
//! recorded history: a watch on the test's Leases that keeps every status the API server
//! committed. Timings are measured and printed (`--nocapture`), never asserted; the only time
//! limits are generous liveness timeouts.

mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::events::v1::Event as K8sEvent;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, DeleteParams, ListParams, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};

use kube::{Client, ResourceExt};
use kube_fence::client::{AcquireOptions, Error, KeepAliveOptions, Leases, Loss};
use kube_fence::lease::controller::{self, ControllerOptions};
use kube_fence_api::token::Token;
use kube_fence_api::{Lease, Phase};
use kube_fence_test_support::history::{self, Observation};
use prometheus_client::registry::Registry;
use tokio::task::JoinHandle;

/// A lease controller for one namespace, running in this process.
fn start_controller(client: &Client, ns: &str, identity: &str) -> JoinHandle<()> {
    start_controller_with(client, ControllerOptions::new(identity).namespace(ns), &mut Registry::default())
}

fn start_controller_with(client: &Client, options: ControllerOptions, registry: &mut Registry) -> JoinHandle<()> {
    let run = controller::run(client.clone(), options, registry, futures::future::pending());
    tokio::spawn(async move {
        if let Err(err) = run.await {
            panic!("controller failed: {err}");
        }
    })
}

/// One committed status of a Lease, as the watch delivered it.
#[derive(Clone, Debug)]
struct Seen {
    lease: String,
    resource_version: u64,
    phase: Phase,
    holder: Option<String>,
    token: Option<Token>,
}

/// Every status version of every Lease in a namespace, in commit order.
#[derive(Clone, Default)]
struct History(Arc<Mutex<Vec<Seen>>>);

impl History {
    async fn record(client: &Client, ns: &str) -> (History, JoinHandle<()>) {
        let history = History::default();
        let sink = history.clone();
        let api: Api<Lease> = Api::namespaced(client.clone(), ns);
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(async move {
            let mut ready = Some(ready_tx);
            let mut events = watcher::watcher(api, watcher::Config::default()).default_backoff().boxed();
            while let Some(event) = events.next().await {
                let lease = match event {
                    Ok(Event::Apply(l)) | Ok(Event::InitApply(l)) => l,
                    Ok(Event::InitDone) => {
                        if let Some(tx) = ready.take() {
                            let _ = tx.send(());
                        }
                        continue;
                    }
                    _ => continue,
                };
                let status = lease.status.clone().unwrap_or_default();
                if let Ok(mut h) = sink.0.lock() {
                    h.push(Seen {
                        lease: lease.name_any(),
                        resource_version: lease.resource_version().and_then(|rv| rv.parse().ok()).unwrap_or_default(),
                        phase: status.phase,
                        holder: status.holder,
                        token: status.token,
                    });
                }
            }
        });
        let _ = tokio::time::timeout(Duration::from_secs(10), ready_rx).await;
        (history, task)
    }

    /// Waits (at most 30 s) until the watch has delivered the grant of every token in `tokens`,
    /// rather than a pause that hopes it did.
    async fn caught_up(&self, tokens: impl IntoIterator<Item = Token>) {
        let tokens: Vec<Token> = tokens.into_iter().collect();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let granted: std::collections::HashSet<Token> = self.grants().into_iter().map(|(_, _, t)| t).collect();
            let missing = tokens.iter().filter(|t| !granted.contains(t)).count();
            if missing == 0 {
                return;
            }
            assert!(Instant::now() < deadline, "the watch did not deliver {missing} of {} grants within 30 s", tokens.len());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn snapshot(&self) -> Vec<Seen> {
        self.0.lock().map(|h| h.clone()).unwrap_or_default()
    }

    /// The grants in commit order: (lease, holder, token) for each new Held token.
    fn grants(&self) -> Vec<(String, String, Token)> {
        let mut last: HashMap<String, Token> = HashMap::new();
        let mut grants = vec![];
        for s in self.snapshot() {
            if let (Phase::Held, Some(holder), Some(token)) = (s.phase, s.holder.clone(), s.token)
                && last.get(&s.lease) != Some(&token)
            {
                grants.push((s.lease.clone(), holder, token));
            }
            if let Some(token) = s.token {
                last.insert(s.lease.clone(), token);
            }
        }
        grants
    }

    /// The invariants, judged by the history checker (`kube_fence_test_support::history`) on
    /// every Held status the watch saw (per lease name across objects: each grant's token is
    /// strictly greater than the previous grant's; a token belongs to one holder). Returns the
    /// number of grants.
    fn assert_fencing_invariants(&self) -> usize {
        let observations: Vec<Observation> = self
            .snapshot()
            .into_iter()
            .filter_map(|s| match (s.phase, s.holder, s.token) {
                (Phase::Held, Some(holder), Some(token)) => {
                    Some(Observation::Grant { lease: s.lease, holder, token, resource_version: s.resource_version })
                }
                _ => None,
            })
            .collect();
        let violations = history::check(&observations, |_| false);
        assert!(violations.is_empty(), "the lease history has violations: {violations:#?}");
        self.grants().len()
    }
}

fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    samples.sort();
    if samples.is_empty() {
        return Duration::ZERO;
    }
    let i = ((samples.len() as f64 - 1.0) * p).round() as usize;
    samples[i.min(samples.len() - 1)]
}

fn options(duration_secs: u64, timeout_secs: u64) -> AcquireOptions {
    AcquireOptions::default().duration(Duration::from_secs(duration_secs)).timeout(Duration::from_secs(timeout_secs))
}

/// Contenders that acquire and release `lease` until `target` grants were made; returns what
/// each acquire returned (holder, token) and its latency.
async fn contend(client: &Client, ns: &str, lease: &str, contenders: usize, target: usize) -> Vec<(String, Token, Duration)> {
    let made = Arc::new(AtomicUsize::new(0));
    let mut tasks = vec![];
    for i in 0..contenders {
        let leases = Leases::new(client.clone(), ns);
        let made = made.clone();
        let lease = lease.to_string();
        tasks.push(tokio::spawn(async move {
            let holder = format!("contender-{i}");
            let mut got = vec![];
            while made.load(Ordering::SeqCst) < target {
                let started = Instant::now();
                let grant = match leases.acquire(&lease, &holder, options(3, 120)).await {
                    Ok(grant) => grant,
                    Err(err) => panic!("{holder}: acquire failed: {err}"),
                };
                got.push((holder.clone(), grant.token, started.elapsed()));
                made.fetch_add(1, Ordering::SeqCst);
                if let Err(err) = leases.release(&grant).await {
                    panic!("{holder}: release failed: {err}");
                }
            }
            got
        }));
    }
    let mut all = vec![];
    for task in tasks {
        all.extend(task.await.expect("contender task"));
    }
    all
}

fn assert_client_grants_distinct(got: &[(String, Token, Duration)]) {
    let mut owners: BTreeMap<Token, &str> = BTreeMap::new();
    for (holder, token, _) in got {
        if let Some(other) = owners.insert(*token, holder) {
            panic!("token {token} was returned to {other} and to {holder}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn twenty_contenders_two_hundred_grants_tokens_strictly_increase() {
    let client = common::client().await;
    let ns = common::namespace(&client, "contenders").await;
    let mut registry = Registry::default();
    let controller = start_controller_with(&client, ControllerOptions::new("solo").namespace(&ns), &mut registry);
    let (history, recorder) = History::record(&client, &ns).await;

    let started = Instant::now();
    let mut got = contend(&client, &ns, "contended", 20, 200).await;
    let elapsed = started.elapsed();
    history.caught_up(got.iter().map(|(_, token, _)| *token)).await;

    assert!(got.len() >= 200, "only {} grants", got.len());
    assert_client_grants_distinct(&got);
    let grants = history.assert_fencing_invariants();
    // Every token a client was given is in the committed history, with that client as holder.
    let committed: HashMap<Token, String> = history.grants().into_iter().map(|(_, h, t)| (t, h)).collect();
    for (holder, token, _) in &got {
        assert_eq!(committed.get(token), Some(holder), "token {token} returned to {holder} is not a committed grant to it");
    }
    let rendered = kube_fence::telemetry::render(&registry);
    let counted = rendered
        .lines()
        .find_map(|l| l.strip_prefix("kube_fence_lease_grants_total "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .unwrap_or(0.0);
    assert!(counted >= got.len() as f64, "grants metric {counted} < {}:\n{rendered}", got.len());

    let mut latencies: Vec<Duration> = got.iter().map(|(_, _, d)| *d).collect();
    eprintln!(
        "MEASURED contenders: {} grants ({} in history) by 20 contenders in {:.2?} = {:.1} grants/s; contended acquire latency p50 {:.2?} p99 {:.2?}",
        got.len(),
        grants,
        elapsed,
        got.len() as f64 / elapsed.as_secs_f64(),
        percentile(&mut latencies, 0.5),
        percentile(&mut latencies, 0.99)
    );
    got.clear();
    controller.abort();
    recorder.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn uncontended_acquire_latency() {
    let client = common::client().await;
    let ns = common::namespace(&client, "latency").await;
    let controller = start_controller(&client, &ns, "solo");
    let leases = Leases::new(client.clone(), &ns);
    let mut latencies = vec![];
    let mut previous: Option<Token> = None;
    for _ in 0..50 {
        let started = Instant::now();
        let grant = leases.acquire("solo", "worker", options(3, 30)).await.expect("acquire");
        latencies.push(started.elapsed());
        assert!(previous.is_none_or(|p| grant.token > p), "token {} after {previous:?}", grant.token);
        previous = Some(grant.token);
        leases.release(&grant).await.expect("release");
    }
    eprintln!(
        "MEASURED uncontended acquire (claim → grant, after a release): p50 {:.2?} p99 {:.2?} over {} acquires",
        percentile(&mut latencies, 0.5),
        percentile(&mut latencies, 0.99),
        latencies.len()
    );
    controller.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn controller_restarts_and_two_replicas_never_regress_a_token() {
    let client = common::client().await;
    let ns = common::namespace(&client, "replicas").await;
    let (history, recorder) = History::record(&client, &ns).await;
    // Two replicas at once, without leader election: the worst case for safety.
    let mut a = start_controller(&client, &ns, "replica-a");
    let b = start_controller(&client, &ns, "replica-b");

    let chaos_client = client.clone();
    let chaos_ns = ns.clone();
    let chaos = tokio::spawn(async move {
        for round in 0..6 {
            tokio::time::sleep(Duration::from_millis(700)).await;
            // Kill replica a mid-run and start a fresh one (its cache and queue are gone).
            a.abort();
            if round % 2 == 0 {
                // A moment with b alone.
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            a = start_controller(&chaos_client, &chaos_ns, &format!("replica-a{round}"));
        }
        tokio::time::sleep(Duration::from_millis(700)).await;
        a.abort();
    });
    let got = contend(&client, &ns, "shared", 6, 80).await;
    chaos.await.expect("chaos task");

    // And a moment with no controller at all, then a new one: nothing goes back.
    b.abort();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let c = start_controller(&client, &ns, "replica-c");
    let more = contend(&client, &ns, "shared", 3, 10).await;

    let mut all = got;
    all.extend(more);
    history.caught_up(all.iter().map(|(_, token, _)| *token)).await;
    assert_client_grants_distinct(&all);
    let grants = history.assert_fencing_invariants();
    assert!(grants >= 90, "{grants} grants in history");
    eprintln!("MEASURED replicas: {grants} grants under two replicas, 6 controller kills and a restart; no token regressed");
    c.abort();
    recorder.abort();
}

/// A `kube-fence controller` process with leader election, its `/metrics` address from its
/// ready file.
struct ControllerProcess {
    child: std::process::Child,
    metrics: String,
    log: std::path::PathBuf,
}

impl ControllerProcess {
    async fn start(kubeconfig: &std::path::Path, home: &std::path::Path, ns: &str, identity: &str) -> ControllerProcess {
        let ready = home.join(format!("{identity}.ready"));
        let log = home.join(format!("{identity}.log"));
        let ready_arg = ready.display().to_string();
        let args = [
            "controller",
            "--namespace",
            ns,
            "--leader-election",
            "--identity",
            identity,
            "--metrics-addr",
            "127.0.0.1:0",
            "--ready-file",
            &ready_arg,
        ];
        let mut child = common::cli::command(common::cli::Cluster::Kubeconfig(kubeconfig), home, &args)
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log file"))
            .spawn()
            .expect("start kube-fence controller");
        let ready = common::wait_ready_file(&ready, &mut child, Duration::from_secs(60)).await;
        let metrics = ready.metrics.expect("the controller's ready file names its metrics address").to_string();
        ControllerProcess { child, metrics, log }
    }

    /// `kube_fence_lease_leading` from its /metrics (None: no answer).
    fn leading(&self) -> Option<bool> {
        self.sample("kube_fence_lease_leading").map(|v| v == 1.0)
    }

    /// The value of sample `name` on its /metrics (None: no answer, or no such sample).
    fn sample(&self, name: &str) -> Option<f64> {
        let out = std::process::Command::new("curl")
            .args(["-s", "--max-time", "5"])
            .arg(format!("http://{}/metrics", self.metrics))
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        text.lines().find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
    }

    /// Waits (at most `limit`) until `leading()` is `leads`.
    fn wait_leading(&self, leads: bool, limit: Duration) {
        let deadline = Instant::now() + limit;
        while self.leading() != Some(leads) {
            assert!(
                Instant::now() < deadline,
                "leading is not {leads} within {limit:?}: {}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for ControllerProcess {
    fn drop(&mut self) {
        let _ = std::process::Command::new("kill").args(["-CONT", &self.child.id().to_string()]).status();
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Threat case: kube-fence's own controller as the stale replica. Two `kube-fence controller`
/// processes elect a leader; the leader is stopped (SIGSTOP, injected: the test stops it once it
/// leads and a holder's grant is due to expire) while the grant of holder `a` is live. The other
/// replica takes over, expires `a` and grants `b` a greater token. The stopped leader is resumed
/// with everything it knew stale — `a` holding, its own leadership, a timer for `a`'s expiry now
/// overdue — and whatever it writes before it sees it lost the election must change nothing: `b`
/// keeps its grant and its token, no token goes back or is granted twice (the history checker),
/// and `a` cannot renew. Its status writes are compare-and-swaps (§4): a stale one loses.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_controller_replica_resumed_after_its_successor_granted_takes_nothing_back() {
    let client = common::client().await;
    let ns = common::namespace(&client, "paused-controller").await;
    let (history, recorder) = History::record(&client, &ns).await;
    let kubeconfig = common::kubeconfig().await;
    let home = tempfile::tempdir().expect("an empty HOME");
    let first = ControllerProcess::start(&kubeconfig, home.path(), &ns, "first").await;
    first.wait_leading(true, Duration::from_secs(60));
    let second = ControllerProcess::start(&kubeconfig, home.path(), &ns, "second").await;
    second.wait_leading(false, Duration::from_secs(60));

    let leases = Leases::new(client.clone(), &ns);
    let a = leases.acquire("job", "a", options(3, 30)).await.expect("the leader grants a");
    common::signal_and_wait(first.child.id(), "-STOP");
    // The second replica leads once the first's election lease (15 s) runs out, sees a's grant
    // expire (no heartbeat for 3 s) and grants b.
    let b = leases.acquire("job", "b", options(60, 90)).await.expect("the second replica grants b");
    assert!(b.token > a.token, "b's token {} is greater than a's {}", b.token, a.token);
    assert_eq!(second.leading(), Some(true), "b was granted by the second replica");
    let keep_alive = leases.keep_alive(&b);

    common::signal_and_wait(first.child.id(), "-CONT");
    first.wait_leading(false, Duration::from_secs(60));
    // A renewal of b's after the first replica stepped down: anything it wrote before is in.
    let renewed = leases.renew(&b).await.expect("b still holds the lease and renews it");
    assert_eq!(renewed.token, b.token, "b's token is unchanged");
    let now = leases.get("job").await.expect("the lease");
    let status = now.status.unwrap_or_default();
    assert_eq!((status.holder.as_deref(), status.token), (Some("b"), Some(b.token)), "b holds, with its token");
    assert!(matches!(keep_alive.holding(), kube_fence::client::Holding::Held { token, .. } if token == b.token));
    let err = leases.renew(&a).await.expect_err("a's grant stays lost");
    assert!(matches!(err, Error::NotHeld { .. }), "{err}");
    keep_alive.stop().await;
    leases.release(&b).await.expect("b releases");
    let c = leases.acquire("job", "c", options(10, 30)).await.expect("the next grant");
    assert!(c.token > b.token, "c's token {} is greater than b's {}", c.token, b.token);
    history.caught_up([a.token, b.token, c.token]).await;
    let grants = history.assert_fencing_invariants();
    let lost = first.sample("kube_fence_lease_status_conflicts_total").unwrap_or(0.0);
    eprintln!(
        "MEASURED paused controller replica: {grants} grants, none regressed or given twice after the stale leader resumed ({lost} of its status writes lost their compare-and-swap)"
    );
    recorder.abort();
}

/// A lease controller replica of `ns` under leader election with short timings: a 2 s election
/// lease, renewed every 300 ms, given up after 1.5 s without a renewal.
fn elected(ns: &str, identity: &str) -> ControllerOptions {
    let mut o = ControllerOptions::new(identity).namespace(ns).leader_election(true);
    o.lease_duration = Duration::from_secs(2);
    o.renew_deadline = Duration::from_millis(1500);
    o.retry_period = Duration::from_millis(300);
    o
}

/// Who holds the lease controllers' election in `ns` now.
async fn leader_now(client: &Client, ns: &str) -> Option<String> {
    let coordination: Api<k8s_openapi::api::coordination::v1::Lease> = Api::namespaced(client.clone(), ns);
    coordination.get_opt(controller::CONTROLLER_NAME).await.expect("election lease").and_then(|l| l.spec?.holder_identity)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leader_election_hands_over_when_the_leader_dies() {
    let client = common::client().await;
    let ns = common::namespace(&client, "leader").await;
    let first = start_controller_with(&client, elected(&ns, "first"), &mut Registry::default());
    // The first leads before the second starts (polled: however long that takes).
    let deadline = Instant::now() + Duration::from_secs(30);
    while leader_now(&client, &ns).await.as_deref() != Some("first") {
        assert!(Instant::now() < deadline, "the first controller did not lead within 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let second = start_controller_with(&client, elected(&ns, "second"), &mut Registry::default());
    let leases = Leases::new(client.clone(), &ns);
    let g1 = leases.acquire("l", "w", options(3, 30)).await.expect("granted under the first leader");
    leases.release(&g1).await.expect("release");
    assert_eq!(leader_now(&client, &ns).await.as_deref(), Some("first"));

    first.abort(); // dies without stepping down
    let died = Instant::now();
    let g2 = leases.acquire("l", "w", options(3, 30)).await.expect("granted under the second leader");
    assert!(g2.token > g1.token);
    assert_eq!(leader_now(&client, &ns).await.as_deref(), Some("second"));
    eprintln!("MEASURED leader failover (2 s election lease): next grant {:.2?} after the leader died", died.elapsed());
    second.abort();
}

/// A leading controller cut from its API server (its renewal sent into the partition gets no
/// answer: the client has no read timeout) stops leading at its renew deadline, not when the
/// renewal gives up — leading on past the deadline is what the deadline exists to prevent —
/// and the other replica takes over and grants. Not a safety case (the controller's writes are
/// compare-and-swaps whoever leads; `a_paused_controller_replica_…` shows it): a replica that
/// cannot reach its API server must not believe, or report, that it leads.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leading_controller_cut_from_its_api_server_steps_down_at_its_renew_deadline() {
    use kube_fence_test_support::partition::Relay;
    let client = common::client().await;
    let ns = common::namespace(&client, "leader-cut").await;
    let kubeconfig = common::kubeconfig().await;
    let relay = Relay::to_api_server_of(&kubeconfig).await;
    let mut registry = Registry::default();
    let cut_off = start_controller_with(&relay.client(&kubeconfig).await, elected(&ns, "cut-off"), &mut registry);
    let leading = || {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode metrics");
        text.lines().filter(|l| !l.starts_with('#')).find_map(|l| l.split_once("_leading ").map(|(_, v)| v.trim() == "1"))
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while leader_now(&client, &ns).await.as_deref() != Some("cut-off") || leading() != Some(true) {
        assert!(Instant::now() < deadline, "the controller behind the relay did not lead within 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let other = start_controller_with(&client, elected(&ns, "other"), &mut Registry::default());

    relay.cut();
    let cut_at = Instant::now();
    // Its renew deadline is 1.5 s; a renewal hung in the cut waited 30 s (a new connection's
    // timeout) or forever.
    while leading() != Some(false) {
        assert!(cut_at.elapsed() < Duration::from_secs(20), "the cut-off controller still leads 20 s after the cut");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let stepped_down = cut_at.elapsed();
    let leases = Leases::new(client.clone(), &ns);
    let granted = leases.acquire("l", "w", options(3, 30)).await.expect("granted under the other replica");
    assert_eq!(leader_now(&client, &ns).await.as_deref(), Some("other"));
    relay.heal();
    leases.release(&granted).await.expect("release");
    eprintln!("MEASURED leading controller cut from its API server: stepped down {stepped_down:.2?} after the cut (renew deadline 1.5 s)");
    cut_off.abort();
    other.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deleting_and_recreating_a_lease_never_restarts_its_tokens() {
    let client = common::client().await;
    let ns = common::namespace(&client, "recreate").await;
    let controller = start_controller(&client, &ns, "solo");
    let (history, recorder) = History::record(&client, &ns).await;
    let leases = Leases::new(client.clone(), &ns);
    let api: Api<Lease> = Api::namespaced(client.clone(), &ns);

    let first = leases.acquire("phoenix", "a", options(3, 30)).await.expect("first grant");
    let mut keep_alive = leases.keep_alive(&first);
    api.delete("phoenix", &DeleteParams::default()).await.expect("delete lease");
    let loss = tokio::time::timeout(Duration::from_secs(10), keep_alive.lost()).await.expect("keep-alive reports the deletion");
    assert_eq!(loss, Loss::Deleted);

    let second = leases.acquire("phoenix", "b", options(3, 30)).await.expect("grant on the re-created lease");
    assert!(second.token > first.token, "re-created lease granted {} after {}", second.token, first.token);
    history.assert_fencing_invariants();

    // The grants were reported as Events (recorded in the background: polled).
    let events: Api<K8sEvent> = Api::namespaced(client.clone(), &ns);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let reasons: Vec<String> =
            events.list(&ListParams::default()).await.expect("events").items.into_iter().filter_map(|e| e.reason).collect();
        if reasons.iter().any(|r| r == "Granted") {
            break;
        }
        assert!(Instant::now() < deadline, "no Granted event within 30 s among {reasons:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    controller.abort();
    recorder.abort();
}

/// `kube_fence_lease_held` as the controller's registry renders it.
fn held_gauge(registry: &Registry) -> Option<i64> {
    kube_fence::telemetry::render(registry)
        .lines()
        .find_map(|l| l.strip_prefix("kube_fence_lease_held "))
        .and_then(|v| v.trim().parse().ok())
}

async fn wait_held(registry: &Registry, want: i64) {
    let deadline = Instant::now() + Duration::from_secs(15);
    while held_gauge(registry) != Some(want) {
        assert!(Instant::now() < deadline, "kube_fence_lease_held is {:?}, not {want}, after 15 s", held_gauge(registry));
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Threat case: a worker with ordinary RBAC releasing or deleting a held Lease. The held gauge
/// is kept from watch events (not a scan of all Leases), so it must follow grants, releases and
/// deletions alike, including a Lease deleted while held.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_held_gauge_follows_grants_releases_and_deletions() {
    let client = common::client().await;
    let ns = common::namespace(&client, "held").await;
    let mut registry = Registry::default();
    let controller = start_controller_with(&client, ControllerOptions::new("solo").namespace(&ns), &mut registry);
    let leases = Leases::new(client.clone(), &ns);
    let api: Api<Lease> = Api::namespaced(client.clone(), &ns);

    let a = leases.acquire("gauge-a", "one", options(30, 30)).await.expect("grant a");
    leases.acquire("gauge-b", "two", options(30, 30)).await.expect("grant b");
    wait_held(&registry, 2).await;
    leases.release(&a).await.expect("release a");
    wait_held(&registry, 1).await;
    api.delete("gauge-b", &DeleteParams::default()).await.expect("delete b");
    wait_held(&registry, 0).await;
    controller.abort();
}

/// A holder cut from its API server (a partition: its packets go nowhere, nothing is closed)
/// learns that its grant ended at the grant's own deadline, although the heartbeat it sent into
/// the partition never gets an answer (the client has no read timeout: it would wait forever),
/// and a keep-alive stopped in the middle of such a heartbeat stops at once. Threat case: an
/// honest holder behind a partition, which must stop believing it holds — `lease run` stops its
/// command on this loss; the writes it might still send are the webhook's to refuse.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_holder_cut_from_its_api_server_loses_its_grant_at_the_deadline_while_its_heartbeat_hangs() {
    use kube_fence_test_support::partition::Relay;
    let client = common::client().await;
    let ns = common::namespace(&client, "cut").await;
    let controller = start_controller(&client, &ns, "solo");
    let kubeconfig = common::kubeconfig().await;
    let relay = Relay::to_api_server_of(&kubeconfig).await;
    let cut_off = Leases::new(relay.client(&kubeconfig).await, &ns);

    // Heartbeats every 200 ms: once cut, one is in flight (and never answered) at the deadline.
    let grant = cut_off.acquire("cut", "behind-the-partition", options(3, 30)).await.expect("grant through the relay");
    let mut keep_alive = cut_off.keep_alive_with(&grant, KeepAliveOptions { interval: Some(Duration::from_millis(200)) });
    let cut_at = Instant::now();
    relay.cut();
    // A bound far past the grant's 3 s (a renewal sent before the cut adds at most 3 s more) and
    // short of how long the hung heartbeat waits: forever on a pooled connection, the client's
    // 30 s connect timeout on a new one (its TLS handshake is held too).
    let loss = tokio::time::timeout(Duration::from_secs(20), keep_alive.lost())
        .await
        .expect("the keep-alive reports the loss at the grant's deadline, not when the hung heartbeat ends");
    assert_eq!(loss, Loss::Unconfirmed, "no heartbeat was confirmed");
    let reported = cut_at.elapsed();
    keep_alive.stop().await;

    // Stopped while a heartbeat hangs: a long grant, so only the heartbeat is waiting.
    relay.heal();
    let long = cut_off.acquire("cut-long", "behind-the-partition", options(600, 30)).await.expect("grant through the healed relay");
    let keep_alive = cut_off.keep_alive_with(&long, KeepAliveOptions { interval: Some(Duration::from_millis(200)) });
    relay.cut();
    // The next heartbeat (every 200 ms) is sent into the cut within this second.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let stopping = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), keep_alive.stop()).await.expect("stop returns while a heartbeat hangs");
    let stopped_in = stopping.elapsed();
    relay.heal();
    eprintln!(
        "MEASURED cut holder: loss reported {reported:.2?} after the cut (grant 3 s, heartbeat every 200 ms); stop took {stopped_in:.2?} with a heartbeat hanging"
    );
    controller.abort();
}

/// An acquire cut from its API server (nothing it sends gets an answer, the client having no
/// read timeout) ends at its deadline with `Timeout`, after a bounded try at withdrawing its
/// claim — not when a request in flight gives up, which was the client's 30 s timeout here and
/// can be never. The claim's own write is raced against the deadline the same way; this test
/// forces the cut before the first request (the list), which the withdrawal follows. Not a
/// fencing case: a worker told to wait 3 s must have its answer then, partition or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_acquire_cut_from_its_api_server_ends_at_its_deadline() {
    use kube_fence_test_support::partition::Relay;
    let client = common::client().await;
    let ns = common::namespace(&client, "cut-acquire").await;
    let kubeconfig = common::kubeconfig().await;
    let relay = Relay::to_api_server_of(&kubeconfig).await;
    let cut_off = Leases::new(relay.client(&kubeconfig).await, &ns);
    let absent = cut_off.get("cut").await;
    assert!(matches!(absent, Err(Error::LeaseNotFound { .. })), "{absent:?}");
    relay.cut();
    let started = Instant::now();
    let acquired = tokio::time::timeout(Duration::from_secs(20), cut_off.acquire("cut", "behind-the-partition", options(30, 3)))
        .await
        .expect("acquire answers within 20 s: its 3 s wait and at most 5 s trying to withdraw");
    let answered_in = started.elapsed();
    assert!(matches!(acquired, Err(Error::Timeout { .. })), "{acquired:?}");
    relay.heal();
    eprintln!("MEASURED acquire cut from its API server: Timeout after {answered_in:.2?} (wait 3 s)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn keep_alive_keeps_the_token_and_a_silent_holder_loses_the_lease() {
    let client = common::client().await;
    let ns = common::namespace(&client, "expiry").await;
    let controller = start_controller(&client, &ns, "solo");
    let (history, recorder) = History::record(&client, &ns).await;
    let leases = Leases::new(client.clone(), &ns);

    // A holder that heartbeats keeps its lease, and its token, past the duration: until its
    // keep-alive has renewed it after its first term ended (a renewal confirmed, sent after
    // `valid_until` of the grant). The lease is 10 s, renewed every 3.3 s: a heartbeat late by
    // seconds on a loaded machine still lands in time.
    let kept = leases.acquire("kept", "steady", options(10, 30)).await.expect("grant");
    let keep_alive = leases.keep_alive(&kept);
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match keep_alive.holding() {
            kube_fence::client::Holding::Held { token, valid_until } => {
                assert_eq!(token, kept.token, "renewals keep the token");
                if valid_until > kept.valid_until + kept.duration {
                    break;
                }
            }
            other => panic!("the kept lease was lost: {other:?}"),
        }
        assert!(Instant::now() < deadline, "no renewal after the first term within 60 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let err = leases.acquire("kept", "rival", options(2, 1)).await.expect_err("a rival cannot take a kept lease");
    assert!(matches!(err, Error::Timeout { ref held_by, .. } if held_by.as_deref() == Some("steady")), "{err}");
    let now = leases.get("kept").await.expect("lease");
    assert_eq!(now.status.as_ref().and_then(|s| s.token), Some(kept.token), "renewals keep the token");
    assert!(matches!(keep_alive.holding(), kube_fence::client::Holding::Held { .. }));
    keep_alive.stop().await;

    // A holder whose heartbeats stop (here: far too slow) loses the lease.
    let silent = leases.acquire("silent", "sleepy", options(2, 30)).await.expect("grant");
    let last_heartbeat = silent.valid_until - silent.duration; // when its claim was sent
    let mut silent_keep_alive = leases.keep_alive_with(&silent, KeepAliveOptions { interval: Some(Duration::from_secs(60)) });
    let next = leases.acquire("silent", "eager", options(2, 30)).await.expect("the next holder gets the lease");
    let takeover = last_heartbeat.elapsed();
    assert!(next.token > silent.token, "{} after {}", next.token, silent.token);
    let loss = tokio::time::timeout(Duration::from_secs(10), silent_keep_alive.lost())
        .await
        .expect("the silent holder's keep-alive reports the loss");
    assert!(matches!(loss, Loss::Unconfirmed | Loss::Expired | Loss::Superseded { .. }), "{loss:?}");
    // Its heartbeat, if it came back now, is refused: the grant is lost.
    let err = leases.renew(&silent).await.expect_err("a lost grant cannot be renewed");
    assert!(matches!(err, Error::NotHeld { .. }), "{err}");
    history.assert_fencing_invariants();
    eprintln!(
        "MEASURED takeover: a 2 s lease whose holder went silent was granted to the next holder {takeover:.2?} after the silent holder's last heartbeat was sent (loss reported as {loss:?})"
    );
    controller.abort();
    recorder.abort();
}

/// Writes `spec.heartbeatTime = at` for the current holder (compare-and-swap).
async fn heartbeat_at(api: &Api<Lease>, name: &str, at: Timestamp) {
    for _ in 0..10 {
        let mut lease = api.get(name).await.expect("lease");
        lease.spec.heartbeat_time = Some(MicroTime(at));
        lease.metadata.managed_fields = None;
        match api.replace(name, &PostParams::default(), &lease).await {
            Ok(_) => return,
            Err(kube::Error::Api(s)) if s.is_conflict() => continue,
            Err(err) => panic!("heartbeat: {err}"),
        }
    }
    panic!("heartbeat kept conflicting");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_skewed_client_clock_neither_expires_nor_extends_a_lease() {
    let client = common::client().await;
    let ns = common::namespace(&client, "skew").await;
    let controller = start_controller(&client, &ns, "solo");
    let leases = Leases::new(client.clone(), &ns);
    let api: Api<Lease> = Api::namespaced(client.clone(), &ns);
    // A 5 s lease, heartbeats every half second: one late by seconds on a loaded machine still
    // lands in time.
    let grant = leases.acquire("skewed", "a", options(5, 30)).await.expect("grant");

    // Heartbeats stamped 30 years in the past, but sent in time: the lease stays held, for more
    // than twice its duration.
    let past = Timestamp::now().saturating_sub(SignedDuration::from_hours(24 * 365 * 30)).expect("past");
    let mut i = 0;
    while grant.valid_until + grant.duration * 3 / 2 > tokio::time::Instant::now() {
        heartbeat_at(&api, "skewed", past.saturating_add(SignedDuration::from_micros(i)).expect("t")).await;
        i += 1;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let lease = api.get("skewed").await.expect("lease");
        let status = lease.status.expect("status");
        assert_eq!((status.phase, status.token), (Phase::Held, Some(grant.token)), "a past heartbeat expired the lease");
    }

    // One heartbeat stamped 30 years in the future, then silence: it expires on schedule.
    let future = Timestamp::now().saturating_add(SignedDuration::from_hours(24 * 365 * 30)).expect("future");
    heartbeat_at(&api, "skewed", future).await;
    let sent = Instant::now();
    let next = leases.acquire("skewed", "b", options(5, 20)).await.expect("a future heartbeat did not extend the lease");
    assert!(next.token > grant.token);
    eprintln!("MEASURED skew: after a heartbeat stamped 30 years ahead, the 5 s lease went to the next holder in {:.2?}", sent.elapsed());
    controller.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_api_server_rejects_a_takeover_of_a_held_lease() {
    let client = common::client().await;
    let ns = common::namespace(&client, "takeover").await;
    let controller = start_controller(&client, &ns, "solo");
    let leases = Leases::new(client.clone(), &ns);
    let api: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let grant = leases.acquire("guarded", "owner", options(15, 30)).await.expect("grant");

    let mut lease = api.get("guarded").await.expect("lease");
    lease.spec.holder = Some("thief".into());
    lease.metadata.managed_fields = None;
    let err = api.replace("guarded", &PostParams::default(), &lease).await.expect_err("takeover by replace is rejected");
    let kube::Error::Api(status) = &err else { panic!("not an API error: {err}") };
    assert_eq!(status.code, 422, "{status:?}");
    assert!(status.message.contains("held by another holder"), "{}", status.message);

    let patch = serde_json::json!({"spec": {"holder": "thief"}});
    let err = api
        .patch("guarded", &kube::api::PatchParams::default(), &kube::api::Patch::Merge(patch))
        .await
        .expect_err("takeover by an unconditional patch is rejected too");
    assert!(err.to_string().contains("held by another holder"), "{err}");
    let now = api.get("guarded").await.expect("lease");
    assert_eq!(now.spec.holder.as_deref(), Some("owner"));
    assert_eq!(now.status.and_then(|s| s.token), Some(grant.token));
    controller.abort();
}

async fn cli(args: &[&str]) -> std::process::Output {
    let kubeconfig = common::kubeconfig().await;
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_kube-fence"))
            .args(&args)
            .env("KUBECONFIG", kubeconfig)
            .env_remove("KUBE_FENCE_NAMESPACE")
            .output()
            .expect("run kube-fence")
    })
    .await
    .expect("kube-fence thread")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).trim().to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cli_lease_acquire_prints_the_token() {
    let client = common::client().await;
    let ns = common::namespace(&client, "cli").await;
    let controller = start_controller(&client, &ns, "solo");

    let out = cli(&["lease", "acquire", "job", "--holder", "sh-1", "--duration", "3s", "--wait", "20s", "-n", &ns]).await;
    assert!(out.status.success(), "acquire failed: {}", text(&out.stderr));
    let token: Token = text(&out.stdout).parse().unwrap_or_else(|e| panic!("stdout {:?} is not a token: {e}", text(&out.stdout)));
    let lease = Leases::new(client.clone(), &ns).get("job").await.expect("the CLI created the lease");
    assert_eq!(lease.status.and_then(|s| s.token), Some(token));

    let out = cli(&["lease", "get", "job", "-o", "token", "-n", &ns]).await;
    assert_eq!(text(&out.stdout), token.to_string());
    let out = cli(&["lease", "renew", "job", "--holder", "sh-1", "-n", &ns]).await;
    assert!(out.status.success(), "renew failed: {}", text(&out.stderr));
    assert_eq!(text(&out.stdout), token.to_string(), "a renewal keeps the token");

    // Another holder times out while sh-1 holds it.
    let out = cli(&["lease", "acquire", "job", "--holder", "sh-2", "--wait", "1s", "-n", &ns]).await;
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("timed out") && text(&out.stderr).contains("held by \"sh-1\""), "{}", text(&out.stderr));

    // Released, the next holder gets a greater token.
    let out = cli(&["lease", "release", "job", "--holder", "sh-1", "-n", &ns]).await;
    assert!(out.status.success(), "release failed: {}", text(&out.stderr));
    let out = cli(&["lease", "acquire", "job", "--holder", "sh-2", "--wait", "20s", "-n", &ns]).await;
    assert!(out.status.success(), "{}", text(&out.stderr));
    let next: Token = text(&out.stdout).parse().expect("token");
    assert!(next > token);

    // Clear errors, non-zero exit.
    let out = cli(&["lease", "acquire", "job", "--holder", "x", "--duration", "soon", "-n", &ns]).await;
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("not a duration"), "{}", text(&out.stderr));
    let out = cli(&["lease", "get", "missing", "-n", &ns]).await;
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("does not exist"), "{}", text(&out.stderr));
    let out = cli(&["lease", "renew", "job", "--holder", "sh-1", "-n", &ns]).await;
    assert!(!out.status.success());
    assert!(text(&out.stderr).contains("held by \"sh-2\""), "{}", text(&out.stderr));
    controller.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_timed_out_or_cancelled_acquire_withdraws_its_claim() {
    let client = common::client().await;
    let ns = common::namespace(&client, "withdraw").await;
    // No controller: the claim stays pending, so acquire must give up.
    let leases = Leases::new(client.clone(), &ns);
    let err = leases.acquire("pending", "w", options(2, 1)).await.expect_err("no controller, no grant");
    assert!(matches!(err, Error::Timeout { .. }), "{err}");
    let lease = leases.get("pending").await.expect("acquire created the lease");
    assert_eq!(lease.spec.holder, None, "the timed-out claim was withdrawn");

    let cancel = tokio_util::sync::CancellationToken::new();
    let trigger = cancel.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(300)).await;
        trigger.cancel();
    });
    let err = leases.acquire("pending", "w", AcquireOptions::default().cancel(cancel)).await.expect_err("cancelled");
    assert!(matches!(err, Error::Cancelled { .. }), "{err}");
    assert_eq!(leases.get("pending").await.expect("lease").spec.holder, None, "the cancelled claim was withdrawn");

    // With a controller, the lease is free to grant at once.
    let controller = start_controller(&client, &ns, "solo");
    let grant = leases.acquire("pending", "w2", options(2, 20)).await.expect("grant");
    assert_eq!(grant.holder, "w2");
    controller.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn fenced_writes_stamp_the_token_and_delete_only_the_version_read() {
    use k8s_openapi::api::core::v1::ConfigMap;
    use kube::api::{ApiResource, DynamicObject, ObjectMeta, Patch, PatchParams};
    use kube_fence_api::names::{LEASE_LABEL, TOKEN_ANNOTATION};

    let client = common::client().await;
    let ns = common::namespace(&client, "fenced").await;
    let controller = start_controller(&client, &ns, "solo");
    let leases = Leases::new(client.clone(), &ns);
    let grant = leases.acquire("writer", "w", options(5, 20)).await.expect("grant");
    let token = grant.token.to_string();

    // Typed create and patch.
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let cm = ConfigMap { metadata: ObjectMeta { name: Some("out".into()), ..Default::default() }, ..Default::default() };
    let created = grant.create(&configmaps, &cm).await.expect("create");
    assert_eq!(created.labels().get(LEASE_LABEL).map(String::as_str), Some("writer"));
    assert_eq!(created.annotations().get(TOKEN_ANNOTATION), Some(&token));
    let patched = grant
        .patch(&configmaps, "out", &PatchParams::default(), Patch::Merge(serde_json::json!({"data": {"k": "v"}})))
        .await
        .expect("patch");
    assert_eq!(patched.annotations().get(TOKEN_ANNOTATION), Some(&token));

    // Dynamic replace.
    let resource = ApiResource::erase::<ConfigMap>(&());
    let dynamic: Api<DynamicObject> = Api::namespaced_with(client.clone(), &ns, &resource);
    let mut obj = dynamic.get("out").await.expect("get");
    obj.metadata.annotations.get_or_insert_with(Default::default).remove(TOKEN_ANNOTATION);
    let replaced = grant.replace(&dynamic, &obj).await.expect("replace");
    assert_eq!(replaced.annotations().get(TOKEN_ANNOTATION), Some(&token));

    // Delete carries a resourceVersion precondition: a stale read cannot delete a newer version.
    let stale = dynamic.get("out").await.expect("get");
    grant.patch(&configmaps, "out", &PatchParams::default(), Patch::Merge(serde_json::json!({"data": {"k": "w"}}))).await.expect("patch");
    let err = grant.delete(&dynamic, &stale).await.expect_err("the version read is gone");
    assert!(matches!(err, Error::Conflict(_)), "{err}");
    let fresh = dynamic.get("out").await.expect("get");
    grant.delete(&dynamic, &fresh).await.expect("delete the version read");
    assert!(configmaps.get_opt("out").await.expect("get").is_none());
    controller.abort();
}
