//! The decision table (docs/design.md §5), row by row, plus every
//! malformed-token form, subresources, finalizer removal and the reads each row needs.

use futures::FutureExt;
use rstest::rstest;

use kube_fence_api::HolderIdentity;

use super::*;
use crate::admission::judge::exemptions::Exemptions;
use crate::admission::judge::facts::PodIdentity;
use crate::admission::judge::fake::{FakeLeases, ReadCounts};
use crate::admission::judge::pipeline::{self, Judging, Sent};

const NS: &str = "team";
const ALICE: &str = "alice";
const GC: &str = "system:serviceaccount:kube-system:generic-garbage-collector";
const NSC: &str = "system:serviceaccount:kube-system:namespace-controller";

fn tok(n: u64) -> Token {
    Token::new(n).unwrap()
}

fn g(lease: &str, token: Option<&str>) -> Option<ObjectFacts> {
    Some(ObjectFacts::guarded(lease, token))
}

fn u(token: Option<&str>) -> Option<ObjectFacts> {
    Some(ObjectFacts::unguarded(token))
}

fn request(operation: Operation, old: Option<ObjectFacts>, new: Option<ObjectFacts>) -> Request {
    Request::new(operation, NS, old, new, ALICE)
}

fn facts(issued: Option<u64>, enforcement: Enforcement) -> LeaseFacts {
    LeaseFacts { issued: issued.map(tok), comparison: Comparison::Strict, enforcement, ..LeaseFacts::default() }
}

fn allow_equal(issued: u64) -> LeaseFacts {
    LeaseFacts { comparison: Comparison::AllowEqual, ..strict(issued) }
}

/// A guarded side that carries a `kubefence.io/write` value.
fn gw(lease: &str, token: &str, write: Option<&str>) -> Option<ObjectFacts> {
    Some(ObjectFacts { write: write.map(str::to_string), ..ObjectFacts::guarded(lease, Some(token)) })
}

fn strict(issued: u64) -> LeaseFacts {
    facts(Some(issued), Enforcement::Enforce)
}

/// The leases a request is judged by, in the fake: `cached` in the watch cache and `current` in
/// the quorum, under every lease name the request carries (`None`: no such lease).
fn leases(req: &Request, cached: Option<LeaseFacts>, current: Option<LeaseFacts>) -> FakeLeases {
    let mut leases = FakeLeases::default();
    for name in [&req.old, &req.new].into_iter().flatten().filter_map(|side| side.lease.as_deref()) {
        if let Some(cached) = &cached {
            leases = leases.with_cached(&req.namespace, name, cached.clone());
        }
        if let Some(current) = &current {
            leases = leases.with_current(&req.namespace, name, current.clone());
        }
    }
    leases
}

/// Judges as the server does — the pipeline: the plan, then the reads it asks for, from a cache
/// that holds `cached` and a quorum that holds `current` — and says which reads it made.
fn judged(req: &Request, exempt: &Exemptions, cached: Option<LeaseFacts>, current: Option<LeaseFacts>) -> (Verdict, ReadCounts) {
    let leases = leases(req, cached, current);
    let judging = Judging { exempt: exempt.clone(), ..Judging::default() };
    let verdict = pipeline::judge(req, &judging, Sent::Objects, &leases).now_or_never().expect("the fake answers at once");
    (verdict, leases.reads())
}

/// Which read a request needs, given what the cache holds: "none", "cache" or "quorum".
fn read_needed(req: &Request, exempt: &Exemptions, cached: Option<LeaseFacts>) -> &'static str {
    match judged(req, exempt, cached, None).1 {
        ReadCounts { quorum: 1.., .. } => "quorum",
        ReadCounts { cached: 1.., .. } => "cache",
        _ => "none",
    }
}

fn judge_with(req: &Request, exempt: &Exemptions, cached: Option<LeaseFacts>, current: Option<LeaseFacts>) -> Verdict {
    judged(req, exempt, cached, current).0
}

fn judge(req: &Request, cached: Option<LeaseFacts>, current: Option<LeaseFacts>) -> Verdict {
    judge_with(req, &Exemptions::default(), cached, current)
}

fn judge_now(req: &Request, f: LeaseFacts) -> Verdict {
    judge(req, Some(f.clone()), Some(f))
}

fn denied(v: &Verdict) -> (u16, Reason) {
    match v {
        Verdict::Deny { code, reason, .. } => (*code, *reason),
        other => panic!("expected a denial, got {other:?}"),
    }
}

// --- Row: UPDATE of an object that records r: t parses, t > r, and t <= lease.status.token.

