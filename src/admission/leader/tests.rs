//! The leader-election guard, row by row: who holds the Lease, who asks, which write.

use rstest::rstest;

use super::*;

const NS: &str = "team";
const GC: &str = "system:serviceaccount:kube-system:generic-garbage-collector";

fn bound(lease: &str) -> Option<ObjectFacts> {
    Some(ObjectFacts { leader_lease: Some(lease.into()), ..ObjectFacts::default() })
}

fn plain() -> Option<ObjectFacts> {
    Some(ObjectFacts::default())
}

fn by_pod(operation: Operation, old: Option<ObjectFacts>, new: Option<ObjectFacts>, pod: Option<&str>) -> Request {
    Request { pod: pod.map(str::to_string), ..Request::new(operation, NS, old, new, "system:serviceaccount:team:ctl") }
}

/// Judges as the server does: the plan, then the quorum read it asks for, from a Lease whose
/// holderIdentity is `holder` (`None`: no such Lease).
fn judge(req: &Request, holder: Option<&str>) -> Verdict {
    match plan(req, &Exemptions::default()) {
        LeaderPlan::Done(verdict) => verdict,
        LeaderPlan::Quorum(read) => read.judge(HolderQuorum(holder.map(str::to_string))),
    }
}

fn outcome(verdict: &Verdict) -> Result<Reason, (u16, Reason)> {
    match verdict {
        Verdict::Deny { code, reason, .. } => Err((*code, *reason)),
        other => Ok(other.reason()),
    }
}

#[rstest]
#[case::exact("web-0", "web-0", true)]
#[case::client_go_identity("web-0_4f1c2a", "web-0", true)]
#[case::another_pod("web-1_4f1c2a", "web-0", false)]
#[case::a_longer_name("web-10_4f1c2a", "web-1", false)]
#[case::a_prefix_without_underscore("web-0x", "web-0", false)]
#[case::empty_holder("", "web-0", false)]
#[case::empty_pod("_x", "", false)]
fn the_holder_is_the_pod_or_the_pod_and_an_underscore(#[case] holder: &str, #[case] pod: &str, #[case] expected: bool) {
    assert_eq!(holds(holder, pod), expected);
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
    let deleting = |finalizers: &[&str], content| {
        Some(ObjectFacts {
            deleting: true,
            finalizers: finalizers.iter().map(|f| f.to_string()).collect(),
            content: Some(content),
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
    let reads = |req: &Request| matches!(plan(req, &Exemptions::default()), LeaderPlan::Quorum(_));
    assert!(reads(&by_pod(Operation::Update, bound("ctl"), bound("ctl"), Some("web-0"))));
    assert!(!reads(&by_pod(Operation::Update, plain(), plain(), Some("web-0"))));
    assert!(!reads(&by_pod(Operation::Update, bound("ctl"), bound("ctl"), None)));
}
