//! What this repository's test binaries add to `kube-fence-test-support`: the cluster they share
//! (`kube_fence_testenv::shared_kubeconfig`: `KUBECONFIG` when set, else a local control plane
//! started once for the whole test binary) and the leader-go example's pause cycle ([`leader`]).
//! Everything else is the support crate's, re-exported so tests say `common::namespace` etc.
#![allow(dead_code, unused_imports)]

pub mod cli;
pub mod identity;
pub mod leader;
pub mod postgres;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

pub use kube_fence_test_support::*;

/// The shared test cluster's kubeconfig (`kube_fence_testenv::shared_kubeconfig`, off the
/// async runtime: the first call may start a control plane).
pub async fn kubeconfig() -> PathBuf {
    tokio::task::spawn_blocking(kube_fence_testenv::shared_kubeconfig).await.expect("control plane thread")
}

/// A client for the shared test cluster, with kube-fence's CRDs installed and established.
pub async fn client() -> kube::Client {
    kube_fence_test_support::client(&kubeconfig().await).await
}

/// Waits (at most `limit`) for the ready file at `path` of the kube-fence process `child`
/// (`--ready-file`, [`kube_fence::ready`]), and returns where it serves. Panics if the process
/// exits first.
pub async fn wait_ready_file(path: &Path, child: &mut std::process::Child, limit: Duration) -> kube_fence::ready::Ready {
    let deadline = Instant::now() + limit;
    loop {
        match kube_fence::ready::Ready::read(path) {
            Ok(Some(ready)) => return ready,
            Ok(None) => {}
            Err(err) => panic!("{}", kube_fence::telemetry::Chain(&err)),
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("kube-fence exited ({status}) before writing its ready file {}", path.display());
        }
        assert!(Instant::now() < deadline, "no ready file {} within {limit:?}", path.display());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A copy of the shared kubeconfig at `dir/name`, edited (as JSON: a kubeconfig's keys are strings).
pub fn kubeconfig_variant(dir: &Path, name: &str, edit: impl FnOnce(&mut serde_json::Value)) -> PathBuf {
    let shared = kube_fence_testenv::shared_kubeconfig();
    let source = std::fs::read_to_string(&shared).unwrap_or_else(|e| panic!("reading {}: {e}", shared.display()));
    let mut config: serde_json::Value = serde_saphyr::from_str(&source).expect("the shared kubeconfig is YAML");
    edit(&mut config);
    let path = dir.join(name);
    std::fs::write(&path, serde_saphyr::to_string(&config).expect("kubeconfig YAML")).expect("write kubeconfig");
    path
}

/// Every entry of a kubeconfig list (`clusters`, `contexts`, `users`), at `field` (`cluster`,
/// `context`, `user`).
pub fn entries<'a>(config: &'a mut serde_json::Value, list: &str, field: &str) -> Vec<&'a mut serde_json::Map<String, serde_json::Value>> {
    config
        .get_mut(list)
        .and_then(|v| v.as_array_mut())
        .expect("kubeconfig list")
        .iter_mut()
        .filter_map(|entry| entry.get_mut(field).and_then(|v| v.as_object_mut()))
        .collect()
}

/// The shared cluster's API server audit log (`kube_fence_testenv::AUDIT_POLICY`: every
/// ConfigMap write, JSON lines), beside its kubeconfig when kube-fence-testenv started it. Panics,
/// saying why, for a cluster whose audit log is not on this machine.
pub async fn audit_log() -> PathBuf {
    let kubeconfig = kubeconfig().await;
    let log = kubeconfig.parent().map(|dir| dir.join(kube_fence_testenv::AUDIT_LOG_FILE));
    log.filter(|log| log.is_file()).unwrap_or_else(|| {
        panic!(
            "no audit log beside {}: this test reads the API server's audit log, which the local control plane (hack/test.sh without KUBECONFIG) keeps",
            kubeconfig.display()
        )
    })
}

/// The audit events of writes to ConfigMap `ns/name`, in the order the API server logged them,
/// once `enough` says they are all there (the API server writes an event as the request
/// completes; at most 30 s).
pub async fn audit_events(log: &Path, ns: &str, name: &str, enough: impl Fn(&[serde_json::Value]) -> bool) -> Vec<serde_json::Value> {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_else(|e| panic!("reading {}: {e}", log.display()));
        let events: Vec<serde_json::Value> = text
            .lines()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|e| e["objectRef"]["namespace"] == ns && e["objectRef"]["name"] == name)
            .collect();
        if enough(&events) {
            return events;
        }
        assert!(Instant::now() < deadline, "the audit log {} has not the events wanted of {ns}/{name}: {events:#?}", log.display());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A kube-fence webhook's audit annotation `key` on an audit event (the API server prefixes it
/// with the webhook's name, `<…>.kubefence.io/<key>`).
pub fn kube_fence_annotation<'a>(event: &'a serde_json::Value, key: &str) -> Option<&'a str> {
    event["annotations"].as_object()?.iter().find_map(|(k, v)| {
        let (webhook, k) = k.split_once('/')?;
        (webhook.ends_with(".kubefence.io") && k == key).then(|| v.as_str()).flatten()
    })
}