#[rstest]
#[case::newer_and_issued(5, "6", 6, None)]
#[case::newer_than_recorded_older_than_issued(5, "6", 9, None)]
#[case::equal_is_stale(5, "5", 9, Some((409, Reason::StaleToken)))]
#[case::older_is_stale(5, "4", 9, Some((409, Reason::StaleToken)))]
#[case::zero_is_stale(5, "0", 9, Some((409, Reason::StaleToken)))]
#[case::not_issued_yet(5, "10", 9, Some((403, Reason::TokenNotIssued)))]
#[case::max_token_not_issued(5, "9223372036854775807", 9, Some((403, Reason::TokenNotIssued)))]
fn update_of_recorded_object(#[case] recorded: u64, #[case] presented: &str, #[case] issued: u64, #[case] expect: Option<(u16, Reason)>) {
    let r = recorded.to_string();
    let req = request(Operation::Update, g("l", Some(&r)), g("l", Some(presented)));
    let v = judge_now(&req, strict(issued));
    match expect {
        None => assert_eq!(v, Verdict::Allow { reason: Reason::Fenced }),
        Some(e) => assert_eq!(denied(&v), e, "{v:?}"),
    }
}

#[test]
fn a_stale_denial_carries_lease_and_both_tokens_as_facts() {
    let req = request(Operation::Update, g("orders", Some("17")), g("orders", Some("12")));
    let Verdict::Deny { code: 409, reason: Reason::StaleToken, message, facts } = judge_now(&req, strict(20)) else { panic!() };
    assert_eq!(facts, Facts { lease: Some("team/orders".into()), presented: Some(tok(12)), recorded: Some(tok(17)), ..Facts::default() });
    assert!(message.contains("team/orders") && message.contains("presented token 12"), "{message}");
}

#[test]
fn update_reads_the_cache_and_a_lagging_cache_forces_a_quorum_read() {
    let exempt = Exemptions::default();
    let req = request(Operation::Update, g("l", Some("5")), g("l", Some("8")));
    // The cache has seen token 8: enough (tokens only grow, so the quorum has too).
    assert_eq!(read_needed(&req, &exempt, Some(strict(8))), "cache");
    assert_eq!(judge(&req, Some(strict(8)), None), Verdict::Allow { reason: Reason::Fenced });
    // The cache has seen only 7, the lease granted 8 a moment ago: read the quorum.
    assert_eq!(read_needed(&req, &exempt, Some(strict(7))), "quorum");
    assert_eq!(judge(&req, Some(strict(7)), Some(strict(8))), Verdict::Allow { reason: Reason::Fenced });
    // Not in the cache at all: maybe just created; read the quorum.
    assert_eq!(read_needed(&req, &exempt, None), "quorum");
    assert_eq!(judge(&req, None, Some(strict(8))), Verdict::Allow { reason: Reason::Fenced });
}

#[test]
fn stale_tokens_are_judged_from_the_cache() {
    let req = request(Operation::Update, g("l", Some("5")), g("l", Some("4")));
    assert_eq!(read_needed(&req, &Exemptions::default(), Some(strict(5))), "cache");
    assert_eq!(denied(&judge(&req, Some(strict(5)), None)), (409, Reason::StaleToken));
}

// --- Per-lease opt-in AllowEqual: t >= r, where t == r counts only when this write restated the
//     token (a new kubefence.io/write value): a write that leaves the annotations alone — a stale
//     holder's data-only patch over a newer holder's write — is not taken for one.

#[rstest]
#[case::restated(gw("l", "5", Some("w1")), gw("l", "5", Some("w2")), None)]
#[case::first_restatement(gw("l", "5", None), gw("l", "5", Some("w1")), None)]
#[case::greater(gw("l", "5", Some("w1")), gw("l", "6", Some("w1")), None)]
#[case::annotations_left_alone(gw("l", "5", Some("w1")), gw("l", "5", Some("w1")), Some((409, Reason::StaleToken)))]
#[case::no_write_annotation(gw("l", "5", None), gw("l", "5", None), Some((409, Reason::StaleToken)))]
#[case::write_annotation_removed(gw("l", "5", Some("w1")), gw("l", "5", None), Some((409, Reason::StaleToken)))]
#[case::less(gw("l", "5", Some("w1")), gw("l", "4", Some("w2")), Some((409, Reason::StaleToken)))]
fn allow_equal_admits_a_restated_token(
    #[case] old: Option<ObjectFacts>,
    #[case] new: Option<ObjectFacts>,
    #[case] expect: Option<(u16, Reason)>,
) {
    let req = request(Operation::Update, old, new);
    let v = judge_now(&req, allow_equal(6));
    match expect {
        None => assert_eq!(v, Verdict::Allow { reason: Reason::Fenced }),
        Some(e) => assert_eq!(denied(&v), e, "{v:?}"),
    }
}

#[test]
fn an_equal_token_is_stale_under_strict_even_restated() {
    let req = request(Operation::Update, gw("l", "5", Some("w1")), gw("l", "5", Some("w2")));
    assert_eq!(denied(&judge_now(&req, strict(6))), (409, Reason::StaleToken));
}

