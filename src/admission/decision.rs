//! Where a write is judged: the fencing decision table of DESIGN.md section 4, as a pure
//! function.
//!
//! [`decide`] takes the facts of one admission request (operation, the lease binding and token
//! of the old and new object, who asks, the delete precondition) and the facts of the bound
//! lease, and returns a [`Verdict`]. [`lease_read`] says which read of the lease a request needs
//! before it can be judged. Neither does I/O; the server (`super::server`) gathers the facts,
//! the lease directory (`super::leases`) reads the lease, and this file decides.
//!
//! Why this is enough for safety: for UPDATE and DELETE the API server runs validating
//! admission inside its storage compare-and-swap loop, so the `old` object judged here is the
//! exact version the write replaces; `presented > recorded` checked here is committed in the
//! same etcd transaction as the write (DESIGN.md section 4, "Why this is atomic").

use std::fmt;

use crate::api::{Comparison, Enforcement};
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
}

impl ObjectFacts {
    pub fn guarded(lease: &str, token: Option<&str>) -> ObjectFacts {
        ObjectFacts { lease: Some(lease.to_string()), token: token.map(str::to_string) }
    }

    pub fn unguarded(token: Option<&str>) -> ObjectFacts {
        ObjectFacts { lease: None, token: token.map(str::to_string) }
    }
}

/// One admission request, reduced to the facts fencing depends on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub operation: Operation,
    /// Namespace of the object (guarded objects are namespaced; the lease lives beside them).
    pub namespace: String,
    /// The stored object (UPDATE, DELETE).
    pub old: Option<ObjectFacts>,
    /// The incoming object (CREATE, UPDATE).
    pub new: Option<ObjectFacts>,
    /// `userInfo.username` of the request.
    pub user: String,
    /// Whether the DELETE carries a non-empty `preconditions.resourceVersion`.
    pub delete_precondition: bool,
}

/// What the webhook knows about the lease an object is bound to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseFacts {
    /// Newest token the lease issued (`status.token`); `None` before its first grant.
    pub issued: Option<Token>,
    pub comparison: Comparison,
    pub enforcement: Enforcement,
}

/// The outcome of looking a lease up.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeaseLookup {
    /// `None` when no lease of that name exists.
    pub lease: Option<LeaseFacts>,
    /// Whether this came from a linearizable (quorum) read rather than the watch cache.
    pub linearizable: bool,
}

/// Which read of the bound lease a request needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseRead {
    /// The verdict does not depend on the lease.
    None,
    /// The watch cache is enough: a cache that lags only makes the verdict stricter.
    Cache,
    /// A quorum read: the cache could be stale in the unsafe direction.
    Linearizable,
}

/// Stable reasons, used in the AdmissionResponse status and as the metric label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Reason {
    /// Admitted: the write carries a valid, fresh token (or needs none).
    Fenced,
    /// Admitted: the object is not guarded (or the operation is not fenced).
    Unguarded,
    /// Admitted: the requester is an exempt identity.
    Exempt,
    /// Admitted: the DELETE names the version it deletes.
    DeletePreconditioned,
    StaleToken,
    TokenMissing,
    TokenMalformed,
    TokenNotIssued,
    LeaseNotFound,
    LeaseRebound,
    LeaseLabelInvalid,
    DeletePreconditionRequired,
    /// The request lacks what a well-formed AdmissionReview of this operation carries.
    MalformedRequest,
    /// The lease could not be read (API server unreachable): failed closed.
    LeaseReadFailed,
    /// The decision was handed lease facts from the cache where it needs a quorum read: a
    /// bug in the caller, failed closed.
    LeaseReadRequired,
}

