//! The API server's policies of fenced controllers, on the real control plane: while a
//! FencedController (`kubefence.io/v1alpha1`) names a `coordination.k8s.io` Lease, the Lease —
//! which carries no kube-fence label or annotation — is claimed only by a Pod of the fence's
//! ServiceAccounts under its own name, and released or deleted only by its holder
//! (`<configuration>-fenced-holder`); and the ServiceAccounts a fence names never write it
//! (`<configuration>-fence-owner`), whatever their RBAC. In an ordinary namespace and in
//! kube-system. The Pods are never scheduled (no node): each client authenticates with a
//! ServiceAccount token bound to its Pod, as the kubelet would mount it. Each test says which
//! threat case it covers.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease as LeaderLease;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::ClusterRoleBinding;
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube_fence::admission::local::LocalOptions;
use kube_fence_api::{FenceMode, FencedController};
use serde_json::json;

use super::leader::{elect, forbidden};
use super::{Fixture, common};
use common::leader::until;

/// Where a scene is set up: the test's own namespace, or kube-system (names prefixed with the
/// test's namespace, removed at the end).
#[derive(Clone, Copy, PartialEq)]
enum Place {
    Own,
    KubeSystem,
}

/// A fenced controller and an intruder: ServiceAccount `ctl` (Pods p1, p2) fenced by
/// FencedController `fence` on Lease `lease`, and ServiceAccount `x` (Pod x1), both bound to
/// `cluster-admin`.
struct Scene {
    /// The namespace everything is in.
    at: String,
    /// Prefix of every name (empty in the test's own namespace).
    prefix: String,
    ctl: String,
    intruder: String,
    fence: String,
    lease: String,
    p1: Client,
    p2: Client,
    x1: Client,
    admin: Client,
    binding: String,
}

