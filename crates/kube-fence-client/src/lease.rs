//! Acquire, renew, keep alive and release a lease.

use std::fmt;
use std::time::Duration;

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::Client;
use kube::api::{Api, PostParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, watch_object};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::Error;
use kube_fence_api::state::{HELD_CONDITION, REASON_EXPIRED, held, lease_duration};
use kube_fence_api::token::Token;
use kube_fence_api::{Lease, LeaseSpec};

/// How many times a heartbeat or release retries a lost compare-and-swap before giving up.
const CAS_ATTEMPTS: usize = 8;

/// Leases in one namespace, seen from a worker.
#[derive(Clone)]
pub struct Leases {
    api: Api<Lease>,
    namespace: String,
}

/// A grant: this holder holds `lease` with `token`. Pass it to the fenced write helpers
/// ([`Grant::create`], [`Grant::replace`], [`Grant::patch`], [`Grant::delete`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Grant {
    pub namespace: String,
    pub lease: String,
    pub holder: String,
    pub token: Token,
    /// The lease duration the controller applies.
    pub duration: Duration,
    /// Until when (local monotonic clock) the lease is certainly still held: the moment the
    /// last confirmed claim or heartbeat was *sent*, plus the duration. The controller starts
    /// the duration when it observes the write, which is later, so this errs on the safe side.
    pub valid_until: Instant,
    /// uid of the Lease object: a Lease deleted and re-created is a different lease.
    pub uid: Option<String>,
}

/// Options of [`Leases::acquire`].
#[derive(Clone, Debug, Default)]
pub struct AcquireOptions {
    /// Lease duration to ask for; `None` keeps the Lease's (15 s when it is created).
    pub duration: Option<Duration>,
    /// Give up after this long (withdrawing the claim); `None` waits forever.
    pub timeout: Option<Duration>,
    /// Give up when cancelled (withdrawing the claim).
    pub cancel: Option<CancellationToken>,
}

impl AcquireOptions {
    pub fn duration(mut self, duration: Duration) -> Self {
        self.duration = Some(duration);
        self
    }
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }
    pub fn cancel(mut self, cancel: CancellationToken) -> Self {
        self.cancel = Some(cancel);
        self
    }
}

/// Why a holder no longer holds its grant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Loss {
    /// The controller observed no heartbeat for the lease duration.
    Expired,
    /// The lease was released (by this holder or by someone clearing `spec.holder`).
    Released,
    /// A newer grant exists (to another holder, or to this holder after it lost the lease).
    Superseded { token: Token },
    /// The Lease was deleted (or deleted and re-created).
    Deleted,
    /// No heartbeat was confirmed within the lease duration (API server unreachable, or
    /// heartbeats too slow): the lease may have expired, so stop acting on it.
    Unconfirmed,
    /// Someone else holds the lease (never this holder's grant to begin with).
    HeldBy(String),
}

impl fmt::Display for Loss {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Loss::Expired => write!(f, "the lease expired: the controller observed no heartbeat within the lease duration"),
            Loss::Released => write!(f, "the lease was released"),
            Loss::Superseded { token } => write!(f, "a newer grant with token {token} exists"),
            Loss::Deleted => write!(f, "the Lease was deleted"),
            Loss::Unconfirmed => write!(f, "no heartbeat was confirmed within the lease duration"),
            Loss::HeldBy(holder) => write!(f, "it is held by {holder}"),
        }
    }
}

/// What [`Leases::acquire`] does next, judged from the Lease as last seen.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// `holder` holds the lease with this token.
    Granted(Token),
    /// No Lease exists: create it with the claim.
    Create,
    /// The lease is free: claim it (set `spec.holder`, compare-and-swap).
    Claim,
    /// Someone holds it, or a claim (maybe ours) awaits the controller: wait for a change.
    Wait { held_by: Option<String> },
}

