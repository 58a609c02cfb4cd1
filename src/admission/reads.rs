//! How a lease is read for judging: the one interface, [`LeaseReads`], the values a read
//! returns, the webhook's real reads ([`Reader`]: the watch cache and quorum reads of
//! `super::leases`, budgeted per source by `super::bounds`, the writer fence's reads shared by
//! `super::shared_reads`) and an in-memory fake for tests ([`fake::FakeLeases`]).
//!
//! A read value — [`Cached`], [`Quorum`], [`HolderQuorum`], [`WriterQuorum`] — is made only by a
//! reader in this module: its fields are private and it has no public constructor, so a plan
//! that asks for a quorum read can be judged only with what a quorum read (or the fake standing
//! in for one) returned. A struct literal does not compile:
//!
//! ```compile_fail,E0423
//! use kube_fence::admission::reads::Quorum;
//! let forged = Quorum(None);
//! ```
//! ```compile_fail,E0423
//! use kube_fence::admission::reads::HolderQuorum;
//! let forged = HolderQuorum(Some("web-0".to_string()));
//! ```
//! ```compile_fail,E0423
//! use kube_fence::admission::reads::{Cached, WriterQuorum};
//! let (cached, fresh) = (Cached(None), WriterQuorum(None));
//! ```
//!
//! What compiles is a read, here from the fake:
//!
//! ```
//! use futures::FutureExt;
//! use kube_fence::admission::decision::{LeaseFacts, LeaseRef};
//! use kube_fence::admission::reads::{LeaseReads, fake::FakeLeases};
//! let leases = FakeLeases::default().with_current("team", "work", LeaseFacts::default());
//! let read = leases.quorum(LeaseRef { namespace: "team", name: "work" }).now_or_never();
//! assert!(matches!(read, Some(Ok(quorum)) if quorum.lease().is_some()));
//! ```

pub mod fake;

use std::collections::BTreeSet;
use std::future::Future;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use k8s_openapi::api::coordination::v1::Lease as LeaderElectionLease;

use super::bounds::ReadBudget;
use super::decision::{LeaseFacts, LeaseRef, Reason, Verdict};
use super::leader::{HOLDER_IDENTITY_LABEL, HOLDER_IS_POD};
use super::leases::LeaseDirectory;
use super::metrics::{LeaseReadKind, Metrics};
use super::shared_reads::SharedReads;
use super::writer::accounts_named;

