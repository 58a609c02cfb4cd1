//! Attacks on the fence, kept as tests: each is what a stale-but-honest worker (paused,
//! partitioned, delayed: it sends the write it prepared under an old grant) or a worker with
//! ordinary RBAC (the built-in `edit` role plus kube-fence Leases) tried against the installed
//! webhook. Each test says which case it covers; where Kubernetes gives no way to close a path,
//! the test pins down exactly what is and is not promised (docs/what-is-fenced.md).

use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Event, Namespace, PersistentVolumeClaim, Pod};
use k8s_openapi::api::rbac::v1::ClusterRole;
use kube::api::{Api, DeleteParams, DynamicObject, EvictParams, ListParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Client, ResourceExt};
use serde_json::json;

use super::{Fixture, LEASE, TOKEN, common, configmap, deployment, guarded_meta, patch, token_of, write};

const WORKER: &str = "worker-a";

async fn worker(f: &Fixture) -> Client {
    common::identity::grant_worker_rbac(&f.client, &f.ns, WORKER).await;
    common::identity::client_as(WORKER).await
}

fn as_worker<K: kube::Resource<DynamicType = ()>>(f: &Fixture, client: &Client) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), &f.ns, &kube::api::ApiResource::erase::<K>(&()))
}

fn pod(name: &str, lease: &str, token: u64) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod", "metadata": guarded_meta(name, lease, token),
        "spec": {"containers": [{"name": "c", "image": "registry.invalid/none"}]}
    }))
    .unwrap()
}

/// Finding 1 (stale worker, and a worker with `edit` RBAC): `/status` of a Deployment or a Pod
/// accepts label and annotation changes. A status write that moves the guard — rewinds the
/// token, drops it, removes the lease label — is judged exactly like a write to the object; a
/// status write that leaves the guard alone is not sent to kube-fence at all (so Kubernetes' own
/// controllers never wait for it: shown with the webhook stopped).
#[tokio::test]
async fn status_writes_cannot_move_the_guard() {
    let mut f = Fixture::new("attack-status").await;
    let client = worker(&f).await;
    f.grant("work", "a", 5).await;
    f.api::<Deployment>().create(&PostParams::default(), &deployment("d1", "work", 5)).await.unwrap();
    f.api::<Pod>().create(&PostParams::default(), &pod("p1", "work", 5)).await.unwrap();
    f.grant("work", "b", 6).await;
    // Some kinds' /status endpoints drop metadata changes before admission (Deployments here),
    // others keep them (Pods): either way the guard must not move without a newer token.
    let mut judged = Vec::new();
    for (kind, api, name) in [("Deployment", as_worker::<Deployment>(&f, &client), "d1"), ("Pod", as_worker::<Pod>(&f, &client), "p1")] {
        let pp = PatchParams::default();
        for (attempt, body, code) in [
            ("rewind the token", json!({"metadata": {"annotations": {TOKEN: "1"}}}), 409),
            ("remove the lease label", json!({"metadata": {"labels": {LEASE: null}}}), 409),
            ("drop the token", json!({"metadata": {"annotations": {TOKEN: null}}}), 403),
        ] {
            match api.patch_status(name, &pp, &Patch::Merge(&body)).await {
                Err(kube::Error::Api(status)) => {
                    assert_eq!(status.code, code, "{kind} /status, {attempt}: {status:?}");
                    judged.push(kind);
                }
                Ok(_) => {}
                Err(e) => panic!("{kind} /status, {attempt}: {e}"),
            }
            let stored = api.get(name).await.unwrap();
            assert_eq!(
                (token_of(&stored), stored.labels().get(LEASE).map(String::as_str)),
                (Some(5), Some("work")),
                "{kind} /status, {attempt}: the guard moved"
            );
        }
    }
    eprintln!("status writes that tried to move the guard and were judged (denied): {judged:?}");
    assert!(judged.contains(&"Pod"), "Pod /status keeps metadata changes, so kube-fence must have judged them");
    // The holder of 6 moves the guard of the Pod through /status with its token: judged, admitted.
    let pods = as_worker::<Pod>(&f, &client);
    let fresh = json!({"metadata": {"annotations": {TOKEN: "6"}}});
    pods.patch_status("p1", &PatchParams::default(), &Patch::Merge(&fresh)).await.expect("a fresh token through /status");
    assert_eq!(token_of(&pods.get("p1").await.unwrap()), Some(6));
    let stale = json!({"metadata": {"annotations": {TOKEN: "6"}, "labels": {"writer": "late"}}});
    assert_eq!(
        common::rejected(pods.patch("p1", &PatchParams::default(), &Patch::Merge(&stale)).await).code,
        409,
        "the recorded token is 6 now"
    );
    // With the webhook stopped (registration in place: guarded writes fail closed), a status
    // write that leaves the guard alone still goes through: it never reaches kube-fence.
    if let Some(hook) = f.hook.as_mut() {
        hook.stop_serving().await;
    }
    let status = json!({"status": {"observedGeneration": 1}});
    f.api::<Deployment>().patch_status("d1", &PatchParams::default(), &Patch::Merge(&status)).await.expect("status write, guard untouched");
    let err = patch(&f.api::<Deployment>(), "d1", &write(Some(7), "x")).await.expect_err("a guarded write fails closed");
    assert!(err.to_string().contains("fence.kubefence.io"), "{err}");
    f.stop().await;
}