/// Pure: what a would-be `holder` does next, given the Lease as last seen.
pub fn next_step(lease: Option<&Lease>, holder: &str) -> Step {
    let Some(lease) = lease else { return Step::Create };
    let claimant = lease.spec.holder.as_deref();
    if let Some((current, token)) = held(lease.status.as_ref()) {
        return if current == holder && claimant == Some(holder) {
            Step::Granted(token)
        } else {
            // Held by another, or our own release not processed yet.
            Step::Wait { held_by: Some(current.to_string()) }
        };
    }
    let observed = lease.status.as_ref().and_then(|s| s.observed_generation).unwrap_or(0);
    let pending = lease.metadata.generation.unwrap_or(0) > observed;
    match claimant {
        Some(_) if pending => Step::Wait { held_by: None },
        _ => Step::Claim,
    }
}

/// Pure: whether `grant` is lost, judged from the Lease as last seen.
pub fn loss(lease: Option<&Lease>, grant: &Grant) -> Option<Loss> {
    let Some(lease) = lease else { return Some(Loss::Deleted) };
    if grant.uid.is_some() && lease.metadata.uid != grant.uid {
        return Some(Loss::Deleted);
    }
    let status = lease.status.as_ref();
    match held(status) {
        Some((holder, token)) if holder == grant.holder && token == grant.token => None,
        Some((_, token)) if token != grant.token => Some(Loss::Superseded { token }),
        _ => match status.and_then(|s| s.token) {
            Some(token) if token > grant.token => Some(Loss::Superseded { token }),
            _ => {
                let expired = status
                    .and_then(|s| s.conditions.iter().find(|c| c.type_ == HELD_CONDITION))
                    .is_some_and(|c| c.reason == REASON_EXPIRED);
                Some(if expired { Loss::Expired } else { Loss::Released })
            }
        },
    }
}

impl Leases {
    pub fn new(client: Client, namespace: &str) -> Leases {
        Leases { api: Api::namespaced(client, namespace), namespace: namespace.to_string() }
    }

    /// The Lease named `name`.
    pub async fn get(&self, name: &str) -> Result<Lease, Error> {
        self.api.get_opt(name).await?.ok_or_else(|| Error::LeaseNotFound { lease: self.qualified(name) })
    }

    /// The grant `holder` holds on `name` right now, for a process that did not acquire it itself
    /// (the CLI's `renew`). Its `valid_until` is now: renew it to confirm it.
    pub async fn current_grant(&self, name: &str, holder: &str) -> Result<Grant, Error> {
        let lease = self.get(name).await?;
        match held(lease.status.as_ref()) {
            Some((h, token)) if h == holder && lease.spec.holder.as_deref() == Some(holder) => {
                Ok(self.grant_of(&lease, holder, token, Instant::now()))
            }
            Some((other, _)) if other != holder => {
                Err(Error::NotHeld { lease: self.qualified(name), holder: holder.to_string(), loss: Loss::HeldBy(other.to_string()) })
            }
            _ => Err(Error::NotHeld { lease: self.qualified(name), holder: holder.to_string(), loss: Loss::Released }),
        }
    }

