//! Where a write is judged: the fencing decision table (docs/design.md §5),
//! as pure functions.
//!
//! A request flows one way: [`plan`] looks at the facts of one admission request and either
//! judges it outright ([`Plan::Done`]) or says which read of the bound lease it needs —
//! [`Plan::Cache`] (the watch cache is enough unless what it holds could be stale in the unsafe
//! direction, in which case [`CacheRead::judge`] asks for a quorum read) or [`Plan::Quorum`].
//! The reads are types: a [`QuorumRead`] is judged only with a [`Quorum`], which only a quorum
//! read produces, so handing the decision the wrong read does not compile. Nothing here does
//! I/O; the server gathers the facts and performs the one read the plan asks for.
//!
//! Why this is enough for safety: for UPDATE and DELETE the API server runs validating
//! admission inside its storage compare-and-swap loop, so the `old` object judged here is the
//! exact version the write replaces; `presented > recorded` checked here is committed in the
//! same etcd transaction as the write (docs/design.md §6).

use std::fmt;

use crate::api::{Comparison, Enforcement, HolderIdentity};
use crate::token::{Token, TokenError};

/// Identities that may write guarded objects without a token by default: the garbage collector
/// (cascading deletion of dependents whose owner is gone) and the namespace controller
/// (deleting a namespace deletes everything in it). Without them a guarded object could pin a
/// namespace or an orphaned dependent forever.
pub const DEFAULT_EXEMPT: [&str; 2] =
    ["system:serviceaccount:kube-system:generic-garbage-collector", "system:serviceaccount:kube-system:namespace-controller"];

/// The operation under admission.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operation {
    Create,
    Update,
    Delete,
    /// Not registered for; admitted if it ever arrives.
    Connect,
}

/// What the decision needs to know about one side (old or new) of the object under admission.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ObjectFacts {
    /// Value of the `kubefence.io/lease` label; `None` when the object is not guarded.
    pub lease: Option<String>,
    /// Raw value of the `kubefence.io/token` annotation, unparsed (parsing is part of judging).
    pub token: Option<String>,
    /// Value of the `kubefence.io/write` annotation: a fresh value per write, set by the client
    /// library next to the token. Under `AllowEqual` it tells a write that restated the token
    /// from one that left the annotations alone.
    pub write: Option<String>,
    /// Whether `metadata.deletionTimestamp` is set: the object is being deleted.
    pub deleting: bool,
    /// `metadata.finalizers`.
    pub finalizers: Vec<String>,
    /// Value of the `kubefence.io/writer` label (`holder`: only the lease's current holder
    /// writes the object and its subresources).
    pub writer: Option<String>,
    /// A digest of everything a finalizer removal must leave unchanged: labels, annotations and
    /// every field outside `metadata`. `None` when it was not computed (then a finalizer removal
    /// is judged like any other write: the safe direction).
    pub content: Option<u64>,
    /// Value of the `kubefence.io/leader-lease` label: the leader-election Lease whose holder
    /// alone writes the object (judged by `super::leader`).
    pub leader_lease: Option<String>,
}

impl ObjectFacts {
    pub fn guarded(lease: &str, token: Option<&str>) -> ObjectFacts {
        ObjectFacts { lease: Some(lease.to_string()), token: token.map(str::to_string), ..ObjectFacts::default() }
    }

    pub fn unguarded(token: Option<&str>) -> ObjectFacts {
        ObjectFacts { lease: None, token: token.map(str::to_string), ..ObjectFacts::default() }
    }

    /// Whether `self` and `other` carry the same guard: lease label, token annotation and
    /// writer label.
    fn same_guard(&self, other: &ObjectFacts) -> bool {
        self.lease == other.lease && self.token == other.token && self.writer == other.writer
    }
}

/// One admission request, reduced to the facts fencing depends on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub operation: Operation,
    /// Namespace of the object (guarded objects are namespaced; the lease lives beside them).
    pub namespace: String,
    /// The subresource written (`status`, `scale`, ...); `None` for the object itself.
    pub subresource: Option<String>,
    /// The stored object (UPDATE, DELETE).
    pub old: Option<ObjectFacts>,
    /// The incoming object (CREATE, UPDATE).
    pub new: Option<ObjectFacts>,
    /// `userInfo.username` of the request.
    pub user: String,
    /// The requesting Pod, when the request is authenticated by a Pod-bound ServiceAccount
    /// token ([`PodIdentity::of`]).
    pub pod: Option<PodIdentity>,
    /// Whether the DELETE carries a non-empty `preconditions.resourceVersion`.
    pub delete_precondition: bool,
}

