//! Holder-only objects (`kubefence.io/writer: holder`) of identity-bound leases, on the real API
//! server with Pod-bound ServiceAccount tokens (the claims a Pod's own token carries; no node
//! needed): `/status` writes, writes and deletes are admitted only from the lease's current
//! holder, read linearizably. Each test says which case it covers.

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams, Preconditions};
use kube::{Client, ResourceExt};
use kube_fence_api::denial::{Denial, Reason};
use kube_fence_api::names::{HOLDER_ONLY, WRITER_LABEL};
use serde_json::json;

use super::{Fixture, TOKEN, common, configmap, deployment};

/// Two Pods of one ServiceAccount with ordinary worker RBAC, and a client for each that
/// authenticates as that Pod.
async fn two_pods(f: &Fixture) -> (Client, Client) {
    let mut clients = Vec::new();
    for pod in common::identity::worker_pods(&f.client, &f.ns, &["p1", "p2"]).await {
        clients.push(common::identity::client_as_pod(&f.client, &f.ns, "worker", &pod).await);
    }
    let p2 = clients.pop().unwrap();
    let p1 = clients.pop().unwrap();
    // RBAC takes effect a moment after the binding is written (the authorizer's cache).
    for client in [&p1, &p2] {
        common::identity::wait_authorized(client, &f.ns, "apps", "deployments", "create").await;
    }
    (p1, p2)
}

/// An identity-bound lease `work` (spec.identity Pod) granted to `holder` with `token`.
async fn grant_bound(f: &Fixture, holder: &str, token: u64) {
    if f.leases().get_opt("work").await.unwrap().is_none() {
        let lease = serde_json::from_value(json!({"apiVersion": "kubefence.io/v1alpha1", "kind": "Lease",
            "metadata": {"name": "work"}, "spec": {"identity": "Pod"}}))
        .unwrap();
        f.leases().create(&PostParams::default(), &lease).await.unwrap();
    }
    f.grant("work", holder, token).await;
}

fn holder_only(mut obj: DynamicObject) -> DynamicObject {
    obj.labels_mut().insert(WRITER_LABEL.into(), HOLDER_ONLY.into());
    obj
}

fn status_of(message: &str) -> serde_json::Value {
    json!({"status": {"conditions": [{"type": "Progressing", "status": "True", "reason": "Writer", "message": message}]}})
}

fn pod_api<K: kube::Resource<DynamicType = ()>>(client: &Client, ns: &str) -> Api<DynamicObject> {
    Api::namespaced_with(client.clone(), ns, &kube::api::ApiResource::erase::<K>(&()))
}

async fn write_status(client: &Client, ns: &str, name: &str, message: &str) -> Result<DynamicObject, kube::Error> {
    pod_api::<Deployment>(client, ns).patch_status(name, &PatchParams::default(), &Patch::Merge(status_of(message))).await
}

/// The denial's typed facts: (code, reason, holder, requester).
fn not_holder(result: Result<DynamicObject, kube::Error>) -> (u16, Reason, Option<String>, Option<String>) {
    match result {
        Err(kube::Error::Api(status)) => {
            let d = Denial::from_status(&status).unwrap_or_else(|| panic!("not a kube-fence denial: {status:?}"));
            (d.code, d.reason, d.holder, d.requester)
        }
        other => panic!("expected a NotHolder denial, got {other:?}"),
    }
}

