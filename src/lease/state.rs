//! The lease state machine — **where a fencing token is issued**.
//!
//! Pure: a [`Lease`] as observed (generation, spec, status, resourceVersion) and the controller's
//! `now` go in; a [`Decision`] comes out: which [`Transition`] to make, the status to write (the
//! caller writes it as a compare-and-swap on the observed resourceVersion), and when to look
//! again. No client, no clock, no I/O.
//!
//! ```text
//! Unheld --grant(n)--> Held(n) --renew--> Held(n) --expire|release--> Unheld --grant(m > n)--> Held(m)
//! ```
//!
//! # Why the token is the resourceVersion
//!
//! The token of a grant is the resourceVersion (the etcd revision) of the Lease version on which
//! the grant was judged. etcd revisions are cluster-wide and strictly increasing, so that version
//! is newer than the status write of every earlier grant of this lease name — even one made to a
//! Lease object that was since deleted and re-created — and the token is therefore greater than
//! every token issued before, with no ledger to keep and no extra write. Because the status write
//! is a compare-and-swap on that same resourceVersion, two controllers judging the same version
//! cannot both grant: one write wins, the other gets a conflict and judges the newer version.
//!
//! # Rules
//!
//! - A *claim* is new when `metadata.generation > status.observedGeneration`. Only a new claim is
//!   granted, so a holder whose lease expired or was released is not silently re-granted.
//! - While held, any spec change by the holder (a new `heartbeatTime`) is a renewal: the token is
//!   kept, `renewTime` becomes the controller's `now` and `expireTime` moves on.
//! - Expiry is judged only on the controller's clock: when `now >= status.expireTime`. A client's
//!   heartbeat timestamp is never read, so a skewed client clock can neither expire nor extend a
//!   lease. A heartbeat the controller observes before it has judged the lease expired renews it
//!   (the token is unchanged either way; time only decides liveness, never safety).
//! - Status times have whole-second precision (`metav1.Time`), so `expireTime` is rounded *up*:
//!   a lease never expires before `duration` has passed since the controller saw the heartbeat.
//! - Releasing (clearing `spec.holder`) and expiry keep `status.token`, so writers can still
//!   compare against it and the next grant is greater.

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, Time};
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;

use kube_fence_api::token::{Token, TokenError};
use kube_fence_api::{Lease, LeaseSpec, LeaseStatus, Phase};

use kube_fence_api::state::{HELD_CONDITION, REASON_EXPIRED, REASON_GRANTED, REASON_RELEASED, REASON_RENEWED, held, lease_duration};

/// A Lease as the controller observed it: the inputs of [`decide`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Observed<'a> {
    /// `metadata.generation`: bumped by the API server on every spec change.
    pub generation: Option<i64>,
    /// `metadata.resourceVersion` of this version: the candidate token of a grant.
    pub resource_version: Option<&'a str>,
    pub spec: &'a LeaseSpec,
    pub status: Option<&'a LeaseStatus>,
}

impl<'a> Observed<'a> {
    pub(crate) fn of(lease: &'a Lease) -> Observed<'a> {
        Observed {
            generation: lease.metadata.generation,
            resource_version: lease.metadata.resource_version.as_deref(),
            spec: &lease.spec,
            status: lease.status.as_ref(),
        }
    }
}

/// What happens to the lease.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Transition {
    /// `holder` gets the lease with a fresh `token`.
    Grant { holder: String, token: Token },
    /// The holder heartbeat; it keeps its `token`.
    Renew { holder: String, token: Token },
    /// The holder cleared `spec.holder` (or, only if takeover protection was bypassed, someone
    /// else's name replaced it).
    Release { holder: String, token: Token },
    /// The controller did not observe a heartbeat for the lease duration.
    Expire { holder: String, token: Token },
    /// A claim could not be granted; the lease stays unheld until the problem is fixed.
    Refuse { holder: String, refusal: Refusal },
    /// Nothing to do (held and fresh, unheld and unclaimed, or the claim was already handled).
    Nothing,
}

impl Transition {
    /// Stable short name, used as event reason and in logs.
    pub(crate) fn reason(&self) -> &'static str {
        match self {
            Transition::Grant { .. } => REASON_GRANTED,
            Transition::Renew { .. } => REASON_RENEWED,
            Transition::Release { .. } => REASON_RELEASED,
            Transition::Expire { .. } => REASON_EXPIRED,
            Transition::Refuse { .. } => "TokenUnavailable",
            Transition::Nothing => "Unchanged",
        }
    }
}

