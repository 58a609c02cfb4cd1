//! Fencing an unmodified leader-elected controller, on the real control plane: objects labelled
//! `kubefence.io/leader-lease` are written only by the Pod holding that `coordination.k8s.io`
//! Lease, and an opted-in Lease (`kubefence.io/holder-identity: Pod`) names as holder only the
//! Pod that writes it. The Pods are never scheduled (no node): each client authenticates with a
//! ServiceAccount token bound to its Pod, as the kubelet would mount it. Each test says which
//! threat case it covers.

use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease as LeaderLease;
use k8s_openapi::api::core::v1::{ConfigMap, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::Role;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use kube_fence::admission::decision::Reason;
use kube_fence::admission::denial::Denial;
use kube_fence::admission::leader::{HOLDER_IDENTITY_LABEL, HOLDER_IS_POD, LEADER_LEASE_LABEL};
use serde_json::json;

use super::{Fixture, common};

/// The identity that sets up guarded objects in the end-to-end test, exempt there (an operator's
/// admin would be).
const SETUP: &str = "leader-go-setup";

pub const WIDGET_CRD: &str = include_str!("../../examples/leader-go/widget-crd.yaml");

/// The example's custom resource, installed once per test binary.
pub async fn install_widget_crd(client: &Client) -> ApiResource {
    let crd: CustomResourceDefinition = serde_yaml::from_str(WIDGET_CRD).expect("the Widget CRD parses");
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    let name = crd.name_any();
    crds.patch(&name, &PatchParams::apply("kube-fence-tests").force(), &Patch::Apply(&crd)).await.expect("apply the Widget CRD");
    let established = kube::runtime::wait::await_condition(crds, &name, kube::runtime::wait::conditions::is_crd_established());
    tokio::time::timeout(Duration::from_secs(30), established).await.expect("CRD established in 30s").expect("watch CRD");
    let resource = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("example.kubefence.io", "v1", "Widget"), "widgets");
    let widgets: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
    let deadline = Instant::now() + Duration::from_secs(30);
    while widgets.list(&Default::default()).await.is_err() {
        assert!(Instant::now() < deadline, "Widgets are not served 30 s after the CRD was established");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    resource
}

/// A controller's Pods: ServiceAccount `ctl` with what a leader-elected controller needs
/// (`edit`, plus coordination Leases and Widgets with their status), and Pods `names` of it.
pub async fn controller_pods(f: &Fixture, names: &[&str]) -> Vec<Pod> {
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "ctl"}})).unwrap();
    Api::<ServiceAccount>::namespaced(f.client.clone(), &f.ns).create(&PostParams::default(), &sa).await.expect("service account");
    let user = format!("system:serviceaccount:{}:ctl", f.ns);
    common::identity::grant_worker_rbac(&f.client, &f.ns, &user).await;
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "leader-elected", "namespace": f.ns},
        "rules": [
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["*"]},
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["*"]},
            {"apiGroups": ["example.kubefence.io"], "resources": ["widgets", "widgets/status"], "verbs": ["*"]},
        ]
    }))
    .unwrap();
    let pp = PatchParams::apply("kube-fence-tests").force();
    Api::<Role>::namespaced(f.client.clone(), &f.ns).patch("leader-elected", &pp, &Patch::Apply(&role)).await.expect("role");
    let binding: k8s_openapi::api::rbac::v1::RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "leader-elected", "namespace": f.ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "leader-elected"},
        "subjects": [{"kind": "ServiceAccount", "name": "ctl", "namespace": f.ns},
                     {"kind": "User", "name": SETUP, "apiGroup": "rbac.authorization.k8s.io"}],
    }))
    .unwrap();
    Api::<k8s_openapi::api::rbac::v1::RoleBinding>::namespaced(f.client.clone(), &f.ns)
        .patch("leader-elected", &pp, &Patch::Apply(&binding))
        .await
        .expect("role binding");
    common::identity::pods_of(&f.client, &f.ns, "ctl", names).await
}