impl Reason {
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::Fenced => "Fenced",
            Reason::Unguarded => "Unguarded",
            Reason::Exempt => "Exempt",
            Reason::DeletePreconditioned => "DeletePreconditioned",
            Reason::StaleToken => "StaleToken",
            Reason::TokenMissing => "TokenMissing",
            Reason::TokenMalformed => "TokenMalformed",
            Reason::TokenNotIssued => "TokenNotIssued",
            Reason::LeaseNotFound => "LeaseNotFound",
            Reason::LeaseRebound => "LeaseRebound",
            Reason::LeaseLabelInvalid => "LeaseLabelInvalid",
            Reason::DeletePreconditionRequired => "DeletePreconditionRequired",
            Reason::MalformedRequest => "MalformedRequest",
            Reason::LeaseReadRequired => "LeaseReadRequired",
            Reason::LeaseReadFailed => "LeaseReadFailed",
        }
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

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
    /// forbids, 400 for malformed input, 500 for a caller bug.
    Deny {
        code: u16,
        reason: Reason,
        message: String,
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
}

/// Who may write guarded objects without a token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exemptions(Vec<String>);

impl Exemptions {
    pub fn new<I: IntoIterator<Item = S>, S: Into<String>>(users: I) -> Exemptions {
        Exemptions(users.into_iter().map(Into::into).collect())
    }

    pub fn contains(&self, user: &str) -> bool {
        self.0.iter().any(|u| u == user)
    }
}

impl Default for Exemptions {
    fn default() -> Self {
        Exemptions::new(DEFAULT_EXEMPT)
    }
}

/// The shape of a request, once the lease binding of its two sides is compared.
enum Shape<'a> {
    /// Neither side is guarded, the requester is exempt, or the operation is not fenced.
    Pass(Reason),
    /// The request cannot be judged; deny it without looking at any lease.
    Reject(Verdict),
    /// CREATE, or UPDATE of an object with no valid recorded token (newly guarded, or guarded
    /// before kube-fence ran): `t` must equal the lease's newest issued token.
    Fresh { lease: &'a str, presented: Result<Token, Missing<'a>> },
    /// UPDATE of an object that records `r`: `t > r` (or `>=`), and `t <= issued`.
    Successor { lease: &'a str, presented: Result<Token, Missing<'a>>, recorded: Token },
    /// DELETE without a resourceVersion precondition: denied unless the lease is in Warn mode.
    UnconditionalDelete { lease: &'a str },
}

/// Why the incoming object carries no usable token.
#[derive(Clone, Debug)]
enum Missing<'a> {
    Absent,
    Malformed(&'a str, TokenError),
}

fn presented_token(facts: &ObjectFacts) -> Result<Token, Missing<'_>> {
    match facts.token.as_deref() {
        None => Err(Missing::Absent),
        Some(raw) => raw.parse().map_err(|e| Missing::Malformed(raw, e)),
    }
}

fn shape<'a>(req: &'a Request, exempt: &Exemptions) -> Shape<'a> {
    let malformed = |message: String| Shape::Reject(Verdict::Deny { code: 400, reason: Reason::MalformedRequest, message });
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
    if old_lease.is_none() && new_lease.is_none() {
        return Shape::Pass(Reason::Unguarded);
    }
    if exempt.contains(&req.user) {
        return Shape::Pass(Reason::Exempt);
    }
    match req.operation {
        Operation::Connect => Shape::Pass(Reason::Unguarded),
        Operation::Delete => match old_lease {
            Some(_) if req.delete_precondition => Shape::Pass(Reason::DeletePreconditioned),
            Some(lease) => Shape::UnconditionalDelete { lease },
            None => Shape::Pass(Reason::Unguarded),
        },
        Operation::Create | Operation::Update => {
            let Some(new) = req.new.as_ref() else { return Shape::Pass(Reason::Unguarded) };
            if let (Some(old), Some(new)) = (old_lease, new_lease)
                && old != new
            {
                return Shape::Reject(Verdict::Deny {
                    code: 403,
                    reason: Reason::LeaseRebound,
                    message: format!(
                        "the object is bound to lease {ns}/{old}; changing its {label} label to {new:?} is never allowed (a token of one lease says nothing about another): delete and re-create the object, or unguard it first with a valid token of {ns}/{old}",
                        ns = req.namespace,
                        label = crate::token::LEASE_LABEL,
                    ),
                });
            }
            // The lease that judges the write: the old binding when there is one (unguarding is
            // judged by the lease being left), else the new one.
            let lease = old_lease.or(new_lease).unwrap_or_default();
            if lease.is_empty() || !is_dns_subdomain(lease) {
                return Shape::Reject(Verdict::Deny {
                    code: 400,
                    reason: Reason::LeaseLabelInvalid,
                    message: format!(
                        "the {} label {lease:?} does not name a lease (a lowercase DNS subdomain name in the same namespace)",
                        crate::token::LEASE_LABEL
                    ),
                });
            }
            let presented = presented_token(new);
            let recorded = match old_lease {
                // The recorded token only counts while the stored object is guarded: an
                // annotation on an unguarded object was never judged.
                Some(_) => req.old.as_ref().and_then(|o| o.token.as_deref()).and_then(|r| r.parse::<Token>().ok()),
                None => None,
            };
            match recorded {
                Some(recorded) => Shape::Successor { lease, presented, recorded },
                None => Shape::Fresh { lease, presented },
            }
        }
    }
}