    /// Acquires `name` for `holder`, creating the Lease when none exists, and waits — up to the
    /// timeout, or until cancelled — while another holder has it. Returns the grant with its
    /// fencing token. On timeout or cancellation the claim is withdrawn (tried for at most 5 s:
    /// one that cannot be, e.g. in a partition, is granted to nobody and expires). The timeout
    /// and the cancel hold while a request is in flight too: one sent into a partition gets no
    /// answer, as the client has no read timeout.
    ///
    /// It watches the Lease while it waits, so the caller needs `list` and `watch` on
    /// `leases.kubefence.io` besides `get`, `create` and `update`. A watch the API server
    /// refuses (401, 403) fails the call at once with that refusal ([`Error::Kube`]) instead of
    /// being retried until the timeout; other watch errors are retried.
    ///
    /// If `holder` already holds the lease, the grant is renewed and returned with its token
    /// unchanged: give every incarnation of a worker its own identity (e.g. pod name plus a
    /// start time) so a restarted worker gets a fresh token.
    ///
    /// Cancel with [`AcquireOptions::cancel`] rather than by dropping the future: a dropped
    /// acquire cannot withdraw a pending claim, which is then granted to nobody listening and
    /// blocks others until it expires.
    ///
    /// ```no_run
    /// # async fn example(leases: kube_fence_client::Leases) -> Result<(), kube_fence_client::Error> {
    /// use std::time::Duration;
    /// use kube_fence_client::AcquireOptions;
    /// let grant = leases.acquire("db-migration", "worker-a", AcquireOptions::default().timeout(Duration::from_secs(30))).await?;
    /// println!("token {}", grant.token);
    /// # Ok(()) }
    /// ```
    pub async fn acquire(&self, name: &str, holder: &str, options: AcquireOptions) -> Result<Grant, Error> {
        let started = Instant::now();
        let deadline = options.timeout.map(|t| started + t);
        let cancel = options.cancel.clone().unwrap_or_default();
        // One watch for the whole wait: each item is the Lease as it is now (None: absent).
        let mut versions = watch_object(self.api.clone(), name).default_backoff().boxed();
        let mut held_by = None;
        let mut claim_sent: Option<Instant> = None;
        let post = PostParams::default();
        loop {
            let seen = tokio::select! {
                item = versions.next() => match item {
                    Some(Ok(seen)) => seen,
                    Some(Err(err)) => match refused(&err) {
                        // Not allowed to list or watch the Lease: waiting cannot change that.
                        Some(refusal) => {
                            self.withdraw(name, holder).await;
                            return Err(refusal.into());
                        }
                        None => { tracing::debug!(%err, "watching the lease"); continue }
                    },
                    None => return Err(Error::Missing("watch stream")),
                },
                why = gave_up(deadline, &cancel) => return Err(self.give_up(name, holder, why, started, held_by).await),
            };
            // Each write below is raced against the deadline and the caller's cancel too: one
            // sent into a partition gets no answer (the client has no read timeout).
            match next_step(seen.as_ref(), holder) {
                Step::Granted(token) => {
                    let Some(lease) = seen else { continue };
                    let grant = self.grant_of(&lease, holder, token, claim_sent.unwrap_or(started));
                    // Granted on a claim we did not make in this call (already held): renew,
                    // which also confirms it from now on.
                    let Some(_) = claim_sent else {
                        return tokio::select! {
                            renewed = self.renew(&grant) => renewed,
                            why = gave_up(deadline, &cancel) => Err(self.give_up(name, holder, why, started, held_by).await),
                        };
                    };
                    return Ok(grant);
                }
                Step::Create => {
                    let lease = Lease::new(name, self.claim_spec(LeaseSpec::default(), holder, options.duration));
                    let sent = Instant::now();
                    let created = tokio::select! {
                        created = self.api.create(&post, &lease) => created,
                        why = gave_up(deadline, &cancel) => return Err(self.give_up(name, holder, why, started, held_by).await),
                    };
                    match created {
                        Ok(_) => claim_sent = Some(sent),
                        Err(kube::Error::Api(s)) if s.is_already_exists() => {}
                        Err(err) => return Err(err.into()),
                    }
                }
                Step::Claim => {
                    let Some(mut lease) = seen else { continue };
                    lease.spec = self.claim_spec(lease.spec, holder, options.duration);
                    lease.metadata.managed_fields = None;
                    let sent = Instant::now();
                    // Carries the resourceVersion we judged: a compare-and-swap. Losing it (to
                    // another contender) or a takeover denial just means: judge the newer version.
                    let claimed = tokio::select! {
                        claimed = self.api.replace(name, &post, &lease) => claimed,
                        why = gave_up(deadline, &cancel) => return Err(self.give_up(name, holder, why, started, held_by).await),
                    };
                    match claimed {
                        Ok(_) => claim_sent = Some(sent),
                        Err(kube::Error::Api(s)) if s.is_conflict() || s.is_invalid() || s.is_not_found() => {}
                        Err(err) => return Err(err.into()),
                    }
                }
                Step::Wait { held_by: by } => held_by = by,
            }
        }
    }

