//! The pause test for status writes, with real processes: a holder Pod's worker
//! (`examples/status_writer.rs`, authenticated with a token bound to its Pod) stops itself
//! (SIGSTOP) between preparing its second `/status` write and sending it, and the test waits
//! until the kernel shows it stopped — the pause is injected, never raced against a timer; its
//! lease expires; the other Pod's
//! worker acquires the lease and writes; the first is resumed with SIGCONT and sends the write
//! it had prepared. Threat case: a stale-but-honest holder (paused, partitioned). Every such
//! write must be refused (`NotHolder`), and a watch of the Lease and the object, judged by the
//! history checker, must show no status write by an older grant after one by a newer grant.

use std::io::BufRead;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, PostParams};
use kube::runtime::watcher;
use kube_fence_api::names::{HOLDER_ONLY, LEASE_LABEL, TOKEN_ANNOTATION, WRITER_LABEL};
use kube_fence_api::{Lease, Phase};
use kube_fence_test_support::history::{self, Observation};
use serde_json::json;
use tokio::sync::mpsc;

use super::{KubeFence, common};

/// The worker binary, built with the tests (`cargo test --all-targets` builds examples).
fn status_writer() -> PathBuf {
    let exe = std::env::current_exe().expect("the test binary's path");
    let bin = exe.parent().and_then(|deps| deps.parent()).map(|dir| dir.join("examples/status_writer")).unwrap_or_default();
    assert!(bin.is_file(), "{} is missing: build it with `cargo build --example status_writer` (hack/test.sh does)", bin.display());
    bin
}

/// One worker process and the JSON lines it prints.
struct Worker {
    pod: String,
    child: Child,
    lines: mpsc::UnboundedReceiver<serde_json::Value>,
    _kubeconfig: tempfile::NamedTempFile,
}

impl Worker {
    /// A worker that stops itself before sending each write in `stops` (`1,2`: before its first
    /// and before its second).
    fn start(pod: &str, ns: &str, kubeconfig: tempfile::NamedTempFile, stops: &str) -> Worker {
        let mut child = Command::new(status_writer())
            .args([ns, "work", "web", "0", "--stop-before-write", stops])
            .env("KUBECONFIG", kubeconfig.path())
            .env("POD_NAME", pod)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the status writer");
        let (tx, lines) = mpsc::unbounded_channel();
        let stdout = child.stdout.take().expect("piped stdout");
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
                let _ = tx.send(serde_json::from_str(&line).unwrap_or_else(|_| json!({"event": "unreadable", "line": line})));
            }
        });
        Worker { pod: pod.into(), child, lines, _kubeconfig: kubeconfig }
    }

    /// The next line whose event is `event` (others are skipped), within 60 s.
    async fn next(&mut self, event: &str) -> serde_json::Value {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.lines.recv()).await {
                Ok(Some(line)) if line["event"] == event => return line,
                Ok(Some(line)) if line["event"] == "refused" => panic!("{}: refused while waiting for {event}: {line}", self.pod),
                Ok(Some(_)) => {}
                Ok(None) => panic!("{}: exited while waiting for {event}", self.pod),
                Err(_) => panic!("{}: no {event} within 60 s", self.pod),
            }
        }
    }

    /// The outcome of write `seq`: its `written` or `refused` line.
    async fn outcome(&mut self, seq: u64) -> serde_json::Value {
        loop {
            let line = tokio::time::timeout(Duration::from_secs(60), self.lines.recv())
                .await
                .unwrap_or_else(|_| panic!("{}: no outcome of write {seq} within 60 s", self.pod))
                .unwrap_or_else(|| panic!("{}: exited before the outcome of write {seq}", self.pod));
            if line["seq"] == seq && line["event"] != "prepared" {
                return line;
            }
        }
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill").args([signal, &self.child.id().to_string()]).status().expect("run kill");
        assert!(status.success(), "kill {signal} {}", self.child.id());
    }

    /// Waits until the worker has stopped itself (state `T` in `/proc/<pid>/stat`), at most 10 s.
    fn wait_stopped(&self) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !common::is_stopped(self.child.id()) {
            assert!(Instant::now() < deadline, "{}: did not stop itself within 10 s of preparing its write", self.pod);
            std::thread::sleep(Duration::from_millis(5));
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Records what a watch sees: grants of lease `work`, and the holder of every status version of
/// Deployment `web` (the worker writes its Pod name into the condition's message).
fn record(client: kube::Client, ns: &str) -> (Arc<Mutex<Vec<Observation>>>, tokio::task::JoinHandle<()>) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (leases, deployments) = (Api::<Lease>::namespaced(client.clone(), ns), Api::<Deployment>::namespaced(client, ns));
    let rv = |meta: &kube::api::ObjectMeta| meta.resource_version.as_deref().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    let grants = watcher::watch_object(leases, "work").filter_map(move |lease| async move {
        let lease = lease.ok()??;
        let status = lease.status.as_ref().filter(|s| s.phase == Phase::Held)?;
        Some(Observation::Grant {
            lease: "work".into(),
            holder: status.holder.clone()?,
            token: status.token?,
            resource_version: rv(&lease.metadata),
        })
    });
    let writes = watcher::watch_object(deployments, "web").filter_map(move |web| async move {
        let web = web.ok()??;
        let message = web.status.as_ref()?.conditions.as_ref()?.first()?.message.clone()?;
        let holder = message.split_whitespace().next()?.to_string();
        Some(Observation::HolderWrite { object: "web".into(), lease: "work".into(), holder, resource_version: rv(&web.metadata) })
    });
    let sink = seen.clone();
    let task = tokio::spawn(async move {
        let mut both = futures::stream::select(grants.boxed(), writes.boxed());
        while let Some(observation) = both.next().await {
            sink.lock().expect("history lock").push(observation);
        }
    });
    (seen, task)
}

