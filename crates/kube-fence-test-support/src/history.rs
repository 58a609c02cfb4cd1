//! The history checker: given what a run observed — every grant a lease made and every write
//! the API server accepted to a guarded object, each with the resourceVersion at which a watch
//! saw it — find every violation of kube-fence's invariants.
//!
//! - per lease: tokens strictly increase from grant to grant, and no token goes to two holders;
//! - per guarded object: accepted tokens strictly increase (`>=` for leases in `AllowEqual`
//!   mode), so no write authorised by token n was accepted after one authorised by a greater token;
//! - every accepted write carries a token its lease granted (checked for the leases whose grants
//!   the history recorded);
//! - per holder-only object (writes judged by who asks, e.g. `/status`): no write by a holder is
//!   accepted after a write by the holder of a newer grant, and every such write comes from a
//!   holder the lease granted to before it.
//!
//! Pure: tests and the fault-injection driver record, this judges. A test oracle, not part of what
//! workers use.

use std::collections::{BTreeMap, HashMap};

use kube_fence_api::token::Token;

/// One thing a watch observed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Observation {
    /// A Lease status showing `holder` holding `token` (renewals repeat the same grant).
    Grant { lease: String, holder: String, token: Token, resource_version: u64 },
    /// A guarded object version the API server accepted, bound to `lease` and carrying `token`.
    Write { object: String, lease: String, token: Token, resource_version: u64 },
    /// A holder-only object version (a `/status` write carries no token) the API server
    /// accepted from `holder`, bound to `lease`.
    HolderWrite { object: String, lease: String, holder: String, resource_version: u64 },
}

/// A broken invariant, with what is needed to find it in the recorded history.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Violation {
    /// A grant's token was not greater than the previous grant's.
    TokenNotIncreasing { lease: String, previous: Token, next: Token, resource_version: u64 },
    /// One token was granted to two different holders.
    TokenGrantedTwice { lease: String, token: Token, first: String, second: String },
    /// A write was accepted after one with a greater (or, in strict mode, equal) token.
    StaleWriteAccepted { object: String, recorded: Token, accepted: Token, resource_version: u64 },
    /// A write was accepted with a token its lease never granted.
    TokenNeverGranted { object: String, lease: String, token: Token, resource_version: u64 },
    /// A holder's write was accepted after a write by the holder of a newer grant.
    StaleHolderWriteAccepted { object: String, holder: String, grant: Token, newer: Token, resource_version: u64 },
    /// A write was accepted from someone the lease had not granted to before it.
    WriterNeverGranted { object: String, lease: String, holder: String, resource_version: u64 },
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Violation::TokenNotIncreasing { lease, previous, next, resource_version } => {
                write!(
                    f,
                    "lease {lease}: grant at resourceVersion {resource_version} has token {next}, not greater than the previous grant's {previous}"
                )
            }
            Violation::TokenGrantedTwice { lease, token, first, second } => {
                write!(f, "lease {lease}: token {token} was granted to both {first} and {second}")
            }
            Violation::StaleWriteAccepted { object, recorded, accepted, resource_version } => {
                write!(
                    f,
                    "object {object}: write with token {accepted} accepted at resourceVersion {resource_version} after token {recorded}"
                )
            }
            Violation::TokenNeverGranted { object, lease, token, resource_version } => {
                write!(
                    f,
                    "object {object}: write with token {token} accepted at resourceVersion {resource_version}, but lease {lease} never granted that token"
                )
            }
            Violation::StaleHolderWriteAccepted { object, holder, grant, newer, resource_version } => {
                write!(
                    f,
                    "object {object}: write by {holder} (grant {grant}) accepted at resourceVersion {resource_version} after a write under the newer grant {newer}"
                )
            }
            Violation::WriterNeverGranted { object, lease, holder, resource_version } => {
                write!(
                    f,
                    "object {object}: write by {holder} accepted at resourceVersion {resource_version}, but lease {lease} had not granted to {holder} before it"
                )
            }
        }
    }
}

