//! Leader election among controller replicas, on a `coordination.k8s.io/v1` Lease.
//!
//! **For efficiency only.** Safety never depends on it: every status write the controller makes
//! is a compare-and-swap on the Lease's resourceVersion, so two replicas that both believe they
//! lead (a paused leader, a partition) can only waste writes, never issue one token twice or
//! move one backwards. That is why this elector can be small: it judges the current leader's
//! expiry from when *it* last saw the record change (its own monotonic clock, as client-go
//! does), takes over with a compare-and-swap, and steps down when it cannot renew in time.
//!
//! Hand-written because no maintained leader-election crate supports kube 5 yet; it is ~150 lines.

use std::future::Future;
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::{Lease as CoordinationLease, LeaseSpec as CoordinationLeaseSpec};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, ObjectMeta, PostParams};

/// Timing of the election (client-go's defaults: 15 s lease, 10 s renew deadline, 2 s retry).
#[derive(Clone, Debug)]
pub(crate) struct ElectionConfig {
    /// Name of the coordination Lease.
    pub name: String,
    /// Identity of this replica (its pod name).
    pub identity: String,
    /// How long a leader's record is honoured after it last changed.
    pub lease_duration: Duration,
    /// A leader that could not renew for this long steps down (must be < lease_duration).
    pub renew_deadline: Duration,
    /// How often to try to acquire or renew.
    pub retry_period: Duration,
}

impl ElectionConfig {
    pub(crate) fn new(name: impl Into<String>, identity: impl Into<String>) -> Self {
        ElectionConfig {
            name: name.into(),
            identity: identity.into(),
            lease_duration: Duration::from_secs(15),
            renew_deadline: Duration::from_secs(10),
            retry_period: Duration::from_secs(2),
        }
    }
}

/// Runs `work` only while this replica leads; restarts it after leadership is regained.
/// Returns when `work` returns (with its output) or `shutdown` resolves (`None`; the
/// leadership is then released so another replica takes over at once).
pub(crate) async fn run_while_leader<F, T>(
    api: Api<CoordinationLease>,
    config: ElectionConfig,
    mut work: impl FnMut() -> F,
    shutdown: impl Future<Output = ()>,
) -> Option<T>
where
    F: Future<Output = T>,
{
    let mut elector = Elector { api, config, observed: None };
    tokio::pin!(shutdown);
    loop {
        // Campaign.
        loop {
            // An attempt sent into a partition gets no answer (the client has no read timeout):
            // shutdown still ends the campaign.
            let acquired = tokio::select! {
                _ = &mut shutdown => return None,
                acquired = elector.try_acquire_or_renew() => acquired,
            };
            if acquired {
                break;
            }
            tokio::select! {
                _ = &mut shutdown => return None,
                _ = tokio::time::sleep(elector.config.retry_period) => {}
            }
        }
        tracing::info!(lease = %elector.config.name, identity = %elector.config.identity, "became leader");
        // Lead until the work ends, leadership is lost, or shutdown.
        let outcome = tokio::select! {
            out = work() => Some(Some(out)),
            _ = elector.keep_leading() => None,
            _ = &mut shutdown => Some(None),
        };
        match outcome {
            Some(out) => {
                // Best effort, and bounded: a release sent into a partition may never be
                // answered, and the record expires anyway.
                if tokio::time::timeout(elector.config.renew_deadline, elector.release()).await.is_err() {
                    tracing::debug!(lease = %elector.config.name, "releasing the leader-election lease got no answer; it expires");
                }
                return out;
            }
            None => tracing::warn!(lease = %elector.config.name, "lost leadership; work stopped, campaigning again"),
        }
    }
}

struct Elector {
    api: Api<CoordinationLease>,
    config: ElectionConfig,
    /// The record version last seen and when (local monotonic clock): judges the leader's expiry.
    observed: Option<(String, Instant)>,
}

