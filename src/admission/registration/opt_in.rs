//! What an opted-in Lease declares (`kubefence.io/writers` on a `coordination.k8s.io/v1` Lease
//! labelled `kubefence.io/holder-identity: Pod`): the ServiceAccounts the writer fence judges, and
//! the resources their writes to pass unjudged. The routing (`super::routing`) registers one
//! webhook per opt-in, whose match condition sends exactly those writes
//! (`crate::admission::judge::writer` judges them).

use std::collections::BTreeSet;
use std::fmt;

use k8s_openapi::api::coordination::v1::Lease as LeaderElectionLease;
use kube_fence_api::names::{HOLDER_IDENTITY_LABEL, HOLDER_IS_POD, WRITERS_ANNOTATION, WRITERS_EXEMPT_ANNOTATION};

use crate::admission::judge::facts::{LeaseRef, SERVICE_ACCOUNT_PREFIX, is_dns_subdomain};
use crate::admission::judge::read::{accounts_named, items};
use crate::admission::judge::writer::PATH_PREFIX;

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

#[cfg(test)]
mod tests;