/// Finding 1, the paths that stay open (worker with `edit` RBAC): `/scale` and `pods/eviction`
/// carry objects without the guard's labels (Scale, Eviction), so the webhook's object selector
/// cannot see that the target is guarded, and `pods/ephemeralcontainers` cannot change metadata.
/// None of them is fenced — but none can move the guard either: the recorded token and the lease
/// label are unchanged afterwards. docs/what-is-fenced.md: do not grant workers these verbs.
#[tokio::test]
async fn scale_eviction_and_ephemeral_containers_are_not_fenced_and_leave_the_guard() {
    let f = Fixture::new("attack-scale").await;
    let client = worker(&f).await;
    f.grant("work", "a", 5).await;
    f.api::<Deployment>().create(&PostParams::default(), &deployment("d1", "work", 5)).await.unwrap();
    f.api::<Pod>().create(&PostParams::default(), &pod("p1", "work", 5)).await.unwrap();
    f.api::<Pod>().create(&PostParams::default(), &pod("p2", "work", 5)).await.unwrap();
    f.grant("work", "b", 6).await;

    let deployments: Api<Deployment> = Api::namespaced(client.clone(), &f.ns);
    let scale = json!({"spec": {"replicas": 0}, "metadata": {"labels": {LEASE: null}, "annotations": {TOKEN: "1"}}});
    deployments.patch_scale("d1", &PatchParams::default(), &Patch::Merge(&scale)).await.expect("/scale is not fenced");
    let d1 = f.api::<Deployment>().get("d1").await.unwrap();
    assert_eq!((token_of(&d1), d1.labels().get(LEASE).map(String::as_str)), (Some(5), Some("work")), "/scale left the guard");

    let pods: Api<Pod> = Api::namespaced(client.clone(), &f.ns);
    let debug = json!({"spec": {"ephemeralContainers": [{"name": "dbg", "image": "registry.invalid/none"}]},
                       "metadata": {"labels": {LEASE: null}}});
    pods.patch_ephemeral_containers("p1", &PatchParams::default(), &Patch::Strategic(&debug))
        .await
        .expect("ephemeral containers are not fenced");
    let p1 = f.api::<Pod>().get("p1").await.unwrap();
    assert_eq!((token_of(&p1), p1.labels().get(LEASE).map(String::as_str)), (Some(5), Some("work")), "ephemeralcontainers left the guard");

    pods.evict("p2", &EvictParams::default()).await.expect("eviction is not fenced");
    f.stop().await;
}

/// Finding 2 (a holder, stale or current, with RBAC to update its Lease): `spec.fencing` sits in
/// the spec every worker writes to claim and renew. Relaxing it (Enforce to Warn) is rejected
/// by the API server itself (CEL); tightening is allowed.
#[tokio::test]
async fn a_worker_cannot_relax_fencing_on_its_lease() {
    let f = Fixture::new("attack-relax").await;
    let client = worker(&f).await;
    f.grant("work", "b", 6).await;
    let leases: Api<kube_fence_api::Lease> = Api::namespaced(client.clone(), &f.ns);
    let relax = json!({"spec": {"fencing": {"enforcement": "Warn"}}});
    let err = leases.patch("work", &PatchParams::default(), &Patch::Merge(&relax)).await.expect_err("relaxing is rejected");
    let kube::Error::Api(status) = &err else { panic!("{err}") };
    assert_eq!(status.code, 422, "{err}");
    assert!(status.message.contains("never relaxed"), "{}", status.message);
    // A lease created in Warn mode (a rollout) can be tightened, and then not relaxed again.
    let warn: kube_fence_api::Lease = serde_json::from_value(json!({
        "apiVersion": "kubefence.io/v1alpha1", "kind": "Lease", "metadata": {"name": "rollout"},
        "spec": {"fencing": {"enforcement": "Warn"}}
    }))
    .unwrap();
    leases.create(&PostParams::default(), &warn).await.expect("a new lease may start in Warn");
    let enforce = json!({"spec": {"fencing": {"enforcement": "Enforce"}}});
    leases.patch("rollout", &PatchParams::default(), &Patch::Merge(&enforce)).await.expect("tightening is allowed");
    assert!(leases.patch("rollout", &PatchParams::default(), &Patch::Merge(&relax)).await.is_err());
    f.stop().await;
}

