//! Kubernetes Events for rejected writes, so `kubectl describe` shows who was fenced off and why.
//!
//! The webhook port accepts reviews from anyone who can reach it (unless the API server is
//! authenticated by a client certificate, `--client-ca-file`), so a review's facts are not
//! verified. Two bounds keep forged reviews from abusing the Events: each source address has a
//! budget of its own ([`budget`], [`PER_SECOND`] a second), so a flood from one Pod cannot use
//! up the API server's budget, and the number of sources tracked is bounded ([`MAX_SOURCES`]).
//! Events go through the crate's one publisher ([`crate::events::Publisher`]), in the background:
//! they never delay or change a verdict. What is specific here: which object a rejection's Event
//! is about, and its note.

use std::net::IpAddr;

use k8s_openapi::api::core::v1::ObjectReference;
use prometheus_client::metrics::counter::Counter;

use crate::admission::http::review::Admission;
use crate::admission::judge::fence::Fence;
use crate::events::{Event, EventType, Publisher, Reporter};
use crate::limit::Buckets;
use kube_fence_api::denial::Reason;

/// Events a second per source address (and at most this many at once after a quiet spell).
pub(crate) const PER_SECOND: u32 = 20;
/// Sources tracked at once; the one idle longest is forgotten beyond that.
pub(crate) const MAX_SOURCES: usize = 256;

/// The webhook's Event budget: a bucket per source address, [`MAX_SOURCES`] of them at most.
pub(crate) fn budget() -> Buckets<IpAddr> {
    Buckets::with_max_keys(PER_SECOND, PER_SECOND, MAX_SOURCES)
}

/// Publishes a Warning Event on the guarded object (or on the Lease that fences its writer) for
/// each rejected write, within its source's budget.
pub struct RejectionEvents(Publisher<IpAddr>);

impl RejectionEvents {
    /// Publishes as `instance` of the webhook; Events over their source's budget are counted in
    /// `suppressed`.
    pub fn new(client: kube::Client, instance: String, suppressed: Counter) -> RejectionEvents {
        let reporter = Reporter { controller: "kube-fence-webhook".into(), instance: Some(instance) };
        RejectionEvents(Publisher::new(client, reporter, budget(), suppressed))
    }

    /// Publishes the rejection of `request`, sent from `source`, on the written object (or
    /// counts it as suppressed); whether it was sent.
    pub fn publish(&self, source: IpAddr, request: &Admission<'_>, reason: Reason, message: &str) -> bool {
        self.0.publish(source, on_object(request, reason, message))
    }

    /// Publishes a fenced writer's write that `fence` refused (or, in Audit mode, would refuse),
    /// sent from `source`, on its FencedController, with `reason`
    /// (`kube_fence_api::fence_events`), or counts it as suppressed; whether it was sent.
    pub fn publish_on_fence(&self, source: IpAddr, fence: &Fence, request: &Admission<'_>, reason: &'static str, message: &str) -> bool {
        self.0.publish(source, on_fence(fence, request, reason, message))
    }
}

/// The Warning Event on the object `request` writes.
fn on_object(request: &Admission<'_>, reason: Reason, message: &str) -> Event {
    let (group, version) = (request.kind.group.as_ref(), request.kind.version.as_ref());
    let regarding = ObjectReference {
        api_version: Some(if group.is_empty() { version.to_string() } else { format!("{group}/{version}") }),
        kind: Some(request.kind.kind.to_string()),
        namespace: request.namespace.as_deref().map(str::to_string),
        name: Some(request.name.to_string()),
        uid: request.old_object.as_ref().and_then(|o| o.metadata.uid.clone()),
        ..Default::default()
    };
    let user = request.user_info.username.as_deref().unwrap_or_default();
    warning(regarding, request, reason.as_str(), format!("{user}: {message}"))
}

