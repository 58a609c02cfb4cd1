//! The webhook's real lease reads: the watch cache and quorum reads of [`directory`],
//! budgeted per source ([`ReadBudget`]), the writer fence's reads shared by [`shared`]. They
//! implement the judging core's one read interface (`crate::admission::judge::read::LeaseReads`)
//! and make its read values; the core never sees a client.

pub mod directory;
pub(crate) mod shared;

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use self::directory::LeaseDirectory;
use self::shared::SharedReads;
use super::judge::facts::LeaseRef;
use super::judge::fence::Fence;
use super::judge::read::{Cached, HolderQuorum, LeaseReads, Quorum, ReadError, WriterQuorum};
use super::metrics::{LeaseReadKind, Metrics};
use crate::limit::Buckets;

/// The reviews of one source that need a quorum read: `per_second` a second, bursts of twice
/// that. A forged review costs the API server a read only within its source's budget; beyond it
/// the review is denied `429 ReadsThrottled` without a read. With `--client-ca-file` every caller
/// is the API server and no budget applies.
#[derive(Debug)]
pub struct ReadBudget(Buckets<IpAddr>);

impl ReadBudget {
    pub const MAX_SOURCES: usize = Buckets::<IpAddr>::MAX_KEYS;

    /// `per_second` reads a second per source, and a burst of twice that.
    pub fn new(per_second: u32) -> ReadBudget {
        let per_second = per_second.max(1);
        ReadBudget(Buckets::new(per_second, per_second.saturating_mul(2)))
    }

    /// Whether `source` may cause one more quorum read at `now` (and if so, it is counted).
    pub fn admit(&mut self, source: IpAddr, now: Instant) -> bool {
        self.0.take(source, now)
    }

    pub fn per_second(&self) -> u32 {
        self.0.per_second()
    }
}

/// Shared quorum reads of fenced controllers' Leases, per `(namespace, name)`.
type WriterReads = SharedReads<(String, String), Result<WriterQuorum, Arc<kube::Error>>>;

/// The webhook's reads: its lease directory (watch cache and quorum reads), the quorum reads
/// each source may cause (`None`: unbudgeted), and the writer fence's shared reads.
pub struct Reader {
    leases: LeaseDirectory,
    metrics: Metrics,
    budget: Option<Mutex<ReadBudget>>,
    writer_reads: Arc<WriterReads>,
}

impl Reader {
    /// Reads through `leases`, counted in `metrics`, at most `per_second` reviews needing a
    /// quorum read per source address (`None`: unbudgeted).
    pub fn new(leases: LeaseDirectory, metrics: Metrics, per_second: Option<u32>) -> Reader {
        Reader { leases, metrics, budget: per_second.map(|n| Mutex::new(ReadBudget::new(n))), writer_reads: Arc::default() }
    }

    /// The lease directory (whose readiness `/readyz` reports).
    pub fn leases(&self) -> &LeaseDirectory {
        &self.leases
    }

    /// The reads of one review, sent from `source` (whose read budget they use).
    pub fn from(&self, source: IpAddr) -> SourceReads<'_> {
        SourceReads { reader: self, source }
    }
}

/// The real reads of one review from `source`.
pub struct SourceReads<'a> {
    reader: &'a Reader,
    source: IpAddr,
}

impl SourceReads<'_> {
    /// Whether the source may cause one more quorum read; counts the refusal if not.
    fn admit(&self) -> Result<(), ReadError> {
        let Some(budget) = self.reader.budget.as_ref() else { return Ok(()) };
        let mut budget = budget.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        if budget.admit(self.source, Instant::now()) {
            return Ok(());
        }
        self.reader.metrics.reads_throttled.inc();
        Err(ReadError::Throttled { source: self.source, per_second: budget.per_second() })
    }
}