/// Checks a history. `allow_equal(object)` says whether that object's lease admits equal tokens.
///
/// The same grant or write may be observed more than once (by a watch and by the worker that
/// made it, or again after a watch re-lists); observations with one resourceVersion count once.
/// A watch that re-lists may also miss versions: the checks then judge fewer transitions, never
/// report one that did not happen.
pub fn check(observations: &[Observation], allow_equal: impl Fn(&str) -> bool) -> Vec<Violation> {
    let mut violations = Vec::new();
    // Order each stream by resourceVersion: that is the order etcd committed them in.
    let mut grants: BTreeMap<&str, Vec<(u64, &str, Token)>> = BTreeMap::new();
    let mut writes: BTreeMap<&str, Vec<(u64, Token)>> = BTreeMap::new();
    let mut granted: HashMap<&str, std::collections::HashSet<Token>> = HashMap::new();
    for o in observations {
        match o {
            Observation::Grant { lease, holder, token, resource_version } => {
                grants.entry(lease).or_default().push((*resource_version, holder, *token));
                granted.entry(lease).or_default().insert(*token);
            }
            Observation::Write { object, token, resource_version, .. } => {
                writes.entry(object).or_default().push((*resource_version, *token))
            }
            Observation::HolderWrite { .. } => {}
        }
    }
    violations.extend(check_holder_writes(observations, &grants));
    for o in observations {
        if let Observation::Write { object, lease, token, resource_version } = o
            && granted.get(lease.as_str()).is_some_and(|tokens| !tokens.contains(token))
        {
            let v = Violation::TokenNeverGranted {
                object: object.clone(),
                lease: lease.clone(),
                token: *token,
                resource_version: *resource_version,
            };
            if !violations.contains(&v) {
                violations.push(v);
            }
        }
    }
    for (lease, mut seen) in grants {
        seen.sort_by_key(|(rv, _, _)| *rv);
        seen.dedup();
        let mut holder_of: HashMap<Token, &str> = HashMap::new();
        // The newest grant so far; seeing it again is a renewal, not a new grant.
        let mut newest: Option<(Token, &str)> = None;
        for (rv, holder, token) in seen {
            if newest == Some((token, holder)) {
                continue;
            }
            if let Some(first) = holder_of.get(&token).copied() {
                if first != holder {
                    violations.push(Violation::TokenGrantedTwice {
                        lease: lease.to_string(),
                        token,
                        first: first.to_string(),
                        second: holder.to_string(),
                    });
                    continue;
                }
            } else {
                holder_of.insert(token, holder);
            }
            match newest {
                Some((max, _)) if token <= max => violations.push(Violation::TokenNotIncreasing {
                    lease: lease.to_string(),
                    previous: max,
                    next: token,
                    resource_version: rv,
                }),
                _ => newest = Some((token, holder)),
            }
        }
    }
    for (object, mut seen) in writes {
        seen.sort_by_key(|(rv, _)| *rv);
        seen.dedup_by_key(|(rv, _)| *rv);
        let equal_ok = allow_equal(object);
        let mut recorded: Option<Token> = None;
        for (rv, token) in seen {
            if let Some(r) = recorded {
                let admitted = if equal_ok { token >= r } else { token > r };
                if !admitted {
                    violations.push(Violation::StaleWriteAccepted {
                        object: object.to_string(),
                        recorded: r,
                        accepted: token,
                        resource_version: rv,
                    });
                }
            }
            recorded = Some(recorded.map_or(token, |r| r.max(token)));
        }
    }
    violations
}

