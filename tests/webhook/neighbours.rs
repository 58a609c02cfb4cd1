//! No noisy neighbours, on the real control plane with the shipped budgets: every genuine review
//! comes from the API server's address, so a quorum-read budget keyed by that address alone let
//! one busy controller or one tenant deny everyone's fenced writes. Reads are now charged per
//! source and lease namespace, once per shared read: a tenant flooding labelled creates in its
//! namespace, and another fenced controller writing flat out in its own, leave a third
//! controller's fenced and leader-guarded writes all admitted.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease as LeaderLease;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube_fence::admission::local::LocalOptions;
use kube_fence_api::denial::Reason;
use kube_fence_api::names::{LEADER_LEASE_LABEL, LEASE_LABEL, TOKEN_ANNOTATION};
use kube_fence_api::{FenceMode, FencedController, FencedControllerSpec};
use serde_json::json;

use super::leader::elect;
use super::{Fixture, common};

/// A controller already running in `ns` as ServiceAccount `ctl`: Pod `c1`, its Lease `ctl` held
/// by it, fenced by a FencedController in Enforce; a client as the holder Pod.
async fn fenced_controller(f: &Fixture, ns: &str) -> Client {
    let sa: k8s_openapi::api::core::v1::ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "ctl"}})).unwrap();
    Api::<k8s_openapi::api::core::v1::ServiceAccount>::namespaced(f.client.clone(), ns)
        .create(&PostParams::default(), &sa)
        .await
        .expect("service account");
    let user = format!("system:serviceaccount:{ns}:ctl");
    common::identity::grant_worker_rbac(&f.client, ns, &user).await;
    let pods = common::identity::pods_of(&f.client, ns, "ctl", &["c1"]).await;
    let holder = common::identity::client_as_pod(&f.client, ns, "ctl", &pods[0]).await;
    common::identity::wait_authorized(&holder, ns, "", "configmaps", "create").await;
    let lease: LeaderLease = serde_json::from_value(json!({"metadata": {"name": "ctl"}, "spec": {}})).unwrap();
    Api::<LeaderLease>::namespaced(holder.clone(), ns).create(&PostParams::default(), &lease).await.expect("the Lease");
    elect(&holder, ns, "ctl", "c1_1", "2026-12-06T09:00:00.000000Z", 1).await.expect("c1 leads");
    let fence = FencedController::new(
        "ctl",
        FencedControllerSpec { lease: "ctl".into(), service_accounts: vec!["ctl".into()], exempt: Vec::new(), mode: FenceMode::Enforce },
    );
    Api::<FencedController>::namespaced(f.client.clone(), ns).create(&PostParams::default(), &fence).await.expect("the fence");
    let routed = kube_fence::admission::registration::routing::configuration_name(&format!("kf-test-{}", f.ns));
    let configs = Api::<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration>::all(f.client.clone());
    common::leader::until("the fence is routed", Duration::from_secs(60), async || {
        configs.get_opt(&routed).await.ok().flatten().is_some_and(|c| kube_fence::admission::registration::routing::routes_in(&c, &user))
    })
    .await;
    // The API server's webhook informer follows the configuration a moment later: wait for a
    // judged write (Fenced is not visible to the writer; a write of the holder always lands).
    holder
}

fn configmap(name: &str) -> ConfigMap {
    serde_json::from_value(json!({"metadata": {"name": name}, "data": {"k": "0"}})).unwrap()
}

/// Counts of one writer's writes: admitted, throttled (429: a retry would follow), failed.
#[derive(Default)]
struct Tally {
    admitted: AtomicU64,
    throttled: AtomicU64,
    failed: AtomicU64,
}

impl Tally {
    fn count<T>(&self, result: Result<T, kube::Error>) {
        match result {
            Ok(_) => self.admitted.fetch_add(1, Ordering::Relaxed),
            Err(kube::Error::Api(e)) if e.code == 429 || e.reason == Reason::ReadsThrottled.as_str() => {
                self.throttled.fetch_add(1, Ordering::Relaxed)
            }
            Err(_) => self.failed.fetch_add(1, Ordering::Relaxed),
        };
    }

    fn get(&self) -> (u64, u64, u64) {
        (self.admitted.load(Ordering::Relaxed), self.throttled.load(Ordering::Relaxed), self.failed.load(Ordering::Relaxed))
    }
}

