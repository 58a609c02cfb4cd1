//! What one client of the webhook port can cost kube-fence and the API server.
//!
//! The port is reachable by more than the API server (every Pod, unless the chart's
//! NetworkPolicy or `--client-ca-file` keeps others out), so:
//! - [`ConnectionGate`]: the connections open at once are bounded, in all and per source
//!   address. A connection holds its place ([`Ticket`]) from the moment it is accepted — before
//!   its TLS handshake — until it is closed; beyond either bound a connection is closed at once,
//!   in the accept loop ([`GatedListener`]).
//!   The deadlines of a connection (handshake, headers, body, idle) are in `super::server`.
//! - The reserve ([`Reviewers`]): a quarter of the places ([`RESERVE_DIVISOR`]) is kept for
//!   *reviewing* sources — those that sent a genuine review (an AdmissionReview that was decoded
//!   and judged) within [`REVIEWERS_REMEMBERED`] — such as the API server. The connections of all
//!   other sources together (idle or not, however many sources and connections they open) hold at
//!   most the other three quarters; beyond that a new one from a non-reviewing source is closed
//!   in the accept loop. A reviewing source may take any free place, within its per-source bound.
//!   So the API server, once it has sent one review, always finds a place, whatever the other
//!   clients hold: 300 sources × 7 idle connections, or 3 × 512, fill their three quarters and
//!   no more. Why not the old rule (the last quarter for any source with fewer than 8 open): many
//!   sources with 7 idle connections each took it all, and the API server, once it had 8 open,
//!   was kept out of it. Why a cap by class, and not only idle deadlines (below) or evicting
//!   idle connections: a client that sends a request now and then is never idle, while the cap
//!   holds whatever it sends. What it does not cover: a source that has never reviewed (an API
//!   server meeting a freshly started replica while others already hold the three quarters)
//!   competes for those with everyone else — idle ones are closed within a minute (below), busy
//!   ones are not; and a client able to send well-formed reviews becomes a reviewing source (the
//!   chart's NetworkPolicy or `--client-ca-file` keep such clients off the port).
//!   Which sources review is remembered in a bounded map ([`MAX_REVIEWERS`], the one that
//!   reviewed longest ago forgotten first); a connection is counted in the class its source
//!   had when it was accepted.
//! - Idle connections of sources that sent no review are closed ([`IDLE_WITHOUT_REVIEW`], 30 s
//!   without a byte either way, checked lazily: [`IdleCheck`]), where the API server's may idle
//!   for [`KEEP_ALIVE_IDLE`]: a flood of idle connections gives its places back within a minute,
//!   and only a client that keeps every connection busy keeps its three quarters.
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
use std::future::Future;
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
/// One place in this many of [`Bounds::max_connections`] is kept for reviewing sources (see
/// [`Reviewers`]): sources that sent no review recently hold at most the rest, together.
pub const RESERVE_DIVISOR: usize = 4;
/// How long a source that sent a genuine review stays a reviewing source. Long, so that the API
/// server of a quiet cluster (no guarded write for a while, its pooled connections idled out)
/// still finds its reserve when the next write comes.
pub const REVIEWERS_REMEMBERED: Duration = Duration::from_secs(24 * 3600);
/// Reviewing sources remembered at once: API servers are a handful. Beyond this the one whose
/// last review is the oldest is forgotten.
pub const MAX_REVIEWERS: usize = 256;
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
/// How long a connection accepted from a source that had sent no review ([`Class::Other`]) may
/// go without a byte read or written before it is closed (between once and twice this; checked
/// lazily), unless its source has sent a genuine review since (then [`KEEP_ALIVE_IDLE`] applies,
/// as to the API server's connections). So idle connections cannot hold the places of sources
/// that send no review: a client must keep each one busy. At least the longest an API server
/// waits for a webhook (30 s), so that a review answered slowly is never cut off.
pub const IDLE_WITHOUT_REVIEW: Duration = Duration::from_secs(30);
/// How long a quorum read may go unanswered unless told ([`Bounds::quorum_read_timeout`]; the
/// command line gives `--webhook-timeout-seconds`): the API server's default webhook timeout.
pub const QUORUM_READ_TIMEOUT: Duration = Duration::from_secs(5);

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
    /// How long a connection of a source that sent no review may go without a byte
    /// ([`IDLE_WITHOUT_REVIEW`]).
    pub idle_without_review: Duration,
    /// How long a quorum read may go unanswered before the reviews waiting for it fail closed:
    /// the API server's webhook timeout ([`QUORUM_READ_TIMEOUT`] unless told), past which no
    /// review waits for it any more.
    pub quorum_read_timeout: Duration,
}

