//! Kubernetes Events for rejected writes, so `kubectl describe` shows who was fenced off and why.
//!
//! The webhook port accepts reviews from anyone who can reach it (unless the API server is
//! authenticated by a client certificate, `--client-ca-file`), so a review's facts are not
//! verified. Two bounds keep forged reviews from abusing the Events: each source address has a
//! budget of its own ([`Budget`], [`Budget::PER_SECOND`] a second), so a flood from one Pod
//! cannot use up the API server's budget, and the number of sources tracked is bounded. Events
//! are published in the background and never delay or change a verdict.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kube::runtime::events::{Event, EventType, Recorder, Reporter};

use crate::admission::http::review::Admission;
use kube_fence_api::denial::Reason;

/// Per-source rate limit for rejection Events. Pure: the clock is passed in.
#[derive(Debug, Default)]
pub struct Budget {
    sources: HashMap<IpAddr, Window>,
}

#[derive(Clone, Copy, Debug)]
struct Window {
    started: Instant,
    used: u32,
}

impl Budget {
    /// Events a second per source address.
    pub const PER_SECOND: u32 = 20;
    /// Sources tracked at once; the least recently active one is forgotten beyond that.
    pub const MAX_SOURCES: usize = 256;

    /// Whether `source` may publish one more Event at `now`.
    pub fn admit(&mut self, source: IpAddr, now: Instant) -> bool {
        if !self.sources.contains_key(&source) && self.sources.len() >= Self::MAX_SOURCES {
            let oldest = self.sources.iter().min_by_key(|(_, w)| w.started).map(|(ip, _)| *ip);
            if let Some(oldest) = oldest {
                self.sources.remove(&oldest);
            }
        }
        let window = self.sources.entry(source).or_insert(Window { started: now, used: 0 });
        if now.duration_since(window.started) >= Duration::from_secs(1) {
            *window = Window { started: now, used: 0 };
        }
        window.used += 1;
        window.used <= Self::PER_SECOND
    }
}

/// Publishes a Warning Event on the guarded object for each rejected write, within budget.
pub struct RejectionEvents {
    recorder: Recorder,
    budget: Mutex<Budget>,
}

impl RejectionEvents {
    pub fn new(client: kube::Client, instance: String) -> RejectionEvents {
        let reporter = Reporter { controller: "kube-fence-webhook".into(), instance: Some(instance) };
        RejectionEvents { recorder: Recorder::new(client, reporter), budget: Mutex::new(Budget::default()) }
    }

    /// Publishes the rejection of `request`, sent from `source`; whether it was within budget.
    pub fn publish(&self, source: IpAddr, request: &Admission<'_>, reason: Reason, message: &str) -> bool {
        let (group, version) = (request.kind.group.as_ref(), request.kind.version.as_ref());
        let reference = k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some(if group.is_empty() { version.to_string() } else { format!("{group}/{version}") }),
            kind: Some(request.kind.kind.to_string()),
            namespace: request.namespace.as_deref().map(str::to_string),
            name: Some(request.name.to_string()),
            uid: request.old_object.as_ref().and_then(|o| o.metadata.uid.clone()),
            ..Default::default()
        };
        let user = request.user_info.username.as_deref().unwrap_or_default();
        self.publish_about(source, reference, format!("{user}: {message}"), reason, format!("{:?}", request.operation))
    }

    /// A Warning Event about a fenced writer's refused write, on the leader-election Lease that
    /// fences it (`namespace`/`name`): the written object may be cluster-scoped or not named yet.
    pub fn publish_on_lease(
        &self,
        source: IpAddr,
        namespace: &str,
        name: &str,
        request: &Admission<'_>,
        reason: Reason,
        message: &str,
    ) -> bool {
        let reference = k8s_openapi::api::core::v1::ObjectReference {
            api_version: Some("coordination.k8s.io/v1".into()),
            kind: Some("Lease".into()),
            namespace: Some(namespace.to_string()),
            name: Some(name.to_string()),
            ..Default::default()
        };
        let (kind, object_ns, object) = (request.kind.kind.as_ref(), request.namespace.as_deref().unwrap_or(""), request.name.as_ref());
        let sub = request.sub_resource.as_deref().filter(|s| !s.is_empty()).map(|s| format!(" /{s}")).unwrap_or_default();
        let user = request.user_info.username.as_deref().unwrap_or_default();
        let written = if object_ns.is_empty() { format!("{kind} {object}{sub}") } else { format!("{kind} {object_ns}/{object}{sub}") };
        self.publish_about(
            source,
            reference,
            format!("{user} {:?} {written}: {message}", request.operation),
            reason,
            format!("{:?}", request.operation),
        )
    }

    fn publish_about(
        &self,
        source: IpAddr,
        reference: k8s_openapi::api::core::v1::ObjectReference,
        note: String,
        reason: Reason,
        action: String,
    ) -> bool {
        let admitted = self.budget.lock().map(|mut b| b.admit(source, Instant::now())).unwrap_or(false);
        if !admitted {
            return false;
        }
        let event = Event {
            type_: EventType::Warning,
            reason: reason.as_str().to_string(),
            note: Some(note.chars().take(1024).collect()),
            action,
            secondary: None,
        };
        let recorder = self.recorder.clone();
        tokio::spawn(async move {
            if let Err(err) = recorder.publish(&event, &reference).await {
                tracing::debug!(%err, "publishing a rejection event");
            }
        });
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn a_flood_from_one_source_leaves_the_others_their_budget() {
        let mut budget = Budget::default();
        let now = Instant::now();
        let flood = (0..10_000).filter(|_| budget.admit(ip(66), now)).count();
        assert_eq!(flood, Budget::PER_SECOND as usize);
        let api_server = (0..Budget::PER_SECOND).filter(|_| budget.admit(ip(1), now)).count();
        assert_eq!(api_server, Budget::PER_SECOND as usize);
        assert!(!budget.admit(ip(1), now));
        // A second later each source has its budget again.
        assert!(budget.admit(ip(66), now + Duration::from_secs(1)));
    }

    #[test]
    fn the_sources_tracked_are_bounded() {
        let mut budget = Budget::default();
        let start = Instant::now();
        budget.admit(ip(1), start + Duration::from_secs(5));
        for i in 0..1000u32 {
            let source = IpAddr::from([172, 16, (i >> 8) as u8, i as u8]);
            budget.admit(source, start + Duration::from_millis(u64::from(i)));
        }
        assert!(budget.sources.len() <= Budget::MAX_SOURCES);
        assert!(budget.sources.contains_key(&ip(1)), "the most recently active source is kept");
    }
}
