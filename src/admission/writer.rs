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
//! its own whose match condition names exactly its ServiceAccounts ([`OptIn::match_condition`]),
//! at a path that names the Lease (`/writer/<namespace>/<name>`), so a review says which Lease
//! judges it and the webhook needs no cache of opt-ins (`super::writer_routing` keeps the
//! registration in step). Writes a controller makes whether it leads or not are never sent: its
//! own Lease (campaigning; the holder policy judges those), Events, and the reviews that store
//! nothing (TokenReview, SubjectAccessReview); `kubefence.io/writers-exempt` names more.
//!
//! Pure like [`super::decision`]: [`plan`] judges outright or asks for one quorum read of the
//! Lease ([`WriterRead`]), judged only with a [`WriterQuorum`], which only [`read_lease`] makes.
//!
//! Why this fences a stale leader, on every object it writes: for UPDATE and DELETE the API server
//! runs validating admission inside its compare-and-swap on the object, so a write by Pod A
//! commits only if A held the Lease at a quorum read made after the request arrived. Once B has
//! taken the Lease, no write of A that arrives after the takeover is admitted; a write of A judged
//! just before it may still commit after it, but not over a write of B to the same object (the
//! swap then fails and the write is judged again). CREATE has no stored object to swap against: a
//! CREATE judged before the takeover may commit after it (docs/design.md §6b).

use std::collections::BTreeSet;
use std::fmt;

use k8s_openapi::api::coordination::v1::Lease as LeaderElectionLease;
use kube::{Api, Client};

use super::decision::{Facts, LeaseRef, Reason, Request, SERVICE_ACCOUNT_PREFIX, Verdict, is_dns_subdomain};
use super::leader::{HOLDER_IDENTITY_LABEL, HOLDER_IS_POD, IdentityRule};

pub use kube_fence_api::names::{WRITERS_ANNOTATION, WRITERS_EXEMPT_ANNOTATION};
/// The path prefix of the writer webhooks: `/writer/<namespace>/<name>`.
pub const PATH_PREFIX: &str = "/writer";

/// A resource the opted-in writers' writes to are not fenced: `resource[.group]`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct ResourceName {
    pub resource: String,
    pub group: String,
}

impl fmt::Display for ResourceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.group.is_empty() { f.write_str(&self.resource) } else { write!(f, "{}.{}", self.resource, self.group) }
    }
}

/// Why a Lease's opt-in cannot be registered (it is then not registered at all, and the
/// controller says why in an Event and its log).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OptInError {
    #[error(
        "{WRITERS_ANNOTATION} names {0:?}, which is not a ServiceAccount name (a lowercase DNS subdomain name of the Lease's namespace)"
    )]
    NotAServiceAccount(String),
    #[error("{WRITERS_EXEMPT_ANNOTATION} names {0:?}, which is not a resource (`<resource>` or `<resource>.<group>`, lowercase)")]
    NotAResource(String),
    #[error(
        "{WRITERS_ANNOTATION} is set, but the Lease lacks the label {HOLDER_IDENTITY_LABEL}: {HOLDER_IS_POD}, so its holder is not bound to a Pod and nobody could be told apart as its holder"
    )]
    NotHolderBound,
}

/// An opted-in Lease, as registered: which ServiceAccounts of its namespace it fences, and which
/// resources their writes to pass unjudged.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct OptIn {
    pub namespace: String,
    pub name: String,
    pub accounts: BTreeSet<String>,
    pub exempt: BTreeSet<ResourceName>,
}

/// Splits a comma-separated annotation into its non-empty, trimmed items.
fn items(value: &str) -> impl Iterator<Item = &str> {
    value.split(',').map(str::trim).filter(|item| !item.is_empty())
}

/// The ServiceAccounts a Lease's writers annotation names, as written (no validation): what the
/// webhook re-reads at judging time.
pub fn accounts_named(annotations: Option<&std::collections::BTreeMap<String, String>>) -> BTreeSet<String> {
    annotations.and_then(|a| a.get(WRITERS_ANNOTATION)).map(|v| items(v).map(str::to_string).collect()).unwrap_or_default()
}