impl Request {
    /// A request on the object itself (no subresource), by `user`, with no delete precondition.
    pub fn new(operation: Operation, namespace: &str, old: Option<ObjectFacts>, new: Option<ObjectFacts>, user: &str) -> Request {
        Request {
            operation,
            namespace: namespace.into(),
            subresource: None,
            old,
            new,
            user: user.into(),
            pod: None,
            delete_precondition: false,
        }
    }
}

/// The Pod a request comes from: the namespace of the ServiceAccount whose token authenticated it
/// (a Pod-bound token is issued only for a Pod of the ServiceAccount's own namespace) and the Pod
/// name the token is bound to (`userInfo.extra["authentication.kubernetes.io/pod-name"]`). A Pod
/// is the holder of a lease only in the lease's namespace: Pod `rt2/pa` is not Pod `rt/pa`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodIdentity {
    pub namespace: String,
    pub name: String,
}

/// The username prefix of every ServiceAccount: `system:serviceaccount:<namespace>:<name>`.
pub const SERVICE_ACCOUNT_PREFIX: &str = "system:serviceaccount:";

impl PodIdentity {
    /// The Pod of a request by `username` whose token names Pod `pod_name` (`None` unless both
    /// are there: a ServiceAccount username and a non-empty Pod name).
    pub fn of(username: &str, pod_name: Option<&str>) -> Option<PodIdentity> {
        let name = pod_name.filter(|n| !n.is_empty())?;
        let (namespace, _account) = username.strip_prefix(SERVICE_ACCOUNT_PREFIX)?.split_once(':')?;
        (!namespace.is_empty()).then(|| PodIdentity { namespace: namespace.to_string(), name: name.to_string() })
    }

    /// The Pod's name, if it is in `namespace` (where the lease that names holders lives).
    pub fn name_in(&self, namespace: &str) -> Option<&str> {
        (self.namespace == namespace).then_some(self.name.as_str())
    }
}

impl fmt::Display for PodIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// What the webhook knows about the lease an object is bound to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LeaseFacts {
    /// Newest token the lease issued (`status.token`); `None` before its first grant.
    pub issued: Option<Token>,
    pub comparison: Comparison,
    pub enforcement: Enforcement,
    /// Whether the lease binds its holder to the requester (`spec.identity`), and how.
    pub identity: Option<HolderIdentity>,
    /// Who holds the lease now (`status.holder` while `status.phase` is `Held`).
    pub holder: Option<String>,
}

/// The lease as the watch cache holds it (`None`: not in the cache). Judging from it is safe
/// only where [`CacheRead::judge`] says so.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cached(pub Option<LeaseFacts>);

/// The lease as a linearizable (quorum) read returned it (`None`: no such lease). Construct it
/// only from a quorum read (`super::leases::LeaseDirectory::quorum`); tests build it directly.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Quorum(pub Option<LeaseFacts>);

/// The lease a request is judged by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaseRef<'r> {
    pub namespace: &'r str,
    pub name: &'r str,
}

impl fmt::Display for LeaseRef<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

pub use kube_fence_api::denial::{Facts, Reason};

/// The judgement on one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Allow {
        reason: Reason,
    },
    /// Would have been denied, but the lease's enforcement is `Warn`.
    AllowWithWarning {
        reason: Reason,
        message: String,
    },
    /// `code` is the HTTP status the API server returns to the writer: 409 for a stale token
    /// (normal recovery: reread and retry under a newer grant), 403 for a write fencing
    /// forbids, 400 for malformed input, 500 when the lease could not be read.
    Deny {
        code: u16,
        reason: Reason,
        message: String,
        facts: Facts,
    },
}

impl Verdict {
    pub fn reason(&self) -> Reason {
        match self {
            Verdict::Allow { reason } | Verdict::AllowWithWarning { reason, .. } | Verdict::Deny { reason, .. } => *reason,
        }
    }

