//! Fuzzing the admission path with property tests (issue 8): token strings, arbitrary bodies,
//! and valid AdmissionReviews mutated at random go through the server's parsing
//! ([`review::decode`], [`review::request_facts`]) and the pure decision
//! (the pipeline: the plan and the reads it asks for, from the in-memory `FakeLeases`) against
//! arbitrary lease states, in the watch cache and in the quorum.
//!
//! Properties: nothing panics; a token is accepted only in its one canonical spelling; and no
//! write to a guarded object by a non-exempt user is ever allowed (outside `Warn` enforcement)
//! unless it carries a valid token that is fresh by the decision table. Pure: no cluster.
//! `PROPTEST_CASES` raises the number of cases (default 256 per property).

use std::str::FromStr;

use futures::FutureExt;
use kube_fence::admission::http::review::{self as server, Unreadable};
use kube_fence::admission::judge::exemptions::Exemptions;
use kube_fence::admission::judge::facts::{LeaseFacts, Operation, Request};
use kube_fence::admission::judge::fake::{FakeLeases, ReadCounts};
use kube_fence::admission::judge::pipeline::{self, Judging, Sent};
use kube_fence::admission::judge::verdict::Verdict;
use kube_fence_api::denial::Reason;
use kube_fence_api::names::{LEASE_LABEL, TOKEN_ANNOTATION};
use kube_fence_api::token::Token;
use kube_fence_api::{Comparison, Enforcement};
use proptest::prelude::*;
use proptest::sample::select;
use serde_json::{Value, json};

const MAX: u64 = i64::MAX as u64;

/// Strings that look like tokens, nearly look like tokens, or are anything at all.
fn token_text() -> impl Strategy<Value = String> {
    prop_oneof![
        (0..=MAX).prop_map(|n| n.to_string()),
        (MAX..=u64::MAX).prop_map(|n| n.to_string()),
        "[+-]?[0-9]{0,21}",
        "[ \t]?0*[0-9]{1,19}[ \t.e]?[0-9]?",
        "[0-9a-fA-FxX_,.]{0,12}",
        "\\PC{0,24}",
        "[٠-٩０-９]{1,4}",
    ]
}

proptest! {
    #[test]
    fn a_token_has_exactly_one_spelling(s in token_text()) {
        match Token::from_str(&s) {
            Ok(t) => {
                prop_assert_eq!(t.to_string(), s.clone(), "accepted a non-canonical spelling");
                prop_assert!(t.get() <= MAX);
                prop_assert!(s.bytes().all(|b| b.is_ascii_digit()) && !s.is_empty());
                prop_assert!(s == "0" || !s.starts_with('0'));
            }
            Err(err) => {
                // The reason names the problem: it quotes the input (except for the empty one).
                prop_assert!(s.is_empty() || err.to_string().contains(&format!("{s:?}")), "{err}");
            }
        }
    }

    #[test]
    fn every_u63_round_trips_and_nothing_above_parses(n in any::<u64>()) {
        let parsed = Token::from_str(&n.to_string());
        if n <= MAX {
            prop_assert_eq!(parsed.map(Token::get), Ok(n));
        } else {
            prop_assert!(parsed.is_err());
        }
    }

    #[test]
    fn arbitrary_bytes_never_panic(body in proptest::collection::vec(any::<u8>(), 0..512)) {
        let _ = server::decode(&body);
    }
}

/// One side of an object under review: its lease label and token annotation (either may be
/// absent, garbage, or of the wrong JSON type).
#[derive(Clone, Debug)]
struct Side {
    lease: Option<Value>,
    token: Option<Value>,
}

fn side() -> impl Strategy<Value = Option<Side>> {
    let lease = prop_oneof![
        3 => Just(Some(json!("work"))),
        1 => Just(Some(json!("other"))),
        1 => Just(None),
        1 => "\\PC{0,8}".prop_map(|s| Some(json!(s))),
        1 => Just(Some(json!(7))),
    ];
    let token = prop_oneof![
        4 => (0u64..6).prop_map(|n| Some(json!(n.to_string()))),
        2 => token_text().prop_map(|s| Some(json!(s))),
        1 => Just(None),
        1 => any::<i64>().prop_map(|n| Some(json!(n))),
    ];
    proptest::option::weighted(0.9, (lease, token).prop_map(|(lease, token)| Side { lease, token }))
}

fn object(side: &Side) -> Value {
    let mut metadata = json!({"name": "x", "namespace": "ns"});
    if let Some(l) = &side.lease {
        metadata["labels"] = json!({ LEASE_LABEL: l });
    }
    if let Some(t) = &side.token {
        metadata["annotations"] = json!({ TOKEN_ANNOTATION: t });
    }
    json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": {"k": "v"}})
}