#[test]
fn allow_equal_deciding_a_write_is_confirmed_by_a_quorum_read() {
    let req = request(Operation::Update, gw("l", "5", Some("w1")), gw("l", "5", Some("w2")));
    assert_eq!(read_needed(&req, &Exemptions::default(), Some(allow_equal(6))), "quorum");
    // The lease was switched to Strict a moment ago; the cache still says AllowEqual.
    assert_eq!(denied(&judge(&req, Some(allow_equal(6)), Some(strict(6)))), (409, Reason::StaleToken));
}

// --- Row: CREATE, or UPDATE that makes an unguarded object guarded: t == newest issued,
//     read linearizably.

#[rstest]
#[case::create_current(Operation::Create, None, "9", None)]
#[case::create_stale(Operation::Create, None, "8", Some((409, Reason::StaleToken)))]
#[case::create_not_issued(Operation::Create, None, "10", Some((403, Reason::TokenNotIssued)))]
#[case::guard_current(Operation::Update, u(None), "9", None)]
#[case::guard_stale(Operation::Update, u(Some("8")), "8", Some((409, Reason::StaleToken)))]
#[case::guard_not_issued(Operation::Update, u(None), "10", Some((403, Reason::TokenNotIssued)))]
// Guarded before kube-fence ran, or with a garbage recorded token: no r to compare, so the
// CREATE rule applies (rather than locking the object forever).
#[case::recorded_missing(Operation::Update, g("l", None), "9", None)]
#[case::recorded_garbage(Operation::Update, g("l", Some("x")), "8", Some((409, Reason::StaleToken)))]
fn create_and_newly_guarded(
    #[case] op: Operation,
    #[case] old: Option<ObjectFacts>,
    #[case] presented: &str,
    #[case] expect: Option<(u16, Reason)>,
) {
    let req = request(op, old, g("l", Some(presented)));
    // The cache alone is never enough, even when it agrees: the plan asks for the quorum.
    let (_, reads) = judged(&req, &Exemptions::default(), Some(strict(9)), Some(strict(9)));
    assert_eq!(reads, ReadCounts { quorum: 1, ..ReadCounts::default() });
    let v = judge(&req, Some(strict(1)), Some(strict(9)));
    match expect {
        None => assert_eq!(v, Verdict::Allow { reason: Reason::Fenced }),
        Some(e) => assert_eq!(denied(&v), e, "{v:?}"),
    }
}

#[test]
fn create_stale_message_names_the_newest_token() {
    let req = request(Operation::Create, None, g("l", Some("3")));
    let Verdict::Deny { message, .. } = judge_now(&req, strict(4)) else { panic!() };
    assert!(message.contains("presented token 3") && message.contains("recorded token 4"), "{message}");
}

#[rstest]
#[case::create(Operation::Create, None)]
#[case::update(Operation::Update, g("l", Some("1")))]
fn lease_missing_or_never_granted(#[case] op: Operation, #[case] old: Option<ObjectFacts>) {
    let req = request(op, old, g("l", Some("2")));
    let missing = judge(&req, None, None);
    let (code, reason) = denied(&missing);
    assert_eq!((code, reason), (403, Reason::LeaseNotFound));
    let never = judge_now(&req, facts(None, Enforcement::Enforce));
    assert_eq!(denied(&never), (403, Reason::TokenNotIssued));
}

// --- Row: changing which lease an object is bound to: never.

#[rstest]
#[case::valid_token("9")]
#[case::stale_token("1")]
fn rebinding_is_never_allowed(#[case] presented: &str) {
    let req = request(Operation::Update, g("a", Some("5")), g("b", Some(presented)));
    let (v, reads) = judged(&req, &Exemptions::default(), None, None);
    assert_eq!(reads, ReadCounts::default(), "rebinding needs no lease read");
    assert_eq!(denied(&v), (403, Reason::LeaseRebound));
    // Not even a Warn lease relaxes it.
    let warn = facts(Some(9), Enforcement::Warn);
    assert_eq!(denied(&judge_now(&req, warn)), (403, Reason::LeaseRebound));
}

// --- Row: removing the label (unguarding): like any UPDATE, only with a valid t > r.

#[rstest]
#[case::valid(Some("6"), None)]
#[case::stale(Some("5"), Some((409, Reason::StaleToken)))]
#[case::missing(None, Some((403, Reason::TokenMissing)))]
#[case::malformed(Some("06"), Some((400, Reason::TokenMalformed)))]
#[case::not_issued(Some("7"), Some((403, Reason::TokenNotIssued)))]
fn unguarding(#[case] presented: Option<&str>, #[case] expect: Option<(u16, Reason)>) {
    let req = request(Operation::Update, g("l", Some("5")), u(presented));
    let v = judge_now(&req, strict(6));
    match expect {
        None => assert_eq!(v, Verdict::Allow { reason: Reason::Fenced }),
        Some(e) => assert_eq!(denied(&v), e),
    }
}

// --- Row: DELETE needs a resourceVersion precondition; exempt identities need none.