    /// One heartbeat: writes a new `spec.heartbeatTime` (compare-and-swap), which the
    /// controller records as a renewal on its own clock. Returns the grant with `valid_until`
    /// moved on, or [`Error::NotHeld`] if the grant was lost.
    pub async fn renew(&self, grant: &Grant) -> Result<Grant, Error> {
        let sent = self
            .edit_spec(&grant.lease, "heartbeat not written", |lease| {
                let sent = Instant::now();
                if let Some(loss) = loss(lease.as_deref(), grant) {
                    return Err(self.not_held(grant, loss));
                }
                let Some(lease) = lease else { return Err(self.not_held(grant, Loss::Deleted)) };
                if lease.spec.holder.as_deref() != Some(grant.holder.as_str()) {
                    return Err(self.not_held(grant, Loss::Released));
                }
                lease.spec.heartbeat_time = Some(next_heartbeat(lease.spec.heartbeat_time.as_ref()));
                Ok(Edit::Write(sent))
            })
            .await?;
        Ok(Grant { valid_until: sent + grant.duration, ..grant.clone() })
    }

    /// Releases the grant: clears `spec.holder` (compare-and-swap); the controller then marks
    /// the lease unheld, keeping the token so the next grant is greater. Releasing a grant that
    /// was already lost is not an error; releasing when a *newer* grant to the same holder
    /// exists is refused, so an old incarnation cannot release its successor.
    pub async fn release(&self, grant: &Grant) -> Result<(), Error> {
        let released = self
            .edit_spec(&grant.lease, "not released", |lease| {
                let Some(lease) = lease else { return Ok(Edit::Skip(())) };
                if lease.spec.holder.as_deref() != Some(grant.holder.as_str()) {
                    return Ok(Edit::Skip(()));
                }
                if let Some(Loss::Superseded { token }) = loss(Some(lease), grant)
                    && held(lease.status.as_ref()).is_some_and(|(h, _)| h == grant.holder)
                {
                    return Err(self.not_held(grant, Loss::Superseded { token }));
                }
                lease.spec.holder = None;
                Ok(Edit::Write(()))
            })
            .await;
        match released {
            Err(Error::Kube(kube::Error::Api(s))) if s.is_not_found() => Ok(()),
            other => other,
        }
    }

    /// Edits the spec of Lease `name` with a compare-and-swap: reads it, lets `edit` change it in
    /// place (or decide there is nothing to write), and writes it back with the resourceVersion
    /// read; on a conflict, reads and edits again. The one place a client changes a Lease's spec.
    async fn edit_spec<T>(
        &self,
        name: &str,
        gave_up: &str,
        mut edit: impl FnMut(Option<&mut Lease>) -> Result<Edit<T>, Error>,
    ) -> Result<T, Error> {
        for _ in 0..CAS_ATTEMPTS {
            let mut lease = self.api.get_opt(name).await?;
            let value = match edit(lease.as_mut())? {
                Edit::Skip(value) => return Ok(value),
                Edit::Write(value) => value,
            };
            let Some(mut lease) = lease else { return Ok(value) };
            lease.metadata.managed_fields = None;
            match self.api.replace(name, &PostParams::default(), &lease).await {
                Ok(_) => return Ok(value),
                Err(kube::Error::Api(s)) if s.is_conflict() => continue,
                Err(err) => return Err(err.into()),
            }
        }
        Err(Error::Conflict(format!("lease {} kept changing; {gave_up}", self.qualified(name))))
    }