/// The reads the guards ask for. [`super::pipeline::drive`] makes the ones a plan names, in
/// order; the real reads are [`SourceReads`], the fake [`fake::FakeLeases`].
pub trait LeaseReads {
    /// The kube-fence lease as the watch cache holds it (never fails: absent is `None`).
    fn cached(&self, lease: LeaseRef<'_>) -> Cached;
    /// The kube-fence lease as a quorum read returns it.
    fn quorum(&self, lease: LeaseRef<'_>) -> impl Future<Output = Result<Quorum, ReadError>> + Send;
    /// The holder of a leader-election Lease, by a quorum read (objects labelled
    /// `kubefence.io/leader-lease`).
    fn holder(&self, lease: LeaseRef<'_>) -> impl Future<Output = Result<HolderQuorum, ReadError>> + Send;
    /// An opted-in leader-election Lease, by a quorum read (the writer fence).
    fn writer(&self, lease: LeaseRef<'_>) -> impl Future<Output = Result<WriterQuorum, ReadError>> + Send;
}

/// Why a quorum read was not made or did not answer. Judged as a denial (fail closed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ReadError {
    /// The request's source used up its quorum-read budget (`super::bounds::ReadBudget`).
    Throttled { source: IpAddr, per_second: u32 },
    /// The API server did not answer the read.
    Failed(String),
}

impl ReadError {
    /// The denial for a read of `lease` (a kube-fence lease or, `leader`, a leader-election
    /// Lease) that failed this way.
    pub fn verdict(&self, lease: LeaseRef<'_>, leader: bool) -> Verdict {
        match self {
            ReadError::Throttled { source, per_second } => Verdict::deny(
                429,
                Reason::ReadsThrottled,
                format!("too many reviews needing a quorum read from {source} (at most {per_second} a second); retry in a second"),
            ),
            ReadError::Failed(err) => {
                let kind = if leader { "leader-election Lease" } else { "lease" };
                Verdict::deny(500, Reason::LeaseReadFailed, format!("cannot read {kind} {lease} (failing closed): {err}"))
            }
        }
    }
}

/// The lease as the watch cache holds it (`None`: not in the cache). Judging from it is safe
/// only where `super::decision::CacheRead::judge` says so.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cached(Option<LeaseFacts>);

impl Cached {
    /// The lease's facts, if the cache has it.
    pub fn lease(&self) -> Option<&LeaseFacts> {
        self.0.as_ref()
    }
}

/// The lease as a linearizable (quorum) read returned it (`None`: no such lease).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quorum(Option<LeaseFacts>);

impl Quorum {
    /// The lease's facts, if it exists.
    pub fn lease(&self) -> Option<&LeaseFacts> {
        self.0.as_ref()
    }
}

/// A leader-election Lease as a quorum read returned it: `None` when there is no such Lease,
/// else its `holderIdentity` (`""` when released or never held).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderQuorum(Option<String>);

impl HolderQuorum {
    fn of(lease: Option<&LeaderElectionLease>) -> HolderQuorum {
        HolderQuorum(lease.map(|l| l.spec.as_ref().and_then(|s| s.holder_identity.clone()).unwrap_or_default()))
    }

    /// The Lease's `holderIdentity` (`""`: nobody), `None` when there is no such Lease.
    pub fn holder(&self) -> Option<&str> {
        self.0.as_deref()
    }
}

/// An opted-in leader-election Lease as a quorum read returned it: `None` when there is no
/// such Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriterQuorum(Option<FreshLease>);

/// What judging a writer needs of the Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FreshLease {
    /// `spec.holderIdentity` (`""` when released or never held).
    pub holder: String,
    /// Whether it still carries `kubefence.io/holder-identity: Pod`.
    pub holder_bound: bool,
    /// The ServiceAccounts its writers annotation names now.
    pub accounts: BTreeSet<String>,
}

impl WriterQuorum {
    fn of(lease: Option<&LeaderElectionLease>) -> WriterQuorum {
        WriterQuorum(lease.map(|l| FreshLease {
            holder: l.spec.as_ref().and_then(|s| s.holder_identity.clone()).unwrap_or_default(),
            holder_bound: l.metadata.labels.as_ref().and_then(|m| m.get(HOLDER_IDENTITY_LABEL)).is_some_and(|v| v == HOLDER_IS_POD),
            accounts: accounts_named(l.metadata.annotations.as_ref()),
        }))
    }

    /// The Lease, if it exists.
    pub fn lease(&self) -> Option<&FreshLease> {
        self.0.as_ref()
    }
}

/// Shared quorum reads of opted-in Leases, per `(namespace, name)`.
type WriterReads = SharedReads<(String, String), Result<WriterQuorum, String>>;

/// The webhook's reads: its lease directory (watch cache and quorum reads), the quorum reads
/// each source may cause (`None`: unbudgeted), and the writer fence's shared reads.
pub struct Reader {
    leases: LeaseDirectory,
    metrics: Metrics,
    budget: Option<Mutex<ReadBudget>>,
    writer_reads: Arc<WriterReads>,
}

impl Reader {
    /// Reads through `leases`, counted in `metrics`, at most `per_second` reviews needing a
    /// quorum read per source address (`None`: unbudgeted).
    pub fn new(leases: LeaseDirectory, metrics: Metrics, per_second: Option<u32>) -> Reader {
        Reader { leases, metrics, budget: per_second.map(|n| Mutex::new(ReadBudget::new(n))), writer_reads: Arc::default() }
    }

    /// The lease directory (whose readiness `/readyz` reports).
    pub fn leases(&self) -> &LeaseDirectory {
        &self.leases
    }

    /// The reads of one review, sent from `source` (whose read budget they use).
    pub fn from(&self, source: IpAddr) -> SourceReads<'_> {
        SourceReads { reader: self, source }
    }
}

/// The real reads of one review from `source`.
pub struct SourceReads<'a> {
    reader: &'a Reader,
    source: IpAddr,
}

impl SourceReads<'_> {
    /// Whether the source may cause one more quorum read; counts the refusal if not.
    fn admit(&self) -> Result<(), ReadError> {
        let Some(budget) = self.reader.budget.as_ref() else { return Ok(()) };
        let mut budget = budget.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if budget.admit(self.source, Instant::now()) {
            return Ok(());
        }
        self.reader.metrics.reads_throttled.inc();
        Err(ReadError::Throttled { source: self.source, per_second: budget.per_second() })
    }
}

impl LeaseReads for SourceReads<'_> {
    fn cached(&self, lease: LeaseRef<'_>) -> Cached {
        self.reader.metrics.lease_read(LeaseReadKind::Cache);
        Cached(self.reader.leases.cached(lease))
    }

    async fn quorum(&self, lease: LeaseRef<'_>) -> Result<Quorum, ReadError> {
        self.admit()?;
        self.reader.metrics.lease_read(LeaseReadKind::Linearizable);
        self.reader.leases.quorum(lease).await.map(Quorum).map_err(|e| ReadError::Failed(e.to_string()))
    }

    async fn holder(&self, lease: LeaseRef<'_>) -> Result<HolderQuorum, ReadError> {
        self.admit()?;
        self.reader.metrics.lease_read(LeaseReadKind::Linearizable);
        let fresh = self.reader.leases.leader_lease(lease).await.map_err(|e| ReadError::Failed(e.to_string()))?;
        Ok(HolderQuorum::of(fresh.as_ref()))
    }

    async fn writer(&self, lease: LeaseRef<'_>) -> Result<WriterQuorum, ReadError> {
        self.admit()?;
        // Concurrent writes of one controller share the next quorum read of its Lease.
        let key = (lease.namespace.to_string(), lease.name.to_string());
        let (leases, metrics, (namespace, name)) = (self.reader.leases.clone(), self.reader.metrics.clone(), key.clone());
        let shared = self.reader.writer_reads.read(key, move || async move {
            metrics.lease_read(LeaseReadKind::Linearizable);
            let fresh = leases.leader_lease(LeaseRef { namespace: &namespace, name: &name }).await.map_err(|e| e.to_string())?;
            Ok::<_, String>(WriterQuorum::of(fresh.as_ref()))
        });
        shared.await.map_err(ReadError::Failed)
    }
}