/// Stale-but-honest ex-holder Pod (and a Pod with ordinary RBAC acting on a token it read):
/// after another Pod took the lease, its `/status` writes to a holder-only Deployment are 409
/// `NotHolder`; the holder's are admitted. The same holds for the Lease changing hands again.
#[tokio::test]
async fn status_writes_to_a_holder_only_object_come_only_from_the_holder() {
    let f = Fixture::new("holder-status").await;
    let (p1, p2) = two_pods(&f).await;
    grant_bound(&f, "p1", 5).await;
    // Created by the holder: a holder-only object's every write, its creation included, is the holder's.
    pod_api::<Deployment>(&p1, &f.ns).create(&PostParams::default(), &holder_only(deployment("web", "work", 5))).await.unwrap();

    write_status(&p1, &f.ns, "web", "p1 under 5").await.expect("the holder writes status");
    assert_eq!(
        not_holder(write_status(&p2, &f.ns, "web", "p2 not holding").await),
        (409, Reason::NotHolder, Some("p1".into()), Some("p2".into()))
    );

    // The lease changes hands: p1 is now the ex-holder, whatever token it still knows.
    grant_bound(&f, "p2", 6).await;
    write_status(&p2, &f.ns, "web", "p2 under 6").await.expect("the new holder writes status");
    assert_eq!(
        not_holder(write_status(&p1, &f.ns, "web", "p1 stale").await),
        (409, Reason::NotHolder, Some("p2".into()), Some("p1".into()))
    );
    let stored = f.api::<Deployment>().get("web").await.unwrap();
    assert_eq!(stored.data["status"]["conditions"][0]["message"], "p2 under 6", "the ex-holder's status write did not stick");

    // While nobody holds the lease, nobody writes the status.
    let unheld = json!({"status": {"phase": "Unheld", "holder": null}});
    f.leases().patch_status("work", &PatchParams::default(), &Patch::Merge(&unheld)).await.unwrap();
    assert_eq!(not_holder(write_status(&p2, &f.ns, "web", "after release").await).1, Reason::NotHolder);
    f.stop().await;
}

/// Stale-but-honest ex-holder Pod: it re-reads the object and deletes it with the fresh
/// resourceVersion (which the token rule alone admits) — refused for a holder-only object.
/// Its fenced write with a token still newer than the recorded one is refused too. The holder
/// deletes.
#[tokio::test]
async fn an_ex_holder_neither_writes_nor_deletes_a_holder_only_object() {
    let f = Fixture::new("holder-delete").await;
    let (p1, p2) = two_pods(&f).await;
    grant_bound(&f, "p1", 5).await;
    pod_api::<ConfigMap>(&p1, &f.ns).create(&PostParams::default(), &holder_only(configmap("state", "work", 5))).await.unwrap();
    grant_bound(&f, "p2", 7).await;

    let as_pod = |c: &Client| pod_api::<ConfigMap>(c, &f.ns);
    // p1 was granted 6 in between (as far as it knows): a token above the recorded 5.
    let body = json!({"metadata": {"annotations": {TOKEN: "6"}}, "data": {"k": "p1"}});
    let stale = as_pod(&p1).patch("state", &PatchParams::default(), &Patch::Merge(&body)).await;
    assert_eq!(not_holder(stale).1, Reason::NotHolder);

    let fresh = as_pod(&p1).get("state").await.unwrap();
    let precondition = DeleteParams {
        preconditions: Some(Preconditions { resource_version: fresh.resource_version(), uid: fresh.uid() }),
        ..DeleteParams::default()
    };
    match as_pod(&p1).delete("state", &precondition).await {
        Err(kube::Error::Api(status)) => {
            assert_eq!(Denial::from_status(&status).map(|d| d.reason), Some(Reason::NotHolder), "{status:?}")
        }
        other => panic!("the ex-holder's delete must be refused, got {other:?}"),
    }
    assert!(as_pod(&p2).delete("state", &precondition).await.is_ok(), "the holder deletes the version it read");
    f.stop().await;
}

/// A worker with ordinary RBAC cannot opt an object out: removing the `kubefence.io/writer`
/// label is itself a write only the holder makes, and a `/status` write cannot move it.
#[tokio::test]
async fn the_writer_label_is_removed_only_by_the_holder() {
    let f = Fixture::new("holder-label").await;
    let (p1, p2) = two_pods(&f).await;
    grant_bound(&f, "p1", 5).await;
    // Created by the holder: a holder-only object's every write, its creation included, is the holder's.
    pod_api::<Deployment>(&p1, &f.ns).create(&PostParams::default(), &holder_only(deployment("web", "work", 5))).await.unwrap();
    let api = |c: &Client| pod_api::<Deployment>(c, &f.ns);
    let drop_label = json!({"metadata": {"labels": {WRITER_LABEL: null}, "annotations": {TOKEN: "5"}}});
    assert_eq!(not_holder(api(&p2).patch("web", &PatchParams::default(), &Patch::Merge(&drop_label)).await).1, Reason::NotHolder);
    let via_status = json!({"metadata": {"labels": {WRITER_LABEL: null}}, "status": {"observedGeneration": 9}});
    assert_eq!(not_holder(api(&p2).patch_status("web", &PatchParams::default(), &Patch::Merge(&via_status)).await).1, Reason::NotHolder);
    let web = f.api::<Deployment>().get("web").await.unwrap();
    assert_eq!(web.labels().get(WRITER_LABEL).map(String::as_str), Some(HOLDER_ONLY));
    // The holder can (with a fresh token, like any change to the guard).
    let drop_label = json!({"metadata": {"labels": {WRITER_LABEL: null}, "annotations": {TOKEN: "6"}}});
    grant_bound(&f, "p1", 6).await;
    api(&p1).patch("web", &PatchParams::default(), &Patch::Merge(&drop_label)).await.expect("the holder opts the object out");
    f.stop().await;
}

