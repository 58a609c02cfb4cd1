//! The reads judging makes, as values: the one interface a reader implements
//! ([`LeaseReads`]), what each read returns, and why a read failed. The real reader is
//! `crate::admission::reads` (the watch cache and quorum reads, budgeted); the fake,
//! for tests and the benchmark, is `super::fake`.
//!
//! A read value — [`Cached`], [`Quorum`], [`HolderQuorum`], [`WriterQuorum`] — is made only by a
//! reader: its fields are private and its constructors are crate-internal (used by the real
//! reader and the fake alone), so a plan that asks for a quorum read can be judged only with what
//! a quorum read (or the fake standing in for one) returned. Outside the crate a struct literal
//! does not compile:
//!
//! ```compile_fail,E0423
//! use kube_fence::admission::judge::read::Quorum;
//! let forged = Quorum(None);
//! ```
//! ```compile_fail,E0423
//! use kube_fence::admission::judge::read::HolderQuorum;
//! let forged = HolderQuorum(Some("web-0".to_string()));
//! ```
//! ```compile_fail,E0423
//! use kube_fence::admission::judge::read::{Cached, WriterQuorum};
//! let (cached, fresh) = (Cached(None), WriterQuorum(None));
//! ```
//!
//! What compiles is a read, here from the fake:
//!
//! ```
//! use futures::FutureExt;
//! use kube_fence::admission::judge::facts::{LeaseFacts, LeaseRef};
//! use kube_fence::admission::judge::read::LeaseReads;
//! use kube_fence::admission::judge::fake::FakeLeases;
//! let leases = FakeLeases::default().with_current("team", "work", LeaseFacts::default());
//! let read = leases.quorum(LeaseRef { namespace: "team", name: "work" }).now_or_never();
//! assert!(matches!(read, Some(Ok(quorum)) if quorum.lease().is_some()));
//! ```

use std::future::Future;
use std::net::IpAddr;
use std::sync::Arc;

use k8s_openapi::api::coordination::v1::Lease as LeaderElectionLease;
use kube_fence_api::denial::Reason;

use super::facts::{LeaseFacts, LeaseRef};
use super::fence::Fence;
use super::verdict::{Held, Verdict};
use crate::telemetry::Chain;

