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
use kube::api::{Api, DeleteParams, DynamicObject, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use kube_fence_api::denial::{Denial, Reason};
use kube_fence_api::names::{HOLDER_IDENTITY_LABEL, LEADER_LEASE_LABEL};
use serde_json::json;

use super::{Fixture, common};
use common::leader;

/// The identity that sets up guarded objects in the end-to-end test, exempt there (an operator's
/// admin would be).
const SETUP: &str = "leader-go-setup";

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

/// What client-go's LeaseLock writes when it acquires, renews or takes over: the whole spec.
pub async fn elect(
    client: &Client,
    ns: &str,
    lease: &str,
    holder: &str,
    renew: &str,
    transitions: i32,
) -> Result<LeaderLease, kube::Error> {
    let leases: Api<LeaderLease> = Api::namespaced(client.clone(), ns);
    let mut current = leases.get(lease).await?;
    current.spec = Some(
        serde_json::from_value(json!({"holderIdentity": holder, "leaseDurationSeconds": 4, "acquireTime": "2026-12-03T09:00:00.000000Z",
            "renewTime": renew, "leaseTransitions": transitions}))
        .unwrap(),
    );
    leases.replace(lease, &PostParams::default(), &current).await
}

pub fn not_holder(result: Result<impl std::fmt::Debug, kube::Error>, holder: &str, requester: &str) {
    let status = common::rejected(result);
    let denial = Denial::from_status(&status).unwrap_or_else(|| panic!("a kube-fence denial, got {status:?}"));
    assert_eq!((denial.code, denial.reason), (409, Reason::NotHolder), "{status:?}");
    assert_eq!(denial.holder.as_deref(), Some(holder));
    assert_eq!(denial.requester.as_deref(), Some(requester));
    assert!(status.message.contains(holder) && status.message.contains(requester), "{}", status.message);
}

pub fn forbidden(result: Result<LeaderLease, kube::Error>, says: &str) {
    let status = common::rejected(result);
    assert_eq!(status.code, 403, "{status:?}");
    assert!(status.message.contains(says), "{says:?} not in {}", status.message);
}

/// Waits until the holder policy judges writes to opted-in Leases in the test's namespace (a
/// policy takes effect a moment after it is created): a spoofed claim is refused.
pub async fn wait_holder_policy(f: &Fixture, spoofer: &Client, lease: &str) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while elect(spoofer, &f.ns, lease, "nobody-of-mine_x", "2026-12-03T09:00:00.000000Z", 0).await.is_ok() {
        assert!(Instant::now() < deadline, "a claim under another Pod's name kept being admitted");
        elect(&f.client, &f.ns, lease, "", "2026-12-03T09:00:00.000000Z", 0).await.expect("admin clears the spoofed claim");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Pods p1 and p2 of the controller's ServiceAccount, a client for each (its Pod-bound token),
/// and the Lease `ctl` opted in, once the holder policy judges it.
async fn opted_in_pods(f: &Fixture) -> (Client, Client) {
    let made = controller_pods(f, &["p1", "p2"]).await;
    let p1 = common::identity::client_as_pod(&f.client, &f.ns, "ctl", &made[0]).await;
    let p2 = common::identity::client_as_pod(&f.client, &f.ns, "ctl", &made[1]).await;
    leader::opted_in_lease(&f.client, &f.ns, leader::LEASE).await;
    wait_holder_policy(f, &p2, "ctl").await;
    (p1, p2)
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
    options.webhook.scope.only_namespaces = Some(vec![ns.clone()]);
    options.webhook.leader_identity = ":".parse().expect("a separator");
    let f = Fixture::with_options(client, ns, options).await;
    let (p1, p2) = opted_in_pods(&f).await;
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
    let widgets = leader::install_widget_crd(&f.client).await;
    let (p1, p2) = opted_in_pods(&f).await;
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

/// Who let each write through, in the API server's audit log: the holder's admitted writes carry
/// the Lease, the holder and the Lease's resourceVersion the webhook read (the version the
/// holder's claim made); the refused write of the Pod that lost the Lease carries none.
/// Stale-but-honest writer: p1 writes again after p2 took the Lease over.
#[tokio::test]
async fn the_audit_log_names_the_holder_that_let_each_write_through() {
    let log = common::audit_log().await;
    let f = Fixture::new("leader-audit").await;
    let (p1, p2) = opted_in_pods(&f).await;
    let version = |lease: LeaderLease| lease.metadata.resource_version.expect("a resourceVersion");
    let first = version(elect(&p1, &f.ns, "ctl", "p1_1111", "2026-12-03T09:00:01.000000Z", 1).await.expect("p1 acquires"));
    let cms = |c: &Client| Api::<ConfigMap>::namespaced(c.clone(), &f.ns);
    let cm: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "audited", "labels": {LEADER_LEASE_LABEL: "ctl"}}, "data": {"writer": "p1"}}))
            .unwrap();
    common::accepted(cms(&p1).create(&PostParams::default(), &cm).await);
    let second = version(elect(&p2, &f.ns, "ctl", "p2_2222", "2026-12-03T09:00:10.000000Z", 2).await.expect("p2 takes over"));
    let pp = PatchParams::default();
    common::accepted(cms(&p2).patch("audited", &pp, &Patch::Merge(&json!({"data": {"writer": "p2"}}))).await);
    not_holder(cms(&p1).patch("audited", &pp, &Patch::Merge(&json!({"data": {"writer": "p1-stale"}}))).await, "p2_2222", "p1");

    let events = common::audit_events(&log, &f.ns, "audited", |events| events.len() >= 3).await;
    let lease = format!("{}/ctl", f.ns);
    let judged = |e: &serde_json::Value| {
        ["lease", "holder", "lease-resource-version"].map(|key| common::kube_fence_annotation(e, key).map(str::to_string))
    };
    let said: Vec<_> =
        events.iter().map(|e| (e["verb"].as_str().unwrap_or_default(), e["responseStatus"]["code"].as_u64(), judged(e))).collect();
    let named = |holder: &str, version: &str| [Some(lease.clone()), Some(holder.to_string()), Some(version.to_string())];
    assert_eq!(
        said,
        vec![
            ("create", Some(201), named("p1_1111", &first)),
            ("patch", Some(200), named("p2_2222", &second)),
            ("patch", Some(409), [None, None, None]),
        ]
    );
    f.stop().await;
}

