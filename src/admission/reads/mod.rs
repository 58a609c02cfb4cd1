//! The webhook's real lease reads: the watch cache and quorum reads of [`directory`], shared by
//! the reviews that wait for them ([`shared`]) and budgeted per source and lease namespace
//! ([`ReadBudget`]). They
//! implement the judging core's one read interface (`crate::admission::judge::read::LeaseReads`)
//! and make its read values; the core never sees a client.

pub mod directory;
pub(crate) mod shared;

use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use self::directory::LeaseDirectory;
use self::shared::SharedReads;
use super::judge::facts::LeaseRef;
use super::judge::fence::Fence;
use super::judge::read::{Cached, HolderQuorum, LeaseReads, Quorum, ReadError, WriterQuorum};
use super::metrics::{LeaseReadKind, Metrics};
use crate::limit::Buckets;
use k8s_openapi::api::coordination::v1::Lease as LeaderElectionLease;

/// The quorum reads a source may start: `per_namespace` a second for the leases of one namespace
/// (bursts of twice that), and `per_source` a second in all. A read is charged when it starts,
/// once for every review that shares it (`shared`), to the source that sent the review and the
/// namespace of the lease it reads: the API server's genuine reviews for one namespace — a busy
/// fenced controller, a tenant flooding labelled creates — use up that namespace's budget only,
/// never another's. A source that is not the API server (a forged review) costs the API server
/// at most `per_source` reads a second, across every namespace it names. With `--client-ca-file`
/// every caller is the API server and no budget applies.
#[derive(Debug)]
pub struct ReadBudget {
    per_namespace: Buckets<(IpAddr, String)>,
    per_source: Buckets<IpAddr>,
}

/// Why a read was not started (what [`ReadError::Throttled`] reports).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Spent {
    /// The source's reads of this namespace's leases.
    Namespace(u32),
    /// All the source's reads.
    Source(u32),
}

impl ReadBudget {
    pub const MAX_KEYS: usize = Buckets::<IpAddr>::MAX_KEYS;
    /// The budget of all a source's reads, in multiples of one namespace's.
    pub const SOURCE_MULTIPLE: u32 = 10;

    /// `per_namespace` reads a second per source and lease namespace, and ten times that per
    /// source in all; each with a burst of twice the rate.
    pub fn new(per_namespace: u32) -> ReadBudget {
        let per_namespace = per_namespace.max(1);
        let per_source = per_namespace.saturating_mul(Self::SOURCE_MULTIPLE);
        ReadBudget {
            per_namespace: Buckets::new(per_namespace, per_namespace.saturating_mul(2)),
            per_source: Buckets::new(per_source, per_source.saturating_mul(2)),
        }
    }

    /// Whether `source` may start one more quorum read of a lease of `namespace` at `now` (and if
    /// so, it is counted in both budgets).
    pub fn admit(&mut self, source: IpAddr, namespace: &str, now: Instant) -> Result<(), Spent> {
        if !self.per_source.can_take(source, now) {
            return Err(Spent::Source(self.per_source.per_second()));
        }
        if !self.per_namespace.take((source, namespace.to_string()), now) {
            return Err(Spent::Namespace(self.per_namespace.per_second()));
        }
        self.per_source.take(source, now);
        Ok(())
    }

    pub fn per_namespace(&self) -> u32 {
        self.per_namespace.per_second()
    }
}

/// Shared quorum reads, per source and lease: a review joins the next read of its lease that
/// its own source starts (never another source's, which could have been refused its budget).
type Shared<V> = SharedReads<(IpAddr, String, String), Result<V, ReadError>>;

/// The webhook's reads: its lease directory (watch cache and quorum reads), the quorum reads
/// each source may start (`None`: unbudgeted), and the shared reads.
pub struct Reader {
    leases: LeaseDirectory,
    metrics: Metrics,
    budget: Option<Arc<Mutex<ReadBudget>>>,
    /// How long a quorum read may go unanswered.
    timeout: Duration,
    fence_leases: Arc<Shared<Option<kube_fence_api::Lease>>>,
    leader_leases: Arc<Shared<Option<LeaderElectionLease>>>,
}