    /// Starts heartbeating every `duration / 3` in a background task, and watches the lease so a
    /// loss is reported as soon as it is seen. Dropping the [`KeepAlive`] stops it (it does not
    /// release the lease).
    pub fn keep_alive(&self, grant: &Grant) -> KeepAlive {
        self.keep_alive_with(grant, KeepAliveOptions::default())
    }

    /// [`Leases::keep_alive`] with options (e.g. another heartbeat interval).
    pub fn keep_alive_with(&self, grant: &Grant, options: KeepAliveOptions) -> KeepAlive {
        let (tx, rx) = watch::channel(Holding::Held { token: grant.token, valid_until: grant.valid_until });
        let stop = CancellationToken::new();
        let interval = options.interval.unwrap_or(grant.duration / 3).max(Duration::from_millis(10));
        let task = tokio::spawn(keep_alive_task(self.clone(), grant.clone(), interval, tx, stop.clone()));
        KeepAlive { state: rx, stop, task: Some(task) }
    }

    fn claim_spec(&self, mut spec: LeaseSpec, holder: &str, duration: Option<Duration>) -> LeaseSpec {
        spec.holder = Some(holder.to_string());
        if let Some(d) = duration {
            spec.lease_duration_seconds = Some(u32::try_from(d.as_secs().max(1)).unwrap_or(u32::MAX));
        }
        // A new heartbeat makes the claim a spec change (a new generation) even when the holder
        // name is the same as the expired claim's: only a new generation is granted.
        spec.heartbeat_time = Some(next_heartbeat(spec.heartbeat_time.as_ref()));
        spec
    }

    fn grant_of(&self, lease: &Lease, holder: &str, token: Token, sent: Instant) -> Grant {
        let duration = Duration::try_from(lease_duration(&lease.spec)).unwrap_or(Duration::ZERO);
        Grant {
            namespace: self.namespace.clone(),
            lease: lease.metadata.name.clone().unwrap_or_default(),
            holder: holder.to_string(),
            token,
            duration,
            valid_until: sent + duration,
            uid: lease.metadata.uid.clone(),
        }
    }

    /// Ends an acquire that timed out or was cancelled: withdraws its claim, if it made one, for
    /// at most [`WITHDRAW_WAIT`] (a claim left behind is granted to nobody and expires), and
    /// says why it ended.
    async fn give_up(&self, name: &str, holder: &str, why: GaveUp, started: Instant, held_by: Option<String>) -> Error {
        if tokio::time::timeout(WITHDRAW_WAIT, self.withdraw(name, holder)).await.is_err() {
            tracing::debug!(lease = name, "withdrawing a claim got no answer in time; it expires");
        }
        match why {
            GaveUp::Timeout => Error::Timeout { lease: self.qualified(name), waited: started.elapsed(), held_by },
            GaveUp::Cancelled => Error::Cancelled { lease: self.qualified(name) },
        }
    }

    /// Best effort, after a timeout or cancellation: take back a claim not yet granted, or
    /// release a grant that arrived too late to be used.
    async fn withdraw(&self, name: &str, holder: &str) {
        let withdrawn = self
            .edit_spec(name, "claim not withdrawn", |lease| {
                let Some(lease) = lease else { return Ok(Edit::Skip(())) };
                let pending = matches!(next_step(Some(lease), holder), Step::Wait { held_by: None } | Step::Granted(_));
                if lease.spec.holder.as_deref() != Some(holder) || !pending {
                    return Ok(Edit::Skip(()));
                }
                lease.spec.holder = None;
                Ok(Edit::Write(()))
            })
            .await;
        if let Err(err) = withdrawn {
            tracing::debug!(%err, lease = name, "withdrawing a claim");
        }
    }

    fn not_held(&self, grant: &Grant, loss: Loss) -> Error {
        Error::NotHeld { lease: self.qualified(&grant.lease), holder: grant.holder.clone(), loss }
    }

    fn qualified(&self, name: &str) -> String {
        format!("{}/{}", self.namespace, name)
    }
}