    /// `allowed`, `warned` or `denied` (the metric label).
    pub fn kind(&self) -> &'static str {
        match self {
            Verdict::Allow { .. } => "allowed",
            Verdict::AllowWithWarning { .. } => "warned",
            Verdict::Deny { .. } => "denied",
        }
    }

    pub fn is_allowed(&self) -> bool {
        !matches!(self, Verdict::Deny { .. })
    }

    /// A denial with no facts (judged before any lease was named or read).
    pub fn deny(code: u16, reason: Reason, message: String) -> Verdict {
        Verdict::Deny { code, reason, message, facts: Facts::default() }
    }
}

/// Who may write guarded objects without a token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exemptions {
    exempt: Vec<String>,
    /// kube-fence's admins (`--lease-admin`, chart value `leaseAdmins`): besides the holder, they
    /// may add or remove the `kubefence.io/leader-lease` label (opt existing objects in, as Helm
    /// or an operator would); every other write of a leader-bound object stays the holder's.
    label_admins: Vec<String>,
}

impl Exemptions {
    pub fn new<I: IntoIterator<Item = S>, S: Into<String>>(users: I) -> Exemptions {
        Exemptions { exempt: users.into_iter().map(Into::into).collect(), label_admins: Vec::new() }
    }

    /// The same, with `admins` allowed to move the leader-lease label.
    pub fn with_label_admins<I: IntoIterator<Item = S>, S: Into<String>>(mut self, admins: I) -> Exemptions {
        self.label_admins.extend(admins.into_iter().map(Into::into));
        self
    }

    pub fn contains(&self, user: &str) -> bool {
        self.exempt.iter().any(|u| u == user)
    }

    /// Whether `user` may add or remove the `kubefence.io/leader-lease` label.
    pub fn may_move_leader_label(&self, user: &str) -> bool {
        self.label_admins.iter().any(|u| u == user)
    }
}

impl Default for Exemptions {
    fn default() -> Self {
        Exemptions::new(DEFAULT_EXEMPT)
    }
}

/// What judging a request needs after [`plan`].
#[derive(Debug)]
pub enum Plan<'r> {
    /// Judged without looking at any lease.
    Done(Verdict),
    /// Read the lease from the watch cache and call [`CacheRead::judge`].
    Cache(CacheRead<'r>),
    /// Read the lease with a quorum read and call [`QuorumRead::judge`].
    Quorum(QuorumRead<'r>),
}

/// A request that the watch cache may be enough to judge.
#[derive(Debug)]
pub struct CacheRead<'r>(Pending<'r>);

/// A request that only a quorum read of its lease can judge.
#[derive(Debug)]
pub struct QuorumRead<'r>(Pending<'r>);

/// The outcome of judging from the cache.
#[derive(Debug)]
pub enum Judged<'r> {
    Done(Verdict),
    /// The cache could be stale in the unsafe direction: read the quorum.
    Quorum(QuorumRead<'r>),
}

/// A request waiting for its lease.
#[derive(Debug)]
struct Pending<'r> {
    lease: LeaseRef<'r>,
    rule: Rule,
    /// Who asked, when the object is holder-only: then the requester must be the lease's
    /// current holder before `rule` is applied.
    writer: Option<Writer<'r>>,
}

/// The requester of a write to a holder-only object, as a lease may name holders.
#[derive(Clone, Copy, Debug)]
struct Writer<'r> {
    user: &'r str,
    pod: Option<&'r PodIdentity>,
}

impl<'r> Writer<'r> {
    /// The requester as a lease in `namespace` with `identity` names holders, or why it cannot
    /// be one (a Pod lease, and the request carries no Pod identity, or a Pod of another
    /// namespace).
    fn as_holder(self, identity: HolderIdentity, namespace: &str) -> Result<&'r str, String> {
        match (identity, self.pod) {
            (HolderIdentity::User, _) => Ok(self.user),
            (HolderIdentity::Pod, None) => Err(format!("{} (no Pod identity: use the Pod's own ServiceAccount token)", self.user)),
            (HolderIdentity::Pod, Some(pod)) => pod.name_in(namespace).ok_or_else(|| {
                format!("Pod {pod}, which is not in the lease's namespace {namespace} (a Pod holds leases of its own namespace only)")
            }),
        }
    }
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

