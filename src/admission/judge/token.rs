//! The token guard: the fencing decision table (docs/design.md §5), as pure functions.
//!
//! [`ByToken`] looks at the facts of one admission request (after the pipeline's preamble) and
//! either judges it outright or says which read of the bound lease it needs ([`TokenRead`]) —
//! [`CacheRead`] (the watch cache is enough unless what it holds could be stale in the unsafe
//! direction, in which case [`CacheRead::judge`] asks for a quorum read) or [`QuorumRead`]. The
//! reads are types: a [`QuorumRead`] is judged only with a [`Quorum`], which only a reader
//! (`super::read`) makes, so handing the decision the wrong read does not compile. Nothing here
//! does I/O; the pending read is handed the reader.
//!
//! Why this is enough for safety: for UPDATE and DELETE the API server runs validating
//! admission inside its storage compare-and-swap loop, so the `old` object judged here is the
//! exact version the write replaces; `presented > recorded` checked here is committed in the
//! same etcd transaction as the write (docs/design.md §6).

use std::cmp::Ordering;

use kube_fence_api::denial::{Facts, Reason};
use kube_fence_api::names::{HOLDER_ONLY, LEASE_LABEL, TOKEN_ANNOTATION, WRITE_ANNOTATION, WRITER_LABEL};
use kube_fence_api::token::{Token, TokenError};
use kube_fence_api::{Comparison, Enforcement};

use super::facts::{LeaseFacts, LeaseRef, ObjectFacts, Operation, Request, Requester, is_dns_subdomain};
use super::guard::{Guard, Pending as PendingRead, Plan};
use super::preamble::Preamble;
use super::read::{Cached, LeaseReads, Quorum, ReadError};
use super::verdict::Verdict;

/// The token guard: objects labelled `kubefence.io/lease` are written only with a token of that
/// lease newer than the one they record.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ByToken;

impl Guard for ByToken {
    type Pending<'r>
        = TokenRead<'r>
    where
        Self: 'r;

    fn plan<'r>(&'r self, req: &'r Request, preamble: &Preamble<'r>) -> Plan<TokenRead<'r>> {
        plan(req, preamble)
    }
}

/// The token guard waiting for its lease.
#[derive(Debug)]
pub(crate) enum TokenRead<'r> {
    Cache(CacheRead<'r>),
    Quorum(QuorumRead<'r>),
}

impl PendingRead for TokenRead<'_> {
    async fn read<R: LeaseReads + Sync>(self, reads: &R) -> Plan<Self> {
        match self {
            TokenRead::Cache(read) => {
                let cached = reads.cached(read.lease());
                read.judge(cached)
            }
            TokenRead::Quorum(read) => {
                let fresh = reads.quorum(read.lease()).await;
                Plan::Done(read.judge(fresh))
            }
        }
    }
}

/// A request that the watch cache may be enough to judge.
#[derive(Debug)]
pub(crate) struct CacheRead<'r>(Pending<'r>);

/// A request that only a quorum read of its lease can judge.
#[derive(Debug)]
pub(crate) struct QuorumRead<'r>(Pending<'r>);

/// A request waiting for its lease.
#[derive(Debug)]
struct Pending<'r> {
    lease: LeaseRef<'r>,
    rule: Rule,
    /// Who asked, when the object is holder-only: then the requester must be the lease's
    /// current holder before `rule` is applied.
    writer: Option<Requester<'r>>,
}

/// Which row of the table judges a request that depends on its lease.
#[derive(Clone, Debug)]
enum Rule {
    /// CREATE, or UPDATE of an object with no valid recorded token (newly guarded, or guarded
    /// before kube-fence ran): `t` must equal the lease's newest issued token.
    Fresh { presented: Result<Token, Missing> },
    /// UPDATE of an object that records `r`: `t > r` (or, under `AllowEqual`, `t == r` with a new
    /// `kubefence.io/write` value: the token restated by this write), and `t <= issued`.
    Successor { presented: Result<Token, Missing>, recorded: Token, restated: bool },
    /// DELETE without a resourceVersion precondition: denied unless the lease is in Warn mode.
    UnconditionalDelete,
    /// Admitted for `Reason` once the holder check passed: a holder-only object's subresource
    /// write that leaves the guard alone, or its preconditioned DELETE.
    Holder(Reason),
}

