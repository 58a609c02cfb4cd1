//! What one client of the webhook port can cost kube-fence and the API server.
//!
//! The port is reachable by more than the API server (every Pod, unless the chart's
//! NetworkPolicy or `--client-ca-file` keeps others out), so:
//! - [`ConnectionGate`]: the connections open at once are bounded, in all and per source
//!   address. A connection holds its place ([`Ticket`]) from the moment it is accepted — before
//!   its TLS handshake — until it is closed; beyond either bound a connection is closed at once,
//!   in the accept loop ([`GatedListener`]).
//!   The deadlines of a connection (handshake, headers, body, idle) are in `super::server`.
//! - Failed connections are budgeted per source ([`FailureBudget`]): a connection that failed its
//!   TLS handshake, or sent bytes but never a request (HTTP/2 spoken to this HTTP/1.1 port,
//!   garbage, headers that never finished), costs its source a token; a source without one has
//!   its new connections closed in the accept loop, before their handshake, until its bucket
//!   refills. A source below half its budget pays for each new connection when it is accepted
//!   and is paid back when the connection turns out not to fail, so connections reopened all
//!   at once cannot pass on one token. Each such connection had cost a TLS handshake, and a client that reopens them as
//!   fast as they are closed kept the two cores busy with handshakes. The API server's
//!   connections carry requests, so they are never charged (what is charged is in
//!   `super::failures`).
//! - The quorum reads one source address starts are budgeted per lease namespace and in all
//!   (`crate::admission::reads::ReadBudget`, at [`Bounds::quorum_reads_per_namespace`]).
//! - [`trim_after_bursts`]: memory a burst of connections used is given back to the system
//!   (glibc keeps freed memory in its arenas otherwise; the binary says how,
//!   [`set_memory_release`]).
//!
//! The bookkeeping is pure (the clock is passed in) and tested here.

use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::admission::metrics::ConnectionMetrics;

use crate::limit::Buckets;

/// Connections open at once, all sources together. An idle TLS connection costs kube-fence
/// some 20–40 KiB; 2,048 of them stay well inside the chart's 256 MiB memory limit beside the
/// request bodies' own budget (`super::server::BODY_BUDGET_BYTES`). The API server keeps one
/// connection per review in flight (a few hundred at most).
pub const MAX_CONNECTIONS: usize = 2048;
/// Connections open at once from one source address: what the API server needs, and a client
/// that opens more cannot take every place.
pub const MAX_CONNECTIONS_PER_SOURCE: usize = 512;
/// The last quarter of [`Bounds::max_connections`] is kept for sources with fewer than this
/// many connections open: clients that open many connections from many addresses fill at most
/// three quarters, and an API server with a few connections open still gets a new one.
pub const FEW_CONNECTIONS: usize = 8;
/// Quorum reads a source may start a second for the leases of one namespace (and ten times that
/// in all: `crate::admission::reads::ReadBudget`). About what the API server sustains on a small
/// machine, so one busy fenced controller is not capped below it.
pub const QUORUM_READS_PER_NAMESPACE: u32 = 1000;
/// Failed connections (see [`FailureBudget`]) per second and source address.
pub const FAILED_CONNECTIONS_PER_SECOND: u32 = 1;
/// A source's failed connections may come in a burst of this many seconds' worth. A kubelet's
/// `tcpSocket` probes (a connection closed before its handshake) fail one every 5–10 s.
pub const FAILURE_BURST_SECONDS: u32 = 16;
/// How long a connection that has carried a request may stay idle before its next request's
/// headers have arrived. Longer than the API server keeps an idle connection to a webhook for
/// reuse (90 s, Go's `IdleConnTimeout`), so the API server, not kube-fence, closes it: a server
/// that closes first races the API server's next review on that connection, and a review whose
/// connection is reset after it was sent is not retried — the guarded write fails with 500
/// "connection reset by peer" (seen in the status pause test on a busy machine with a 10 s idle
/// deadline). It bounds no attacker: one who sends a request every few seconds keeps a
/// connection anyway; the places in [`Bounds`] are what bound connections.
pub const KEEP_ALIVE_IDLE: Duration = Duration::from_secs(120);
const _: () = assert!(KEEP_ALIVE_IDLE.as_secs() > 90, "the API server, not kube-fence, must close an idle connection");