/// The Warning Event on the FencedController `fence` that judged the writer of `request`: the
/// written object may be cluster-scoped or not named yet, so the note names it.
fn on_fence(fence: &Fence, request: &Admission<'_>, reason: &'static str, message: &str) -> Event {
    let regarding = ObjectReference {
        api_version: Some(format!("{}/v1alpha1", kube_fence_api::GROUP)),
        kind: Some("FencedController".into()),
        namespace: Some(fence.namespace.clone()),
        name: Some(fence.name.clone()),
        ..Default::default()
    };
    let (kind, object_ns, object) = (request.kind.kind.as_ref(), request.namespace.as_deref().unwrap_or(""), request.name.as_ref());
    let sub = request.sub_resource.as_deref().filter(|s| !s.is_empty()).map(|s| format!(" /{s}")).unwrap_or_default();
    let user = request.user_info.username.as_deref().unwrap_or_default();
    let written = if object_ns.is_empty() { format!("{kind} {object}{sub}") } else { format!("{kind} {object_ns}/{object}{sub}") };
    warning(regarding, request, reason, format!("{user} {:?} {written}: {message}", request.operation))
}

fn warning(regarding: ObjectReference, request: &Admission<'_>, reason: &'static str, note: String) -> Event {
    Event { regarding, type_: EventType::Warning, reason, action: format!("{:?}", request.operation), note }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::admission::http::review;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn a_flood_from_one_source_leaves_the_others_their_budget() {
        let mut budget = budget();
        let now = Instant::now();
        let flood = (0..10_000).filter(|_| budget.take(ip(66), now)).count();
        assert_eq!(flood, PER_SECOND as usize);
        let api_server = (0..PER_SECOND).filter(|_| budget.take(ip(1), now)).count();
        assert_eq!(api_server, PER_SECOND as usize);
        assert!(!budget.take(ip(1), now));
        // A second later each source has its budget again, and the flood no more than that.
        let later = now + Duration::from_secs(1);
        assert_eq!((0..10_000).filter(|_| budget.take(ip(66), later)).count(), PER_SECOND as usize);
        assert!(budget.take(ip(1), later));
    }

    #[test]
    fn the_sources_tracked_are_bounded() {
        let mut budget = budget();
        let start = Instant::now();
        budget.take(ip(1), start + Duration::from_secs(5));
        for i in 0..1000u32 {
            let source = IpAddr::from([172, 16, (i >> 8) as u8, i as u8]);
            budget.take(source, start + Duration::from_millis(u64::from(i)));
        }
        assert!(budget.tracked() <= MAX_SOURCES);
        assert!(budget.knows(&ip(1)), "the most recently active source is kept");
    }

    const REVIEW: &str = r#"{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": "u", "kind": {"group": "apps", "version": "v1", "kind": "Deployment"},
                    "resource": {"group": "apps", "version": "v1", "resource": "deployments"},
                    "name": "web", "namespace": "shop", "operation": "UPDATE", "userInfo": {"username": "mallory"},
                    "object": {"metadata": {"name": "web"}},
                    "oldObject": {"metadata": {"name": "web", "uid": "1234"}}}}"#;

    #[test]
    fn a_rejection_is_a_warning_on_the_written_object() {
        let request = review::decode(REVIEW.as_bytes()).expect("a review");
        let event = on_object(&request, Reason::StaleToken, "token 4 is older than 5");
        let r = &event.regarding;
        assert_eq!(
            (r.api_version.as_deref(), r.kind.as_deref(), r.namespace.as_deref(), r.name.as_deref(), r.uid.as_deref()),
            (Some("apps/v1"), Some("Deployment"), Some("shop"), Some("web"), Some("1234"))
        );
        assert_eq!((event.type_, event.reason, event.action.as_str()), (EventType::Warning, "StaleToken", "Update"));
        assert_eq!(event.note, "mallory: token 4 is older than 5");
    }

    #[test]
    fn a_fenced_writers_rejection_is_a_warning_on_its_fenced_controller_naming_the_object() {
        let request = review::decode(REVIEW.as_bytes()).expect("a review");
        let fence = crate::admission::judge::fake::fence("shop", "web-leader", &["web"], &[], crate::admission::judge::fence::Mode::Enforce);
        let event = on_fence(&fence, &request, Reason::NotHolder.as_str(), "not the holder");
        let r = &event.regarding;
        assert_eq!(
            (r.api_version.as_deref(), r.kind.as_deref(), r.namespace.as_deref(), r.name.as_deref()),
            (Some("kubefence.io/v1alpha1"), Some("FencedController"), Some("shop"), Some("web-leader"))
        );
        assert_eq!(event.note, "mallory Update Deployment shop/web: not the holder");
    }
}
