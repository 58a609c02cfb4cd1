//! The pipeline's own rules, over the fake reader: how the two guards of an object combine, and
//! that a read that fails or is throttled is denied (fail closed).

use std::net::{IpAddr, Ipv4Addr};
use std::sync::Arc;

use futures::FutureExt;
use k8s_openapi::api::coordination::v1::{Lease as LeaderElectionLease, LeaseSpec};
use rstest::rstest;

use super::*;
use crate::admission::judge::facts::{LeaseFacts, ObjectFacts, Operation, PodIdentity};
use crate::admission::judge::fake::{self, FakeLeases, ReadCounts};
use crate::admission::judge::fence::Mode;
use crate::admission::judge::read::ReadError;
use kube_fence_api::token::Token;

const NS: &str = "team";
const POD_USER: &str = "system:serviceaccount:team:ctl";

/// A side bound to leader-election Lease `ctl` and, with `token`, guarded by lease `l`.
fn side(token: Option<&str>) -> Option<ObjectFacts> {
    let guard = match token {
        Some(token) => ObjectFacts::guarded("l", Some(token)),
        None => ObjectFacts::default(),
    };
    Some(ObjectFacts { leader_lease: Some("ctl".into()), ..guard })
}

/// An UPDATE by Pod `web-0`.
fn update(old: Option<ObjectFacts>, new: Option<ObjectFacts>) -> Request {
    Request { pod: PodIdentity::of(POD_USER, Some("web-0")), ..Request::new(Operation::Update, NS, old, new, POD_USER) }
}

/// Lease `l` has issued 6; Lease `ctl` is held by `holder`.
fn leases(holder: &str) -> FakeLeases {
    let spec = LeaseSpec { holder_identity: Some(holder.into()), ..LeaseSpec::default() };
    FakeLeases::default().with_lease(NS, "l", LeaseFacts { issued: Token::new(6), ..LeaseFacts::default() }).with_leader_lease(
        NS,
        "ctl",
        LeaderElectionLease { spec: Some(spec), ..Default::default() },
    )
}

fn judged(req: &Request, sent: Sent, leases: &FakeLeases) -> Verdict {
    judge(req, &Judging::default(), sent, leases).now_or_never().expect("the fake answers at once")
}

fn outcome(verdict: &Verdict) -> Result<Reason, (u16, Reason)> {
    match verdict {
        Verdict::Deny { code, reason, .. } => Err((*code, *reason)),
        other => Ok(other.reason()),
    }
}

/// Both guards: the holder's denial stands (the token lease is then not read), else the token
/// guard decides, unless it does not guard the object.
#[rstest]
#[case::holder_and_fresh_token("web-0_a", side(Some("5")), side(Some("6")), Ok(Reason::Fenced), ReadCounts { holder: 1, cached: 1, ..ReadCounts::default() })]
#[case::holder_and_stale_token("web-0_a", side(Some("5")), side(Some("4")), Err((409, Reason::StaleToken)), ReadCounts { holder: 1, cached: 1, ..ReadCounts::default() })]
#[case::not_the_holder_with_a_fresh_token("web-1_a", side(Some("5")), side(Some("6")), Err((409, Reason::NotHolder)), ReadCounts { holder: 1, ..ReadCounts::default() })]
#[case::holder_and_no_token_guard("web-0_a", side(None), side(None), Ok(Reason::Fenced), ReadCounts { holder: 1, ..ReadCounts::default() })]
fn both_guards(
    #[case] holder: &str,
    #[case] old: Option<ObjectFacts>,
    #[case] new: Option<ObjectFacts>,
    #[case] expect: Result<Reason, (u16, Reason)>,
    #[case] reads: ReadCounts,
) {
    let leases = leases(holder);
    assert_eq!(outcome(&judged(&update(old, new), Sent::Objects, &leases)), expect);
    assert_eq!(leases.reads(), reads);
}

#[rstest]
#[case::token_lease(side(Some("5")).map(|s| ObjectFacts { leader_lease: None, ..s }), Sent::Objects, "cannot read lease team/l (failing closed): ServiceError: etcd is away")]
#[case::leader_lease(side(None), Sent::Objects, "cannot read leader-election Lease team/ctl (failing closed): ServiceError: etcd is away")]
#[case::writer(None, Sent::Writer, "cannot read leader-election Lease team/ctl (failing closed): ServiceError: etcd is away")]
fn a_read_that_fails_or_is_throttled_is_denied(#[case] facts: Option<ObjectFacts>, #[case] sent: Sent, #[case] failed: &str) {
    // An UPDATE the cache cannot judge (the fake holds no lease: a quorum read is needed).
    let req = update(facts.clone(), facts.map(|f| ObjectFacts { token: f.token.map(|_| "7".into()), ..f }));
    let fence = || fake::fence(NS, "ctl", &["ctl"], &[], Mode::Enforce);
    let leases =
        FakeLeases::default().with_fence(fence()).failing(ReadError::Failed(Arc::new(kube::Error::Service("etcd is away".into()))));
    let v = judged(&req, sent, &leases);
    assert!(matches!(&v, Verdict::Deny { code: 500, reason: Reason::LeaseReadFailed, message, .. } if message == failed), "{v:?}");
    let source = IpAddr::V4(Ipv4Addr::new(10, 0, 0, 7));
    let leases = FakeLeases::default().with_fence(fence()).failing(ReadError::Throttled { source, namespace: None, per_second: 5 });
    let v = judged(&req, sent, &leases);
    assert!(
        matches!(&v, Verdict::Deny { code: 429, reason: Reason::ReadsThrottled, message, .. } if message.contains("from 10.0.0.7 (at most 5 a second)")),
        "{v:?}"
    );
}

/// Before the fence cache is filled, a fenced writer's write is denied (fail closed: the routing
/// says it is fenced, and which fence judges it is not known yet); a write by anyone the routing
/// did not mean is not fenced by any fence.
#[test]
fn a_fenced_writer_is_denied_until_the_fences_are_known() {
    let req = update(None, None);
    let v = judged(&req, Sent::Writer, &FakeLeases::default().fences_unknown());
    assert!(matches!(&v, Verdict::Deny { code: 503, reason: Reason::LeaseReadFailed, .. }), "{v:?}");
    assert_eq!(judged(&req, Sent::Writer, &FakeLeases::default()), Verdict::Allow { reason: Reason::Unguarded });
}