/// Worker with ordinary RBAC (any Pod of the controller's ServiceAccount can update its Lease):
/// on an opted-in Lease, naming another Pod as holder, renewing another's hold, releasing it or
/// dropping the opt-in label is refused (403) by the API server itself; a token bound to no Pod
/// names nobody. client-go's own acquire, renew, release and take-over are admitted.
#[tokio::test]
async fn the_holder_of_an_opted_in_lease_cannot_be_spoofed() {
    let f = Fixture::new("leader-spoof").await;
    let (p1, p2) = opted_in_pods(&f).await;
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
    fn start(bin: &std::path::Path, dir: &std::path::Path, pod: &str, ns: &str, env: &[(&str, &str)]) -> Replica {
        use std::io::BufRead;
        let stderr = std::fs::OpenOptions::new().create(true).append(true).open(dir.join(format!("{pod}.log"))).expect("log file");
        let mut child = std::process::Command::new(bin)
            .env("KUBECONFIG", dir.join(format!("{pod}.kubeconfig")))
            .env("POD_NAME", pod)
            .env("NAMESPACE", ns)
            .env("LEASE", leader::LEASE)
            .env("CONFIGMAP", leader::CONFIGMAP)
            .env("RESOURCE", leader::WIDGET)
            .env("LEASE_DURATION", "2s")
            .env("WRITE_INTERVAL", "100ms")
            .envs(env.iter().copied())
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

    /// Signals the replica and waits until the signal took effect (what [`leader::Replicas`]
    /// promises: the cycle's next step must not race the kernel's delivery).
    fn signal(&self, signal: &str) {
        common::signal_and_wait(self.child.id(), signal);
    }
}

/// The replicas as processes of this machine: signalled by their process id.
struct Processes(Vec<Replica>);

impl Processes {
    fn replica(&self, pod: &str) -> &Replica {
        self.0.iter().find(|r| r.pod == pod).unwrap_or_else(|| panic!("the holder's Pod {pod} is one of ours"))
    }
}

impl leader::Replicas for Processes {
    fn signal(&mut self, pod: &str, signal: &str) {
        self.replica(pod).signal(signal);
    }

    fn with_lines<R>(&self, pod: &str, f: impl FnOnce(&[serde_json::Value]) -> R) -> R {
        f(&self.replica(pod).lines.lock().expect("lines"))
    }
}

/// How the example controller runs in a pause test: what it writes besides its two labelled
/// objects, and whether its ServiceAccount is fenced (a FencedController on its Lease).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Writes {
    /// The labelled ConfigMap and Widget status only.
    Labelled,
    /// Also a new unlabelled ConfigMap per write and a patch of its Namespace (cluster-scoped),
    /// with the writer fenced.
    EverythingFenced,
    /// The same writes without the FencedController: the unlabelled ones are not fenced.
    EverythingUnfenced,
}