/// Why the incoming object carries no usable token.
#[derive(Clone, Debug)]
enum Missing {
    Absent,
    Malformed(String, TokenError),
}

fn presented_token(facts: &ObjectFacts) -> Result<Token, Missing> {
    match facts.token.as_deref() {
        None => Err(Missing::Absent),
        Some(raw) => raw.parse().map_err(|e| Missing::Malformed(raw.to_string(), e)),
    }
}

/// The token guard's first step for `req` (whose `preamble` the pipeline worked out): judged
/// outright, or the read of the bound lease it needs.
fn plan<'r>(req: &'r Request, preamble: &Preamble<'r>) -> Plan<TokenRead<'r>> {
    let old_lease = req.old.as_ref().and_then(|o| o.lease.as_deref());
    let new_lease = req.new.as_ref().and_then(|n| n.lease.as_deref());
    let pass = |reason| Plan::Done(Verdict::Allow { reason });
    if let Some(settled) = preamble.settled(old_lease.is_some() || new_lease.is_some()) {
        return Plan::Done(settled);
    }
    // Holder-only when either side says so: removing the label is judged like any other write.
    fn writer_label(facts: &Option<ObjectFacts>) -> Option<&str> {
        facts.as_ref().and_then(|f| f.writer.as_deref())
    }
    if let Some(value) = writer_label(&req.new).filter(|v| *v != HOLDER_ONLY) {
        return Plan::Done(Verdict::deny(
            400,
            Reason::WriterLabelInvalid,
            format!(
                "the {} label is {value:?}; its only value is {:?} (only the lease's current holder writes the object)",
                WRITER_LABEL, HOLDER_ONLY
            ),
        ));
    }
    if let Some(unjudged) = preamble.unjudged() {
        return Plan::Done(unjudged);
    }
    let writer = (writer_label(&req.old).is_some() || writer_label(&req.new).is_some()).then_some(preamble.requester);
    let lease = |name| LeaseRef { namespace: &req.namespace, name };
    // A row that depends on the lease may be judged from the cache, except for a holder-only
    // object: who holds the lease now is read with a quorum read.
    let read = |pending: Pending<'r>| match pending.writer {
        Some(_) => Plan::Read(TokenRead::Quorum(QuorumRead(pending))),
        None => Plan::Read(TokenRead::Cache(CacheRead(pending))),
    };
    // Rows admitted without a token: for a holder-only object, once the holder check passed
    // (a quorum read of its lease); for any other, at once.
    let by_holder = |reason: Reason| match (writer, old_lease.or(new_lease)) {
        (Some(writer), Some(name)) => {
            Plan::Read(TokenRead::Quorum(QuorumRead(Pending { lease: lease(name), rule: Rule::Holder(reason), writer: Some(writer) })))
        }
        _ => pass(reason),
    };
    // A subresource write is judged only when it moves the guard itself — or when the object is
    // holder-only: then only by who asks.
    if let (Operation::Update, Some(old), Some(new)) = (req.operation, &req.old, &req.new)
        && preamble.subresource
        && old.same_guard(new)
    {
        return by_holder(Reason::GuardUnchanged);
    }
    if preamble.finalizers_removed {
        return pass(Reason::FinalizersRemoved);
    }
    match req.operation {
        Operation::Connect => pass(Reason::Unguarded),
        Operation::Delete => match old_lease {
            Some(_) if req.delete_precondition => by_holder(Reason::DeletePreconditioned),
            Some(name) => read(Pending { lease: lease(name), rule: Rule::UnconditionalDelete, writer }),
            None => pass(Reason::Unguarded),
        },
        Operation::Create | Operation::Update => {
            let Some(new) = req.new.as_ref() else { return pass(Reason::Unguarded) };
            if let (Some(old), Some(new)) = (old_lease, new_lease)
                && old != new
            {
                return Plan::Done(Verdict::deny(
                    403,
                    Reason::LeaseRebound,
                    format!(
                        "the object is bound to lease {ns}/{old}; changing its {label} label to {new:?} is never allowed (a token of one lease says nothing about another): delete and re-create the object, or unguard it first with a valid token of {ns}/{old}",
                        ns = req.namespace,
                        label = LEASE_LABEL,
                    ),
                ));
            }
            // The lease that judges the write: the old binding when there is one (unguarding is
            // judged by the lease being left), else the new one.
            let name = old_lease.or(new_lease).unwrap_or_default();
            if name.is_empty() || !is_dns_subdomain(name) {
                return Plan::Done(Verdict::deny(
                    400,
                    Reason::LeaseLabelInvalid,
                    format!(
                        "the {} label {name:?} does not name a lease (a lowercase DNS subdomain name in the same namespace)",
                        LEASE_LABEL
                    ),
                ));
            }
            let presented = presented_token(new);
            // The recorded token only counts while the stored object is guarded: an annotation
            // on an unguarded object was never judged.
            let recorded = old_lease.and(req.old.as_ref()).and_then(|o| o.token.as_deref()).and_then(|r| r.parse::<Token>().ok());
            let restated = new.write.is_some() && new.write.as_deref() != req.old.as_ref().and_then(|o| o.write.as_deref());
            let pending = |rule| Pending { lease: lease(name), rule, writer };
            match recorded {
                Some(recorded) => read(pending(Rule::Successor { presented, recorded, restated })),
                None => Plan::Read(TokenRead::Quorum(QuorumRead(pending(Rule::Fresh { presented })))),
            }
        }
    }
}