/// Why a claim was not granted.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub(crate) enum Refusal {
    /// The Lease has no resourceVersion (never true of an object read from the API server).
    #[error("the observed Lease has no resourceVersion to derive a token from")]
    NoResourceVersion,
    /// The API server's resourceVersion is not a decimal u63, so it cannot serve as a token.
    #[error("resourceVersion {resource_version:?} cannot serve as a fencing token: {error}")]
    ResourceVersionNotToken { resource_version: String, error: TokenError },
    /// The candidate is not greater than the newest token issued: granting would reissue or
    /// move a token backwards (only possible if the storage's revisions went backwards, e.g.
    /// an etcd restore).
    #[error("candidate token {candidate} is not greater than the newest issued token {recorded}")]
    WouldNotIncrease { candidate: Token, recorded: Token },
}

/// The outcome of judging one observed version of a Lease.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Decision {
    pub transition: Transition,
    /// The status to write, as a compare-and-swap on the observed resourceVersion; `None` when
    /// the stored status is already right.
    pub status: Option<LeaseStatus>,
    /// When to judge the lease again even if nothing changes: exactly at expiry while held.
    pub requeue_at: Option<Timestamp>,
}

/// When a held lease expires on the controller's clock: `status.expireTime`, or (for a status
/// written by hand without one) `renewTime + duration`, or immediately.
fn expiry(status: &LeaseStatus, spec: &LeaseSpec) -> Timestamp {
    if let Some(Time(at)) = status.expire_time {
        return at;
    }
    match status.renew_time {
        Some(Time(renewed)) => round_up(renewed.saturating_add(lease_duration(spec)).unwrap_or(Timestamp::MAX)),
        None => Timestamp::MIN,
    }
}

/// Judges one observed version of a Lease at the controller's `now`.
pub(crate) fn decide(observed: &Observed<'_>, now: Timestamp) -> Decision {
    let generation = observed.generation.unwrap_or(0);
    let old = observed.status.cloned().unwrap_or_default();
    let claim_is_new = generation > old.observed_generation.unwrap_or(0);
    let claimant = observed.spec.holder.as_deref();

    let (transition, new) = match held(observed.status) {
        Some((holder, token)) => {
            let holder = holder.to_string();
            match claimant {
                Some(c) if c == holder && claim_is_new => {
                    let new = LeaseStatus { observed_generation: Some(generation), ..held_until(&old, observed.spec, now) };
                    (Transition::Renew { holder, token }, new)
                }
                Some(c) if c == holder => {
                    if now >= expiry(&old, observed.spec) {
                        (Transition::Expire { holder, token }, unheld(&old, Some(generation)))
                    } else {
                        (Transition::Nothing, old.clone())
                    }
                }
                // Cleared: a release. Someone else's name (takeover protection bypassed): release
                // too, but leave their claim pending so the next judgement grants it afresh.
                None => (Transition::Release { holder, token }, unheld(&old, Some(generation))),
                Some(_) => (Transition::Release { holder, token }, unheld(&old, old.observed_generation)),
            }
        }
        None => match claimant {
            Some(claimant) if claim_is_new => {
                let holder = claimant.to_string();
                match candidate_token(observed.resource_version, old.token) {
                    Ok(token) => {
                        let new = LeaseStatus {
                            phase: Phase::Held,
                            holder: Some(holder.clone()),
                            token: Some(token),
                            acquire_time: Some(Time(truncate(now))),
                            lease_transitions: old.lease_transitions.saturating_add(1),
                            observed_generation: Some(generation),
                            ..held_until(&old, observed.spec, now)
                        };
                        (Transition::Grant { holder, token }, new)
                    }
                    Err(refusal) => {
                        // Not acted on: observedGeneration stays, so the claim is judged again
                        // on the next version (whose resourceVersion may serve).
                        let new = LeaseStatus { phase: Phase::Unheld, holder: None, ..old.clone() };
                        (Transition::Refuse { holder, refusal }, new)
                    }
                }
            }
            _ => {
                // Unclaimed, or a claim already handled. Normalise a malformed Held status.
                let new = if old.phase == Phase::Held { unheld(&old, old.observed_generation) } else { old.clone() };
                (Transition::Nothing, new)
            }
        },
    };

    let new = with_condition(new, &transition, generation, now);
    let requeue_at = held(Some(&new)).map(|_| expiry(&new, observed.spec));
    let status =
        if observed.status == Some(&new) || (observed.status.is_none() && new == LeaseStatus::default()) { None } else { Some(new) };
    Decision { transition, status, requeue_at }
}

