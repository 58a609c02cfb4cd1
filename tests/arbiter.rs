//! A kube-fence token fencing a write outside Kubernetes, at a real arbiter: PostgreSQL, started
//! by the test from the distribution's packages (initdb into a temporary directory, the server
//! on a Unix socket it creates itself, no TCP port; as an unprivileged user when run as root,
//! which PostgreSQL refuses). The worker is `examples/pg_arbiter.rs`: it acquires a kube-fence
//! Lease from the real lease controller and commits its effect with `... WHERE last_fence <
//! $token`, `last_fence` written in the same transaction as the effect.
//!
//! The pause cycle, 100 times: worker A gets token n, prepares its effect and stops itself
//! (SIGSTOP raised by the process; the test sees `/proc` state `T`); A's lease expires; worker B
//! gets n+1 and commits; A is resumed and commits — 0 rows, refused. The effects table, read back
//! in commit order and judged by the history checker together with the grants a watch of the
//! Lease saw, shows no stale effect. The same cycle without the condition lets A's stale effect
//! land, and the checker finds it: the test can fail. Threat case: a stale-but-honest writer
//! (paused or partitioned past its lease) at an arbiter outside the API server.

mod common;

use std::io::BufRead;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kube::api::Api;
use kube::runtime::watcher;
use kube_fence::lease::controller::{self, ControllerOptions};
use kube_fence_api::token::Token;
use kube_fence_api::{Lease, Phase};
use kube_fence_test_support::history::{self, Observation, Violation};

use common::postgres::Postgres;
use serde_json::json;
use tokio::sync::mpsc;

fn pg_arbiter() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let bin = exe.parent().and_then(|deps| deps.parent()).map(|dir| dir.join("examples/pg_arbiter")).unwrap_or_default();
    assert!(bin.is_file(), "{} is missing: build it with `cargo build --example pg_arbiter` (hack/test.sh does)", bin.display());
    bin
}

/// One worker process and the JSON lines it prints.
struct Worker {
    child: Child,
    lines: mpsc::UnboundedReceiver<serde_json::Value>,
}