#[rstest]
#[case::alice_with_precondition(ALICE, true, None)]
#[case::alice_without(ALICE, false, Some((403, Reason::DeletePreconditionRequired)))]
#[case::gc_without(GC, false, None)]
#[case::namespace_controller_without(NSC, false, None)]
fn delete(#[case] user: &str, #[case] precondition: bool, #[case] expect: Option<(u16, Reason)>) {
    let mut req = request(Operation::Delete, g("l", Some("5")), None);
    req.user = user.into();
    req.delete_precondition = precondition;
    let v = judge_now(&req, strict(6));
    match expect {
        None => assert!(matches!(v, Verdict::Allow { reason: Reason::DeletePreconditioned | Reason::Exempt }), "{v:?}"),
        Some(e) => assert_eq!(denied(&v), e),
    }
}

// --- Exempt identities write without a token; the list is configurable.

#[rstest]
#[case::create(Operation::Create, None, g("l", None))]
#[case::update(Operation::Update, g("l", Some("5")), g("l", None))]
#[case::delete(Operation::Delete, g("l", Some("5")), None)]
fn exempt_identities(#[case] op: Operation, #[case] old: Option<ObjectFacts>, #[case] new: Option<ObjectFacts>) {
    let mut req = request(op, old, new);
    req.user = GC.into();
    assert_eq!(read_needed(&req, &Exemptions::default(), None), "none");
    assert_eq!(judge(&req, None, None), Verdict::Allow { reason: Reason::Exempt });
    // With a configured list that leaves the garbage collector out, it is judged like anyone.
    let only_ops = Exemptions::new(["ops"]);
    assert_ne!(read_needed(&req, &only_ops, Some(strict(9))), "none");
    req.user = "ops".into();
    assert_eq!(judge_with(&req, &only_ops, None, None), Verdict::Allow { reason: Reason::Exempt });
}

// --- Row: missing, non-numeric, signed, padded, fractional, overflowing token: deny, naming it.

#[rstest]
#[case::empty("", "empty")]
#[case::space_inside("1 2", "whitespace")]
#[case::leading_space(" 12", "whitespace")]
#[case::trailing_newline("12\n", "whitespace")]
#[case::leading_zero("012", "leading zero")]
#[case::zero_padded_zero("00", "leading zero")]
#[case::plus("+12", "sign")]
#[case::minus("-12", "sign")]
#[case::fraction("12.0", "not a decimal integer")]
#[case::exponent("1e3", "not a decimal integer")]
#[case::hex("0x1f", "not a decimal integer")]
#[case::hex_letters("ff", "not a decimal integer")]
#[case::two_pow_63("9223372036854775808", "larger than")]
#[case::u64_max("18446744073709551615", "larger than")]
#[case::twenty_digits("10000000000000000000", "larger than")]
#[case::arabic_indic_digits("\u{0661}\u{0662}", "not a decimal integer")]
#[case::fullwidth_digits("\u{FF11}\u{FF12}", "not a decimal integer")]
#[case::superscript("\u{00B9}", "not a decimal integer")]
#[case::json_quoted("\"12\"", "not a decimal integer")]
fn malformed_tokens_are_denied_naming_the_problem(
    #[case] raw: &str,
    #[case] names: &str,
    #[values(Operation::Create, Operation::Update)] op: Operation,
) {
    let old = match op {
        Operation::Create => None,
        _ => g("l", Some("5")),
    };
    let req = request(op, old, g("l", Some(raw)));
    let v = judge_now(&req, strict(9));
    let Verdict::Deny { code: 400, reason: Reason::TokenMalformed, message, .. } = &v else { panic!("{raw:?}: {v:?}") };
    assert!(message.contains(names), "{raw:?}: {message}");
    assert!(message.contains(kube_fence_api::names::TOKEN_ANNOTATION), "{message}");
}

#[rstest]
#[case::create(Operation::Create, None)]
#[case::update(Operation::Update, g("l", Some("5")))]
fn missing_token_is_denied(#[case] op: Operation, #[case] old: Option<ObjectFacts>) {
    let req = request(op, old, g("l", None));
    let Verdict::Deny { code: 403, reason: Reason::TokenMissing, message, .. } = judge_now(&req, strict(9)) else { panic!() };
    assert!(message.contains("kubefence.io/token") && message.contains("team/l"), "{message}");
}

#[test]
fn the_largest_token_is_accepted() {
    let max = Token::MAX.to_string();
    let req = request(Operation::Update, g("l", Some("5")), g("l", Some(&max)));
    assert_eq!(judge_now(&req, LeaseFacts { issued: Some(Token::MAX), ..strict(0) }), Verdict::Allow { reason: Reason::Fenced });
}

// --- Warn enforcement: what would be denied is admitted with a warning (except rebinding).