fn review(operation: &str, user: &str, old: &Option<Side>, new: &Option<Side>, precondition: Option<&str>) -> Value {
    let mut request = json!({
        "uid": "u-1",
        "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
        "resource": {"group": "", "version": "v1", "resource": "configmaps"},
        "name": "x", "namespace": "ns", "operation": operation,
        "userInfo": {"username": user},
    });
    if let Some(o) = old {
        request["oldObject"] = object(o);
    }
    if let Some(n) = new {
        request["object"] = object(n);
    }
    if let Some(rv) = precondition {
        request["options"] = json!({"apiVersion": "meta.k8s.io/v1", "kind": "DeleteOptions", "preconditions": {"resourceVersion": rv}});
    }
    json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": request})
}

/// Any JSON value, small.
fn any_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<f64>().prop_map(Value::from),
        "\\PC{0,10}".prop_map(Value::from),
    ];
    leaf.prop_recursive(3, 16, 4, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::from),
            proptest::collection::btree_map("[a-zA-Z./]{0,8}", inner, 0..4).prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Where mutations land: the fields the webhook reads, and their parents.
const POINTERS: [&str; 16] = [
    "",
    "/apiVersion",
    "/kind",
    "/request",
    "/request/uid",
    "/request/operation",
    "/request/namespace",
    "/request/userInfo",
    "/request/userInfo/username",
    "/request/options",
    "/request/object",
    "/request/object/metadata",
    "/request/object/metadata/labels",
    "/request/object/metadata/annotations",
    "/request/oldObject/metadata/annotations",
    "/request/kind",
];