/// Bounds on what the webhook port's clients can cost (`--max-connections`,
/// `--max-connections-per-source`, `--failed-connections-per-source`,
/// `--quorum-reads-per-source`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    pub max_connections: usize,
    pub max_connections_per_source: usize,
    /// Failed connections per second and source (bursts of [`FAILURE_BURST_SECONDS`] times
    /// that) before the source's new connections are closed at once; `None`: unbudgeted.
    pub failed_connections_per_source: Option<u32>,
    /// Reviews needing a quorum read, per second and source (a burst of twice that is allowed);
    /// `None`: unbudgeted (every caller is authenticated, or a benchmark).
    pub quorum_reads_per_namespace: Option<u32>,
    /// How long a connection that carried a request may stay idle ([`KEEP_ALIVE_IDLE`]).
    pub keep_alive_idle: Duration,
}

impl Default for Bounds {
    fn default() -> Bounds {
        Bounds {
            max_connections: MAX_CONNECTIONS,
            max_connections_per_source: MAX_CONNECTIONS_PER_SOURCE,
            failed_connections_per_source: Some(FAILED_CONNECTIONS_PER_SECOND),
            quorum_reads_per_namespace: Some(QUORUM_READS_PER_NAMESPACE),
            keep_alive_idle: KEEP_ALIVE_IDLE,
        }
    }
}

/// Why a connection was closed as soon as it was accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Crowded {
    /// All sources together have [`Bounds::max_connections`] open.
    Total,
    /// Its source address has [`Bounds::max_connections_per_source`] open.
    Source,
    /// Its source address used up its budget of failed connections ([`FailureBudget`]).
    Failing,
}

/// Counts of open connections, in all and per source. Pure.
#[derive(Debug, Default)]
pub struct OpenConnections {
    total: usize,
    by_source: HashMap<IpAddr, usize>,
    /// The most open at once since [`OpenConnections::take_peak`] was last called.
    peak: usize,
}

impl OpenConnections {
    /// Takes a place for a connection from `source`, or says why there is none.
    pub fn open(&mut self, source: IpAddr, limits: &Bounds) -> Result<(), Crowded> {
        let from_source = self.by_source.get(&source).copied().unwrap_or(0);
        // The last quarter of the places is for sources with few connections open.
        let shared = limits.max_connections - limits.max_connections / 4;
        let cap = if from_source < FEW_CONNECTIONS { limits.max_connections } else { shared };
        if self.total >= cap {
            return Err(Crowded::Total);
        }
        if from_source >= limits.max_connections_per_source {
            return Err(Crowded::Source);
        }
        let from_source = self.by_source.entry(source).or_insert(0);
        *from_source += 1;
        self.total += 1;
        self.peak = self.peak.max(self.total);
        Ok(())
    }

    /// Gives back the place of a closed connection from `source`.
    pub fn close(&mut self, source: IpAddr) {
        if let Some(n) = self.by_source.get_mut(&source) {
            *n -= 1;
            self.total -= 1;
            if *n == 0 {
                self.by_source.remove(&source);
            }
        }
    }

    pub fn total(&self) -> usize {
        self.total
    }

    /// The most connections open at once since the last call, and the count now.
    pub fn take_peak(&mut self) -> (usize, usize) {
        let peak = std::mem::replace(&mut self.peak, self.total);
        (peak, self.total)
    }
}

/// Admits connections within [`Bounds`]; shared by the accept path of one server.
#[derive(Clone, Debug)]
pub struct ConnectionGate {
    limits: Bounds,
    open: Arc<Mutex<OpenConnections>>,
    failures: Option<Arc<Mutex<FailureBudget>>>,
    metrics: ConnectionMetrics,
}

impl ConnectionGate {
    pub fn new(limits: Bounds, metrics: ConnectionMetrics) -> ConnectionGate {
        let failures = limits.failed_connections_per_source.map(|n| Arc::new(Mutex::new(FailureBudget::new(n))));
        ConnectionGate { limits, open: Arc::default(), failures, metrics }
    }

    /// The bounds it was made with.
    pub fn limits(&self) -> Bounds {
        self.limits
    }

    /// A place for a connection from `source`, held until the ticket is dropped.
    pub fn admit(&self, source: IpAddr) -> Result<Ticket, Crowded> {
        self.admit_at(source, Instant::now())
    }