/// The API server's refusal of a watch (its initial list, its start or an error in its stream)
/// for this caller: 401 (credentials rejected) or 403 (RBAC). Retrying, as the watcher's backoff
/// does for every error, cannot end it; anything else (the API server unreachable, a watch that
/// expired) may pass.
fn refused(err: &watcher::Error) -> Option<kube::Error> {
    let status = match err {
        watcher::Error::InitialListFailed(kube::Error::Api(status))
        | watcher::Error::WatchStartFailed(kube::Error::Api(status))
        | watcher::Error::WatchFailed(kube::Error::Api(status))
        | watcher::Error::WatchError(status) => status,
        _ => return None,
    };
    matches!(status.code, 401 | 403).then(|| kube::Error::Api(status.clone()))
}

/// What one compare-and-swap edit of a Lease's spec decided.
enum Edit<T> {
    /// The Lease was changed in place: write it back, then return the value.
    Write(T),
    /// Nothing to write: return the value.
    Skip(T),
}

/// A heartbeat timestamp: the local time, nudged forward if it would equal the previous one
/// (only the change matters: the controller never reads the value).
fn next_heartbeat(previous: Option<&MicroTime>) -> MicroTime {
    let now = Timestamp::now();
    match previous {
        Some(MicroTime(p)) if now <= *p => MicroTime(p.saturating_add(SignedDuration::from_micros(1)).unwrap_or(now)),
        _ => MicroTime(now),
    }
}

/// How long an acquire that gave up tries to withdraw its claim.
const WITHDRAW_WAIT: Duration = Duration::from_secs(5);

/// Why an acquire stopped waiting.
#[derive(Clone, Copy, Debug)]
enum GaveUp {
    Timeout,
    Cancelled,
}

/// Resolves when the deadline passes or the caller cancels.
async fn gave_up(deadline: Option<Instant>, cancel: &CancellationToken) -> GaveUp {
    tokio::select! {
        _ = sleep_until_opt(deadline) => GaveUp::Timeout,
        _ = cancel.cancelled() => GaveUp::Cancelled,
    }
}

async fn sleep_until_opt(deadline: Option<Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d).await,
        None => futures::future::pending().await,
    }
}

/// Options of [`Leases::keep_alive_with`].
#[derive(Clone, Debug, Default)]
pub struct KeepAliveOptions {
    /// Time between heartbeats; default a third of the lease duration.
    pub interval: Option<Duration>,
}

/// What a keep-alive knows about its grant.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Holding {
    /// Still held; certainly until `valid_until` (local monotonic clock).
    Held { token: Token, valid_until: Instant },
    /// Lost, and why. Final.
    Lost(Loss),
}

