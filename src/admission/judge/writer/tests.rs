//! The writer fence, row by row: who may write, and what passes.

use futures::FutureExt;
use rstest::rstest;

use super::*;
use crate::admission::judge::facts::{GroupResource, Operation, PodIdentity};
use crate::admission::judge::fake::{self, FakeLeases};
use crate::admission::judge::fence::Mode;
use crate::admission::judge::pipeline::{self, Judging, Sent};
use crate::admission::judge::verdict::Held;

const NS: &str = "team";
const CTL: &str = "system:serviceaccount:team:ctl";

fn by(user: &str, pod: Option<&str>) -> Request {
    Request { pod: PodIdentity::of(user, pod), ..Request::new(Operation::Update, "anywhere", None, None, user) }
}

/// A write of `group`/`resource` `namespace/name` by Pod `pod` of ServiceAccount `ctl`.
fn writing(group: &str, resource: &str, namespace: &str, name: &str, pod: &str) -> Request {
    Request {
        resource: GroupResource { group: group.into(), resource: resource.into() },
        name: name.into(),
        pod: PodIdentity::of(CTL, Some(pod)),
        ..Request::new(Operation::Update, namespace, None, None, CTL)
    }
}

/// Judges through the pipeline as the writer webhook, with FencedController `team/ctl` (Lease
/// `ctl`, ServiceAccount `ctl`, exempting configmaps, in `mode`) and Lease `team/ctl` held by
/// `holder` (`None`: no such Lease).
fn judge_in(mode: Mode, req: &Request, holder: Option<&str>) -> Verdict {
    let leases = FakeLeases::default().with_fence(fake::fence(NS, "ctl", &["ctl"], &["configmaps"], mode));
    let leases = match holder {
        Some(holder) => leases.with_leader_lease(NS, "ctl", fake::leader_lease(NS, "ctl", &[], &[], Some(holder))),
        None => leases,
    };
    pipeline::judge(req, &Judging::default(), Sent::Writer, &leases).now_or_never().expect("the fake answers at once")
}

fn judge(req: &Request, holder: Option<&str>) -> Verdict {
    judge_in(Mode::Enforce, req, holder)
}

/// Both threat cases: a stale-but-honest ex-leader replica (rows `ex_leader`, `released`), and a
/// worker with ordinary RBAC that borrows the ServiceAccount from another namespace or without a
/// Pod (rows `pod_of_another_namespace`, `not_a_pod`).
#[rstest]
#[case::leader(by(CTL, Some("ctl-0")), Some("ctl-0_1a2b"), Ok(Reason::Fenced))]
#[case::ex_leader(by(CTL, Some("ctl-1")), Some("ctl-0_1a2b"), Err((409, Reason::NotHolder)))]
#[case::released(by(CTL, Some("ctl-0")), Some(""), Err((409, Reason::NotHolder)))]
#[case::prefix_is_not_the_pod(by(CTL, Some("ctl")), Some("ctl-0_1a2b"), Err((409, Reason::NotHolder)))]
#[case::not_a_pod(by(CTL, None), Some("ctl-0_1a2b"), Err((403, Reason::NotHolder)))]
#[case::pod_of_another_namespace(by("system:serviceaccount:other:ctl", Some("ctl-0")), Some("ctl-0_1a2b"), Ok(Reason::Unguarded))]
#[case::another_account(by("system:serviceaccount:team:other", Some("ctl-0")), Some("ctl-0_1a2b"), Ok(Reason::Unguarded))]
#[case::no_lease_nobody_writes(by(CTL, Some("ctl-0")), None, Err((409, Reason::NotHolder)))]
#[case::exempt_resource(writing("", "configmaps", "anywhere", "x", "ctl-1"), Some("ctl-0_1a2b"), Ok(Reason::Exempt))]
#[case::exempt_name_other_group(writing("other.io", "configmaps", "team", "x", "ctl-1"), Some("ctl-0_1a2b"), Err((409, Reason::NotHolder)))]
#[case::own_lease(writing("coordination.k8s.io", "leases", "team", "ctl", "ctl-1"), Some("ctl-0_1a2b"), Ok(Reason::Exempt))]
#[case::another_lease(writing("coordination.k8s.io", "leases", "team", "other", "ctl-1"), Some("ctl-0_1a2b"), Err((409, Reason::NotHolder)))]
fn who_may_write(#[case] req: Request, #[case] holder: Option<&str>, #[case] expect: Result<Reason, (u16, Reason)>) {
    let v = judge(&req, holder);
    match (expect, &v) {
        (Ok(reason), _) => assert_eq!(v.reason(), reason, "{v:?}"),
        (Err((code, reason)), Verdict::Deny { code: c, reason: r, .. }) => assert_eq!((*c, *r), (code, reason), "{v:?}"),
        (Err(e), _) => panic!("expected {e:?}, got {v:?}"),
    }
}