    fn admit_at(&self, source: IpAddr, now: Instant) -> Result<Ticket, Crowded> {
        let paid = match &self.failures {
            None => Paid::Nothing,
            Some(failures) => match failures.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).admit(source, now) {
                Some(paid) => paid,
                None => {
                    self.metrics.refused_failing.inc();
                    return Err(Crowded::Failing);
                }
            },
        };
        let mut open = self.open.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match open.open(source, &self.limits) {
            Ok(()) => {
                self.metrics.open.set(open.total() as i64);
                Ok(Ticket { gate: self.clone(), source, paid })
            }
            Err(crowded) => {
                drop(open);
                self.settle(source, paid, false);
                match crowded {
                    Crowded::Total => self.metrics.refused_total.inc(),
                    Crowded::Source => self.metrics.refused_source.inc(),
                    Crowded::Failing => self.metrics.refused_failing.inc(),
                };
                Err(crowded)
            }
        }
    }

    /// Connections open now.
    pub fn open(&self) -> usize {
        self.open.lock().map(|o| o.total()).unwrap_or_default()
    }

    fn take_peak(&self) -> (usize, usize) {
        self.open.lock().map(|mut o| o.take_peak()).unwrap_or_default()
    }

    /// Settles a connection from `source` with its [`FailureBudget`]: it `failed` or not, and
    /// what it `paid` when it was accepted.
    fn settle(&self, source: IpAddr, paid: Paid, failed: bool) {
        if failed {
            self.metrics.failed.inc();
        }
        if let Some(failures) = &self.failures {
            failures.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).settle(source, paid, failed, Instant::now());
        }
    }
}

/// One connection's place; given back when dropped.
#[derive(Debug)]
pub struct Ticket {
    gate: ConnectionGate,
    source: IpAddr,
    paid: Paid,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut open = self.gate.open.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        open.close(self.source);
        self.gate.metrics.open.set(open.total() as i64);
    }
}

impl Ticket {
    /// Where to report that this connection failed.
    pub fn failure_report(&self) -> FailureReport {
        FailureReport { gate: self.gate.clone(), source: self.source, paid: self.paid }
    }
}

/// Reports how one connection ended to its gate's [`FailureBudget`]; to be called once.
#[derive(Clone, Debug)]
pub struct FailureReport {
    gate: ConnectionGate,
    source: IpAddr,
    paid: Paid,
}

impl FailureReport {
    /// The connection failed.
    pub fn failed(&self) {
        self.gate.settle(self.source, self.paid, true);
    }

    /// The connection ended without failing.
    pub fn ended_well(&self) {
        self.gate.settle(self.source, self.paid, false);
    }
}

/// A stream that holds its connection's [`Ticket`] for as long as it lives.
#[derive(Debug)]
pub struct Admitted<S> {
    inner: S,
    ticket: Ticket,
}

impl<S> Admitted<S> {
    /// Where to report that this connection failed.
    pub fn failure_report(&self) -> FailureReport {
        self.ticket.failure_report()
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Admitted<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Admitted<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }
}

/// The webhook port's listener: a connection without a place is closed in the accept loop
/// itself, before a task, a service or a TLS handshake is spent on it. (Refused in a task of its
/// own, as an acceptor is, refusals queued behind one another under a flood of connections,
/// each holding its descriptor, and the API server's reviews waited behind them:
/// `hack/bench.sh --only connections`.) The address type `GatedAddr` names it to
/// `axum_server`, and handlers extract the peer as `ConnectInfo<SocketAddr>`.
#[derive(Debug)]
pub struct GatedListener {
    listener: tokio::net::TcpListener,
    gate: ConnectionGate,
}

impl GatedListener {
    /// Accepts on `listener` (non-blocking) within `gate`.
    pub fn new(listener: std::net::TcpListener, gate: ConnectionGate) -> io::Result<GatedListener> {
        listener.set_nonblocking(true)?;
        Ok(GatedListener { listener: tokio::net::TcpListener::from_std(listener)?, gate })
    }
}

/// The peer address of a connection a [`GatedListener`] accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GatedAddr(pub SocketAddr);

impl axum_server::Address for GatedAddr {
    type Stream = Admitted<TcpStream>;
    type Listener = GatedListener;
}

