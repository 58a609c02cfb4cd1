//! The leader-election guard, row by row: who holds the Lease, who asks, which write.

use futures::FutureExt;
use k8s_openapi::api::coordination::v1::{Lease as LeaderElectionLease, LeaseSpec};
use rstest::rstest;

use super::*;
use crate::admission::judge::exemptions::Exemptions;
use crate::admission::judge::facts::PodIdentity;
use crate::admission::judge::fake::{FakeLeases, ReadCounts};
use crate::admission::judge::identity::IdentityRuleError;
use crate::admission::judge::pipeline::{self, Judging, Sent};

const NS: &str = "team";
const GC: &str = "system:serviceaccount:kube-system:generic-garbage-collector";

fn bound(lease: &str) -> Option<ObjectFacts> {
    Some(ObjectFacts { leader_lease: Some(lease.into()), ..ObjectFacts::default() })
}

fn plain() -> Option<ObjectFacts> {
    Some(ObjectFacts::default())
}

fn by_pod(operation: Operation, old: Option<ObjectFacts>, new: Option<ObjectFacts>, pod: Option<&str>) -> Request {
    let user = "system:serviceaccount:team:ctl";
    Request { pod: PodIdentity::of(user, pod), ..Request::new(operation, NS, old, new, user) }
}

/// The same request by Pod `pod` of ServiceAccount `ctl` in namespace `namespace`.
fn by_pod_of(namespace: &str, operation: Operation, old: Option<ObjectFacts>, new: Option<ObjectFacts>, pod: &str) -> Request {
    let user = format!("system:serviceaccount:{namespace}:ctl");
    Request { pod: PodIdentity::of(&user, Some(pod)), ..Request::new(operation, NS, old, new, &user) }
}

/// Threat: a worker with ordinary RBAC in the Lease's namespace, whose Pod runs in another
/// namespace under the same name as the holder: it is not the holder.
#[test]
fn a_pod_of_another_namespace_is_not_the_holder() {
    let req = by_pod_of("other", Operation::Update, bound("ctl-lease"), bound("ctl-lease"), "web-0");
    let v = judge(&req, Some("web-0_1234"));
    assert!(matches!(v, Verdict::Deny { code: 403, reason: Reason::NotHolder, .. }), "{v:?}");
    let Verdict::Deny { message, facts, .. } = v else { unreachable!() };
    assert!(message.contains("Pod other/web-0 is not in the Lease's namespace team"), "{message}");
    assert_eq!(facts.requester.as_deref(), Some("other/web-0"));
    // The same Pod name in the Lease's own namespace is the holder.
    let same = by_pod_of(NS, Operation::Update, bound("ctl-lease"), bound("ctl-lease"), "web-0");
    assert_eq!(judge(&same, Some("web-0_1234")).reason(), Reason::Fenced);
}

/// Judges as the server does: the plan, then the quorum read it asks for, from a Lease whose
/// holderIdentity is `holder` (`None`: no such Lease), under the default identity rule.
fn judge(req: &Request, holder: Option<&str>) -> Verdict {
    judge_by(&IdentityRule::default(), req, holder)
}

fn judge_by(identity: &IdentityRule, req: &Request, holder: Option<&str>) -> Verdict {
    judged(&Judging { identity: identity.clone(), ..Judging::default() }, req, holder).0
}

/// Judges through the pipeline, with the leader-election Lease the request names held by
/// `holder` (`None`: no such Lease) in the fake; also the reads it made.
fn judged(judging: &Judging, req: &Request, holder: Option<&str>) -> (Verdict, ReadCounts) {
    let mut leases = FakeLeases::default();
    for name in [&req.old, &req.new].into_iter().flatten().filter_map(|side| side.leader_lease.as_deref()) {
        if let Some(holder) = holder {
            let spec = LeaseSpec { holder_identity: Some(holder.to_string()), ..LeaseSpec::default() };
            leases = leases.with_leader_lease(&req.namespace, name, LeaderElectionLease { spec: Some(spec), ..Default::default() });
        }
    }
    let verdict = pipeline::judge(req, judging, Sent::Objects, &leases).now_or_never().expect("the fake answers at once");
    (verdict, leases.reads())
}

fn rule(value: &str) -> IdentityRule {
    value.parse().unwrap_or_else(|e| panic!("{value:?}: {e}"))
}

fn outcome(verdict: &Verdict) -> Result<Reason, (u16, Reason)> {
    match verdict {
        Verdict::Deny { code, reason, .. } => Err((*code, *reason)),
        other => Ok(other.reason()),
    }
}

