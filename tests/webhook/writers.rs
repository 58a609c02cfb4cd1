//! Fencing the writer, not the object, on the real control plane: a cluster admin creates a
//! `FencedController` naming the controller's `coordination.k8s.io` Lease and its ServiceAccount
//! `ctl`, and from then on every write of `ctl` — new unlabelled objects, cluster-scoped objects,
//! subresources, deletecollection — is admitted only from the Pod holding that Lease (Enforce),
//! or admitted with a warning (Audit). The Lease carries no label or annotation of kube-fence's.
//! The Pods are never scheduled: each client authenticates with a ServiceAccount token bound to
//! its Pod, as the kubelet would mount it. Each test says which threat case it covers.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease as LeaderLease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube_fence::admission::registration::routing;
use kube_fence_api::denial::Reason;
use kube_fence_api::{FenceMode, FencedController, FencedControllerSpec, fence_events};
use serde_json::json;

use super::leader::{controller_pods, elect, not_holder};
use super::{Fixture, common};
use common::leader::{LEASE, until};

const AT: &str = "2026-12-03T09:00:00.000000Z";

/// The FencedController `ctl` of the test's namespace: Lease `ctl`, ServiceAccount `ctl`.
fn fence(f: &Fixture, exempt: &[&str], mode: FenceMode) -> FencedController {
    let mut fenced = FencedController::new(
        LEASE,
        FencedControllerSpec {
            lease: LEASE.into(),
            service_accounts: vec!["ctl".into()],
            exempt: exempt.iter().map(|e| e.to_string()).collect(),
            mode,
        },
    );
    fenced.metadata.namespace = Some(f.ns.clone());
    fenced
}

fn fences(f: &Fixture) -> Api<FencedController> {
    Api::namespaced(f.client.clone(), &f.ns)
}

/// Pods p1 and p2 of ServiceAccount `ctl`, clients for both, and the controller already running:
/// its Lease `ctl` (created as client-go would, no kube-fence label) held by p1. Then the admin
/// fences it (`exempt`, `mode`), and once the writer webhook judges `ctl`'s writes, returns.
async fn fenced_controller(f: &Fixture, exempt: &[&str], mode: FenceMode) -> (Client, Client, Vec<Pod>) {
    let (p1, p2, made) = running_controller(f).await;
    fences(f).create(&PostParams::default(), &fence(f, exempt, mode)).await.expect("the admin fences the controller");
    match mode {
        FenceMode::Enforce => wait_writer_fenced(f, &p2).await,
        FenceMode::Audit => wait_writer_audited(f, &p2).await,
    }
    (p1, p2, made)
}

/// Pods p1 and p2 of ServiceAccount `ctl`, clients for both, and the controller running: its
/// Lease `ctl` created by p1 (as client-go would, no kube-fence label) and held by p1.
async fn running_controller(f: &Fixture) -> (Client, Client, Vec<Pod>) {
    let made = controller_pods(f, &["p1", "p2"]).await;
    common::leader::may_patch_namespace(&f.client, &f.ns, "ctl").await;
    let p1 = common::identity::client_as_pod(&f.client, &f.ns, "ctl", &made[0]).await;
    let p2 = common::identity::client_as_pod(&f.client, &f.ns, "ctl", &made[1]).await;
    let lease: LeaderLease = serde_json::from_value(json!({"metadata": {"name": LEASE}, "spec": {}})).unwrap();
    Api::<LeaderLease>::namespaced(p1.clone(), &f.ns).create(&PostParams::default(), &lease).await.expect("p1 creates its Lease");
    elect(&p1, &f.ns, LEASE, "p1_1111", AT, 1).await.expect("p1 acquires");
    (p1, p2, made)
}