impl Default for Bounds {
    fn default() -> Bounds {
        Bounds {
            max_connections: MAX_CONNECTIONS,
            max_connections_per_source: MAX_CONNECTIONS_PER_SOURCE,
            failed_connections_per_source: Some(FAILED_CONNECTIONS_PER_SECOND),
            quorum_reads_per_namespace: Some(QUORUM_READS_PER_NAMESPACE),
            keep_alive_idle: KEEP_ALIVE_IDLE,
            idle_without_review: IDLE_WITHOUT_REVIEW,
            quorum_read_timeout: QUORUM_READ_TIMEOUT,
        }
    }
}

/// Why a connection was closed as soon as it was accepted.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Crowded {
    /// All sources together have [`Bounds::max_connections`] open.
    Total,
    /// Its source address has [`Bounds::max_connections_per_source`] open.
    Source,
    /// Its source address used up its budget of failed connections ([`FailureBudget`]).
    Failing,
    /// Its source sent no review recently, and the connections of such sources hold every place
    /// not kept for reviewing sources ([`RESERVE_DIVISOR`]).
    Reserved,
}

/// The sources that sent a genuine review recently (within [`REVIEWERS_REMEMBERED`]), at most
/// [`MAX_REVIEWERS`] of them: when full, the one that reviewed longest ago is forgotten. Pure:
/// the clock is passed in.
#[derive(Debug)]
pub struct Reviewers {
    last_review: HashMap<IpAddr, Instant>,
    max: usize,
    remembered: Duration,
}

impl Default for Reviewers {
    fn default() -> Reviewers {
        Reviewers::new(MAX_REVIEWERS, REVIEWERS_REMEMBERED)
    }
}

impl Reviewers {
    /// At most `max` sources, each remembered for `remembered` after its last review.
    pub fn new(max: usize, remembered: Duration) -> Reviewers {
        Reviewers { last_review: HashMap::new(), max: max.max(1), remembered }
    }

    /// `source` sent a genuine review at `now`.
    pub fn reviewed(&mut self, source: IpAddr, now: Instant) {
        if let Some(at) = self.last_review.get_mut(&source) {
            // A clock that goes backwards does not make a review older.
            *at = (*at).max(now);
            return;
        }
        if self.last_review.len() >= self.max {
            let oldest = self.last_review.iter().min_by_key(|(_, at)| **at).map(|(source, _)| *source);
            if let Some(oldest) = oldest {
                self.last_review.remove(&oldest);
            }
        }
        self.last_review.insert(source, now);
    }

    /// Whether `source` sent a genuine review within [`REVIEWERS_REMEMBERED`] of `now`.
    pub fn reviewing(&self, source: IpAddr, now: Instant) -> bool {
        self.last_review.get(&source).is_some_and(|at| now.saturating_duration_since(*at) <= self.remembered)
    }

    /// Sources remembered now.
    pub fn len(&self) -> usize {
        self.last_review.len()
    }

    /// Whether no source is remembered.
    pub fn is_empty(&self) -> bool {
        self.last_review.is_empty()
    }
}

/// Whether a connection's source had sent a genuine review recently when it was accepted
/// ([`Reviewers`]): which places it may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// Any free place.
    Reviewing,
    /// Only places not kept for reviewing sources.
    Other,
}

/// Counts of open connections, in all, of non-reviewing sources, and per source. Pure.
#[derive(Debug, Default)]
pub struct OpenConnections {
    total: usize,
    /// Connections accepted while their source was not reviewing ([`Class::Other`]).
    others: usize,
    by_source: HashMap<IpAddr, usize>,
    /// The most open at once since [`OpenConnections::take_peak`] was last called.
    peak: usize,
}

