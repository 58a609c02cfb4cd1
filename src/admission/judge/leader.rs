//! Fencing an unmodified leader-elected controller: objects labelled
//! `kubefence.io/leader-lease: <name>` are written only by the Pod that holds the
//! `coordination.k8s.io/v1` Lease `<name>` in their namespace — the Lease client-go's
//! `leaderelection` (and controller-runtime) elects its leader on. No token, no code change.
//!
//! Pure like [`super::token`], and run by `super::pipeline` after its preamble: [`ByLeader`]
//! judges a request outright or asks for one quorum read of the Lease's holder ([`HolderRead`]),
//! judged only with a [`HolderQuorum`], which only a reader (`super::read`) makes.
//!
//! Who holds it: client-go names a holder by its identity, in practice `<hostname>_<uuid>`, and
//! a Pod's hostname is its name. The requester's Pod name comes from its Pod-bound
//! ServiceAccount token (`Request::pod`). The rule is an [`IdentityRule`]
//! (`--leader-identity-separator`, chart value `leaderIdentity.separator`): by default the holder
//! identity is the Pod's name, or starts with the Pod's name and `_` (Pod names cannot contain
//! `_`, so Pod `web-1` never matches `web-10_…`); the holder policy's CEL applies the same rule
//! (`registration::Registration::holder_policy`).
//!
//! Why this fences a stale leader: for UPDATE and DELETE the API server runs validating
//! admission inside its compare-and-swap on the object, and a write that loses the swap is
//! judged again. So a write by Pod A commits only if A held the Lease at a quorum read made
//! after the last write to the object: once B has taken the Lease and written the object, none
//! of A's writes is admitted. Not covered: A re-acquiring the Lease (its old writes are then its
//! own again), and CREATE, which has no stored object to swap against (docs/design.md).

use kube_fence_api::denial::{Facts, Reason};
use kube_fence_api::names::LEADER_LEASE_LABEL;

use super::facts::{LeaseRef, ObjectFacts, Operation, Request, is_dns_subdomain};
use super::guard::{Guard, Pending, Plan};
use super::identity::IdentityRule;
use super::preamble::Preamble;
use super::read::{HolderQuorum, LeaseReads, ReadError};
use super::verdict::Verdict;

/// The leader-election guard: objects labelled `kubefence.io/leader-lease` are written only by
/// the Pod that holds that Lease, its holder named as the preamble's identity rule says.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ByLeader;

impl Guard for ByLeader {
    type Pending<'r>
        = HolderRead<'r>
    where
        Self: 'r;

    fn plan<'r>(&'r self, req: &'r Request, preamble: &Preamble<'r>) -> Plan<HolderRead<'r>> {
        plan(req, preamble, preamble.identity)
    }
}

impl Pending for HolderRead<'_> {
    async fn read<R: LeaseReads + Sync>(self, reads: &R) -> Plan<Self> {
        let fresh = reads.holder(self.lease).await;
        Plan::Done(self.judge(fresh))
    }
}

/// A request only the Lease's current holder may make.
#[derive(Debug)]
pub(crate) struct HolderRead<'r> {
    lease: LeaseRef<'r>,
    pod: &'r str,
    identity: &'r IdentityRule,
}