/// Waits until a write of p2 (which does not hold the Lease) is refused: the writer webhook is
/// registered and the API server calls it. The probe is a cluster-scoped write (a label on the
/// test's Namespace), which no exemption in these tests admits.
async fn wait_writer_fenced(f: &Fixture, p2: &Client) {
    let namespaces = Api::<Namespace>::all(p2.clone());
    until("the writer webhook judges ServiceAccount ctl's writes", Duration::from_secs(30), async || {
        match namespaces.patch(&f.ns, &PatchParams::default(), &label_namespace("probe")).await {
            Ok(_) => false,
            Err(kube::Error::Api(e)) if e.reason == Reason::NotHolder.as_str() => true,
            Err(e) => panic!("probe write failed otherwise: {e}"),
        }
    })
    .await;
}

/// Waits until a write of p2 (which does not hold the Lease) is admitted with the audit warning.
async fn wait_writer_audited(f: &Fixture, p2: &Client) {
    until("the writer webhook audits ServiceAccount ctl's writes", Duration::from_secs(30), async || {
        let (status, warnings) = patch_namespace_label(p2, &f.ns, "probe").await;
        assert!(status.is_success(), "an audited write is admitted: {status}");
        warnings.iter().any(|w| w.contains("kube-fence (audit mode) would deny this write"))
    })
    .await;
}

/// Labels the Namespace `ns` as `client`, as client-go sends it, with the response's status and
/// the warnings the API server passed on (where admission warnings travel; kubectl prints them).
async fn patch_namespace_label(client: &Client, ns: &str, value: &str) -> (http::StatusCode, Vec<String>) {
    let body = label_namespace(value);
    let request = kube::core::Request::new("/api/v1/namespaces").patch(ns, &PatchParams::default(), &body).expect("a patch request");
    let response = client.send(request.map(kube::client::Body::from)).await.expect("the API server answers");
    let warnings = response.headers().get_all("warning").iter().map(|v| v.to_str().unwrap_or_default().to_string()).collect();
    (response.status(), warnings)
}

fn fresh_configmap(name: &str) -> ConfigMap {
    serde_json::from_value(json!({"metadata": {"name": name}, "data": {"k": "v"}})).unwrap()
}

fn label_namespace(value: &str) -> Patch<serde_json::Value> {
    Patch::Merge(json!({"metadata": {"labels": {"written-by": value}}}))
}