#[rstest]
#[case::stale(Operation::Update, g("l", Some("5")), g("l", Some("4")), Reason::StaleToken)]
#[case::missing(Operation::Update, g("l", Some("5")), g("l", None), Reason::TokenMissing)]
#[case::malformed(Operation::Update, g("l", Some("5")), g("l", Some("-1")), Reason::TokenMalformed)]
#[case::not_issued(Operation::Update, g("l", Some("5")), g("l", Some("99")), Reason::TokenNotIssued)]
#[case::create_stale(Operation::Create, None, g("l", Some("1")), Reason::StaleToken)]
#[case::delete(Operation::Delete, g("l", Some("5")), None, Reason::DeletePreconditionRequired)]
fn warn_mode_admits_with_a_warning(
    #[case] op: Operation,
    #[case] old: Option<ObjectFacts>,
    #[case] new: Option<ObjectFacts>,
    #[case] reason: Reason,
) {
    let req = request(op, old, new);
    let warn = facts(Some(9), Enforcement::Warn);
    // Warn relaxes fencing, so it is confirmed by a quorum read.
    let v = judge(&req, Some(warn.clone()), Some(warn.clone()));
    let Verdict::AllowWithWarning { reason: got, message } = &v else { panic!("{v:?}") };
    assert_eq!(*got, reason);
    assert!(message.contains("Warn"), "{message}");
    // A lease switched to Enforce a moment ago is enforced, though the cache still says Warn.
    assert!(matches!(judge(&req, Some(warn), Some(strict(9))), Verdict::Deny { .. }));
}

#[test]
fn warn_mode_still_admits_good_writes_plainly() {
    let req = request(Operation::Update, g("l", Some("5")), g("l", Some("6")));
    let warn = facts(Some(9), Enforcement::Warn);
    assert_eq!(judge_now(&req, warn), Verdict::Allow { reason: Reason::Fenced });
}

// --- Not guarded, and malformed requests.

#[rstest]
#[case::create(Operation::Create, None, u(None))]
#[case::update(Operation::Update, u(None), u(Some("garbage")))]
#[case::delete(Operation::Delete, u(None), None)]
fn unguarded_objects_pass_without_a_lease_read(#[case] op: Operation, #[case] old: Option<ObjectFacts>, #[case] new: Option<ObjectFacts>) {
    let req = request(op, old, new);
    assert_eq!(read_needed(&req, &Exemptions::default(), None), "none");
    assert_eq!(judge(&req, None, None), Verdict::Allow { reason: Reason::Unguarded });
}

#[rstest]
#[case::update_without_old(Operation::Update, None, g("l", Some("5")))]
#[case::create_without_new(Operation::Create, None, None)]
#[case::update_without_new(Operation::Update, g("l", Some("5")), None)]
#[case::delete_without_old(Operation::Delete, None, None)]
fn malformed_requests_are_denied(#[case] op: Operation, #[case] old: Option<ObjectFacts>, #[case] new: Option<ObjectFacts>) {
    // Even an exempt identity: without the objects nobody can tell whether they are guarded.
    let mut req = request(op, old, new);
    req.user = GC.into();
    assert_eq!(denied(&judge(&req, None, None)), (400, Reason::MalformedRequest));
}

#[rstest]
#[case::empty("")]
#[case::upper("Orders")]
#[case::slash("a/b")]
#[case::too_long(&"a".repeat(254))]
fn invalid_lease_label(#[case] name: &str) {
    let req = request(Operation::Create, None, g(name, Some("1")));
    assert_eq!(read_needed(&req, &Exemptions::default(), None), "none");
    assert_eq!(denied(&judge(&req, None, None)), (400, Reason::LeaseLabelInvalid));
}

// --- Subresources: a write to /status (or any subresource that carries the whole object) is
//     judged exactly like a write to the object when it moves the guard, and passes otherwise.

fn on(subresource: &str, mut req: Request) -> Request {
    req.subresource = Some(subresource.into());
    req
}

#[rstest]
#[case::status_keeps_guard(g("l", Some("5")), g("l", Some("5")), Ok(Reason::GuardUnchanged))]
#[case::status_rewinds_token(g("l", Some("5")), g("l", Some("1")), Err((409, Reason::StaleToken)))]
#[case::status_drops_token(g("l", Some("5")), g("l", None), Err((403, Reason::TokenMissing)))]
#[case::status_unguards(g("l", Some("5")), u(Some("5")), Err((409, Reason::StaleToken)))]
#[case::status_unguards_without_token(g("l", Some("5")), u(None), Err((403, Reason::TokenMissing)))]
#[case::status_rebinds(g("l", Some("5")), g("other", Some("9")), Err((403, Reason::LeaseRebound)))]
#[case::status_with_a_fresh_token(g("l", Some("5")), g("l", Some("6")), Ok(Reason::Fenced))]
#[case::status_guards_with_a_stale_token(u(None), g("l", Some("4")), Err((409, Reason::StaleToken)))]
fn subresource_updates_are_judged_when_they_move_the_guard(
    #[case] old: Option<ObjectFacts>,
    #[case] new: Option<ObjectFacts>,
    #[case] expect: Result<Reason, (u16, Reason)>,
) {
    let req = on("status", request(Operation::Update, old, new));
    let v = judge_now(&req, strict(6));
    match expect {
        Ok(reason) => assert_eq!(v, Verdict::Allow { reason }),
        Err(e) => assert_eq!(denied(&v), e, "{v:?}"),
    }
}