/// Finding 3 (stale worker): under 0.1's `AllowEqual`, a patch that leaves the annotation alone
/// "presented" the recorded token and was admitted — a stale holder's data-only patch over a
/// newer holder's write. Now an equal token counts only when the write restates it (a new
/// `kubefence.io/write` value, as the client library writes); and `AllowEqual` cannot be
/// switched on for an existing lease.
#[tokio::test]
async fn an_equal_token_counts_only_when_the_write_restates_it() {
    let f = Fixture::new("attack-equal").await;
    let equal: kube_fence_api::Lease = serde_json::from_value(json!({
        "apiVersion": "kubefence.io/v1alpha1", "kind": "Lease", "metadata": {"name": "work"},
        "spec": {"fencing": {"comparison": "AllowEqual"}}
    }))
    .unwrap();
    f.leases().create(&PostParams::default(), &equal).await.expect("a lease created with AllowEqual");
    f.grant("work", "b", 6).await;
    let api = f.api::<ConfigMap>();
    api.create(&PostParams::default(), &configmap("state", "work", 6)).await.unwrap();
    let restate = |write: &str| json!({"metadata": {"annotations": {TOKEN: "6", "kubefence.io/write": write}}, "data": {"k": write}});
    // The holder of 6 writes twice more under its grant, restating the token each time.
    patch(&api, "state", &restate("b-1")).await.expect("a restated equal token");
    patch(&api, "state", &restate("b-2")).await.expect("again");
    // A stale holder's patch that leaves the annotations as b wrote them is not b's write.
    let untouched = json!({"data": {"k": "from a stale holder"}});
    let rejected = common::rejected(patch(&api, "state", &untouched).await);
    let (code, message) = (rejected.code, rejected.message);
    assert_eq!(code, 409, "{message}");
    // And a stale holder that restates its own, older token is stale as ever.
    let stale = json!({"metadata": {"annotations": {TOKEN: "5", "kubefence.io/write": "a-9"}}});
    assert_eq!(common::rejected(patch(&api, "state", &stale).await).code, 409);
    // The client library restates on every write.
    let grant = kube_fence::client::Grant {
        namespace: f.ns.clone(),
        lease: "work".into(),
        holder: "b".into(),
        token: kube_fence_api::token::Token::new(6).unwrap(),
        duration: Duration::from_secs(30),
        valid_until: tokio::time::Instant::now(),
        uid: None,
    };
    let cms: Api<ConfigMap> = Api::namespaced(f.client.clone(), &f.ns);
    for i in 0..3 {
        let body = Patch::Merge(json!({"data": {"k": format!("library {i}")}}));
        grant.patch(&cms, "state", &PatchParams::default(), body).await.expect("the library's writes restate the token");
    }
    // Relaxing an existing Strict lease to AllowEqual is rejected.
    f.grant("strict", "a", 7).await;
    let relax = json!({"spec": {"fencing": {"comparison": "AllowEqual"}}});
    let err = f.leases().patch("strict", &PatchParams::default(), &Patch::Merge(&relax)).await.expect_err("relaxing is rejected");
    assert!(err.to_string().contains("never relaxed"), "{err}");
    f.stop().await;
}

/// Finding 4 (Kubernetes' own controllers, no token): deleting a guarded PVC waits for the
/// pvc-protection controller to remove its finalizer, and deleting a namespace full of guarded
/// objects with finalizers waits for each. A write that only removes finalizers from an object
/// being deleted is admitted; one that also changes anything else is still fenced.
#[tokio::test]
async fn finalizer_removal_lets_guarded_objects_and_their_namespace_be_deleted() {
    let f = Fixture::new("attack-finalizers").await;
    f.grant("work", "a", 5).await;
    let pvc: DynamicObject = serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": guarded_meta("data", "work", 5),
        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}
    }))
    .unwrap();
    let pvcs = f.api::<PersistentVolumeClaim>();
    let created = pvcs.create(&PostParams::default(), &pvc).await.unwrap();
    assert!(created.finalizers().iter().any(|f| f == "kubernetes.io/pvc-protection"), "{:?}", created.finalizers());
    let precondition = |obj: &DynamicObject| DeleteParams {
        preconditions: Some(Preconditions { resource_version: obj.metadata.resource_version.clone(), uid: None }),
        ..Default::default()
    };
    pvcs.delete("data", &precondition(&created)).await.unwrap();
    let took =
        common::wait_gone(&pvcs, "data", Instant::now(), Duration::from_secs(90), "the pvc-protection controller removes its finalizer")
            .await;
    eprintln!("guarded PVC deleted {took:?} after the delete request");

    // A finalizer of the worker's own: removing it is admitted; removing it while changing data
    // is not.
    let api = f.api::<ConfigMap>();
    let mut cm = configmap("state", "work", 5);
    cm.metadata.finalizers = Some(vec!["example.com/a".into(), "example.com/b".into()]);
    let cm = api.create(&PostParams::default(), &cm).await.unwrap();
    api.delete("state", &precondition(&cm)).await.unwrap();
    let sneaky = json!({"metadata": {"finalizers": ["example.com/b"]}, "data": {"k": "changed on the way out"}});
    assert_eq!(common::rejected(patch(&api, "state", &sneaky).await).code, 409);
    let only = json!({"metadata": {"finalizers": ["example.com/b"]}});
    patch(&api, "state", &only).await.expect("removing one finalizer");

    // A namespace full of guarded objects with finalizers (PVCs, and one of our own that its
    // "controller" — this test — removes), deleted with the controllers running.
    for i in 0..3 {
        let mut pvc = pvc.clone();
        pvc.metadata.name = Some(format!("data-{i}"));
        pvcs.create(&PostParams::default(), &pvc).await.unwrap();
    }
    let namespaces: Api<Namespace> = Api::all(f.client.clone());
    namespaces.delete(&f.ns, &DeleteParams::default()).await.unwrap();
    patch(&api, "state", &json!({"metadata": {"finalizers": []}})).await.expect("the last finalizer");
    let took =
        common::wait_gone(&namespaces, &f.ns, Instant::now(), Duration::from_secs(120), "the namespace with guarded PVCs is deleted").await;
    eprintln!("namespace with guarded PVCs deleted in {took:?}");
    f.stop().await;
}