/// Stale-but-honest writer (a leader that lost its Lease and did not notice): after p2 takes the
/// Lease over, p1's writes of every kind are refused — a new unlabelled ConfigMap, a patch of a
/// cluster-scoped Namespace, its Pod's `/status`, a deletecollection — with 409 `NotHolder`
/// naming holder and requester, while p2's are admitted. What a follower writes whether it leads
/// or not is never judged: Events and its Lease (campaigning).
#[tokio::test]
async fn after_a_takeover_the_ex_leader_writes_nothing_anywhere() {
    let f = Fixture::new("writers-takeover").await;
    let (p1, p2, _) = fenced_controller(&f, &[], FenceMode::Enforce).await;
    let cms = |c: &Client| Api::<ConfigMap>::namespaced(c.clone(), &f.ns);
    let namespaces = |c: &Client| Api::<Namespace>::all(c.clone());
    let pp = PatchParams::default();

    // p1 leads: its writes land, p2's do not.
    common::accepted(cms(&p1).create(&PostParams::default(), &fresh_configmap("made-by-p1")).await);
    common::accepted(namespaces(&p1).patch(&f.ns, &pp, &label_namespace("p1")).await);
    not_holder(cms(&p2).create(&PostParams::default(), &fresh_configmap("made-by-p2")).await, "p1_1111", "p2");
    not_holder(namespaces(&p2).patch(&f.ns, &pp, &label_namespace("p2")).await, "p1_1111", "p2");

    // p2 takes the Lease over (p1's expired); p1 goes on as if it still led.
    elect(&p2, &f.ns, LEASE, "p2_2222", "2026-12-03T09:00:09.000000Z", 2).await.expect("p2 takes over");
    not_holder(cms(&p1).create(&PostParams::default(), &fresh_configmap("late-p1")).await, "p2_2222", "p1");
    not_holder(cms(&p1).patch("made-by-p1", &pp, &Patch::Merge(json!({"data": {"k": "stale"}}))).await, "p2_2222", "p1");
    not_holder(namespaces(&p1).patch(&f.ns, &pp, &label_namespace("stale-p1")).await, "p2_2222", "p1");
    not_holder(
        Api::<Pod>::namespaced(p1.clone(), &f.ns).patch_status("p1", &pp, &Patch::Merge(json!({"status": {"message": "stale"}}))).await,
        "p2_2222",
        "p1",
    );
    not_holder(cms(&p1).delete("made-by-p1", &DeleteParams::default()).await.map(|_| ()), "p2_2222", "p1");
    let swept = cms(&p1).delete_collection(&DeleteParams::default(), &ListParams::default()).await;
    assert!(common::rejected(swept).reason == Reason::NotHolder.as_str(), "deletecollection by the ex-leader");
    let ssa = PatchParams::apply("ctl").force();
    not_holder(
        cms(&p1)
            .patch(
                "applied",
                &ssa,
                &Patch::Apply(json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "applied"}, "data": {"k": "v"}})),
            )
            .await,
        "p2_2222",
        "p1",
    );
    // Nothing of p1's after the takeover landed.
    assert!(cms(&f.client).get_opt("late-p1").await.expect("get").is_none());
    assert_eq!(cms(&f.client).get("made-by-p1").await.expect("get").data.and_then(|d| d.get("k").cloned()).as_deref(), Some("v"));
    let labels = namespaces(&f.client).get(&f.ns).await.expect("namespace").metadata.labels.unwrap_or_default();
    assert_eq!(labels.get("written-by").map(String::as_str), Some("p1"), "the namespace keeps the leader's write");

    // The new leader writes everywhere.
    common::accepted(cms(&p2).patch("made-by-p1", &pp, &Patch::Merge(json!({"data": {"k": "p2"}}))).await);
    common::accepted(namespaces(&p2).patch(&f.ns, &pp, &label_namespace("p2")).await);

    // A follower's Events and its campaign on the Lease are not judged by the writer webhook.
    let event: k8s_openapi::api::events::v1::Event = serde_json::from_value(json!({"metadata": {"generateName": "ctl-"},
        "eventTime": "2026-12-03T09:00:10.000000Z", "reportingController": "example.kubefence.io/ctl", "reportingInstance": "p1",
        "action": "Campaign", "reason": "Following", "type": "Normal", "note": "p1 follows",
        "regarding": {"apiVersion": "v1", "kind": "ConfigMap", "namespace": f.ns, "name": "made-by-p1"}}))
    .unwrap();
    common::accepted(
        Api::<k8s_openapi::api::events::v1::Event>::namespaced(p1.clone(), &f.ns).create(&PostParams::default(), &event).await,
    );
    let lease = Api::<LeaderLease>::namespaced(p1.clone(), &f.ns).get(LEASE).await.expect("a follower reads the Lease");
    common::accepted(Api::<LeaderLease>::namespaced(p1.clone(), &f.ns).replace(LEASE, &PostParams::default(), &lease).await);

    // The refusals are Warning Events on the FencedController (the written object may be
    // cluster-scoped, or not named yet).
    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(f.client.clone(), &f.ns);
    until("a NotHolder Warning Event on the FencedController", Duration::from_secs(30), async || {
        events.list(&ListParams::default()).await.is_ok_and(|l| {
            l.items.iter().any(|e| {
                let about = e.regarding.as_ref();
                e.reason.as_deref() == Some(fence_events::REFUSED)
                    && about.and_then(|r| r.kind.as_deref()) == Some("FencedController")
                    && about.and_then(|r| r.name.as_deref()) == Some(LEASE)
                    && e.note.as_deref().is_some_and(|n| n.contains("Namespace") || n.contains("ConfigMap"))
            })
        })
    })
    .await;
    f.stop().await;
}