impl OptIn {
    /// The opt-in a Lease declares: `Ok(None)` when it declares none (no writers annotation, or
    /// one that names nobody).
    pub fn of(lease: &LeaderElectionLease) -> Result<Option<OptIn>, OptInError> {
        let meta = &lease.metadata;
        let accounts = accounts_named(meta.annotations.as_ref());
        if accounts.is_empty() {
            return Ok(None);
        }
        let bound = meta.labels.as_ref().and_then(|l| l.get(HOLDER_IDENTITY_LABEL)).is_some_and(|v| v == HOLDER_IS_POD);
        if !bound {
            return Err(OptInError::NotHolderBound);
        }
        if let Some(bad) = accounts.iter().find(|a| !is_dns_subdomain(a)) {
            return Err(OptInError::NotAServiceAccount(bad.clone()));
        }
        let mut exempt = BTreeSet::new();
        for item in meta
            .annotations
            .as_ref()
            .and_then(|a| a.get(WRITERS_EXEMPT_ANNOTATION))
            .map(|v| items(v).collect::<Vec<_>>())
            .unwrap_or_default()
        {
            exempt.insert(parse_resource(item).ok_or_else(|| OptInError::NotAResource(item.to_string()))?);
        }
        Ok(Some(OptIn {
            namespace: meta.namespace.clone().unwrap_or_default(),
            name: meta.name.clone().unwrap_or_default(),
            accounts,
            exempt,
        }))
    }

    /// The Lease.
    pub fn lease(&self) -> LeaseRef<'_> {
        LeaseRef { namespace: &self.namespace, name: &self.name }
    }

    /// The usernames of the fenced ServiceAccounts.
    pub fn usernames(&self) -> Vec<String> {
        self.accounts.iter().map(|a| format!("{SERVICE_ACCOUNT_PREFIX}{}:{a}", self.namespace)).collect()
    }

    /// The path its webhook is called at.
    pub fn path(&self) -> String {
        format!("{PATH_PREFIX}/{}/{}", self.namespace, self.name)
    }

    /// The match condition (CEL, evaluated by the API server) that sends this Lease's webhook
    /// exactly the writes it judges: by one of the fenced ServiceAccounts, and not to the Lease
    /// itself, not an Event, not a review that stores nothing, not an exempt resource. Written so
    /// that it cannot fail to evaluate (every field it reads is always in a request).
    pub fn match_condition(&self) -> String {
        let quote = |s: &str| format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"));
        let users: Vec<String> = self.usernames().iter().map(|u| quote(u)).collect();
        let mut condition = format!(
            "request.userInfo.username in [{users}] \
             && !(request.resource.group == 'coordination.k8s.io' && request.resource.resource == 'leases' && request.namespace == {ns} && request.name == {name}) \
             && !(request.resource.resource == 'events' && request.resource.group in ['', 'events.k8s.io']) \
             && !(request.resource.group in ['authentication.k8s.io', 'authorization.k8s.io'])",
            users = users.join(", "),
            ns = quote(&self.namespace),
            name = quote(&self.name),
        );
        for exempt in &self.exempt {
            condition.push_str(&format!(
                " && !(request.resource.resource == {} && request.resource.group == {})",
                quote(&exempt.resource),
                quote(&exempt.group)
            ));
        }
        condition
    }
}

/// `resource` or `resource.group`, lowercase DNS names.
fn parse_resource(item: &str) -> Option<ResourceName> {
    let (resource, group) = match item.split_once('.') {
        Some((resource, group)) => (resource, Some(group)),
        None => (item, None),
    };
    let label = |s: &str| !s.is_empty() && s.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    (label(resource) && group.is_none_or(is_dns_subdomain))
        .then(|| ResourceName { resource: resource.to_string(), group: group.unwrap_or_default().to_string() })
}

/// The Lease as a quorum read returned it: `None` when there is no such Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WriterQuorum(Option<FreshLease>);