/// Finding 7 (a worker whose RBAC includes `leases/status`): forging `status.token` = 2^63-1
/// would refuse every later claim and lock every object stamped with it. Only the controller's
/// identity may write Lease status (a ValidatingAdmissionPolicy judged by the API server).
#[tokio::test]
async fn lease_status_is_written_only_by_the_controller() {
    let f = Fixture::new("attack-lease-status").await;
    let client = worker(&f).await;
    f.grant("work", "a", 5).await;
    let leases: Api<kube_fence_api::Lease> = Api::namespaced(client, &f.ns);
    let forged = json!({"status": {"phase": "Held", "holder": WORKER, "token": i64::MAX}});
    // The policy takes effect a moment after it is created.
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        match leases.patch_status("work", &PatchParams::default(), &Patch::Merge(&forged)).await {
            Err(kube::Error::Api(status)) => break status,
            Ok(_) => {
                assert!(Instant::now() < deadline, "a worker kept writing Lease status");
                f.grant("work", "a", 5).await;
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("{e}"),
        }
    };
    assert_eq!(status.code, 403, "{status:?}");
    assert!(status.message.contains("written only by the kube-fence controller"), "{}", status.message);
    let lease = f.leases().get("work").await.unwrap();
    assert_eq!(lease.status.and_then(|s| s.token).map(|t| t.get()), Some(5));
    // The controller's identity (here: the admin that runs the local webhook) still can.
    f.grant("work", "b", 6).await;
    f.stop().await;
}

/// Finding 6 (anyone who can reach the webhook port): forged AdmissionReviews create Warning
/// Events, but only within their own source's budget: a flood from 127.0.0.2 does not use up the
/// Events of the API server (which calls from 127.0.0.1), so a genuine rejection right after the
/// flood still gets its Event.
#[tokio::test]
async fn forged_reviews_cannot_use_up_the_api_servers_events() {
    let f = Fixture::new("attack-events").await;
    f.grant("work", "a", 5).await;
    let api = f.api::<ConfigMap>();
    api.create(&PostParams::default(), &configmap("state", "work", 5)).await.unwrap();
    let hook = f.hook.as_ref().expect("webhook");
    let forged = serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": "forged", "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
                    "resource": {"group": "", "version": "v1", "resource": "configmaps"},
                    "name": "forged", "namespace": f.ns, "operation": "CREATE", "userInfo": {"username": "mallory"},
                    "object": {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "forged", "labels": {LEASE: "work"}}}}
    }))
    .unwrap();
    // The flood runs from 127.0.0.2 while the genuine write is made.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // Four connections at a time, so the flood exceeds its source's budget even on a slow machine.
    let flooders: Vec<_> = (0..4)
        .map(|_| {
            let (stop, addr, ca, forged) = (stop.clone(), hook.addr, hook.ca_pem.clone(), forged.clone());
            tokio::spawn(async move {
                let mut sent = 0u32;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    let (status, _, _) = super::https_from("127.0.0.2", addr, &ca, &super::post(&forged), &forged).await;
                    assert_eq!(status, 200, "a forged review is answered");
                    sent += 1;
                }
                sent
            })
        })
        .collect();
    // The flood has used up its source's Events before the genuine write.
    wait_metric_above(&f, "kube_fence_webhook_events_suppressed_total", 0.0, "a forged review's Event suppressed").await;
    // A genuine stale write, through the API server, in the middle of the flood.
    assert_eq!(common::rejected(patch(&api, "state", &write(Some(4), "late")).await).code, 409);
    // Pacing: the flood goes on a while after the genuine write, so its Event competes with it.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut sent = 0;
    for flooder in flooders {
        sent += flooder.await.expect("flood task");
    }
    let events: Api<Event> = Api::namespaced(f.client.clone(), &f.ns);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let list = events.list(&ListParams::default()).await.unwrap();
        let genuine =
            list.items.iter().any(|e| e.reason.as_deref() == Some("StaleToken") && e.involved_object.name.as_deref() == Some("state"));
        let forged = list.items.iter().filter(|e| e.involved_object.name.as_deref() == Some("forged")).count();
        if genuine {
            eprintln!("events: genuine rejection recorded; {forged} Event(s) from {sent} forged reviews");
            break;
        }
        assert!(Instant::now() < deadline, "the genuine rejection got no Event after a forged flood");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let metrics = kube_fence::telemetry::render(&f.registry);
    let suppressed = metrics.lines().find(|l| l.starts_with("kube_fence_webhook_events_suppressed_total")).unwrap_or_default().to_string();
    assert!(suppressed.split_whitespace().last().and_then(|v| v.parse::<f64>().ok()).is_some_and(|v| v > 0.0), "{suppressed}");
    f.stop().await;
}