/// Adoption as a cluster admin would do it, on a controller that already runs (its Lease made
/// by the controller, no kube-fence label): the admin, named in no kube-fence setting, fences it in
/// Audit — a follower's write lands with a warning that says what Enforce would refuse, and a
/// `WouldRefuse` Event on the FencedController — then switches to Enforce (one field): the
/// follower is refused with 409 `NotHolder` while the leader keeps writing; then deletes the
/// FencedController to roll back, and the follower's writes land again. Threat case: a
/// stale-but-honest replica (the follower writes as if it led).
#[tokio::test]
async fn audit_then_enforce_then_roll_back_by_deleting_the_fence() {
    let f = Fixture::new("writers-adopt").await;
    let (p1, p2, _) = fenced_controller(&f, &[], FenceMode::Audit).await;
    let (status, warnings) = patch_namespace_label(&p2, &f.ns, "p2-audited").await;
    assert!(status.is_success(), "audited: the follower's write lands ({status})");
    assert!(
        warnings.iter().any(|w| w.contains("kube-fence (audit mode) would deny this write") && w.contains("p1_1111")),
        "the follower is told what Enforce would say: {warnings:?}"
    );
    let (status, warnings) = patch_namespace_label(&p1, &f.ns, "p1").await;
    assert!(status.is_success() && warnings.is_empty(), "the leader writes without a warning: {status} {warnings:?}");
    // The audit log keeps every write Enforce would refuse (Events are rate-limited), and who let
    // the leader's through.
    let cms = |c: &Client| Api::<ConfigMap>::namespaced(c.clone(), &f.ns);
    common::accepted(cms(&p2).create(&PostParams::default(), &fresh_configmap("audited-follower")).await);
    common::accepted(cms(&p1).create(&PostParams::default(), &fresh_configmap("audited-leader")).await);
    let log = common::audit_log().await;
    let annotated = async |name: &str, key: &str| {
        let events = common::audit_events(&log, &f.ns, name, |e| !e.is_empty()).await;
        common::kube_fence_annotation(&events[0], key).map(str::to_string)
    };
    assert_eq!(annotated("audited-follower", "would-deny").await.as_deref(), Some("NotHolder"));
    assert_eq!(annotated("audited-follower", "holder").await, None);
    assert_eq!(annotated("audited-leader", "holder").await.as_deref(), Some("p1_1111"));
    assert_eq!(annotated("audited-leader", "would-deny").await, None);
    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(f.client.clone(), &f.ns);
    until("a WouldRefuse Event on the FencedController", Duration::from_secs(30), async || {
        events.list(&ListParams::default()).await.is_ok_and(|l| {
            l.items.iter().any(|e| {
                e.reason.as_deref() == Some(fence_events::WOULD_REFUSE)
                    && e.regarding.as_ref().and_then(|r| r.kind.as_deref()) == Some("FencedController")
            })
        })
    })
    .await;

    // Enforce: one field.
    let enforce = Patch::Merge(json!({"spec": {"mode": "Enforce"}}));
    fences(&f).patch(LEASE, &PatchParams::default(), &enforce).await.expect("the admin switches to Enforce");
    wait_writer_fenced(&f, &p2).await;
    not_holder(cms(&p2).create(&PostParams::default(), &fresh_configmap("by-the-follower")).await, "p1_1111", "p2");
    common::accepted(cms(&p1).create(&PostParams::default(), &fresh_configmap("by-the-leader")).await);

    // Roll back: delete the FencedController; the routing follows and the follower writes again.
    fences(&f).delete(LEASE, &DeleteParams::default()).await.expect("the admin deletes the fence");
    until("the follower's writes land once the fence is gone", Duration::from_secs(30), async || {
        cms(&p2).create(&PostParams::default(), &fresh_configmap("after-roll-back")).await.is_ok()
    })
    .await;
    // The Lease was never touched by kube-fence: no label, no annotation.
    let lease = Api::<LeaderLease>::namespaced(f.client.clone(), &f.ns).get(LEASE).await.expect("the Lease");
    assert!(lease.metadata.labels.unwrap_or_default().keys().all(|k| !k.starts_with("kubefence.io/")));
    assert!(lease.metadata.annotations.unwrap_or_default().keys().all(|k| !k.starts_with("kubefence.io/")));
    f.stop().await;
}

