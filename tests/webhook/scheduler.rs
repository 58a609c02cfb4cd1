//! A real controller nobody here wrote, fenced by the writer opt-in alone: kube-scheduler
//! (Kubernetes' own, built unmodified from the pinned Go modules with the control plane), a
//! client-go leader-elected controller, run as two replicas — processes with their Pods' bound
//! tokens and their Pods' names as host names (a UTS namespace each), as the kubelet would run
//! them — electing their leader on a Lease in the test's namespace and scheduling the Pods that
//! ask for their scheduler. Its work with no node to schedule to: each pending Pod's
//! `PodScheduled=False` condition (`pods/status`) and a `FailedScheduling` Event.
//!
//! Threat case: a stale-but-honest leader. Replica A leads and renews every 10 s; the Lease is
//! released behind its back (an admin clears the holder, as a partition or a missed renewal
//! would let it expire) and replica B, which retries every second, takes it; until A's next
//! renewal A still believes it leads and schedules — and every write it sends is refused with 409
//! `NotHolder`, while B's are admitted. No object is labelled; only the Lease carries the opt-in.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use k8s_openapi::api::coordination::v1::Lease as LeaderLease;
use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
use k8s_openapi::api::rbac::v1::{ClusterRoleBinding, Role, RoleBinding};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use serde_json::json;

use super::{Fixture, common};
use common::leader::until;

const LEASE: &str = "sched";
const SCHEDULER_NAME: &str = "kf-fenced-scheduler";

/// ServiceAccount `scheduler` with what kube-scheduler needs (the built-in `system:kube-scheduler`
/// and `system:volume-scheduler` roles, plus its Lease in the test's namespace), and its Pods.
async fn scheduler_pods(f: &Fixture) -> Vec<Pod> {
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": "scheduler"}})).unwrap();
    Api::<ServiceAccount>::namespaced(f.client.clone(), &f.ns).create(&PostParams::default(), &sa).await.expect("service account");
    let pp = PatchParams::apply("kube-fence-tests").force();
    for role in ["system:kube-scheduler", "system:volume-scheduler"] {
        let name = format!("{}-{}", f.ns, role.replace(':', "-"));
        let binding: ClusterRoleBinding = serde_json::from_value(json!({"metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role},
            "subjects": [{"kind": "ServiceAccount", "name": "scheduler", "namespace": f.ns}]}))
        .unwrap();
        Api::<ClusterRoleBinding>::all(f.client.clone()).patch(&name, &pp, &Patch::Apply(&binding)).await.expect("binding");
    }
    let role: Role = serde_json::from_value(json!({"metadata": {"name": "scheduler-lease", "namespace": f.ns},
        "rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get", "create", "update"]}]}))
    .unwrap();
    Api::<Role>::namespaced(f.client.clone(), &f.ns).patch("scheduler-lease", &pp, &Patch::Apply(&role)).await.expect("role");
    let binding: RoleBinding = serde_json::from_value(json!({"metadata": {"name": "scheduler-lease", "namespace": f.ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "scheduler-lease"},
        "subjects": [{"kind": "ServiceAccount", "name": "scheduler", "namespace": f.ns}]}))
    .unwrap();
    Api::<RoleBinding>::namespaced(f.client.clone(), &f.ns).patch("scheduler-lease", &pp, &Patch::Apply(&binding)).await.expect("binding");
    common::identity::pods_of(&f.client, &f.ns, "scheduler", &["sched-0", "sched-1"]).await
}

/// One kube-scheduler replica: the process (in a UTS namespace whose host name is its Pod's
/// name: kube-scheduler names itself `<hostname>_<uuid>`) and its log file.
struct Scheduler {
    child: Child,
    log: PathBuf,
}

