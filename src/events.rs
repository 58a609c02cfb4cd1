//! The one Kubernetes Event publisher. The webhook's Warning Events on rejected writes and the
//! lease controller's Events on Leases both go through a [`Publisher`]; each caller says only
//! what its Events are about (the object, the reason, the note) and whose budget they use.
//!
//! Events are reports: publishing one never delays or changes the work that caused it. An Event
//! is written in the background, within a budget ([`crate::limit::Buckets`], per key: a source
//! address for the webhook, `()` for all of the controller's) and at most [`MAX_IN_FLIGHT`] at
//! once; the rest are counted as suppressed and dropped, so neither a flood of forged reviews nor
//! a churn of leases turns into a flood of Events on the API server, or into tasks piling up
//! while it is slow.
//!
//! Events are written directly (`events.k8s.io/v1`, one Event each, no series) rather than
//! through kube-runtime's `Recorder`: to count repeats into a series, the `Recorder` keeps every
//! Event it published for six minutes and rescans them all on each publish, so its memory and
//! CPU grow with the number of objects Events are about (tens of thousands under lease churn, or
//! any number of names in forged reviews) instead of with the budget.

use std::hash::Hash;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event as Resource;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, PostParams};
pub(crate) use kube::runtime::events::{EventType, Reporter};
use prometheus_client::metrics::counter::Counter;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::limit::Buckets;

/// Event writes waiting for the API server at once, per publisher. Beyond that an Event is
/// suppressed rather than queued: a slow API server must not make publishers hold ever more
/// Events in memory.
pub(crate) const MAX_IN_FLIGHT: usize = 16;

/// The longest note the API server accepts, in bytes; a longer one is cut (at a character
/// boundary) rather than have the whole Event refused.
pub(crate) const MAX_NOTE_BYTES: usize = 1024;

/// Events about objects with no namespace (cluster-scoped ones) are written here, as
/// Kubernetes' own components do.
const CLUSTER_EVENTS_NAMESPACE: &str = "default";

/// One Event, as a caller describes it.
#[derive(Clone, Debug)]
pub(crate) struct Event {
    /// The object the Event is about (`kubectl describe` of it shows the Event).
    pub regarding: ObjectReference,
    pub type_: EventType,
    /// Why, in PascalCase (`kubectl describe`'s Reason).
    pub reason: &'static str,
    /// What was done, in PascalCase.
    pub action: String,
    /// What happened, for a person (`kubectl describe`'s Message).
    pub note: String,
}

/// Publishes Events within a budget per key `K` and [`MAX_IN_FLIGHT`] at once, counting the
/// Events it drops in `suppressed`. Cloning shares the budget, the bound and the counter.
#[derive(Clone)]
pub(crate) struct Publisher<K> {
    client: Client,
    reporter: Reporter,
    gate: Arc<Gate<K>>,
}

impl<K: Hash + Eq + Copy> Publisher<K> {
    /// Publishes as `reporter` through `client`, each key at most what `budget` allows, and
    /// counts the Events not published in `suppressed`.
    pub(crate) fn new(client: Client, reporter: Reporter, budget: Buckets<K>, suppressed: Counter) -> Publisher<K> {
        Publisher { client, reporter, gate: Arc::new(Gate::new(budget, MAX_IN_FLIGHT, suppressed)) }
    }

    /// Publishes `event` in the background, charged to `key`'s budget; whether it was sent (if
    /// not, it was counted as suppressed). Never waits: the write runs as its own task, so this
    /// must be called within a Tokio runtime.
    pub(crate) fn publish(&self, key: K, event: Event) -> bool {
        let Some(permit) = self.gate.admit(key, Instant::now()) else {
            return false;
        };
        let resource = resource(&self.reporter, event, Timestamp::now());
        let namespace = resource.metadata.namespace.clone().unwrap_or_default();
        let api: Api<Resource> = Api::namespaced(self.client.clone(), &namespace);
        tokio::spawn(async move {
            if let Err(err) = api.create(&PostParams::default(), &resource).await {
                tracing::debug!(%err, reason = resource.reason.as_deref().unwrap_or_default(), "publishing an event");
            }
            drop(permit);
        });
        true
    }
}

/// What an Event must pass before it is written: its key's budget and a place among those in
/// flight. Pure but for the semaphore; the clock is passed in.
struct Gate<K> {
    budget: Mutex<Buckets<K>>,
    in_flight: Arc<Semaphore>,
    suppressed: Counter,
}