/// The leader-election Lease `name`, opted into holder binding, with no holder yet.
pub async fn opted_in_lease(f: &Fixture, name: &str) {
    let lease: LeaderLease =
        serde_json::from_value(json!({"metadata": {"name": name, "labels": {HOLDER_IDENTITY_LABEL: HOLDER_IS_POD}}, "spec": {}})).unwrap();
    Api::<LeaderLease>::namespaced(f.client.clone(), &f.ns).create(&PostParams::default(), &lease).await.expect("create the Lease");
}

/// What client-go's LeaseLock writes when it acquires, renews or takes over: the whole spec.
async fn elect(client: &Client, ns: &str, lease: &str, holder: &str, renew: &str, transitions: i32) -> Result<LeaderLease, kube::Error> {
    let leases: Api<LeaderLease> = Api::namespaced(client.clone(), ns);
    let mut current = leases.get(lease).await?;
    current.spec = Some(
        serde_json::from_value(json!({"holderIdentity": holder, "leaseDurationSeconds": 4, "acquireTime": "2026-12-03T09:00:00.000000Z",
            "renewTime": renew, "leaseTransitions": transitions}))
        .unwrap(),
    );
    leases.replace(lease, &PostParams::default(), &current).await
}

fn not_holder(result: Result<impl std::fmt::Debug, kube::Error>, holder: &str, requester: &str) {
    let status = common::rejected(result);
    let denial = Denial::from_status(&status).unwrap_or_else(|| panic!("a kube-fence denial, got {status:?}"));
    assert_eq!((denial.code, denial.reason), (409, Reason::NotHolder), "{status:?}");
    assert_eq!(denial.holder.as_deref(), Some(holder));
    assert_eq!(denial.requester.as_deref(), Some(requester));
    assert!(status.message.contains(holder) && status.message.contains(requester), "{}", status.message);
}

fn forbidden(result: Result<LeaderLease, kube::Error>, says: &str) {
    let status = common::rejected(result);
    assert_eq!(status.code, 403, "{status:?}");
    assert!(status.message.contains(says), "{says:?} not in {}", status.message);
}

