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
//! Pure like [`super::decision`], and planned by `super::pipeline` (of its preamble it takes who
//! asks): [`plan`] judges outright or asks for one quorum read of the Lease ([`WriterRead`]),
//! judged only with a [`WriterQuorum`], which only a reader (`super::reads`) makes.
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

use super::decision::{Facts, LeaseRef, Reason, SERVICE_ACCOUNT_PREFIX, Verdict, is_dns_subdomain};
use super::leader::{HOLDER_IDENTITY_LABEL, HOLDER_IS_POD, IdentityRule};
use super::pipeline::{Preamble, Step};
use super::reads::{ReadError, WriterQuorum};

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
pub fn plan<'r>(preamble: &Preamble<'r>, lease: LeaseRef<'r>, identity: &'r IdentityRule) -> Step<'r> {
    // The routing names the Lease's own ServiceAccounts only; anything else was sent by a stale
    // or forged registration: it is not this Lease's to judge.
    let Some(account) = preamble.requester.account_in(lease.namespace) else {
        return Step::Done(Verdict::Allow { reason: Reason::Unguarded });
    };
    let pod = preamble.requester.pod_in(lease.namespace);
    Step::Writer(WriterRead { lease, account, pod, identity })
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
