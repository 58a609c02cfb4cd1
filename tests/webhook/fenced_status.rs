//! The FencedController status on the real control plane: the status controller
//! (`kube_fence::fenced::controller`) runs beside the test's webhook (whose routing keeps the
//! writers configuration `kf-test-<ns>-writers` in step) and says, in `Ready` and `holder`, what
//! it finds: no Lease, the holder Pod of the named ServiceAccount (Auditing, then Enforcing once
//! the spec says so), a holder of another ServiceAccount, a holder on the node's network. Each
//! transition of Ready is one Event on the FencedController, and a change that is none (another
//! holder of the same ServiceAccount) publishes none. The Pods are never scheduled.

use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::coordination::v1::Lease as LeaderLease;
use k8s_openapi::api::core::v1::Pod;
use k8s_openapi::api::events::v1::Event;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube_fence::admission::judge::identity::IdentityRule;
use kube_fence::admission::registration::routing;
use kube_fence::fenced::controller::{self, Metrics, StatusOptions};
use kube_fence_api::{FenceMode, FencedController, FencedControllerSpec, FencedControllerStatus, ready};
use serde_json::json;

use super::leader::controller_pods;
use super::{Fixture, common};
use common::leader::until;

const FENCE: &str = "ctl";
const LEASE: &str = "ctl-lease";

/// The Ready condition's (status, reason) and the holder, of FencedController [`FENCE`].
async fn observed(f: &Fixture) -> Option<(String, String, Option<String>, Option<i64>)> {
    let fenced = Api::<FencedController>::namespaced(f.client.clone(), &f.ns).get(FENCE).await.expect("the FencedController");
    let FencedControllerStatus { observed_generation, holder, conditions } = fenced.status?;
    let ready = conditions.into_iter().find(|c| c.type_ == "Ready")?;
    Some((ready.status, ready.reason, holder, observed_generation))
}

/// Waits until Ready is `status` with `reason` and the holder is `holder`.
async fn wait_ready(f: &Fixture, status: &str, reason: &str, holder: Option<&str>) {
    let mut last = None;
    let what = format!("Ready={status} {reason} with holder {holder:?}");
    let limit = Duration::from_secs(30);
    let deadline = std::time::Instant::now() + limit;
    loop {
        last = observed(f).await.or(last);
        if last.as_ref().is_some_and(|(s, r, h, _)| s == status && r == reason && h.as_deref() == holder) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "{what} within {limit:?}; last seen {last:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The reasons of the Events on FencedController [`FENCE`], oldest first, with their types.
async fn events(f: &Fixture) -> Vec<(String, String)> {
    let all = Api::<Event>::namespaced(f.client.clone(), &f.ns).list(&ListParams::default()).await.expect("list Events");
    let mut ours: Vec<_> = all
        .items
        .into_iter()
        .filter(|e| {
            let about = e.regarding.as_ref();
            about.and_then(|r| r.kind.as_deref()) == Some("FencedController")
                && about.and_then(|r| r.name.as_deref()) == Some(FENCE)
                && e.reporting_controller.as_deref() == Some(controller::REPORTER)
        })
        .collect();
    ours.sort_by_key(|e| e.event_time.clone().map(|t| t.0));
    ours.into_iter().map(|e| (e.type_.unwrap_or_default(), e.reason.unwrap_or_default())).collect()
}

/// Pod `pod` of ServiceAccount `ctl` claims Lease [`LEASE`] as `holder`, with its own token (the
/// fenced-holder policy lets only a Pod of the fence's ServiceAccounts claim it, as itself).
async fn hold(f: &Fixture, pod: &Pod, holder: &str) {
    let as_pod = common::identity::client_as_pod(&f.client, &f.ns, "ctl", pod).await;
    let leases = Api::<LeaderLease>::namespaced(as_pod, &f.ns);
    let body = json!({"spec": {"holderIdentity": holder, "leaseDurationSeconds": 15}});
    leases.patch(LEASE, &PatchParams::default(), &Patch::Merge(&body)).await.expect("claim the Lease");
}

/// Waits until the writers configuration of `configuration` routes ServiceAccount ctl. If the
/// routing has not applied it within a few seconds, applies a stand-in that does (the same
/// webhook and condition names, a condition this API server compiles, calling the test's webhook
/// for ctl's ConfigMap writes only, which this test makes none of): what the status judges is the
/// applied configuration, whoever applied it.
async fn wait_routed(f: &Fixture, configuration: &str) {
    let writers = Api::<ValidatingWebhookConfiguration>::all(f.client.clone());
    let name = routing::configuration_name(configuration);
    let user = format!("system:serviceaccount:{}:ctl", f.ns);
    let routed = async || writers.get_opt(&name).await.ok().flatten().is_some_and(|c| routing::routes_in(&c, &user));
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while std::time::Instant::now() < deadline {
        if routed().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("the routing did not route ctl within 5 s (see its log); applying a stand-in {name}");
    let main = writers.get(configuration).await.expect("the test's webhook configuration");
    let client_config = main.webhooks.and_then(|w| w.into_iter().next()).map(|w| w.client_config).expect("a webhook");
    let stand_in = json!({"apiVersion": "admissionregistration.k8s.io/v1", "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": name},
        "webhooks": [{"name": routing::WEBHOOK_NAME, "clientConfig": client_config,
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "resources": ["configmaps"], "operations": ["CREATE"]}],
            "matchConditions": [{"name": routing::CONDITION_NAME, "expression": format!("request.userInfo.username in {{'{user}': true}}")}],
            "failurePolicy": "Fail", "sideEffects": "None", "admissionReviewVersions": ["v1"], "timeoutSeconds": 5}]});
    writers.patch(&name, &PatchParams::apply("kube-fence-tests").force(), &Patch::Apply(&stand_in)).await.expect("apply the stand-in");
    until("the writers configuration routes ctl", Duration::from_secs(30), routed).await;
}