// Which identity names which Pod, by rule. A wrong `true` lets another Pod write (worker with
// ordinary RBAC, and a stale-but-honest writer whose successor's identity it matches); a wrong
// `false` fences the real leader out.
#[rstest]
// The default: client-go's `<hostname>_<uuid>`.
#[case::exact("_", "web-0", "web-0", true)]
#[case::client_go_identity("_", "web-0_4f1c2a", "web-0", true)]
#[case::another_pod("_", "web-1_4f1c2a", "web-0", false)]
#[case::a_longer_name("_", "web-10_4f1c2a", "web-1", false)]
#[case::a_prefix_without_underscore("_", "web-0x", "web-0", false)]
#[case::another_separator("_", "web-0:4f1c2a", "web-0", false)]
#[case::empty_holder("_", "", "web-0", false)]
#[case::empty_pod("_", "_x", "", false)]
// The Pod's name exactly.
#[case::exact_only("none", "web-0", "web-0", true)]
#[case::exact_only_refuses_a_suffix("none", "web-0_4f1c2a", "web-0", false)]
#[case::exact_only_another_pod("none", "web-1", "web-0", false)]
#[case::exact_only_empty_pod("none", "", "", false)]
// Another separator, of one or more characters.
#[case::colon("::", "web-0::4f1c2a", "web-0", true)]
#[case::colon_is_not_underscore("::", "web-0_4f1c2a", "web-0", false)]
#[case::colon_half_a_separator("::", "web-0:4f1c2a", "web-0", false)]
#[case::colon_a_longer_name("::", "web-10::4f1c2a", "web-1", false)]
#[case::at_exact("@", "web-0", "web-0", true)]
#[case::uppercase("X", "web-0X1", "web-0", true)]
fn the_holder_names_the_pod_by_the_rule(#[case] separator: &str, #[case] holder: &str, #[case] pod: &str, #[case] expected: bool) {
    assert_eq!(rule(separator).holds(holder, pod), expected);
}

#[rstest]
#[case::default("_", IdentityRule::Separated("_".into()))]
#[case::exact("none", IdentityRule::Exact)]
#[case::longer(":uid=", IdentityRule::Separated(":uid=".into()))]
#[case::uppercase_first("ID", IdentityRule::Separated("ID".into()))]
fn a_separator_parses_into_a_rule_and_prints_as_it_was_given(#[case] value: &str, #[case] expected: IdentityRule) {
    assert_eq!(rule(value), expected);
    assert_eq!(rule(value).to_string(), value);
}

/// A separator that could continue a Pod name makes one identity name two Pods (`-`: Pod `web`
/// would hold what Pod `web-1` holds): refused, as is what cannot be written into CEL as it is.
#[rstest]
#[case::empty("", IdentityRuleError::Empty)]
#[case::dash("-", IdentityRuleError::StartsLikePodName("-".into(), '-'))]
#[case::dot(".", IdentityRuleError::StartsLikePodName(".".into(), '.'))]
#[case::letter("x_", IdentityRuleError::StartsLikePodName("x_".into(), 'x'))]
#[case::digit("0", IdentityRuleError::StartsLikePodName("0".into(), '0'))]
#[case::none_with_more("none_", IdentityRuleError::StartsLikePodName("none_".into(), 'n'))]
#[case::quote("_'", IdentityRuleError::Unsupported("_'".into(), '\''))]
#[case::backslash("\\", IdentityRuleError::Unsupported("\\".into(), '\\'))]
#[case::space(" ", IdentityRuleError::Unsupported(" ".into(), ' '))]
#[case::not_ascii("·", IdentityRuleError::Unsupported("·".into(), '·'))]
fn a_separator_that_is_ambiguous_or_unquotable_is_refused(#[case] value: &str, #[case] expected: IdentityRuleError) {
    assert_eq!(value.parse::<IdentityRule>(), Err(expected));
}

#[test]
fn the_refusal_names_the_problem() {
    let err = "-".parse::<IdentityRule>().err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("a Pod name can contain") && err.contains("`p1-…`"), "{err}");
    let err = "".parse::<IdentityRule>().err().map(|e| e.to_string()).unwrap_or_default();
    assert!(err.contains("`none`"), "{err}");
}