/// The first step of judging `req`: judged outright, or the read of the bound lease it needs.
pub fn plan<'r>(req: &'r Request, exempt: &Exemptions) -> Plan<'r> {
    let malformed = |message: String| Plan::Done(Verdict::deny(400, Reason::MalformedRequest, message));
    // Whether the object is guarded is known only from the objects the review carries.
    let needs_old = matches!(req.operation, Operation::Update | Operation::Delete);
    let needs_new = matches!(req.operation, Operation::Create | Operation::Update);
    if (needs_old && req.old.is_none()) || (needs_new && req.new.is_none()) {
        return malformed(format!(
            "a {:?} admission request must carry {}",
            req.operation,
            match req.operation {
                Operation::Create => "the incoming object (object)",
                Operation::Delete => "the stored object (oldObject)",
                _ => "both the stored (oldObject) and the incoming object (object)",
            }
        ));
    }
    let old_lease = req.old.as_ref().and_then(|o| o.lease.as_deref());
    let new_lease = req.new.as_ref().and_then(|n| n.lease.as_deref());
    let pass = |reason| Plan::Done(Verdict::Allow { reason });
    if old_lease.is_none() && new_lease.is_none() {
        return pass(Reason::Unguarded);
    }
    if exempt.contains(&req.user) {
        return pass(Reason::Exempt);
    }
    // Holder-only when either side says so: removing the label is judged like any other write.
    fn writer_label(facts: &Option<ObjectFacts>) -> Option<&str> {
        facts.as_ref().and_then(|f| f.writer.as_deref())
    }
    if let Some(value) = writer_label(&req.new).filter(|v| *v != crate::token::HOLDER_ONLY) {
        return Plan::Done(Verdict::deny(
            400,
            Reason::WriterLabelInvalid,
            format!(
                "the {} label is {value:?}; its only value is {:?} (only the lease's current holder writes the object)",
                crate::token::WRITER_LABEL,
                crate::token::HOLDER_ONLY
            ),
        ));
    }
    let writer =
        (writer_label(&req.old).is_some() || writer_label(&req.new).is_some()).then_some(Writer { user: &req.user, pod: req.pod.as_ref() });
    let lease = |name| LeaseRef { namespace: &req.namespace, name };
    // A row that depends on the lease may be judged from the cache, except for a holder-only
    // object: who holds the lease now is read with a quorum read.
    let read = |pending: Pending<'r>| match pending.writer {
        Some(_) => Plan::Quorum(QuorumRead(pending)),
        None => Plan::Cache(CacheRead(pending)),
    };
    // Rows admitted without a token: for a holder-only object, once the holder check passed
    // (a quorum read of its lease); for any other, at once.
    let by_holder = |reason: Reason| match (writer, old_lease.or(new_lease)) {
        (Some(writer), Some(name)) => {
            Plan::Quorum(QuorumRead(Pending { lease: lease(name), rule: Rule::Holder(reason), writer: Some(writer) }))
        }
        _ => pass(reason),
    };
    let subresource = req.subresource.as_deref().is_some_and(|s| !s.is_empty());
    match (req.operation, &req.old, &req.new) {
        (Operation::Connect, ..) => return pass(Reason::Unguarded),
        // A subresource CREATE (eviction, binding, token) makes no guarded object.
        (Operation::Create | Operation::Delete, ..) if subresource => return pass(Reason::Unguarded),
        // A subresource write is judged only when it moves the guard itself — or when the
        // object is holder-only: then only by who asks.
        (Operation::Update, Some(old), Some(new)) if subresource && old.same_guard(new) => return by_holder(Reason::GuardUnchanged),
        (Operation::Update, Some(old), Some(new)) if only_removes_finalizers(old, new) => return pass(Reason::FinalizersRemoved),
        _ => {}
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
                        label = crate::token::LEASE_LABEL,
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
                        crate::token::LEASE_LABEL
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
                None => Plan::Quorum(QuorumRead(pending(Rule::Fresh { presented }))),
            }
        }
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

