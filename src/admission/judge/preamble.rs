//! What every guard kind knows of a request before its own rules, worked out once by the
//! pipeline: objects missing, an exempt requester, a write no object guard judges, a finalizer
//! removal, who asks.

use kube_fence_api::denial::Reason;

use super::exemptions::Exemptions;
use super::facts::{ObjectFacts, Operation, Request, Requester};
use super::identity::IdentityRule;
use super::verdict::Verdict;

/// How this webhook judges: who is exempt, how a leader-election Lease names a Pod
/// (`--leader-identity-separator`), and whether the holder fences (objects labelled
/// `kubefence.io/leader-lease`, opted-in writers) deny or only warn (`--holder-fences`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Judging {
    pub exempt: Exemptions,
    pub identity: IdentityRule,
    pub holder_fences: Mode,
}

pub use super::fence::Mode;

/// Which webhook a review was sent to: the guarded objects' (`/validate`), or the writer fence's
/// (`/writer`: a write of a ServiceAccount a FencedController names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Sent {
    Objects,
    Writer,
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
    /// Which webhook the review was sent to.
    pub sent: Sent,
    /// How a leader-election Lease's holder names a Pod.
    pub identity: &'r IdentityRule,
}

impl<'r> Preamble<'r> {
    /// The preamble of `req`, sent to the webhook `sent`, judged as `judging` says.
    pub fn of(req: &'r Request, judging: &'r Judging, sent: Sent) -> Preamble<'r> {
        let exempt: &Exemptions = &judging.exempt;
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
            sent,
            identity: &judging.identity,
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