/// The reads the guards ask for: each guard's pending read (`super::guard::Pending`) makes the
/// one it needs. The real reads are `crate::admission::reads::SourceReads`, the fake
/// `super::fake::FakeLeases`.
pub trait LeaseReads {
    /// The kube-fence lease as the watch cache holds it (never fails: absent is `None`).
    fn cached(&self, lease: LeaseRef<'_>) -> Cached;
    /// The kube-fence lease as a quorum read returns it.
    fn quorum(&self, lease: LeaseRef<'_>) -> impl Future<Output = Result<Quorum, ReadError>> + Send;
    /// The holder of a leader-election Lease, by a quorum read (objects labelled
    /// `kubefence.io/leader-lease`).
    fn holder(&self, lease: LeaseRef<'_>) -> impl Future<Output = Result<HolderQuorum, ReadError>> + Send;
    /// A fenced controller's leader-election Lease, by a quorum read (the writer fence).
    fn writer(&self, lease: LeaseRef<'_>) -> impl Future<Output = Result<WriterQuorum, ReadError>> + Send;
    /// The fences (FencedControllers) that name `user`, as the webhook's cache of them holds them
    /// now; `None` before the cache was filled once.
    fn fences(&self, user: &str) -> Option<Vec<Arc<Fence>>>;
}

/// Why a quorum read was not made or did not answer. Judged as a denial (fail closed).
#[derive(Clone, Debug)]
pub enum ReadError {
    /// The request's source used up its quorum-read budget
    /// (`crate::admission::reads::ReadBudget`): for the leases of `namespace`, or (`None`) in all.
    Throttled { source: IpAddr, namespace: Option<String>, per_second: u32 },
    /// The API server did not answer the read (shared by every review that waited for it).
    Failed(Arc<kube::Error>),
    /// No answer within this long: the API server's webhook timeout, past which no review is
    /// waiting any more (a read sent into a partition may never be answered, and would hold up
    /// every later read of its lease).
    Unanswered(std::time::Duration),
}

impl ReadError {
    /// The denial for a read of `lease` (a kube-fence lease or, `leader`, a leader-election
    /// Lease) that failed this way.
    pub fn verdict(&self, lease: LeaseRef<'_>, leader: bool) -> Verdict {
        match self {
            ReadError::Throttled { source, namespace, per_second } => Verdict::deny(
                429,
                Reason::ReadsThrottled,
                match namespace {
                    Some(namespace) => format!(
                        "too many quorum reads of leases of namespace {namespace} from {source} (at most {per_second} a second); retry in a second"
                    ),
                    None => format!("too many quorum reads from {source} (at most {per_second} a second); retry in a second"),
                },
            ),
            ReadError::Failed(err) => {
                let kind = if leader { "leader-election Lease" } else { "lease" };
                Verdict::deny(500, Reason::LeaseReadFailed, format!("cannot read {kind} {lease} (failing closed): {}", Chain(err.as_ref())))
            }
            ReadError::Unanswered(after) => {
                let kind = if leader { "leader-election Lease" } else { "lease" };
                Verdict::deny(
                    500,
                    Reason::LeaseReadFailed,
                    format!("cannot read {kind} {lease} (failing closed): the API server did not answer within {}s", after.as_secs_f64()),
                )
            }
        }
    }
}

/// The lease as the watch cache holds it (`None`: not in the cache). Judging from it is safe
/// only where `super::token::CacheRead::judge` says so.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cached(Option<LeaseFacts>);

impl Cached {
    /// What a watch-cache read returned (readers only).
    pub(crate) fn new(lease: Option<LeaseFacts>) -> Cached {
        Cached(lease)
    }

    /// The lease's facts, if the cache has it.
    pub fn lease(&self) -> Option<&LeaseFacts> {
        self.0.as_ref()
    }
}

/// The lease as a linearizable (quorum) read returned it (`None`: no such lease).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quorum(Option<LeaseFacts>);

impl Quorum {
    /// What a quorum read returned (readers only).
    pub(crate) fn new(lease: Option<LeaseFacts>) -> Quorum {
        Quorum(lease)
    }

    /// The lease's facts, if it exists.
    pub fn lease(&self) -> Option<&LeaseFacts> {
        self.0.as_ref()
    }
}

/// A leader-election Lease as a quorum read returned it: `None` when there is no such Lease,
/// else its `holderIdentity` (`""` when released or never held), and the resourceVersion read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderQuorum(Holding);

impl HolderQuorum {
    /// What a quorum read of the Lease returned (readers only).
    pub(crate) fn of(lease: Option<&LeaderElectionLease>) -> HolderQuorum {
        HolderQuorum(Holding::of(lease))
    }

    /// The Lease's `holderIdentity` (`""`: nobody), `None` when there is no such Lease.
    pub fn holder(&self) -> Option<&str> {
        self.0.holder.as_deref()
    }

    /// Who held `lease` at this read, for an admitted write's answer.
    pub fn held(&self, lease: LeaseRef<'_>) -> Held {
        self.0.held(lease)
    }
}

/// A fenced controller's leader-election Lease as a quorum read returned it: `None` when there is
/// no such Lease, else its `holderIdentity` (`""` when released or never held), and the
/// resourceVersion read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriterQuorum(Holding);

impl WriterQuorum {
    /// What a quorum read of the Lease returned (readers only).
    pub(crate) fn of(lease: Option<&LeaderElectionLease>) -> WriterQuorum {
        WriterQuorum(Holding::of(lease))
    }

    /// The Lease's `holderIdentity` (`""`: nobody), `None` when there is no such Lease.
    pub fn holder(&self) -> Option<&str> {
        self.0.holder.as_deref()
    }

    /// Who held `lease` at this read, for an admitted write's answer.
    pub fn held(&self, lease: LeaseRef<'_>) -> Held {
        self.0.held(lease)
    }
}

/// What both holder reads keep of a leader-election Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Holding {
    holder: Option<String>,
    resource_version: String,
}

impl Holding {
    fn of(lease: Option<&LeaderElectionLease>) -> Holding {
        Holding {
            holder: lease.map(|l| l.spec.as_ref().and_then(|s| s.holder_identity.clone()).unwrap_or_default()),
            resource_version: lease.and_then(|l| l.metadata.resource_version.clone()).unwrap_or_default(),
        }
    }

    fn held(&self, lease: LeaseRef<'_>) -> Held {
        Held { lease: lease.to_string(), holder: self.holder.clone().unwrap_or_default(), resource_version: self.resource_version.clone() }
    }
}