/// The token a grant on this version would carry, if it may be issued.
fn candidate_token(resource_version: Option<&str>, recorded: Option<Token>) -> Result<Token, Refusal> {
    let rv = resource_version.ok_or(Refusal::NoResourceVersion)?;
    let candidate: Token = rv.parse().map_err(|error| Refusal::ResourceVersionNotToken { resource_version: rv.to_string(), error })?;
    match recorded {
        Some(recorded) if candidate <= recorded => Err(Refusal::WouldNotIncrease { candidate, recorded }),
        _ => Ok(candidate),
    }
}

/// `old` with the holder's times moved on: renewed now, expiring `duration` later.
fn held_until(old: &LeaseStatus, spec: &LeaseSpec, now: Timestamp) -> LeaseStatus {
    let expires = round_up(now.saturating_add(lease_duration(spec)).unwrap_or(Timestamp::MAX));
    LeaseStatus { renew_time: Some(Time(truncate(now))), expire_time: Some(Time(expires)), ..old.clone() }
}

/// `old` with nobody holding it; the token is kept so the next grant is compared against it.
fn unheld(old: &LeaseStatus, observed_generation: Option<i64>) -> LeaseStatus {
    LeaseStatus {
        phase: Phase::Unheld,
        holder: None,
        acquire_time: None,
        renew_time: None,
        expire_time: None,
        observed_generation,
        ..old.clone()
    }
}

/// Sets the `Held` condition for the transition, keeping `lastTransitionTime` unless its status
/// really changes.
fn with_condition(mut status: LeaseStatus, transition: &Transition, generation: i64, now: Timestamp) -> LeaseStatus {
    let (value, message) = match transition {
        Transition::Grant { holder, token } => ("True", format!("granted to {holder} with token {token}")),
        Transition::Renew { holder, token } => ("True", format!("held by {holder} with token {token}")),
        Transition::Release { holder, token } => ("False", format!("released by {holder}; newest token {token}")),
        Transition::Expire { holder, token } => {
            ("False", format!("{holder} did not renew within the lease duration; newest token {token}"))
        }
        Transition::Refuse { holder, refusal } => ("False", format!("cannot grant to {holder}: {refusal}")),
        Transition::Nothing => return status,
    };
    let previous = status.conditions.iter().position(|c| c.type_ == HELD_CONDITION);
    let last_transition_time = match previous.map(|i| &status.conditions[i]) {
        Some(c) if c.status == value => c.last_transition_time.clone(),
        _ => Time(truncate(now)),
    };
    let condition = Condition {
        type_: HELD_CONDITION.to_string(),
        status: value.to_string(),
        reason: transition.reason().to_string(),
        message,
        observed_generation: Some(generation),
        last_transition_time,
    };
    match previous {
        Some(i) => status.conditions[i] = condition,
        None => status.conditions.push(condition),
    }
    status
}

/// `t` at whole-second precision, as `metav1.Time` stores it.
fn truncate(t: Timestamp) -> Timestamp {
    Timestamp::from_second(t.as_second()).unwrap_or(t)
}

/// `t` rounded up to a whole second, so that a stored expiry is never earlier than computed.
fn round_up(t: Timestamp) -> Timestamp {
    let down = truncate(t);
    if down == t { t } else { down.saturating_add(SignedDuration::from_secs(1)).unwrap_or(down) }
}