/// A third party cannot fence another's ServiceAccount: a FencedController names ServiceAccounts
/// of its own namespace only, so one made in another namespace for a ServiceAccount of the same
/// name fences nothing here (the controller's writes land), and a Lease alone fences nobody.
/// Threat case: a tenant who may create FencedControllers in its own namespace.
#[tokio::test]
async fn a_fence_in_another_namespace_fences_nothing_here() {
    let f = Fixture::new("writers-third-party").await;
    let made = controller_pods(&f, &["p1"]).await;
    let p1 = common::identity::client_as_pod(&f.client, &f.ns, "ctl", &made[0]).await;
    // Another namespace's "ctl" fence (its routing scope is the test's namespace only, so it is
    // registered by no one; the webhook still would not apply it to this namespace's ctl).
    let other = common::namespace(&f.client, "writers-third-party-b").await;
    let mut foreign = fence(&f, &[], FenceMode::Enforce);
    foreign.metadata.namespace = Some(other.clone());
    Api::<FencedController>::namespaced(f.client.clone(), &other).create(&PostParams::default(), &foreign).await.expect("a fence there");
    // A Lease "ctl" held by someone else, in the test's namespace, with no FencedController.
    let lease: LeaderLease = serde_json::from_value(json!({"metadata": {"name": LEASE}, "spec": {"holderIdentity": "q1_evil"}})).unwrap();
    Api::<LeaderLease>::namespaced(f.client.clone(), &f.ns).create(&PostParams::default(), &lease).await.expect("a Lease");
    tokio::time::sleep(routing::SETTLE * 3).await;
    common::accepted(Api::<ConfigMap>::namespaced(p1.clone(), &f.ns).create(&PostParams::default(), &fresh_configmap("unfenced")).await);
    f.stop().await;
}

/// A flood of fences (a tenant with the admin-granted verb, or a cluster with a thousand
/// operators): 1,000 FencedControllers created at once are all routed within the time printed,
/// and a fence created in the middle of the burst is enforced within it, while writes by others
/// keep landing. Figures, not asserted: how long routing took, and how long the fence created
/// during the burst took to be enforced.
#[tokio::test]
async fn a_thousand_fences_at_once_are_routed_and_a_fence_made_meanwhile_is_enforced() {
    let f = Fixture::new("writers-flood").await;
    let (p1, p2, _) = running_controller(&f).await;

    let started = Instant::now();
    let flood = |range: std::ops::Range<usize>| {
        let api = fences(&f);
        let ns = f.ns.clone();
        futures::stream::iter(range.map(move |i| {
            let api = api.clone();
            let mut fenced = FencedController::new(
                &format!("tenant-{i}"),
                FencedControllerSpec {
                    lease: format!("tenant-{i}"),
                    service_accounts: vec![format!("tenant-{i}")],
                    exempt: vec!["configmaps".into()],
                    mode: FenceMode::Enforce,
                },
            );
            fenced.metadata.namespace = Some(ns.clone());
            async move { api.create(&PostParams::default(), &fenced).await.map(|_| ()) }
        }))
        .buffer_unordered(16)
        .collect::<Vec<_>>()
    };
    use futures::StreamExt;
    let first = flood(0..500).await;
    fences(&f).create(&PostParams::default(), &fence(&f, &[], FenceMode::Enforce)).await.expect("the real fence, mid-burst");
    let during = Instant::now();
    let second = flood(500..1_000).await;
    assert!(first.iter().chain(&second).all(Result::is_ok), "1,000 FencedControllers created");
    let created = started.elapsed();
    wait_writer_fenced(&f, &p2).await;
    let enforced = during.elapsed();
    // Every fence is in the applied routing.
    let name = routing::configuration_name(&format!("kf-test-{}", f.ns));
    let configs = Api::<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration>::all(f.client.clone());
    until("all 1,001 fences routed", Duration::from_secs(60), async || {
        let applied = configs.get(&name).await.expect("the writers configuration");
        (0..1_000).all(|i| routing::routes_in(&applied, &format!("system:serviceaccount:{}:tenant-{i}", f.ns)))
            && routing::routes_in(&applied, &format!("system:serviceaccount:{}:ctl", f.ns))
    })
    .await;
    let routed = started.elapsed();
    // Others' writes land meanwhile and after (the admin's, an unfenced ServiceAccount's).
    common::accepted(Api::<ConfigMap>::namespaced(f.client.clone(), &f.ns).create(&PostParams::default(), &fresh_configmap("admin")).await);
    common::accepted(Api::<ConfigMap>::namespaced(p1.clone(), &f.ns).create(&PostParams::default(), &fresh_configmap("leader")).await);
    println!(
        "1,000 FencedControllers: created in {:.1} s; all routed {:.1} s after the burst began; the fence made mid-burst enforced {:.1} s after it was created",
        created.as_secs_f64(),
        routed.as_secs_f64(),
        enforced.as_secs_f64()
    );
    f.stop().await;
}