impl<'r> CacheRead<'r> {
    /// The lease to look up in the watch cache.
    pub fn lease(&self) -> LeaseRef<'r> {
        self.0.lease
    }

    /// Judges from the cache, or asks for a quorum read when the cache could be stale in the
    /// unsafe direction: the lease is absent from it, the presented token is newer than the
    /// newest token it has seen, or the lease relaxes fencing — Warn mode, or `AllowEqual`
    /// deciding the write (a lease tightened a moment ago must not be missed).
    pub fn judge(self, cached: Cached) -> Judged<'r> {
        // Holder-only objects are planned for a quorum read: no writer reaches the cache.
        let Pending { lease, rule, writer } = self.0;
        let quorum = |rule| Judged::Quorum(QuorumRead(Pending { lease, rule, writer }));
        let Some(facts) = cached.0 else {
            return match rule {
                // A delete without a precondition is denied whatever the lease says, unless it is
                // in Warn mode; an absent lease cannot be, so no quorum read is needed.
                Rule::UnconditionalDelete => Judged::Done(judge(lease, &rule, writer, None)),
                rule => quorum(rule),
            };
        };
        if facts.enforcement == Enforcement::Warn {
            return quorum(rule);
        }
        if let Rule::Successor { presented: Ok(t), recorded, .. } = &rule
            && (facts.issued.is_none_or(|issued| *t > issued) || (t == recorded && facts.comparison == Comparison::AllowEqual))
        {
            return quorum(rule);
        }
        Judged::Done(judge(lease, &rule, writer, Some(&facts)))
    }
}

impl<'r> QuorumRead<'r> {
    /// The lease to read with a quorum read.
    pub fn lease(&self) -> LeaseRef<'r> {
        self.0.lease
    }

    /// Judges with the lease as a quorum read returned it.
    pub fn judge(self, fresh: Quorum) -> Verdict {
        judge(self.0.lease, &self.0.rule, self.0.writer, fresh.0.as_ref())
    }
}