/// The example controller's two objects bound to its Lease (the ConfigMap and the Widget, created
/// by the exempt setup user), and a directory with a kubeconfig per Pod of `pods` carrying that
/// Pod's bound token (`<pod>.kubeconfig`, what [`Replica::start`] runs a replica with).
async fn labelled_objects_and_kubeconfigs(f: &Fixture, widgets: &kube::api::ApiResource, pods: &[Pod]) -> tempfile::TempDir {
    let setup = common::identity::client_as(SETUP).await;
    let labelled = json!({LEADER_LEASE_LABEL: leader::LEASE});
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": leader::CONFIGMAP, "labels": labelled}})).unwrap();
    common::accepted(Api::<ConfigMap>::namespaced(setup.clone(), &f.ns).create(&PostParams::default(), &cm).await);
    let widget: DynamicObject = serde_json::from_value(json!({"apiVersion": "example.kubefence.io/v1", "kind": "Widget",
        "metadata": {"name": leader::WIDGET, "labels": labelled}, "spec": {}}))
    .unwrap();
    common::accepted(Api::<DynamicObject>::namespaced_with(setup, &f.ns, widgets).create(&PostParams::default(), &widget).await);
    let dir = tempfile::tempdir().expect("temp dir");
    for pod in pods {
        let token = common::identity::pod_token(&f.client, &f.ns, "ctl", pod).await;
        let kubeconfig = common::identity::kubeconfig_with_token(&token).await;
        let yaml = serde_saphyr::to_string(&kubeconfig).expect("kubeconfig yaml");
        std::fs::write(dir.path().join(format!("{}.kubeconfig", pod.name_any())), yaml).expect("write kubeconfig");
    }
    dir
}

/// Runs two replicas of examples/leader-go as processes authenticated with their Pods' bound
/// tokens through `cycles` pause cycles, and returns what the cycles and the watch found.
async fn leader_go_cycles(test: &str, writes: Writes, cycles: usize) -> (leader::Run, leader::Seen, usize) {
    use kube_fence::admission::judge::exemptions::{DEFAULT_EXEMPT, Exemptions};
    use kube_fence::admission::local::LocalOptions;
    let built = tokio::task::spawn_blocking(|| {
        std::process::Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/hack/build-leader-go.sh")).output().expect("build leader-go")
    })
    .await
    .expect("build thread");
    assert!(built.status.success(), "hack/build-leader-go.sh: {}", String::from_utf8_lossy(&built.stderr));
    let bin = std::path::PathBuf::from(String::from_utf8_lossy(&built.stdout).trim().to_string());

    let client = common::client().await;
    let ns = common::namespace(&client, test).await;
    let mut options = LocalOptions::new(format!("kf-test-{ns}"));
    options.webhook.scope.only_namespaces = Some(vec![ns.clone()]);
    options.webhook.exempt = Exemptions::new(DEFAULT_EXEMPT.iter().map(|u| u.to_string()).chain([SETUP.to_string()]));
    let f = Fixture::with_options(client, ns, options).await;
    let widgets = leader::install_widget_crd(&f.client).await;
    let pods = controller_pods(&f, &["p1", "p2"]).await;
    leader::may_patch_namespace(&f.client, &f.ns, "ctl").await;
    leader::opted_in_lease(&f.client, &f.ns, leader::LEASE).await;
    if writes == Writes::EverythingFenced {
        leader::fence_controller(&f.client, &f.ns, leader::LEASE, "ctl", kube_fence_api::FenceMode::Enforce).await;
        let routed = kube_fence::admission::registration::routing::configuration_name(&format!("kf-test-{}", f.ns));
        let configurations = Api::<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration>::all(f.client.clone());
        leader::until("the writer webhook is registered", Duration::from_secs(30), async || {
            configurations.get_opt(&routed).await.ok().flatten().and_then(|c| c.webhooks).is_some_and(|w| w.len() == 1)
        })
        .await;
    }
    let dir = labelled_objects_and_kubeconfigs(&f, &widgets, &pods).await;
    let seen = std::sync::Arc::new(std::sync::Mutex::new(leader::Seen::default()));
    let recorder = leader::record(&f.client, &f.ns, &widgets, seen.clone());
    let env: &[(&str, &str)] = if writes == Writes::Labelled { &[] } else { &[("CREATE_OBJECTS", "1"), ("PATCH_NAMESPACE", "1")] };
    let mut replicas = Processes(["p1", "p2"].iter().map(|pod| Replica::start(&bin, dir.path(), pod, &f.ns, env)).collect());

    let run = leader::pause_cycles(&f.client, &f.ns, &widgets, cycles, &mut replicas).await;
    let mut accepted = 0;
    for mut replica in replicas.0 {
        replica.signal("-TERM");
        let exited = replica.child.wait().expect("wait");
        assert!(exited.success(), "{} exited with {exited} on SIGTERM", replica.pod);
        accepted += leader::accepted(&replica.lines.lock().expect("lines"));
    }
    // The watch catches up with the last writes.
    leader::catch_up(&seen, accepted, Duration::from_secs(30)).await;
    recorder.abort();
    let seen = std::mem::take(&mut *seen.lock().expect("seen"));
    f.stop().await;
    (run, seen, accepted)
}