#[test]
fn subresource_creates_make_no_guarded_object() {
    // pods/eviction, pods/binding: the object under admission is not the guarded one.
    let req = on("eviction", request(Operation::Create, None, g("l", None)));
    assert_eq!(judge(&req, None, None), Verdict::Allow { reason: Reason::Unguarded });
}

// --- Finalizer removal from an object being deleted: admitted without a token, and only that.

fn deleting(token: Option<&str>, finalizers: &[&str], content: u64) -> Option<ObjectFacts> {
    Some(ObjectFacts {
        deleting: true,
        finalizers: finalizers.iter().map(|f| f.to_string()).collect(),
        content: Some(crate::admission::judge::facts::Digest::from(content)),
        ..ObjectFacts::guarded("l", token)
    })
}

#[rstest]
#[case::one_of_two(deleting(Some("5"), &["a", "b"], 1), deleting(Some("5"), &["b"], 1), Ok(Reason::FinalizersRemoved))]
#[case::the_last(deleting(Some("5"), &["kubernetes.io/pvc-protection"], 1), deleting(Some("5"), &[], 1), Ok(Reason::FinalizersRemoved))]
#[case::and_content_changed(deleting(Some("5"), &["a"], 1), deleting(Some("5"), &[], 2), Err((409, Reason::StaleToken)))]
#[case::and_token_rewound(deleting(Some("5"), &["a"], 1), deleting(Some("1"), &[], 1), Err((409, Reason::StaleToken)))]
#[case::and_unguarded(deleting(Some("5"), &["a"], 1), Some(ObjectFacts { lease: None, ..deleting(Some("5"), &[], 1).unwrap_or_default() }), Err((409, Reason::StaleToken)))]
#[case::none_removed(deleting(Some("5"), &["a"], 1), deleting(Some("5"), &["a"], 1), Err((409, Reason::StaleToken)))]
#[case::swapped(deleting(Some("5"), &["a", "b"], 1), deleting(Some("5"), &["c"], 1), Err((409, Reason::StaleToken)))]
#[case::not_being_deleted(Some(ObjectFacts { deleting: false, ..deleting(Some("5"), &["a"], 1).unwrap_or_default() }), Some(ObjectFacts { deleting: false, ..deleting(Some("5"), &[], 1).unwrap_or_default() }), Err((409, Reason::StaleToken)))]
#[case::content_unknown(Some(ObjectFacts { content: None, ..deleting(Some("5"), &["a"], 1).unwrap_or_default() }), Some(ObjectFacts { content: None, ..deleting(Some("5"), &[], 1).unwrap_or_default() }), Err((409, Reason::StaleToken)))]
fn finalizer_removal_from_an_object_being_deleted(
    #[case] old: Option<ObjectFacts>,
    #[case] new: Option<ObjectFacts>,
    #[case] expect: Result<Reason, (u16, Reason)>,
) {
    let req = request(Operation::Update, old, new);
    let v = judge_now(&req, strict(6));
    match expect {
        Ok(reason) => {
            assert_eq!(v, Verdict::Allow { reason });
            assert_eq!(read_needed(&req, &Exemptions::default(), None), "none");
        }
        Err(e) => assert_eq!(denied(&v), e, "{v:?}"),
    }
}

// --- Holder-only objects (`kubefence.io/writer: holder`) of identity-bound leases: every write,
//     subresources and deletes included, comes from the lease's current holder, read by quorum.
//     Threat case: a stale holder (paused, partitioned) and a worker with ordinary RBAC alike —
//     tokens are readable, identities are not forgeable.

/// A holder-only guarded side.
fn h(token: Option<&str>) -> Option<ObjectFacts> {
    Some(ObjectFacts { writer: Some(kube_fence_api::names::HOLDER_ONLY.into()), ..ObjectFacts::guarded("l", token) })
}

/// A lease bound to Pods, held by `holder` with newest token `issued`.
fn bound(issued: u64, holder: Option<&str>) -> LeaseFacts {
    LeaseFacts { identity: Some(HolderIdentity::Pod), holder: holder.map(str::to_string), ..strict(issued) }
}

/// A request from Pod `pod` (a Pod-bound ServiceAccount token).
fn from_pod(pod: &str, mut req: Request) -> Request {
    req.user = "system:serviceaccount:team:worker".into();
    req.pod = PodIdentity::of(&req.user, Some(pod));
    req
}

/// Threat: a worker with ordinary RBAC in the lease's namespace whose Pod, in another namespace,
/// has the holder's name. It is not the holder of a lease in `team`.
#[test]
fn a_pod_of_another_namespace_is_not_the_holder() {
    let mut req = on("status", from_pod("a", request(Operation::Update, h(Some("5")), h(Some("5")))));
    req.user = "system:serviceaccount:elsewhere:worker".into();
    req.pod = PodIdentity::of(&req.user, Some("a"));
    let Verdict::Deny { code, reason, message, .. } = judge_now(&req, bound(6, Some("a"))) else { panic!("expected a denial") };
    assert_eq!((code, reason), (409, Reason::NotHolder));
    assert!(message.contains("Pod elsewhere/a, which is not in the lease's namespace team"), "{message}");
}