impl axum_server::AddrListener<Admitted<TcpStream>, GatedAddr> for GatedListener {
    async fn bind_to(_: GatedAddr) -> io::Result<GatedListener> {
        Err(io::Error::other("a GatedListener is made from a bound listener and its gate (GatedListener::new)"))
    }

    async fn accept_stream(&self) -> io::Result<(Admitted<TcpStream>, GatedAddr)> {
        loop {
            let (stream, peer) = self.listener.accept().await?;
            match self.gate.admit(peer.ip()) {
                Ok(ticket) => {
                    // The API server sends a review at once and waits for the verdict: no batching.
                    let _ = stream.set_nodelay(true);
                    return Ok((Admitted { inner: stream, ticket }, GatedAddr(peer)));
                }
                // Dropped here: closed at once.
                Err(crowded) => tracing::debug!(%peer, ?crowded, "connection closed at once: too many open"),
            }
        }
    }

    fn get_local_addr(&self) -> io::Result<GatedAddr> {
        self.listener.local_addr().map(GatedAddr)
    }
}

impl axum::extract::connect_info::Connected<GatedAddr> for SocketAddr {
    fn connect_info(accepted: GatedAddr) -> SocketAddr {
        accepted.0
    }
}

/// What a connection paid its source's [`FailureBudget`] when it was accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Paid {
    /// Nothing: its source had at least half its budget (or none applies). Charged if it fails.
    Nothing,
    /// A token: its source had less than half its budget. Paid back if it does not fail.
    Token,
}

/// The failed connections of one source: `per_second` a second, bursts of
/// [`FAILURE_BURST_SECONDS`] times that.
/// - A source with at least half its bucket connects freely; a connection that then fails
///   takes a token (or none, when none is left: failures run up no debt).
/// - A source with less than half pays a token for each new connection when it is accepted,
///   given back when the connection does not fail: connections reopened all at once cannot pass
///   on one token, so a source's handshakes are bounded by its budget.
/// - A source with no token left is refused until it has one again.
///
/// A source that never failed (the API server) always has a full bucket and pays nothing.
#[derive(Debug)]
pub struct FailureBudget(Buckets<IpAddr>);

impl FailureBudget {
    pub fn new(per_second: u32) -> FailureBudget {
        let per_second = per_second.max(1);
        FailureBudget(Buckets::new(per_second, per_second.saturating_mul(FAILURE_BURST_SECONDS)))
    }

    /// Whether a new connection from `source` may be accepted at `now`, and what it paid; `None`:
    /// refused.
    pub fn admit(&mut self, source: IpAddr, now: Instant) -> Option<Paid> {
        if !self.0.knows(&source) {
            return Some(Paid::Nothing);
        }
        let half = self.0.burst() / 2.0;
        let tokens = self.0.tokens(source, now);
        if *tokens >= half {
            Some(Paid::Nothing)
        } else if *tokens >= 1.0 {
            *tokens -= 1.0;
            Some(Paid::Token)
        } else {
            None
        }
    }

    /// Settles a connection of `source` at `now`: it `failed` or not, having `paid` when accepted.
    pub fn settle(&mut self, source: IpAddr, paid: Paid, failed: bool, now: Instant) {
        match (paid, failed) {
            (Paid::Nothing, true) => {
                self.0.take(source, now);
            }
            (Paid::Token, false) => self.0.give_back(source, now),
            (Paid::Nothing, false) | (Paid::Token, true) => {}
        }
    }
}

/// How free heap memory is given back to the system, if the program says ([`set_memory_release`]).
static RELEASE: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

/// Sets how free heap memory is given back to the system after a burst of connections: the
/// `kube-fence` binary passes glibc's `malloc_trim` (this library has no unsafe code). Without
/// it the webhook's resident memory stays at a burst's peak. The first call wins.
pub fn set_memory_release(release: fn()) {
    let _ = RELEASE.set(release);
}