/// Waits until the holder policy judges writes to opted-in Leases in the test's namespace (a
/// policy takes effect a moment after it is created): a spoofed claim is refused.
async fn wait_holder_policy(f: &Fixture, spoofer: &Client, lease: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while elect(spoofer, &f.ns, lease, "nobody-of-mine_x", "2026-12-03T09:00:00.000000Z", 0).await.is_ok() {
        assert!(Instant::now() < deadline, "a claim under another Pod's name kept being admitted");
        elect(&f.client, &f.ns, lease, "", "2026-12-03T09:00:00.000000Z", 0).await.expect("admin clears the spoofed claim");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The identity rule is configured (`--leader-identity-separator :`, chart value
/// `leaderIdentity.separator`), and the webhook and the holder policy both judge by it, not by
/// client-go's default `_`. Worker with ordinary RBAC: p2 cannot claim the Lease as p1 (`p1:…`),
/// and even p1 cannot claim it as `p1_…`, which names no Pod under this rule. Stale-but-honest
/// writer: once p2 holds the Lease as `p2:…`, p1's write to a guarded object is refused (409) and
/// p2's admitted; and a holder in the default form (`p1_…`, set by an admin) lets no Pod write,
/// p1 included, with a denial that names the rule.
#[tokio::test]
async fn the_configured_identity_rule_is_what_the_webhook_and_the_holder_policy_judge_by() {
    use kube_fence::admission::local::LocalOptions;
    let client = common::client().await;
    let ns = common::namespace(&client, "leader-rule").await;
    let mut options = LocalOptions::new(format!("kf-test-{ns}"));
    options.only_namespaces = Some(vec![ns.clone()]);
    options.leader_identity = ":".parse().expect("a separator");
    let f = Fixture::with_options(client, ns, options).await;
    let made = controller_pods(&f, &["p1", "p2"]).await;
    let p1 = common::identity::client_as_pod(&f.client, &f.ns, "ctl", &made[0]).await;
    let p2 = common::identity::client_as_pod(&f.client, &f.ns, "ctl", &made[1]).await;
    opted_in_lease(&f, "ctl").await;
    wait_holder_policy(&f, &p2, "ctl").await;
    let at = |s: u32| format!("2026-12-03T09:00:{s:02}.000000Z");

    // The holder policy, by the rule.
    forbidden(elect(&p1, &f.ns, "ctl", "p1_1111", &at(1), 1).await, "Pod p1 may hold it only as p1 or p1:<suffix>, not as p1_1111");
    forbidden(elect(&p2, &f.ns, "ctl", "p1:9999", &at(1), 1).await, "Pod p2 may hold it only as p2 or p2:<suffix>");
    elect(&p1, &f.ns, "ctl", "p1:1111", &at(1), 1).await.expect("p1 acquires as p1:1111");
    elect(&p1, &f.ns, "ctl", "p1:1111", &at(2), 1).await.expect("p1 renews");

    // The webhook, by the same rule.
    let cms = |c: &Client| Api::<ConfigMap>::namespaced(c.clone(), &f.ns);
    let labelled = json!({LEADER_LEASE_LABEL: "ctl"});
    let cm: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "state", "labels": labelled}, "data": {"writer": "p1"}})).unwrap();
    common::accepted(cms(&p1).create(&PostParams::default(), &cm).await);
    let data = |writer: &str| json!({"data": {"writer": writer}});
    let pp = PatchParams::default();
    not_holder(cms(&p2).patch("state", &pp, &Patch::Merge(&data("p2"))).await, "p1:1111", "p2");
    elect(&p2, &f.ns, "ctl", "p2:2222", &at(10), 2).await.expect("p2 takes over as p2:2222");
    common::accepted(cms(&p2).patch("state", &pp, &Patch::Merge(&data("p2"))).await);
    not_holder(cms(&p1).patch("state", &pp, &Patch::Merge(&data("p1-stale"))).await, "p2:2222", "p1");

    // A holder in client-go's default form names no Pod under this rule.
    elect(&f.client, &f.ns, "ctl", "p1_3333", &at(20), 3).await.expect("an admin sets the holder");
    let status = common::rejected(cms(&p1).patch("state", &pp, &Patch::Merge(&data("p1"))).await);
    assert_eq!(status.code, 409, "{status:?}");
    assert!(status.message.contains("Pod p1 holds it only as p1 or p1:<suffix>"), "{}", status.message);

    let stored = cms(&f.client).get("state").await.expect("the ConfigMap");
    assert_eq!(stored.data.unwrap_or_default().get("writer").map(String::as_str), Some("p2"));
    f.stop().await;
}