/// Stale-but-honest writer's fence, as an admin watches it come to work: every state of the
/// holder shows in Ready, each change of Ready is one Event, and nothing else is.
#[tokio::test]
async fn the_status_says_whether_the_fence_works_and_who_holds_the_lease() {
    let f = Fixture::new("fenced-status").await;
    let configuration = format!("kf-test-{}", f.ns);
    let stop = tokio_util::sync::CancellationToken::new();
    let options = StatusOptions {
        namespace: Some(f.ns.clone()),
        configuration: configuration.clone(),
        identity: IdentityRule::default(),
        instance: "test".into(),
    };
    let running = tokio::spawn(controller::run(f.client.clone(), options, Metrics::default(), stop.clone()));

    // Pods p1, p2 of ServiceAccount ctl; q1 of another; h1 of ctl on the node's network.
    let pods = controller_pods(&f, &["p1", "p2"]).await;
    common::identity::pods_of(&f.client, &f.ns, "default", &["q1"]).await;
    let host: Pod = serde_json::from_value(json!({"metadata": {"name": "h1"},
        "spec": {"serviceAccountName": "ctl", "hostNetwork": true, "schedulingGates": [{"name": "kubefence.io/never-run"}],
                 "containers": [{"name": "c", "image": "registry.invalid/none"}]}}))
    .expect("a Pod");
    let host =
        Api::<Pod>::namespaced(f.client.clone(), &f.ns).create(&PostParams::default(), &host).await.expect("create the hostNetwork Pod");

    // An Audit fence on a Lease that does not exist yet.
    let fences = Api::<FencedController>::namespaced(f.client.clone(), &f.ns);
    let spec = FencedControllerSpec { lease: LEASE.into(), service_accounts: vec!["ctl".into()], exempt: vec![], mode: FenceMode::Audit };
    fences.create(&PostParams::default(), &FencedController::new(FENCE, spec)).await.expect("create the FencedController");
    wait_ready(&f, "False", ready::LEASE_NOT_FOUND, None).await;

    // Once the writer webhook routes ctl, the Lease appears, held by p1.
    wait_routed(&f, &configuration).await;
    let lease: LeaderLease = serde_json::from_value(json!({"metadata": {"name": LEASE}, "spec": {}})).unwrap();
    Api::<LeaderLease>::namespaced(f.client.clone(), &f.ns).create(&PostParams::default(), &lease).await.expect("create the Lease");
    hold(&f, &pods[0], "p1_1111").await;
    wait_ready(&f, "True", ready::AUDITING, Some("p1")).await;
    assert_eq!(observed(&f).await.and_then(|o| o.3), Some(1), "observedGeneration");

    // Audit → Enforce: a new generation, Enforcing.
    fences.patch(FENCE, &PatchParams::default(), &Patch::Merge(json!({"spec": {"mode": "Enforce"}}))).await.expect("enforce");
    wait_ready(&f, "True", ready::ENFORCING, Some("p1")).await;
    assert_eq!(observed(&f).await.and_then(|o| o.3), Some(2), "observedGeneration follows the spec");

    // A holder of another ServiceAccount; a holder on the node's network; p1 again.
    // A holder of another ServiceAccount: possible only if it held the Lease before the fence
    // existed (the fenced-holder policy refuses its claim while the fence exists), so the admin
    // removes the fence, the other Pod's holder is written, and the fence is made again.
    fences.delete(FENCE, &Default::default()).await.expect("delete the fence");
    until("the fence is gone", Duration::from_secs(30), async || fences.get_opt(FENCE).await.is_ok_and(|f| f.is_none())).await;
    let body = json!({"spec": {"holderIdentity": "q1_2222", "leaseDurationSeconds": 15}});
    let leases = Api::<LeaderLease>::namespaced(f.client.clone(), &f.ns);
    until("the holder binding ends with the fence", Duration::from_secs(30), async || {
        leases.patch(LEASE, &PatchParams::default(), &Patch::Merge(&body)).await.is_ok()
    })
    .await;
    let spec = FencedControllerSpec { lease: LEASE.into(), service_accounts: vec!["ctl".into()], exempt: vec![], mode: FenceMode::Enforce };
    fences.create(&PostParams::default(), &FencedController::new(FENCE, spec)).await.expect("the fence again");
    wait_ready(&f, "False", ready::HOLDER_NOT_FENCED, Some("q1")).await;
    hold(&f, &host, "h1_3333").await;
    wait_ready(&f, "False", ready::HOST_NETWORK, Some("h1")).await;
    hold(&f, &pods[0], "p1_4444").await;
    wait_ready(&f, "True", ready::ENFORCING, Some("p1")).await;

    // Each transition is one Event: Warning when Ready is False, Normal when True.
    let expected: Vec<(String, String)> = [
        ("Warning", ready::LEASE_NOT_FOUND),
        ("Normal", ready::AUDITING),
        ("Normal", ready::ENFORCING),
        ("Warning", ready::HOLDER_NOT_FENCED),
        ("Warning", ready::HOST_NETWORK),
        ("Normal", ready::ENFORCING),
    ]
    .iter()
    .map(|(t, r)| (t.to_string(), r.to_string()))
    .collect();
    let mut seen = Vec::new();
    until("an Event on each transition", Duration::from_secs(30), async || {
        seen = events(&f).await;
        seen.len() >= expected.len()
    })
    .await;
    assert_eq!(seen, expected);

    // Another holder of ServiceAccount ctl: the holder changes, Ready does not, and no Event.
    hold(&f, &pods[1], "p2_5555").await;
    wait_ready(&f, "True", ready::ENFORCING, Some("p2")).await;
    // Past a resync, so a reconcile that would publish one has run.
    tokio::time::sleep(controller::RESYNC + Duration::from_secs(1)).await;
    assert_eq!(events(&f).await, expected, "no Event without a transition");
    println!("fenced status: {} transitions, {} Events", expected.len(), seen.len());

    stop.cancel();
    let _ = tokio::time::timeout(Duration::from_secs(10), running).await;
    f.stop().await;
}