impl<K: Hash + Eq + Copy> Gate<K> {
    fn new(budget: Buckets<K>, in_flight: usize, suppressed: Counter) -> Gate<K> {
        Gate { budget: Mutex::new(budget), in_flight: Arc::new(Semaphore::new(in_flight)), suppressed }
    }

    /// A place in flight for one Event of `key` at `now`, or `None` (counted as suppressed).
    /// The place is taken first, so an Event dropped because too many are in flight does not
    /// also use up its key's budget.
    fn admit(&self, key: K, now: Instant) -> Option<OwnedSemaphorePermit> {
        let permit = self.in_flight.clone().try_acquire_owned().ok();
        // The budget holds no invariant a panic elsewhere could break: use it even if poisoned.
        let admitted = permit.filter(|_| self.budget.lock().unwrap_or_else(PoisonError::into_inner).take(key, now));
        if admitted.is_none() {
            self.suppressed.inc();
        }
        admitted
    }
}

/// The longest prefix an Event's name may have: a name is a DNS subdomain (at most 253
/// characters), and the prefix is followed by `.` and the moment in hex (at most 32 digits).
const MAX_NAME_PREFIX: usize = 253 - 1 - 32;

/// What an object's name lends an Event's name: the API server refuses an Event whose name is
/// not a DNS subdomain, and objects may have names that are not (253 characters already, or
/// `system:controller:x` for a ClusterRole, upper case for some custom resources). Lower case,
/// each dot-separated part kept to `[a-z0-9-]` with no dash at either end, empty parts dropped,
/// cut to [`MAX_NAME_PREFIX`]; empty if nothing is left.
fn name_prefix(name: &str) -> String {
    let parts = name.split('.').map(|part| {
        let part: String =
            part.chars().map(|c| c.to_ascii_lowercase()).map(|c| if c.is_ascii_alphanumeric() || c == '-' { c } else { '-' }).collect();
        part.trim_matches('-').to_string()
    });
    let joined = parts.filter(|part| !part.is_empty()).collect::<Vec<_>>().join(".");
    // Only ASCII is left, so any byte is a character boundary.
    joined[..joined.len().min(MAX_NAME_PREFIX)].trim_end_matches(['-', '.']).to_string()
}