/// Stale-but-honest writer: leader p1 was paused past its Lease; p2 took the Lease over and
/// wrote. Every write p1 then sends — ConfigMap update and delete, a Widget's main resource and
/// its `/status`, a create — is refused with 409 NotHolder naming the holder and the requester,
/// and nothing p1 sent is stored. The holder's own writes (create, update, status, delete) are
/// admitted before and after.
#[tokio::test]
async fn only_the_pod_holding_the_leader_lease_writes() {
    let f = Fixture::new("leader-holder").await;
    let widgets = install_widget_crd(&f.client).await;
    let made = controller_pods(&f, &["p1", "p2"]).await;
    let p1 = common::identity::client_as_pod(&f.client, &f.ns, "ctl", &made[0]).await;
    let p2 = common::identity::client_as_pod(&f.client, &f.ns, "ctl", &made[1]).await;
    opted_in_lease(&f, "ctl").await;
    wait_holder_policy(&f, &p2, "ctl").await;
    elect(&p1, &f.ns, "ctl", "p1_1111", "2026-12-03T09:00:01.000000Z", 1).await.expect("p1 acquires");

    let cms = |c: &Client| Api::<ConfigMap>::namespaced(c.clone(), &f.ns);
    let ws = |c: &Client| Api::<DynamicObject>::namespaced_with(c.clone(), &f.ns, &widgets);
    let labelled = json!({LEADER_LEASE_LABEL: "ctl"});
    let cm: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "state", "labels": labelled}, "data": {"writer": "p1"}})).unwrap();
    common::accepted(cms(&p1).create(&PostParams::default(), &cm).await);
    let widget: DynamicObject = serde_json::from_value(json!({"apiVersion": "example.kubefence.io/v1", "kind": "Widget",
        "metadata": {"name": "w", "labels": labelled}, "spec": {"size": 1}}))
    .unwrap();
    common::accepted(ws(&p1).create(&PostParams::default(), &widget).await);
    let status = |writer: &str| json!({"status": {"writer": writer}});
    let data = |writer: &str| json!({"data": {"writer": writer}});
    let pp = PatchParams::default();
    common::accepted(ws(&p1).patch_status("w", &pp, &Patch::Merge(&status("p1"))).await);
    common::accepted(cms(&p1).patch("state", &pp, &Patch::Merge(&data("p1"))).await);
    // Not the holder: p2 cannot write while p1 leads.
    not_holder(cms(&p2).patch("state", &pp, &Patch::Merge(&data("p2"))).await, "p1_1111", "p2");

    // p1 is paused past its Lease; p2 takes over (client-go: a new holder, transitions + 1).
    elect(&p2, &f.ns, "ctl", "p2_2222", "2026-12-03T09:00:10.000000Z", 2).await.expect("p2 takes over");
    common::accepted(cms(&p2).patch("state", &pp, &Patch::Merge(&data("p2"))).await);
    common::accepted(ws(&p2).patch_status("w", &pp, &Patch::Merge(&status("p2"))).await);

    // p1 resumes and sends what it had prepared.
    not_holder(cms(&p1).patch("state", &pp, &Patch::Merge(&data("p1-stale"))).await, "p2_2222", "p1");
    not_holder(ws(&p1).patch_status("w", &pp, &Patch::Merge(&status("p1-stale"))).await, "p2_2222", "p1");
    not_holder(ws(&p1).patch("w", &pp, &Patch::Merge(&json!({"spec": {"size": 9}}))).await, "p2_2222", "p1");
    not_holder(cms(&p1).delete("state", &DeleteParams::default()).await, "p2_2222", "p1");
    let another: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "other", "labels": labelled}})).unwrap();
    not_holder(cms(&p1).create(&PostParams::default(), &another).await, "p2_2222", "p1");
    // Dropping the label is a write too.
    let unlabel = json!({"metadata": {"labels": {LEADER_LEASE_LABEL: null}}});
    not_holder(cms(&p1).patch("state", &pp, &Patch::Merge(&unlabel)).await, "p2_2222", "p1");

    let stored = cms(&f.client).get("state").await.expect("the ConfigMap is still there");
    assert_eq!(stored.data.unwrap_or_default().get("writer").map(String::as_str), Some("p2"));
    let stored = ws(&f.client).get("w").await.expect("the Widget");
    assert_eq!(stored.data["status"]["writer"], "p2");
    assert_eq!(stored.data["spec"]["size"], 1);
    common::accepted(cms(&p2).delete("state", &DeleteParams::default()).await);
    f.stop().await;
}