impl Scene {
    /// Sets the scene up in `place`; the fence is created by the admin with `mode`, once the
    /// policies judge (a dry-run claim by the intruder is refused).
    async fn new(f: &Fixture, place: Place, mode: FenceMode) -> Scene {
        let (at, prefix) = match place {
            Place::Own => (f.ns.clone(), String::new()),
            Place::KubeSystem => ("kube-system".to_string(), format!("{}-", f.ns)),
        };
        let name = |n: &str| format!("{prefix}{n}");
        let (ctl, intruder) = (name("ctl"), name("x"));
        for sa in [&ctl, &intruder] {
            let account: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": sa}})).unwrap();
            Api::<ServiceAccount>::namespaced(f.client.clone(), &at)
                .create(&PostParams::default(), &account)
                .await
                .expect("service account");
        }
        // Both bound to cluster-admin: full RBAC on Leases and on FencedControllers.
        let binding = format!("{}-fenced-admins", f.ns);
        let crb: ClusterRoleBinding = serde_json::from_value(json!({"metadata": {"name": binding},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "cluster-admin"},
            "subjects": [{"kind": "ServiceAccount", "name": ctl, "namespace": at}, {"kind": "ServiceAccount", "name": intruder, "namespace": at}]}))
        .unwrap();
        Api::<ClusterRoleBinding>::all(f.client.clone()).create(&PostParams::default(), &crb).await.expect("cluster role binding");
        let (p1, p2, x1) = (name("p1"), name("p2"), name("x1"));
        let pods = common::identity::pods_of(&f.client, &at, &ctl, &[&p1, &p2]).await;
        let intruders = common::identity::pods_of(&f.client, &at, &intruder, &[&x1]).await;
        let client = |sa: String, pod: Pod| {
            let (admin, at) = (f.client.clone(), at.clone());
            async move { common::identity::client_as_pod(&admin, &at, &sa, &pod).await }
        };
        let scene = Scene {
            p1: client(ctl.clone(), pods[0].clone()).await,
            p2: client(ctl.clone(), pods[1].clone()).await,
            x1: client(intruder.clone(), intruders[0].clone()).await,
            admin: f.client.clone(),
            fence: name("fence"),
            lease: name("lease"),
            at,
            prefix,
            ctl,
            intruder,
            binding,
        };
        for client in [&scene.p1, &scene.x1] {
            common::identity::wait_authorized(client, &scene.at, "coordination.k8s.io", "leases", "update").await;
            common::identity::wait_authorized(client, &scene.at, "kubefence.io", "fencedcontrollers", "delete").await;
        }
        let lease: LeaderLease = serde_json::from_value(json!({"metadata": {"name": scene.lease}, "spec": {}})).unwrap();
        scene.leases(&scene.admin).create(&PostParams::default(), &lease).await.expect("the controller's Lease, no holder yet");
        scene.create_fence(mode).await;
        scene.wait_judged().await;
        scene
    }

    fn name(&self, n: &str) -> String {
        format!("{}{n}", self.prefix)
    }

    fn leases(&self, client: &Client) -> Api<LeaderLease> {
        Api::namespaced(client.clone(), &self.at)
    }

    fn fences(&self, client: &Client) -> Api<FencedController> {
        Api::namespaced(client.clone(), &self.at)
    }

    async fn create_fence(&self, mode: FenceMode) {
        let fence: FencedController = serde_json::from_value(json!({"apiVersion": "kubefence.io/v1alpha1", "kind": "FencedController",
            "metadata": {"name": self.fence}, "spec": {"lease": self.lease, "serviceAccounts": [self.ctl], "mode": mode}}))
        .unwrap();
        self.fences(&self.admin).create(&PostParams::default(), &fence).await.expect("the admin creates the fence");
    }

    /// A claim of the Lease by `client` as `holder`, as a server-side dry run: judged by the
    /// policies, stored nowhere.
    async fn claim_dry_run(&self, client: &Client, holder: &str) -> Result<LeaderLease, kube::Error> {
        let leases = self.leases(client);
        let mut lease = leases.get(&self.lease).await?;
        lease.spec = Some(serde_json::from_value(json!({"holderIdentity": holder, "leaseDurationSeconds": 4})).unwrap());
        leases.replace(&self.lease, &PostParams { dry_run: true, ..Default::default() }, &lease).await
    }

    /// Waits until the fence judges the Lease (the policy and its parameters are read by the API
    /// server a moment after they are written): the intruder's claim is refused.
    async fn wait_judged(&self) {
        let x1 = self.name("x1_0");
        until("the fenced-holder policy judges the Lease", Duration::from_secs(30), async || {
            self.claim_dry_run(&self.x1, &x1).await.is_err()
        })
        .await;
        // And the fence-owner guard judges the fence.
        let fence = self.fences(&self.p1);
        until("the fence-owner guard judges the fence", Duration::from_secs(30), async || {
            let pp = PatchParams { dry_run: true, ..Default::default() };
            fence.patch(&self.fence, &pp, &Patch::Merge(json!({"spec": {"mode": "Audit"}}))).await.is_err()
        })
        .await;
    }

    /// Removes what the scene made (the fence first: the Lease is then no longer judged).
    async fn clean_up(self) {
        let dp = DeleteParams::default();
        let _ = self.fences(&self.admin).delete(&self.fence, &dp).await;
        let _ = Api::<ClusterRoleBinding>::all(self.admin.clone()).delete(&self.binding, &dp).await;
        if self.at == "kube-system" {
            let leases = self.leases(&self.admin);
            until("the Lease is deletable once the fence is gone", Duration::from_secs(30), async || {
                match leases.delete(&self.lease, &dp).await {
                    Ok(_) => true,
                    Err(kube::Error::Api(e)) => e.code == 404,
                    Err(_) => false,
                }
            })
            .await;
            let pods = Api::<Pod>::namespaced(self.admin.clone(), &self.at);
            for pod in ["p1", "p2", "x1"] {
                let _ = pods.delete(&self.name(pod), &DeleteParams { grace_period_seconds: Some(0), ..Default::default() }).await;
            }
            let accounts = Api::<ServiceAccount>::namespaced(self.admin.clone(), &self.at);
            for sa in [&self.ctl, &self.intruder] {
                let _ = accounts.delete(sa, &dp).await;
            }
        }
    }
}