/// The rows that depend on the lease.
fn judge(lease: LeaseRef<'_>, rule: &Rule, writer: Option<Writer<'_>>, facts: Option<&LeaseFacts>) -> Verdict {
    let on_lease = Facts { lease: Some(lease.to_string()), ..Facts::default() };
    let Some(facts) = facts else {
        return Verdict::Deny {
            code: 403,
            reason: Reason::LeaseNotFound,
            message: format!(
                "the object is bound to lease {lease}, which does not exist: create the lease and write with a token it granted"
            ),
            facts: on_lease,
        };
    };
    // From here on a denial is a fencing denial, which a Warn lease turns into a warning.
    let deny = |code: u16, reason: Reason, message: String, facts_of_denial: Facts| match facts.enforcement {
        Enforcement::Enforce => Verdict::Deny { code, reason, message, facts: facts_of_denial },
        Enforcement::Warn => Verdict::AllowWithWarning {
            reason,
            message: format!("kube-fence (lease {lease} enforcement Warn) would deny this write: {message}"),
        },
    };
    // A holder-only object: who asks must hold the lease now, whatever the write carries.
    if let Some(writer) = writer {
        let Some(identity) = facts.identity else {
            return deny(
                403,
                Reason::NotHolder,
                format!(
                    "the object is holder-only ({}: {}), but lease {lease} does not bind its holder to an identity (spec.identity is unset), so who holds it cannot be checked: create the lease with spec.identity Pod or User, or remove the label",
                    crate::token::WRITER_LABEL,
                    crate::token::HOLDER_ONLY
                ),
                Facts { holder: facts.holder.clone(), requester: Some(writer.user.to_string()), ..on_lease },
            );
        };
        let me = writer.as_holder(identity, lease.namespace);
        if me.is_err() || me.as_deref().ok() != facts.holder.as_deref() {
            let who = me.clone().map_or_else(|why| why, str::to_string);
            let holder = facts.holder.as_deref().map_or_else(|| "nobody holds it".to_string(), |h| format!("it is held by {h}"));
            return deny(
                409,
                Reason::NotHolder,
                format!(
                    "only the current holder of lease {lease} writes this holder-only object: {holder} (spec.identity {identity:?}), and this write comes from {who}"
                ),
                Facts { holder: facts.holder.clone(), requester: Some(me.unwrap_or(writer.user).to_string()), ..on_lease },
            );
        }
    }
    let (presented, recorded) = match rule {
        Rule::Holder(reason) => return Verdict::Allow { reason: *reason },
        Rule::UnconditionalDelete => {
            return deny(
                403,
                Reason::DeletePreconditionRequired,
                format!(
                    "deleting an object guarded by lease {lease} requires a resourceVersion precondition (delete only the version you read)"
                ),
                on_lease,
            );
        }
        Rule::Fresh { presented } => (presented, None),
        Rule::Successor { presented, recorded, .. } => (presented, Some(*recorded)),
    };
    // Under AllowEqual an equal token is restated by a new write annotation — or, for a
    // holder-only object, by the holder of the grant that issued it (the holder check passed).
    let restated = match rule {
        Rule::Successor { restated, presented: Ok(t), .. } => *restated && writer.is_none() || writer.is_some() && Some(*t) == facts.issued,
        _ => false,
    };
    let presented = match presented {
        Ok(t) => *t,
        Err(Missing::Absent) => {
            return deny(
                403,
                Reason::TokenMissing,
                format!(
                    "the object is guarded by lease {lease}: the write must carry the {} annotation with a token granted by that lease",
                    crate::token::TOKEN_ANNOTATION
                ),
                Facts { recorded, ..on_lease },
            );
        }
        Err(Missing::Malformed(raw, err)) => {
            return deny(
                400,
                Reason::TokenMalformed,
                format!("the {} annotation {raw:?} is not a token (lease {lease}): {err}", crate::token::TOKEN_ANNOTATION),
                Facts { recorded, ..on_lease },
            );
        }
    };
    let facts_with =
        |recorded: Option<Token>| Facts { lease: Some(lease.to_string()), presented: Some(presented), recorded, ..Facts::default() };
    let Some(issued) = facts.issued else {
        return deny(
            403,
            Reason::TokenNotIssued,
            format!("lease {lease} has not granted any token yet; presented token {presented} was not issued by it"),
            facts_with(recorded),
        );
    };
    let not_issued = || {
        deny(
            403,
            Reason::TokenNotIssued,
            format!("presented token {presented} is newer than lease {lease}'s newest token {issued}: it was not issued by that lease"),
            facts_with(recorded),
        )
    };
    match recorded {
        // CREATE / newly guarded: there is no recorded token on the object to compare with,
        // so the write must carry the lease's current token, read linearizably.
        None if presented == issued => Verdict::Allow { reason: Reason::Fenced },
        None if presented < issued => deny(
            409,
            Reason::StaleToken,
            format!(
                "stale write to an object guarded by lease {lease}: presented token {presented}, recorded token {issued} (the lease's newest grant); a guarded object is created or newly guarded only with the newest token"
            ),
            facts_with(Some(issued)),
        ),
        None => not_issued(),
        // AllowEqual: several writes under one grant, each restating the token (a new write
        // annotation), so a write that leaves the annotations alone is not taken for one.
        Some(recorded) if presented == recorded && facts.comparison == Comparison::AllowEqual && !restated => deny(
            409,
            Reason::StaleToken,
            format!(
                "stale write to an object guarded by lease {lease}: presented token {presented}, recorded token {recorded}; under AllowEqual an equal token counts only when the write restates it with a new {} annotation (the client library does)",
                crate::token::WRITE_ANNOTATION
            ),
            facts_with(Some(recorded)),
        ),
        Some(recorded) if presented < recorded || (presented == recorded && facts.comparison == Comparison::Strict) => deny(
            409,
            Reason::StaleToken,
            format!(
                "stale write to an object guarded by lease {lease}: presented token {presented}, recorded token {recorded} (the presented token is not greater than the recorded one)"
            ),
            facts_with(Some(recorded)),
        ),
        Some(_) if presented > issued => not_issued(),
        Some(_) => Verdict::Allow { reason: Reason::Fenced },
    }
}

/// A Kubernetes object name (RFC 1123 subdomain): what a lease's name can be.
pub(crate) fn is_dns_subdomain(s: &str) -> bool {
    s.len() <= 253
        && s.split('.').all(|part| {
            !part.is_empty()
                && part.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !part.starts_with('-')
                && !part.ends_with('-')
        })
}

#[cfg(test)]
mod tests;