#[rstest]
// The holder writes: main resource and status, create, update, delete.
#[case::holder_creates(Operation::Create, None, bound("ctl"), None, Some("web-0"), Some("web-0_a"), Ok(Reason::Fenced))]
#[case::holder_updates(Operation::Update, bound("ctl"), bound("ctl"), None, Some("web-0"), Some("web-0_a"), Ok(Reason::Fenced))]
#[case::holder_writes_status(
    Operation::Update,
    bound("ctl"),
    bound("ctl"),
    Some("status"),
    Some("web-0"),
    Some("web-0_a"),
    Ok(Reason::Fenced)
)]
#[case::holder_deletes(Operation::Delete, bound("ctl"), None, None, Some("web-0"), Some("web-0_a"), Ok(Reason::Fenced))]
// The leader that lost its Lease (stale-but-honest writer): every write is 409.
#[case::ex_holder_updates(Operation::Update, bound("ctl"), bound("ctl"), None, Some("web-0"), Some("web-1_b"), Err((409, Reason::NotHolder)))]
#[case::ex_holder_writes_status(Operation::Update, bound("ctl"), bound("ctl"), Some("status"), Some("web-0"), Some("web-1_b"), Err((409, Reason::NotHolder)))]
#[case::ex_holder_deletes(Operation::Delete, bound("ctl"), None, None, Some("web-0"), Some("web-1_b"), Err((409, Reason::NotHolder)))]
#[case::ex_holder_creates(Operation::Create, None, bound("ctl"), None, Some("web-0"), Some("web-1_b"), Err((409, Reason::NotHolder)))]
#[case::released(Operation::Update, bound("ctl"), bound("ctl"), None, Some("web-0"), Some(""), Err((409, Reason::NotHolder)))]
#[case::no_such_lease(Operation::Update, bound("ctl"), bound("ctl"), None, Some("web-0"), None, Err((403, Reason::LeaseNotFound)))]
// Another Pod with the same RBAC (worker with ordinary RBAC): guarding, unguarding and
// rebinding are writes like any other.
#[case::unguarding_by_another(Operation::Update, bound("ctl"), plain(), None, Some("web-9"), Some("web-0_a"), Err((409, Reason::NotHolder)))]
#[case::unguarding_by_the_holder(Operation::Update, bound("ctl"), plain(), None, Some("web-0"), Some("web-0_a"), Ok(Reason::Fenced))]
#[case::guarding_by_another(Operation::Update, plain(), bound("ctl"), None, Some("web-9"), Some("web-0_a"), Err((409, Reason::NotHolder)))]
#[case::rebinding(Operation::Update, bound("ctl"), bound("other"), None, Some("web-0"), Some("web-0_a"), Err((403, Reason::LeaseRebound)))]
#[case::label_not_a_name(Operation::Update, bound("Not_A_Name"), bound("Not_A_Name"), None, Some("web-0"), Some("web-0_a"), Err((400, Reason::LeaseLabelInvalid)))]
// Not a Pod (no Pod-bound token): nobody holds a leader-election Lease as a username.
#[case::no_pod_identity(Operation::Update, bound("ctl"), bound("ctl"), None, None, Some("web-0_a"), Err((403, Reason::NotHolder)))]
// Not guarded, and what is never judged.
#[case::unguarded(Operation::Update, plain(), plain(), None, Some("web-9"), Some("web-0_a"), Ok(Reason::Unguarded))]
#[case::eviction(Operation::Create, None, bound("ctl"), Some("eviction"), Some("web-9"), Some("web-0_a"), Ok(Reason::Unguarded))]
#[case::malformed(Operation::Update, bound("ctl"), None, None, Some("web-0"), Some("web-0_a"), Err((400, Reason::MalformedRequest)))]
fn only_the_holder_writes(
    #[case] operation: Operation,
    #[case] old: Option<ObjectFacts>,
    #[case] new: Option<ObjectFacts>,
    #[case] subresource: Option<&str>,
    #[case] pod: Option<&str>,
    #[case] holder: Option<&str>,
    #[case] expected: Result<Reason, (u16, Reason)>,
) {
    let req = Request { subresource: subresource.map(str::to_string), ..by_pod(operation, old, new, pod) };
    assert_eq!(outcome(&judge(&req, holder)), expected);
}

#[test]
fn a_denial_names_the_lease_the_holder_and_the_requester() {
    let req = by_pod(Operation::Update, bound("ctl"), bound("ctl"), Some("web-0"));
    let Verdict::Deny { message, facts, .. } = judge(&req, Some("web-1_b")) else { panic!("denied") };
    assert_eq!(facts.lease.as_deref(), Some("team/ctl"));
    assert_eq!(facts.holder.as_deref(), Some("web-1_b"));
    assert_eq!(facts.requester.as_deref(), Some("web-0"));
    for part in ["team/ctl", "web-1_b", "web-0"] {
        assert!(message.contains(part), "{part} in {message}");
    }
}