impl<'r> CacheRead<'r> {
    /// The lease to look up in the watch cache.
    pub(crate) fn lease(&self) -> LeaseRef<'r> {
        self.0.lease
    }

    /// Judges from the cache, or asks for a quorum read when the cache could be stale in the
    /// unsafe direction: the lease is absent from it, the presented token is newer than the
    /// newest token it has seen, or the lease relaxes fencing — Warn mode, or `AllowEqual`
    /// deciding the write (a lease tightened a moment ago must not be missed).
    pub(crate) fn judge(self, cached: Cached) -> Plan<TokenRead<'r>> {
        // Holder-only objects are planned for a quorum read: no writer reaches the cache.
        let pending = self.0;
        let Some(facts) = cached.lease() else {
            return match pending.rule {
                // A delete without a precondition is denied whatever the lease says, unless it is
                // in Warn mode; an absent lease cannot be, so no quorum read is needed.
                Rule::UnconditionalDelete => Plan::Done(pending.judge(None)),
                _ => Plan::Read(TokenRead::Quorum(QuorumRead(pending))),
            };
        };
        if facts.enforcement == Enforcement::Warn {
            return Plan::Read(TokenRead::Quorum(QuorumRead(pending)));
        }
        if let Rule::Successor { presented: Ok(t), recorded, .. } = &pending.rule
            && (facts.issued.is_none_or(|issued| *t > issued) || (t == recorded && facts.comparison == Comparison::AllowEqual))
        {
            return Plan::Read(TokenRead::Quorum(QuorumRead(pending)));
        }
        Plan::Done(pending.judge(Some(facts)))
    }
}

impl<'r> QuorumRead<'r> {
    /// The lease to read with a quorum read.
    pub(crate) fn lease(&self) -> LeaseRef<'r> {
        self.0.lease
    }

    /// Judges with the lease as a quorum read returned it (a failed read is denied: fail closed).
    pub(crate) fn judge(self, fresh: Result<Quorum, ReadError>) -> Verdict {
        match fresh {
            Ok(fresh) => self.0.judge(fresh.lease()),
            Err(err) => err.verdict(self.0.lease, false),
        }
    }
}