impl Scheduler {
    fn start(dir: &Path, pod: &str, ns: &str, retry: &str) -> Scheduler {
        let kubeconfig = dir.join(format!("{pod}.kubeconfig"));
        let config = dir.join(format!("{pod}.yaml"));
        let settings = json!({
            "apiVersion": "kubescheduler.config.k8s.io/v1", "kind": "KubeSchedulerConfiguration",
            "clientConnection": {"kubeconfig": kubeconfig},
            "leaderElection": {"leaderElect": true, "resourceLock": "leases", "resourceNamespace": ns, "resourceName": LEASE,
                               "leaseDuration": "30s", "renewDeadline": "20s", "retryPeriod": retry},
            "profiles": [{"schedulerName": SCHEDULER_NAME}],
        });
        std::fs::write(&config, serde_saphyr::to_string(&settings).expect("yaml")).expect("write the scheduler configuration");
        let log = dir.join(format!("{pod}.log"));
        let stderr = std::fs::File::create(&log).expect("log file");
        let bin =
            Path::new(&std::env::var("KUBE_FENCE_BIN_DIR").expect("KUBE_FENCE_BIN_DIR (hack/test.sh sets it)")).join("kube-scheduler");
        let script = format!("hostname {pod} && exec {} --config {} --secure-port 0 -v 2", bin.display(), config.display());
        let child = Command::new("unshare")
            .args(["--uts", "sh", "-c", &script])
            .stdout(Stdio::null())
            .stderr(stderr)
            .spawn()
            .expect("start kube-scheduler in a UTS namespace of its own (unshare, as root)");
        Scheduler { child, log }
    }

    fn log(&self) -> String {
        let mut text = String::new();
        let _ = std::fs::File::open(&self.log).and_then(|mut f| f.read_to_string(&mut text));
        text
    }
}

