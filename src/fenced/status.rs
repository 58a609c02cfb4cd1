//! What a FencedController's status says, from what the controller found (pure): whether the
//! fence works (the `Ready` condition, with a reason from [`kube_fence_api::ready`] and a message
//! a person can act on), which Pod holds the Lease now (`holder`), and the generation described.
//!
//! Precedence, first match wins: an invalid spec (`InvalidSpec`), no Lease (`LeaseNotFound`), the
//! writer webhook not routing every fenced ServiceAccount (`NotRouted`), the holder not a Pod of
//! the fenced ServiceAccounts (`HolderNotFenced`), the holder Pod on the node's network
//! (`HostNetwork`); else `Ready=True`, `Enforcing` or `Auditing` by `spec.mode`. A Lease with no
//! holder now is Ready: the fence refuses (or warns of) every judged write meanwhile.

use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::Timestamp;
use kube_fence_api::{FencedController, FencedControllerStatus, ready};

use crate::admission::judge::fence::{Fence, FenceError, Mode};
use crate::admission::judge::identity::IdentityRule;

/// The condition type the status carries.
pub const READY: &str = "Ready";

/// The Lease as found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LeaseFact<'a> {
    NotFound,
    /// Its `holderIdentity` (`None` or empty: nobody holds it now).
    Found {
        holder: Option<&'a str>,
    },
}

impl<'a> LeaseFact<'a> {
    /// The holder identity, if somebody holds the Lease.
    pub fn holder(&self) -> Option<&'a str> {
        match self {
            LeaseFact::Found { holder: Some(h) } if !h.is_empty() => Some(h),
            _ => None,
        }
    }
}

/// The Pod the holder identity names, as found (looked at only when the Lease has a holder).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodFact<'a> {
    NotFound,
    Found { service_account: &'a str, host_network: bool },
}

/// Whether the applied writer webhook routes the fence's ServiceAccounts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Routing {
    /// The writers configuration does not exist.
    NoConfiguration,
    /// These fenced usernames are not routed (empty: every one is).
    Unrouted(Vec<String>),
}

impl Routing {
    /// How `applied` routes `fence`'s usernames, `routed` saying whether one is
    /// (`crate::admission::registration::routing::routes_in`, or a memo of it).
    pub fn of(fence: &Fence, applied: Option<&ValidatingWebhookConfiguration>, mut routed: impl FnMut(&str) -> bool) -> Routing {
        match applied {
            None => Routing::NoConfiguration,
            Some(_) => Routing::Unrouted(fence.usernames().filter(|u| !routed(u)).collect()),
        }
    }
}

/// What the controller found for one FencedController.
#[derive(Clone, Debug)]
pub struct Facts<'a> {
    pub lease: LeaseFact<'a>,
    pub holder_pod: PodFact<'a>,
    pub routing: Routing,
    /// The writers configuration's name (for messages).
    pub configuration: &'a str,
    pub identity: &'a IdentityRule,
}

/// The Pod a holder identity names under `rule`: the whole identity, or the part before the
/// separator; `None` when that is no Pod name (a lowercase DNS subdomain name).
pub fn holder_pod<'i>(rule: &IdentityRule, identity: &'i str) -> Option<&'i str> {
    let pod = match rule.separator() {
        Some(separator) => identity.split_once(separator).map_or(identity, |(pod, _)| pod),
        None => identity,
    };
    let label = |l: &str| {
        !l.is_empty()
            && l.len() <= 63
            && l.bytes().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == b'-')
            && !l.starts_with('-')
            && !l.ends_with('-')
    };
    (pod.len() <= 253 && pod.split('.').all(label) && rule.holds(identity, pod)).then_some(pod)
}

/// The `Ready` condition of `status`, if any.
pub fn ready_condition(status: Option<&FencedControllerStatus>) -> Option<&Condition> {
    status?.conditions.iter().find(|c| c.type_ == READY)
}

/// The status `fenced` should have, given `fence` (`Fence::of(fenced)`) and `facts`, at `now`.
pub fn desired(fenced: &FencedController, fence: &Result<Fence, FenceError>, facts: &Facts<'_>, now: Timestamp) -> FencedControllerStatus {
    let generation = fenced.metadata.generation;
    let (holder, (ready, reason, message)) = match fence {
        Err(err) => (
            None,
            (
                false,
                ready::INVALID_SPEC,
                format!("{err}: the writer webhook does not route this fence, so nothing is judged; fix the spec"),
            ),
        ),
        Ok(fence) => {
            let holder = facts
                .lease
                .holder()
                .and_then(|h| holder_pod(facts.identity, h))
                .filter(|_| matches!(facts.holder_pod, PodFact::Found { .. }));
            (holder.map(str::to_string), judge(fence, facts))
        }
    };
    let before = ready_condition(fenced.status.as_ref());
    let status = if ready { "True" } else { "False" };
    let last_transition_time = match before {
        Some(c) if c.status == status && c.reason == reason => c.last_transition_time.clone(),
        // Whole seconds: what the API server stores, so the next look finds it unchanged.
        _ => Time(Timestamp::from_second(now.as_second()).unwrap_or(now)),
    };
    let condition = Condition {
        type_: READY.to_string(),
        status: status.to_string(),
        reason: reason.to_string(),
        message,
        observed_generation: generation,
        last_transition_time,
    };
    // Other conditions (none are written today) are kept as they are.
    let mut conditions: Vec<Condition> =
        fenced.status.as_ref().map(|s| s.conditions.iter().filter(|c| c.type_ != READY).cloned().collect()).unwrap_or_default();
    conditions.insert(0, condition);
    FencedControllerStatus { observed_generation: generation, holder, conditions }
}