#[rstest]
#[case::service_account("system:serviceaccount:team:worker", Some("a"), Some(("team", "a")))]
#[case::no_pod_name("system:serviceaccount:team:worker", None, None)]
#[case::empty_pod_name("system:serviceaccount:team:worker", Some(""), None)]
#[case::not_a_service_account("alice", Some("a"), None)]
#[case::no_namespace("system:serviceaccount::worker", Some("a"), None)]
#[case::no_account_name_separator("system:serviceaccount:team", Some("a"), None)]
fn a_pod_identity_is_a_service_account_namespace_and_a_pod_name(
    #[case] user: &str,
    #[case] pod: Option<&str>,
    #[case] expect: Option<(&str, &str)>,
) {
    let got = PodIdentity::of(user, pod);
    assert_eq!(got.as_ref().map(|p| (p.namespace.as_str(), p.name.as_str())), expect);
}

#[rstest]
#[case::status_by_the_holder("a", "status", h(Some("5")), h(Some("5")), Ok(Reason::GuardUnchanged))]
#[case::status_by_the_ex_holder("b", "status", h(Some("5")), h(Some("5")), Err((409, Reason::NotHolder)))]
#[case::status_moving_the_guard_by_the_holder("a", "status", h(Some("5")), h(Some("1")), Err((409, Reason::StaleToken)))]
#[case::update_by_the_holder("a", "", h(Some("5")), h(Some("6")), Ok(Reason::Fenced))]
#[case::update_by_the_ex_holder_with_a_fresh_token("b", "", h(Some("5")), h(Some("6")), Err((409, Reason::NotHolder)))]
#[case::create_by_the_ex_holder("b", "", None, h(Some("6")), Err((409, Reason::NotHolder)))]
#[case::removing_the_label_by_the_ex_holder("b", "", h(Some("5")), g("l", Some("6")), Err((409, Reason::NotHolder)))]
#[case::adding_the_label_by_the_ex_holder("b", "", g("l", Some("5")), h(Some("6")), Err((409, Reason::NotHolder)))]
fn holder_only_writes(
    #[case] pod: &str,
    #[case] subresource: &str,
    #[case] old: Option<ObjectFacts>,
    #[case] new: Option<ObjectFacts>,
    #[case] expect: Result<Reason, (u16, Reason)>,
) {
    let operation = if old.is_some() { Operation::Update } else { Operation::Create };
    let mut req = from_pod(pod, request(operation, old, new));
    req.subresource = Some(subresource.to_string()).filter(|s| !s.is_empty());
    // Every holder-only write needs who holds the lease now: a quorum read, never the cache.
    assert_eq!(read_needed(&req, &Exemptions::default(), Some(bound(6, Some("a")))), "quorum");
    // The cache still names the ex-holder: it is not consulted.
    let v = judge(&req, Some(bound(5, Some("b"))), Some(bound(6, Some("a"))));
    match expect {
        Ok(reason) => assert_eq!(v, Verdict::Allow { reason }),
        Err(e) => assert_eq!(denied(&v), e, "{v:?}"),
    }
}

#[test]
fn a_holder_only_denial_names_the_holder_and_the_requester() {
    let req = on("status", from_pod("b", request(Operation::Update, h(Some("5")), h(Some("5")))));
    let Verdict::Deny { facts, message, .. } = judge_now(&req, bound(6, Some("a"))) else { panic!("expected a denial") };
    assert_eq!((facts.holder.as_deref(), facts.requester.as_deref()), (Some("a"), Some("b")));
    assert_eq!(facts.lease.as_deref(), Some("team/l"));
    assert!(message.contains("held by a") && message.contains("from b"), "{message}");
}

#[rstest]
#[case::unheld(bound(6, None), Err((409, Reason::NotHolder)))]
#[case::held_by_the_pod(bound(6, Some("a")), Ok(Reason::GuardUnchanged))]
#[case::no_pod_identity_in_the_request(bound(6, Some("system:serviceaccount:team:worker")), Err((409, Reason::NotHolder)))]
#[case::user_bound(LeaseFacts { identity: Some(HolderIdentity::User), ..bound(6, Some("system:serviceaccount:team:worker")) }, Ok(Reason::GuardUnchanged))]
#[case::user_bound_held_by_another(LeaseFacts { identity: Some(HolderIdentity::User), ..bound(6, Some("bob")) }, Err((409, Reason::NotHolder)))]
#[case::lease_not_bound(LeaseFacts { identity: None, ..bound(6, Some("a")) }, Err((403, Reason::NotHolder)))]
#[case::warn_lease(LeaseFacts { enforcement: Enforcement::Warn, ..bound(6, Some("b")) }, Ok(Reason::NotHolder))]
fn the_holder_check_by_lease_kind(#[case] lease: LeaseFacts, #[case] expect: Result<Reason, (u16, Reason)>) {
    let mut req = on("status", from_pod("a", request(Operation::Update, h(Some("5")), h(Some("5")))));
    if lease.holder.as_deref() == Some("system:serviceaccount:team:worker") && lease.identity == Some(HolderIdentity::Pod) {
        req.pod = None;
    }
    let v = judge_now(&req, lease);
    match expect {
        Ok(reason) => assert_eq!(v.reason(), reason, "{v:?}"),
        Err(e) => assert_eq!(denied(&v), e, "{v:?}"),
    }
    assert!(matches!(judge(&req, None, None), Verdict::Deny { code: 403, reason: Reason::LeaseNotFound, .. }));
}

