//! Fencing an unmodified client-go leader-elected controller as it really runs: two replicas of
//! examples/leader-go (built from the Go module proxy into an image by
//! `hack/build-leader-go.sh --image`) as the Pods of a Deployment on a real node, with the
//! ServiceAccount tokens the kubelet mounts, against the kube-fence the chart installed. Threat
//! case: a stale-but-honest writer (a leader paused past its Lease, then resumed). Needs the node:
//! `hack/e2e-node.sh` runs it with `--ignored`, after installing the chart and importing the image
//! (`LEADER_GO_IMAGE`); the cycle, the watch and the history check are tests/common/leader.rs,
//! shared with the same test on processes (tests/webhook/leader.rs).

use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, ListParams, LogParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config, ResourceExt};
use kube_fence_api::names::LEADER_LEASE_LABEL;
use serde_json::{Value, json};

use super::{KubeFence, common, installed};
use common::leader::{self, CONFIGMAP, LEASE, WIDGET};
use k8s_openapi::api::coordination::v1::Lease as LeaderLease;

/// The user that creates the guarded objects, acting for the leader's Pod.
const SETUP: &str = "leader-go-setup";

/// What examples/leader-go needs, and nothing more: client-go's LeaseLock gets, creates (when
/// absent) and updates its Lease; the program merge-patches the ConfigMap and the Widget's
/// `/status` (no events: it sets no event recorder).
fn least_privilege(ns: &str, everything: bool) -> Role {
    let mut role: Role = serde_json::from_value(json!({
        "metadata": {"name": "leader-go", "namespace": ns},
        "rules": [
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": [LEASE], "verbs": ["get", "update"]},
            // RBAC cannot restrict a create by name.
            {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
            {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [CONFIGMAP], "verbs": ["patch"]},
            {"apiGroups": ["example.kubefence.io"], "resources": ["widgets/status"], "resourceNames": [WIDGET], "verbs": ["patch"]},
        ]
    }))
    .expect("a Role from a literal");
    if everything {
        // CREATE_OBJECTS: a new ConfigMap per write (RBAC cannot restrict a create by name).
        role.rules
            .get_or_insert_default()
            .push(serde_json::from_value(json!({"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]})).expect("a rule"));
    }
    role
}

/// ServiceAccount `ctl` bound to [`least_privilege`], and [`SETUP`] allowed to create the
/// guarded objects.
async fn rbac(client: &Client, ns: &str, everything: bool) {
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "ctl"}})).expect("a literal");
    Api::<ServiceAccount>::namespaced(client.clone(), ns).create(&PostParams::default(), &sa).await.expect("service account");
    let setup: Role = serde_json::from_value(json!({
        "metadata": {"name": SETUP, "namespace": ns},
        "rules": [{"apiGroups": ["", "example.kubefence.io"], "resources": ["configmaps", "widgets"], "verbs": ["create"]}]
    }))
    .expect("a literal");
    let pp = PatchParams::apply("kube-fence-tests").force();
    let roles = Api::<Role>::namespaced(client.clone(), ns);
    for (role, subject) in [
        (least_privilege(ns, everything), json!({"kind": "ServiceAccount", "name": "ctl", "namespace": ns})),
        (setup, json!({"kind": "User", "name": SETUP, "apiGroup": "rbac.authorization.k8s.io"})),
    ] {
        let name = role.name_any();
        roles.patch(&name, &pp, &Patch::Apply(&role)).await.expect("role");
        let binding: RoleBinding = serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": ns},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
            "subjects": [subject],
        }))
        .expect("a literal");
        Api::<RoleBinding>::namespaced(client.clone(), ns).patch(&name, &pp, &Patch::Apply(&binding)).await.expect("role binding");
    }
    if everything {
        // PATCH_NAMESPACE: its own Namespace, a cluster-scoped object.
        leader::may_patch_namespace(client, ns, "ctl").await;
    }
}

