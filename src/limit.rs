//! The one rate limiter: a token bucket per key (a source address, or `()` for one bucket in
//! all), with the number of keys it remembers bounded. Pure: the clock is passed in, so every
//! budget built on it is tested without sleeping.
//!
//! Used by the webhook's quorum-read budget (`admission::reads::ReadBudget`), its budget of
//! failed connections (`admission::http::bounds::FailureBudget`), and the Event publisher
//! (`events`). Why not a crate such as `governor`: its keyed limiter keeps every key until it is
//! swept and has no way to give a token back, which the failed-connection budget needs (a
//! connection pays when it is accepted and is paid back when it does not fail); this one forgets
//! the key idle longest once [`Buckets::MAX_KEYS`] are tracked, so a flood from many addresses
//! costs bounded memory.

use std::collections::HashMap;
use std::hash::Hash;
use std::time::Instant;

/// A token bucket per key.
#[derive(Debug)]
pub(crate) struct Buckets<K> {
    per_second: f64,
    burst: f64,
    max_keys: usize,
    keys: HashMap<K, Bucket>,
}

#[derive(Clone, Copy, Debug)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

impl<K: Hash + Eq + Clone> Buckets<K> {
    /// Keys tracked at once by default; beyond that the one idle longest is forgotten (a key
    /// forgotten starts again with a full bucket, so only a client with this many addresses gains
    /// by it).
    pub(crate) const MAX_KEYS: usize = 1024;

    /// `per_second` tokens a second per key, at most `burst` saved up.
    pub(crate) fn new(per_second: u32, burst: u32) -> Buckets<K> {
        Buckets::with_max_keys(per_second, burst, Self::MAX_KEYS)
    }

    /// The same, remembering at most `max_keys` keys.
    pub(crate) fn with_max_keys(per_second: u32, burst: u32, max_keys: usize) -> Buckets<K> {
        let per_second = f64::from(per_second.max(1));
        Buckets { per_second, burst: f64::from(burst).max(1.0), max_keys: max_keys.max(1), keys: HashMap::new() }
    }

    /// Tokens a key earns a second.
    pub(crate) fn per_second(&self) -> u32 {
        self.per_second as u32
    }

    /// The most tokens a key saves up.
    pub(crate) fn burst(&self) -> f64 {
        self.burst
    }

    /// Whether `key` has a bucket (it was seen and not forgotten since).
    pub(crate) fn knows(&self, key: &K) -> bool {
        self.keys.contains_key(key)
    }

    /// How many keys are remembered now (tests).
    #[cfg(test)]
    pub(crate) fn tracked(&self) -> usize {
        self.keys.len()
    }

    /// `key`'s tokens, refilled to `now` (a new key starts full). A clock that goes backwards
    /// refills nothing.
    pub(crate) fn tokens(&mut self, key: K, now: Instant) -> &mut f64 {
        if !self.keys.contains_key(&key) && self.keys.len() >= self.max_keys {
            let idlest = self.keys.iter().min_by_key(|(_, b)| b.at).map(|(k, _)| k.clone());
            if let Some(idlest) = idlest {
                self.keys.remove(&idlest);
            }
        }
        let (rate, burst) = (self.per_second, self.burst);
        let bucket = self.keys.entry(key).or_insert(Bucket { tokens: burst, at: now });
        let refill = now.saturating_duration_since(bucket.at).as_secs_f64() * rate;
        bucket.tokens = (bucket.tokens + refill).min(burst);
        bucket.at = bucket.at.max(now);
        &mut bucket.tokens
    }

    /// Whether `key` has a token at `now` (taking none).
    pub(crate) fn can_take(&mut self, key: K, now: Instant) -> bool {
        *self.tokens(key, now) >= 1.0
    }

    /// Takes a token of `key` at `now` if it has one.
    pub(crate) fn take(&mut self, key: K, now: Instant) -> bool {
        let tokens = self.tokens(key, now);
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }

    /// Gives `key` a token back at `now` (never beyond its burst).
    pub(crate) fn give_back(&mut self, key: K, now: Instant) {
        let burst = self.burst;
        let tokens = self.tokens(key, now);
        *tokens = (*tokens + 1.0).min(burst);
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;
    use std::time::Duration;

    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn a_flood_from_one_key_is_cut_to_its_budget_and_leaves_the_others_theirs() {
        let mut buckets = Buckets::new(100, 200);
        let now = Instant::now();
        assert_eq!((0..10_000).filter(|_| buckets.take(ip(66), now)).count(), 200, "a burst");
        assert_eq!((0..200).filter(|_| buckets.take(ip(1), now)).count(), 200, "another key has its own bucket");
        // A second later the flooding key has a second's worth again, not more.
        let later = now + Duration::from_secs(1);
        assert_eq!((0..10_000).filter(|_| buckets.take(ip(66), later)).count(), 100);
        // Ten seconds of rest refill it to the burst, no further.
        let rested = later + Duration::from_secs(10);
        assert_eq!((0..10_000).filter(|_| buckets.take(ip(66), rested)).count(), 200);
        // A key that asks at the rate is never refused.
        let mut steady = Buckets::new(100, 200);
        assert!((0..1_000).all(|i| steady.take(ip(5), now + Duration::from_millis(10 * i))));
    }

    #[test]
    fn the_keys_remembered_are_bounded_and_the_most_recent_kept() {
        let mut buckets = Buckets::with_max_keys(1, 1, 256);
        let start = Instant::now();
        buckets.take(ip(1), start + Duration::from_secs(5));
        for i in 0..5_000u32 {
            buckets.take(IpAddr::from([172, 16, (i >> 8) as u8, i as u8]), start + Duration::from_millis(u64::from(i)));
        }
        assert!(buckets.tracked() <= 256);
        assert!(buckets.knows(&ip(1)), "the most recently active key is kept");
    }

    #[test]
    fn a_clock_that_goes_backwards_refills_nothing_and_a_token_given_back_stays_within_the_burst() {
        let mut buckets = Buckets::new(1, 2);
        let start = Instant::now();
        assert!(buckets.take((), start + Duration::from_secs(1)));
        assert!(buckets.take((), start + Duration::from_secs(1)));
        assert!(!buckets.take((), start));
        buckets.give_back((), start);
        buckets.give_back((), start);
        buckets.give_back((), start);
        assert_eq!(*buckets.tokens((), start), 2.0);
    }
}