#[test]
fn exempt_identities_and_finalizer_removal_need_no_holder() {
    let gc = Request { user: GC.into(), ..by_pod(Operation::Delete, bound("ctl"), None, None) };
    assert_eq!(outcome(&judge(&gc, Some("web-0_a"))), Ok(Reason::Exempt));
    let deleting = |finalizers: &[&str], content: u64| {
        Some(ObjectFacts {
            deleting: true,
            finalizers: finalizers.iter().map(|f| f.to_string()).collect(),
            content: Some(crate::admission::judge::facts::Digest::from(content)),
            ..bound("ctl").unwrap_or_default()
        })
    };
    let removal = by_pod(Operation::Update, deleting(&["a", "b"], 1), deleting(&["b"], 1), Some("web-9"));
    assert_eq!(outcome(&judge(&removal, Some("web-0_a"))), Ok(Reason::FinalizersRemoved));
    // Removing a finalizer and changing anything else is a write like any other.
    let and_more = by_pod(Operation::Update, deleting(&["a", "b"], 1), deleting(&["b"], 2), Some("web-9"));
    assert_eq!(outcome(&judge(&and_more, Some("web-0_a"))), Err((409, Reason::NotHolder)));
}

#[test]
fn only_the_request_that_needs_the_holder_reads_it() {
    let reads = |req: &Request| judged(&Judging::default(), req, Some("web-0_a")).1.holder == 1;
    assert!(reads(&by_pod(Operation::Update, bound("ctl"), bound("ctl"), Some("web-0"))));
    assert!(!reads(&by_pod(Operation::Update, plain(), plain(), Some("web-0"))));
    assert!(!reads(&by_pod(Operation::Update, bound("ctl"), bound("ctl"), None)));
}

/// Stale-but-honest writer and worker with ordinary RBAC, under a configured rule: the webhook
/// judges by the rule it was given, not by the default.
#[test]
fn the_webhook_judges_by_the_configured_rule() {
    let req = by_pod(Operation::Update, bound("ctl"), bound("ctl"), Some("web-0"));
    assert_eq!(outcome(&judge_by(&rule(":"), &req, Some("web-0:a"))), Ok(Reason::Fenced));
    assert_eq!(outcome(&judge_by(&rule(":"), &req, Some("web-1:a"))), Err((409, Reason::NotHolder)));
    assert_eq!(outcome(&judge_by(&rule("none"), &req, Some("web-0"))), Ok(Reason::Fenced));
    // The default form names no Pod under another rule; the denial says which rule judged.
    let Verdict::Deny { code: 409, message, .. } = judge_by(&rule("none"), &req, Some("web-0_a")) else { panic!("denied") };
    assert!(message.contains("Pod web-0 holds it only as web-0;") && message.contains("--leader-identity-separator"), "{message}");
    let Verdict::Deny { message, .. } = judge_by(&rule(":"), &req, Some("web-0_a")) else { panic!("denied") };
    assert!(message.contains("only as web-0 or web-0:<suffix>;"), "{message}");
}

/// kube-fence's admins (`--lease-admin`) opt objects in and out — create one labelled, add the
/// label, remove it — as Helm or an operator would; their other writes to a bound object, and
/// anyone else's label moves, are judged as before (worker with ordinary RBAC: not an admin).
#[rstest]
#[case::creates_labelled(Operation::Create, None, bound("ctl"), "admin", Ok(Reason::Exempt))]
#[case::adds_the_label(Operation::Update, plain(), bound("ctl"), "admin", Ok(Reason::Exempt))]
#[case::removes_the_label(Operation::Update, bound("ctl"), plain(), "admin", Ok(Reason::Exempt))]
#[case::writes_a_bound_object(Operation::Update, bound("ctl"), bound("ctl"), "admin", Err(403))]
#[case::deletes_a_bound_object(Operation::Delete, bound("ctl"), None, "admin", Err(403))]
#[case::a_worker_adds_the_label(Operation::Update, plain(), bound("ctl"), "worker", Err(403))]
fn admins_move_the_leader_label(
    #[case] operation: Operation,
    #[case] old: Option<ObjectFacts>,
    #[case] new: Option<ObjectFacts>,
    #[case] user: &str,
    #[case] expect: Result<Reason, u16>,
) {
    let exempt = Exemptions::default().with_label_admins(["admin"]);
    let req = Request::new(operation, NS, old, new, user);
    let (verdict, reads) = judged(&Judging { exempt, ..Judging::default() }, &req, Some("web-0_a"));
    assert_eq!(reads, ReadCounts::default(), "{user} is no Pod: judged without a read");
    match (expect, &verdict) {
        (Ok(reason), _) => assert_eq!(verdict.reason(), reason, "{verdict:?}"),
        (Err(code), Verdict::Deny { code: c, reason, .. }) => assert_eq!((*c, *reason), (code, Reason::NotHolder), "{verdict:?}"),
        (Err(_), _) => panic!("expected a denial: {verdict:?}"),
    }
}