/// Stale-but-honest writer, end to end: two replicas of an unmodified client-go
/// leader-elected controller (examples/leader-go, built from the Go module proxy), as processes
/// authenticated with their Pods' bound tokens, write a guarded ConfigMap and a guarded Widget's
/// status. Each cycle SIGSTOPs the leader past its Lease; the other replica takes over and
/// writes; the old leader gets SIGCONT and sends its pending writes, which are refused (409
/// NotHolder); it then stops leading and campaigns again. A watch records the Lease's holders and
/// every accepted write, and the history checker finds no stale write accepted. Cycles:
/// LEADER_GO_CYCLES (default 3). The same cycle with Pods on a real node: tests/e2e/leader.rs.
#[tokio::test]
async fn a_paused_client_go_leader_is_fenced_when_it_resumes() {
    let cycles: usize = std::env::var("LEADER_GO_CYCLES").ok().and_then(|c| c.parse().ok()).unwrap_or(3);
    let (run, seen, accepted) = leader_go_cycles("leader-go", Writes::Labelled, cycles).await;
    run.check("leader-go", &seen, accepted);
}

/// Stale-but-honest writer, on everything it writes: the same controller also creates a new
/// unlabelled ConfigMap per write and patches its Namespace (cluster-scoped), and its
/// ServiceAccount is fenced by a FencedController on its Lease — no label on those objects.
/// The history checker finds no stale write on any of them. Cycles: LEADER_GO_CYCLES (default 3).
#[tokio::test]
async fn a_paused_client_go_leader_is_fenced_on_everything_it_writes_once_it_is_fenced() {
    let cycles: usize = std::env::var("LEADER_GO_CYCLES").ok().and_then(|c| c.parse().ok()).unwrap_or(3);
    let (run, seen, accepted) = leader_go_cycles("leader-go-writers", Writes::EverythingFenced, cycles).await;
    assert!(seen.writes.iter().any(|(_, o, _)| o == leader::MADE), "the watch saw the created ConfigMaps");
    assert!(seen.writes.iter().any(|(_, o, _)| o.starts_with("namespace/")), "the watch saw writes of the Namespace");
    run.check("leader-go writers", &seen, accepted);
}

/// The same run without the FencedController shows what it closes (the test above can fail): the resumed
/// leader's pending creates and Namespace patches land after its successor's writes — stale writes
/// the history checker finds — while the labelled objects stay fenced.
#[tokio::test]
async fn without_a_fence_a_paused_leaders_unlabelled_writes_land_stale() {
    let (_run, seen, _) = leader_go_cycles("leader-go-unfenced", Writes::EverythingUnfenced, 3).await;
    let (violations, _) = leader::violations(&seen);
    let on = |v: &kube_fence_test_support::history::Violation| match v {
        kube_fence_test_support::history::Violation::StaleWriteAccepted { object, .. } => object.clone(),
        other => format!("{other}"),
    };
    let objects: std::collections::BTreeSet<String> = violations.iter().map(on).collect();
    println!("leader-go without the opt-in: {} stale writes accepted, on {objects:?}", violations.len());
    assert!(!violations.is_empty(), "without the opt-in some stale unlabelled write landed");
    assert!(
        objects.iter().all(|o| o == leader::MADE || o.starts_with("namespace/")),
        "only unlabelled objects took stale writes: {objects:?}"
    );
}