impl Reader {
    /// Reads through `leases`, counted in `metrics`, at most `per_namespace` quorum reads started
    /// a second per source and lease namespace (`None`: unbudgeted), each failing (closed) when
    /// unanswered after `timeout`.
    pub fn new(leases: LeaseDirectory, metrics: Metrics, per_namespace: Option<u32>, timeout: Duration) -> Reader {
        Reader {
            leases,
            metrics,
            timeout,
            budget: per_namespace.map(|n| Arc::new(Mutex::new(ReadBudget::new(n)))),
            fence_leases: Arc::default(),
            leader_leases: Arc::default(),
        }
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

/// Charges one quorum read of a lease of `namespace` to `source`, or says why not (and counts
/// the refusal).
fn charge(budget: Option<&Arc<Mutex<ReadBudget>>>, metrics: &Metrics, source: IpAddr, namespace: &str) -> Result<(), ReadError> {
    let Some(budget) = budget else { return Ok(()) };
    let mut budget = budget.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    match budget.admit(source, namespace, Instant::now()) {
        Ok(()) => Ok(()),
        Err(spent) => {
            metrics.reads_throttled.inc();
            let (per_second, namespace) = match spent {
                Spent::Namespace(n) => (n, Some(namespace.to_string())),
                Spent::Source(n) => (n, None),
            };
            Err(ReadError::Throttled { source, namespace, per_second })
        }
    }
}

impl SourceReads<'_> {
    /// The next read of `lease` this source starts (joined, or started and charged): the
    /// kube-fence Lease when `fence`, the leader-election Lease otherwise.
    async fn shared<V, F, Fut>(&self, shared: &Arc<Shared<V>>, lease: LeaseRef<'_>, read: F) -> Result<V, ReadError>
    where
        V: Clone + Send + Sync + 'static,
        F: FnOnce(LeaseDirectory, String, String) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<V, kube::Error>> + Send + 'static,
    {
        let key = (self.source, lease.namespace.to_string(), lease.name.to_string());
        let (budget, metrics, leases, source, timeout) =
            (self.reader.budget.clone(), self.reader.metrics.clone(), self.reader.leases.clone(), self.source, self.reader.timeout);
        let (namespace, name) = (key.1.clone(), key.2.clone());
        shared
            .read(key, move || async move {
                charge(budget.as_ref(), &metrics, source, &namespace)?;
                metrics.lease_read(LeaseReadKind::Linearizable);
                let started = Instant::now();
                // Bounded: a read the API server never answers (sent into a partition) would
                // otherwise be the one every later review of this lease waits behind.
                let read = match tokio::time::timeout(timeout, read(leases, namespace, name)).await {
                    Ok(read) => read.map_err(|e| ReadError::Failed(Arc::new(e))),
                    Err(_) => Err(ReadError::Unanswered(timeout)),
                };
                metrics.quorum_read(started.elapsed().as_secs_f64());
                read
            })
            .await
    }

    async fn leader_lease(&self, lease: LeaseRef<'_>) -> Result<Option<LeaderElectionLease>, ReadError> {
        self.shared(&self.reader.leader_leases, lease, |leases, namespace, name| async move {
            leases.leader_lease(LeaseRef { namespace: &namespace, name: &name }).await
        })
        .await
    }
}

impl LeaseReads for SourceReads<'_> {
    fn cached(&self, lease: LeaseRef<'_>) -> Cached {
        self.reader.metrics.lease_read(LeaseReadKind::Cache);
        Cached::new(self.reader.leases.cached(lease))
    }

    async fn quorum(&self, lease: LeaseRef<'_>) -> Result<Quorum, ReadError> {
        // Reviews of one lease share the next read, a lease that does not exist included: a flood
        // of creates naming one absent lease costs a read per round trip, not one each.
        let fresh = self
            .shared(&self.reader.fence_leases, lease, |leases, namespace, name| async move {
                leases.quorum_lease(LeaseRef { namespace: &namespace, name: &name }).await
            })
            .await?;
        Ok(Quorum::new(fresh.as_ref().map(directory::facts)))
    }

    async fn holder(&self, lease: LeaseRef<'_>) -> Result<HolderQuorum, ReadError> {
        Ok(HolderQuorum::of(self.leader_lease(lease).await?.as_ref()))
    }

    async fn writer(&self, lease: LeaseRef<'_>) -> Result<WriterQuorum, ReadError> {
        // Concurrent writes of one controller share the next quorum read of its Lease.
        Ok(WriterQuorum::of(self.leader_lease(lease).await?.as_ref()))
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

    /// A quorum read the API server never answers (an endpoint that accepts the connection and
    /// then says nothing, as one behind a partition) fails closed at the read timeout, and the
    /// next review's read is not queued behind it forever: it gets a read of its own, which
    /// times out the same way. Before the bound, the first read held its lease's slot until the
    /// connection gave up.
    #[tokio::test]
    async fn an_unanswered_quorum_read_fails_closed_at_its_timeout_and_frees_its_lease() {
        let silent = tokio::net::TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).await.expect("bind");
        let addr = silent.local_addr().expect("address");
        let held = tokio::spawn(async move {
            let mut open = vec![];
            while let Ok((conn, _)) = silent.accept().await {
                open.push(conn); // never read, never answered, never closed
            }
        });
        let config = kube::Config::new(format!("https://{addr}").parse().expect("url"));
        let client = kube::Client::try_from(config).expect("client");
        let (leases, _cache) = LeaseDirectory::new(client);
        let timeout = Duration::from_millis(300);
        let reader = Reader::new(leases, Metrics::register(&mut prometheus_client::registry::Registry::default()), None, timeout);
        let lease = LeaseRef { namespace: "ns", name: "l" };
        for attempt in 0..2 {
            let started = Instant::now();
            let read = tokio::time::timeout(Duration::from_secs(20), reader.from(ip(1)).quorum(lease))
                .await
                .unwrap_or_else(|_| panic!("attempt {attempt}: no answer within 20 s"));
            assert!(matches!(read, Err(ReadError::Unanswered(after)) if after == timeout), "attempt {attempt}: {read:?}");
            assert!(started.elapsed() >= timeout, "attempt {attempt}: not before the timeout");
        }
        held.abort();
    }

    /// Threat cases: a tenant (or one busy controller) whose reviews come from the API server's
    /// address, like everyone's; and a forger with an address of its own.
    #[test]
    fn one_namespace_uses_up_its_own_budget_and_leaves_the_others_theirs() {
        let mut budget = ReadBudget::new(100);
        let now = Instant::now();
        let api_server = ip(1);
        let flood = (0..10_000).filter(|_| budget.admit(api_server, "tenant", now).is_ok()).count();
        assert_eq!(flood, 200, "a burst of twice the rate, for the tenant's namespace");
        assert_eq!(budget.admit(api_server, "tenant", now), Err(Spent::Namespace(100)));
        let others = (0..200).filter(|_| budget.admit(api_server, "operators", now).is_ok()).count();
        assert_eq!(others, 200, "another namespace, through the same API server, keeps its budget");
        // A second later the flooding namespace has a second's worth again, not more.
        let later = now + Duration::from_secs(1);
        assert_eq!((0..10_000).filter(|_| budget.admit(api_server, "tenant", later).is_ok()).count(), 100);
        // A namespace read at the rate is never refused.
        let mut steady = ReadBudget::new(100);
        assert!((0..1_000).all(|i| steady.admit(api_server, "team", now + Duration::from_millis(10 * i)).is_ok()));
    }

    #[test]
    fn a_source_naming_many_namespaces_is_cut_to_its_budget_in_all() {
        let mut budget = ReadBudget::new(100);
        let now = Instant::now();
        let forger = ip(66);
        let reads = (0..10_000).filter(|i| budget.admit(forger, &format!("ns-{i}"), now).is_ok()).count();
        assert_eq!(reads, 2_000, "ten namespaces' worth, as a burst of twice that");
        assert_eq!(budget.admit(forger, "ns-new", now), Err(Spent::Source(1_000)));
        assert!(budget.admit(ip(1), "ns-new", now).is_ok(), "another source keeps its own budget");
    }

    #[test]
    fn the_keys_a_read_budget_tracks_are_bounded() {
        let mut budget = ReadBudget::new(1);
        let start = Instant::now();
        for i in 0..5_000u32 {
            let _ = budget.admit(
                IpAddr::from([172, 16, (i >> 8) as u8, i as u8]),
                &format!("ns-{i}"),
                start + Duration::from_millis(u64::from(i)),
            );
        }
        assert!(budget.per_namespace.tracked() <= ReadBudget::MAX_KEYS);
        assert!(budget.per_source.tracked() <= ReadBudget::MAX_KEYS);
    }
}