impl Worker {
    fn start(conninfo: &str, kubeconfig: &Path, args: &[&str]) -> Worker {
        let mut child = Command::new(pg_arbiter())
            .args(args)
            .env("PG_CONNINFO", conninfo)
            .env("KUBECONFIG", kubeconfig)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start pg_arbiter");
        let (tx, lines) = mpsc::unbounded_channel();
        let stdout = child.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(serde_json::from_str(&line).unwrap_or_else(|_| json!({"event": "unreadable", "line": line})));
            }
        });
        Worker { child, lines }
    }

    async fn next(&mut self, event: &str) -> serde_json::Value {
        loop {
            let line = tokio::time::timeout(Duration::from_secs(60), self.lines.recv())
                .await
                .unwrap_or_else(|_| panic!("no {event} from the worker within 60 s"))
                .unwrap_or_else(|| panic!("the worker exited before {event}"));
            if line["event"] == event {
                return line;
            }
            assert!(!["written", "refused"].contains(&line["event"].as_str().unwrap_or_default()), "waiting for {event}, got {line}");
        }
    }

    /// The outcome: `written` or `refused`.
    async fn outcome(&mut self) -> serde_json::Value {
        loop {
            let line = tokio::time::timeout(Duration::from_secs(60), self.lines.recv())
                .await
                .expect("an outcome from the worker within 60 s")
                .expect("the worker printed its outcome before exiting");
            if line["event"] == "written" || line["event"] == "refused" {
                return line;
            }
        }
    }

    async fn wait_stopped(&self) {
        let stat = format!("/proc/{}/stat", self.child.id());
        let started = Instant::now();
        loop {
            let state = std::fs::read_to_string(&stat).unwrap_or_default();
            if state.rsplit_once(')').is_some_and(|(_, rest)| rest.trim_start().starts_with('T')) {
                return;
            }
            assert!(started.elapsed() < Duration::from_secs(30), "the worker did not stop itself within 30 s: {state}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn resume(&self) {
        let status = Command::new("kill").args(["-CONT", &self.child.id().to_string()]).status().expect("run kill");
        assert!(status.success(), "kill -CONT {}", self.child.id());
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Grants of lease `work` a watch sees.
fn record_grants(client: kube::Client, ns: &str) -> (Arc<Mutex<Vec<Observation>>>, tokio::task::JoinHandle<()>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = seen.clone();
    let leases = Api::<Lease>::namespaced(client, ns);
    let task = tokio::spawn(async move {
        let mut versions = watcher::watch_object(leases, "work").boxed();
        while let Some(lease) = versions.next().await {
            let Ok(Some(lease)) = lease else { continue };
            let Some(status) = lease.status.as_ref().filter(|s| s.phase == Phase::Held) else { continue };
            let (Some(holder), Some(token)) = (status.holder.clone(), status.token) else { continue };
            let resource_version = lease.metadata.resource_version.as_deref().and_then(|v| v.parse().ok()).unwrap_or(0);
            sink.lock().expect("history lock").push(Observation::Grant { lease: "work".into(), holder, token, resource_version });
        }
    });
    (seen, task)
}

/// One cycle on `resource`: A gets a token, prepares, stops itself; B gets the next and commits;
/// A resumes and commits. Returns A's outcome, A's and B's tokens.
async fn cycle(conninfo: &str, kubeconfig: &Path, ns: &str, round: u64, resource: &str, fenced: bool) -> (serde_json::Value, u64, u64) {
    let (a_name, b_name) = (format!("a-{round}"), format!("b-{round}"));
    let mut a_args = vec!["write", ns, "work", &a_name, resource, "--pause-before-write"];
    let mut b_args = vec!["write", ns, "work", &b_name, resource];
    if !fenced {
        a_args.push("--unfenced");
        b_args.push("--unfenced");
    }
    let mut a = Worker::start(conninfo, kubeconfig, &a_args);
    let a_token = a.next("prepared").await["token"].as_u64().unwrap_or_default();
    a.wait_stopped().await;
    let mut b = Worker::start(conninfo, kubeconfig, &b_args);
    let b_token = b.next("granted").await["token"].as_u64().unwrap_or_default();
    let b_outcome = b.outcome().await;
    assert_eq!(b_outcome["event"], "written", "round {round}: B's effect commits: {b_outcome}");
    assert!(b_token > a_token, "round {round}: B's token {b_token} > A's {a_token}");
    a.resume();
    (a.outcome().await, a_token, b_token)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_writer_is_fenced_at_a_postgresql_arbiter() {
    let cycles: u64 = std::env::var("KF_ARBITER_CYCLES").ok().and_then(|c| c.parse().ok()).unwrap_or(100);
    let mut postgres = Postgres::start();
    let db = postgres.wait_ready().await;
    let client = common::client().await;
    let ns = common::namespace(&client, "arbiter").await;
    let kubeconfig = common::kubeconfig().await;
    // The real lease controller, for this namespace (the webhook is not involved: the arbiter is
    // the database).
    let mut registry = prometheus_client::registry::Registry::default();
    let run =
        controller::run(client.clone(), ControllerOptions::new("arbiter-test").namespace(&ns), &mut registry, futures::future::pending());
    let lease_controller = tokio::spawn(async move {
        if let Err(err) = run.await {
            panic!("controller failed: {err}");
        }
    });
    let (grants, recorder) = record_grants(client.clone(), &ns);
    let conninfo = postgres.conninfo();
    let init = Command::new(pg_arbiter()).arg("init").env("PG_CONNINFO", &conninfo).status().expect("pg_arbiter init");
    assert!(init.success(), "pg_arbiter init");

    let started = Instant::now();
    for round in 0..cycles {
        let (outcome, a, b) = cycle(&conninfo, &kubeconfig, &ns, round, "fenced", true).await;
        assert_eq!(outcome["event"], "refused", "round {round}: the paused writer's effect must be refused: {outcome}");
        assert_eq!(outcome["last_fence"].as_u64(), Some(b), "round {round}: the fence holds B's token, not A's {a}");
    }
    let elapsed = started.elapsed();
    // Control: without `last_fence < $token` the paused writer's stale effect lands.
    let (outcome, stale, _) = cycle(&conninfo, &kubeconfig, &ns, cycles, "unfenced", false).await;
    assert_eq!(outcome["event"], "written", "without the condition the stale effect lands: {outcome}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    recorder.abort();
    lease_controller.abort();

    // The table's history, in commit order per resource (seq is taken under the fence row's lock).
    let rows = db.query("SELECT seq, resource, token FROM effects ORDER BY seq", &[]).await.expect("read the effects");
    let mut observations = grants.lock().expect("history lock").clone();
    let granted = observations.len();
    for row in &rows {
        let (seq, resource, token): (i64, String, i64) = (row.get(0), row.get(1), row.get(2));
        let token = u64::try_from(token).ok().and_then(Token::new).expect("a token");
        observations.push(Observation::Write { object: resource, lease: "work".into(), token, resource_version: seq.unsigned_abs() });
    }
    let effects = rows.iter().filter(|r| r.get::<_, String>(1) == "fenced").count();
    assert_eq!(effects as u64, cycles, "one effect per cycle (B's) on the fenced resource");
    let (control, others): (Vec<_>, Vec<_>) = history::check(&observations, |_| false)
        .into_iter()
        .partition(|v| matches!(v, Violation::StaleWriteAccepted { object, .. } if object == "unfenced"));
    assert!(others.is_empty(), "the effects table shows stale effects: {others:#?}");
    assert!(
        control.iter().any(|v| matches!(v, Violation::StaleWriteAccepted { accepted, .. } if accepted.get() == stale)),
        "the checker finds the unfenced stale effect: {control:#?}"
    );
    eprintln!(
        "arbiter pause test: {cycles}/{cycles} paused effects refused by PostgreSQL, 0 stale effects in {effects} committed ({granted} grant observations), \
         {:.2} s per cycle; unfenced control: the stale effect landed and the checker caught it",
        elapsed.as_secs_f64() / cycles.max(1) as f64
    );
}
