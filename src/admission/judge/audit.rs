//! Audit mode, for any guard: [`Audited`] runs the guard it wraps and admits what that guard
//! would deny, with a warning that says so — to the writer (the API server passes AdmissionReview
//! warnings on: `kubectl` prints them, client-go logs them) and in the webhook's metrics
//! (`decisions{verdict="warned"}` with the guard's reason). Gatekeeper's `dryrun` and Kyverno's
//! `Audit` do the same for their policies: a fence is tried on a running controller before it is
//! enforced, and the first sign of a missing exemption is a warning, not a failed write.
//!
//! Everything the wrapped guard would deny is admitted, read failures and throttled reads
//! included: an audited fence never makes a write fail. It reads what the guard reads, so the
//! warnings are what enforcing would refuse.

use super::facts::Request;
use super::guard::{Guard, Pending, Plan};
pub(crate) use super::preamble::Mode;
use super::preamble::Preamble;
use super::read::LeaseReads;
use super::verdict::Verdict;

/// The guard `G`, in audit mode.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Audited<G>(pub G);

impl<G: Guard> Guard for Audited<G> {
    type Pending<'r>
        = Audited<G::Pending<'r>>
    where
        Self: 'r;

    fn plan<'r>(&'r self, req: &'r Request, preamble: &Preamble<'r>) -> Plan<Audited<G::Pending<'r>>> {
        audited(self.0.plan(req, preamble))
    }
}

impl<P: Pending> Pending for Audited<P> {
    async fn read<R: LeaseReads + Sync>(self, reads: &R) -> Plan<Self> {
        audited(self.0.read(reads).await)
    }
}

fn audited<P>(plan: Plan<P>) -> Plan<Audited<P>> {
    match plan {
        Plan::Done(verdict) => Plan::Done(warn_instead(verdict)),
        Plan::Read(pending) => Plan::Read(Audited(pending)),
    }
}

/// A denial turned into an admission with a warning; anything else as it was.
fn warn_instead(verdict: Verdict) -> Verdict {
    match verdict {
        Verdict::Deny { reason, message, .. } => {
            Verdict::AllowWithWarning { reason, message: format!("kube-fence (audit mode) would deny this write: {message}") }
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use futures::FutureExt;
    use kube_fence_api::denial::Reason;
    use rstest::rstest;

    use super::*;
    use crate::admission::judge::facts::{ObjectFacts, Operation, PodIdentity};
    use crate::admission::judge::fake::{self, FakeLeases};
    use crate::admission::judge::leader::ByLeader;
    use crate::admission::judge::pipeline::{Judging, Sent, judge};
    use crate::admission::judge::preamble::Preamble;
    use crate::admission::judge::writer::ByWriter;

    const NS: &str = "team";
    const USER: &str = "system:serviceaccount:team:ctl";

    /// An UPDATE by Pod `pod` of an object bound to leader-election Lease `ctl`.
    fn update_by(pod: &str) -> Request {
        let bound = Some(ObjectFacts { leader_lease: Some("ctl".into()), ..ObjectFacts::default() });
        Request { pod: PodIdentity::of(USER, Some(pod)), ..Request::new(Operation::Update, NS, bound.clone(), bound, USER) }
    }

    /// Lease `ctl` held by Pod `ctl-0`, opted in for ServiceAccount `ctl`.
    fn leases() -> FakeLeases {
        FakeLeases::default()
            .with_leader_lease(NS, "ctl", fake::leader_lease(NS, "ctl", &[], &[], Some("ctl-0_1a2b")))
            .with_fence(fake::fence(NS, "ctl", &["ctl"], &[], Mode::Enforce))
    }

    /// The writer fence of FencedController `team/ctl`.
    fn by_writer() -> ByWriter {
        ByWriter(std::sync::Arc::new(fake::fence(NS, "ctl", &["ctl"], &[], Mode::Enforce)))
    }

    fn run<G: Guard>(guard: G, req: &Request, sent: Sent) -> Verdict {
        let judging = Judging::default();
        let preamble = Preamble::of(req, &judging, sent);
        super::super::guard::run(&guard, req, &preamble, &leases()).now_or_never().expect("the fake answers at once")
    }

    /// Threat: a stale replica (a follower, or a leader that lost its Lease) writes. Enforced, it
    /// is denied; audited, the same write is admitted with the same reason and what enforcing
    /// would have said; the holder's write is admitted either way, without a warning.
    #[rstest]
    #[case::leader_lease(Sent::Objects, true)]
    #[case::writer_fence(Sent::Writer, false)]
    fn audit_admits_what_enforcing_denies_and_says_so(#[case] sent: Sent, #[case] leader: bool) {
        let (stale, holder) = (update_by("ctl-1"), update_by("ctl-0"));
        let enforced = |req: &Request| if leader { run(ByLeader, req, sent) } else { run(by_writer(), req, sent) };
        let audited = |req: &Request| if leader { run(Audited(ByLeader), req, sent) } else { run(Audited(by_writer()), req, sent) };
        let Verdict::Deny { code: 409, reason: Reason::NotHolder, message: denied, .. } = enforced(&stale) else {
            panic!("enforced: {:?}", enforced(&stale))
        };
        match audited(&stale) {
            Verdict::AllowWithWarning { reason: Reason::NotHolder, message } => {
                assert_eq!(message, format!("kube-fence (audit mode) would deny this write: {denied}"))
            }
            other => panic!("audited: {other:?}"),
        }
        assert!(matches!(enforced(&holder), Verdict::AllowHeld { reason: Reason::Fenced, .. }), "{:?}", enforced(&holder));
        assert_eq!(audited(&holder), enforced(&holder));
    }

    /// The pipeline registers audit mode for the holder fences only: the token guard still denies
    /// a stale token, and the leader guard's warning is kept when the token guard then admits.
    #[test]
    fn the_pipeline_audits_the_holder_fences_and_keeps_their_warning() {
        let judging = Judging { holder_fences: Mode::Audit, ..Judging::default() };
        let verdict = judge(&update_by("ctl-1"), &judging, Sent::Objects, &leases()).now_or_never().expect("at once");
        assert!(matches!(&verdict, Verdict::AllowWithWarning { reason: Reason::NotHolder, .. }), "{verdict:?}");
        let enforced = judge(&update_by("ctl-1"), &Judging::default(), Sent::Objects, &leases()).now_or_never().expect("at once");
        assert!(matches!(enforced, Verdict::Deny { code: 409, reason: Reason::NotHolder, .. }), "{enforced:?}");
    }
}