impl OpenConnections {
    /// Takes a place for a connection of `class` from `source`, or says why there is none.
    pub fn open(&mut self, source: IpAddr, class: Class, limits: &Bounds) -> Result<(), Crowded> {
        let from_source = self.by_source.get(&source).copied().unwrap_or(0);
        if from_source >= limits.max_connections_per_source {
            return Err(Crowded::Source);
        }
        if self.total >= limits.max_connections {
            return Err(Crowded::Total);
        }
        // A share of the places is kept for reviewing sources: the others together hold at most
        // the rest.
        let shared = limits.max_connections - limits.max_connections / RESERVE_DIVISOR;
        if class == Class::Other && self.others >= shared {
            return Err(Crowded::Reserved);
        }
        let from_source = self.by_source.entry(source).or_insert(0);
        *from_source += 1;
        self.total += 1;
        if class == Class::Other {
            self.others += 1;
        }
        self.peak = self.peak.max(self.total);
        Ok(())
    }

    /// Gives back the place of a closed connection of `class` from `source`.
    pub fn close(&mut self, source: IpAddr, class: Class) {
        if let Some(n) = self.by_source.get_mut(&source) {
            *n -= 1;
            self.total -= 1;
            if class == Class::Other {
                self.others = self.others.saturating_sub(1);
            }
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
    reviewers: Arc<Mutex<Reviewers>>,
    failures: Option<Arc<Mutex<FailureBudget>>>,
    metrics: ConnectionMetrics,
}

impl ConnectionGate {
    pub fn new(limits: Bounds, metrics: ConnectionMetrics) -> ConnectionGate {
        let failures = limits.failed_connections_per_source.map(|n| Arc::new(Mutex::new(FailureBudget::new(n))));
        ConnectionGate { limits, open: Arc::default(), reviewers: Arc::default(), failures, metrics }
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
        let reviewing = self.reviewers.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).reviewing(source, now);
        let class = if reviewing { Class::Reviewing } else { Class::Other };
        let mut open = self.open.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match open.open(source, class, &self.limits) {
            Ok(()) => {
                self.metrics.open.set(open.total() as i64);
                Ok(Ticket { gate: self.clone(), source, class, paid })
            }
            Err(crowded) => {
                drop(open);
                self.settle(source, paid, false);
                match crowded {
                    Crowded::Total => self.metrics.refused_total.inc(),
                    Crowded::Source => self.metrics.refused_source.inc(),
                    Crowded::Failing => self.metrics.refused_failing.inc(),
                    Crowded::Reserved => self.metrics.refused_reserved.inc(),
                };
                Err(crowded)
            }
        }
    }

    /// `source` sent a genuine review (an AdmissionReview that was decoded and judged): its new
    /// connections may take the places kept for reviewing sources.
    pub fn reviewed(&self, source: IpAddr) {
        self.reviewed_at(source, Instant::now());
    }

    fn reviewed_at(&self, source: IpAddr, now: Instant) {
        self.reviewers.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).reviewed(source, now);
    }

    /// Whether `source` sent a genuine review recently.
    fn reviewing(&self, source: IpAddr) -> bool {
        self.reviewers.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).reviewing(source, Instant::now())
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
    class: Class,
    paid: Paid,
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut open = self.gate.open.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        open.close(self.source, self.class);
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

/// A stream that holds its connection's [`Ticket`] for as long as it lives, and, for a
/// connection of a source that sent no review, its idle deadline ([`IDLE_WITHOUT_REVIEW`]).
#[derive(Debug)]
pub struct Admitted<S> {
    inner: S,
    ticket: Ticket,
    idle: Option<IdleDeadline>,
}

/// The idle deadline of a connection of a source that sent no review, checked lazily: a byte
/// read or written only sets `active`; when the timer fires, an active connection gets another
/// period, an idle one is closed — unless its source has sent a genuine review since.
#[derive(Debug)]
struct IdleDeadline {
    after: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
    active: bool,
}

/// What an idle connection's deadline says when it fires.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IdleCheck {
    /// Bytes moved in the last period: another one.
    Rearm,
    /// Its source has sent a genuine review since it was accepted: no deadline of its own.
    Lift,
    /// Idle a whole period from a source that sent no review: closed.
    Close,
}

impl IdleCheck {
    /// What the deadline of a connection that was `active` in the last period, from a source
    /// `reviewing` now, says. Pure.
    pub fn decide(active: bool, reviewing: bool) -> IdleCheck {
        match (reviewing, active) {
            (true, _) => IdleCheck::Lift,
            (false, true) => IdleCheck::Rearm,
            (false, false) => IdleCheck::Close,
        }
    }
}

impl<S> Admitted<S> {
    fn new(inner: S, ticket: Ticket) -> Admitted<S> {
        let idle = match ticket.class {
            Class::Reviewing => None,
            Class::Other => {
                let after = ticket.gate.limits.idle_without_review;
                Some(IdleDeadline { after, timer: Box::pin(tokio::time::sleep(after)), active: false })
            }
        };
        Admitted { inner, ticket, idle }
    }