/// Worker with ordinary RBAC: a Pod's identity includes its namespace. Pod `p1` of namespace
/// `<ns>-other`, whose ServiceAccount is bound to the same Roles in the test's namespace as the
/// controller's, is not Pod `p1` of the test's namespace: it cannot name itself holder of an
/// opted-in Lease there (holder policy), write an object bound to that Lease (leader webhook),
/// nor write a holder-only object of a kube-fence Lease held by `p1` (token webhook).
#[tokio::test]
async fn a_pod_of_another_namespace_is_not_the_pod_of_the_same_name_here() {
    use k8s_openapi::api::rbac::v1::RoleBinding;
    let f = Fixture::new("pod-namespace").await;
    let (p1, _p2) = opted_in_pods(&f).await;
    let other = common::namespace(&f.client, "pod-namespace-other").await;
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "ctl"}})).unwrap();
    Api::<ServiceAccount>::namespaced(f.client.clone(), &other).create(&PostParams::default(), &sa).await.expect("service account");
    let twin_user = format!("system:serviceaccount:{other}:ctl");
    common::identity::grant_worker_rbac(&f.client, &f.ns, &twin_user).await;
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "leader-elected-twin", "namespace": f.ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "leader-elected"},
        "subjects": [{"kind": "ServiceAccount", "name": "ctl", "namespace": other}],
    }))
    .unwrap();
    Api::<RoleBinding>::namespaced(f.client.clone(), &f.ns).create(&PostParams::default(), &binding).await.expect("binding");
    let twin_pod = common::identity::pods_of(&f.client, &other, "ctl", &["p1"]).await;
    let twin = common::identity::client_as_pod(&f.client, &other, "ctl", &twin_pod[0]).await;
    common::identity::wait_authorized(&twin, &f.ns, "coordination.k8s.io", "leases", "update").await;

    // The holder policy: the twin cannot claim the Lease, not even as `p1_…`.
    forbidden(
        elect(&twin, &f.ns, "ctl", "p1_evil", "2026-12-03T09:00:01.000000Z", 1).await,
        &format!("the request carries no Pod identity of namespace {}", f.ns),
    );
    elect(&p1, &f.ns, "ctl", "p1_1111", "2026-12-03T09:00:01.000000Z", 1).await.expect("p1 acquires");

    // The leader webhook: the twin is not the holder of the Lease its object is bound to.
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "state", "labels": {LEADER_LEASE_LABEL: "ctl"}}})).unwrap();
    common::accepted(Api::<ConfigMap>::namespaced(p1.clone(), &f.ns).create(&PostParams::default(), &cm).await);
    let written = Api::<ConfigMap>::namespaced(twin.clone(), &f.ns)
        .patch("state", &PatchParams::default(), &Patch::Merge(json!({"data": {"writer": "twin"}})))
        .await;
    let status = common::rejected(written);
    assert_eq!((status.code, status.reason.as_str()), (403, Reason::NotHolder.as_str()), "{status:?}");
    assert!(status.message.contains(&format!("Pod {other}/p1 is not in the Lease's namespace {}", f.ns)), "{}", status.message);

    // The token webhook's holder-only objects: lease `work` (spec.identity Pod) is held by `p1`.
    let lease = serde_json::from_value(json!({"apiVersion": "kubefence.io/v1alpha1", "kind": "Lease",
        "metadata": {"name": "work"}, "spec": {"identity": "Pod"}}))
    .unwrap();
    f.leases().create(&PostParams::default(), &lease).await.expect("lease");
    f.grant("work", "p1", 5).await;
    let guarded: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "holder-only",
        "labels": {"kubefence.io/lease": "work", "kubefence.io/writer": "holder"}, "annotations": {"kubefence.io/token": "5"}}}))
    .unwrap();
    let made = common::accepted(Api::<ConfigMap>::namespaced(p1.clone(), &f.ns).create(&PostParams::default(), &guarded).await);
    let dp = DeleteParams {
        preconditions: Some(kube::api::Preconditions { resource_version: made.resource_version(), uid: None }),
        ..DeleteParams::default()
    };
    let deleted = Api::<ConfigMap>::namespaced(twin.clone(), &f.ns).delete("holder-only", &dp).await;
    let status = common::rejected(deleted);
    assert_eq!((status.code, status.reason.as_str()), (409, Reason::NotHolder.as_str()), "{status:?}");
    assert!(status.message.contains(&format!("Pod {other}/p1, which is not in the lease's namespace {}", f.ns)), "{}", status.message);
    f.stop().await;
}