impl Pending<'_> {
    /// The rows that depend on the lease: the lease must exist, a holder-only object's writer
    /// must hold it, then the request's rule.
    fn judge(&self, facts: Option<&LeaseFacts>) -> Verdict {
        let Some(facts) = facts else { return lease_not_found(self.lease) };
        let by = ByLease { lease: self.lease, facts };
        if let Some(denied) = self.writer.and_then(|writer| by.not_holder(writer)) {
            return denied;
        }
        match &self.rule {
            Rule::Holder(reason) => Verdict::Allow { reason: *reason },
            Rule::UnconditionalDelete => by.unconditional_delete(),
            Rule::Fresh { presented } => by.fresh(presented),
            Rule::Successor { presented, recorded, restated } => {
                // Under AllowEqual an equal token is restated by a new write annotation — or, for
                // a holder-only object, by the holder of the grant that issued it (the holder
                // check passed).
                let restated = match (presented, self.writer) {
                    (Ok(t), Some(_)) => Some(*t) == facts.issued,
                    (Ok(_), None) => *restated,
                    (Err(_), _) => false,
                };
                by.successor(presented, *recorded, restated)
            }
        }
    }
}

/// The object is bound to a lease that does not exist.
fn lease_not_found(lease: LeaseRef<'_>) -> Verdict {
    Verdict::Deny {
        code: 403,
        reason: Reason::LeaseNotFound,
        message: format!("the object is bound to lease {lease}, which does not exist: create the lease and write with a token it granted"),
        facts: Facts { lease: Some(lease.to_string()), ..Facts::default() },
    }
}

/// A request judged by an existing lease: one method per row.
struct ByLease<'a> {
    lease: LeaseRef<'a>,
    facts: &'a LeaseFacts,
}