/// The Deployment: 2 replicas of the image, its Pod's name from the downward API, a 2 s Lease and
/// a write every 100 ms.
fn deployment(image: &str, everything: bool) -> Deployment {
    let field = |path: &str| json!({"fieldRef": {"fieldPath": path}});
    let flag = if everything { "1" } else { "0" };
    serde_json::from_value(json!({
        "metadata": {"name": "leader-go"},
        "spec": {
            "replicas": 2,
            "selector": {"matchLabels": {"app": "leader-go"}},
            "template": {
                "metadata": {"labels": {"app": "leader-go"}},
                "spec": {
                    "serviceAccountName": "ctl",
                    "terminationGracePeriodSeconds": 5,
                    "containers": [{
                        "name": "leader-go",
                        "image": image,
                        "imagePullPolicy": "Never",
                        "env": [
                            {"name": "POD_NAME", "valueFrom": field("metadata.name")},
                            {"name": "NAMESPACE", "valueFrom": field("metadata.namespace")},
                            {"name": "LEASE", "value": LEASE},
                            {"name": "CONFIGMAP", "value": CONFIGMAP},
                            {"name": "RESOURCE", "value": WIDGET},
                            {"name": "LEASE_DURATION", "value": "2s"},
                            {"name": "WRITE_INTERVAL", "value": "100ms"},
                            {"name": "CREATE_OBJECTS", "value": flag},
                            {"name": "PATCH_NAMESPACE", "value": flag},
                        ],
                    }],
                },
            },
        },
    }))
    .expect("a Deployment from a literal")
}

/// A client acting as [`SETUP`], which the installed kube-fence exempts (`webhook.exemptUsers`,
/// hack/e2e-install-and-test.sh; a value the 0.1 chart the operations tests go back to knows): it
/// creates the objects bound to a leader Lease without being the holder's Pod, as an operator's
/// admin would.
async fn setup_client() -> Client {
    let path = common::kubeconfig().await;
    let kubeconfig = Kubeconfig::read_from(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let mut config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await.expect("kubeconfig is usable");
    config.auth_info.impersonate = Some(SETUP.into());
    config.auth_info.impersonate_groups = Some(vec!["system:authenticated".into()]);
    Client::try_from(config).expect("client from kubeconfig")
}

/// The host process id of a container (`containerd://<id>`), from the node's containerd.
pub(super) fn host_pid(container_id: &str) -> u32 {
    let id = container_id.strip_prefix("containerd://").unwrap_or_else(|| panic!("a containerd container: {container_id}"));
    let address = std::env::var("CONTAINERD_ADDRESS").expect("CONTAINERD_ADDRESS (hack/test-node.sh exports it)");
    let namespace = std::env::var("CONTAINERD_NAMESPACE").unwrap_or_else(|_| "k8s.io".into());
    let out = Command::new("ctr").args(["--address", &address, "-n", &namespace, "task", "ls"]).output().expect("run ctr");
    assert!(out.status.success(), "ctr task ls: {}", String::from_utf8_lossy(&out.stderr));
    // TASK  PID  STATUS
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|line| {
            let mut fields = line.split_whitespace();
            (fields.next() == Some(id)).then(|| fields.next().and_then(|pid| pid.parse().ok())).flatten()
        })
        .unwrap_or_else(|| panic!("no task {id} in `ctr task ls`"))
}

/// Whether process `pid` is stopped (state `T` in /proc/<pid>/stat).
/// One replica: its Pod, its container's host process, and the JSON lines of its log.
struct PodReplica {
    pod: String,
    pid: u32,
    lines: Arc<Mutex<Vec<Value>>>,
    follower: tokio::task::JoinHandle<()>,
}