/// Two replicas keep the writer webhook in step, each from its own view of the FencedControllers;
/// one whose view is older (its watch lagging behind its API server, its apply delayed past the
/// other's) must not put an older set of fences back. Here the older view is a list taken before
/// the fence was made (and one taken before it was deleted), applied after the running webhook
/// routed the newer one: refused as superseded each time, and the routing stays as the newer list
/// says. Threat case: kube-fence's own replica, stale but honest (it never loosens a fence).
#[tokio::test]
async fn a_replica_with_an_older_view_of_the_fences_never_routes_an_older_set() {
    let f = Fixture::new("writers-monotonic").await;
    let (_p1, p2, _) = running_controller(&f).await;
    let scope = routing_scope(&f);
    let configs = Api::<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration>::all(f.client.clone());
    let name = routing::configuration_name(&scope.configuration_name);
    let ctl = format!("system:serviceaccount:{}:ctl", f.ns);
    let routed = async |want: bool| {
        until("the writers configuration routes ctl as the newest list says", Duration::from_secs(30), async || {
            configs.get_opt(&name).await.expect("read the writers configuration").is_some_and(|c| routing::routes_in(&c, &ctl)) == want
        })
        .await;
    };

    let before = routing::list(&f.client, &scope).await.expect("a list before the fence");
    assert!(!before.routes.routes(&ctl));
    fences(&f).create(&PostParams::default(), &fence(&f, &[], FenceMode::Enforce)).await.expect("the admin fences the controller");
    routed(true).await;
    wait_writer_fenced(&f, &p2).await;
    let applied = configs.get(&name).await.expect("the writers configuration");
    let recorded = routing::recorded_revision(&applied).expect("the configuration records its list's revision");
    assert!(recorded > before.revision, "recorded {recorded}, the older list's {}", before.revision);
    match routing::apply(&f.client, &scope, &before).await.expect("apply the older list") {
        routing::Applied::Superseded { recorded: r } => assert!(r > before.revision),
        other => panic!("an older list was not refused: {other:?}"),
    }
    assert!(routing::routes_in(&configs.get(&name).await.expect("read back"), &ctl), "the fence stays routed");
    wait_writer_fenced(&f, &p2).await;

    // The other way: a list that still has the fence, applied after it was deleted.
    let with = routing::list(&f.client, &scope).await.expect("a list with the fence");
    assert!(with.routes.routes(&ctl));
    fences(&f).delete(LEASE, &DeleteParams::default()).await.expect("the admin deletes the fence");
    routed(false).await;
    assert!(
        matches!(routing::apply(&f.client, &scope, &with).await, Ok(routing::Applied::Superseded { .. })),
        "a deleted fence is not put back"
    );
    assert!(!routing::routes_in(&configs.get(&name).await.expect("read back"), &ctl), "the fence stays gone");
    // A list as new as the one applied is applied (the resync re-applies its own).
    let now = routing::list(&f.client, &scope).await.expect("a current list");
    assert_eq!(routing::apply(&f.client, &scope, &now).await.expect("apply the current list"), routing::Applied::InStep);
    // A record copied from another cluster (a restored backup: far above this cluster's
    // revisions) does not hold the routing: the next list is applied over it.
    let copied = Patch::Merge(json!({"metadata": {"annotations": {routing::REVISION_ANNOTATION: u64::MAX.to_string()}}}));
    configs.patch(&name, &PatchParams::default(), &copied).await.expect("an admin restores a copied record");
    let next = routing::list(&f.client, &scope).await.expect("a current list");
    assert_eq!(routing::apply(&f.client, &scope, &next).await.expect("apply over a copied record"), routing::Applied::InStep);
    let restored = configs.get(&name).await.expect("read back");
    assert_eq!(routing::recorded_revision(&restored), Some(next.revision), "the list's revision is recorded again");
    f.stop().await;
}

