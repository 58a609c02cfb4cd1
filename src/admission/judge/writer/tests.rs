//! The writer fence, row by row: who may write.

use futures::FutureExt;
use rstest::rstest;

use k8s_openapi::api::coordination::v1::Lease as LeaderElectionLease;
use kube_fence_api::names::{HOLDER_IDENTITY_LABEL, HOLDER_IS_POD};

use super::*;
use crate::admission::judge::facts::{Operation, PodIdentity};
use crate::admission::judge::fake::{self, FakeLeases};
use crate::admission::judge::pipeline::{self, Judging, Sent};

const NS: &str = "team";

fn lease(labels: &[(&str, &str)], annotations: &[(&str, &str)], holder: Option<&str>) -> LeaderElectionLease {
    fake::leader_lease(NS, "ctl", labels, annotations, holder)
}

fn opted_in(writers: &str, holder: Option<&str>) -> LeaderElectionLease {
    fake::opted_in_lease(NS, "ctl", writers, holder)
}

fn by(user: &str, pod: Option<&str>) -> Request {
    Request { pod: PodIdentity::of(user, pod), ..Request::new(Operation::Update, "anywhere", None, None, user) }
}

/// Judges through the pipeline as the webhook of Lease `team/ctl`, which is `fresh` (`None`: no
/// such Lease) in the fake.
fn judge(req: &Request, fresh: Option<LeaderElectionLease>) -> Verdict {
    let leases = match fresh {
        Some(lease) => FakeLeases::default().with_leader_lease(NS, "ctl", lease),
        None => FakeLeases::default(),
    };
    let sent = Sent::Writer(LeaseRef { namespace: NS, name: "ctl" });
    pipeline::judge(req, &Judging::default(), sent, &leases).now_or_never().expect("the fake answers at once")
}

const CTL: &str = "system:serviceaccount:team:ctl";

/// Both threat cases: a stale-but-honest ex-leader replica (rows `ex_leader`, `released`), and a
/// worker with ordinary RBAC that borrows the ServiceAccount from another namespace or without a
/// Pod (rows `pod_of_another_namespace`, `not_a_pod`).
#[rstest]
#[case::leader(by(CTL, Some("ctl-0")), Some(opted_in("ctl", Some("ctl-0_1a2b"))), Ok(Reason::Fenced))]
#[case::ex_leader(by(CTL, Some("ctl-1")), Some(opted_in("ctl", Some("ctl-0_1a2b"))), Err((409, Reason::NotHolder)))]
#[case::released(by(CTL, Some("ctl-0")), Some(opted_in("ctl", Some(""))), Err((409, Reason::NotHolder)))]
#[case::never_held(by(CTL, Some("ctl-0")), Some(opted_in("ctl", None)), Err((409, Reason::NotHolder)))]
#[case::prefix_is_not_the_pod(by(CTL, Some("ctl")), Some(opted_in("ctl", Some("ctl-0_1a2b"))), Err((409, Reason::NotHolder)))]
#[case::not_a_pod(by(CTL, None), Some(opted_in("ctl", Some("ctl-0_1a2b"))), Err((403, Reason::NotHolder)))]
#[case::pod_of_another_namespace(
    by("system:serviceaccount:other:ctl", Some("ctl-0")),
    Some(opted_in("ctl", Some("ctl-0_1a2b"))),
    Ok(Reason::Unguarded)
)]
#[case::opt_in_removed(by(CTL, Some("ctl-1")), Some(lease(&[(HOLDER_IDENTITY_LABEL, HOLDER_IS_POD)], &[], Some("ctl-0"))), Ok(Reason::Unguarded))]
#[case::account_no_longer_named(by(CTL, Some("ctl-1")), Some(opted_in("other", Some("ctl-0"))), Ok(Reason::Unguarded))]
#[case::label_removed(by(CTL, Some("ctl-1")), Some(lease(&[], &[(WRITERS_ANNOTATION, "ctl")], Some("ctl-0"))), Ok(Reason::Unguarded))]
#[case::lease_deleted(by(CTL, Some("ctl-1")), None, Ok(Reason::Unguarded))]
fn who_may_write(#[case] req: Request, #[case] fresh: Option<LeaderElectionLease>, #[case] expect: Result<Reason, (u16, Reason)>) {
    let v = judge(&req, fresh);
    match (expect, &v) {
        (Ok(reason), _) => assert_eq!(v.reason(), reason, "{v:?}"),
        (Err((code, reason)), Verdict::Deny { code: c, reason: r, .. }) => assert_eq!((*c, *r), (code, reason), "{v:?}"),
        (Err(e), _) => panic!("expected {e:?}, got {v:?}"),
    }
}

#[test]
fn a_refusal_names_the_lease_the_holder_and_the_requester() {
    let v = judge(&by(CTL, Some("ctl-1")), Some(opted_in("ctl", Some("ctl-0_1a2b"))));
    let Verdict::Deny { message, facts, .. } = v else { panic!("expected a denial: {v:?}") };
    assert_eq!(facts.lease.as_deref(), Some("team/ctl"));
    assert_eq!(facts.holder.as_deref(), Some("ctl-0_1a2b"));
    assert_eq!(facts.requester.as_deref(), Some("ctl-1"));
    assert!(message.contains("is held by ctl-0_1a2b") && message.contains("Pod ctl-1"), "{message}");
}

#[rstest]
#[case("team", "ctl", true)]
#[case("team", "kube-controller-manager", true)]
#[case("a.b", "ctl", false)]
#[case("", "ctl", false)]
#[case("team", "", false)]
#[case("Team", "ctl", false)]
fn a_path_names_a_lease(#[case] namespace: &str, #[case] name: &str, #[case] ok: bool) {
    assert_eq!(lease_of_path(namespace, name).is_some(), ok);
}
