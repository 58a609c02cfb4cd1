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
//! - `faults_ha_short` / `faults_ha_unfenced` / `faults_ha_long` (ignored; `hack/torture.sh
//!   --ha`): the same checker on the HA topology (issue 36, [`torture::ha`]): three etcd members,
//!   two API servers, two kube-fence replicas, partitions and kills; the unfenced run (webhook
//!   never registered) must report violations, or the checker proves nothing on this topology.
//!
//! All start a control plane of their own whatever `KUBECONFIG` says: they restart its
//! kube-apiserver and etcd, which no shared cluster may suffer.

mod common;
mod torture;

use torture::ha::{HaConfig, HaFault, HaReport, Path};
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

fn write_report(text: &str) {
    if let Ok(path) = std::env::var("KF_TORTURE_REPORT") {
        let _ = std::fs::write(&path, text);
    }
}

fn assert_ha_proven(report: &HaReport, config: &HaConfig) {
    println!("{report}");
    write_report(&report.to_string());
    assert!(report.violations.is_empty(), "the history has violations:\n{report}");
    assert_eq!(report.planted_accepted, Some(false), "the scripted stale write across the API servers was not refused:\n{report}");
    assert_eq!(report.injected(), config.faults, "fewer faults than asked (the run hit its time bound):\n{report}");
    if config.faults >= 2 * HaFault::ALL.len() as u64 {
        for fault in HaFault::ALL {
            assert!(report.fault(fault) >= 1, "fault {fault:?} was never injected:\n{report}");
        }
    }
    assert!(report.writes_accepted > 0, "no write was accepted:\n{report}");
    // The client-go Lease paths: the scripted stale write refused, and genuine writes sent under
    // every fault kind the run injected (so each kind met these paths too).
    for path in Path::ALL {
        assert_eq!(report.planted_on(path), Some(false), "{}: the scripted stale write was not refused:\n{report}", path.describe());
        assert!(report.path_writes.get(&path).copied().unwrap_or(0) > 0, "{}: no write was admitted:\n{report}", path.describe());
        for fault in HaFault::ALL.into_iter().filter(|f| report.fault(*f) > 0) {
            assert!(
                report.on_path(path, Some(fault)).attempted > 0,
                "{}: no genuine write was sent during {fault:?}:\n{report}",
                path.describe()
            );
        }
    }
}

/// The HA topology, 20 faults (`hack/torture.sh --ha --short`). Needs root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "minutes long, needs root: run with hack/torture.sh --ha --short"]
async fn faults_ha_short() {
    let config = HaConfig::short();
    let report = torture::ha::run(config.clone()).await;
    assert_ha_proven(&report, &config);
}

/// The planted fault: the same run with kube-fence's webhook never registered. The scripted stale
/// write is accepted and the checker must say so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "minutes long, needs root: run with hack/torture.sh --ha --short"]
async fn faults_ha_unfenced() {
    let config = HaConfig { fenced: false, faults: 4, ..HaConfig::short() };
    let report = torture::ha::run(config.clone()).await;
    println!("{report}");
    assert_eq!(report.planted_accepted, Some(true), "without the webhook the scripted stale write must be accepted:\n{report}");
    assert!(!report.violations.is_empty(), "the checker missed the accepted stale write(s):\n{report}");
    // The same on the client-go Lease paths: the ex-leader's delayed writes are admitted, and the
    // checker finds them in the watched history.
    for path in Path::ALL {
        assert_eq!(
            report.planted_on(path),
            Some(true),
            "{}: without the webhook the scripted stale write must be accepted:\n{report}",
            path.describe()
        );
        assert!(report.violations_on(Some(path)) > 0, "{}: the checker missed the accepted stale write(s):\n{report}", path.describe());
    }
}

/// The long run on the HA topology (`hack/torture.sh --ha`; `KF_HA_FAULTS`, default 2,000).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "hours long, needs root: run with hack/torture.sh --ha"]
async fn faults_ha_long() {
    let config = HaConfig::long_from_env();
    let report = torture::ha::run(config.clone()).await;
    assert_ha_proven(&report, &config);
}
