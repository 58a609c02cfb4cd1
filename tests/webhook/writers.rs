//! Fencing the writer, not the object, on the real control plane: the controller's
//! `coordination.k8s.io` Lease carries `kubefence.io/holder-identity: Pod` and
//! `kubefence.io/writers: ctl`, and from then on every write of ServiceAccount `ctl` — new
//! unlabelled objects, cluster-scoped objects, subresources, deletecollection — is admitted only
//! from the Pod holding that Lease. The Pods are never scheduled: each client authenticates with
//! a ServiceAccount token bound to its Pod, as the kubelet would mount it. Each test says which
//! threat case it covers.

use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease as LeaderLease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod};
use kube::Client;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube_fence::admission::registration::routing;
use kube_fence_api::denial::Reason;
use kube_fence_api::names::{WRITERS_ANNOTATION, WRITERS_EXEMPT_ANNOTATION};
use serde_json::json;

use super::leader::{controller_pods, elect, not_holder, wait_holder_policy};
use super::{Fixture, common};
use common::leader::{LEASE, until};

const AT: &str = "2026-12-03T09:00:00.000000Z";

/// Pods p1 and p2 of ServiceAccount `ctl`, clients for both, and Lease `ctl` opted in for the
/// writers `annotations` name, held by p1, once the writer webhook judges `ctl`'s writes.
async fn fenced_controller(f: &Fixture, annotations: serde_json::Value) -> (Client, Client, Vec<Pod>) {
    let made = controller_pods(f, &["p1", "p2"]).await;
    common::leader::may_patch_namespace(&f.client, &f.ns, "ctl").await;
    let p1 = common::identity::client_as_pod(&f.client, &f.ns, "ctl", &made[0]).await;
    let p2 = common::identity::client_as_pod(&f.client, &f.ns, "ctl", &made[1]).await;
    let lease: LeaderLease = serde_json::from_value(json!({"metadata": {"name": LEASE,
        "labels": {"kubefence.io/holder-identity": "Pod"}, "annotations": annotations}, "spec": {}}))
    .unwrap();
    Api::<LeaderLease>::namespaced(f.client.clone(), &f.ns).create(&PostParams::default(), &lease).await.expect("create the Lease");
    wait_holder_policy(f, &p2, LEASE).await;
    elect(&p1, &f.ns, LEASE, "p1_1111", AT, 1).await.expect("p1 acquires");
    wait_writer_fenced(f, &p2).await;
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
    let (p1, p2, _) = fenced_controller(&f, json!({WRITERS_ANNOTATION: "ctl"})).await;
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

    // The refusals are Warning Events on the Lease that fences the writer (the written object may
    // be cluster-scoped, or not named yet).
    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(f.client.clone(), &f.ns);
    until("a NotHolder Warning Event on the Lease", Duration::from_secs(30), async || {
        events.list(&ListParams::default()).await.is_ok_and(|l| {
            l.items.iter().any(|e| {
                let about = e.regarding.as_ref();
                e.reason.as_deref() == Some("NotHolder")
                    && about.and_then(|r| r.kind.as_deref()) == Some("Lease")
                    && about.and_then(|r| r.name.as_deref()) == Some(LEASE)
                    && e.note.as_deref().is_some_and(|n| n.contains("Namespace") || n.contains("ConfigMap"))
            })
        })
    })
    .await;
    f.stop().await;
}

/// Worker with ordinary RBAC: the Lease belongs to the holder. A non-holder replica (p2) cannot
/// delete the Lease (to re-create it without the opt-in); the holder can remove the annotation, and
/// then everyone's writes flow again. (Who may change the opt-in itself is the FencedController's
/// business now: tests/webhook/fenced_policy.rs.)
#[tokio::test]
async fn only_the_holder_or_an_admin_ends_the_opt_in_and_then_writes_flow_again() {
    let f = Fixture::new("writers-opt-out").await;
    let (p1, p2, _) = fenced_controller(&f, json!({WRITERS_ANNOTATION: "ctl"})).await;
    let leases = |c: &Client| Api::<LeaderLease>::namespaced(c.clone(), &f.ns);
    let drop_opt_in = Patch::Merge(json!({"metadata": {"annotations": {WRITERS_ANNOTATION: null}}}));
    let deleted = leases(&p2).delete(LEASE, &DeleteParams::default()).await;
    let status = common::rejected(deleted);
    assert_eq!(status.code, 403, "{status:?}");
    assert!(status.message.contains("Lease ctl is deleted only by its holder p1_1111, not by Pod p2"), "{}", status.message);
    let swept = leases(&p2).delete_collection(&DeleteParams::default(), &ListParams::default()).await;
    assert_eq!(common::rejected(swept).code, 403, "deletecollection of the Lease by a non-holder");
    assert!(leases(&f.client).get_opt(LEASE).await.expect("get").is_some());

    // The holder ends the opt-in; once the routing follows, p2's writes land.
    common::accepted(leases(&p1).patch(LEASE, &PatchParams::default(), &drop_opt_in).await);
    let cms = Api::<ConfigMap>::namespaced(p2.clone(), &f.ns);
    until("p2's writes flow once the opt-in is gone", Duration::from_secs(30), async || {
        cms.create(&PostParams::default(), &fresh_configmap("after-opt-out")).await.is_ok()
    })
    .await;
    f.stop().await;
}

/// `kubefence.io/writers-exempt` names what the controller writes whether it leads or not: a
/// follower's ConfigMap writes pass, its other writes are still fenced (stale-but-honest writer).
#[tokio::test]
async fn exempt_resources_are_written_by_followers_too() {
    let f = Fixture::new("writers-exempt").await;
    let (_p1, p2, _) = fenced_controller(&f, json!({WRITERS_ANNOTATION: "ctl", WRITERS_EXEMPT_ANNOTATION: "configmaps"})).await;
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
    let (p1, _p2, _) = fenced_controller(&f, json!({WRITERS_ANNOTATION: "ctl"})).await;
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
    let (p1, _p2, _) = fenced_controller(&f, json!({WRITERS_ANNOTATION: "ctl"})).await;
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