/// Audit before enforce (`--holder-fences Audit`, chart value `webhook.holderFences`).
/// Stale-but-honest writer: p1 lost the Lease to p2 and writes again. Audited, its write lands;
/// the API server hands p1 the webhook's warning, which says what enforcing would have said; and
/// the webhook counts it as warned `NotHolder`. The holder's own write carries no warning.
/// (Enforced, the same write is refused: `only_the_pod_holding_the_leader_lease_writes`.)
#[tokio::test]
async fn in_audit_mode_a_stale_leaders_write_lands_with_a_warning_that_says_why() {
    let client = common::client().await;
    let ns = common::namespace(&client, "leader-audit").await;
    let mut options = kube_fence::admission::local::LocalOptions::new(format!("kf-test-{ns}"));
    options.webhook.scope.only_namespaces = Some(vec![ns.clone()]);
    options.webhook.holder_fences = kube_fence::admission::judge::preamble::Mode::Audit;
    let f = Fixture::with_options(client, ns, options).await;
    let (p1, p2) = opted_in_pods(&f).await;
    elect(&p2, &f.ns, "ctl", "p2_2222", "2026-12-03T09:00:10.000000Z", 2).await.expect("p2 holds the Lease");
    let cm: ConfigMap =
        serde_json::from_value(json!({"metadata": {"name": "state", "labels": {LEADER_LEASE_LABEL: "ctl"}}, "data": {"writer": "p2"}}))
            .unwrap();
    common::accepted(Api::<ConfigMap>::namespaced(p2.clone(), &f.ns).create(&PostParams::default(), &cm).await);

    // The write as client-go sends it, read with its response headers (where warnings travel).
    let patch = |client: &Client, writer: &str| {
        let body = Patch::Merge(json!({"data": {"writer": writer}}));
        let request = kube::core::Request::new(format!("/api/v1/namespaces/{}/configmaps", f.ns))
            .patch("state", &PatchParams::default(), &body)
            .expect("a patch request");
        let client = client.clone();
        async move {
            let response = client.send(request.map(kube::client::Body::from)).await.expect("the API server answers");
            let warnings: Vec<String> =
                response.headers().get_all("warning").iter().map(|v| v.to_str().unwrap_or_default().to_string()).collect();
            (response.status(), warnings)
        }
    };
    let (status, warnings) = patch(&p1, "p1-stale").await;
    assert!(status.is_success(), "audited, the stale write is admitted: {status}");
    assert!(
        warnings.iter().any(|w| w.contains("kube-fence (audit mode) would deny this write") && w.contains("p2_2222")),
        "p1 is told what enforcing would have said: {warnings:?}"
    );
    let stored = Api::<ConfigMap>::namespaced(f.client.clone(), &f.ns).get("state").await.expect("the ConfigMap");
    assert_eq!(stored.data.unwrap_or_default().get("writer").map(String::as_str), Some("p1-stale"), "audit mode lets it land");
    let (status, warnings) = patch(&p2, "p2-again").await;
    assert!(status.is_success() && warnings.is_empty(), "the holder writes without a warning: {status} {warnings:?}");

    let metrics = kube_fence::telemetry::render(&f.registry);
    assert!(
        metrics.lines().any(|l| l.starts_with("kube_fence_webhook_decisions_total")
            && l.contains("verdict=\"warned\"")
            && l.contains("reason=\"NotHolder\"")
            && !l.ends_with(" 0")),
        "counted as warned NotHolder:\n{metrics}"
    );
    f.stop().await;
}