/// What the answer tells the API server's audit log: the Lease, its holder and the version the
/// quorum read returned (docs/design.md §6b: a create committed after a takeover was judged
/// before it exactly when that version is older than the takeover).
#[test]
fn an_admission_names_the_lease_the_holder_and_the_version_read() {
    let v = judge(&by(CTL, Some("ctl-0")), Some("ctl-0_1a2b"));
    let held = Held { lease: "team/ctl".into(), holder: "ctl-0_1a2b".into(), resource_version: fake::LEADER_LEASE_VERSION.into() };
    assert_eq!(v, Verdict::AllowHeld { reason: Reason::Fenced, held });
}

#[test]
fn a_refusal_names_the_lease_the_fence_the_holder_and_the_requester() {
    let v = judge(&by(CTL, Some("ctl-1")), Some("ctl-0_1a2b"));
    let Verdict::Deny { message, facts, .. } = v else { panic!("expected a denial: {v:?}") };
    assert_eq!(facts.lease.as_deref(), Some("team/ctl"));
    assert_eq!(facts.holder.as_deref(), Some("ctl-0_1a2b"));
    assert_eq!(facts.requester.as_deref(), Some("ctl-1"));
    assert!(
        message.contains("is held by ctl-0_1a2b") && message.contains("Pod ctl-1") && message.contains("FencedController ctl"),
        "{message}"
    );
    let v = judge(&by(CTL, Some("ctl-1")), None);
    assert!(matches!(&v, Verdict::Deny { message, .. } if message.contains("which does not exist")), "{v:?}");
}

/// Audit mode is the FencedController's own: the follower's write is admitted with a warning
/// that says what Enforce would refuse; the leader's write carries no warning.
#[test]
fn an_audit_fence_warns_where_an_enforced_one_refuses() {
    let v = judge_in(Mode::Audit, &by(CTL, Some("ctl-1")), Some("ctl-0_1a2b"));
    assert!(
        matches!(&v, Verdict::AllowWithWarning { reason: Reason::NotHolder, message } if message.starts_with("kube-fence (audit mode) would deny this write: write by Pod ctl-1 denied")),
        "{v:?}"
    );
    let leader = judge_in(Mode::Audit, &by(CTL, Some("ctl-0")), Some("ctl-0_1a2b"));
    assert!(matches!(leader, Verdict::AllowHeld { reason: Reason::Fenced, .. }), "{leader:?}");
}

/// Two fences of one ServiceAccount (two admins fenced it): an Enforce fence's refusal stands
/// whatever the other says; an exemption of one fence does not exempt the write from the other.
#[test]
fn of_two_fences_either_may_refuse() {
    let leases = FakeLeases::default()
        .with_fence(fake::fence(NS, "ctl", &["ctl"], &["configmaps"], Mode::Audit))
        .with_fence(fake::fence(NS, "other", &["ctl"], &[], Mode::Enforce))
        .with_leader_lease(NS, "ctl", fake::leader_lease(NS, "ctl", &[], &[], Some("ctl-0_1")))
        .with_leader_lease(NS, "other", fake::leader_lease(NS, "other", &[], &[], Some("ctl-0_1")));
    let run = |req: &Request| pipeline::judge(req, &Judging::default(), Sent::Writer, &leases).now_or_never().expect("at once");
    let v = run(&writing("", "configmaps", "team", "x", "ctl-1"));
    assert!(matches!(&v, Verdict::Deny { code: 409, reason: Reason::NotHolder, .. }), "{v:?}");
    assert_eq!(run(&writing("", "configmaps", "team", "x", "ctl-0")).reason(), Reason::Fenced);
}

/// Of two fences, one exempting the write: whichever is judged first, the holder's write is
/// admitted naming the Lease of the fence that judged it by its holder.
#[test]
fn an_exemption_of_one_fence_keeps_the_holder_the_other_read() {
    let exempting = || fake::fence(NS, "ctl", &["ctl"], &["configmaps"], Mode::Enforce);
    let holding = || fake::fence(NS, "other", &["ctl"], &[], Mode::Enforce);
    for (first, second) in [(exempting(), holding()), (holding(), exempting())] {
        let leases = FakeLeases::default().with_fence(first).with_fence(second).with_leader_lease(
            NS,
            "other",
            fake::leader_lease(NS, "other", &[], &[], Some("ctl-0_1")),
        );
        let v = pipeline::judge(&writing("", "configmaps", "team", "x", "ctl-0"), &Judging::default(), Sent::Writer, &leases)
            .now_or_never()
            .expect("at once");
        assert!(matches!(&v, Verdict::AllowHeld { held, .. } if held.lease == "team/other" && held.holder == "ctl-0_1"), "{v:?}");
    }
}