/// A fixture whose registration also covers kube-system when `place` is [`Place::KubeSystem`]
/// (the policies of fenced controllers follow the scope's namespaces; unscoped, they cover all).
async fn fixture(test: &str, place: Place) -> Fixture {
    let client = common::client().await;
    let ns = common::namespace(&client, test).await;
    let mut options = LocalOptions::new(format!("kf-test-{ns}"));
    let mut only = vec![ns.clone()];
    if place == Place::KubeSystem {
        only.push("kube-system".into());
    }
    options.webhook.scope.only_namespaces = Some(only);
    Fixture::with_options(client, ns, options).await
}

fn refused_by_owner_guard<T: std::fmt::Debug>(result: Result<T, kube::Error>, s: &Scene) {
    refused_by_owner_guard_of(result, s, &s.fence)
}

/// Refused by the fence-owner guard, the message naming the ServiceAccount and fence `fence`.
fn refused_by_owner_guard_of<T: std::fmt::Debug>(result: Result<T, kube::Error>, s: &Scene, fence: &str) {
    let status = common::rejected(result);
    assert_eq!(status.code, 403, "{status:?}");
    let who = format!("ServiceAccount system:serviceaccount:{}:{} is fenced by FencedController {}/{fence}", s.at, s.ctl, s.at);
    assert!(status.message.contains(&who), "{who:?} not in {}", status.message);
    assert!(status.message.contains("never by the controller it fences"), "{}", status.message);
}

