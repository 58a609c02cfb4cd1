//! Where a write is judged, end to end: facts → [`plan`] (pure) → the reads the plan asks for,
//! made by [`drive`] through a [`LeaseReads`] → verdict (pure). The server, the unit tables,
//! the property tests and the benchmark all judge through [`judge`]; only the reader differs
//! (the webhook's `super::reads::SourceReads`, or `super::reads::fake::FakeLeases`).
//!
//! One [`Preamble`] serves every guard kind: what a request's operation, objects and requester
//! say before any guard's own rules (objects missing, an exempt requester, a write no guard
//! judges, a finalizer removal, who asks) is worked out once. The guards then plan in turn:
//! an object may carry both a leader-election guard (`super::leader`) and a token guard
//! (`super::decision`, holder-only objects included), and [`both`] is the rule that combines
//! them. The writer fence (`super::writer`) judges every write of its opted-in writers: of the
//! preamble it takes who asks.

use std::future::Future;

use super::decision::{self, CacheRead, Exemptions, LeaseRef, ObjectFacts, Operation, QuorumRead, Reason, Request, Requester, Verdict};
use super::leader::{self, HolderRead, IdentityRule, LeaderPlan};
use super::reads::{HolderQuorum, LeaseReads, ReadError};
use super::writer::{self, WriterRead};

/// How this webhook judges: who is exempt, and how a leader-election Lease names a Pod
/// (`--leader-identity-separator`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Judging {
    pub exempt: Exemptions,
    pub identity: IdentityRule,
}

/// Which webhook a review was sent to: the guarded objects' (`/validate`), or the writer fence
/// of an opted-in Lease (`/writer/<namespace>/<name>`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sent<'r> {
    Objects,
    Writer(LeaseRef<'r>),
}

/// What every guard kind knows of a request before its own rules, worked out once.
#[derive(Clone, Copy, Debug)]
pub struct Preamble<'r> {
    operation: Operation,
    /// The request lacks an object its operation carries.
    missing: bool,
    /// The requester writes guarded objects without a token (`Exemptions::contains`).
    exempt: bool,
    /// The requester may add or remove the leader-lease label (`--lease-admin`).
    pub label_admin: bool,
    /// CONNECT, or a subresource CREATE or DELETE (eviction, binding, token): it makes or removes
    /// no guarded object, so no object guard judges it.
    unjudged: bool,
    /// The write is to a subresource (`status`, `scale`, ...).
    pub subresource: bool,
    /// An UPDATE that only removes finalizers from an object being deleted.
    pub finalizers_removed: bool,
    /// Who asks.
    pub requester: Requester<'r>,
}

