//! Lease reads from memory, for pure tests and benchmarks: a watch cache and a quorum that may
//! disagree (the cache lags), leader-election Leases, and a failure to inject. Every read
//! answers at once, so a plan driven over it completes on its first poll
//! (`futures::FutureExt::now_or_never`). It counts the reads it answered. Built for this crate's
//! tests and, with the `test-support` feature, for its integration tests and benchmark.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use k8s_openapi::api::coordination::v1::{Lease as LeaderElectionLease, LeaseSpec};
use kube::api::ObjectMeta;

use super::facts::{LeaseFacts, LeaseRef};
use super::fence::{Fence, Mode, ResourceName};
use super::read::{Cached, HolderQuorum, LeaseReads, Quorum, ReadError, WriterQuorum};

/// Leases in memory, by `namespace/name`.
#[derive(Debug, Default)]
pub struct FakeLeases {
    cached: Vec<(String, String, LeaseFacts)>,
    current: Vec<(String, String, LeaseFacts)>,
    leader: Vec<(String, String, LeaderElectionLease)>,
    failure: Option<ReadError>,
    counts: [AtomicUsize; 4],
    fences: Vec<Arc<Fence>>,
    /// The fence cache has not been filled yet.
    fences_unknown: bool,
}

/// How many reads of each kind a [`FakeLeases`] answered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReadCounts {
    pub cached: usize,
    pub quorum: usize,
    pub holder: usize,
    pub writer: usize,
}

// The read kinds, as indexes into `FakeLeases::counts`; every kind but the cache may fail.
const CACHED: usize = 0;
const QUORUM: usize = 1;
const HOLDER: usize = 2;
const WRITER: usize = 3;

fn find<'a, T>(entries: &'a [(String, String, T)], lease: LeaseRef<'_>) -> Option<&'a T> {
    entries.iter().find(|(ns, name, _)| ns == lease.namespace && name == lease.name).map(|(_, _, t)| t)
}

impl FakeLeases {
    /// The kube-fence lease `namespace/name` as the watch cache holds it.
    pub fn with_cached(mut self, namespace: &str, name: &str, facts: LeaseFacts) -> FakeLeases {
        self.cached.push((namespace.into(), name.into(), facts));
        self
    }

    /// The kube-fence lease `namespace/name` as a quorum read returns it.
    pub fn with_current(mut self, namespace: &str, name: &str, facts: LeaseFacts) -> FakeLeases {
        self.current.push((namespace.into(), name.into(), facts));
        self
    }

    /// The kube-fence lease `namespace/name`, the same in the cache and the quorum.
    pub fn with_lease(self, namespace: &str, name: &str, facts: LeaseFacts) -> FakeLeases {
        self.with_cached(namespace, name, facts.clone()).with_current(namespace, name, facts)
    }

    /// The leader-election Lease `namespace/name` (what holder and writer reads return).
    pub fn with_leader_lease(mut self, namespace: &str, name: &str, lease: LeaderElectionLease) -> FakeLeases {
        self.leader.push((namespace.into(), name.into(), lease));
        self
    }

    /// The FencedController `fence`, in the fence cache.
    pub fn with_fence(mut self, fence: Fence) -> FakeLeases {
        self.fences.push(Arc::new(fence));
        self
    }

    /// The fence cache has not been filled yet.
    pub fn fences_unknown(mut self) -> FakeLeases {
        self.fences_unknown = true;
        self
    }

    /// Every quorum read (kube-fence lease, holder, writer) fails with `error`.
    pub fn failing(mut self, error: ReadError) -> FakeLeases {
        self.failure = Some(error);
        self
    }

    /// The reads answered so far.
    pub fn reads(&self) -> ReadCounts {
        let [cached, quorum, holder, writer] = self.counts.each_ref().map(|c| c.load(Ordering::Relaxed));
        ReadCounts { cached, quorum, holder, writer }
    }

    fn count(&self, kind: usize) -> Result<(), ReadError> {
        self.counts[kind].fetch_add(1, Ordering::Relaxed);
        match &self.failure {
            Some(error) if kind != CACHED => Err(error.clone()),
            _ => Ok(()),
        }
    }
}

impl LeaseReads for FakeLeases {
    fn cached(&self, lease: LeaseRef<'_>) -> Cached {
        let _ = self.count(CACHED);
        Cached::new(find(&self.cached, lease).cloned())
    }

    async fn quorum(&self, lease: LeaseRef<'_>) -> Result<Quorum, ReadError> {
        self.count(QUORUM)?;
        Ok(Quorum::new(find(&self.current, lease).cloned()))
    }

    async fn holder(&self, lease: LeaseRef<'_>) -> Result<HolderQuorum, ReadError> {
        self.count(HOLDER)?;
        Ok(HolderQuorum::of(find(&self.leader, lease)))
    }

    async fn writer(&self, lease: LeaseRef<'_>) -> Result<WriterQuorum, ReadError> {
        self.count(WRITER)?;
        Ok(WriterQuorum::of(find(&self.leader, lease)))
    }

    fn fences(&self, user: &str) -> Option<Vec<Arc<Fence>>> {
        (!self.fences_unknown).then(|| self.fences.iter().filter(|f| f.account_of(user).is_some()).cloned().collect())
    }
}

/// The resourceVersion of every fake leader-election Lease ([`leader_lease`]).
pub const LEADER_LEASE_VERSION: &str = "17";

/// A leader-election Lease `namespace/name` with these labels and annotations, held by `holder`
/// (`None`: never held): what the fake's holder and writer reads answer with.
pub fn leader_lease(
    namespace: &str,
    name: &str,
    labels: &[(&str, &str)],
    annotations: &[(&str, &str)],
    holder: Option<&str>,
) -> LeaderElectionLease {
    let map = |pairs: &[(&str, &str)]| {
        (!pairs.is_empty()).then(|| pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect::<BTreeMap<_, _>>())
    };
    LeaderElectionLease {
        metadata: ObjectMeta {
            name: Some(name.into()),
            namespace: Some(namespace.into()),
            labels: map(labels),
            annotations: map(annotations),
            resource_version: Some(LEADER_LEASE_VERSION.into()),
            ..ObjectMeta::default()
        },
        spec: Some(LeaseSpec { holder_identity: holder.map(str::to_string), ..LeaseSpec::default() }),
    }
}

/// The fence of FencedController `namespace/name` on Lease `name`, for ServiceAccounts
/// `accounts`, exempting `exempt` (`resource[.group]`), in `mode`.
pub fn fence(namespace: &str, name: &str, accounts: &[&str], exempt: &[&str], mode: Mode) -> Fence {
    Fence {
        namespace: namespace.into(),
        name: name.into(),
        lease: name.into(),
        accounts: accounts.iter().map(|a| a.to_string()).collect(),
        exempt: exempt.iter().map(|e| ResourceName::parse(e).expect("an exempt resource")).collect(),
        mode,
    }
}