/// The lease name as used in logs: `namespace/name`.
pub(crate) fn display_name(lease: &Lease) -> String {
    format!("{}/{}", lease.namespace().unwrap_or_default(), lease.name_any())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn ts(s: i64) -> Timestamp {
        Timestamp::from_second(s).unwrap_or(Timestamp::UNIX_EPOCH)
    }
    fn tok(n: u64) -> Token {
        Token::new(n).unwrap_or(Token::MAX)
    }

    /// A compact description of a stored status, for the table.
    #[derive(Clone, Copy, Debug)]
    enum S {
        /// No status yet.
        None,
        /// Unheld; newest token; observedGeneration.
        Unheld(Option<u64>, i64),
        /// Held by holder with token; observedGeneration; expireTime (seconds).
        Held(&'static str, u64, i64, i64),
    }

    fn status(s: S) -> Option<LeaseStatus> {
        match s {
            S::None => None,
            S::Unheld(token, og) => Some(LeaseStatus {
                phase: Phase::Unheld,
                token: token.map(tok),
                observed_generation: Some(og),
                lease_transitions: 1,
                ..Default::default()
            }),
            S::Held(holder, token, og, expires) => Some(LeaseStatus {
                phase: Phase::Held,
                holder: Some(holder.into()),
                token: Some(tok(token)),
                acquire_time: Some(Time(ts(expires - 20))),
                renew_time: Some(Time(ts(expires - 10))),
                expire_time: Some(Time(ts(expires))),
                lease_transitions: 1,
                observed_generation: Some(og),
                conditions: vec![],
            }),
        }
    }

    fn spec(holder: Option<&str>) -> LeaseSpec {
        LeaseSpec { holder: holder.map(String::from), lease_duration_seconds: Some(10), ..Default::default() }
    }

    fn judge(holder: Option<&str>, generation: i64, rv: &str, s: S, now: i64) -> Decision {
        let spec = spec(holder);
        let status = status(s);
        decide(&Observed { generation: Some(generation), resource_version: Some(rv), spec: &spec, status: status.as_ref() }, ts(now))
    }

    fn grant(h: &str, t: u64) -> Transition {
        Transition::Grant { holder: h.into(), token: tok(t) }
    }
    fn renew(h: &str, t: u64) -> Transition {
        Transition::Renew { holder: h.into(), token: tok(t) }
    }
    fn release(h: &str, t: u64) -> Transition {
        Transition::Release { holder: h.into(), token: tok(t) }
    }
    fn expire(h: &str, t: u64) -> Transition {
        Transition::Expire { holder: h.into(), token: tok(t) }
    }

    /// Every combination of (spec holder, new claim or not, stored status, clock) → transition.
    #[rstest]
    // Unheld, no claim.
    #[case::fresh_unclaimed(None, 1, S::None, 100, Transition::Nothing)]
    #[case::unheld_unclaimed(None, 3, S::Unheld(Some(7), 2), 100, Transition::Nothing)]
    #[case::unheld_claim_withdrawn(None, 3, S::Unheld(Some(7), 3), 100, Transition::Nothing)]
    // Unheld, a new claim is granted with the observed resourceVersion.
    #[case::first_claim(Some("a"), 1, S::None, 100, grant("a", 500))]
    #[case::claim_after_release(Some("b"), 4, S::Unheld(Some(7), 3), 100, grant("b", 500))]
    #[case::claim_without_previous_token(Some("b"), 4, S::Unheld(None, 3), 100, grant("b", 500))]
    #[case::expired_holder_writes_again(Some("a"), 5, S::Unheld(Some(7), 4), 100, grant("a", 500))]
    // Unheld, a claim already handled (the expired holder's name left in spec) is not re-granted.
    #[case::handled_claim_not_regranted(Some("a"), 4, S::Unheld(Some(7), 4), 100, Transition::Nothing)]
    // Held: renewal keeps the token, whether or not the clock is past expiry.
    #[case::renew_before_expiry(Some("a"), 6, S::Held("a", 7, 5, 110), 100, renew("a", 7))]
    #[case::renew_observed_before_judged_expired(Some("a"), 6, S::Held("a", 7, 5, 110), 200, renew("a", 7))]
    // Held, nothing new: fresh → nothing; at or past expiry → expire.
    #[case::held_fresh(Some("a"), 5, S::Held("a", 7, 5, 110), 109, Transition::Nothing)]
    #[case::held_at_expiry(Some("a"), 5, S::Held("a", 7, 5, 110), 110, expire("a", 7))]
    #[case::held_past_expiry(Some("a"), 5, S::Held("a", 7, 5, 110), 500, expire("a", 7))]
    // Held, released (holder cleared), expired or not.
    #[case::released(None, 6, S::Held("a", 7, 5, 110), 100, release("a", 7))]
    #[case::released_after_expiry(None, 6, S::Held("a", 7, 5, 110), 200, release("a", 7))]
    // Held, another name in spec (only if CEL was bypassed): released, never granted in one step.
    #[case::displaced(Some("b"), 6, S::Held("a", 7, 5, 110), 100, release("a", 7))]
    fn transitions(
        #[case] holder: Option<&str>,
        #[case] generation: i64,
        #[case] stored: S,
        #[case] now: i64,
        #[case] expected: Transition,
    ) {
        let d = judge(holder, generation, "500", stored, now);
        assert_eq!(d.transition, expected);
    }

    #[rstest]
    #[case::grant(Some("a"), 4, S::Unheld(Some(7), 3), 100)]
    #[case::renew(Some("a"), 6, S::Held("a", 7, 5, 110), 100)]
    #[case::release(None, 6, S::Held("a", 7, 5, 110), 100)]
    #[case::expire(Some("a"), 5, S::Held("a", 7, 5, 110), 110)]
    #[case::nothing_held(Some("a"), 5, S::Held("a", 7, 5, 110), 105)]
    fn a_token_never_goes_down_and_is_never_lost(
        #[case] holder: Option<&str>,
        #[case] generation: i64,
        #[case] stored: S,
        #[case] now: i64,
    ) {
        let before = status(stored).and_then(|s| s.token);
        let d = judge(holder, generation, "500", stored, now);
        let after = d.status.as_ref().or(status(stored).as_ref()).and_then(|s| s.token);
        assert!(after >= before, "{before:?} -> {after:?}");
        assert!(after.is_some());
    }

    #[test]
    fn grant_writes_the_whole_held_status() {
        let d = judge(Some("b"), 4, "500", S::Unheld(Some(7), 3), 100);
        let s = d.status.expect("a grant writes status");
        assert_eq!(s.phase, Phase::Held);
        assert_eq!(s.holder.as_deref(), Some("b"));
        assert_eq!(s.token, Some(tok(500)));
        assert_eq!(s.acquire_time, Some(Time(ts(100))));
        assert_eq!(s.renew_time, Some(Time(ts(100))));
        assert_eq!(s.expire_time, Some(Time(ts(110))));
        assert_eq!(s.lease_transitions, 2);
        assert_eq!(s.observed_generation, Some(4));
        assert_eq!(d.requeue_at, Some(ts(110)), "requeue exactly at expiry");
        let c = &s.conditions[0];
        assert_eq!((c.type_.as_str(), c.status.as_str(), c.reason.as_str()), ("Held", "True", "Granted"));
        assert!(c.message.contains("500"), "{}", c.message);
    }

    #[test]
    fn renewal_keeps_token_and_acquire_time_and_moves_expiry() {
        let d = judge(Some("a"), 6, "900", S::Held("a", 7, 5, 110), 105);
        let s = d.status.expect("a renewal writes status");
        assert_eq!(s.token, Some(tok(7)));
        assert_eq!(s.acquire_time, Some(Time(ts(90))));
        assert_eq!(s.renew_time, Some(Time(ts(105))));
        assert_eq!(s.expire_time, Some(Time(ts(115))));
        assert_eq!(s.lease_transitions, 1, "a renewal is not a transition");
        assert_eq!(s.observed_generation, Some(6));
        assert_eq!(d.requeue_at, Some(ts(115)));
    }

    #[rstest]
    #[case::release(None, 6, 100)]
    #[case::expire(Some("a"), 5, 110)]
    fn losing_the_lease_keeps_the_token_and_marks_the_claim_handled(
        #[case] holder: Option<&str>,
        #[case] generation: i64,
        #[case] now: i64,
    ) {
        let d = judge(holder, generation, "900", S::Held("a", 7, 5, 110), now);
        let s = d.status.expect("writes status");
        assert_eq!(s.phase, Phase::Unheld);
        assert_eq!(s.holder, None);
        assert_eq!(s.token, Some(tok(7)));
        assert_eq!((s.renew_time.clone(), s.expire_time.clone()), (None, None));
        assert_eq!(s.observed_generation, Some(generation));
        assert_eq!(d.requeue_at, None, "nothing to wait for while unheld");
        assert_eq!(s.conditions[0].status, "False");
    }

    #[test]
    fn nothing_to_do_writes_nothing_and_requeues_at_expiry() {
        let d = judge(Some("a"), 5, "900", S::Held("a", 7, 5, 110), 101);
        assert_eq!(d.status, None);
        assert_eq!(d.requeue_at, Some(ts(110)));
        let d = judge(None, 1, "900", S::None, 101);
        assert_eq!((d.status, d.requeue_at), (None, None), "an unclaimed new lease needs no status write");
    }

    #[test]
    fn the_clients_heartbeat_timestamp_is_never_read() {
        let at = |heartbeat: i64| {
            let spec = LeaseSpec {
                heartbeat_time: Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(ts(heartbeat))),
                ..spec(Some("a"))
            };
            let stored = status(S::Held("a", 7, 5, 110));
            decide(&Observed { generation: Some(6), resource_version: Some("900"), spec: &spec, status: stored.as_ref() }, ts(105))
        };
        assert_eq!(at(-1_000_000), at(1_000_000_000), "far past and far future heartbeats decide the same");
        assert_eq!(at(0).transition, renew("a", 7));
    }

    #[rstest]
    #[case::not_a_number("abc", "not a decimal")]
    #[case::padded("0500", "leading zero")]
    #[case::overflow("99999999999999999999", "larger than")]
    #[case::not_increasing("7", "not greater than the newest issued token 7")]
    #[case::lower("6", "not greater than")]
    fn a_resource_version_that_cannot_serve_refuses_the_grant(#[case] rv: &str, #[case] why: &str) {
        let d = judge(Some("b"), 4, rv, S::Unheld(Some(7), 3), 100);
        let Transition::Refuse { holder, refusal } = &d.transition else { panic!("expected a refusal, got {:?}", d.transition) };
        assert_eq!(holder, "b");
        assert!(refusal.to_string().contains(why), "{refusal}");
        let s = d.status.expect("the refusal is recorded as a condition");
        assert_eq!(s.phase, Phase::Unheld);
        assert_eq!(s.token, Some(tok(7)), "token kept");
        assert_eq!(s.observed_generation, Some(3), "the claim stays pending");
        assert_eq!(s.conditions[0].reason, "TokenUnavailable");
        // Judging the same version again writes nothing new (no write loop).
        let spec = spec(Some("b"));
        let again = decide(&Observed { generation: Some(4), resource_version: Some(rv), spec: &spec, status: Some(&s) }, ts(101));
        assert_eq!(again.status, None);
    }

    #[test]
    fn no_resource_version_refuses() {
        let spec = spec(Some("a"));
        let d = decide(&Observed { generation: Some(1), resource_version: None, spec: &spec, status: None }, ts(1));
        assert!(matches!(d.transition, Transition::Refuse { refusal: Refusal::NoResourceVersion, .. }));
    }

    #[test]
    fn expiry_is_rounded_up_to_whole_seconds() {
        let spec = spec(Some("a"));
        let now = Timestamp::from_millisecond(100_300).unwrap_or(Timestamp::UNIX_EPOCH);
        let d = decide(&Observed { generation: Some(1), resource_version: Some("5"), spec: &spec, status: None }, now);
        let s = d.status.expect("granted");
        assert_eq!(s.renew_time, Some(Time(ts(100))));
        assert_eq!(s.expire_time, Some(Time(ts(111))), "never earlier than now + duration");
    }

    #[test]
    fn condition_keeps_last_transition_time_while_status_unchanged() {
        let granted = judge(Some("a"), 1, "5", S::None, 100).status.expect("granted");
        let spec = spec(Some("a"));
        let renewed = decide(&Observed { generation: Some(2), resource_version: Some("9"), spec: &spec, status: Some(&granted) }, ts(104))
            .status
            .expect("renewed");
        assert_eq!(renewed.conditions.len(), 1);
        assert_eq!(renewed.conditions[0].reason, "Renewed");
        assert_eq!(renewed.conditions[0].last_transition_time, Time(ts(100)));
    }

    #[test]
    fn malformed_held_status_without_token_is_unheld() {
        let spec = spec(Some("a"));
        let bad = LeaseStatus { phase: Phase::Held, holder: Some("a".into()), observed_generation: Some(1), ..Default::default() };
        let d = decide(&Observed { generation: Some(2), resource_version: Some("50"), spec: &spec, status: Some(&bad) }, ts(1));
        assert_eq!(d.transition, grant("a", 50));
    }

    #[test]
    fn held_status_without_expire_time_uses_renew_time_plus_duration() {
        let spec = spec(Some("a"));
        let s = LeaseStatus { expire_time: None, ..status(S::Held("a", 7, 5, 110)).unwrap_or_default() };
        // renewTime = 100, duration 10.
        let judge = |now| {
            decide(&Observed { generation: Some(5), resource_version: Some("50"), spec: &spec, status: Some(&s) }, ts(now)).transition
        };
        assert_eq!(judge(109), Transition::Nothing);
        assert_eq!(judge(110), expire("a", 7));
    }
}