impl<'r> Preamble<'r> {
    /// The preamble of `req`, with `exempt` saying who is exempt.
    pub fn of(req: &'r Request, exempt: &Exemptions) -> Preamble<'r> {
        let needs_old = matches!(req.operation, Operation::Update | Operation::Delete);
        let needs_new = matches!(req.operation, Operation::Create | Operation::Update);
        let subresource = req.subresource.as_deref().is_some_and(|s| !s.is_empty());
        let finalizers_removed = match (req.operation, &req.old, &req.new) {
            (Operation::Update, Some(old), Some(new)) => only_removes_finalizers(old, new),
            _ => false,
        };
        Preamble {
            operation: req.operation,
            missing: (needs_old && req.old.is_none()) || (needs_new && req.new.is_none()),
            exempt: exempt.contains(&req.user),
            label_admin: exempt.may_move_leader_label(&req.user),
            unjudged: req.operation == Operation::Connect
                || (subresource && matches!(req.operation, Operation::Create | Operation::Delete)),
            subresource,
            finalizers_removed,
            requester: Requester { user: &req.user, pod: req.pod.as_ref() },
        }
    }

    /// The denial when the request lacks an object its operation carries: whether the object is
    /// guarded is known only from the objects the review carries, so no object guard can judge it.
    pub fn malformed(&self) -> Option<Verdict> {
        self.missing.then(|| {
            Verdict::deny(
                400,
                Reason::MalformedRequest,
                format!(
                    "a {:?} admission request must carry {}",
                    self.operation,
                    match self.operation {
                        Operation::Create => "the incoming object (object)",
                        Operation::Delete => "the stored object (oldObject)",
                        _ => "both the stored (oldObject) and the incoming object (object)",
                    }
                ),
            )
        })
    }

    /// What an object guard decides before its own rules: `Unguarded` unless its label is on the
    /// object (`guarded`), `Exempt` for an exempt requester.
    pub fn settled(&self, guarded: bool) -> Option<Verdict> {
        let reason = if !guarded {
            Reason::Unguarded
        } else if self.exempt {
            Reason::Exempt
        } else {
            return None;
        };
        Some(Verdict::Allow { reason })
    }

    /// `Unguarded` for a write no object guard judges (CONNECT, a subresource CREATE or DELETE).
    pub fn unjudged(&self) -> Option<Verdict> {
        self.unjudged.then_some(Verdict::Allow { reason: Reason::Unguarded })
    }
}

/// Whether an UPDATE only removes finalizers from an object being deleted: the guard, every
/// label and annotation and every field outside metadata unchanged. Controllers (PVC protection,
/// foreground deletion, operators' own) must be able to finish a deletion someone was allowed to
/// start; blocking them would pin the object, and its namespace, for ever.
fn only_removes_finalizers(old: &ObjectFacts, new: &ObjectFacts) -> bool {
    let subset = new.finalizers.iter().all(|f| old.finalizers.contains(f)) && new.finalizers.len() < old.finalizers.len();
    old.deleting && subset && old.same_guard(new) && old.content.is_some() && old.content == new.content
}

/// Where judging a request stands: judged, or waiting for one read.
#[derive(Debug)]
pub enum Step<'r> {
    Done(Verdict),
    /// Read the kube-fence lease from the watch cache: [`CacheRead::judge`].
    Cache(CacheRead<'r>),
    /// Read the kube-fence lease with a quorum read: [`QuorumRead::judge`].
    Quorum(QuorumRead<'r>),
    /// Read the leader-election Lease's holder with a quorum read: [`BothGuards::judge`].
    Holder(BothGuards<'r>),
    /// Read the opted-in Lease with a quorum read: [`WriterRead::judge`].
    Writer(WriterRead<'r>),
}

/// A request judged by who holds its leader-election Lease, then by its token guard.
#[derive(Debug)]
pub struct BothGuards<'r> {
    holder: HolderRead<'r>,
    token: Box<Step<'r>>,
}

impl<'r> BothGuards<'r> {
    /// The leader-election Lease to read.
    pub fn lease(&self) -> LeaseRef<'r> {
        self.holder.lease()
    }

    /// Judges by the holder as a quorum read returned it, then, per [`both`], by the token guard.
    pub fn judge(self, fresh: Result<HolderQuorum, ReadError>) -> Step<'r> {
        both(self.holder.judge(fresh), *self.token)
    }
}

/// How the two guards of an object combine: the leader-election guard judges first and its
/// denial stands; then the token guard decides, unless it does not guard the object (then the
/// leader-election guard's verdict is the answer). The token guard says `Unguarded` only when it
/// plans (never after a read), so the rule is applied to its plan.
fn both<'r>(by_holder: Verdict, by_token: Step<'r>) -> Step<'r> {
    if !by_holder.is_allowed() {
        return Step::Done(by_holder);
    }
    match by_token {
        Step::Done(by_token) if by_token.reason() == Reason::Unguarded => Step::Done(by_holder),
        by_token => by_token,
    }
}

/// The first step of judging `req`, sent to the webhook `sent`.
pub fn plan<'r>(req: &'r Request, judging: &'r Judging, sent: Sent<'r>) -> Step<'r> {
    let preamble = Preamble::of(req, &judging.exempt);
    match sent {
        Sent::Writer(lease) => writer::plan(&preamble, lease, &judging.identity),
        Sent::Objects => {
            if let Some(malformed) = preamble.malformed() {
                return Step::Done(malformed);
            }
            let by_token = decision::plan(req, &preamble);
            match leader::plan(req, &preamble, &judging.identity) {
                LeaderPlan::Done(by_holder) => both(by_holder, by_token),
                LeaderPlan::Quorum(holder) => Step::Holder(BothGuards { holder, token: Box::new(by_token) }),
            }
        }
    }
}

/// Makes the reads `step` asks for, in order, and returns the verdict.
pub async fn drive<R: LeaseReads + Sync>(mut step: Step<'_>, reads: &R) -> Verdict {
    loop {
        step = match step {
            Step::Done(verdict) => return verdict,
            Step::Cache(read) => {
                let cached = reads.cached(read.lease());
                read.judge(cached)
            }
            Step::Quorum(read) => {
                let fresh = reads.quorum(read.lease()).await;
                Step::Done(read.judge(fresh))
            }
            Step::Holder(read) => {
                let fresh = reads.holder(read.lease()).await;
                read.judge(fresh)
            }
            Step::Writer(read) => {
                let fresh = reads.writer(read.lease()).await;
                Step::Done(read.judge(fresh))
            }
        }
    }
}

/// Judges `req`, sent to the webhook `sent`, reading leases through `reads`.
pub fn judge<'a, R: LeaseReads + Sync>(
    req: &'a Request,
    judging: &'a Judging,
    sent: Sent<'a>,
    reads: &'a R,
) -> impl Future<Output = Verdict> + Send + 'a {
    drive(plan(req, judging, sent), reads)
}

#[cfg(test)]
mod tests;
