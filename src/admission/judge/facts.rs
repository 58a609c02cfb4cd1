//! The vocabulary of judging: one admission request reduced to the facts fencing depends on
//! (what [`crate::admission::http::review`] reads off the wire), who asks, and the lease a
//! request is judged by. Every guard (`super::token`, `super::leader`, `super::writer`) speaks it;
//! it imports nothing of theirs.

use std::fmt;

use kube_fence_api::token::Token;
use kube_fence_api::{Comparison, Enforcement, HolderIdentity};

/// Where the API server puts the name of the Pod a ServiceAccount token is bound to
/// (`userInfo.extra`): the requester's Pod ([`PodIdentity`]).
pub const POD_NAME_EXTRA: &str = "authentication.kubernetes.io/pod-name";

/// A SHA-256 digest of an object's content (what `crate::admission::http::review` computes for an
/// object being deleted).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Digest(pub [u8; 32]);

impl fmt::Display for Digest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// Tests name digests by a number.
#[cfg(test)]
impl From<u64> for Digest {
    fn from(n: u64) -> Digest {
        let mut digest = [0; 32];
        digest[..8].copy_from_slice(&n.to_le_bytes());
        Digest(digest)
    }
}

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
    pub content: Option<Digest>,
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
    pub(crate) fn same_guard(&self, other: &ObjectFacts) -> bool {
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
    /// The resource written (`request.resource`, without its version).
    pub resource: GroupResource,
    /// The object's name (`""` for a CREATE whose name the API server generates).
    pub name: String,
}

/// A resource, as an admission request names it (`request.resource`): its API group (`""` for
/// the core group) and its plural name.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GroupResource {
    pub group: String,
    pub resource: String,
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
            resource: GroupResource::default(),
            name: String::new(),
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

/// Who asks: the request's username and, when it is authenticated by a Pod-bound token, its Pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Requester<'r> {
    pub user: &'r str,
    pub pod: Option<&'r PodIdentity>,
}

impl<'r> Requester<'r> {
    /// The requester as a lease in `namespace` with `identity` names holders, or why it cannot
    /// be one (a Pod lease, and the request carries no Pod identity, or a Pod of another
    /// namespace).
    pub(crate) fn as_holder(self, identity: HolderIdentity, namespace: &str) -> Result<&'r str, String> {
        match (identity, self.pod) {
            (HolderIdentity::User, _) => Ok(self.user),
            (HolderIdentity::Pod, None) => Err(format!("{} (no Pod identity: use the Pod's own ServiceAccount token)", self.user)),
            (HolderIdentity::Pod, Some(pod)) => pod.name_in(namespace).ok_or_else(|| {
                format!("Pod {pod}, which is not in the lease's namespace {namespace} (a Pod holds leases of its own namespace only)")
            }),
        }
    }

    /// The requester's Pod name, if it is a Pod of `namespace`.
    pub fn pod_in(&self, namespace: &str) -> Option<&'r str> {
        self.pod.and_then(|p| p.name_in(namespace))
    }

    /// The requester's ServiceAccount name, if it is a ServiceAccount of `namespace`.
    pub fn account_in(&self, namespace: &str) -> Option<&'r str> {
        let (ns, account) = self.user.strip_prefix(SERVICE_ACCOUNT_PREFIX)?.split_once(':')?;
        (ns == namespace).then_some(account)
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