/// Runs `program` with `args` (kubectl from the control plane's binaries, or this crate's
/// `kube-fence`) as the cluster admin of `kubeconfig`, with `stdin`; its stdout, or a panic with
/// its stderr.
fn as_admin(program: &str, args: &[&str], stdin: Option<&str>) -> String {
    use std::io::Write;
    let mut child = std::process::Command::new(program)
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    if let Some(input) = stdin {
        child.stdin.take().expect("stdin").write_all(input.as_bytes()).expect("write stdin");
    }
    drop(child.stdin.take());
    let out = child.wait_with_output().expect("wait");
    assert!(out.status.success(), "{program} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The row of `kube-fence status -n <ns> -o json` for FencedController `name`.
fn fence_row(ns: &str, name: &str) -> Option<serde_json::Value> {
    let out = as_admin(env!("CARGO_BIN_EXE_kube-fence"), &["status", "-n", ns, "-o", "json"], None);
    let rows: Vec<serde_json::Value> = serde_json::from_str(&out).unwrap_or_else(|e| panic!("status -o json: {e}: {out}"));
    rows.into_iter().find(|r| r["kind"] == "FencedController" && r["name"] == name)
}

/// Tried as a new user would, with `kubectl` and `kube-fence status` only: an unmodified client-go
/// controller (examples/leader-go, two replicas as processes with their Pods' bound tokens) runs
/// first, its Lease created by client-go. A cluster admin named in no kube-fence setting fences
/// it in Audit (`kubectl apply`): `kube-fence status` shows it Ready, Auditing, held by the
/// leader's Pod; a paused leader's stale writes land and are counted as warned. The admin
/// switches to Enforce (`kubectl patch`): the next paused leader's pending writes are refused
/// (409), counted as refused, and the history checker finds no stale write while enforced; the
/// leader keeps working. The admin deletes the fence (`kubectl delete`): a follower's write lands
/// again. Threat case: a stale-but-honest replica (a leader paused past its Lease).
#[tokio::test]
async fn a_running_client_go_controller_is_fenced_in_audit_then_enforced_then_released_with_kubectl() {
    use kube_fence::admission::local::LocalOptions;
    let built = tokio::task::spawn_blocking(|| {
        std::process::Command::new(concat!(env!("CARGO_MANIFEST_DIR"), "/hack/build-leader-go.sh")).output().expect("build leader-go")
    })
    .await
    .expect("build thread");
    assert!(built.status.success(), "hack/build-leader-go.sh: {}", String::from_utf8_lossy(&built.stderr));
    let bin = std::path::PathBuf::from(String::from_utf8_lossy(&built.stdout).trim().to_string());

    let client = common::client().await;
    let ns = common::namespace(&client, "adopt").await;
    let mut options = LocalOptions::new(format!("kf-test-{ns}"));
    options.webhook.scope.only_namespaces = Some(vec![ns.clone()]);
    options.webhook.exempt = kube_fence::admission::judge::exemptions::Exemptions::new(
        kube_fence::admission::judge::exemptions::DEFAULT_EXEMPT.iter().map(|u| u.to_string()).chain([SETUP.to_string()]),
    );
    let configuration = options.webhook.scope.configuration_name.clone();
    let f = Fixture::with_options(client, ns, options).await;
    // kube-fence's status controller, as `kube-fence run` runs it beside the lease controller.
    let stop = tokio_util::sync::CancellationToken::new();
    let status = kube_fence::fenced::controller::StatusOptions {
        namespace: Some(f.ns.clone()),
        configuration,
        identity: kube_fence::admission::judge::identity::IdentityRule::default(),
        instance: "adopt-test".into(),
    };
    let controller = tokio::spawn(kube_fence::fenced::controller::run(
        f.client.clone(),
        status,
        kube_fence::fenced::controller::Metrics::default(),
        stop.clone(),
    ));
    let widgets = leader::install_widget_crd(&f.client).await;
    let pods = controller_pods(&f, &["p1", "p2"]).await;
    leader::may_patch_namespace(&f.client, &f.ns, "ctl").await;
    let dir = labelled_objects_and_kubeconfigs(&f, &widgets, &pods).await;

    // The controller runs first: client-go creates its Lease, with no kube-fence label.
    let env = [("CREATE_OBJECTS", "1"), ("PATCH_NAMESPACE", "1")];
    let mut replicas = Processes(["p1", "p2"].iter().map(|pod| Replica::start(&bin, dir.path(), pod, &f.ns, &env)).collect());
    let leases = Api::<LeaderLease>::namespaced(f.client.clone(), &f.ns);
    leader::until("client-go elects a leader on a Lease it created", Duration::from_secs(60), async || {
        leases
            .get_opt(leader::LEASE)
            .await
            .ok()
            .flatten()
            .and_then(|l| l.spec)
            .and_then(|s| s.holder_identity)
            .is_some_and(|h| !h.is_empty())
    })
    .await;
    let lease = Api::<LeaderLease>::namespaced(f.client.clone(), &f.ns).get(leader::LEASE).await.expect("the Lease");
    assert!(lease.metadata.labels.unwrap_or_default().is_empty(), "client-go made the Lease, unlabelled");

    // Audit, with kubectl.
    let kubectl = "kubectl";
    let fence = format!(
        "apiVersion: kubefence.io/v1alpha1\nkind: FencedController\nmetadata: {{name: leader-go, namespace: {ns}}}\nspec: {{lease: {lease}, serviceAccounts: [ctl], mode: Audit}}\n",
        ns = f.ns,
        lease = leader::LEASE
    );
    as_admin(kubectl, &["apply", "-f", "-"], Some(&fence));
    let mut row = None;
    leader::until("kube-fence status: Ready, Auditing, held by the leader's Pod", Duration::from_secs(60), async || {
        row = fence_row(&f.ns, "leader-go");
        let holder = leader::holder_now(&f.client, &f.ns).await;
        row.as_ref().is_some_and(|r| {
            r["ready"]["status"] == "True"
                && r["ready"]["reason"] == "Auditing"
                && holder.starts_with(&format!("{}_", r["holder"].as_str().unwrap_or("?")))
        })
    })
    .await;
    println!("status, audited: {}", row.unwrap_or_default());
    // The labelled objects stay fenced by their own label (Enforce); the fence's Audit lets the
    // resumed leader's created ConfigMaps and Namespace patches land, each with a warning.
    let audited = leader::pause_cycles(&f.client, &f.ns, &widgets, 1, &mut replicas).await;
    leader::until("kube-fence status counts the audited stale writes", Duration::from_secs(60), async || {
        fence_row(&f.ns, "leader-go").is_some_and(|r| r["warnedLastHour"].as_u64().unwrap_or(0) > 0)
    })
    .await;

    // Enforce, with kubectl; the history from here on is checked.
    as_admin(
        kubectl,
        &["-n", &f.ns, "patch", "fencedcontroller", "leader-go", "--type", "merge", "-p", r#"{"spec":{"mode":"Enforce"}}"#],
        None,
    );
    leader::until("kube-fence status: Enforcing", Duration::from_secs(60), async || {
        fence_row(&f.ns, "leader-go").is_some_and(|r| r["ready"]["reason"] == "Enforcing")
    })
    .await;
    // The routing and the webhook's cache follow within a moment: wait for a follower's write to
    // be refused before the checked cycles.
    let follower_pod = |holder: &str| if holder.starts_with("p1_") { pods[1].clone() } else { pods[0].clone() };
    let holder = leader::holder_now(&f.client, &f.ns).await;
    let follower = common::identity::client_as_pod(&f.client, &f.ns, "ctl", &follower_pod(&holder)).await;
    let probe: ConfigMap = serde_json::from_value(json!({"metadata": {"generateName": "probe-"}})).unwrap();
    leader::until("a follower's write is refused", Duration::from_secs(60), async || {
        Api::<ConfigMap>::namespaced(follower.clone(), &f.ns).create(&PostParams::default(), &probe).await.is_err()
    })
    .await;
    let seen = std::sync::Arc::new(std::sync::Mutex::new(leader::Seen::default()));
    let recorder = leader::record(&f.client, &f.ns, &widgets, seen.clone());
    let enforced = leader::pause_cycles(&f.client, &f.ns, &widgets, 2, &mut replicas).await;
    leader::until("kube-fence status counts the refusals", Duration::from_secs(60), async || {
        fence_row(&f.ns, "leader-go").is_some_and(|r| r["refusedLastHour"].as_u64().unwrap_or(0) > 0)
    })
    .await;

    // Roll back, with kubectl: the follower writes again.
    as_admin(kubectl, &["-n", &f.ns, "delete", "fencedcontroller", "leader-go"], None);
    let holder = leader::holder_now(&f.client, &f.ns).await;
    let follower = common::identity::client_as_pod(&f.client, &f.ns, "ctl", &follower_pod(&holder)).await;
    leader::until("the follower's write lands once the fence is deleted", Duration::from_secs(60), async || {
        Api::<ConfigMap>::namespaced(follower.clone(), &f.ns).create(&PostParams::default(), &probe).await.is_ok()
    })
    .await;
    assert!(fence_row(&f.ns, "leader-go").is_none(), "kube-fence status no longer lists the fence");

    let mut accepted = 0;
    for mut replica in replicas.0 {
        replica.signal("-TERM");
        let exited = replica.child.wait().expect("wait");
        assert!(exited.success(), "{} exited with {exited} on SIGTERM", replica.pod);
        accepted += leader::accepted(&replica.lines.lock().expect("lines"));
    }
    recorder.abort();
    let seen = std::mem::take(&mut *seen.lock().expect("seen"));
    let (violations, _) = leader::violations(&seen);
    println!(
        "adopted: the audited cycle refused {:?} (labelled objects; its other stale writes landed, warned); the enforced cycles refused {:?}; {accepted} writes accepted in all; violations while enforced: {}",
        audited.refused,
        enforced.refused,
        violations.len()
    );
    assert!(violations.is_empty(), "no stale write while enforced: {violations:?}");
    assert!(enforced.refused.iter().any(|r| *r > 0), "a resumed leader's pending write was refused");
    stop.cancel();
    let _ = controller.await;
    f.stop().await;
}