/// Holder-only writes carry no token: each is attributed to the newest grant its holder had been
/// given before it committed, and per object those grants never go back.
fn check_holder_writes(observations: &[Observation], grants: &BTreeMap<&str, Vec<(u64, &str, Token)>>) -> Vec<Violation> {
    let mut violations = Vec::new();
    let mut writes: BTreeMap<&str, Vec<(u64, &str, &str)>> = BTreeMap::new();
    for o in observations {
        if let Observation::HolderWrite { object, lease, holder, resource_version } = o {
            writes.entry(object).or_default().push((*resource_version, lease, holder));
        }
    }
    for (object, mut seen) in writes {
        seen.sort();
        seen.dedup_by_key(|(rv, ..)| *rv);
        let mut newest: Option<Token> = None;
        for (rv, lease, holder) in seen {
            let grant = grants
                .get(lease)
                .into_iter()
                .flatten()
                .filter(|(grant_rv, who, _)| *grant_rv < rv && *who == holder)
                .map(|(_, _, token)| *token)
                .max();
            let Some(grant) = grant else {
                violations.push(Violation::WriterNeverGranted {
                    object: object.to_string(),
                    lease: lease.to_string(),
                    holder: holder.to_string(),
                    resource_version: rv,
                });
                continue;
            };
            match newest {
                Some(newer) if grant < newer => violations.push(Violation::StaleHolderWriteAccepted {
                    object: object.to_string(),
                    holder: holder.to_string(),
                    grant,
                    newer,
                    resource_version: rv,
                }),
                _ => newest = Some(newest.map_or(grant, |n| n.max(grant))),
            }
        }
    }
    violations
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    fn t(n: u64) -> Token {
        Token::new(n).expect("test token in range")
    }
    fn grant(lease: &str, holder: &str, token: u64, rv: u64) -> Observation {
        Observation::Grant { lease: lease.into(), holder: holder.into(), token: t(token), resource_version: rv }
    }
    fn write(object: &str, token: u64, rv: u64) -> Observation {
        Observation::Write { object: object.into(), lease: "l".into(), token: t(token), resource_version: rv }
    }

    #[rstest]
    #[case::empty(vec![], 0)]
    #[case::increasing_grants(vec![grant("l", "a", 5, 5), grant("l", "b", 9, 9), grant("l", "a", 12, 12)], 0)]
    #[case::renewals_repeat_a_grant(vec![grant("l", "a", 5, 5), grant("l", "a", 5, 7), grant("l", "a", 5, 8), grant("l", "b", 10, 10)], 0)]
    #[case::observed_out_of_order_but_committed_in_order(vec![grant("l", "b", 9, 9), grant("l", "a", 5, 5)], 0)]
    #[case::planted_regression(vec![grant("l", "a", 5, 5), grant("l", "b", 9, 9), grant("l", "c", 7, 11)], 1)]
    #[case::planted_reissue(vec![grant("l", "a", 5, 5), grant("l", "b", 5, 6)], 1)]
    #[case::leases_are_independent(vec![grant("l1", "a", 9, 9), grant("l2", "a", 5, 10)], 0)]
    #[case::increasing_writes(vec![write("o", 5, 20), write("o", 9, 21), write("o", 12, 22)], 0)]
    #[case::planted_stale_write(vec![write("o", 5, 20), write("o", 9, 21), write("o", 7, 22)], 1)]
    #[case::planted_equal_write_in_strict_mode(vec![write("o", 5, 20), write("o", 5, 21)], 1)]
    #[case::objects_are_independent(vec![write("o1", 9, 20), write("o2", 5, 21)], 0)]
    #[case::stale_after_a_later_higher_one(vec![write("o", 5, 20), write("o", 12, 21), write("o", 9, 22), write("o", 10, 23)], 2)]
    #[case::writes_with_granted_tokens(vec![grant("l", "a", 5, 5), write("o", 5, 6), grant("l", "b", 9, 9), write("o", 9, 10)], 0)]
    #[case::planted_write_with_a_token_never_granted(vec![grant("l", "a", 5, 5), write("o", 5, 6), write("o", 7, 8)], 1)]
    #[case::seen_twice_counts_once(vec![grant("l", "a", 5, 5), write("o", 5, 6), write("o", 5, 6), grant("l", "a", 5, 5)], 0)]
    #[case::planted_stale_write_seen_twice(vec![write("o", 9, 21), write("o", 5, 22), write("o", 9, 21), write("o", 5, 22)], 1)]
    fn finds_exactly_the_planted_violations(#[case] history: Vec<Observation>, #[case] expected: usize) {
        let violations = check(&history, |_| false);
        assert_eq!(violations.len(), expected, "{violations:#?}");
    }

    fn by(object: &str, holder: &str, rv: u64) -> Observation {
        Observation::HolderWrite { object: object.into(), lease: "l".into(), holder: holder.into(), resource_version: rv }
    }

    #[rstest]
    #[case::holders_in_turn(vec![grant("l", "a", 5, 5), by("o", "a", 6), by("o", "a", 7), grant("l", "b", 9, 9), by("o", "b", 10)], 0)]
    // The ex-holder's write committed after the new grant but before the new holder wrote: the
    // per-object guarantee allows it (its admission read the lease before the grant).
    #[case::ex_holder_before_the_new_holder_wrote(vec![grant("l", "a", 5, 5), grant("l", "b", 9, 9), by("o", "a", 10), by("o", "b", 11)], 0)]
    #[case::planted_ex_holder_after_the_new_holder(vec![grant("l", "a", 5, 5), grant("l", "b", 9, 9), by("o", "b", 10), by("o", "a", 11)], 1)]
    #[case::planted_write_by_nobody_granted(vec![grant("l", "a", 5, 5), by("o", "c", 6)], 1)]
    #[case::planted_write_before_the_grant(vec![by("o", "a", 4), grant("l", "a", 5, 5)], 1)]
    #[case::regained_under_the_same_identity(vec![grant("l", "a", 5, 5), grant("l", "b", 9, 9), by("o", "b", 10), grant("l", "a", 12, 12), by("o", "a", 13)], 0)]
    #[case::objects_are_independent(vec![grant("l", "a", 5, 5), grant("l", "b", 9, 9), by("o1", "b", 10), by("o2", "a", 11)], 0)]
    fn holder_writes_never_go_back_to_an_older_grant(#[case] history: Vec<Observation>, #[case] expected: usize) {
        let violations = check(&history, |_| false);
        assert_eq!(violations.len(), expected, "{violations:#?}");
    }

    #[test]
    fn equal_tokens_are_fine_only_where_the_lease_allows_them() {
        let history = vec![write("relaxed", 5, 1), write("relaxed", 5, 2), write("strict", 5, 3), write("strict", 5, 4)];
        let violations = check(&history, |o| o == "relaxed");
        assert_eq!(
            violations,
            vec![Violation::StaleWriteAccepted { object: "strict".into(), recorded: t(5), accepted: t(5), resource_version: 4 }]
        );
    }

    #[test]
    fn a_planted_violation_among_many_good_observations_is_found() {
        // A long, shuffled history like the fault driver's, with one stale write planted.
        let mut history = vec![];
        for i in 0..500u64 {
            let token = 100 + 10 * i;
            history.push(grant("l", if i % 2 == 0 { "a" } else { "b" }, token, token + 1));
            history.push(write("o", token, token + 2));
        }
        history.push(write("o", 2_000, 5_003)); // granted (i = 190), but committed after token 5_000
        history.reverse();
        let violations = check(&history, |_| false);
        assert_eq!(
            violations,
            vec![Violation::StaleWriteAccepted { object: "o".into(), recorded: t(5_000), accepted: t(2_000), resource_version: 5_003 }]
        );
    }

    #[test]
    fn violations_say_what_broke() {
        let v = check(&[grant("ns/l", "a", 5, 5), grant("ns/l", "b", 5, 6)], |_| false);
        assert_eq!(v[0].to_string(), "lease ns/l: token 5 was granted to both a and b");
    }
}