/// Returns memory freed after a burst of connections to the system: every `every`, when at
/// least `burst` connections closed since the last look, calls what [`set_memory_release`]
/// set (if anything).
pub async fn trim_after_bursts(gate: ConnectionGate, every: Duration, burst: usize) {
    let mut ticker = tokio::time::interval(every);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticker.tick().await;
        let (peak, now) = gate.take_peak();
        if let Some(release) = RELEASE.get().copied()
            && peak.saturating_sub(now) >= burst
        {
            let started = Instant::now();
            let _ = tokio::task::spawn_blocking(release).await;
            tracing::debug!(peak, now, took = ?started.elapsed(), "returned free memory after a burst of connections");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    const UNBUDGETED: Bounds = Bounds {
        max_connections: 0,
        max_connections_per_source: 0,
        failed_connections_per_source: None,
        quorum_reads_per_namespace: None,
        keep_alive_idle: KEEP_ALIVE_IDLE,
    };

    #[test]
    fn connections_are_bounded_in_all_and_per_source() {
        let limits = Bounds { max_connections: 5, max_connections_per_source: 3, ..UNBUDGETED };
        let mut open = OpenConnections::default();
        assert_eq!((0..10).filter(|_| open.open(ip(66), &limits).is_ok()).count(), 3);
        assert_eq!(open.open(ip(66), &limits), Err(Crowded::Source));
        assert_eq!(open.open(ip(1), &limits), Ok(()), "another source still gets a place");
        assert_eq!(open.open(ip(2), &limits), Ok(()));
        assert_eq!(open.open(ip(3), &limits), Err(Crowded::Total));
        open.close(ip(66));
        assert_eq!(open.open(ip(3), &limits), Ok(()), "a closed connection's place is free again");
        assert_eq!(open.take_peak(), (5, 5));
        for source in [66, 66, 1, 2, 3] {
            open.close(ip(source));
        }
        assert_eq!(open.total(), 0);
        assert!(open.by_source.is_empty(), "sources without connections are forgotten");
        assert_eq!(open.take_peak(), (5, 0));
        assert_eq!(open.take_peak(), (0, 0));
        // Closing what was never opened changes nothing.
        open.close(ip(9));
        assert_eq!(open.total(), 0);
    }

    #[test]
    fn the_last_quarter_of_the_places_is_kept_for_sources_with_few_connections() {
        let limits = Bounds { max_connections: 40, max_connections_per_source: 16, ..UNBUDGETED };
        let mut open = OpenConnections::default();
        // Sources with many connections fill the shared three quarters (30), then each its
        // first FEW_CONNECTIONS more from the rest: 16, 14 (8 + 6 to 30), 8.
        let many: Vec<usize> = [66, 67, 68].iter().map(|s| (0..16).filter(|_| open.open(ip(*s), &limits).is_ok()).count()).collect();
        assert_eq!(many, [16, 14, FEW_CONNECTIONS]);
        assert_eq!(open.open(ip(67), &limits), Err(Crowded::Total), "a source with many open is kept out of the last quarter");
        // A source with few open still gets a place.
        assert_eq!(open.open(ip(1), &limits), Ok(()));
        assert_eq!(open.open(ip(2), &limits), Ok(()));
        assert_eq!(open.total(), 40);
        assert_eq!(open.open(ip(4), &limits), Err(Crowded::Total), "never more than the bound in all");
    }

    #[test]
    fn a_gate_gives_a_place_back_when_its_ticket_is_dropped() {
        let metrics = ConnectionMetrics::default();
        let gate = ConnectionGate::new(Bounds { max_connections: 2, max_connections_per_source: 2, ..UNBUDGETED }, metrics.clone());
        let a = gate.admit(ip(1)).expect("a place");
        let _b = gate.admit(ip(1)).expect("a place");
        assert_eq!(gate.admit(ip(2)).map(|_| ()), Err(Crowded::Total));
        assert_eq!(metrics.open.get(), 2);
        drop(a);
        assert_eq!(gate.open(), 1);
        assert!(gate.admit(ip(2)).is_ok());
        assert_eq!(metrics.refused_total.get(), 1);
    }

    #[test]
    fn a_source_whose_connections_fail_is_refused_until_its_bucket_refills() {
        let mut failures = FailureBudget::new(1);
        let now = Instant::now();
        let burst = FAILURE_BURST_SECONDS as usize;
        // A source that never failed connects freely, and is not even tracked.
        assert_eq!(failures.admit(ip(1), now), Some(Paid::Nothing));
        assert_eq!(failures.0.tracked(), 0);
        // A flood of connections from one source, each failing once it was let in: the burst.
        let mut admitted = 0;
        while let Some(paid) = failures.admit(ip(66), now) {
            failures.settle(ip(66), paid, true, now);
            admitted += 1;
            assert!(admitted <= 1_000);
        }
        assert_eq!(admitted, burst, "a burst of FAILURE_BURST_SECONDS seconds' worth");
        assert_eq!(failures.admit(ip(1), now), Some(Paid::Nothing), "another source is not affected");
        // Failures charged while empty run up no debt: a second later, one more.
        failures.settle(ip(66), Paid::Nothing, true, now);
        let second = now + Duration::from_secs(1);
        assert_eq!(failures.admit(ip(66), second), Some(Paid::Token), "below half its budget, a connection pays");
        assert_eq!(failures.admit(ip(66), second), None);
        // Rested long enough, the whole burst again, no more.
        let rested = second + Duration::from_secs(600);
        let again = std::iter::from_fn(|| failures.admit(ip(66), rested).map(|paid| failures.settle(ip(66), paid, true, rested)));
        assert_eq!(again.take(1_000).count(), burst);
    }

    #[test]
    fn connections_opened_at_once_by_a_failing_source_cannot_pass_on_one_token() {
        let mut failures = FailureBudget::new(1);
        let now = Instant::now();
        let burst = FAILURE_BURST_SECONDS as usize;
        // Half the burst fails; then 100 connections arrive at once, before any has failed.
        for _ in 0..burst / 2 + 1 {
            let paid = failures.admit(ip(66), now).expect("within the burst");
            failures.settle(ip(66), paid, true, now);
        }
        let at_once: Vec<Paid> = (0..100).map_while(|_| failures.admit(ip(66), now)).collect();
        assert_eq!(at_once.len(), burst / 2 - 1, "each paid a token up front: as many as were left");
        assert!(at_once.iter().all(|paid| *paid == Paid::Token));
        // Those that carried requests are paid back; the source may connect again.
        for paid in at_once {
            failures.settle(ip(66), paid, false, now);
        }
        assert_eq!(failures.admit(ip(66), now), Some(Paid::Token));
    }

    #[test]
    fn a_source_with_an_occasional_failure_never_pays_up_front() {
        // A kubelet's tcpSocket probe from the API server's address: one failure every 5 s.
        let mut failures = FailureBudget::new(1);
        let start = Instant::now();
        for probe in 0..100u64 {
            let at = start + Duration::from_secs(5 * probe);
            failures.settle(ip(10), Paid::Nothing, true, at);
            // The API server opens 100 connections at once right after.
            assert!((0..100).all(|_| failures.admit(ip(10), at) == Some(Paid::Nothing)), "probe {probe}");
        }
    }

    #[test]
    fn a_gate_refuses_a_failing_source_before_counting_its_connection() {
        let metrics = ConnectionMetrics::default();
        let limits = Bounds { max_connections: 100, max_connections_per_source: 100, failed_connections_per_source: Some(1), ..UNBUDGETED };
        let gate = ConnectionGate::new(limits, metrics.clone());
        let now = Instant::now();
        let mut held = Vec::new();
        for _ in 0..FAILURE_BURST_SECONDS {
            let ticket = gate.admit_at(ip(66), now).expect("within the burst");
            ticket.failure_report().failed();
            held.push(ticket);
        }
        assert_eq!(gate.admit_at(ip(66), now).map(|_| ()), Err(Crowded::Failing));
        assert_eq!(gate.open(), FAILURE_BURST_SECONDS as usize, "a refused connection takes no place");
        assert!(gate.admit_at(ip(1), now).is_ok(), "a source that does not fail is admitted");
        assert_eq!(metrics.refused_failing.get(), 1);
        assert_eq!(metrics.failed.get(), u64::from(FAILURE_BURST_SECONDS));
        // Without a budget, failures are counted and nothing is refused.
        let gate = ConnectionGate::new(Bounds { max_connections: 100, max_connections_per_source: 100, ..UNBUDGETED }, metrics.clone());
        let held: Vec<_> = (0..50).map(|_| gate.admit_at(ip(66), now).expect("no failure budget")).collect();
        held.iter().for_each(|t| t.failure_report().failed());
        assert!(gate.admit_at(ip(66), now).is_ok());
    }
}