/// Anyone who can reach the webhook port (no RBAC needed): forged reviews that need a quorum
/// read of a lease (a CREATE of a guarded object is judged by one) no longer turn into API
/// server reads one for one. A flood of 400 from 127.0.0.2 causes at most its source's budget
/// of reads (a burst of twice the rate, then the rate; 5 a second here, so that even a slow
/// machine floods faster than that); the rest are denied 429 `ReadsThrottled` without a read.
/// The API server (calling from 127.0.0.1) keeps its own budget: a genuine guarded create in
/// the middle of the flood is admitted.
#[tokio::test]
async fn forged_reviews_cost_the_api_server_reads_only_within_their_sources_budget() {
    const PER_SECOND: u32 = 5;
    let client = common::client().await;
    let ns = common::namespace(&client, "attack-reads").await;
    let mut options = kube_fence::admission::local::LocalOptions::new(format!("kf-test-{ns}"));
    options.webhook.scope.only_namespaces = Some(vec![ns.clone()]);
    options.policy_path = common::policy_path();
    options.webhook.bounds.quorum_reads_per_namespace = Some(PER_SECOND);
    let f = Fixture::with_options(client, ns, options).await;
    f.grant("work", "a", 5).await;
    let hook = f.hook.as_ref().expect("webhook");
    let forged = serde_json::to_vec(&json!({
        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
        "request": {"uid": "forged", "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
                    "resource": {"group": "", "version": "v1", "resource": "configmaps"},
                    "name": "forged", "namespace": f.ns, "operation": "CREATE", "userInfo": {"username": "mallory"},
                    "object": {"apiVersion": "v1", "kind": "ConfigMap",
                               "metadata": {"name": "forged", "labels": {LEASE: "work"}, "annotations": {TOKEN: "5"}}}}
    }))
    .unwrap();
    let reads = || {
        let metrics = kube_fence::telemetry::render(&f.registry);
        let line =
            metrics.lines().find(|l| l.starts_with("kube_fence_webhook_lease_reads_total{read=\"linearizable\"}")).unwrap_or_default();
        line.split_whitespace().last().and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0) as u64
    };
    let before = reads();
    let started = Instant::now();
    let per_flooder = 100;
    let flooders: Vec<_> = (0..4)
        .map(|_| {
            let (addr, ca, forged) = (hook.addr, hook.ca_pem.clone(), forged.clone());
            tokio::spawn(async move {
                let (mut throttled, mut other) = (0u32, Vec::new());
                for _ in 0..per_flooder {
                    let (status, body, _) = super::https_from("127.0.0.2", addr, &ca, &super::post(&forged), &forged).await;
                    assert_eq!(status, 200, "a forged review is answered: {body}");
                    let review: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
                    let answer = &review["response"]["status"];
                    if answer["code"] == 429 && answer["reason"] == "ReadsThrottled" {
                        assert_eq!(answer["details"]["retryAfterSeconds"], 1, "a throttled review says when to retry: {body}");
                        throttled += 1;
                    } else if review["response"]["allowed"] != true {
                        other.push(answer.clone());
                    }
                }
                (throttled, other)
            })
        })
        .collect();
    // A genuine guarded create (one quorum read) through the API server, during the flood: once
    // the flood has used up its source's reads.
    wait_metric_above(&f, "kube_fence_webhook_reads_throttled_total", 0.0, "a forged review throttled").await;
    f.api::<ConfigMap>().create(&PostParams::default(), &configmap("genuine", "work", 5)).await.expect("the API server's review is judged");
    let mut throttled = 0;
    for flooder in flooders {
        let (t, other) = flooder.await.expect("flood task");
        throttled += t;
        assert!(other.is_empty(), "the forged reviews within budget are judged as usual (admitted: token 5 is fresh): {other:?}");
    }
    let judged = 4 * per_flooder - throttled;
    let took = started.elapsed();
    let caused = reads() - before;
    // Within budget: a burst of twice the rate, then the rate; and the genuine create's read,
    // and a read's worth of slack each side of the clock.
    let budget = 2 * u64::from(PER_SECOND) + (took.as_secs_f64() * f64::from(PER_SECOND)).ceil() as u64 + 3;
    eprintln!(
        "{} forged reviews in {took:.1?} caused {caused} quorum reads (budget {budget}): {judged} judged, {throttled} denied 429 ReadsThrottled",
        4 * per_flooder
    );
    assert!(caused <= budget, "{caused} quorum reads from {} forged reviews in {took:?}, budget {budget}", 4 * per_flooder);
    assert!(throttled > 0, "some forged reviews were throttled");
    let metrics = kube_fence::telemetry::render(&f.registry);
    assert!(
        metrics.lines().any(|l| l.starts_with("kube_fence_webhook_reads_throttled_total ") && !l.ends_with(" 0")),
        "the throttling is counted"
    );
    f.stop().await;
}

