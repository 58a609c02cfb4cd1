//! Fencing a writer, not an object: a `FencedController` (`kubefence.io/v1alpha1`, created by an
//! admin in the controller's namespace) names a running controller's leader-election Lease and
//! its ServiceAccounts. From then on every write they make — any kind, any namespace,
//! cluster-scoped included, every subresource, create, update, patch, apply, delete,
//! deletecollection — is admitted only from the Pod, in the fence's namespace, that holds the
//! Lease now (a quorum read), by the same identity rule and with the same 409 `NotHolder` as
//! objects labelled `kubefence.io/leader-lease` (`super::leader`); in `Audit` mode it is
//! admitted with a warning instead (`super::audit`). No object is labelled, the Lease is not
//! touched, and the controller's code is not changed.
//!
//! Only the fenced identities' writes reach kube-fence: the routing
//! (`crate::admission::registration::routing`) registers one webhook, at `/writer`, whose match
//! condition tests the requester's username against the set of every fenced ServiceAccount, and
//! leaves out what a fence lets pass (its exemptions and its own Lease) and what a controller
//! writes whether it leads or not (Events, reviews that store nothing). The webhook looks the
//! requester's fences up in its cache of FencedControllers (`super::read::LeaseReads::fences`)
//! and judges each: [`ByWriter`] judges outright or asks for one quorum read of the Lease
//! ([`WriterRead`]), judged only with a [`WriterQuorum`], which only a reader (`super::read`)
//! makes.
//!
//! Why this fences a stale leader, on every object it writes: for UPDATE and DELETE the API server
//! runs validating admission inside its compare-and-swap on the object, so a write by Pod A
//! commits only if A held the Lease at a quorum read made after the request arrived. Once B has
//! taken the Lease, no write of A that arrives after the takeover is admitted; a write of A judged
//! just before it may still commit after it, but not over a write of B to the same object (the
//! swap then fails and the write is judged again). CREATE has no stored object to swap against: a
//! CREATE judged before the takeover may commit after it (docs/design.md §6b).

use std::sync::Arc;

use kube_fence_api::denial::{Facts, Reason};

use super::facts::{LeaseRef, Request, SERVICE_ACCOUNT_PREFIX};
use super::fence::Fence;
use super::guard::{Guard, Pending, Plan};
use super::identity::IdentityRule;
use super::preamble::Preamble;
use super::read::{LeaseReads, ReadError, WriterQuorum};
use super::verdict::Verdict;

/// The path of the writer webhook.
pub const PATH: &str = "/writer";

/// The writer fence of one FencedController: every write of its ServiceAccounts is admitted only
/// from the Pod that holds its Lease, named as the preamble's identity rule says. It judges the
/// writes of nobody else, and lets pass what the fence exempts and the fence's own Lease.
#[derive(Clone, Debug)]
pub struct ByWriter(pub Arc<Fence>);

impl Guard for ByWriter {
    type Pending<'r>
        = WriterRead<'r>
    where
        Self: 'r;

    fn plan<'r>(&'r self, req: &'r Request, preamble: &Preamble<'r>) -> Plan<WriterRead<'r>> {
        let fence = &*self.0;
        // The routing names the fence's own ServiceAccounts only; anything else was sent by a
        // stale registration or for another fence: it is not this fence's to judge.
        let Some(account) = fence.account_of(preamble.requester.user) else {
            return Plan::Done(Verdict::Allow { reason: Reason::Unguarded });
        };
        if fence.passes(req) {
            return Plan::Done(Verdict::Allow { reason: Reason::Exempt });
        }
        let pod = preamble.requester.pod_in(&fence.namespace);
        Plan::Read(WriterRead { fence, account, pod, identity: preamble.identity })
    }
}

impl Pending for WriterRead<'_> {
    async fn read<R: LeaseReads + Sync>(self, reads: &R) -> Plan<Self> {
        let fresh = reads.writer(self.lease()).await;
        Plan::Done(self.judge(fresh))
    }
}

/// A write only the fence's Lease's holder Pod may make.
#[derive(Debug)]
pub struct WriterRead<'r> {
    fence: &'r Fence,
    /// The requester's ServiceAccount, in the fence's namespace.
    account: &'r str,
    /// The requester's Pod name, in the fence's namespace (`None`: not a Pod of it).
    pod: Option<&'r str>,
    identity: &'r IdentityRule,
}

impl<'r> WriterRead<'r> {
    /// The Lease to read with a quorum read.
    pub fn lease(&self) -> LeaseRef<'r> {
        self.fence.lease()
    }

    /// Judges with the Lease as a quorum read returned it (a failed read is denied: fail closed).
    pub fn judge(self, fresh: Result<WriterQuorum, ReadError>) -> Verdict {
        let lease = self.lease();
        let WriterRead { fence, account, pod, identity } = self;
        let fresh = match fresh {
            Ok(fresh) => fresh,
            Err(err) => return err.verdict(lease, true),
        };
        // No Lease: nobody holds it, so nobody writes (fail closed; the FencedController's status
        // says `LeaseNotFound`, and client-go creates the Lease when it campaigns).
        let holder = fresh.holder().unwrap_or_default();
        let requester = pod.map_or_else(|| format!("{SERVICE_ACCOUNT_PREFIX}{}:{account}", lease.namespace), str::to_string);
        let facts = |holder: &str| Facts {
            lease: Some(lease.to_string()),
            holder: (!holder.is_empty()).then(|| holder.to_string()),
            requester: Some(requester.clone()),
            ..Facts::default()
        };
        let Some(pod) = pod else {
            return Verdict::Deny {
                code: 403,
                reason: Reason::NotHolder,
                message: format!(
                    "ServiceAccount {account} writes only from the Pod that holds leader-election Lease {lease} (FencedController {fenced}): this request is not authenticated by the token of a Pod in namespace {ns}",
                    fenced = fence.name,
                    ns = lease.namespace
                ),
                facts: facts(holder),
            };
        };
        if identity.holds(holder, pod) {
            return Verdict::AllowHeld { reason: Reason::Fenced, held: fresh.held(lease) };
        }
        let held = match fresh.holder() {
            None => "does not exist".to_string(),
            Some("") => "has no holder now".to_string(),
            Some(holder) => format!("is held by {holder}"),
        };
        Verdict::Deny {
            code: 409,
            reason: Reason::NotHolder,
            message: format!(
                "write by Pod {pod} denied: ServiceAccount {account} writes only from the holder of leader-election Lease {lease} (FencedController {fenced}), which {held} (a leader that lost its Lease; Pod {pod} holds it only as {forms})",
                fenced = fence.name,
                forms = identity.forms(pod)
            ),
            facts: facts(holder),
        }
    }
}

#[cfg(test)]
mod tests;