/// What judging a writer needs of the Lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FreshLease {
    /// `spec.holderIdentity` (`""` when released or never held).
    pub holder: String,
    /// Whether it still carries `kubefence.io/holder-identity: Pod`.
    pub holder_bound: bool,
    /// The ServiceAccounts its writers annotation names now.
    pub accounts: BTreeSet<String>,
}

impl WriterQuorum {
    /// From a quorum read's result. Only [`read_lease`] and tests of this module call it.
    fn from_read(lease: Option<LeaderElectionLease>) -> WriterQuorum {
        WriterQuorum(lease.map(|l| FreshLease {
            holder: l.spec.and_then(|s| s.holder_identity).unwrap_or_default(),
            holder_bound: l.metadata.labels.as_ref().and_then(|m| m.get(HOLDER_IDENTITY_LABEL)).is_some_and(|v| v == HOLDER_IS_POD),
            accounts: accounts_named(l.metadata.annotations.as_ref()),
        }))
    }
}

/// What judging a write of an opted-in writer needs after [`plan`].
#[derive(Debug)]
pub enum WriterPlan<'r> {
    /// Judged without reading the Lease.
    Done(Verdict),
    /// Read the Lease with a quorum read and call [`WriterRead::judge`].
    Quorum(WriterRead<'r>),
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

/// The first step of judging `req`, sent by the webhook of opted-in Lease `lease`.
pub fn plan<'r>(req: &'r Request, lease: LeaseRef<'r>, identity: &'r IdentityRule) -> WriterPlan<'r> {
    // The routing names the Lease's own ServiceAccounts only; anything else was sent by a stale
    // or forged registration: it is not this Lease's to judge.
    let account = req
        .user
        .strip_prefix(SERVICE_ACCOUNT_PREFIX)
        .and_then(|rest| rest.split_once(':'))
        .filter(|(namespace, _)| *namespace == lease.namespace)
        .map(|(_, account)| account);
    let Some(account) = account else { return WriterPlan::Done(Verdict::Allow { reason: Reason::Unguarded }) };
    let pod = req.pod.as_ref().and_then(|p| p.name_in(lease.namespace));
    WriterPlan::Quorum(WriterRead { lease, account, pod, identity })
}

impl<'r> WriterRead<'r> {
    /// The Lease to read with a quorum read.
    pub fn lease(&self) -> LeaseRef<'r> {
        self.lease
    }

    /// Judges with the Lease as a quorum read returned it.
    pub fn judge(self, fresh: WriterQuorum) -> Verdict {
        let WriterRead { lease, account, pod, identity } = self;
        let fenced = match &fresh.0 {
            Some(l) => l.holder_bound && l.accounts.contains(account),
            None => false,
        };
        // The opt-in is gone (the Lease deleted, or its annotation or label removed — by its
        // holder or an admin, the holder policy sees to that): the writes flow again.
        let Some(fresh) = fresh.0.filter(|_| fenced) else { return Verdict::Allow { reason: Reason::Unguarded } };
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

/// The Lease as etcd has it now: `Api::get` without a resourceVersion is a quorum read.
pub async fn read_lease(client: Client, lease: LeaseRef<'_>) -> Result<WriterQuorum, kube::Error> {
    let fresh = Api::<LeaderElectionLease>::namespaced(client, lease.namespace).get_opt(lease.name).await?;
    Ok(WriterQuorum::from_read(fresh))
}

/// The Lease a writer webhook's path names (`<namespace>/<name>` after [`PATH_PREFIX`]), or why
/// it names none.
pub fn lease_of_path<'p>(namespace: &'p str, name: &'p str) -> Option<LeaseRef<'p>> {
    let namespace_ok = !namespace.is_empty() && namespace.len() <= 63 && is_dns_subdomain(namespace) && !namespace.contains('.');
    (namespace_ok && is_dns_subdomain(name)).then_some(LeaseRef { namespace, name })
}

#[cfg(test)]
mod tests;
