use k8s_openapi::api::admissionregistration::v1::{ValidatingWebhookConfiguration, WebhookClientConfig};
use kube_fence_api::{FenceMode, FencedControllerSpec};
use rstest::rstest;

use super::*;
use crate::admission::registration::routing::{self, Routes};

const NOW: i64 = 1_800_000_000;

fn fenced(mode: FenceMode, accounts: &[&str]) -> FencedController {
    let mut fc = FencedController::new(
        "ctl",
        FencedControllerSpec {
            lease: "ctl-lease".into(),
            service_accounts: accounts.iter().map(|s| s.to_string()).collect(),
            exempt: vec![],
            mode,
        },
    );
    fc.metadata.namespace = Some("team".into());
    fc.metadata.generation = Some(3);
    fc
}

fn now() -> Timestamp {
    Timestamp::from_second(NOW).expect("a time")
}

/// The writers configuration routing `fences`, as the routing applies it.
fn applied(fences: &[&FencedController]) -> ValidatingWebhookConfiguration {
    let template = WebhookClientConfig { url: Some("https://127.0.0.1:1/validate".into()), ..Default::default() };
    routing::configuration("kf-writers", &template, &Routes::of(fences.iter().copied()), 5)
}

/// Facts with the Lease `lease`, the holder Pod `pod`, and the routing of `routed` fences.
fn facts<'a>(lease: LeaseFact<'a>, pod: PodFact<'a>, routing: Routing, rule: &'a IdentityRule) -> Facts<'a> {
    Facts { lease, holder_pod: pod, routing, configuration: "kf-writers", identity: rule }
}

fn routed() -> Routing {
    Routing::Unrouted(vec![])
}

const HELD: LeaseFact<'static> = LeaseFact::Found { holder: Some("p1_1234") };
const CTL_POD: PodFact<'static> = PodFact::Found { service_account: "ctl", host_network: false };

#[rstest]
#[case::enforcing(
    FenceMode::Enforce,
    HELD,
    CTL_POD,
    routed(),
    (true, ready::ENFORCING),
    Some("p1"),
    "Pod p1 (ServiceAccount ctl) holds Lease team/ctl-lease"
)]
#[case::auditing(FenceMode::Audit, HELD, CTL_POD, routed(), (true, ready::AUDITING), Some("p1"), "admitted with a warning")]
#[case::no_lease(
    FenceMode::Enforce,
    LeaseFact::NotFound,
    PodFact::NotFound,
    routed(),
    (false, ready::LEASE_NOT_FOUND),
    None,
    "Lease team/ctl-lease does not exist"
)]
#[case::no_lease_beats_not_routed(
    FenceMode::Enforce,
    LeaseFact::NotFound,
    CTL_POD,
    Routing::NoConfiguration,
    (false, ready::LEASE_NOT_FOUND),
    None,
    "does not exist"
)]
#[case::no_configuration(
    FenceMode::Enforce,
    HELD,
    CTL_POD,
    Routing::NoConfiguration,
    (false, ready::NOT_ROUTED),
    Some("p1"),
    "ValidatingWebhookConfiguration kf-writers does not exist"
)]
#[case::not_routed(FenceMode::Enforce, HELD, CTL_POD, Routing::Unrouted(vec!["system:serviceaccount:team:ctl".into()]), (false, ready::NOT_ROUTED), Some("p1"), "does not route system:serviceaccount:team:ctl")]
#[case::not_routed_beats_holder(FenceMode::Enforce, HELD, PodFact::NotFound, Routing::Unrouted(vec!["x".into()]), (false, ready::NOT_ROUTED), None, "does not route x")]
#[case::vacant(FenceMode::Enforce, LeaseFact::Found { holder: None }, PodFact::NotFound, routed(), (true, ready::ENFORCING), None, "has no holder now: until a Pod of ServiceAccount(s) ctl acquires it, every judged write of them is refused")]
#[case::vacant_empty(FenceMode::Audit, LeaseFact::Found { holder: Some("") }, PodFact::NotFound, routed(), (true, ready::AUDITING), None, "has no holder now")]
#[case::holder_pod_missing(
    FenceMode::Enforce,
    HELD,
    PodFact::NotFound,
    routed(),
    (false, ready::HOLDER_NOT_FENCED),
    None,
    "names Pod p1, but no Pod p1 exists in namespace team"
)]
#[case::holder_names_no_pod(FenceMode::Enforce, LeaseFact::Found { holder: Some("Node-7_x") }, PodFact::NotFound, routed(), (false, ready::HOLDER_NOT_FENCED), None, "names no Pod")]
#[case::holder_of_another_account(FenceMode::Enforce, HELD, PodFact::Found { service_account: "default", host_network: false }, routed(), (false, ready::HOLDER_NOT_FENCED), Some("p1"), "runs as ServiceAccount default, not one of spec.serviceAccounts (ctl)")]
#[case::not_fenced_beats_host_network(FenceMode::Enforce, HELD, PodFact::Found { service_account: "default", host_network: true }, routed(), (false, ready::HOLDER_NOT_FENCED), Some("p1"), "ServiceAccount default")]
#[case::host_network(FenceMode::Enforce, HELD, PodFact::Found { service_account: "ctl", host_network: true }, routed(), (false, ready::HOST_NETWORK), Some("p1"), "spec.hostNetwork")]
fn the_ready_condition_says_what_was_found(
    #[case] mode: FenceMode,
    #[case] lease: LeaseFact<'static>,
    #[case] pod: PodFact<'static>,
    #[case] routing: Routing,
    #[case] expect: (bool, &str),
    #[case] holder: Option<&str>,
    #[case] says: &str,
) {
    let (ready, reason) = expect;
    let fc = fenced(mode, &["ctl"]);
    let rule = IdentityRule::default();
    let status = desired(&fc, &Fence::of(&fc), &facts(lease, pod, routing, &rule), now());
    let condition = ready_condition(Some(&status)).expect("a Ready condition");
    assert_eq!(
        (condition.status.as_str(), condition.reason.as_str()),
        (if ready { "True" } else { "False" }, reason),
        "{}",
        condition.message
    );
    assert!(condition.message.contains(says), "{says:?} not in {:?}", condition.message);
    assert_eq!(status.holder.as_deref(), holder);
    assert_eq!((status.observed_generation, condition.observed_generation), (Some(3), Some(3)));
    assert_eq!(condition.last_transition_time, Time(now()));
}

