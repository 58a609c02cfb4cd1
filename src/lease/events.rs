//! Kubernetes Events on Leases (grants, releases, expiries, refusals), bounded.
//!
//! Events are reports: they must not slow the next grant nor grow with the number of leases.
//! kube-runtime's `Recorder` keeps every Event it published for six minutes, keyed by the object
//! reference *with its resourceVersion*, so under churn it holds one entry per transition (tens
//! of thousands at 10,000 leases) and rescans them all on each publish. These Events are written
//! directly instead (`events.k8s.io/v1`, no series), at most [`Budget::PER_SECOND`] a second in
//! all and [`MAX_IN_FLIGHT`] at once; the rest are counted and dropped. Transitions are logged
//! and counted in metrics whether or not their Event is published.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, PostParams};
use kube::{Client, Resource};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::Semaphore;

use kube_fence_api::Lease;

/// Event publishes waiting for the API server at once.
pub const MAX_IN_FLIGHT: usize = 16;

/// A rate limit over all Events of one controller. Pure: the clock is passed in.
#[derive(Debug, Default)]
pub struct Budget {
    window: Option<(Instant, u32)>,
}

impl Budget {
    /// Events a second, in all.
    pub const PER_SECOND: u32 = 50;

    /// Whether one more Event may be published at `now`.
    pub fn admit(&mut self, now: Instant) -> bool {
        let (started, used) = match self.window {
            Some((started, used)) if now.duration_since(started) < Duration::from_secs(1) => (started, used),
            _ => (now, 0),
        };
        self.window = Some((started, used + 1));
        used < Self::PER_SECOND
    }
}

/// What one transition reports.
pub struct Report {
    pub warning: bool,
    pub reason: &'static str,
    pub note: String,
}

/// Publishes the controller's Events on Leases, within [`Budget`] and [`MAX_IN_FLIGHT`].
#[derive(Clone)]
pub struct LeaseEvents {
    client: Client,
    controller: String,
    instance: String,
    budget: Arc<Mutex<Budget>>,
    in_flight: Arc<Semaphore>,
    suppressed: Counter,
}

impl LeaseEvents {
    pub fn new(client: Client, controller: &str, instance: &str, suppressed: Counter) -> LeaseEvents {
        LeaseEvents {
            client,
            controller: controller.to_string(),
            instance: instance.to_string(),
            budget: Arc::new(Mutex::new(Budget::default())),
            in_flight: Arc::new(Semaphore::new(MAX_IN_FLIGHT)),
            suppressed,
        }
    }

    /// Publishes `report` on `lease` in the background, or counts it as suppressed.
    pub fn publish(&self, lease: &Lease, report: Report) {
        let admitted = self.budget.lock().map(|mut b| b.admit(Instant::now())).unwrap_or(false);
        let permit = admitted.then(|| self.in_flight.clone().try_acquire_owned().ok()).flatten();
        let (Some(permit), Some(namespace)) = (permit, lease.meta().namespace.clone()) else {
            self.suppressed.inc();
            return;
        };
        let event = self.event(lease, report);
        let api: Api<Event> = Api::namespaced(self.client.clone(), &namespace);
        tokio::spawn(async move {
            if let Err(err) = api.create(&PostParams::default(), &event).await {
                tracing::debug!(%err, "publishing an event");
            }
            drop(permit);
        });
    }

    fn event(&self, lease: &Lease, report: Report) -> Event {
        let now = Timestamp::now();
        let mut regarding: ObjectReference = lease.object_ref(&());
        // The object, not one version of it.
        regarding.resource_version = None;
        let name = regarding.name.clone().unwrap_or_default();
        Event {
            metadata: ObjectMeta {
                name: Some(format!("{name}.{:x}", now.as_nanosecond())),
                namespace: regarding.namespace.clone(),
                ..Default::default()
            },
            event_time: Some(MicroTime(now)),
            action: Some("Reconcile".to_string()),
            reason: Some(report.reason.to_string()),
            note: Some(report.note),
            type_: Some(if report.warning { "Warning" } else { "Normal" }.to_string()),
            reporting_controller: Some(self.controller.clone()),
            reporting_instance: Some(self.instance.clone()),
            regarding: Some(regarding),
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Threat case: a worker with ordinary RBAC churning its leases (claim, release, claim …)
    /// makes the controller publish at most the budget's Events a second, so it cannot turn its
    /// churn into an Event flood on the API server.
    #[test]
    fn a_burst_of_transitions_publishes_at_most_the_budget_each_second() {
        let mut budget = Budget::default();
        let start = Instant::now();
        let admitted = (0..10_000).filter(|_| budget.admit(start)).count();
        assert_eq!(admitted, Budget::PER_SECOND as usize);
        assert!(!budget.admit(start + Duration::from_millis(999)));
        assert!(budget.admit(start + Duration::from_secs(1)), "a second later the budget is there again");
    }
}
