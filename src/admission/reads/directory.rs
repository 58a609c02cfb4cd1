//! Reading leases from the API server: the kube-fence lease a guarded object is bound to, from a
//! watch cache of all kube-fence Leases or with a quorum read when the cache could be stale in the
//! unsafe direction (`crate::admission::judge::token` says which), and leader-election Leases, always
//! with a quorum read. What a read returns becomes a read value of `crate::admission::judge::read`.
//!
//! A cache that lags is safe for the per-object rule: tokens only grow, so a token at or below
//! what the cache has seen was issued. What the cache cannot answer — CREATE, newly guarded
//! objects, a token newer than it has seen, a relaxed policy — goes to `Api::get`, which the
//! API server serves from etcd with a quorum read (no `resourceVersion` given).

use std::future::Future;
use std::sync::Arc;

use futures::StreamExt;
use kube::runtime::reflector::{self, ObjectRef, Store};
use kube::runtime::{WatchStreamExt, watcher};
use kube::{Api, Client};

use k8s_openapi::api::coordination::v1::Lease as LeaderElectionLease;

use crate::admission::judge::facts::LeaseFacts;

use crate::admission::judge::facts::{LeaseRef, SERVICE_ACCOUNT_PREFIX};
use crate::admission::judge::fence::Fence;
use kube_fence_api::{FencedController, Lease};

/// The webhook's view of the leases, and of the FencedControllers (which fence whose writes).
#[derive(Clone)]
pub struct LeaseDirectory {
    client: Client,
    store: Store<Lease>,
    fences: Store<FencedController>,
}

impl LeaseDirectory {
    /// A directory, and the future that keeps its cache filled (run it for as long as the
    /// directory is used).
    pub fn new(client: Client) -> (LeaseDirectory, impl Future<Output = ()> + Send + 'static) {
        let (store, writer) = reflector::store();
        // The webhook reads only spec.fencing and status.token: keep the cache small (10,000
        // leases cost far less without managedFields, annotations and conditions).
        let trimmed = watcher(Api::<Lease>::all(client.clone()), watcher::Config::default()).modify(|lease: &mut Lease| {
            lease.metadata.managed_fields = None;
            lease.metadata.annotations = None;
            if let Some(status) = lease.status.as_mut() {
                status.conditions.clear();
            }
        });
        let stream = reflector::reflector(writer, trimmed).default_backoff().for_each(|event| async move {
            if let Err(err) = event {
                tracing::warn!(error = %err, "lease watch failed; retrying");
            }
        });
        let (fences, fence_writer) = reflector::store();
        let fenced =
            watcher(Api::<FencedController>::all(client.clone()), watcher::Config::default()).modify(|f: &mut FencedController| {
                f.metadata.managed_fields = None;
                f.metadata.annotations = None;
                f.status = None;
            });
        let fence_stream = reflector::reflector(fence_writer, fenced).default_backoff().for_each(|event| async move {
            if let Err(err) = event {
                tracing::warn!(error = %err, "FencedController watch failed; retrying");
            }
        });
        (LeaseDirectory { client, store, fences }, async move {
            futures::join!(stream, fence_stream);
        })
    }

    /// The client the directory reads with.
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// Whether the lease cache has been filled once (what `/readyz` waits for). The fence cache is
    /// not waited for: a webhook whose fences are not known yet refuses the fenced writers' writes
    /// (503, fail closed) and judges everything else, so a cluster without the FencedController
    /// CRD (`helm upgrade` does not install new CRDs) or an RBAC without it (an older chart) keeps
    /// a ready webhook.
    pub fn is_ready(&self) -> bool {
        // A store that is not ready yet has not seen its initial list.
        futures::FutureExt::now_or_never(self.store.wait_until_ready()).is_some_and(|r| r.is_ok())
    }

    /// Waits until the lease cache has been filled once, at most `timeout`; whether it was.
    pub async fn wait_ready(&self, timeout: std::time::Duration) -> bool {
        matches!(tokio::time::timeout(timeout, self.store.wait_until_ready()).await, Ok(Ok(())))
    }

    /// The fences of the FencedControllers that name `user` (a ServiceAccount's username), as the
    /// cache holds them now; `None` before the cache was filled once. A FencedController whose
    /// spec cannot be judged by (`Fence::of`; the schema refuses such specs) fences nothing here:
    /// its status says so.
    pub fn fences(&self, user: &str) -> Option<Vec<Arc<Fence>>> {
        if !ready_fences(&self.fences) {
            return None;
        }
        let Some((namespace, account)) = user.strip_prefix(SERVICE_ACCOUNT_PREFIX).and_then(|rest| rest.split_once(':')) else {
            return Some(Vec::new());
        };
        let found = self
            .fences
            .state()
            .iter()
            .filter(|f| f.metadata.namespace.as_deref() == Some(namespace) && f.spec.service_accounts.iter().any(|a| a == account))
            .filter_map(|f| Fence::of(f).ok().map(Arc::new))
            .collect();
        Some(found)
    }

    /// The lease as the watch cache has it.
    pub fn cached(&self, lease: LeaseRef<'_>) -> Option<LeaseFacts> {
        let cached = self.store.get(&ObjectRef::new(lease.name).within(lease.namespace));
        cached.as_deref().map(facts)
    }

    /// The lease as etcd has it now: `Api::get` without a resourceVersion is a quorum read.
    pub async fn quorum(&self, lease: LeaseRef<'_>) -> Result<Option<LeaseFacts>, kube::Error> {
        Ok(self.quorum_lease(lease).await?.as_ref().map(facts))
    }

    /// The same, the whole lease.
    pub async fn quorum_lease(&self, lease: LeaseRef<'_>) -> Result<Option<Lease>, kube::Error> {
        Api::<Lease>::namespaced(self.client.clone(), lease.namespace).get_opt(lease.name).await
    }

    /// The leader-election Lease as etcd has it now (a quorum read, as above).
    pub async fn leader_lease(&self, lease: LeaseRef<'_>) -> Result<Option<LeaderElectionLease>, kube::Error> {
        Api::<LeaderElectionLease>::namespaced(self.client.clone(), lease.namespace).get_opt(lease.name).await
    }
}

fn ready_fences(store: &Store<FencedController>) -> bool {
    futures::FutureExt::now_or_never(store.wait_until_ready()).is_some_and(|r| r.is_ok())
}

/// What fencing needs from a lease.
pub fn facts(lease: &Lease) -> LeaseFacts {
    let policy = lease.spec.fencing.clone().unwrap_or_default();
    LeaseFacts {
        issued: lease.status.as_ref().and_then(|s| s.token),
        comparison: policy.comparison.unwrap_or_default(),
        enforcement: policy.enforcement.unwrap_or_default(),
        identity: lease.spec.identity,
        holder: lease.status.as_ref().filter(|s| s.phase == kube_fence_api::Phase::Held).and_then(|s| s.holder.clone()),
    }
}
