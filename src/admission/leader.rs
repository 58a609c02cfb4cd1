//! Fencing an unmodified leader-elected controller: objects labelled
//! `kubefence.io/leader-lease: <name>` are written only by the Pod that holds the
//! `coordination.k8s.io/v1` Lease `<name>` in their namespace — the Lease client-go's
//! `leaderelection` (and controller-runtime) elects its leader on. No token, no code change.
//!
//! Pure like [`super::decision`]: [`plan`] judges a request outright or asks for one quorum read
//! of the Lease's holder ([`HolderRead`]), judged only with a [`HolderQuorum`], which only a
//! quorum read ([`read_holder`]) produces.
//!
//! Who holds it: client-go names a holder by its identity, in practice `<hostname>_<uuid>`, and
//! a Pod's hostname is its name. The requester's Pod name comes from its Pod-bound
//! ServiceAccount token (`Request::pod`). The rule ([`holds`]): the holder identity is the Pod's
//! name, or starts with the Pod's name and `_` (Pod names cannot contain `_`, so Pod `web-1`
//! never matches `web-10_…`).
//!
//! Why this fences a stale leader: for UPDATE and DELETE the API server runs validating
//! admission inside its compare-and-swap on the object, and a write that loses the swap is
//! judged again. So a write by Pod A commits only if A held the Lease at a quorum read made
//! after the last write to the object: once B has taken the Lease and written the object, none
//! of A's writes is admitted. Not covered: A re-acquiring the Lease (its old writes are then its
//! own again), and CREATE, which has no stored object to swap against (docs/design.md).

use k8s_openapi::api::coordination::v1::Lease as LeaderElectionLease;
use kube::{Api, Client};

use super::decision::{Exemptions, Facts, LeaseRef, ObjectFacts, Operation, Reason, Request, Verdict, is_dns_subdomain};

/// The label that binds an object to the leader-election Lease of that name in its namespace.
pub const LEADER_LEASE_LABEL: &str = "kubefence.io/leader-lease";

/// The label that opts a `coordination.k8s.io/v1` Lease into holder binding: with value
/// [`HOLDER_IS_POD`], a write that sets its `holderIdentity` must name the requesting Pod
/// (`registration::Registration::holder_policy`).
pub const HOLDER_IDENTITY_LABEL: &str = "kubefence.io/holder-identity";
/// The value of [`HOLDER_IDENTITY_LABEL`] that binds the holder to the requesting Pod.
pub const HOLDER_IS_POD: &str = "Pod";

/// Whether `holder` (a Lease's `holderIdentity`) names Pod `pod`: equal, or `pod` + `_` + any.
pub fn holds(holder: &str, pod: &str) -> bool {
    !pod.is_empty() && holder.strip_prefix(pod).is_some_and(|rest| rest.is_empty() || rest.starts_with('_'))
}

/// The leader-election Lease as a quorum read returned it: `None` when there is no such Lease,
/// else its `holderIdentity` (`""` when released or never held). Construct it only from a
/// quorum read ([`read_holder`]); tests build it directly.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HolderQuorum(pub Option<String>);

/// What judging a leader-guarded request needs after [`plan`].
#[derive(Debug)]
pub enum LeaderPlan<'r> {
    /// Judged without reading the Lease (`Unguarded` when no side carries the label).
    Done(Verdict),
    /// Read the Lease's holder with a quorum read and call [`HolderRead::judge`].
    Quorum(HolderRead<'r>),
}

/// A request only the Lease's current holder may make.
#[derive(Debug)]
pub struct HolderRead<'r> {
    lease: LeaseRef<'r>,
    pod: &'r str,
}

/// The first step of judging `req` by its leader-election Lease.
pub fn plan<'r>(req: &'r Request, exempt: &Exemptions) -> LeaderPlan<'r> {
    let label = |side: &'r Option<ObjectFacts>| side.as_ref().and_then(|o| o.leader_lease.as_deref());
    let (old_lease, new_lease) = (label(&req.old), label(&req.new));
    let done = LeaderPlan::Done;
    let pass = |reason| LeaderPlan::Done(Verdict::Allow { reason });
    if old_lease.is_none() && new_lease.is_none() {
        return pass(Reason::Unguarded);
    }
    let needs_old = matches!(req.operation, Operation::Update | Operation::Delete);
    let needs_new = matches!(req.operation, Operation::Create | Operation::Update);
    if (needs_old && req.old.is_none()) || (needs_new && req.new.is_none()) {
        return done(Verdict::deny(400, Reason::MalformedRequest, format!("a {:?} admission request lacks its object", req.operation)));
    }
    if exempt.contains(&req.user) {
        return pass(Reason::Exempt);
    }
    let subresource = req.subresource.as_deref().is_some_and(|s| !s.is_empty());
    match (req.operation, &req.old, &req.new) {
        (Operation::Connect, ..) => return pass(Reason::Unguarded),
        // A subresource CREATE (eviction, binding, token) makes no guarded object.
        (Operation::Create | Operation::Delete, ..) if subresource => return pass(Reason::Unguarded),
        (Operation::Update, Some(old), Some(new)) if only_removes_finalizers(old, new) => return pass(Reason::FinalizersRemoved),
        _ => {}
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
    match req.pod.as_deref() {
        Some(pod) => LeaderPlan::Quorum(HolderRead { lease, pod }),
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

/// Whether an UPDATE only removes finalizers from an object being deleted (everything else,
/// labels and annotations included, unchanged): admitted, so that a deletion someone was allowed
/// to start can finish.
fn only_removes_finalizers(old: &ObjectFacts, new: &ObjectFacts) -> bool {
    let subset = new.finalizers.iter().all(|f| old.finalizers.contains(f)) && new.finalizers.len() < old.finalizers.len();
    old.deleting && subset && old.content.is_some() && old.content == new.content
}

impl<'r> HolderRead<'r> {
    /// The Lease to read with a quorum read.
    pub fn lease(&self) -> LeaseRef<'r> {
        self.lease
    }

    /// Judges with the Lease's holder as a quorum read returned it.
    pub fn judge(self, fresh: HolderQuorum) -> Verdict {
        let HolderRead { lease, pod } = self;
        let facts = |holder: Option<&str>| Facts {
            lease: Some(lease.to_string()),
            holder: holder.filter(|h| !h.is_empty()).map(str::to_string),
            requester: Some(pod.to_string()),
            ..Facts::default()
        };
        match fresh.0.as_deref() {
            None => Verdict::Deny {
                code: 403,
                reason: Reason::LeaseNotFound,
                message: format!(
                    "the object is written only by the holder of leader-election Lease {lease}, which does not exist (Pod {pod} asked)"
                ),
                facts: facts(None),
            },
            Some(holder) if holds(holder, pod) => Verdict::Allow { reason: Reason::Fenced },
            Some("") => Verdict::Deny {
                code: 409,
                reason: Reason::NotHolder,
                message: format!(
                    "write by Pod {pod} denied: leader-election Lease {lease} has no holder now, and only its holder writes this object"
                ),
                facts: facts(None),
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

/// The Lease's holder as etcd has it now: `Api::get` without a resourceVersion is a quorum read.
pub async fn read_holder(client: Client, lease: LeaseRef<'_>) -> Result<HolderQuorum, kube::Error> {
    let fresh = Api::<LeaderElectionLease>::namespaced(client, lease.namespace).get_opt(lease.name).await?;
    Ok(HolderQuorum(fresh.map(|l| l.spec.and_then(|s| s.holder_identity).unwrap_or_default())))
}

#[cfg(test)]
mod tests;