/// Ready or not, the reason and the message, for a valid fence.
fn judge(fence: &Fence, facts: &Facts<'_>) -> (bool, &'static str, String) {
    let lease = format!("Lease {}/{}", fence.namespace, fence.lease);
    let accounts = fence.accounts.iter().cloned().collect::<Vec<_>>().join(", ");
    let (effect, ready_reason) = match fence.mode {
        Mode::Enforce => ("refused (409 NotHolder)", ready::ENFORCING),
        Mode::Audit => ("admitted with a warning and a WouldRefuse Event (spec.mode Enforce refuses them)", ready::AUDITING),
    };
    if facts.lease == LeaseFact::NotFound {
        return (
            false,
            ready::LEASE_NOT_FOUND,
            format!(
                "{lease} does not exist: no Pod holds it, so every judged write of ServiceAccount(s) {accounts} is {effect}; the controller creates it when it first campaigns — check that spec.lease names its leader-election Lease"
            ),
        );
    }
    match &facts.routing {
        Routing::NoConfiguration => {
            return (
                false,
                ready::NOT_ROUTED,
                format!(
                    "ValidatingWebhookConfiguration {} does not exist (yet): the API server sends kube-fence no write of ServiceAccount(s) {accounts}, so none is judged; kube-fence applies it within seconds — if this stays, read kube-fence's logs",
                    facts.configuration
                ),
            );
        }
        Routing::Unrouted(missing) if !missing.is_empty() => {
            return (
                false,
                ready::NOT_ROUTED,
                format!(
                    "the writer webhook (ValidatingWebhookConfiguration {}) does not route {} yet: their writes are not judged; kube-fence routes a new fence within seconds — if this stays, read kube-fence's logs (older fences may fill the webhook's match condition, or this namespace is outside --only-namespace)",
                    facts.configuration,
                    missing.join(", ")
                ),
            );
        }
        Routing::Unrouted(_) => {}
    }
    let Some(identity) = facts.lease.holder() else {
        return (
            true,
            ready_reason,
            format!(
                "{lease} has no holder now: until a Pod of ServiceAccount(s) {accounts} acquires it, every judged write of them is {effect}"
            ),
        );
    };
    let Some(pod) = holder_pod(facts.identity, identity) else {
        return (
            false,
            ready::HOLDER_NOT_FENCED,
            format!(
                "{lease} is held by {identity:?}, which names no Pod under the identity rule (a Pod name, then {}): every judged write of ServiceAccount(s) {accounts} is {effect}; make the controller's leader-election identity its Pod name (client-go: <hostname>_<uuid>), or set kube-fence's --leader-identity-separator to its separator",
                facts.identity.separator().map_or_else(|| "nothing".to_string(), |s| format!("{s:?} and anything")),
            ),
        );
    };
    match facts.holder_pod {
        PodFact::NotFound => (
            false,
            ready::HOLDER_NOT_FENCED,
            format!(
                "{lease} is held by {identity:?}, which names Pod {pod}, but no Pod {pod} exists in namespace {ns}: every judged write of ServiceAccount(s) {accounts} is {effect}; a holder that is not a Pod of this namespace (another namespace, a process outside the cluster, a renamed identity) cannot be fenced",
                ns = fence.namespace
            ),
        ),
        PodFact::Found { service_account, .. } if !fence.accounts.contains(service_account) => (
            false,
            ready::HOLDER_NOT_FENCED,
            format!(
                "{lease} is held by Pod {pod}, which runs as ServiceAccount {service_account}, not one of spec.serviceAccounts ({accounts}): no fenced Pod holds the Lease, so every judged write of them is {effect}; add {service_account} to spec.serviceAccounts, or check spec.lease"
            ),
        ),
        PodFact::Found { host_network: true, .. } => (
            false,
            ready::HOST_NETWORK,
            format!(
                "{lease} is held by Pod {pod}, which runs with spec.hostNetwork: its hostname is its node's, so client-go's default identity (<hostname>_<uuid>) names the node, not the Pod, and replicas on one node look alike; run the controller without hostNetwork, or make its leader-election identity its Pod name (POD_NAME from the downward API)"
            ),
        ),
        PodFact::Found { service_account, .. } => (
            true,
            ready_reason,
            format!(
                "Pod {pod} (ServiceAccount {service_account}) holds {lease}: writes of ServiceAccount(s) {accounts} from any other Pod are {effect}"
            ),
        ),
    }
}

/// A change of Ready's status or reason, as an Event reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transition {
    /// Ready is True now (a Normal Event; else Warning).
    pub ready: bool,
    /// The new reason (one of [`kube_fence_api::ready`]).
    pub reason: &'static str,
    pub note: String,
}

/// The transition from `before` to `after`, if Ready's status or reason changed (a first Ready
/// condition is one).
pub fn transition(before: Option<&FencedControllerStatus>, after: &FencedControllerStatus) -> Option<Transition> {
    let now = ready_condition(Some(after))?;
    let was = ready_condition(before);
    if was.is_some_and(|w| w.status == now.status && w.reason == now.reason) {
        return None;
    }
    let reason = [
        ready::ENFORCING,
        ready::AUDITING,
        ready::LEASE_NOT_FOUND,
        ready::HOLDER_NOT_FENCED,
        ready::HOST_NETWORK,
        ready::NOT_ROUTED,
        ready::INVALID_SPEC,
    ]
    .into_iter()
    .find(|r| *r == now.reason)?;
    Some(Transition { ready: now.status == "True", reason, note: now.message.clone() })
}

#[cfg(test)]
mod tests;