#[tokio::test]
async fn a_paused_holder_pod_cannot_write_status_after_losing_its_lease() {
    let rounds: u64 = std::env::var("KF_STATUS_PAUSE_ROUNDS").ok().and_then(|r| r.parse().ok()).unwrap_or(100);
    let kf = KubeFence::start("e2e-status-pause").await;
    let (client, ns) = (kf.client.clone(), kf.ns.clone());
    let made = common::identity::worker_pods(&client, &ns, &["p1", "p2"]).await;
    let p1_client = common::identity::client_as_pod(&client, &ns, "worker", &made[0]).await;
    common::identity::wait_authorized(&p1_client, &ns, "apps", "deployments", "create").await;
    let lease: Lease = serde_json::from_value(json!({"apiVersion": "kubefence.io/v1alpha1", "kind": "Lease",
        "metadata": {"name": "work"}, "spec": {"identity": "Pod"}}))
    .unwrap();
    Api::<Lease>::namespaced(client.clone(), &ns).create(&PostParams::default(), &lease).await.unwrap();
    let (seen, recorder) = record(client.clone(), &ns);

    let kubeconfig = |i: usize| common::identity::kubeconfig_as_pod(&client, &ns, "worker", &made[i]);
    // The first holder stops before its first write too, until web exists.
    let mut holder = Worker::start("p1", &ns, kubeconfig(0).await, "1,2");
    let granted = holder.next("granted").await;
    holder.next("prepared").await;
    holder.wait_stopped();
    // The holder-only Deployment is created by its holder, with the lease's newest token.
    let web: Deployment = serde_json::from_value(json!({
        "metadata": {"name": "web", "labels": {LEASE_LABEL: "work", WRITER_LABEL: HOLDER_ONLY},
                     "annotations": {TOKEN_ANNOTATION: granted["token"].to_string()}},
        "spec": {"replicas": 0, "selector": {"matchLabels": {"app": "web"}},
                 "template": {"metadata": {"labels": {"app": "web"}}, "spec": {"containers": [{"name": "c", "image": "registry.invalid/none"}]}}}
    }))
    .unwrap();
    Api::<Deployment>::namespaced(p1_client, &ns).create(&PostParams::default(), &web).await.expect("the holder creates web");
    holder.signal("-CONT");

    let started = Instant::now();
    let mut refused = 0;
    // Every holder writes once, prepares its next write and stops itself before sending it.
    holder.next("written").await;
    let mut seq = holder.next("prepared").await["seq"].as_u64().unwrap_or_default();
    for round in 0..rounds {
        let other = if holder.pod == "p1" { 1 } else { 0 };
        // Paused (by itself) between preparing the write and sending it, past its lease.
        holder.wait_stopped();
        // Each next holder writes once, prepares its second write and stops itself before sending.
        let mut next = Worker::start(["p1", "p2"][other], &ns, kubeconfig(other).await, "2");
        next.next("granted").await;
        next.next("written").await;
        holder.signal("-CONT");
        let outcome = holder.outcome(seq).await;
        assert_eq!(outcome["event"], "refused", "round {round}: the paused holder's status write must be refused: {outcome}");
        assert_eq!(outcome["reason"], "NotHolder", "round {round}: {outcome}");
        assert_eq!(outcome["holder"], next.pod.as_str(), "round {round}: the refusal names the holder");
        refused += 1;
        seq = next.next("prepared").await["seq"].as_u64().unwrap_or_default();
        holder = next;
    }
    let elapsed = started.elapsed();
    drop(holder);
    // The watch catches up: each of the rounds + 1 holders wrote once.
    let watched = || seen.lock().expect("history lock").iter().filter(|o| matches!(o, Observation::HolderWrite { .. })).count() as u64;
    let deadline = Instant::now() + Duration::from_secs(30);
    while watched() <= rounds && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    recorder.abort();
    let observations = seen.lock().expect("history lock").clone();
    let writes = observations.iter().filter(|o| matches!(o, Observation::HolderWrite { .. })).count();
    let violations = history::check(&observations, |_| false);
    assert!(violations.is_empty(), "the history shows stale status writes: {violations:#?}");
    assert!(writes as u64 >= rounds, "the watch saw {writes} status writes in {rounds} rounds");
    eprintln!(
        "status pause test: {refused}/{rounds} stale status writes refused, {writes} status writes checked, {:.1} s per round",
        elapsed.as_secs_f64() / rounds.max(1) as f64
    );
    kf.stop().await;
}