/// A running keep-alive (see [`Leases::keep_alive`]).
pub struct KeepAlive {
    state: watch::Receiver<Holding>,
    stop: CancellationToken,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl KeepAlive {
    /// The current state, and every change of it.
    pub fn subscribe(&self) -> watch::Receiver<Holding> {
        self.state.clone()
    }

    /// The state now.
    pub fn holding(&self) -> Holding {
        self.state.borrow().clone()
    }

    /// Resolves when the grant is lost (at once if it already is).
    pub async fn lost(&mut self) -> Loss {
        loop {
            if let Holding::Lost(loss) = &*self.state.borrow_and_update() {
                return loss.clone();
            }
            if self.state.changed().await.is_err() {
                // The task ended without reporting a loss: it was stopped.
                return match &*self.state.borrow() {
                    Holding::Lost(loss) => loss.clone(),
                    Holding::Held { .. } => futures::future::pending().await,
                };
            }
        }
    }

    /// Stops heartbeating (the lease is not released; see [`Leases::release`]).
    pub async fn stop(mut self) {
        self.stop.cancel();
        if let Some(task) = self.task.take() {
            let _ = task.await;
        }
    }
}

impl Drop for KeepAlive {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn keep_alive_task(leases: Leases, grant: Grant, interval: Duration, state: watch::Sender<Holding>, stop: CancellationToken) {
    let mut versions = watch_object(leases.api.clone(), &grant.lease).default_backoff().boxed();
    let mut ticker = tokio::time::interval_at(Instant::now() + interval, interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut valid_until = grant.valid_until;
    // The heartbeat in flight, if any. It is one more thing the loop waits on, never the only
    // one: a heartbeat sent into a partition can hang as long as the client lets it (kube's has
    // no read timeout), and meanwhile the grant must still end at `valid_until`, a loss seen by
    // the watch must still end it, and `stop` must still return at once.
    let mut heartbeat: Option<BoxFuture<'static, Result<Grant, Error>>> = None;
    let lost = loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep_until(valid_until) => break Loss::Unconfirmed,
            item = versions.next() => match item {
                Some(Ok(seen)) => if let Some(loss) = loss(seen.as_ref(), &grant) { break loss },
                Some(Err(err)) => tracing::debug!(%err, "watching the lease"),
                None => {}
            },
            _ = ticker.tick(), if heartbeat.is_none() => {
                let (renewing, sending) = (leases.clone(), Grant { valid_until, ..grant.clone() });
                heartbeat = Some(async move { renewing.renew(&sending).await }.boxed());
            }
            renewed = async {
                match heartbeat.as_mut() {
                    Some(sent) => sent.await,
                    None => std::future::pending().await,
                }
            }, if heartbeat.is_some() => {
                heartbeat = None;
                match renewed {
                    Ok(renewed) => {
                        valid_until = renewed.valid_until;
                        let _ = state.send(Holding::Held { token: grant.token, valid_until });
                    }
                    Err(Error::NotHeld { loss, .. }) => break loss,
                    Err(err) => tracing::warn!(lease = %grant.lease, %err, "heartbeat failed; retrying"),
                }
            }
        }
    };
    tracing::info!(lease = %grant.lease, holder = %grant.holder, token = %grant.token, loss = %lost, "lease lost");
    let _ = state.send(Holding::Lost(lost));
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube_fence_api::{LeaseStatus, Phase};
    use rstest::rstest;

    fn lease(spec_holder: Option<&str>, generation: i64, status: Option<(Phase, Option<&str>, u64, i64)>) -> Lease {
        let mut l = Lease::new("l", LeaseSpec { holder: spec_holder.map(String::from), ..Default::default() });
        l.metadata.generation = Some(generation);
        l.status = status.map(|(phase, holder, token, og)| LeaseStatus {
            phase,
            holder: holder.map(String::from),
            token: Token::new(token),
            observed_generation: Some(og),
            ..Default::default()
        });
        l
    }

    fn status(code: u16, reason: &str) -> Box<kube::core::Status> {
        Box::new(kube::core::Status { code, reason: reason.into(), message: format!("{reason} ({code})"), ..Default::default() })
    }

    /// A watch the API server refuses for the caller ends acquire at once, with the refusal;
    /// what may pass (the server unreachable or failing, an expired watch) is retried.
    #[rstest]
    #[case::list_forbidden(watcher::Error::InitialListFailed(kube::Error::Api(status(403, "Forbidden"))), Some(403))]
    #[case::watch_forbidden(watcher::Error::WatchStartFailed(kube::Error::Api(status(403, "Forbidden"))), Some(403))]
    #[case::stream_forbidden(watcher::Error::WatchFailed(kube::Error::Api(status(403, "Forbidden"))), Some(403))]
    #[case::credentials_rejected(watcher::Error::WatchError(status(401, "Unauthorized")), Some(401))]
    #[case::expired(watcher::Error::WatchError(status(410, "Expired")), None)]
    #[case::server_error(watcher::Error::WatchStartFailed(kube::Error::Api(status(500, "InternalError"))), None)]
    #[case::throttled(watcher::Error::InitialListFailed(kube::Error::Api(status(429, "TooManyRequests"))), None)]
    #[case::no_resource_version(watcher::Error::NoResourceVersion, None)]
    fn refused_watches_are_not_retried(#[case] err: watcher::Error, #[case] code: Option<u16>) {
        let refusal = refused(&err).map(|refusal| match refusal {
            kube::Error::Api(status) => status.code,
            other => panic!("{err}: refused as {other}, not as the API server's status"),
        });
        assert_eq!(refusal, code, "{err}");
    }