#[derive(Clone, Debug)]
enum Mutation {
    Remove(&'static str),
    Replace(&'static str, Value),
    /// Byte-level: overwrite byte `at % len` with `byte`.
    Flip(usize, u8),
    /// Byte-level: cut the serialized body at `at % len`.
    Truncate(usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        select(&POINTERS[..]).prop_map(Mutation::Remove),
        (select(&POINTERS[..]), any_json()).prop_map(|(p, v)| Mutation::Replace(p, v)),
        (any::<usize>(), any::<u8>()).prop_map(|(at, b)| Mutation::Flip(at, b)),
        any::<usize>().prop_map(Mutation::Truncate),
    ]
}

fn apply(mut value: Value, mutations: &[Mutation]) -> Vec<u8> {
    let mut bytes = None;
    for m in mutations {
        match m {
            Mutation::Remove(p) | Mutation::Replace(p, _) => {
                let (parent, key) = p.rsplit_once('/').unwrap_or(("", ""));
                let replacement = if let Mutation::Replace(_, v) = m { Some(v.clone()) } else { None };
                if p.is_empty() {
                    value = replacement.unwrap_or(Value::Null);
                } else if let Some(Value::Object(map)) = value.pointer_mut(parent) {
                    match replacement {
                        Some(v) => {
                            map.insert(key.to_string(), v);
                        }
                        None => {
                            map.remove(key);
                        }
                    }
                }
            }
            Mutation::Flip(at, b) => {
                let body = bytes.get_or_insert_with(|| serde_json::to_vec(&value).unwrap_or_default());
                if !body.is_empty() {
                    let i = at % body.len();
                    body[i] = *b;
                }
            }
            Mutation::Truncate(at) => {
                let body = bytes.get_or_insert_with(|| serde_json::to_vec(&value).unwrap_or_default());
                if !body.is_empty() {
                    let i = at % body.len();
                    body.truncate(i);
                }
            }
        }
    }
    bytes.unwrap_or_else(|| serde_json::to_vec(&value).unwrap_or_default())
}

fn lease() -> impl Strategy<Value = Option<LeaseFacts>> {
    let facts = (
        proptest::option::of((0u64..6).prop_map(|n| Token::new(n).unwrap_or(Token::MAX))),
        select(vec![Comparison::Strict, Comparison::AllowEqual]),
        prop_oneof![9 => Just(Enforcement::Enforce), 1 => Just(Enforcement::Warn)],
    )
        .prop_map(|(issued, comparison, enforcement)| LeaseFacts { issued, comparison, enforcement, ..LeaseFacts::default() });
    proptest::option::weighted(0.9, facts)
}

/// Judges as the server does — the pipeline: the plan, then the reads it asks for — with the
/// watch cache holding `cached` and a quorum read returning `current`; also returns the lease
/// facts the verdict was judged by.
fn judge(req: &Request, exempt: &Exemptions, cached: &Option<LeaseFacts>, current: &Option<LeaseFacts>) -> (Verdict, Option<LeaseFacts>) {
    let mut leases = FakeLeases::default();
    for name in [&req.old, &req.new].into_iter().flatten().filter_map(|side| side.lease.as_deref()) {
        if let Some(cached) = cached {
            leases = leases.with_cached(&req.namespace, name, cached.clone());
        }
        if let Some(current) = current {
            leases = leases.with_current(&req.namespace, name, current.clone());
        }
    }
    let judging = Judging { exempt: exempt.clone(), ..Judging::default() };
    let verdict = pipeline::judge(req, &judging, Sent::Objects, &leases).now_or_never().expect("the fake answers at once");
    let judged_by = match leases.reads() {
        ReadCounts { quorum: 1.., .. } => current.clone(),
        ReadCounts { cached: 1.., .. } => cached.clone(),
        _ => None,
    };
    (verdict, judged_by)
}

/// The oracle: what any allowed write must satisfy (docs/design.md §5).
fn check_verdict(req: &Request, exempt: &Exemptions, facts: Option<&LeaseFacts>, verdict: &Verdict) -> Result<(), TestCaseError> {
    let old_lease = req.old.as_ref().and_then(|o| o.lease.as_deref());
    let new_lease = req.new.as_ref().and_then(|n| n.lease.as_deref());
    let guarded = old_lease.is_some() || new_lease.is_some();
    let fenced_op = matches!(req.operation, Operation::Create | Operation::Update);
    if !matches!(verdict, Verdict::Allow { .. }) || !guarded || !fenced_op || exempt.contains(&req.user) {
        return Ok(());
    }
    prop_assert_eq!(verdict.reason(), Reason::Fenced, "a guarded write was allowed for another reason");
    prop_assert!(facts.is_some(), "allowed without knowing the lease");
    let facts = facts.unwrap_or_else(|| unreachable!());
    // A plain Allow must satisfy the whole table whatever the enforcement: Warn only turns
    // denials into warnings (AllowWithWarning), never a stale write into a plain Allow.
    let raw = req.new.as_ref().and_then(|n| n.token.as_deref());
    let presented = raw.and_then(|t| Token::from_str(t).ok());
    prop_assert!(presented.is_some(), "allowed a guarded write with the invalid token {:?}", raw);
    let t = presented.unwrap_or_else(|| unreachable!());
    let issued = facts.issued;
    prop_assert!(issued.is_some_and(|i| t <= i), "allowed token {} that the lease (newest {:?}) never issued", t, issued);
    if old_lease.is_some() && new_lease.is_some() {
        prop_assert_eq!(old_lease, new_lease, "allowed rebinding to another lease");
    }
    let recorded = old_lease.and(req.old.as_ref().and_then(|o| o.token.as_deref())).and_then(|r| Token::from_str(r).ok());
    match recorded {
        Some(r) if facts.comparison == Comparison::Strict => prop_assert!(t > r, "allowed {} over recorded {}", t, r),
        // The reviews generated here carry no kubefence.io/write annotation: an equal token
        // is never restated, so it is stale under AllowEqual too.
        Some(r) => prop_assert!(t > r, "allowed {} over recorded {} without a restatement", t, r),
        None => prop_assert_eq!(Some(t), issued, "a create / newly guarded write must carry the newest token"),
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn mutated_reviews_never_panic_and_never_allow_an_invalid_token(
        operation in select(vec!["CREATE", "UPDATE", "DELETE", "CONNECT", "PATCH", ""]),
        user in select(vec!["alice", "system:serviceaccount:kube-system:generic-garbage-collector", ""]),
        old in side(),
        new in side(),
        precondition in proptest::option::of(select(vec!["42", ""])),
        mutations in proptest::collection::vec(mutation(), 0..3),
        cached in lease(),
        current in lease(),
    ) {
        let body = apply(review(operation, user, &old, &new, precondition), &mutations);
        let exempt = Exemptions::default();
        match server::decode(&body) {
            Ok(request) => {
                let req = server::request_facts(&request);
                let (verdict, facts) = judge(&req, &exempt, &cached, &current);
                check_verdict(&req, &exempt, facts.as_ref(), &verdict)?;
            }
            Err(Unreadable::Malformed { uid, message }) => {
                prop_assert!(!message.is_empty());
                prop_assert!(!uid.is_empty() || body.windows(6).any(|w| w == b"\"uid\":"));
            }
            Err(Unreadable::NotAReview(message)) => prop_assert!(!message.is_empty()),
        }
    }

    /// Without mutations every review is readable, and the verdict for a plain guarded UPDATE
    /// is exactly the table's.
    #[test]
    fn unmutated_updates_follow_the_table(old_token in 0u64..40, new_token in 0u64..40, issued in 0u64..40, cache_lag in 0u64..3) {
        let side = |t: u64| Some(Side { lease: Some(json!("work")), token: Some(json!(t.to_string())) });
        let body = apply(review("UPDATE", "alice", &side(old_token), &side(new_token), None), &[]);
        let request = server::decode(&body).map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
        let req = server::request_facts(&request);
        let facts = |issued: u64| Some(LeaseFacts { issued: Token::new(issued), comparison: Comparison::Strict, enforcement: Enforcement::Enforce, ..LeaseFacts::default() });
        // The watch cache may lag behind the quorum; the verdict must not depend on it.
        let (verdict, _) = judge(&req, &Exemptions::default(), &facts(issued.saturating_sub(cache_lag)), &facts(issued));
        let fresh = new_token > old_token;
        prop_assert_eq!(verdict.is_allowed(), fresh && new_token <= issued, "{:?}", verdict);
        if !fresh {
            prop_assert!(matches!(verdict, Verdict::Deny { code: 409, reason: Reason::StaleToken, .. }), "{:?}", verdict);
        }
    }
}
