//! What this repository's test binaries add to `kube-fence-test-support`: the cluster they share
//! (`kube_fence_testenv::shared_kubeconfig`: `KUBECONFIG` when set, else a local control plane
//! started once for the whole test binary) and the leader-go example's pause cycle ([`leader`]).
//! Everything else is the support crate's, re-exported so tests say `common::namespace` etc.
#![allow(dead_code, unused_imports)]

pub mod identity;
pub mod leader;

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