/// The lease that judges `req`: the one the stored object is bound to, else the one the
/// incoming object names.
pub fn bound_lease(req: &Request) -> Option<&str> {
    let old = req.old.as_ref().and_then(|o| o.lease.as_deref());
    old.or_else(|| req.new.as_ref().and_then(|n| n.lease.as_deref()))
}

/// Which read of the bound lease `req` needs. Called first with `cached: None`; when that
/// answers [`LeaseRead::Cache`], call it again with what the cache holds — it answers
/// [`LeaseRead::Linearizable`] when the cache could be stale in the unsafe direction:
/// the lease is absent from it, the presented token is newer than the newest token the cache
/// has seen, or the lease relaxes fencing (AllowEqual deciding the write, or Warn) so a policy
/// tightened a moment ago must not be missed.
pub fn lease_read(req: &Request, exempt: &Exemptions, cached: Option<&LeaseLookup>) -> LeaseRead {
    match shape(req, exempt) {
        Shape::Pass(_) | Shape::Reject(_) => LeaseRead::None,
        Shape::Fresh { .. } => LeaseRead::Linearizable,
        Shape::UnconditionalDelete { .. } => match cached.map(|c| &c.lease) {
            Some(Some(facts)) if facts.enforcement == Enforcement::Warn => LeaseRead::Linearizable,
            _ => LeaseRead::Cache,
        },
        Shape::Successor { presented, recorded, .. } => {
            let Some(cached) = cached else { return LeaseRead::Cache };
            let Some(facts) = &cached.lease else { return LeaseRead::Linearizable };
            if facts.enforcement == Enforcement::Warn {
                return LeaseRead::Linearizable;
            }
            match presented {
                Ok(t) if facts.issued.is_none_or(|issued| t > issued) => LeaseRead::Linearizable,
                Ok(t) if t == recorded && facts.comparison == Comparison::AllowEqual => LeaseRead::Linearizable,
                _ => LeaseRead::Cache,
            }
        }
    }
}

