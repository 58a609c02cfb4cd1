//! Kubernetes Events on Leases (grants, releases, expiries, refusals), bounded.
//!
//! Events are reports: they must not slow the next grant nor grow with the number of leases.
//! They go through the crate's one publisher ([`crate::events::Publisher`]: written directly, in
//! the background, at most `crate::events::MAX_IN_FLIGHT` at once), within one budget over all of
//! the controller's Events ([`PER_SECOND`] a second); the rest are counted and dropped.
//! Transitions are logged and counted in metrics whether or not their Event is published. What
//! is specific here: an Event is about the Lease (the object, not one version of it), with the
//! transition's reason and note.

use k8s_openapi::api::core::v1::ObjectReference;
use kube::{Client, Resource};
use prometheus_client::metrics::counter::Counter;

use crate::events::{Event, EventType, Publisher, Reporter};
use crate::limit::Buckets;
use kube_fence_api::Lease;

/// Events a second, in all (and at most this many at once after a quiet spell).
pub(crate) const PER_SECOND: u32 = 50;

/// The controller's Event budget: one bucket (key `()`) for all its Events.
pub(crate) fn budget() -> Buckets<()> {
    Buckets::with_max_keys(PER_SECOND, PER_SECOND, 1)
}

/// What one transition reports.
pub(crate) struct Report {
    pub warning: bool,
    pub reason: &'static str,
    pub note: String,
}

/// Publishes the controller's Events on Leases, within [`budget`].
#[derive(Clone)]
pub(crate) struct LeaseEvents(Publisher<()>);

impl LeaseEvents {
    pub(crate) fn new(client: Client, controller: &str, instance: &str, suppressed: Counter) -> LeaseEvents {
        let reporter = Reporter { controller: controller.to_string(), instance: Some(instance.to_string()) };
        LeaseEvents(Publisher::new(client, reporter, budget(), suppressed))
    }

    /// Publishes `report` on `lease` in the background, or counts it as suppressed.
    pub(crate) fn publish(&self, lease: &Lease, report: Report) {
        self.0.publish((), event(lease, report));
    }
}

/// The Event `report` makes on `lease`.
fn event(lease: &Lease, report: Report) -> Event {
    let mut regarding: ObjectReference = lease.object_ref(&());
    // The object, not one version of it.
    regarding.resource_version = None;
    Event {
        regarding,
        type_: if report.warning { EventType::Warning } else { EventType::Normal },
        reason: report.reason,
        action: "Reconcile".to_string(),
        note: report.note,
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    /// Threat case: a worker with ordinary RBAC churning its leases (claim, release, claim …)
    /// makes the controller publish at most the budget's Events a second, so it cannot turn its
    /// churn into an Event flood on the API server.
    #[test]
    fn a_burst_of_transitions_publishes_at_most_the_budget_each_second() {
        let mut budget = budget();
        let start = Instant::now();
        let burst = (0..10_000).filter(|_| budget.take((), start)).count();
        assert_eq!(burst, PER_SECOND as usize, "a burst at once: one second's budget");
        // A transition every millisecond for ten more seconds: each second publishes at most the
        // budget (the bucket refills continuously, so a second may fall a token short of it).
        for second in 1..=10u64 {
            let published = (0..1000u64).filter(|ms| budget.take((), start + Duration::from_millis((second - 1) * 1000 + ms + 1))).count();
            assert!(published <= PER_SECOND as usize, "second {second}: {published}");
            assert!(published + 1 >= PER_SECOND as usize, "second {second}: {published}");
        }
    }

    #[test]
    fn an_event_is_about_the_lease_not_one_version_of_it() {
        let mut lease = Lease::new("work", Default::default());
        lease.metadata.namespace = Some("jobs".into());
        lease.metadata.resource_version = Some("42".into());
        let event = event(&lease, Report { warning: true, reason: "Refused", note: "cannot grant".into() });
        assert_eq!(event.regarding.name.as_deref(), Some("work"));
        assert_eq!(event.regarding.namespace.as_deref(), Some("jobs"));
        assert_eq!(event.regarding.resource_version, None);
        assert_eq!((event.type_, event.reason, event.action.as_str()), (EventType::Warning, "Refused", "Reconcile"));
    }
}