/// Finding 9, statements pinned down (stale worker): (a) a token the lease never granted is
/// admitted when it is newer than the recorded one and not newer than the lease's newest token —
/// the promise is "not greater than the newest grant", not "issued"; (b) a stale holder that
/// re-reads the object and deletes it with the fresh resourceVersion deletes the newer holder's
/// object: the DELETE rule only stops deleting a version the deleter did not see; (c) a
/// cluster-scoped object with the label is not fenced (leases are namespaced).
#[tokio::test]
async fn what_is_promised_and_what_is_not() {
    let f = Fixture::new("attack-statements").await;
    let api = f.api::<ConfigMap>();
    f.grant("work", "a", 431).await;
    api.create(&PostParams::default(), &configmap("state", "work", 431)).await.unwrap();
    f.grant("work", "b", 437).await;
    f.grant("work", "c", 493).await;
    patch(&api, "state", &write(Some(438), "never-granted")).await.expect("(a) 438 <= 493 is admitted, though never granted");

    // (b) The lease moves to d, which writes; the stale holder c re-reads and deletes.
    f.grant("work", "d", 500).await;
    patch(&api, "state", &write(Some(500), "d")).await.unwrap();
    let fresh = api.get("state").await.unwrap();
    let params = DeleteParams {
        preconditions: Some(Preconditions { resource_version: fresh.metadata.resource_version.clone(), uid: None }),
        ..Default::default()
    };
    api.delete("state", &params).await.expect("(b) a re-read delete is admitted: not fenced");

    // (c) Cluster-scoped: the webhook matches namespaced objects only.
    let roles: Api<ClusterRole> = Api::all(f.client.clone());
    let name = format!("{}-labelled", f.ns);
    let role: ClusterRole = serde_json::from_value(json!({"metadata": {"name": name, "labels": {LEASE: "work"}}})).unwrap();
    roles.create(&PostParams::default(), &role).await.expect("(c) a labelled cluster-scoped object is not fenced");
    roles.delete(&name, &DeleteParams::default()).await.unwrap();
    f.stop().await;
}

/// A second validating webhook that answers "allowed" after `delay` for objects annotated
/// `test.kubefence.io/slow`, and at once for the rest; registered for this test's namespace.
struct SlowWebhook {
    name: String,
    stop: tokio_util::sync::CancellationToken,
}

impl SlowWebhook {
    async fn start(f: &Fixture, delay: Duration) -> SlowWebhook {
        use axum::routing::post;
        use kube::core::admission::{AdmissionRequest, AdmissionResponse, AdmissionReview};
        use std::net::{IpAddr, Ipv4Addr};
        let made =
            kube_fence::admission::http::tls::SelfSigned::generate(&["localhost".into()], &[IpAddr::V4(Ipv4Addr::LOCALHOST)]).unwrap();
        let tls = axum_server::tls_rustls::RustlsConfig::from_config(made.server_config().unwrap());
        let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).unwrap();
        let addr = listener.local_addr().unwrap();
        let reviewed = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = reviewed.clone();
        let router = axum::Router::new().route(
            "/slow",
            post(move |axum::Json(review): axum::Json<AdmissionReview<DynamicObject>>| {
                let reviewed = counted.clone();
                async move {
                    reviewed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let request: AdmissionRequest<DynamicObject> = review.try_into().expect("a review");
                    if request.object.as_ref().is_some_and(|o| o.annotations().contains_key("test.kubefence.io/slow")) {
                        // Deliberate: this is the slow webhook whose delay the test measures.
                        tokio::time::sleep(delay).await;
                    }
                    axum::Json(AdmissionResponse::from(&request).into_review())
                }
            }),
        );
        let stop = tokio_util::sync::CancellationToken::new();
        let gate = kube_fence::admission::http::bounds::ConnectionGate::new(Default::default(), Default::default());
        tokio::spawn(kube_fence::admission::http::server::serve(listener, tls, router, gate, stop.clone().cancelled_owned()));
        let name = format!("kf-slow-{}", f.ns);
        let config: k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration = serde_json::from_value(json!({
            "metadata": {"name": name},
            "webhooks": [{
                "name": "slow.test.kubefence.io",
                "clientConfig": {"url": format!("https://{addr}/slow"), "caBundle": k8s_openapi::ByteString(made.ca_cert.into_bytes())},
                "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "resources": ["configmaps"], "operations": ["CREATE"]}],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": f.ns}},
                "failurePolicy": "Fail", "sideEffects": "None", "admissionReviewVersions": ["v1"], "timeoutSeconds": 15,
            }]
        }))
        .unwrap();
        let api: Api<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration> = Api::all(f.client.clone());
        api.create(&PostParams::default(), &config).await.unwrap();
        // The API server picks the configuration up a moment after it is created: probe creates
        // (not slowed) until one of them reaches this webhook.
        let probes: Api<ConfigMap> = Api::namespaced(f.client.clone(), &f.ns);
        let deadline = Instant::now() + Duration::from_secs(60);
        for attempt in 0.. {
            let probe: ConfigMap = serde_json::from_value(json!({"metadata": {"name": format!("kf-slow-probe-{attempt}")}})).unwrap();
            probes.create(&PostParams::default(), &probe).await.expect("a probe create is admitted");
            probes.delete(&probe.name_any(), &DeleteParams::default()).await.expect("the probe is deleted");
            if reviewed.load(std::sync::atomic::Ordering::SeqCst) > 0 {
                break;
            }
            assert!(Instant::now() < deadline, "the slow webhook's configuration took no effect within 60 s: no probe create reached it");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        SlowWebhook { name, stop }
    }

    async fn stop(self, client: &Client) {
        let api: Api<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration> = Api::all(client.clone());
        let _ = api.delete(&self.name, &DeleteParams::default()).await;
        self.stop.cancel();
    }
}

