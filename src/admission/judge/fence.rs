//! What a `FencedController` declares, as the writer fence judges it (pure): the ServiceAccounts
//! of its namespace whose every write is admitted only from the Pod holding its Lease, the
//! resources their writes to pass, and whether the fence refuses or only warns. The routing
//! (`crate::admission::registration::routing`) sends the API server's reviews of exactly those
//! writes; `super::writer` judges them.

use std::collections::BTreeSet;
use std::fmt;

use kube_fence_api::{FenceMode, FencedController};

use super::facts::{LeaseRef, Request, SERVICE_ACCOUNT_PREFIX, is_dns_subdomain};

/// Whether a fence denies what it would refuse, or admits it with a warning.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Mode {
    /// Refused writes are denied.
    #[default]
    Enforce,
    /// Refused writes are admitted with a warning that says what enforcing would have said.
    Audit,
}

/// A resource a fence lets its writers write unjudged: `resource[.group]`, as kubectl spells it.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ResourceName {
    pub resource: String,
    pub group: String,
}

impl ResourceName {
    /// `resource` or `resource.group`, lowercase DNS names; `None` when `item` is neither.
    pub fn parse(item: &str) -> Option<ResourceName> {
        let (resource, group) = match item.split_once('.') {
            Some((resource, group)) => (resource, Some(group)),
            None => (item, None),
        };
        let label = |s: &str| !s.is_empty() && s.len() <= 63 && s.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-');
        (label(resource) && group.is_none_or(is_dns_subdomain))
            .then(|| ResourceName { resource: resource.to_string(), group: group.unwrap_or_default().to_string() })
    }

    /// The key the routing's match condition compares a request with: `<group>/<resource>`.
    pub fn key(&self) -> String {
        format!("{}/{}", self.group, self.resource)
    }
}

impl fmt::Display for ResourceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.group.is_empty() { f.write_str(&self.resource) } else { write!(f, "{}.{}", self.resource, self.group) }
    }
}

/// Why a FencedController cannot be judged by (the schema refuses all of these; an object written
/// before a schema change, or by a client that skipped validation, is reported `Ready=False`).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FenceError {
    #[error("spec.serviceAccounts names {0:?}, which is not a ServiceAccount name (a lowercase DNS subdomain name)")]
    NotAServiceAccount(String),
    #[error("spec.serviceAccounts is empty: the fence would judge nobody")]
    NoServiceAccount,
    #[error("spec.exempt names {0:?}, which is not a resource (`<resource>` or `<resource>.<group>`, lowercase, as kubectl spells it)")]
    NotAResource(String),
    #[error("spec.lease {0:?} is not a Lease name (a lowercase DNS subdomain name)")]
    NotALease(String),
}

/// A FencedController, as judged.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Fence {
    /// The FencedController's namespace: its Lease's and its ServiceAccounts'.
    pub namespace: String,
    /// The FencedController's name.
    pub name: String,
    /// The controller's leader-election Lease.
    pub lease: String,
    pub accounts: BTreeSet<String>,
    pub exempt: BTreeSet<ResourceName>,
    pub mode: Mode,
}

impl Fence {
    /// The fence a FencedController declares, or why it cannot be judged by.
    pub fn of(fenced: &FencedController) -> Result<Fence, FenceError> {
        let spec = &fenced.spec;
        if !is_dns_subdomain(&spec.lease) || spec.lease.is_empty() {
            return Err(FenceError::NotALease(spec.lease.clone()));
        }
        if spec.service_accounts.is_empty() {
            return Err(FenceError::NoServiceAccount);
        }
        if let Some(bad) = spec.service_accounts.iter().find(|a| a.is_empty() || !is_dns_subdomain(a)) {
            return Err(FenceError::NotAServiceAccount(bad.clone()));
        }
        let exempt = spec
            .exempt
            .iter()
            .map(|item| ResourceName::parse(item).ok_or_else(|| FenceError::NotAResource(item.clone())))
            .collect::<Result<_, _>>()?;
        Ok(Fence {
            namespace: fenced.metadata.namespace.clone().unwrap_or_default(),
            name: fenced.metadata.name.clone().unwrap_or_default(),
            lease: spec.lease.clone(),
            accounts: spec.service_accounts.iter().cloned().collect(),
            exempt,
            mode: match spec.mode {
                FenceMode::Audit => Mode::Audit,
                FenceMode::Enforce => Mode::Enforce,
            },
        })
    }