    #[rstest]
    #[case::absent(None, Step::Create)]
    #[case::fresh_unclaimed(Some(lease(None, 1, None)), Step::Claim)]
    #[case::fresh_claimed_by_other(Some(lease(Some("b"), 1, None)), Step::Wait { held_by: None })]
    #[case::my_claim_pending(Some(lease(Some("me"), 3, Some((Phase::Unheld, None, 7, 2)))), Step::Wait { held_by: None })]
    #[case::my_old_claim_handled(Some(lease(Some("me"), 3, Some((Phase::Unheld, None, 7, 3)))), Step::Claim)]
    #[case::others_old_claim_handled(Some(lease(Some("b"), 3, Some((Phase::Unheld, None, 7, 3)))), Step::Claim)]
    #[case::released(Some(lease(None, 4, Some((Phase::Unheld, None, 7, 4)))), Step::Claim)]
    #[case::held_by_other(Some(lease(Some("b"), 3, Some((Phase::Held, Some("b"), 7, 3)))), Step::Wait { held_by: Some("b".into()) })]
    #[case::other_released_not_yet_processed(Some(lease(None, 4, Some((Phase::Held, Some("b"), 7, 3)))), Step::Wait { held_by: Some("b".into()) })]
    #[case::granted_to_me(Some(lease(Some("me"), 3, Some((Phase::Held, Some("me"), 9, 3)))), Step::Granted(Token::new(9).unwrap_or(Token::MAX)))]
    #[case::my_release_pending(Some(lease(None, 4, Some((Phase::Held, Some("me"), 9, 3)))), Step::Wait { held_by: Some("me".into()) })]
    fn acquire_steps(#[case] seen: Option<Lease>, #[case] expected: Step) {
        assert_eq!(next_step(seen.as_ref(), "me"), expected);
    }

    fn grant(token: u64) -> Grant {
        Grant {
            namespace: "ns".into(),
            lease: "l".into(),
            holder: "me".into(),
            token: Token::new(token).unwrap_or(Token::MAX),
            duration: Duration::from_secs(10),
            valid_until: Instant::now(),
            uid: None,
        }
    }

    #[rstest]
    #[case::still_held(Some(lease(Some("me"), 3, Some((Phase::Held, Some("me"), 9, 3)))), None)]
    #[case::deleted(None, Some(Loss::Deleted))]
    #[case::released(Some(lease(None, 4, Some((Phase::Unheld, None, 9, 4)))), Some(Loss::Released))]
    #[case::superseded(Some(lease(Some("b"), 5, Some((Phase::Held, Some("b"), 12, 5)))), Some(Loss::Superseded { token: Token::new(12).unwrap_or(Token::MAX) }))]
    #[case::regranted_to_me(Some(lease(Some("me"), 5, Some((Phase::Held, Some("me"), 12, 5)))), Some(Loss::Superseded { token: Token::new(12).unwrap_or(Token::MAX) }))]
    fn losses(#[case] seen: Option<Lease>, #[case] expected: Option<Loss>) {
        assert_eq!(loss(seen.as_ref(), &grant(9)), expected);
    }

    #[test]
    fn heartbeats_always_change() {
        let far_future = MicroTime(Timestamp::now().saturating_add(SignedDuration::from_hours(1000)).unwrap_or(Timestamp::MAX));
        let next = next_heartbeat(Some(&far_future));
        assert!(next.0 > far_future.0);
    }
}