impl Drop for Scheduler {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

async fn holder(client: &Client, ns: &str) -> String {
    let lease = Api::<LeaderLease>::namespaced(client.clone(), ns).get_opt(LEASE).await.expect("get the Lease");
    lease.and_then(|l| l.spec).and_then(|s| s.holder_identity).unwrap_or_default()
}

/// A Pod for the fenced scheduler, which it cannot place (there is no node).
fn pending(name: &str) -> Pod {
    serde_json::from_value(json!({"metadata": {"name": name}, "spec": {"schedulerName": SCHEDULER_NAME,
        "containers": [{"name": "c", "image": "registry.invalid/none"}]}}))
    .unwrap()
}

/// Whether the scheduler wrote Pod `name`'s `PodScheduled` condition.
async fn scheduled_status(pods: &Api<Pod>, name: &str) -> bool {
    let pod = pods.get(name).await.expect("get the Pod");
    pod.status.and_then(|s| s.conditions).unwrap_or_default().iter().any(|c| c.type_ == "PodScheduled" && c.status == "False")
}

#[tokio::test]
async fn kube_scheduler_is_fenced_by_its_lease_alone() {
    let f = Fixture::new("scheduler").await;
    let pods = scheduler_pods(&f).await;
    let lease: LeaderLease = serde_json::from_value(json!({"metadata": {"name": LEASE}, "spec": {}})).unwrap();
    Api::<LeaderLease>::namespaced(f.client.clone(), &f.ns).create(&PostParams::default(), &lease).await.expect("the Lease");
    common::leader::fence_controller(&f.client, &f.ns, LEASE, "scheduler", kube_fence_api::FenceMode::Enforce).await;
    let routed = kube_fence::admission::registration::routing::configuration_name(&format!("kf-test-{}", f.ns));
    let configurations = Api::<k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration>::all(f.client.clone());
    until("the writer webhook is registered", Duration::from_secs(30), async || {
        configurations.get_opt(&routed).await.ok().flatten().and_then(|c| c.webhooks).is_some_and(|w| w.len() == 1)
    })
    .await;
    let dir = tempfile::tempdir().expect("temp dir");
    for pod in &pods {
        let kubeconfig =
            common::identity::kubeconfig_with_token(&common::identity::pod_token(&f.client, &f.ns, "scheduler", pod).await).await;
        std::fs::write(dir.path().join(format!("{}.kubeconfig", pod.name_any())), serde_saphyr::to_string(&kubeconfig).unwrap()).unwrap();
    }

    // A leads and does its normal work: status and an Event for a Pod it cannot place.
    let a = Scheduler::start(dir.path(), "sched-0", &f.ns, "10s");
    until("sched-0 leads", Duration::from_secs(60), async || holder(&f.client, &f.ns).await.starts_with("sched-0_")).await;
    let workload: Api<Pod> = Api::namespaced(f.client.clone(), &f.ns);
    workload.create(&PostParams::default(), &pending("while-a-leads")).await.expect("a pending Pod");
    until("the leader writes the Pod's PodScheduled condition", Duration::from_secs(30), async || {
        scheduled_status(&workload, "while-a-leads").await
    })
    .await;
    let events = Api::<k8s_openapi::api::events::v1::Event>::namespaced(f.client.clone(), &f.ns);
    until("the leader's FailedScheduling Event", Duration::from_secs(30), async || {
        events.list(&ListParams::default()).await.is_ok_and(|l| {
            l.items.iter().any(|e| {
                e.reason.as_deref() == Some("FailedScheduling")
                    && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("while-a-leads")
            })
        })
    })
    .await;

    // B follows, retrying every second. Right after A renews, the Lease is released behind A's
    // back; B takes it within a second, while A, renewing only every 10 s, still leads in its own
    // eyes.
    let b = Scheduler::start(dir.path(), "sched-1", &f.ns, "1s");
    let renewed = |l: Option<LeaderLease>| l.and_then(|l| l.spec).and_then(|s| s.renew_time).map(|t| t.0);
    let leases = Api::<LeaderLease>::namespaced(f.client.clone(), &f.ns);
    let before = renewed(leases.get_opt(LEASE).await.expect("lease"));
    until("A renews", Duration::from_secs(30), async || renewed(leases.get_opt(LEASE).await.ok().flatten()) != before).await;
    // The handover is written by B's own Pod (an admin may not: while the FencedController exists
    // only a Pod of the fenced ServiceAccount claims the Lease, as itself, and only the holder
    // releases it): a claim as sched-1, then its release, which B's scheduler then takes under
    // its own identity.
    let as_b = common::identity::client_as_pod(&f.client, &f.ns, "scheduler", &pods[1]).await;
    // (kube-scheduler's role may update Leases, not patch them.)
    let as_b = Api::<LeaderLease>::namespaced(as_b, &f.ns);
    let mut lease = as_b.get(LEASE).await.expect("B's Pod reads the Lease");
    let spec = lease.spec.get_or_insert_with(Default::default);
    spec.holder_identity = Some("sched-1_handover".into());
    spec.renew_time = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime("2026-01-01T00:00:00Z".parse().expect("a time")));
    let lease = as_b.replace(LEASE, &PostParams::default(), &lease).await.expect("B's Pod hands the Lease over to itself");
    // ... and, now its holder, releases it (client-go takes a released Lease at once; an expired
    // one only a Lease duration after it last saw it change).
    let mut lease = lease;
    lease.spec.get_or_insert_with(Default::default).holder_identity = None;
    as_b.replace(LEASE, &PostParams::default(), &lease).await.expect("B's Pod releases the Lease");
    until("B takes the Lease", Duration::from_secs(5), async || {
        let now = holder(&f.client, &f.ns).await;
        now.starts_with("sched-1_") && now != "sched-1_handover"
    })
    .await;
    for i in 0..3 {
        workload.create(&PostParams::default(), &pending(&format!("after-takeover-{i}"))).await.expect("a pending Pod");
    }
    // B, the holder, does the work; A's writes are refused.
    for i in 0..3 {
        let name = format!("after-takeover-{i}");
        until(&format!("the new leader writes {name}'s condition"), Duration::from_secs(30), async || {
            scheduled_status(&workload, &name).await
        })
        .await;
    }
    until("the ex-leader's writes are refused with NotHolder", Duration::from_secs(30), async || {
        let log = a.log();
        log.contains("NotHolder") || log.contains("write by Pod sched-0 denied")
    })
    .await;
    let log = a.log();
    let refused: Vec<&str> = log.lines().filter(|l| l.contains("write by Pod sched-0 denied")).collect();
    println!(
        "kube-scheduler: the ex-leader's refused writes in its log: {}; the new leader wrote 3 of 3; first refusal: {}",
        refused.len(),
        refused.first().map(|l| &l[..l.len().min(400)]).unwrap_or("")
    );
    let refused = refused.len();
    assert!(refused > 0, "A logged refused writes:\n{}", log.lines().rev().take(20).collect::<Vec<_>>().join("\n"));
    assert!(!b.log().contains("write by Pod sched-1 denied"), "B's writes were admitted");
    drop((a, b));
    f.stop().await;
}
