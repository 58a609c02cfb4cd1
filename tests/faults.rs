//! Proof under faults (issue 8): many workers acquire leases and write guarded objects with
//! their tokens while workers are paused past their leases, clocks are skewed, and the
//! controller, the webhook, kube-apiserver and etcd are killed and restarted; the recorded
//! history of grants and accepted writes is then checked by `kube_fence_test_support::history::check`.
//!
//! - `faults_short`: what CI runs on every change — every fault kind at least once, a few
//!   hundred writes, 0 violations.
//! - `faults_long` (ignored; `hack/torture.sh`): the long version, sized by `KF_TORTURE_*`
//!   (default ≥ 10,000 accepted writes, ≥ 1,000 pause cycles, 5 rounds of control-plane faults).
//!
//! Both start a control plane of their own whatever `KUBECONFIG` says: they restart its
//! kube-apiserver and etcd, which no shared cluster may suffer.

mod common;
mod torture;

use torture::{Config, Fault, Report};

fn assert_proven(report: &Report, config: &Config) {
    println!("{report}");
    assert!(report.violations.is_empty(), "the history has violations:\n{report}");
    for fault in Fault::ALL {
        assert!(report.fault(fault) >= 1, "fault {fault:?} was never injected:\n{report}");
    }
    assert!(report.fault(Fault::WorkerPaused) >= config.min_pauses, "too few pause cycles (the run hit its time bound):\n{report}");
    assert!(report.writes_accepted >= config.min_writes, "too few accepted writes (the run hit its time bound):\n{report}");
    // The delayed writes must have met newer writes, or the pause test proved nothing.
    assert!(report.pause_writes_rejected >= 1, "no delayed write was ever rejected:\n{report}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn faults_short() {
    let config = Config::short();
    let report = torture::run(config.clone()).await;
    assert_proven(&report, &config);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "minutes long: run with hack/torture.sh"]
async fn faults_long() {
    let config = Config::long_from_env();
    let report = torture::run(config.clone()).await;
    if let Ok(path) = std::env::var("KF_TORTURE_REPORT") {
        let _ = std::fs::write(&path, report.to_string());
    }
    assert_proven(&report, &config);
}