/// Worker with ordinary RBAC (any Pod of the controller's ServiceAccount can update its Lease):
/// on an opted-in Lease, naming another Pod as holder, renewing another's hold, releasing it or
/// dropping the opt-in label is refused (403) by the API server itself; a token bound to no Pod
/// names nobody. client-go's own acquire, renew, release and take-over are admitted.
#[tokio::test]
async fn the_holder_of_an_opted_in_lease_cannot_be_spoofed() {
    let f = Fixture::new("leader-spoof").await;
    let made = controller_pods(&f, &["p1", "p2"]).await;
    let p1 = common::identity::client_as_pod(&f.client, &f.ns, "ctl", &made[0]).await;
    let p2 = common::identity::client_as_pod(&f.client, &f.ns, "ctl", &made[1]).await;
    opted_in_lease(&f, "ctl").await;
    wait_holder_policy(&f, &p2, "ctl").await;
    let at = |s: u32| format!("2026-12-03T09:00:{s:02}.000000Z");

    elect(&p1, &f.ns, "ctl", "p1_1111", &at(1), 1).await.expect("p1 acquires");
    elect(&p1, &f.ns, "ctl", "p1_1111", &at(2), 1).await.expect("p1 renews");
    forbidden(elect(&p2, &f.ns, "ctl", "p1_9999", &at(3), 2).await, "Pod p2 may hold it only as p2");
    forbidden(elect(&p2, &f.ns, "ctl", "p1_1111", &at(3), 1).await, "Pod p2 may hold it only as p2");
    forbidden(elect(&p2, &f.ns, "ctl", "p10_1111", &at(3), 2).await, "not as p10_1111");
    forbidden(elect(&p2, &f.ns, "ctl", "", &at(3), 1).await, "released only by its holder p1_1111");
    let bare = common::identity::client_as(&format!("system:serviceaccount:{}:ctl", f.ns)).await;
    forbidden(elect(&bare, &f.ns, "ctl", "p2_2222", &at(3), 2).await, "carries no Pod identity");
    let unlabel = json!({"metadata": {"labels": {HOLDER_IDENTITY_LABEL: null}}});
    let leases = |c: &Client| Api::<LeaderLease>::namespaced(c.clone(), &f.ns);
    forbidden(leases(&p2).patch("ctl", &PatchParams::default(), &Patch::Merge(&unlabel)).await, "removed only by an admin");
    let stored = leases(&f.client).get("ctl").await.expect("lease");
    assert_eq!(stored.spec.and_then(|s| s.holder_identity).as_deref(), Some("p1_1111"));

    // client-go's release (ReleaseOnCancel), then another's acquisition, and a take-over after
    // expiry (the policy judges names, not time: client-go judges expiry).
    elect(&p1, &f.ns, "ctl", "", &at(4), 1).await.expect("p1 releases");
    elect(&p2, &f.ns, "ctl", "p2_2222", &at(5), 2).await.expect("p2 acquires");
    elect(&p1, &f.ns, "ctl", "p1_3333", &at(15), 3).await.expect("p1 takes over after p2's lease expired");
    // A Lease created by client-go is opted in by name only (chart value leaderLeases); one that
    // is not opted in is not judged.
    let free: LeaderLease = serde_json::from_value(json!({"metadata": {"name": "free"}, "spec": {"holderIdentity": "p1_x"}})).unwrap();
    common::accepted(leases(&p2).create(&PostParams::default(), &free).await);
    f.stop().await;
}

// --- An unmodified client-go controller (examples/leader-go), paused and resumed.

/// One replica of the example controller: the process, and the JSON lines it printed.
struct Replica {
    pod: String,
    child: std::process::Child,
    lines: std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>>,
}

impl Replica {
    fn start(bin: &std::path::Path, dir: &std::path::Path, pod: &str, ns: &str) -> Replica {
        use std::io::BufRead;
        let stderr = std::fs::OpenOptions::new().create(true).append(true).open(dir.join(format!("{pod}.log"))).expect("log file");
        let mut child = std::process::Command::new(bin)
            .env("KUBECONFIG", dir.join(format!("{pod}.kubeconfig")))
            .env("POD_NAME", pod)
            .env("NAMESPACE", ns)
            .env("LEASE", "ctl")
            .env("CONFIGMAP", "state")
            .env("RESOURCE", "w")
            .env("LEASE_DURATION", "2s")
            .env("WRITE_INTERVAL", "100ms")
            .stdout(std::process::Stdio::piped())
            .stderr(stderr)
            .spawn()
            .expect("start the example controller");
        let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let (out, sink) = (child.stdout.take().expect("stdout"), lines.clone());
        std::thread::spawn(move || {
            for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                if let Ok(value) = serde_json::from_str(&line) {
                    sink.lock().expect("lines").push(value);
                }
            }
        });
        Replica { pod: pod.to_string(), child, lines }
    }

    fn signal(&self, signal: &str) {
        let status = std::process::Command::new("kill").args([signal, &self.child.id().to_string()]).status().expect("kill");
        assert!(status.success(), "kill {signal} {}", self.child.id());
    }

    /// Writes this process sent that were refused because it no longer held the Lease.
    fn refused(&self) -> usize {
        let lines = self.lines.lock().expect("lines");
        lines.iter().filter(|l| l["event"] == "write" && l["accepted"] == false && l["reason"] == Reason::NotHolder.as_str()).count()
    }

    fn accepted(&self) -> usize {
        let lines = self.lines.lock().expect("lines");
        lines.iter().filter(|l| l["event"] == "write" && l["accepted"] == true).count()
    }
}