/// The `events.k8s.io/v1` Event `reporter` writes for `event` at `now`.
fn resource(reporter: &Reporter, event: Event, now: Timestamp) -> Resource {
    let Event { regarding, type_, reason, action, mut note } = event;
    let namespace = regarding.namespace.clone().filter(|ns| !ns.is_empty()).unwrap_or_else(|| CLUSTER_EVENTS_NAMESPACE.to_string());
    // Unique per object and moment; an object not named yet (generateName), or whose name has
    // nothing an Event's name may keep, lends the reporter's name instead.
    let prefix =
        regarding.name.as_deref().map(name_prefix).filter(|name| !name.is_empty()).unwrap_or_else(|| name_prefix(&reporter.controller));
    let name = format!("{prefix}.{:x}", now.as_nanosecond());
    if note.len() > MAX_NOTE_BYTES {
        let mut cut = MAX_NOTE_BYTES;
        while !note.is_char_boundary(cut) {
            cut -= 1;
        }
        note.truncate(cut);
    }
    Resource {
        metadata: ObjectMeta { name: Some(name), namespace: Some(namespace), ..Default::default() },
        event_time: Some(MicroTime(now)),
        action: Some(action),
        reason: Some(reason.to_string()),
        note: Some(note),
        type_: Some(
            match type_ {
                EventType::Normal => "Normal",
                EventType::Warning => "Warning",
            }
            .to_string(),
        ),
        reporting_controller: Some(reporter.controller.clone()),
        reporting_instance: Some(reporter.instance.clone().unwrap_or_else(|| reporter.controller.clone())),
        regarding: Some(regarding),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn gate(per_second: u32, in_flight: usize) -> Gate<u8> {
        Gate::new(Buckets::new(per_second, per_second), in_flight, Counter::default())
    }

    #[test]
    fn events_over_the_budget_are_suppressed_and_counted() {
        let gate = gate(5, 100);
        let now = Instant::now();
        let sent = (0..50).filter_map(|_| gate.admit(1, now)).count();
        assert_eq!(sent, 5);
        assert_eq!(gate.suppressed.get(), 45);
        assert!(gate.admit(2, now).is_some(), "another key has its own budget");
        assert!(gate.admit(1, now + Duration::from_secs(1)).is_some(), "a second later the key has more");
    }

    #[test]
    fn events_beyond_those_in_flight_are_suppressed_without_using_the_budget() {
        let gate = gate(3, 2);
        let now = Instant::now();
        let held: Vec<_> = (0..2).filter_map(|_| gate.admit(1, now)).collect();
        assert_eq!(held.len(), 2);
        assert!(gate.admit(1, now).is_none(), "two in flight already");
        assert_eq!(gate.suppressed.get(), 1);
        drop(held);
        // The Event refused for want of a place did not cost a token: one is left.
        assert!(gate.admit(1, now).is_some());
        assert!(gate.admit(1, now).is_none());
    }

    fn reporter() -> Reporter {
        Reporter { controller: "kube-fence-test".into(), instance: Some("pod-0".into()) }
    }

    fn event(namespace: Option<&str>, name: &str, note: String) -> Event {
        Event {
            regarding: ObjectReference {
                kind: Some("ConfigMap".into()),
                namespace: namespace.map(str::to_string),
                name: Some(name.to_string()),
                ..Default::default()
            },
            type_: EventType::Warning,
            reason: "StaleToken",
            action: "Update".into(),
            note,
        }
    }

    #[test]
    fn the_resource_carries_the_event_and_its_reporter() {
        let now = Timestamp::from_second(1_700_000_000).unwrap();
        let r = resource(&reporter(), event(Some("work"), "state", "late".into()), now);
        assert_eq!(r.metadata.namespace.as_deref(), Some("work"));
        assert_eq!(r.metadata.name, Some(format!("state.{:x}", now.as_nanosecond())));
        assert_eq!(r.type_.as_deref(), Some("Warning"));
        assert_eq!(r.reason.as_deref(), Some("StaleToken"));
        assert_eq!(r.action.as_deref(), Some("Update"));
        assert_eq!(r.note.as_deref(), Some("late"));
        assert_eq!(r.reporting_controller.as_deref(), Some("kube-fence-test"));
        assert_eq!(r.reporting_instance.as_deref(), Some("pod-0"));
        assert_eq!(r.regarding.and_then(|o| o.name).as_deref(), Some("state"));
        assert_eq!(r.series, None, "one Event each, never a series");
    }

    #[test]
    fn a_cluster_scoped_or_unnamed_object_still_gets_a_valid_event() {
        let now = Timestamp::now();
        let r = resource(&reporter(), event(None, "", "x".into()), now);
        assert_eq!(r.metadata.namespace.as_deref(), Some(CLUSTER_EVENTS_NAMESPACE));
        assert_eq!(r.metadata.name, Some(format!("kube-fence-test.{:x}", now.as_nanosecond())));
    }

    /// An Event's name is a DNS subdomain whatever the object's name (the API server refused
    /// the Event of an object named with 253 characters, or with a colon).
    #[rstest::rstest]
    #[case::plain("state", "state")]
    #[case::dotted("a.b-c", "a.b-c")]
    #[case::cluster_role("system:controller:x", "system-controller-x")]
    #[case::upper_case("MyWidget", "mywidget")]
    #[case::dashes_at_the_ends_of_a_part("-a-.-b", "a.b")]
    #[case::empty_parts("a..b.", "a.b")]
    #[case::nothing_left(":::", "")]
    #[case::longest(&"x".repeat(253), &"x".repeat(MAX_NAME_PREFIX))]
    #[case::cut_before_a_dot(&format!("{}.{}", "x".repeat(MAX_NAME_PREFIX - 1), "y".repeat(20)), &"x".repeat(MAX_NAME_PREFIX - 1))]
    fn an_events_name_is_made_valid_from_the_objects(#[case] object: &str, #[case] prefix: &str) {
        assert_eq!(name_prefix(object), prefix);
        let now = Timestamp::now();
        let name = resource(&reporter(), event(Some("work"), object, "x".into()), now).metadata.name.unwrap_or_default();
        assert!(name.len() <= 253, "{} characters", name.len());
        let valid_part = |p: &str| {
            !p.is_empty()
                && p.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !p.starts_with('-')
                && !p.ends_with('-')
        };
        assert!(name.split('.').all(valid_part), "{name} is a DNS subdomain");
    }

    #[test]
    fn a_long_note_is_cut_to_the_limit_at_a_character_boundary() {
        let note = "é".repeat(MAX_NOTE_BYTES);
        let r = resource(&reporter(), event(Some("work"), "state", note), Timestamp::now());
        let cut = r.note.unwrap();
        assert!(cut.len() <= MAX_NOTE_BYTES && cut.len() >= MAX_NOTE_BYTES - 1);
        assert!(cut.chars().all(|c| c == 'é'));
    }
}