/// The first step of judging `req` (whose `preamble` the pipeline worked out) by its
/// leader-election Lease, whose holder names a Pod by `identity`.
fn plan<'r>(req: &'r Request, preamble: &Preamble<'r>, identity: &'r IdentityRule) -> Plan<HolderRead<'r>> {
    let label = |side: &'r Option<ObjectFacts>| side.as_ref().and_then(|o| o.leader_lease.as_deref());
    let (old_lease, new_lease) = (label(&req.old), label(&req.new));
    let done = Plan::Done;
    let pass = |reason| Plan::Done(Verdict::Allow { reason });
    if let Some(settled) = preamble.settled(old_lease.is_some() || new_lease.is_some()) {
        return done(settled);
    }
    if let Some(unjudged) = preamble.unjudged() {
        return done(unjudged);
    }
    if preamble.finalizers_removed {
        return pass(Reason::FinalizersRemoved);
    }
    // An admin opts an object in or out (creates it labelled, adds or removes the label); what
    // it writes to an object that stays bound is the holder's like any other write.
    let moves_label = match req.operation {
        Operation::Create => true,
        Operation::Update => old_lease.is_none() != new_lease.is_none(),
        _ => false,
    };
    if moves_label && preamble.label_admin {
        return pass(Reason::Exempt);
    }
    if let (Some(old), Some(new)) = (old_lease, new_lease)
        && old != new
    {
        return done(Verdict::deny(
            403,
            Reason::LeaseRebound,
            format!(
                "the object is bound to leader-election Lease {ns}/{old}; changing its {LEADER_LEASE_LABEL} label to {new:?} is never allowed: remove the label first (as the holder of {ns}/{old}), then add the new one (as the holder of {ns}/{new})",
                ns = req.namespace
            ),
        ));
    }
    // Unguarding is judged by the Lease being left; guarding by the Lease being joined.
    let name = old_lease.or(new_lease).unwrap_or_default();
    if !is_dns_subdomain(name) {
        return done(Verdict::deny(
            400,
            Reason::LeaseLabelInvalid,
            format!("the {LEADER_LEASE_LABEL} label {name:?} does not name a Lease (a lowercase DNS subdomain name in the same namespace)"),
        ));
    }
    let lease = LeaseRef { namespace: &req.namespace, name };
    match preamble.requester.pod {
        Some(pod) => match pod.name_in(lease.namespace) {
            Some(pod) => Plan::Read(HolderRead { lease, pod, identity }),
            None => done(Verdict::Deny {
                code: 403,
                reason: Reason::NotHolder,
                message: format!(
                    "the object is written only by the holder of leader-election Lease {lease}: Pod {pod} is not in the Lease's namespace {ns} (a Pod holds Leases of its own namespace only)",
                    ns = lease.namespace
                ),
                facts: Facts { lease: Some(lease.to_string()), requester: Some(pod.to_string()), ..Facts::default() },
            }),
        },
        None => done(Verdict::Deny {
            code: 403,
            reason: Reason::NotHolder,
            message: format!(
                "the object is written only by the holder of leader-election Lease {lease}: {user} is not a Pod (the request must be authenticated by the Pod's own ServiceAccount token)",
                user = req.user
            ),
            facts: Facts { lease: Some(lease.to_string()), requester: Some(req.user.clone()), ..Facts::default() },
        }),
    }
}

impl<'r> HolderRead<'r> {
    /// Judges with the Lease's holder as a quorum read returned it (a failed read is denied:
    /// fail closed).
    pub(crate) fn judge(self, fresh: Result<HolderQuorum, ReadError>) -> Verdict {
        let HolderRead { lease, pod, identity } = self;
        let fresh = match fresh {
            Ok(fresh) => fresh,
            Err(err) => return err.verdict(lease, true),
        };
        let facts = |holder: Option<&str>| Facts {
            lease: Some(lease.to_string()),
            holder: holder.filter(|h| !h.is_empty()).map(str::to_string),
            requester: Some(pod.to_string()),
            ..Facts::default()
        };
        match fresh.holder() {
            None => Verdict::Deny {
                code: 403,
                reason: Reason::LeaseNotFound,
                message: format!(
                    "the object is written only by the holder of leader-election Lease {lease}, which does not exist (Pod {pod} asked)"
                ),
                facts: facts(None),
            },
            Some(holder) if identity.holds(holder, pod) => Verdict::AllowHeld { reason: Reason::Fenced, held: fresh.held(lease) },
            Some("") => Verdict::Deny {
                code: 409,
                reason: Reason::NotHolder,
                message: format!(
                    "write by Pod {pod} denied: leader-election Lease {lease} has no holder now, and only its holder writes this object"
                ),
                facts: facts(None),
            },
            // Looks like this Pod's identity, yet the rule says otherwise: say which rule, as the
            // controller's identity and the configured rule may disagree.
            Some(holder) if holder.starts_with(pod) => Verdict::Deny {
                code: 409,
                reason: Reason::NotHolder,
                message: format!(
                    "write by Pod {pod} denied: leader-election Lease {lease} is held by {holder}, which is not Pod {pod} by the leader identity rule (Pod {pod} holds it only as {forms}; see --leader-identity-separator, chart value leaderIdentity.separator), and only its holder writes this object",
                    forms = identity.forms(pod)
                ),
                facts: facts(Some(holder)),
            },
            Some(holder) => Verdict::Deny {
                code: 409,
                reason: Reason::NotHolder,
                message: format!(
                    "write by Pod {pod} denied: leader-election Lease {lease} is held by {holder}, and only its holder writes this object (a leader that lost its Lease)"
                ),
                facts: facts(Some(holder)),
            },
        }
    }
}

#[cfg(test)]
mod tests;