/// What the watch saw, by resourceVersion: Lease holders, and each guarded object's writer.
#[derive(Default)]
struct Seen {
    /// (resourceVersion, holderIdentity, leaseTransitions)
    holders: Vec<(u64, String, i32)>,
    /// (resourceVersion, object, writer identity)
    writes: Vec<(u64, String, String)>,
}

/// Watches the Lease, the ConfigMap and the Widget into `seen` until aborted.
fn record(f: &Fixture, widgets: &ApiResource, seen: std::sync::Arc<std::sync::Mutex<Seen>>) -> tokio::task::JoinHandle<()> {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let rv = |meta: &kube::api::ObjectMeta| meta.resource_version.as_deref().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    let by_name = |name: &str| watcher::Config::default().fields(&format!("metadata.name={name}"));
    let leases = watcher(Api::<LeaderLease>::namespaced(f.client.clone(), &f.ns), by_name("ctl")).applied_objects().map(move |l| {
        l.map(|l: LeaderLease| {
            let spec = l.spec.clone().unwrap_or_default();
            (rv(&l.metadata), None, spec.holder_identity.unwrap_or_default(), spec.lease_transitions.unwrap_or(0))
        })
    });
    let cms = watcher(Api::<ConfigMap>::namespaced(f.client.clone(), &f.ns), by_name("state")).applied_objects().map(move |c| {
        c.map(|c: ConfigMap| {
            let writer = c.data.as_ref().and_then(|d| d.get("writer")).cloned().unwrap_or_default();
            (rv(&c.metadata), Some("configmap/state".to_string()), writer, 0)
        })
    });
    let ws =
        watcher(Api::<DynamicObject>::namespaced_with(f.client.clone(), &f.ns, widgets), by_name("w")).applied_objects().map(move |w| {
            w.map(|w: DynamicObject| {
                let writer = w.data["status"]["writer"].as_str().unwrap_or_default().to_string();
                (rv(&w.metadata), Some("widget/w".to_string()), writer, 0)
            })
        });
    tokio::spawn(async move {
        let mut all = futures::stream::select_all([leases.boxed(), cms.boxed(), ws.boxed()]);
        while let Some(event) = all.next().await {
            let Ok((rv, object, who, transitions)) = event else { continue };
            let mut seen = seen.lock().expect("seen");
            match object {
                None => seen.holders.push((rv, who, transitions)),
                Some(object) if !who.is_empty() => seen.writes.push((rv, object, who)),
                Some(_) => {}
            }
        }
    })
}

/// The history checker's view: a grant per holder (token = leaseTransitions + 1, which
/// client-go raises whenever the holder changes), and each accepted write under the newest grant
/// its writer had at that resourceVersion. Returns the observations and the writes whose writer
/// held no grant the watch saw (none are expected).
fn observations(seen: &Seen) -> (Vec<kube_fence::history::Observation>, usize) {
    use kube_fence::history::Observation;
    use kube_fence::token::Token;
    let token = |transitions: i32| Token::new(u64::try_from(transitions).unwrap_or(0) + 1).expect("a token");
    let mut out = Vec::new();
    let mut holders = seen.holders.clone();
    holders.sort();
    for (rv, holder, transitions) in &holders {
        if !holder.is_empty() {
            out.push(Observation::Grant { lease: "ctl".into(), holder: holder.clone(), token: token(*transitions), resource_version: *rv });
        }
    }
    let mut unmatched = 0;
    for (rv, object, writer) in &seen.writes {
        match holders.iter().rev().find(|(at, holder, _)| at < rv && holder == writer) {
            Some((_, _, transitions)) => out.push(Observation::Write {
                object: object.clone(),
                lease: "ctl".into(),
                token: token(*transitions),
                resource_version: *rv,
            }),
            None => unmatched += 1,
        }
    }
    (out, unmatched)
}