/// The routing scope of the fixture's webhook (`Fixture::new`: its configuration, its namespace).
fn routing_scope(f: &Fixture) -> kube_fence::admission::registration::scope::Scope {
    let mut scope = kube_fence::admission::registration::scope::Scope::new(format!("kf-test-{}", f.ns));
    scope.only_namespaces = Some(vec![f.ns.clone()]);
    scope
}

/// `spec.exempt` names what the controller writes whether it leads or not: a follower's
/// ConfigMap writes pass, its other writes are still fenced (stale-but-honest writer).
#[tokio::test]
async fn exempt_resources_are_written_by_followers_too() {
    let f = Fixture::new("writers-exempt").await;
    let (_p1, p2, _) = fenced_controller(&f, &["configmaps"], FenceMode::Enforce).await;
    let cms = Api::<ConfigMap>::namespaced(p2.clone(), &f.ns);
    common::accepted(cms.create(&PostParams::default(), &fresh_configmap("by-a-follower")).await);
    common::accepted(cms.patch("by-a-follower", &PatchParams::default(), &Patch::Merge(json!({"data": {"k": "w"}}))).await);
    not_holder(Api::<Namespace>::all(p2.clone()).patch(&f.ns, &PatchParams::default(), &label_namespace("p2")).await, "p1_1111", "p2");
    f.stop().await;
}

/// Fails safe: with kube-fence gone (crashed, its registration left behind), the fenced
/// ServiceAccount's writes fail closed — the holder's too — while everyone else's pass.
#[tokio::test]
async fn with_kube_fence_down_only_the_fenced_writers_writes_fail() {
    let mut f = Fixture::new("writers-down").await;
    let (p1, _p2, _) = fenced_controller(&f, &[], FenceMode::Enforce).await;
    if let Some(hook) = f.hook.take() {
        hook.crash().await;
    }
    let refused = Api::<ConfigMap>::namespaced(p1.clone(), &f.ns).create(&PostParams::default(), &fresh_configmap("while-down")).await;
    assert!(common::failed_closed(&common::rejected(refused)), "the holder's write fails closed while kube-fence is down");
    let other = common::identity::client_as(&format!("system:serviceaccount:{}:someone-else", f.ns)).await;
    common::identity::grant_worker_rbac(&f.client, &f.ns, &format!("system:serviceaccount:{}:someone-else", f.ns)).await;
    common::identity::wait_authorized(&other, &f.ns, "", "configmaps", "create").await;
    common::accepted(Api::<ConfigMap>::namespaced(other, &f.ns).create(&PostParams::default(), &fresh_configmap("by-others")).await);
    common::accepted(
        Api::<ConfigMap>::namespaced(f.client.clone(), &f.ns).create(&PostParams::default(), &fresh_configmap("by-admin")).await,
    );
    // What the crashed process left behind is removed as an admin would.
    let name = routing::configuration_name(&format!("kf-test-{}", f.ns));
    let _ = Api::<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration>::all(f.client.clone())
        .delete(&name, &DeleteParams::default())
        .await;
    let _ = Api::<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration>::all(f.client.clone())
        .delete(&format!("kf-test-{}", f.ns), &DeleteParams::default())
        .await;
}