/// Fenced controller with cluster-admin (the insider threat): the controller's ServiceAccount,
/// bound to `cluster-admin`, cannot switch its Enforce fence to Audit, change its exemptions or
/// its Lease, write its status, delete it, or create another fence naming itself — each refused
/// with a message naming the ServiceAccount — and the fence is left as the admin wrote it.
async fn the_fenced_service_account_cannot_touch_its_fence(place: Place, test: &str) {
    let f = fixture(test, place).await;
    let s = Scene::new(&f, place, FenceMode::Enforce).await;
    let fences = s.fences(&s.p1);
    let pp = PatchParams::default();
    refused_by_owner_guard(fences.patch(&s.fence, &pp, &Patch::Merge(json!({"spec": {"mode": "Audit"}}))).await, &s);
    refused_by_owner_guard(fences.patch(&s.fence, &pp, &Patch::Merge(json!({"spec": {"exempt": ["configmaps"]}}))).await, &s);
    refused_by_owner_guard(fences.patch(&s.fence, &pp, &Patch::Merge(json!({"spec": {"serviceAccounts": ["someone-else"]}}))).await, &s);
    refused_by_owner_guard(fences.patch(&s.fence, &pp, &Patch::Merge(json!({"spec": {"lease": "another-lease"}}))).await, &s);
    let status = json!({"status": {"holder": "nobody", "conditions": [{"type": "Ready", "status": "False", "reason": "Forged",
        "message": "forged", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}});
    refused_by_owner_guard(fences.patch_status(&s.fence, &pp, &Patch::Merge(status)).await, &s);
    refused_by_owner_guard(fences.delete(&s.fence, &DeleteParams::default()).await, &s);
    let own: FencedController = serde_json::from_value(json!({"apiVersion": "kubefence.io/v1alpha1", "kind": "FencedController",
        "metadata": {"name": s.name("mine")}, "spec": {"lease": s.lease, "serviceAccounts": [s.ctl], "mode": "Audit"}}))
    .unwrap();
    refused_by_owner_guard_of(fences.create(&PostParams::default(), &own).await, &s, &s.name("mine"));
    // Its follower Pod and a token without a Pod are the same ServiceAccount: refused too.
    refused_by_owner_guard(s.fences(&s.p2).delete(&s.fence, &DeleteParams::default()).await, &s);

    let stored = s.fences(&s.admin).get(&s.fence).await.expect("the fence is still there");
    assert_eq!(stored.spec.mode, FenceMode::Enforce);
    assert_eq!(stored.spec.service_accounts, std::slice::from_ref(&s.ctl));
    assert!(stored.spec.exempt.is_empty() && stored.spec.lease == s.lease && stored.status.is_none());
    assert_eq!(stored.metadata.generation, Some(1), "nothing the controller sent changed the fence");
    s.clean_up().await;
    f.stop().await;
}

#[tokio::test]
async fn a_fenced_controller_with_cluster_admin_cannot_loosen_change_or_delete_its_fence() {
    the_fenced_service_account_cannot_touch_its_fence(Place::Own, "fence-owner").await;
}

#[tokio::test]
async fn a_fenced_controller_with_cluster_admin_cannot_touch_its_fence_in_kube_system() {
    the_fenced_service_account_cannot_touch_its_fence(Place::KubeSystem, "fence-owner-ks").await;
}

/// Follower replica and third-party Pod with full RBAC on Leases (a lock-out and a spoofed
/// leader): p1 of the fenced ServiceAccount acquires the Lease as itself; its follower p2 cannot
/// rename the holder (p1's name with another suffix), renew p1's term, release it or delete the
/// Lease; a Pod of another ServiceAccount (x1, cluster-admin) cannot claim it even as itself nor
/// delete it — it could otherwise take the Lease and lock the controller out. client-go's
/// take-over of an expired Lease works: p2 writes its own name. A metadata-only write is not a
/// claim and passes.
async fn only_the_fenced_service_accounts_pods_hold_the_lease(place: Place, test: &str) {
    let f = fixture(test, place).await;
    let s = Scene::new(&f, place, FenceMode::Audit).await;
    let (p1, p2, x1) = (s.name("p1"), s.name("p2"), s.name("x1"));
    let at = |sec: u32| format!("2026-12-03T09:00:{sec:02}.000000Z");
    elect(&s.p1, &s.at, &s.lease, &format!("{p1}_1111"), &at(1), 1).await.expect("p1 acquires as itself");
    elect(&s.p1, &s.at, &s.lease, &format!("{p1}_1111"), &at(2), 1).await.expect("p1 renews");

    // The follower cannot rename, renew, release or delete p1's term.
    forbidden(
        elect(&s.p2, &s.at, &s.lease, &format!("{p1}_9999"), &at(3), 2).await,
        &format!("Pod {p2} may hold it only as {p2} or {p2}_<suffix>, not as {p1}_9999"),
    );
    forbidden(elect(&s.p2, &s.at, &s.lease, &format!("{p1}_1111"), &at(3), 1).await, &format!("not as {p1}_1111"));
    forbidden(elect(&s.p2, &s.at, &s.lease, "", &at(3), 1).await, &format!("released only by its holder {p1}_1111, not by Pod {p2}"));
    let status = common::rejected(s.leases(&s.p2).delete(&s.lease, &DeleteParams::default()).await);
    assert_eq!(status.code, 403, "{status:?}");
    assert!(status.message.contains(&format!("deleted only by its holder {p1}_1111, not by Pod {p2}")), "{}", status.message);

    // The intruder, with full RBAC on Leases, cannot claim it, not even as itself, nor delete it.
    let fenced_by = format!("is fenced by FencedController {}", s.fence);
    forbidden(elect(&s.x1, &s.at, &s.lease, &format!("{x1}_3333"), &at(4), 2).await, &fenced_by);
    forbidden(
        elect(&s.x1, &s.at, &s.lease, &format!("{x1}_3333"), &at(4), 2).await,
        &format!("Pod {x1} runs as system:serviceaccount:{}:{}, which the fence does not name", s.at, s.intruder),
    );
    assert_eq!(common::rejected(s.leases(&s.x1).delete(&s.lease, &DeleteParams::default()).await).code, 403);
    // ... nor can a requester that is no Pod (here the cluster admin): rollback is deleting the fence.
    forbidden(elect(&s.admin, &s.at, &s.lease, "admin_1", &at(4), 2).await, "is no Pod of namespace");
    // A metadata-only write leaves the holder alone: not a claim.
    common::accepted(
        s.leases(&s.x1).patch(&s.lease, &PatchParams::default(), &Patch::Merge(json!({"metadata": {"labels": {"team": "x"}}}))).await,
    );

    // p1 is paused past its Lease: client-go in p2 takes over, writing its own name.
    elect(&s.p2, &s.at, &s.lease, &format!("{p2}_2222"), &at(10), 2).await.expect("p2 takes the expired Lease over as itself");
    // The resumed p1 cannot take it back under p2's name, and the intruder still cannot take it.
    forbidden(elect(&s.p1, &s.at, &s.lease, &format!("{p2}_2222"), &at(11), 2).await, &format!("not as {p2}_2222"));
    forbidden(elect(&s.x1, &s.at, &s.lease, &format!("{x1}_3333"), &at(11), 3).await, &fenced_by);
    // The holder releases (client-go's ReleaseOnCancel) and deletes nothing it does not hold.
    elect(&s.p2, &s.at, &s.lease, "", &at(12), 2).await.expect("the holder releases");
    let stored = s.leases(&s.admin).get(&s.lease).await.expect("the Lease");
    assert_eq!(stored.spec.and_then(|s| s.holder_identity).unwrap_or_default(), "");
    s.clean_up().await;
    f.stop().await;
}

#[tokio::test]
async fn only_a_pod_of_the_fenced_service_accounts_holds_the_lease() {
    only_the_fenced_service_accounts_pods_hold_the_lease(Place::Own, "fenced-holder").await;
}

#[tokio::test]
async fn only_a_pod_of_the_fenced_service_accounts_holds_the_lease_in_kube_system() {
    only_the_fenced_service_accounts_pods_hold_the_lease(Place::KubeSystem, "fenced-holder-ks").await;
}

/// Rollback and tightening by the admin (who needs no kube-fence setting: not in any list): the
/// fixture's cluster admin creates the fence (Audit), switches it to Enforce, writes its status,
/// and deletes it; once it is deleted the Lease is not judged any more — the other
/// ServiceAccount's Pod may then claim it.
#[tokio::test]
async fn a_cluster_admin_creates_changes_and_deletes_the_fence_and_deleting_it_ends_the_binding() {
    let f = fixture("fence-admin", Place::Own).await;
    let s = Scene::new(&f, Place::Own, FenceMode::Audit).await;
    let fences = s.fences(&s.admin);
    let pp = PatchParams::default();
    let enforced = common::accepted(fences.patch(&s.fence, &pp, &Patch::Merge(json!({"spec": {"mode": "Enforce"}}))).await);
    assert_eq!(enforced.spec.mode, FenceMode::Enforce);
    common::accepted(fences.patch(&s.fence, &pp, &Patch::Merge(json!({"spec": {"exempt": ["configmaps"]}}))).await);
    let status = json!({"status": {"holder": "p1", "observedGeneration": 3}});
    common::accepted(fences.patch_status(&s.fence, &pp, &Patch::Merge(status)).await);
    let x1 = s.name("x1");
    forbidden(elect(&s.x1, &s.at, &s.lease, &format!("{x1}_1"), "2026-12-03T09:00:01.000000Z", 1).await, "is fenced by FencedController");

    common::accepted(fences.delete(&s.fence, &DeleteParams::default()).await);
    let started = Instant::now();
    until("the intruder's claim is admitted once the fence is gone", Duration::from_secs(30), async || {
        elect(&s.x1, &s.at, &s.lease, &format!("{x1}_1"), "2026-12-03T09:00:01.000000Z", 1).await.is_ok()
    })
    .await;
    eprintln!("MEASURED the binding ended {:?} after the FencedController was deleted", started.elapsed());
    s.clean_up().await;
    f.stop().await;
}

/// Unfenced Leases stay as they were (no collateral damage): with the policies registered and a
/// fence judging Lease `lease`, another Lease of the same namespace, and a Lease of a namespace
/// with no FencedController, are written by anyone under any holder name — an admin and the Pod
/// of another ServiceAccount claim, rename, release and delete them.
#[tokio::test]
async fn a_lease_no_fenced_controller_names_is_not_judged() {
    let f = fixture("fence-none", Place::Own).await;
    let s = Scene::new(&f, Place::Own, FenceMode::Enforce).await;
    let unfenced: LeaderLease = serde_json::from_value(json!({"metadata": {"name": "other"}, "spec": {}})).unwrap();
    s.leases(&s.admin).create(&PostParams::default(), &unfenced).await.expect("another Lease");
    let at = "2026-12-03T09:00:01.000000Z";
    elect(&s.x1, &s.at, "other", "somebody-else_1", at, 1).await.expect("a claim under another name");
    elect(&s.admin, &s.at, "other", "admin-says_2", at, 2).await.expect("the admin renames the holder");
    // (A non-holder of another ServiceAccount: a follower of the fenced one writes nothing but
    // its own Lease, and the writer fence would refuse it.)
    elect(&s.x1, &s.at, "other", "", at, 2).await.expect("a non-holder releases it");
    s.leases(&s.x1).delete("other", &DeleteParams::default()).await.expect("a non-holder deletes it");

    // A namespace with no FencedController at all.
    let bare = common::namespace(&f.client, "fence-none-bare").await;
    let leases = Api::<LeaderLease>::namespaced(f.client.clone(), &bare);
    let lease: LeaderLease = serde_json::from_value(json!({"metadata": {"name": "l"}, "spec": {"holderIdentity": "anyone"}})).unwrap();
    leases.create(&PostParams::default(), &lease).await.expect("created with any holder");
    elect(&f.client, &bare, "l", "", at, 1).await.expect("released by anyone");
    leases.delete("l", &DeleteParams::default()).await.expect("deleted by anyone");
    s.clean_up().await;
    f.stop().await;
}

/// Resource exhaustion through a fence (the writer webhook's per-fence cost grows with it): the
/// CRD's schema refuses 9 ServiceAccounts, 33 exemptions and a malformed exemption, each with a
/// message naming the field. Needs no policy.
#[tokio::test]
async fn an_oversize_or_malformed_fence_is_refused_by_the_schema() {
    let client = common::client().await;
    let ns = common::namespace(&client, "fence-schema").await;
    let fences = Api::<FencedController>::namespaced(client.clone(), &ns);
    let make = |accounts: Vec<String>, exempt: Vec<String>| -> FencedController {
        serde_json::from_value(json!({"apiVersion": "kubefence.io/v1alpha1", "kind": "FencedController",
            "metadata": {"name": "f"}, "spec": {"lease": "l", "serviceAccounts": accounts, "exempt": exempt}}))
        .unwrap()
    };
    let nine: Vec<String> = (0..9).map(|i| format!("sa{i}")).collect();
    let many: Vec<String> = (0..33).map(|i| format!("r{i}")).collect();
    for (fence, field) in [
        (make(nine, vec![]), "spec.serviceAccounts"),
        (make(vec!["sa".into()], many), "spec.exempt"),
        (make(vec!["sa".into()], vec!["Deployments_apps".into()]), "spec.exempt[0]"),
        (make(vec!["Bad SA".into()], vec![]), "spec.serviceAccounts[0]"),
    ] {
        let status = common::rejected(fences.create(&PostParams::default(), &fence).await);
        assert_eq!(status.code, 422, "{status:?}");
        assert!(status.message.contains(field), "{field:?} not in {}", status.message);
    }
    common::accepted(
        fences
            .create(&PostParams::default(), &make((0..8).map(|i| format!("sa{i}")).collect(), (0..32).map(|i| format!("r{i}")).collect()))
            .await,
    );
}
