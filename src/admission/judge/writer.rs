//! Fencing a writer, not an object: a `coordination.k8s.io/v1` Lease that carries the label
//! `kubefence.io/holder-identity: Pod` and the annotation `kubefence.io/writers: <sa>[,<sa>...]`
//! (ServiceAccounts of the Lease's own namespace) opts those ServiceAccounts in. From then on
//! every write they make — any kind, any namespace, cluster-scoped included, every subresource,
//! create, update, patch, apply, delete, deletecollection — is admitted only from the Pod, in the
//! Lease's namespace, that holds the Lease now (a quorum read), by the same identity rule and with
//! the same 409 `NotHolder` as objects labelled `kubefence.io/leader-lease` (`super::leader`).
//! No object is labelled and the controller's code is not changed.
//!
//! Only the opted-in identities' writes reach kube-fence: each opted-in Lease gets a webhook of
//! its own whose match condition names exactly its ServiceAccounts
//! (`crate::admission::registration::opt_in::OptIn::match_condition`),
//! at a path that names the Lease (`/writer/<namespace>/<name>`), so a review says which Lease
//! judges it and the webhook needs no cache of opt-ins (`crate::admission::registration::routing`
//! keeps the registration in step). Writes a controller makes whether it leads or not are never sent: its
//! own Lease (campaigning; the holder policy judges those), Events, and the reviews that store
//! nothing (TokenReview, SubjectAccessReview); `kubefence.io/writers-exempt` names more.
//!
//! Pure like [`super::token`], and run by `super::pipeline` (of its preamble it takes who asks):
//! [`ByWriter`] judges outright or asks for one quorum read of the Lease ([`WriterRead`]), judged
//! only with a [`WriterQuorum`], which only a reader (`super::read`) makes.
//!
//! Why this fences a stale leader, on every object it writes: for UPDATE and DELETE the API server
//! runs validating admission inside its compare-and-swap on the object, so a write by Pod A
//! commits only if A held the Lease at a quorum read made after the request arrived. Once B has
//! taken the Lease, no write of A that arrives after the takeover is admitted; a write of A judged
//! just before it may still commit after it, but not over a write of B to the same object (the
//! swap then fails and the write is judged again). CREATE has no stored object to swap against: a
//! CREATE judged before the takeover may commit after it (docs/design.md §6b).

use kube_fence_api::denial::{Facts, Reason};
use kube_fence_api::names::WRITERS_ANNOTATION;

use super::facts::{LeaseRef, Request, SERVICE_ACCOUNT_PREFIX, is_dns_subdomain};
use super::guard::{Guard, Pending, Plan};
use super::identity::IdentityRule;
use super::preamble::{Preamble, Sent};
use super::read::{LeaseReads, ReadError, WriterQuorum};
use super::verdict::Verdict;

/// The path prefix of the writer webhooks: `/writer/<namespace>/<name>`.
pub const PATH_PREFIX: &str = "/writer";

/// The writer fence of the opted-in Lease a review was sent for (`Sent::Writer`): every write of
/// its ServiceAccounts is admitted only from the Pod that holds it, named as the preamble's
/// identity rule says. It judges nothing sent to another webhook.
#[derive(Clone, Copy, Debug)]
pub struct ByWriter;

impl Guard for ByWriter {
    type Pending<'r>
        = WriterRead<'r>
    where
        Self: 'r;

    fn plan<'r>(&'r self, _req: &'r Request, preamble: &Preamble<'r>) -> Plan<WriterRead<'r>> {
        match preamble.sent {
            Sent::Writer(lease) => plan(preamble, lease, preamble.identity),
            Sent::Objects => Plan::Done(Verdict::Allow { reason: Reason::Unguarded }),
        }
    }
}

impl Pending for WriterRead<'_> {
    async fn read<R: LeaseReads + Sync>(self, reads: &R) -> Plan<Self> {
        let fresh = reads.writer(self.lease).await;
        Plan::Done(self.judge(fresh))
    }
}

/// A write only the Lease's holder Pod may make.
#[derive(Debug)]
pub struct WriterRead<'r> {
    lease: LeaseRef<'r>,
    /// The requester's ServiceAccount, in the Lease's namespace.
    account: &'r str,
    /// The requester's Pod name, in the Lease's namespace (`None`: not a Pod of it).
    pod: Option<&'r str>,
    identity: &'r IdentityRule,
}

/// The first step of judging a request (whose `preamble` the pipeline worked out) sent by the
/// webhook of opted-in Lease `lease`.
fn plan<'r>(preamble: &Preamble<'r>, lease: LeaseRef<'r>, identity: &'r IdentityRule) -> Plan<WriterRead<'r>> {
    // The routing names the Lease's own ServiceAccounts only; anything else was sent by a stale
    // or forged registration: it is not this Lease's to judge.
    let Some(account) = preamble.requester.account_in(lease.namespace) else {
        return Plan::Done(Verdict::Allow { reason: Reason::Unguarded });
    };
    let pod = preamble.requester.pod_in(lease.namespace);
    Plan::Read(WriterRead { lease, account, pod, identity })
}

impl<'r> WriterRead<'r> {
    /// The Lease to read with a quorum read.
    pub fn lease(&self) -> LeaseRef<'r> {
        self.lease
    }

    /// Judges with the Lease as a quorum read returned it (a failed read is denied: fail closed).
    pub fn judge(self, fresh: Result<WriterQuorum, ReadError>) -> Verdict {
        let WriterRead { lease, account, pod, identity } = self;
        let fresh = match fresh {
            Ok(fresh) => fresh,
            Err(err) => return err.verdict(lease, true),
        };
        let fenced = match fresh.lease() {
            Some(l) => l.holder_bound && l.accounts.contains(account),
            None => false,
        };
        // The opt-in is gone (the Lease deleted, or its annotation or label removed — by its
        // holder or an admin, the holder policy sees to that): the writes flow again.
        let Some(fresh) = fresh.lease().filter(|_| fenced) else { return Verdict::Allow { reason: Reason::Unguarded } };
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
                    "ServiceAccount {account} writes only from the Pod that holds leader-election Lease {lease} ({WRITERS_ANNOTATION}): this request is not authenticated by the token of a Pod in namespace {ns}",
                    ns = lease.namespace
                ),
                facts: facts(&fresh.holder),
            };
        };
        if identity.holds(&fresh.holder, pod) {
            return Verdict::Allow { reason: Reason::Fenced };
        }
        let held = if fresh.holder.is_empty() { "has no holder now".to_string() } else { format!("is held by {}", fresh.holder) };
        Verdict::Deny {
            code: 409,
            reason: Reason::NotHolder,
            message: format!(
                "write by Pod {pod} denied: ServiceAccount {account} writes only from the holder of leader-election Lease {lease} ({WRITERS_ANNOTATION}), which {held} (a leader that lost its Lease; Pod {pod} holds it only as {forms})",
                forms = identity.forms(pod)
            ),
            facts: facts(&fresh.holder),
        }
    }
}

/// The Lease a writer webhook's path names (`<namespace>/<name>` after [`PATH_PREFIX`]), or why
/// it names none.
pub fn lease_of_path<'p>(namespace: &'p str, name: &'p str) -> Option<LeaseRef<'p>> {
    let namespace_ok = !namespace.is_empty() && namespace.len() <= 63 && is_dns_subdomain(namespace) && !namespace.contains('.');
    (namespace_ok && is_dns_subdomain(name)).then_some(LeaseRef { namespace, name })
}

#[cfg(test)]
mod tests;