/// docs/what-is-fenced.md's matrix, holder-only column, for the paths not covered above (stale ex-holder
/// Pod with ordinary RBAC): server-side apply and deletecollection are refused `NotHolder`;
/// `/scale` is not fenced (the Scale carries no labels) and leaves the guard; a finalizer
/// removal from an object being deleted is admitted from anyone, so deletion completes.
#[tokio::test]
async fn the_holder_only_matrix_apply_deletecollection_scale_and_finalizers() {
    let f = Fixture::new("holder-matrix").await;
    let (p1, p2) = two_pods(&f).await;
    grant_bound(&f, "p1", 5).await;
    let mut pinned = holder_only(configmap("pinned", "work", 5));
    pinned.metadata.finalizers = Some(vec!["kubefence.io/test".into()]);
    for obj in [holder_only(configmap("a", "work", 5)), holder_only(configmap("b", "work", 5)), pinned] {
        pod_api::<ConfigMap>(&p1, &f.ns).create(&PostParams::default(), &obj).await.unwrap();
    }
    pod_api::<Deployment>(&p1, &f.ns).create(&PostParams::default(), &holder_only(deployment("web", "work", 5))).await.unwrap();
    grant_bound(&f, "p2", 7).await;

    // Server-side apply by the ex-holder, with a token above the recorded one.
    let applied = json!({"apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": "a", "annotations": {TOKEN: "6"}}, "data": {"k": "p1"}});
    let apply = pod_api::<ConfigMap>(&p1, &f.ns).patch("a", &PatchParams::apply("p1").force(), &Patch::Apply(&applied)).await;
    assert_eq!(not_holder(apply).1, Reason::NotHolder);

    // deletecollection: the API server admits each item's DELETE on its own.
    let all = kube::api::ListParams::default().labels("kubefence.io/lease=work");
    match pod_api::<ConfigMap>(&p1, &f.ns).delete_collection(&DeleteParams::default(), &all).await {
        Err(kube::Error::Api(status)) => assert_eq!(Denial::from_status(&status).map(|d| d.reason), Some(Reason::NotHolder), "{status:?}"),
        other => panic!("the ex-holder's deletecollection must be refused, got {other:?}"),
    }
    assert!(f.api::<ConfigMap>().get_opt("a").await.unwrap().is_some() && f.api::<ConfigMap>().get_opt("b").await.unwrap().is_some());

    // /scale: not fenced, and it cannot move the guard.
    let deployments: Api<Deployment> = Api::namespaced(p1.clone(), &f.ns);
    let scale = json!({"spec": {"replicas": 0}, "metadata": {"labels": {WRITER_LABEL: null}}});
    deployments.patch_scale("web", &PatchParams::default(), &Patch::Merge(&scale)).await.expect("/scale is not fenced");
    let web = f.api::<Deployment>().get("web").await.unwrap();
    assert_eq!(web.labels().get(WRITER_LABEL).map(String::as_str), Some(HOLDER_ONLY), "/scale left the writer label");

    // Finalizer removal from an object being deleted: the holder deletes, anyone may finish it.
    let rv = f.api::<ConfigMap>().get("pinned").await.unwrap();
    let precondition = DeleteParams {
        preconditions: Some(Preconditions { resource_version: rv.resource_version(), uid: rv.uid() }),
        ..DeleteParams::default()
    };
    let _ = pod_api::<ConfigMap>(&p2, &f.ns).delete("pinned", &precondition).await.expect("the holder deletes");
    let unpin = json!({"metadata": {"finalizers": null}});
    pod_api::<ConfigMap>(&p1, &f.ns)
        .patch("pinned", &PatchParams::default(), &Patch::Merge(&unpin))
        .await
        .expect("finishing a deletion is admitted from anyone");
    f.stop().await;
}