/// Threat cases: a tenant with ordinary RBAC (creates in its own namespace only) flooding creates
/// labelled with leases that do not exist, each needing a quorum read; and another fenced
/// controller, legitimate and busy, writing flat out with 8 workers. Meanwhile a third
/// controller's leader makes 170 fenced writes (unlabelled ConfigMaps) and 170 writes of an
/// object bound to its Lease (`kubefence.io/leader-lease`): every one is admitted, none
/// throttled. With the budget keyed by the API server's address alone (before), the same run
/// threw hundreds of 429s at the third controller.
#[tokio::test]
async fn a_tenants_flood_and_a_busy_controller_leave_a_third_controllers_writes_alone() {
    let client = common::client().await;
    let ns = common::namespace(&client, "neighbours").await;
    let tenant = common::namespace(&client, "neighbours-tenant").await;
    let busy = common::namespace(&client, "neighbours-busy").await;
    let mut options = LocalOptions::new(format!("kf-test-{ns}"));
    options.webhook.scope.only_namespaces = Some(vec![ns.clone(), tenant.clone(), busy.clone()]);
    let f = Fixture::with_options(client, ns.clone(), options).await;
    let third = fenced_controller(&f, &ns).await;
    let busy_holder = fenced_controller(&f, &busy).await;
    let bound = json!({"metadata": {"name": "bound", "labels": {LEADER_LEASE_LABEL: "ctl"}}, "data": {"k": "0"}});
    common::accepted(
        Api::<ConfigMap>::namespaced(third.clone(), &ns).create(&PostParams::default(), &serde_json::from_value(bound).unwrap()).await,
    );

    // The tenant: may create ConfigMaps in its namespace, and floods labelled creates.
    let mallory = format!("system:serviceaccount:{tenant}:mallory");
    common::identity::grant_worker_rbac(&f.client, &tenant, &mallory).await;
    let mallory = common::identity::client_as(&mallory).await;
    common::identity::wait_authorized(&mallory, &tenant, "", "configmaps", "create").await;
    let stop = Arc::new(AtomicBool::new(false));
    let (flood, busy_writes) = (Arc::new(Tally::default()), Arc::new(Tally::default()));
    let mut noise = Vec::new();
    for worker in 0..8 {
        let (api, until_stopped, tally) = (Api::<ConfigMap>::namespaced(mallory.clone(), &tenant), stop.clone(), flood.clone());
        noise.push(tokio::spawn(async move {
            let mut i = 0u64;
            while !until_stopped.load(Ordering::Relaxed) {
                i += 1;
                let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": format!("flood-{worker}-{i}"),
                    "labels": {LEASE_LABEL: format!("nothing-{worker}-{i}")}, "annotations": {TOKEN_ANNOTATION: "1"}}}))
                .unwrap();
                tally.count(api.create(&PostParams::default(), &cm).await);
            }
        }));
        let (api, until_stopped, tally) = (Api::<ConfigMap>::namespaced(busy_holder.clone(), &busy), stop.clone(), busy_writes.clone());
        noise.push(tokio::spawn(async move {
            let name = format!("busy-{worker}");
            tally.count(api.create(&PostParams::default(), &configmap(&name)).await);
            let mut i = 0u64;
            while !until_stopped.load(Ordering::Relaxed) {
                i += 1;
                tally.count(api.patch(&name, &PatchParams::default(), &Patch::Merge(json!({"data": {"k": i.to_string()}}))).await);
            }
        }));
    }
    // Once the noise runs (the tenant's creates are being judged), the third controller writes.
    common::leader::until("the flood is being judged", Duration::from_secs(30), async || flood.get().2 > 50).await;
    let started = Instant::now();
    let (fenced, bound) = (Tally::default(), Tally::default());
    let cms = Api::<ConfigMap>::namespaced(third.clone(), &ns);
    fenced.count(cms.create(&PostParams::default(), &configmap("third")).await);
    for i in 0..170 {
        fenced.count(cms.patch("third", &PatchParams::default(), &Patch::Merge(json!({"data": {"k": i.to_string()}}))).await);
        bound.count(cms.patch("bound", &PatchParams::default(), &Patch::Merge(json!({"data": {"k": i.to_string()}}))).await);
    }
    let took = started.elapsed();
    stop.store(true, Ordering::Relaxed);
    for task in noise {
        task.await.expect("a noise task");
    }
    let (flooded, busy_done) = (flood.get(), busy_writes.get());
    println!(
        "neighbours, {took:.1?}: third controller fenced {:?} and leader-bound {:?} (admitted, throttled, failed); the tenant's flood {flooded:?} (its creates are refused: LeaseNotFound); the busy controller {busy_done:?}",
        fenced.get(),
        bound.get()
    );
    assert_eq!(fenced.get(), (171, 0, 0), "the third controller's fenced writes are all admitted");
    assert_eq!(bound.get(), (170, 0, 0), "its leader-bound writes are all admitted");
    assert!(flooded.0 == 0 && flooded.2 > 0, "the tenant's creates were judged and refused");
    assert!(busy_done.0 > 0, "the busy controller was writing");
    f.stop().await;
}