impl ByLease<'_> {
    /// The facts of a denial by this lease.
    fn on_lease(&self) -> Facts {
        Facts { lease: Some(self.lease.to_string()), ..Facts::default() }
    }

    /// A fencing denial, which a Warn lease turns into a warning.
    fn deny(&self, code: u16, reason: Reason, message: String, facts: Facts) -> Verdict {
        match self.facts.enforcement {
            Enforcement::Enforce => Verdict::Deny { code, reason, message, facts },
            Enforcement::Warn => Verdict::AllowWithWarning {
                reason,
                message: format!("kube-fence (lease {} enforcement Warn) would deny this write: {message}", self.lease),
            },
        }
    }

    /// A holder-only object: who asks must hold the lease now, whatever the write carries. The
    /// denial if `writer` does not.
    fn not_holder(&self, writer: Requester<'_>) -> Option<Verdict> {
        let (lease, facts) = (self.lease, self.facts);
        let Some(identity) = facts.identity else {
            return Some(self.deny(
                403,
                Reason::NotHolder,
                format!(
                    "the object is holder-only ({}: {}), but lease {lease} does not bind its holder to an identity (spec.identity is unset), so who holds it cannot be checked: create the lease with spec.identity Pod or User, or remove the label",
                    WRITER_LABEL,
                    HOLDER_ONLY
                ),
                Facts { holder: facts.holder.clone(), requester: Some(writer.user.to_string()), ..self.on_lease() },
            ));
        };
        let me = writer.as_holder(identity, lease.namespace);
        if me.is_ok() && me.as_deref().ok() == facts.holder.as_deref() {
            return None;
        }
        let who = me.clone().map_or_else(|why| why, str::to_string);
        let holder = facts.holder.as_deref().map_or_else(|| "nobody holds it".to_string(), |h| format!("it is held by {h}"));
        Some(self.deny(
            409,
            Reason::NotHolder,
            format!(
                "only the current holder of lease {lease} writes this holder-only object: {holder} (spec.identity {identity:?}), and this write comes from {who}"
            ),
            Facts { holder: facts.holder.clone(), requester: Some(me.unwrap_or(writer.user).to_string()), ..self.on_lease() },
        ))
    }

    /// A DELETE without a resourceVersion precondition.
    fn unconditional_delete(&self) -> Verdict {
        self.deny(
            403,
            Reason::DeletePreconditionRequired,
            format!(
                "deleting an object guarded by lease {} requires a resourceVersion precondition (delete only the version you read)",
                self.lease
            ),
            self.on_lease(),
        )
    }

    /// The denial of a write that carries no token, or a malformed one.
    fn unusable(&self, missing: &Missing, recorded: Option<Token>) -> Verdict {
        let lease = self.lease;
        match missing {
            Missing::Absent => self.deny(
                403,
                Reason::TokenMissing,
                format!(
                    "the object is guarded by lease {lease}: the write must carry the {} annotation with a token granted by that lease",
                    TOKEN_ANNOTATION
                ),
                Facts { recorded, ..self.on_lease() },
            ),
            Missing::Malformed(raw, err) => self.deny(
                400,
                Reason::TokenMalformed,
                format!("the {} annotation {raw:?} is not a token (lease {lease}): {err}", TOKEN_ANNOTATION),
                Facts { recorded, ..self.on_lease() },
            ),
        }
    }

    /// The facts of a denial of `presented`, which had to beat `recorded`.
    fn tokens(&self, presented: Token, recorded: Option<Token>) -> Facts {
        Facts { presented: Some(presented), recorded, ..self.on_lease() }
    }

    /// The denial of `presented` by a lease that has granted no token yet.
    fn none_issued(&self, presented: Token, recorded: Option<Token>) -> Verdict {
        self.deny(
            403,
            Reason::TokenNotIssued,
            format!("lease {} has not granted any token yet; presented token {presented} was not issued by it", self.lease),
            self.tokens(presented, recorded),
        )
    }

    /// `presented` is newer than anything the lease issued.
    fn not_issued(&self, presented: Token, issued: Token, recorded: Option<Token>) -> Verdict {
        self.deny(
            403,
            Reason::TokenNotIssued,
            format!(
                "presented token {presented} is newer than lease {}'s newest token {issued}: it was not issued by that lease",
                self.lease
            ),
            self.tokens(presented, recorded),
        )
    }

    /// CREATE / newly guarded: there is no recorded token on the object to compare with, so the
    /// write must carry the lease's current token, read linearizably.
    fn fresh(&self, presented: &Result<Token, Missing>) -> Verdict {
        let presented = match presented {
            Ok(t) => *t,
            Err(missing) => return self.unusable(missing, None),
        };
        let Some(issued) = self.facts.issued else { return self.none_issued(presented, None) };
        match presented.cmp(&issued) {
            Ordering::Equal => Verdict::Allow { reason: Reason::Fenced },
            Ordering::Less => self.deny(
                409,
                Reason::StaleToken,
                format!(
                    "stale write to an object guarded by lease {}: presented token {presented}, recorded token {issued} (the lease's newest grant); a guarded object is created or newly guarded only with the newest token",
                    self.lease
                ),
                self.tokens(presented, Some(issued)),
            ),
            Ordering::Greater => self.not_issued(presented, issued, None),
        }
    }

    /// UPDATE of an object that records `recorded`: `presented` must be newer (or, under
    /// `AllowEqual`, equal and `restated`), and issued by the lease.
    fn successor(&self, presented: &Result<Token, Missing>, recorded: Token, restated: bool) -> Verdict {
        let lease = self.lease;
        let presented = match presented {
            Ok(t) => *t,
            Err(missing) => return self.unusable(missing, Some(recorded)),
        };
        let Some(issued) = self.facts.issued else { return self.none_issued(presented, Some(recorded)) };
        let comparison = self.facts.comparison;
        // AllowEqual: several writes under one grant, each restating the token (a new write
        // annotation), so a write that leaves the annotations alone is not taken for one.
        if presented == recorded && comparison == Comparison::AllowEqual && !restated {
            return self.deny(
                409,
                Reason::StaleToken,
                format!(
                    "stale write to an object guarded by lease {lease}: presented token {presented}, recorded token {recorded}; under AllowEqual an equal token counts only when the write restates it with a new {} annotation (the client library does)",
                    WRITE_ANNOTATION
                ),
                self.tokens(presented, Some(recorded)),
            );
        }
        if presented < recorded || (presented == recorded && comparison == Comparison::Strict) {
            return self.deny(
                409,
                Reason::StaleToken,
                format!(
                    "stale write to an object guarded by lease {lease}: presented token {presented}, recorded token {recorded} (the presented token is not greater than the recorded one)"
                ),
                self.tokens(presented, Some(recorded)),
            );
        }
        if presented > issued {
            return self.not_issued(presented, issued, Some(recorded));
        }
        Verdict::Allow { reason: Reason::Fenced }
    }
}

#[cfg(test)]
mod tests;