#[test]
fn an_invalid_spec_comes_first_and_says_what_is_wrong() {
    let fc = fenced(FenceMode::Enforce, &["Not_An_Account"]);
    let rule = IdentityRule::default();
    let status = desired(&fc, &Fence::of(&fc), &facts(LeaseFact::NotFound, PodFact::NotFound, Routing::NoConfiguration, &rule), now());
    let condition = ready_condition(Some(&status)).expect("Ready");
    assert_eq!((condition.status.as_str(), condition.reason.as_str()), ("False", ready::INVALID_SPEC));
    assert!(condition.message.contains("\"Not_An_Account\"") && condition.message.contains("fix the spec"), "{}", condition.message);
    assert_eq!(status.holder, None);
}

#[test]
fn routing_is_read_from_the_applied_configuration() {
    let fc = fenced(FenceMode::Enforce, &["ctl", "helper"]);
    let fence = Fence::of(&fc).expect("a fence");
    let config = applied(&[&fc]);
    let routes = |u: &str| routing::routes_in(&config, u);
    assert_eq!(Routing::of(&fence, Some(&config), routes), Routing::Unrouted(vec![]));
    assert_eq!(Routing::of(&fence, None, routes), Routing::NoConfiguration);
    // A configuration that routes another fence only.
    let mut other = fenced(FenceMode::Enforce, &["ctl"]);
    other.metadata.namespace = Some("elsewhere".into());
    let config = applied(&[&other]);
    assert_eq!(
        Routing::of(&fence, Some(&config), |u| routing::routes_in(&config, u)),
        Routing::Unrouted(vec!["system:serviceaccount:team:ctl".into(), "system:serviceaccount:team:helper".into()])
    );
    // Nothing routed: a configuration with no webhooks.
    let empty = applied(&[]);
    assert_eq!(
        Routing::of(&fence, Some(&empty), |u| routing::routes_in(&empty, u)),
        Routing::Unrouted(vec!["system:serviceaccount:team:ctl".into(), "system:serviceaccount:team:helper".into()])
    );
}