/// The number of reviews the fixture's webhook has allowed so far, from its metrics.
/// Waits (60 s at most) until the fixture's metric sample whose line starts with `sample` is
/// above `floor`, failing with `what` was awaited.
async fn wait_metric_above(f: &Fixture, sample: &str, floor: f64, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let text = kube_fence::telemetry::render(&f.registry);
        let value = text.lines().find(|l| l.starts_with(sample)).and_then(|l| l.split_whitespace().last()?.parse::<f64>().ok());
        if value.is_some_and(|v| v > floor) {
            return;
        }
        assert!(Instant::now() < deadline, "not within 60 s: {what} ({sample} is {value:?})");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn allowed_decisions(f: &Fixture) -> u64 {
    let metrics = kube_fence::telemetry::render(&f.registry);
    metrics
        .lines()
        .filter(|l| l.starts_with("kube_fence_webhook_decisions_total{") && l.contains("verdict=\"allowed\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

/// Finding 8, the documented limit (stale worker): a CREATE has no stored object to compare
/// with, so it is judged against the lease's newest token when it is admitted, and the API
/// server does not judge it again when it commits. Validating webhooks run in parallel, so the
/// window between kube-fence's verdict and the commit is as long as the slowest other webhook
/// takes (up to its timeout, at most 30 s), plus the write. Here a second webhook takes 4 s: A's
/// create (token 5) is admitted by kube-fence, the lease moves to B (6), B creates and deletes
/// the object, and A's create then commits with the stale token. The test measures the window.
#[tokio::test]
async fn create_after_delete_window_is_as_long_as_the_slowest_webhook() {
    let f = Fixture::new("attack-window").await;
    let slow = SlowWebhook::start(&f, Duration::from_secs(4)).await;
    f.grant("work", "a", 5).await;
    let api = f.api::<ConfigMap>();
    let mut stale = configmap("x", "work", 5);
    stale.annotations_mut().insert("test.kubefence.io/slow".into(), "true".into());
    let allowed_before = allowed_decisions(&f);
    let sent = Instant::now();
    let a = {
        let api = api.clone();
        tokio::spawn(async move { api.create(&PostParams::default(), &stale).await.map(|_| Instant::now()) })
    };
    // Wait until kube-fence has admitted A's create (its allowed-decision count moves); the slow
    // webhook still holds the create back.
    let deadline = Instant::now() + Duration::from_secs(60);
    while allowed_decisions(&f) <= allowed_before {
        assert!(Instant::now() < deadline, "kube-fence did not admit A's create within 60 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    f.grant("work", "b", 6).await;
    let b = api.create(&PostParams::default(), &configmap("x", "work", 6)).await.expect("B creates the object with the newest token");
    let params = DeleteParams {
        preconditions: Some(Preconditions { resource_version: b.metadata.resource_version.clone(), uid: None }),
        ..Default::default()
    };
    api.delete("x", &params).await.expect("B deletes it");
    let committed = a.await.expect("A's task").expect("A's stale create commits after B's create and delete");
    let stored = api.get("x").await.unwrap();
    eprintln!("create-after-delete window: A's create committed {:?} after it was sent, with the stale token", committed - sent);
    assert_eq!(token_of(&stored), Some(5), "the documented limit: the stale create landed");
    slow.stop(&f.client).await;
    f.stop().await;
}

fn bound_lease(name: &str, identity: &str) -> kube_fence_api::Lease {
    serde_json::from_value(json!({
        "apiVersion": "kubefence.io/v1alpha1", "kind": "Lease", "metadata": {"name": name}, "spec": {"identity": identity}
    }))
    .unwrap()
}

/// A claim, renewal or release of `lease`, as the spec patch the client library sends.
async fn lease_write(client: &Client, ns: &str, lease: &str, holder: Option<&str>, beat: &str) -> Result<(), kube::Error> {
    let leases: Api<kube_fence_api::Lease> = Api::namespaced(client.clone(), ns);
    let body = json!({"spec": {"holder": holder, "heartbeatTime": beat}});
    leases.patch(lease, &PatchParams::default(), &Patch::Merge(&body)).await.map(|_| ())
}

fn forbidden(result: Result<(), kube::Error>, says: &str) {
    match result {
        Err(kube::Error::Api(status)) => {
            assert_eq!(status.code, 403, "{status:?}");
            assert!(status.message.contains(says), "{says:?} not in {}", status.message);
        }
        other => panic!("expected a denial saying {says:?}, got {other:?}"),
    }
}

/// Holder identity (malicious or confused worker with RBAC to update Leases): on a Lease with
/// `spec.identity: User`, a claim or renewal names the requester itself and only the holder
/// releases; the API server judges it (a ValidatingAdmissionPolicy), whoever RBAC lets in.
#[tokio::test]
async fn a_user_bound_lease_is_claimed_renewed_and_released_only_by_its_holder() {
    let f = Fixture::new("identity-user").await;
    common::identity::grant_worker_rbac(&f.client, &f.ns, "worker-a").await;
    common::identity::grant_worker_rbac(&f.client, &f.ns, "worker-b").await;
    let (a, b) = (common::identity::client_as("worker-a").await, common::identity::client_as("worker-b").await);
    f.leases().create(&PostParams::default(), &bound_lease("bound", "User")).await.unwrap();
    // The policy takes effect a moment after it is created: B's claim under A's name is refused.
    let deadline = Instant::now() + Duration::from_secs(30);
    while lease_write(&b, &f.ns, "bound", Some("worker-a"), "2026-12-03T09:00:00.000001Z").await.is_ok() {
        assert!(Instant::now() < deadline, "a claim under another's name kept being admitted");
        lease_write(&f.client, &f.ns, "bound", None, "2026-12-03T09:00:00.000000Z").await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    lease_write(&a, &f.ns, "bound", Some("worker-a"), "2026-12-03T09:00:01.000000Z").await.expect("A claims as itself");
    forbidden(
        lease_write(&b, &f.ns, "bound", Some("worker-a"), "2026-12-03T09:00:02.000000Z").await,
        "may claim or renew it only as worker-b",
    );
    forbidden(lease_write(&b, &f.ns, "bound", None, "2026-12-03T09:00:01.000000Z").await, "released only by its holder worker-a");
    lease_write(&a, &f.ns, "bound", Some("worker-a"), "2026-12-03T09:00:03.000000Z").await.expect("A renews");
    lease_write(&a, &f.ns, "bound", None, "2026-12-03T09:00:03.000000Z").await.expect("A releases");
    lease_write(&b, &f.ns, "bound", Some("worker-b"), "2026-12-03T09:00:04.000000Z").await.expect("B claims as itself");
    // The binding cannot be dropped by a worker.
    let unbind = json!({"spec": {"identity": null}});
    let leases: Api<kube_fence_api::Lease> = Api::namespaced(b.clone(), &f.ns);
    assert!(leases.patch("bound", &PatchParams::default(), &Patch::Merge(&unbind)).await.is_err(), "spec.identity is immutable");
    f.stop().await;
}

/// Holder identity from a Pod (its bound ServiceAccount token, as the kubelet mounts it): on a
/// Lease with `spec.identity: Pod`, `holder` is the requesting Pod's name. Another Pod of the
/// same ServiceAccount can neither renew nor release it, and a token bound to no Pod claims
/// nothing.
#[tokio::test]
async fn a_pod_bound_lease_is_claimed_renewed_and_released_only_by_its_pod() {
    let f = Fixture::new("identity-pod").await;
    let made = common::identity::worker_pods(&f.client, &f.ns, &["p1", "p2"]).await;
    let p1 = common::identity::client_as_pod(&f.client, &f.ns, "worker", &made[0]).await;
    let p2 = common::identity::client_as_pod(&f.client, &f.ns, "worker", &made[1]).await;
    f.leases().create(&PostParams::default(), &bound_lease("bound", "Pod")).await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    while lease_write(&p2, &f.ns, "bound", Some("p1"), "2026-12-03T09:00:00.000001Z").await.is_ok() {
        assert!(Instant::now() < deadline, "a claim under another Pod's name kept being admitted");
        lease_write(&f.client, &f.ns, "bound", None, "2026-12-03T09:00:00.000000Z").await.unwrap();
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    lease_write(&p1, &f.ns, "bound", Some("p1"), "2026-12-03T09:00:01.000000Z").await.expect("p1 claims as itself");
    forbidden(lease_write(&p2, &f.ns, "bound", Some("p1"), "2026-12-03T09:00:02.000000Z").await, "may claim or renew it only as p2");
    forbidden(lease_write(&p2, &f.ns, "bound", None, "2026-12-03T09:00:01.000000Z").await, "released only by its holder p1");
    // The same ServiceAccount without a Pod-bound token has no Pod identity.
    let bare = common::identity::client_as(&format!("system:serviceaccount:{}:worker", f.ns)).await;
    forbidden(lease_write(&bare, &f.ns, "bound", Some("p1"), "2026-12-03T09:00:02.000000Z").await, "carries no Pod identity");
    lease_write(&p1, &f.ns, "bound", None, "2026-12-03T09:00:03.000000Z").await.expect("p1 releases");
    f.stop().await;
}