    /// Where to report that this connection failed.
    pub fn failure_report(&self) -> FailureReport {
        self.ticket.failure_report()
    }

    /// Bytes moved: the connection is not idle.
    fn moved(&mut self) {
        if let Some(idle) = &mut self.idle {
            idle.active = true;
        }
    }

    /// Whether the connection, waiting, has been idle past its deadline (registering `cx` to be
    /// woken at the deadline otherwise).
    fn idle_past_deadline(&mut self, cx: &mut Context<'_>) -> bool {
        loop {
            let Some(idle) = &mut self.idle else { return false };
            if idle.timer.as_mut().poll(cx).is_pending() {
                return false;
            }
            let reviewing = self.ticket.gate.reviewing(self.ticket.source);
            match IdleCheck::decide(idle.active, reviewing) {
                IdleCheck::Close => return true,
                IdleCheck::Lift => self.idle = None,
                IdleCheck::Rearm => {
                    idle.active = false;
                    let next = tokio::time::Instant::now() + idle.after;
                    idle.timer.as_mut().reset(next);
                    // Polled again: the timer wakes this task at the next deadline.
                }
            }
        }
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for Admitted<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(Ok(())) => {
                if buf.filled().len() > before {
                    self.moved();
                }
                Poll::Ready(Ok(()))
            }
            Poll::Ready(Err(err)) => Poll::Ready(Err(err)),
            Poll::Pending if self.idle_past_deadline(cx) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "closing a connection idle past its deadline: its source sent no review",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Admitted<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.inner).poll_write(cx, buf);
        if matches!(written, Poll::Ready(Ok(n)) if n > 0) {
            self.moved();
        }
        written
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }

    fn poll_write_vectored(mut self: Pin<&mut Self>, cx: &mut Context<'_>, bufs: &[io::IoSlice<'_>]) -> Poll<io::Result<usize>> {
        let written = Pin::new(&mut self.inner).poll_write_vectored(cx, bufs);
        if matches!(written, Poll::Ready(Ok(n)) if n > 0) {
            self.moved();
        }
        written
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
                    return Ok((Admitted::new(stream, ticket), GatedAddr(peer)));
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
        idle_without_review: IDLE_WITHOUT_REVIEW,
        quorum_read_timeout: QUORUM_READ_TIMEOUT,
    };

    #[test]
    fn connections_are_bounded_in_all_and_per_source() {
        let limits = Bounds { max_connections: 5, max_connections_per_source: 3, ..UNBUDGETED };
        let mut open = OpenConnections::default();
        let reviewing = Class::Reviewing;
        assert_eq!((0..10).filter(|_| open.open(ip(66), reviewing, &limits).is_ok()).count(), 3);
        assert_eq!(open.open(ip(66), reviewing, &limits), Err(Crowded::Source));
        assert_eq!(open.open(ip(1), reviewing, &limits), Ok(()), "another source still gets a place");
        assert_eq!(open.open(ip(2), reviewing, &limits), Ok(()));
        assert_eq!(open.open(ip(3), reviewing, &limits), Err(Crowded::Total));
        open.close(ip(66), reviewing);
        assert_eq!(open.open(ip(3), reviewing, &limits), Ok(()), "a closed connection's place is free again");
        assert_eq!(open.take_peak(), (5, 5));
        for source in [66, 66, 1, 2, 3] {
            open.close(ip(source), reviewing);
        }
        assert_eq!(open.total(), 0);
        assert!(open.by_source.is_empty(), "sources without connections are forgotten");
        assert_eq!(open.take_peak(), (5, 0));
        assert_eq!(open.take_peak(), (0, 0));
        // Closing what was never opened changes nothing.
        open.close(ip(9), Class::Other);
        assert_eq!((open.total(), open.others), (0, 0));
    }

    /// A source of 172.16.x.y, the `n`th.
    fn many(n: usize) -> IpAddr {
        IpAddr::from([172, 16, (n >> 8) as u8, n as u8])
    }

    #[test]
    fn the_places_kept_for_reviewing_sources_are_taken_by_no_other() {
        // 40 places, 10 of them kept; 16 per source. The red team's floods, scaled down: many
        // sources with a few connections each (300 × 7 of 2,048), a few with their bound each
        // (3 × 512), both far beyond every place. Then a reviewing source asks for 16.
        let limits = Bounds { max_connections: 40, max_connections_per_source: 16, ..UNBUDGETED };
        // (what floods, sources, connections each tried, others admitted, the reviewing source's admitted)
        let table: [(&str, usize, usize, usize, usize); 5] = [
            ("many sources, few connections each", 60, 7, 30, 10),
            ("few sources, their bound each", 3, 16, 30, 10),
            ("one source", 1, 100, 16, 16),
            ("nobody", 0, 0, 0, 16),
            ("many sources, one connection each", 1_000, 1, 30, 10),
        ];
        for (case, sources, each, others, reviewer) in table {
            let mut open = OpenConnections::default();
            let mut refused = HashMap::<Crowded, usize>::new();
            for source in 0..sources {
                for _ in 0..each {
                    if let Err(crowded) = open.open(many(source), Class::Other, &limits) {
                        *refused.entry(crowded).or_default() += 1;
                    }
                }
            }
            assert_eq!(open.total(), others, "{case}: admitted from the flood");
            assert_eq!(refused.get(&Crowded::Total), None, "{case}: the flood never reaches the bound in all");
            if others == 30 {
                assert_eq!(open.open(many(9_999), Class::Other, &limits), Err(Crowded::Reserved), "{case}");
            }
            let admitted = (0..16).filter(|_| open.open(ip(1), Class::Reviewing, &limits).is_ok()).count();
            assert_eq!(admitted, reviewer, "{case}: the reviewing source's places");
            assert!(open.total() <= limits.max_connections, "{case}");
        }
    }

    #[test]
    fn a_reviewing_source_may_take_any_free_place_and_the_others_then_fewer() {
        let limits = Bounds { max_connections: 40, max_connections_per_source: 32, ..UNBUDGETED };
        let mut open = OpenConnections::default();
        // The API server, busy, holds 32 places, the kept 10 and 22 more.
        assert_eq!((0..32).filter(|_| open.open(ip(1), Class::Reviewing, &limits).is_ok()).count(), 32);
        // The others get what is left of all places: 8, refused then for the bound in all.
        assert_eq!((0..20).filter(|_| open.open(many(7), Class::Other, &limits).is_ok()).count(), 8);
        assert_eq!(open.open(many(8), Class::Other, &limits), Err(Crowded::Total));
        // As the API server's connections close, the others' share grows back to 30, no further.
        for _ in 0..32 {
            open.close(ip(1), Class::Reviewing);
        }
        assert_eq!((0..40).filter(|n| open.open(many(10 + n), Class::Other, &limits).is_ok()).count(), 22);
        assert_eq!(open.others, 30);
        // A connection counted as another's gives its place back as one.
        open.close(many(7), Class::Other);
        assert_eq!(open.open(many(100), Class::Other, &limits), Ok(()));
    }

    #[test]
    fn reviewing_sources_are_remembered_for_a_while_and_boundedly() {
        let start = Instant::now();
        let mut reviewers = Reviewers::new(4, Duration::from_secs(60));
        assert!(!reviewers.reviewing(ip(1), start), "a source that never reviewed");
        reviewers.reviewed(ip(1), start);
        // (when, reviewing)
        let table = [(0, true), (59, true), (60, true), (61, false)];
        for (after, reviewing) in table {
            assert_eq!(reviewers.reviewing(ip(1), start + Duration::from_secs(after)), reviewing, "{after} s after its review");
        }
        // A later review renews; a clock that goes backwards does not make it older.
        reviewers.reviewed(ip(1), start + Duration::from_secs(100));
        reviewers.reviewed(ip(1), start + Duration::from_secs(50));
        assert!(reviewers.reviewing(ip(1), start + Duration::from_secs(150)));
        // Bounded: 1,000 sources reviewing once each leave at most 4 remembered, the latest kept.
        for n in 0..1_000 {
            reviewers.reviewed(many(n), start + Duration::from_secs(100) + Duration::from_millis(n as u64));
        }
        assert_eq!(reviewers.len(), 4);
        assert!(reviewers.reviewing(many(999), start + Duration::from_secs(101)));
        assert!(!reviewers.reviewing(many(0), start + Duration::from_secs(101)), "the one that reviewed longest ago is forgotten");
        // A source that keeps reviewing stays among them.
        let mut reviewers = Reviewers::new(4, Duration::from_secs(60));
        for n in 0..1_000 {
            let at = start + Duration::from_millis(10 * n as u64);
            reviewers.reviewed(many(n), at);
            reviewers.reviewed(ip(1), at);
        }
        assert!(reviewers.reviewing(ip(1), start + Duration::from_secs(10)));
    }

    #[test]
    fn a_gate_keeps_the_reserve_for_sources_that_reviewed() {
        let metrics = ConnectionMetrics::default();
        let gate = ConnectionGate::new(Bounds { max_connections: 8, max_connections_per_source: 8, ..UNBUDGETED }, metrics.clone());
        let now = Instant::now();
        // The API server's first connection, before it sent a review, is one of the others.
        let first = gate.admit_at(ip(1), now).expect("a place");
        gate.reviewed_at(ip(1), now);
        // Others fill their share (6 of 8; the first took one of them).
        let flood: Vec<_> = (0..20).filter_map(|n| gate.admit_at(many(n), now).ok()).collect();
        assert_eq!(flood.len(), 5);
        assert_eq!(metrics.refused_reserved.get(), 15);
        // The API server gets the two kept places, and its first connection's place comes back as
        // one of the others' share.
        let kept: Vec<_> = (0..2).map(|_| gate.admit_at(ip(1), now).expect("a kept place")).collect();
        assert_eq!(gate.admit_at(ip(1), now).map(|_| ()), Err(Crowded::Total));
        drop(first);
        let _late = gate.admit_at(many(50), now).expect("the first connection was counted among the others");
        assert_eq!(gate.open(), 8);
        drop(kept);
        assert_eq!(gate.admit_at(many(51), now).map(|_| ()), Err(Crowded::Reserved), "the kept places stay kept");
        assert_eq!(gate.open(), 6);
    }

    #[test]
    fn an_idle_deadline_rearms_for_an_active_connection_and_lifts_for_a_reviewing_source() {
        // (bytes moved in the last period, its source reviewing now, what the deadline says)
        let table = [
            (false, false, IdleCheck::Close),
            (true, false, IdleCheck::Rearm),
            (false, true, IdleCheck::Lift),
            (true, true, IdleCheck::Lift),
        ];
        for (active, reviewing, check) in table {
            assert_eq!(IdleCheck::decide(active, reviewing), check, "active {active}, reviewing {reviewing}");
        }
    }

    #[tokio::test]
    async fn an_idle_connection_of_a_source_that_sent_no_review_is_closed() {
        use tokio::io::AsyncReadExt;
        let limits =
            Bounds { max_connections: 8, max_connections_per_source: 8, idle_without_review: Duration::from_millis(20), ..UNBUDGETED };
        let gate = ConnectionGate::new(limits, ConnectionMetrics::default());
        let mut buf = [0u8; 8];
        // A source that sent no review: its idle connection is closed (errors) at its deadline.
        let (_client, server) = tokio::io::duplex(64);
        let mut other = Admitted::new(server, gate.admit(ip(66)).expect("a place"));
        let read = tokio::time::timeout(Duration::from_secs(60), other.read(&mut buf)).await.expect("closed at its deadline");
        assert_eq!(read.map_err(|e| e.kind()), Err(io::ErrorKind::TimedOut));
        // A reviewing source's connection has no deadline of its own (the server's keep-alive).
        gate.reviewed(ip(1));
        let (_client, server) = tokio::io::duplex(64);
        assert!(Admitted::new(server, gate.admit(ip(1)).expect("a place")).idle.is_none());
        // Accepted before its source reviewed: the deadline lifts when it fires.
        let (_client, server) = tokio::io::duplex(64);
        let mut early = Admitted::new(server, gate.admit(ip(2)).expect("a place"));
        assert!(early.idle.is_some());
        gate.reviewed(ip(2));
        let waited = tokio::time::timeout(Duration::from_millis(200), early.read(&mut buf)).await;
        assert!(waited.is_err(), "still open: {waited:?}");
        assert!(early.idle.is_none(), "the deadline lifted");
    }

    #[test]
    fn a_gate_gives_a_place_back_when_its_ticket_is_dropped() {
        let metrics = ConnectionMetrics::default();
        let gate = ConnectionGate::new(Bounds { max_connections: 2, max_connections_per_source: 2, ..UNBUDGETED }, metrics.clone());
        gate.reviewed(ip(1));
        gate.reviewed(ip(2));
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