#[rstest]
#[case::client_go(IdentityRule::default(), "p1_0b7a", Some("p1"))]
#[case::bare_name(IdentityRule::default(), "p1", Some("p1"))]
#[case::dotted(IdentityRule::default(), "web.v2-0_x", Some("web.v2-0"))]
#[case::exact(IdentityRule::Exact, "p1", Some("p1"))]
#[case::exact_with_suffix(IdentityRule::Exact, "p1_0b7a", None)]
#[case::other_separator(IdentityRule::Separated(":".into()), "p1:9", Some("p1"))]
#[case::other_separator_default_form(IdentityRule::Separated(":".into()), "p1_9", None)]
#[case::uppercase(IdentityRule::default(), "Node-1_x", None)]
#[case::empty(IdentityRule::default(), "", None)]
#[case::empty_pod(IdentityRule::default(), "_x", None)]
#[case::slash(IdentityRule::default(), "a/b_x", None)]
fn a_holder_identity_names_a_pod(#[case] rule: IdentityRule, #[case] identity: &str, #[case] pod: Option<&str>) {
    assert_eq!(holder_pod(&rule, identity), pod);
}

#[test]
fn the_transition_time_is_kept_while_status_and_reason_are_and_a_change_is_one_transition() {
    let rule = IdentityRule::default();
    let mut fc = fenced(FenceMode::Audit, &["ctl"]);
    let first = desired(&fc, &Fence::of(&fc), &facts(HELD, CTL_POD, routed(), &rule), now());
    let t = transition(fc.status.as_ref(), &first).expect("a first Ready is a transition");
    assert_eq!((t.ready, t.reason), (true, ready::AUDITING));
    fc.status = Some(first.clone());

    // Later, the same facts: the same status, no transition.
    let later = Timestamp::from_second(NOW + 60).expect("a time");
    let again = desired(&fc, &Fence::of(&fc), &facts(HELD, CTL_POD, routed(), &rule), later);
    assert_eq!(again, first);
    assert_eq!(transition(fc.status.as_ref(), &again), None);

    // Another holder (same status and reason): the message changes, the transition time does not.
    let other = desired(&fc, &Fence::of(&fc), &facts(LeaseFact::Found { holder: Some("p2_1") }, CTL_POD, routed(), &rule), later);
    assert_eq!(other.holder.as_deref(), Some("p2"));
    assert_eq!(ready_condition(Some(&other)).map(|c| c.last_transition_time.clone()), Some(Time(now())));
    assert_eq!(transition(fc.status.as_ref(), &other), None);

    // Audit → Enforce: a new generation, a new reason, a transition at the later time.
    fc.spec.mode = FenceMode::Enforce;
    fc.metadata.generation = Some(4);
    let enforced = desired(&fc, &Fence::of(&fc), &facts(HELD, CTL_POD, routed(), &rule), later);
    let condition = ready_condition(Some(&enforced)).expect("Ready");
    assert_eq!((enforced.observed_generation, condition.reason.as_str()), (Some(4), ready::ENFORCING));
    assert_eq!(condition.last_transition_time, Time(later));
    assert_eq!(transition(fc.status.as_ref(), &enforced).map(|t| (t.ready, t.reason)), Some((true, ready::ENFORCING)));
    fc.status = Some(enforced);

    // The holder goes away: Ready=False, a Warning transition.
    let gone = desired(&fc, &Fence::of(&fc), &facts(HELD, PodFact::NotFound, routed(), &rule), later);
    let t = transition(fc.status.as_ref(), &gone).expect("a transition");
    assert_eq!((t.ready, t.reason), (false, ready::HOLDER_NOT_FENCED));
    assert!(t.note.contains("no Pod p1 exists"), "{}", t.note);
}

#[test]
fn the_transition_time_is_whole_seconds() {
    let fc = fenced(FenceMode::Enforce, &["ctl"]);
    let rule = IdentityRule::default();
    let at = Timestamp::new(NOW, 123_456_789).expect("a time");
    let status = desired(&fc, &Fence::of(&fc), &facts(HELD, CTL_POD, routed(), &rule), at);
    assert_eq!(ready_condition(Some(&status)).map(|c| c.last_transition_time.clone()), Some(Time(now())));
}