/// The linearizable lease reads the fixture's webhook has made so far.
fn linearizable_reads(f: &Fixture) -> u64 {
    let metrics = kube_fence::telemetry::render(&f.registry);
    metrics
        .lines()
        .find(|l| l.starts_with("kube_fence_webhook_lease_reads_total") && l.contains("read=\"linearizable\""))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// Reads are shared: a burst of the leader's concurrent writes (stale-but-honest case: the
/// leader itself) is judged with fewer quorum reads of its Lease than writes, each read started
/// after the writes it judges arrived; all are admitted.
#[tokio::test]
async fn concurrent_writes_of_the_leader_share_quorum_reads() {
    let f = Fixture::new("writers-shared-reads").await;
    let (p1, _p2, _) = fenced_controller(&f, &[], FenceMode::Enforce).await;
    let before = linearizable_reads(&f);
    let cms = Api::<ConfigMap>::namespaced(p1.clone(), &f.ns);
    let writes = 32;
    let results = futures::future::join_all((0..writes).map(|i| {
        let cms = cms.clone();
        async move { cms.create(&PostParams::default(), &fresh_configmap(&format!("burst-{i}"))).await }
    }))
    .await;
    assert!(results.iter().all(Result::is_ok), "the leader's writes are admitted: {:?}", results.iter().find(|r| r.is_err()));
    let reads = linearizable_reads(&f) - before;
    println!("writer fence: {writes} concurrent writes of the leader judged with {reads} quorum reads of its Lease");
    assert!(reads >= 1 && reads < writes, "{reads} reads for {writes} concurrent writes");
    f.stop().await;
}

/// CONNECT is judged too: a fenced follower cannot `exec` into, `attach` to or `port-forward` to
/// the Pods its controller manages (stale-but-honest replica, or a follower acting as if it
/// led), while the leader's CONNECT passes admission (and then fails only because these Pods
/// were never scheduled).
#[tokio::test]
async fn a_followers_exec_attach_and_port_forward_are_refused() {
    let f = Fixture::new("writers-connect").await;
    let (p1, p2, _) = fenced_controller(&f, &[], FenceMode::Enforce).await;
    let connect = async |client: &Client, path: &str| {
        let url = format!("/api/v1/namespaces/{}/pods/p1/{path}", f.ns);
        let request = http::Request::post(url).body(Vec::new()).expect("a request");
        let response = client.send(request.map(kube::client::Body::from)).await.expect("the API server answers");
        let status = response.status();
        let body = http_body_util::BodyExt::collect(response.into_body()).await.map(|c| c.to_bytes()).unwrap_or_default();
        (status, String::from_utf8_lossy(&body).into_owned())
    };
    for path in ["exec?command=true&stdout=true", "attach?stdout=true", "portforward?ports=8080"] {
        let (status, body) = connect(&p2, path).await;
        assert!(
            status == http::StatusCode::CONFLICT && body.contains(Reason::NotHolder.as_str()) && body.contains("p1_1111"),
            "{path} by the follower: {status} {body}"
        );
        let (status, body) = connect(&p1, path).await;
        assert!(!body.contains(Reason::NotHolder.as_str()), "{path} by the leader passes admission: {status} {body}");
    }
    f.stop().await;
}