/// The holder identity of Lease `ctl` now, and whether `writer` is the last writer of both
/// guarded objects.
async fn holder_now(f: &Fixture) -> String {
    let lease = Api::<LeaderLease>::namespaced(f.client.clone(), &f.ns).get("ctl").await.expect("lease");
    lease.spec.and_then(|s| s.holder_identity).unwrap_or_default()
}

async fn both_written_by(f: &Fixture, widgets: &ApiResource, writer: &str) -> bool {
    let cm = Api::<ConfigMap>::namespaced(f.client.clone(), &f.ns).get("state").await.expect("configmap");
    let w = Api::<DynamicObject>::namespaced_with(f.client.clone(), &f.ns, widgets).get("w").await.expect("widget");
    cm.data.unwrap_or_default().get("writer").map(String::as_str) == Some(writer) && w.data["status"]["writer"] == writer
}

async fn until(what: &str, limit: Duration, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done().await {
        assert!(Instant::now() < deadline, "{what} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Stale-but-honest writer, end to end: two replicas of an unmodified client-go
/// leader-elected controller (examples/leader-go, built from the Go module proxy) write a
/// guarded ConfigMap and a guarded Widget's status. Each cycle SIGSTOPs the leader past its
/// Lease; the other replica takes over and writes; the old leader gets SIGCONT and sends its
/// pending writes, which are refused (409 NotHolder); it then loses leadership, exits and is
/// restarted. A watch records the Lease's holders and every accepted write, and the history
/// checker finds no stale write accepted. Cycles: LEADER_GO_CYCLES (default 3).
#[tokio::test]
async fn a_paused_client_go_leader_is_fenced_when_it_resumes() {
    use kube_fence::admission::decision::{DEFAULT_EXEMPT, Exemptions};
    use kube_fence::admission::local::LocalOptions;
    let cycles: usize = std::env::var("LEADER_GO_CYCLES").ok().and_then(|c| c.parse().ok()).unwrap_or(3);
    let built = tokio::task::spawn_blocking(|| {
        std::process::Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/hack/build-leader-go.sh")).output().expect("build leader-go")
    })
    .await
    .expect("build thread");
    assert!(built.status.success(), "hack/build-leader-go.sh: {}", String::from_utf8_lossy(&built.stderr));
    let bin = std::path::PathBuf::from(String::from_utf8_lossy(&built.stdout).trim().to_string());

    let client = common::client().await;
    let ns = common::namespace(&client, "leader-go").await;
    let mut options = LocalOptions::new(format!("kf-test-{ns}"));
    options.only_namespaces = Some(vec![ns.clone()]);
    options.exempt = Exemptions::new(DEFAULT_EXEMPT.iter().map(|u| u.to_string()).chain([SETUP.to_string()]));
    let f = Fixture::with_options(client, ns, options).await;
    let widgets = install_widget_crd(&f.client).await;
    let pods = controller_pods(&f, &["p1", "p2"]).await;
    opted_in_lease(&f, "ctl").await;
    let setup = common::identity::client_as(SETUP).await;
    let labelled = json!({LEADER_LEASE_LABEL: "ctl"});
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "state", "labels": labelled}})).unwrap();
    common::accepted(Api::<ConfigMap>::namespaced(setup.clone(), &f.ns).create(&PostParams::default(), &cm).await);
    let widget: DynamicObject = serde_json::from_value(json!({"apiVersion": "example.kubefence.io/v1", "kind": "Widget",
        "metadata": {"name": "w", "labels": labelled}, "spec": {}}))
    .unwrap();
    common::accepted(Api::<DynamicObject>::namespaced_with(setup, &f.ns, &widgets).create(&PostParams::default(), &widget).await);

    let dir = tempfile::tempdir().expect("temp dir");
    for pod in &pods {
        let token = common::identity::pod_token(&f.client, &f.ns, "ctl", pod).await;
        let kubeconfig = common::identity::kubeconfig_with_token(&token).await;
        let yaml = serde_yaml::to_string(&kubeconfig).expect("kubeconfig yaml");
        std::fs::write(dir.path().join(format!("{}.kubeconfig", pod.name_any())), yaml).expect("write kubeconfig");
    }
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Seen::default()));
    let recorder = record(&f, &widgets, seen.clone());
    let mut replicas: Vec<Replica> = ["p1", "p2"].iter().map(|pod| Replica::start(&bin, dir.path(), pod, &f.ns)).collect();

    let started = Instant::now();
    let (mut refused, mut accepted) = (Vec::new(), 0);
    for cycle in 0..cycles {
        // A leader that has written both objects.
        let mut leader = String::new();
        until(&format!("cycle {cycle}: a leader writes"), Duration::from_secs(60), async || {
            leader = holder_now(&f).await;
            !leader.is_empty() && both_written_by(&f, &widgets, &leader).await
        })
        .await;
        let pod = leader.split('_').next().unwrap_or_default().to_string();
        let old = replicas.iter().position(|r| r.pod == pod).unwrap_or_else(|| panic!("the holder {leader} is one of ours"));
        replicas[old].signal("-STOP");
        // The other replica takes over once the Lease expires, and writes.
        let mut successor = String::new();
        until(&format!("cycle {cycle}: the other replica takes over and writes"), Duration::from_secs(60), async || {
            successor = holder_now(&f).await;
            !successor.is_empty() && successor != leader && both_written_by(&f, &widgets, &successor).await
        })
        .await;
        assert!(!successor.starts_with(&format!("{pod}_")), "the stopped replica cannot have renewed");
        replicas[old].signal("-CONT");
        // It sends its pending writes, learns it lost the Lease, and exits (its Pod restarts it).
        let exited = {
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                if let Some(status) = replicas[old].child.try_wait().expect("wait") {
                    break status;
                }
                assert!(Instant::now() < deadline, "cycle {cycle}: the resumed leader did not stop within 60 s");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        };
        assert!(exited.success(), "cycle {cycle}: the resumed leader exited with {exited}");
        refused.push(replicas[old].refused());
        accepted += replicas[old].accepted();
        replicas[old] = Replica::start(&bin, dir.path(), &pod, &f.ns);
    }
    let took = started.elapsed();
    for mut replica in replicas {
        accepted += replica.accepted();
        replica.signal("-TERM");
        let _ = replica.child.wait();
    }
    // Let the watch catch up with the last writes.
    tokio::time::sleep(Duration::from_secs(1)).await;
    recorder.abort();
    let seen = std::mem::take(&mut *seen.lock().expect("seen"));
    let (history, unmatched) = observations(&seen);
    // Every write under one grant carries that grant's token: equal tokens are the same leader.
    let violations = kube_fence::history::check(&history, |_| true);
    let with_refusals = refused.iter().filter(|r| **r > 0).count();
    println!(
        "leader-go: {cycles} cycles in {took:.1?} ({:.2?} per cycle); {accepted} writes accepted, {} watched; stale writes refused per cycle: {refused:?} ({with_refusals}/{cycles} cycles had a pending write refused); violations: {}",
        took / cycles.max(1) as u32,
        seen.writes.len(),
        violations.len()
    );
    assert!(violations.is_empty(), "stale writes accepted: {}", violations.iter().map(|v| v.to_string()).collect::<Vec<_>>().join("; "));
    assert_eq!(unmatched, 0, "every accepted write was made by a holder the watch saw");
    assert!(seen.writes.len() >= 2 * cycles, "each cycle's writes were watched");
    assert!(with_refusals > 0, "a resumed leader's pending write was refused in some cycle");
    f.stop().await;
}