/// Follows Pod `pod`'s log (the Pod log API) into `lines`, reconnecting if the stream ends (the
/// log is read again from its start and the lines already read are skipped).
fn follow(client: Client, ns: &str, pod: &str, lines: Arc<Mutex<Vec<Value>>>) -> tokio::task::JoinHandle<()> {
    use futures::{AsyncBufReadExt, StreamExt};
    let (pods, pod) = (Api::<Pod>::namespaced(client, ns), pod.to_string());
    tokio::spawn(async move {
        let mut read = 0;
        loop {
            if let Ok(log) = pods.log_stream(&pod, &LogParams { follow: true, ..Default::default() }).await {
                let mut log = std::pin::pin!(log.lines());
                let mut at = 0;
                while let Some(Ok(line)) = log.next().await {
                    at += 1;
                    if at <= read {
                        continue;
                    }
                    read = at;
                    // client-go's own log lines (klog, stderr) are not JSON.
                    if let Ok(value @ Value::Object(_)) = serde_json::from_str(&line) {
                        lines.lock().expect("lines").push(value);
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
}

struct PodReplicas(Vec<PodReplica>);

impl PodReplicas {
    fn replica(&self, pod: &str) -> &PodReplica {
        self.0.iter().find(|r| r.pod == pod).unwrap_or_else(|| panic!("the holder's Pod {pod} is one of the Deployment's"))
    }
}

impl leader::Replicas for PodReplicas {
    fn signal(&mut self, pod: &str, signal: &str) {
        common::signal_and_wait(self.replica(pod).pid, signal);
    }

    fn with_lines<R>(&self, pod: &str, f: impl FnOnce(&[Value]) -> R) -> R {
        f(&self.replica(pod).lines.lock().expect("lines"))
    }
}

/// Whether a create made the object (or found it made).
fn created(result: Result<(), kube::Error>) -> bool {
    match result {
        Ok(()) => true,
        Err(kube::Error::Api(e)) => e.code == 409 && e.reason == "AlreadyExists",
        Err(_) => false,
    }
}

/// The Deployment's 2 Pods once both containers run: name and container ID.
async fn running_pods(pods: &Api<Pod>) -> Vec<(String, String)> {
    let mut running = Vec::new();
    leader::until("both leader-go Pods run", Duration::from_secs(120), async || {
        let listed = pods.list(&ListParams::default().labels("app=leader-go")).await.expect("list Pods");
        running = listed
            .items
            .iter()
            .filter_map(|p| {
                let status = p.status.as_ref()?.container_statuses.as_ref()?.first()?;
                status.state.as_ref()?.running.as_ref()?;
                Some((p.name_any(), status.container_id.clone()?))
            })
            .collect();
        running.len() == 2 && listed.items.len() == 2
    })
    .await;
    running
}

/// Stale-but-honest writer, on a real node: the leader Pod's container is SIGSTOPped (through
/// its host process id, found via containerd) past its 2 s Lease; the other replica takes the
/// Lease over and writes the guarded ConfigMap and the guarded Widget's status; the old leader
/// gets SIGCONT, sends its pending writes — refused with 409 NotHolder, as its log shows — stops
/// leading and campaigns again in the same container. A watch records the Lease's holders and
/// every accepted write; the history checker must find no stale write accepted. Cycles:
/// LEADER_GO_CYCLES (default 3; hack/e2e-node.sh runs 20).
#[tokio::test]
#[ignore = "needs the node: hack/e2e-node.sh"]
async fn a_paused_leader_pod_is_fenced_when_it_resumes() {
    paused_leader_pods("e2e-leader-go", false).await;
}

/// Stale-but-honest writer, on everything it writes, on a real node: the same Deployment also
/// creates a new unlabelled ConfigMap per write and patches its Namespace (cluster-scoped), and
/// its ServiceAccount is fenced by a FencedController on its Lease; the installed kube-fence
/// routes and judges those writes. The history checker finds no write of a paused
/// leader committed after its successor's on any object. Cycles: LEADER_GO_CYCLES.
#[tokio::test]
#[ignore = "needs the node: hack/e2e-node.sh"]
async fn a_paused_leader_pods_every_write_is_fenced_once_it_is_fenced() {
    paused_leader_pods("e2e-leader-writers", true).await;
}

async fn paused_leader_pods(test: &str, everything: bool) {
    assert!(installed(), "runs against an installed kube-fence on the node (hack/e2e-node.sh sets KUBE_FENCE_E2E_INSTALLED=1)");
    let image = std::env::var("LEADER_GO_IMAGE").expect("LEADER_GO_IMAGE: the imported leader-go image (hack/e2e-node.sh)");
    let cycles: usize = std::env::var("LEADER_GO_CYCLES").ok().and_then(|c| c.parse().ok()).unwrap_or(3);
    let kf = KubeFence::start(test).await;
    let (client, ns) = (kf.client.clone(), kf.ns.clone());
    let widgets: ApiResource = leader::install_widget_crd(&client).await;
    rbac(&client, &ns, everything).await;
    // The Lease is created before the controller (client-go keeps the metadata of a Lease it
    // finds); when the controller is fenced as a writer, an admin creates its FencedController.
    leader::opted_in_lease(&client, &ns, LEASE).await;
    if everything {
        leader::fence_controller(&client, &ns, LEASE, "ctl", kube_fence_api::FenceMode::Enforce).await;
        // The installed kube-fence routes the fenced ServiceAccount's writes to its writer webhook.
        let webhooks = Api::<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration>::all(client.clone());
        let user = format!("system:serviceaccount:{ns}:ctl");
        leader::until("the installed kube-fence routes the writer's writes", Duration::from_secs(60), async || {
            webhooks
                .list(&ListParams::default())
                .await
                .is_ok_and(|list| list.items.iter().any(|c| kube_fence::admission::registration::routing::routes_in(c, &user)))
        })
        .await;
    }
    let seen = Arc::new(Mutex::new(leader::Seen::default()));
    let recorder = leader::record(&client, &ns, &widgets, seen.clone());
    Api::<Deployment>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &deployment(&image, everything))
        .await
        .expect("Deployment");
    let pods: Api<Pod> = Api::namespaced(client.clone(), &ns);
    let mut replicas = PodReplicas(
        running_pods(&pods)
            .await
            .into_iter()
            .map(|(pod, container)| {
                let lines = Arc::new(Mutex::new(Vec::new()));
                let follower = follow(client.clone(), &ns, &pod, lines.clone());
                PodReplica { pid: host_pid(&container), pod, lines, follower }
            })
            .collect(),
    );

    // The guarded objects, created by a kube-fence admin once a leader runs (it patches them from then on).
    let labelled = json!({LEADER_LEASE_LABEL: LEASE});
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": CONFIGMAP, "labels": labelled}})).expect("a literal");
    let widget: DynamicObject = serde_json::from_value(json!({"apiVersion": "example.kubefence.io/v1", "kind": "Widget",
        "metadata": {"name": WIDGET, "labels": labelled}, "spec": {}}))
    .expect("a literal");
    leader::until("the first leader's Pod creates the guarded objects", Duration::from_secs(60), async || {
        let holder = leader::holder_now(&client, &ns).await;
        if holder.is_empty() {
            return false;
        }
        let as_leader = setup_client().await;
        let cm = Api::<ConfigMap>::namespaced(as_leader.clone(), &ns).create(&PostParams::default(), &cm).await.map(|_| ());
        let widget = Api::<DynamicObject>::namespaced_with(as_leader, &ns, &widgets).create(&PostParams::default(), &widget).await;
        created(cm) && created(widget.map(|_| ()))
    })
    .await;

    let run = leader::pause_cycles(&client, &ns, &widgets, cycles, &mut replicas).await;
    // The watch catches up with the present (the Lease's, the ConfigMap's and the Widget's current
    // versions: every holder and write before them too), however busy the machine is; then with
    // what the logs say was accepted.
    watched_now(&client, &ns, &widgets, &seen).await;
    let accepted: usize = replicas.0.iter().map(|r| leader::accepted(&r.lines.lock().expect("lines"))).sum();
    leader::catch_up(&seen, accepted, Duration::from_secs(30)).await;
    recorder.abort();
    for replica in &replicas.0 {
        replica.follower.abort();
        let pod = pods.get(&replica.pod).await.expect("the Pod");
        let restarts = pod.status.and_then(|s| s.container_statuses).and_then(|c| c.first().map(|c| c.restart_count));
        assert_eq!(restarts, Some(0), "{}: the controller campaigned again in the same container", replica.pod);
    }
    let seen = std::mem::take(&mut *seen.lock().expect("seen"));
    if everything {
        assert!(seen.writes.iter().any(|(_, o, _)| o == leader::MADE), "the watch saw the new ConfigMaps");
        assert!(seen.writes.iter().any(|(_, o, _)| o.starts_with("namespace/")), "the watch saw the Namespace writes");
    }
    run.check(if everything { "leader-go writers on the node" } else { "leader-go on the node" }, &seen, accepted);
    // Its Pods would keep writing through the tests that follow.
    Api::<Namespace>::all(client.clone()).delete(&ns, &DeleteParams::default()).await.expect("delete the namespace");
    kf.stop().await;
}

/// Waits (at most 60 s) until the watch recorded in `seen` has delivered the current version of
/// the leader-election Lease, the ConfigMap and the Widget: a watch delivers versions in order,
/// so it then holds every holder and write that came before, without a pause that hopes it does.
async fn watched_now(client: &Client, ns: &str, widgets: &ApiResource, seen: &Mutex<leader::Seen>) {
    let version = |meta: &kube::api::ObjectMeta| meta.resource_version.as_deref().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    let lease = version(&Api::<LeaderLease>::namespaced(client.clone(), ns).get(LEASE).await.expect("the Lease").metadata);
    let cm = version(&Api::<ConfigMap>::namespaced(client.clone(), ns).get(CONFIGMAP).await.expect("the ConfigMap").metadata);
    let widget =
        version(&Api::<DynamicObject>::namespaced_with(client.clone(), ns, widgets).get(WIDGET).await.expect("the Widget").metadata);
    let (cm_name, widget_name) = (format!("configmap/{CONFIGMAP}"), format!("widget/{WIDGET}"));
    leader::until("the watch delivers the current Lease, ConfigMap and Widget", Duration::from_secs(60), async || {
        let seen = seen.lock().expect("seen");
        let newest = |object: &str| seen.writes.iter().filter(|(_, o, _)| o == object).map(|(rv, _, _)| *rv).max().unwrap_or(0);
        seen.holders.iter().map(|(rv, _, _)| *rv).max().unwrap_or(0) >= lease && newest(&cm_name) >= cm && newest(&widget_name) >= widget
    })
    .await;
}