impl Elector {
    /// Renews until a renewal has not succeeded for `renew_deadline`, or someone else leads. A
    /// renewal (or the read of who leads) still unanswered at the renew deadline ends it too: in
    /// a partition it may never be answered, and leading on past the deadline is what the
    /// deadline exists to prevent.
    async fn keep_leading(&mut self) {
        let mut last_renewed = Instant::now();
        loop {
            tokio::time::sleep(self.config.retry_period).await;
            let left = self.config.renew_deadline.saturating_sub(last_renewed.elapsed());
            match tokio::time::timeout(left, self.try_acquire_or_renew()).await {
                Ok(true) => last_renewed = Instant::now(),
                Ok(false) => {
                    let left = self.config.renew_deadline.saturating_sub(last_renewed.elapsed());
                    let leader = tokio::time::timeout(left, self.leader()).await.ok().flatten();
                    if leader.as_deref() != Some(self.config.identity.as_str()) || last_renewed.elapsed() >= self.config.renew_deadline {
                        return;
                    }
                }
                Err(_) => {
                    tracing::warn!(lease = %self.config.name, "no renewal answered within the renew deadline");
                    return;
                }
            }
        }
    }

    async fn leader(&self) -> Option<String> {
        self.api.get_opt(&self.config.name).await.ok().flatten().and_then(|l| l.spec?.holder_identity)
    }

    /// One attempt: create the record, renew our own, or take over an expired one. True when
    /// this replica leads afterwards. Every write is a compare-and-swap on resourceVersion.
    async fn try_acquire_or_renew(&mut self) -> bool {
        let now = MicroTime(Timestamp::now());
        let duration_secs = i32::try_from(self.config.lease_duration.as_secs()).unwrap_or(i32::MAX);
        let current = match self.api.get_opt(&self.config.name).await {
            Ok(current) => current,
            Err(err) => {
                tracing::debug!(%err, "reading the leader-election lease");
                return false;
            }
        };
        let Some(mut record) = current else {
            let fresh = CoordinationLease {
                metadata: ObjectMeta { name: Some(self.config.name.clone()), ..Default::default() },
                spec: Some(CoordinationLeaseSpec {
                    holder_identity: Some(self.config.identity.clone()),
                    lease_duration_seconds: Some(duration_secs),
                    acquire_time: Some(now.clone()),
                    renew_time: Some(now),
                    lease_transitions: Some(0),
                    ..Default::default()
                }),
            };
            return self.api.create(&PostParams::default(), &fresh).await.is_ok();
        };
        let rv = record.metadata.resource_version.clone().unwrap_or_default();
        let spec = record.spec.get_or_insert_with(Default::default);
        let ours = spec.holder_identity.as_deref() == Some(self.config.identity.as_str());
        let vacant = spec.holder_identity.as_deref().is_none_or(str::is_empty);
        if !ours && !vacant {
            // Someone else leads: expired only once its record stood still for a whole duration.
            let seen_at = match &self.observed {
                Some((seen_rv, at)) if *seen_rv == rv => *at,
                _ => {
                    self.observed = Some((rv.clone(), Instant::now()));
                    return false;
                }
            };
            let honoured =
                spec.lease_duration_seconds.map_or(self.config.lease_duration, |s| Duration::from_secs(u64::try_from(s).unwrap_or(0)));
            if seen_at.elapsed() < honoured {
                return false;
            }
        }
        if !ours {
            spec.lease_transitions = Some(spec.lease_transitions.unwrap_or(0).saturating_add(1));
            spec.acquire_time = Some(now.clone());
            spec.holder_identity = Some(self.config.identity.clone());
        }
        spec.renew_time = Some(now);
        spec.lease_duration_seconds = Some(duration_secs);
        // `record` still carries the resourceVersion we judged: the replace is a compare-and-swap.
        match self.api.replace(&self.config.name, &PostParams::default(), &record).await {
            Ok(written) => {
                self.observed = written.metadata.resource_version.map(|rv| (rv, Instant::now()));
                true
            }
            Err(err) => {
                tracing::debug!(%err, "writing the leader-election lease");
                false
            }
        }
    }

    /// Steps down on a clean exit so another replica need not wait for expiry.
    async fn release(&mut self) {
        let Ok(Some(mut record)) = self.api.get_opt(&self.config.name).await else { return };
        let Some(spec) = record.spec.as_mut() else { return };
        if spec.holder_identity.as_deref() != Some(self.config.identity.as_str()) {
            return;
        }
        spec.holder_identity = None;
        spec.renew_time = Some(MicroTime(Timestamp::now()));
        if let Err(err) = self.api.replace(&self.config.name, &PostParams::default(), &record).await {
            tracing::debug!(%err, "releasing the leader-election lease");
        }
    }
}