/// Judges one request. `lease` is the lookup of the bound lease, read as [`lease_read`] asks
/// (`None` when it asks for no read). Given a weaker read than it needs, it fails closed.
pub fn decide(req: &Request, exempt: &Exemptions, lease: Option<&LeaseLookup>) -> Verdict {
    let shape = shape(req, exempt);
    let (name, presented, recorded) = match &shape {
        Shape::Pass(reason) => return Verdict::Allow { reason: *reason },
        Shape::Reject(verdict) => return verdict.clone(),
        Shape::Fresh { lease, presented } => (*lease, presented, None),
        Shape::Successor { lease, presented, recorded } => (*lease, presented, Some(*recorded)),
        Shape::UnconditionalDelete { lease } => (*lease, &Err(Missing::Absent), None),
    };
    let ns = &req.namespace;
    let Some(lookup) = lease else {
        return Verdict::Deny {
            code: 500,
            reason: Reason::LeaseReadRequired,
            message: format!("lease {ns}/{name} was not read (kube-fence bug; failing closed)"),
        };
    };
    let needed = lease_read(req, exempt, Some(lookup));
    if needed == LeaseRead::Linearizable && !lookup.linearizable {
        return Verdict::Deny {
            code: 500,
            reason: Reason::LeaseReadRequired,
            message: format!("lease {ns}/{name} must be read linearizably to judge this write (kube-fence bug; failing closed)"),
        };
    }
    let Some(facts) = &lookup.lease else {
        return Verdict::Deny {
            code: 403,
            reason: Reason::LeaseNotFound,
            message: format!(
                "the object is bound to lease {ns}/{name}, which does not exist: create the lease and write with a token it granted"
            ),
        };
    };
    // From here on a denial is a fencing denial, which a Warn lease turns into a warning.
    let deny = |code: u16, reason: Reason, message: String| match facts.enforcement {
        Enforcement::Enforce => Verdict::Deny { code, reason, message },
        Enforcement::Warn => Verdict::AllowWithWarning {
            reason,
            message: format!("kube-fence (lease {ns}/{name} enforcement Warn) would deny this write: {message}"),
        },
    };

    if matches!(shape, Shape::UnconditionalDelete { .. }) {
        return deny(
            403,
            Reason::DeletePreconditionRequired,
            format!(
                "deleting an object guarded by lease {ns}/{name} requires a resourceVersion precondition (delete only the version you read)"
            ),
        );
    }
    let presented = match presented {
        Ok(t) => *t,
        Err(Missing::Absent) => {
            return deny(
                403,
                Reason::TokenMissing,
                format!(
                    "the object is guarded by lease {ns}/{name}: the write must carry the {} annotation with a token granted by that lease",
                    crate::token::TOKEN_ANNOTATION
                ),
            );
        }
        Err(Missing::Malformed(raw, err)) => {
            return deny(
                400,
                Reason::TokenMalformed,
                format!("the {} annotation {raw:?} is not a token (lease {ns}/{name}): {err}", crate::token::TOKEN_ANNOTATION),
            );
        }
    };
    let Some(issued) = facts.issued else {
        return deny(
            403,
            Reason::TokenNotIssued,
            format!("lease {ns}/{name} has not granted any token yet; presented token {presented} was not issued by it"),
        );
    };
    match recorded {
        // CREATE / newly guarded: there is no recorded token on the object to compare with,
        // so the write must carry the lease's current token, read linearizably.
        None if presented == issued => Verdict::Allow { reason: Reason::Fenced },
        None if presented < issued => deny(
            409,
            Reason::StaleToken,
            format!(
                "stale write to an object guarded by lease {ns}/{name}: presented token {presented}, recorded token {issued} (the lease's newest grant); a guarded object is created or newly guarded only with the newest token"
            ),
        ),
        None => deny(
            403,
            Reason::TokenNotIssued,
            format!("presented token {presented} was not issued by lease {ns}/{name} (its newest token is {issued})"),
        ),
        Some(recorded) => {
            let fresh = match facts.comparison {
                Comparison::Strict => presented > recorded,
                Comparison::AllowEqual => presented >= recorded,
            };
            if !fresh {
                let relation = match facts.comparison {
                    Comparison::Strict => "is not greater than",
                    Comparison::AllowEqual => "is less than",
                };
                deny(
                    409,
                    Reason::StaleToken,
                    format!(
                        "stale write to an object guarded by lease {ns}/{name}: presented token {presented}, recorded token {recorded} (the presented token {relation} the recorded one)"
                    ),
                )
            } else if presented > issued {
                deny(
                    403,
                    Reason::TokenNotIssued,
                    format!("presented token {presented} was not issued by lease {ns}/{name} (its newest token is {issued})"),
                )
            } else {
                Verdict::Allow { reason: Reason::Fenced }
            }
        }
    }
}

/// A Kubernetes object name (RFC 1123 subdomain): what a lease's name can be.
fn is_dns_subdomain(s: &str) -> bool {
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