    /// The Lease whose holder alone writes.
    pub fn lease(&self) -> LeaseRef<'_> {
        LeaseRef { namespace: &self.namespace, name: &self.lease }
    }

    /// The usernames of the fenced ServiceAccounts.
    pub fn usernames(&self) -> impl Iterator<Item = String> + '_ {
        self.accounts.iter().map(|a| format!("{SERVICE_ACCOUNT_PREFIX}{}:{a}", self.namespace))
    }

    /// The fenced ServiceAccount `user` is, if it is one.
    pub fn account_of<'u>(&self, user: &'u str) -> Option<&'u str> {
        let (ns, account) = user.strip_prefix(SERVICE_ACCOUNT_PREFIX)?.split_once(':')?;
        (ns == self.namespace && self.accounts.contains(account)).then_some(account)
    }

    /// Whether `req` passes this fence unjudged: a write to an exempt resource, or to the fence's
    /// own Lease (campaigning; the API server's holder policy judges those).
    pub fn passes(&self, req: &Request) -> bool {
        let resource = &req.resource;
        let own_lease = resource.group == "coordination.k8s.io"
            && resource.resource == "leases"
            && req.namespace == self.namespace
            && req.name == self.lease;
        own_lease || self.exempt.iter().any(|e| e.group == resource.group && e.resource == resource.resource)
    }
}

#[cfg(test)]
mod tests {
    use kube_fence_api::FencedControllerSpec;
    use rstest::rstest;

    use super::*;
    use crate::admission::judge::facts::{GroupResource, Operation};

    fn fenced(accounts: &[&str], exempt: &[&str], lease: &str) -> FencedController {
        let mut fc = FencedController::new(
            "ctl",
            FencedControllerSpec {
                lease: lease.into(),
                service_accounts: accounts.iter().map(|s| s.to_string()).collect(),
                exempt: exempt.iter().map(|s| s.to_string()).collect(),
                mode: FenceMode::Enforce,
            },
        );
        fc.metadata.namespace = Some("team".into());
        fc
    }

    #[rstest]
    #[case::fine(&["ctl"], &["configmaps", "deployments.apps"], "ctl", Ok(()))]
    #[case::bad_account(&["Ctl"], &[], "ctl", Err(FenceError::NotAServiceAccount("Ctl".into())))]
    #[case::no_account(&[], &[], "ctl", Err(FenceError::NoServiceAccount))]
    #[case::bad_resource(&["ctl"], &["config maps"], "ctl", Err(FenceError::NotAResource("config maps".into())))]
    #[case::dotted_resource_start(&["ctl"], &[".apps"], "ctl", Err(FenceError::NotAResource(".apps".into())))]
    #[case::bad_lease(&["ctl"], &[], "", Err(FenceError::NotALease(String::new())))]
    fn what_a_fenced_controller_may_declare(
        #[case] accounts: &[&str],
        #[case] exempt: &[&str],
        #[case] lease: &str,
        #[case] expect: Result<(), FenceError>,
    ) {
        assert_eq!(Fence::of(&fenced(accounts, exempt, lease)).map(|_| ()), expect);
    }

    fn write(group: &str, resource: &str, namespace: &str, name: &str) -> Request {
        Request {
            resource: GroupResource { group: group.into(), resource: resource.into() },
            name: name.into(),
            ..Request::new(Operation::Update, namespace, None, None, "system:serviceaccount:team:ctl")
        }
    }

    #[rstest]
    #[case::own_lease(write("coordination.k8s.io", "leases", "team", "ctl"), true)]
    #[case::another_lease(write("coordination.k8s.io", "leases", "team", "other"), false)]
    #[case::same_name_elsewhere(write("coordination.k8s.io", "leases", "other", "ctl"), false)]
    #[case::exempt_core(write("", "configmaps", "anywhere", "x"), true)]
    #[case::exempt_grouped(write("apps", "deployments", "team", "x"), true)]
    #[case::same_resource_other_group(write("extensions", "deployments", "team", "x"), false)]
    #[case::not_exempt(write("", "secrets", "team", "x"), false)]
    fn what_passes_unjudged(#[case] req: Request, #[case] passes: bool) {
        let fence = Fence::of(&fenced(&["ctl"], &["configmaps", "deployments.apps"], "ctl")).expect("a fence");
        assert_eq!(fence.passes(&req), passes);
    }

    #[test]
    fn a_fence_knows_its_accounts_in_its_namespace_only() {
        let fence = Fence::of(&fenced(&["ctl", "helper"], &[], "ctl")).expect("a fence");
        assert_eq!(fence.account_of("system:serviceaccount:team:helper"), Some("helper"));
        assert_eq!(fence.account_of("system:serviceaccount:other:ctl"), None);
        assert_eq!(fence.account_of("system:serviceaccount:team:someone"), None);
        assert_eq!(fence.account_of("ctl"), None);
        assert_eq!(fence.usernames().collect::<Vec<_>>(), ["system:serviceaccount:team:ctl", "system:serviceaccount:team:helper"]);
    }
}