impl LeaseReads for SourceReads<'_> {
    fn cached(&self, lease: LeaseRef<'_>) -> Cached {
        self.reader.metrics.lease_read(LeaseReadKind::Cache);
        Cached::new(self.reader.leases.cached(lease))
    }

    async fn quorum(&self, lease: LeaseRef<'_>) -> Result<Quorum, ReadError> {
        self.admit()?;
        self.reader.metrics.lease_read(LeaseReadKind::Linearizable);
        self.reader.leases.quorum(lease).await.map(Quorum::new).map_err(|e| ReadError::Failed(Arc::new(e)))
    }

    async fn holder(&self, lease: LeaseRef<'_>) -> Result<HolderQuorum, ReadError> {
        self.admit()?;
        self.reader.metrics.lease_read(LeaseReadKind::Linearizable);
        let fresh = self.reader.leases.leader_lease(lease).await.map_err(|e| ReadError::Failed(Arc::new(e)))?;
        Ok(HolderQuorum::of(fresh.as_ref()))
    }

    async fn writer(&self, lease: LeaseRef<'_>) -> Result<WriterQuorum, ReadError> {
        self.admit()?;
        // Concurrent writes of one controller share the next quorum read of its Lease.
        let key = (lease.namespace.to_string(), lease.name.to_string());
        let (leases, metrics, (namespace, name)) = (self.reader.leases.clone(), self.reader.metrics.clone(), key.clone());
        let shared = self.reader.writer_reads.read(key, move || async move {
            metrics.lease_read(LeaseReadKind::Linearizable);
            let fresh = leases.leader_lease(LeaseRef { namespace: &namespace, name: &name }).await.map_err(Arc::new)?;
            Ok::<_, Arc<kube::Error>>(WriterQuorum::of(fresh.as_ref()))
        });
        shared.await.map_err(ReadError::Failed)
    }

    fn fences(&self, user: &str) -> Option<Vec<Arc<Fence>>> {
        self.reader.leases.fences(user)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn a_flood_of_reads_from_one_source_is_cut_to_its_budget() {
        let mut budget = ReadBudget::new(100);
        let now = Instant::now();
        let flood = (0..10_000).filter(|_| budget.admit(ip(66), now)).count();
        assert_eq!(flood, 200, "a burst of twice the rate");
        assert!(!budget.admit(ip(66), now));
        assert_eq!((0..200).filter(|_| budget.admit(ip(1), now)).count(), 200, "another source has its own budget");
        // A second later the flooding source has a second's worth again, not more.
        let later = now + Duration::from_secs(1);
        assert_eq!((0..10_000).filter(|_| budget.admit(ip(66), later)).count(), 100);
        // Ten seconds of rest refill it to the burst, no further.
        let rested = later + Duration::from_secs(10);
        assert_eq!((0..10_000).filter(|_| budget.admit(ip(66), rested)).count(), 200);
        // A source that asks at the rate is never refused.
        let mut steady = ReadBudget::new(100);
        assert!((0..1_000).all(|i| steady.admit(ip(5), now + Duration::from_millis(10 * i))));
    }

    #[test]
    fn the_sources_a_read_budget_tracks_are_bounded() {
        let mut budget = ReadBudget::new(1);
        let start = Instant::now();
        budget.admit(ip(1), start + Duration::from_secs(5));
        for i in 0..5_000u32 {
            budget.admit(IpAddr::from([172, 16, (i >> 8) as u8, i as u8]), start + Duration::from_millis(u64::from(i)));
        }
        assert!(budget.0.tracked() <= ReadBudget::MAX_SOURCES);
        assert!(budget.0.knows(&ip(1)), "the most recently active source is kept");
        // A clock that goes backwards (a caller's Instant taken before another's) refills nothing.
        let mut budget = ReadBudget::new(1);
        assert!(budget.admit(ip(1), start + Duration::from_secs(1)));
        assert!(budget.admit(ip(1), start + Duration::from_secs(1)));
        assert!(!budget.admit(ip(1), start));
    }
}