#[rstest]
#[case::preconditioned_by_the_holder("a", true, Ok(Reason::DeletePreconditioned))]
#[case::preconditioned_by_the_ex_holder("b", true, Err((409, Reason::NotHolder)))]
#[case::unconditional_by_the_holder("a", false, Err((403, Reason::DeletePreconditionRequired)))]
#[case::unconditional_by_the_ex_holder("b", false, Err((409, Reason::NotHolder)))]
fn holder_only_deletes(#[case] pod: &str, #[case] precondition: bool, #[case] expect: Result<Reason, (u16, Reason)>) {
    let mut req = from_pod(pod, request(Operation::Delete, h(Some("5")), None));
    req.delete_precondition = precondition;
    assert_eq!(read_needed(&req, &Exemptions::default(), Some(bound(6, Some("a")))), "quorum");
    let v = judge(&req, Some(bound(6, Some("b"))), Some(bound(6, Some("a"))));
    match expect {
        Ok(reason) => assert_eq!(v, Verdict::Allow { reason }),
        Err(e) => assert_eq!(denied(&v), e, "{v:?}"),
    }
}

#[rstest]
// The holder of the grant that issued the recorded token writes again: no write annotation needed.
#[case::the_holder_of_this_grant(6, Some("a"), None, Ok(Reason::Fenced))]
// The same Pod after it lost and regained the lease (a newer grant): its equal token is old.
#[case::the_holder_of_a_newer_grant(7, Some("a"), Some("w2"), Err((409, Reason::StaleToken)))]
#[case::another_pod(6, Some("b"), Some("w2"), Err((409, Reason::NotHolder)))]
fn allow_equal_on_a_holder_only_object_means_the_holder_of_this_grant(
    #[case] issued: u64,
    #[case] holder: Option<&str>,
    #[case] write: Option<&str>,
    #[case] expect: Result<Reason, (u16, Reason)>,
) {
    let side = |w: Option<&str>| Some(ObjectFacts { write: w.map(str::to_string), ..h(Some("6")).unwrap_or_default() });
    let req = from_pod("a", request(Operation::Update, side(Some("w1")), side(write.or(Some("w1")))));
    let v = judge_now(&req, LeaseFacts { comparison: Comparison::AllowEqual, ..bound(issued, holder) });
    match expect {
        Ok(reason) => assert_eq!(v, Verdict::Allow { reason }),
        Err(e) => assert_eq!(denied(&v), e, "{v:?}"),
    }
}

#[rstest]
#[case::a_typo(Some("Holder"), Err((400, Reason::WriterLabelInvalid)))]
#[case::another_value(Some("anyone"), Err((400, Reason::WriterLabelInvalid)))]
fn the_writer_label_has_one_value(#[case] value: Option<&str>, #[case] expect: Result<Reason, (u16, Reason)>) {
    let new = Some(ObjectFacts { writer: value.map(str::to_string), ..ObjectFacts::guarded("l", Some("6")) });
    let req = from_pod("a", request(Operation::Update, g("l", Some("5")), new));
    assert_eq!(read_needed(&req, &Exemptions::default(), None), "none");
    match expect {
        Ok(reason) => assert_eq!(judge_now(&req, bound(6, Some("a"))), Verdict::Allow { reason }),
        Err(e) => assert_eq!(denied(&judge_now(&req, bound(6, Some("a")))), e),
    }
}

#[test]
fn holder_only_objects_still_let_exempt_controllers_and_finalizer_removal_through() {
    let gc = Request { user: GC.into(), ..request(Operation::Delete, h(Some("5")), None) };
    assert_eq!(judge(&gc, None, None), Verdict::Allow { reason: Reason::Exempt });
    let side = |finalizers: &[&str]| {
        Some(ObjectFacts {
            deleting: true,
            content: Some(crate::admission::judge::facts::Digest::from(1)),
            finalizers: finalizers.iter().map(|f| f.to_string()).collect(),
            ..h(Some("5")).unwrap_or_default()
        })
    };
    let req = from_pod("b", request(Operation::Update, side(&["a"]), side(&[])));
    assert_eq!(judge(&req, None, None), Verdict::Allow { reason: Reason::FinalizersRemoved });
}
