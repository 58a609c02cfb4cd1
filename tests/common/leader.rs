//! The pause cycle for an unmodified client-go leader-elected controller (examples/leader-go),
//! shared by its two runs: as processes on the local control plane (tests/webhook/leader.rs) and
//! as the Pods of a Deployment on a real node (tests/e2e/leader.rs). What differs between them is
//! how a replica is stopped, resumed and read ([`Replicas`]); the cycle ([`pause_cycles`]), the
//! watch ([`record`]) and the history check ([`Run::check`]) are the same.
//!
//! Names: Lease [`LEASE`], ConfigMap [`CONFIGMAP`] and Widget [`WIDGET`], in the test's namespace;
//! the replicas' identities are `<pod>_<uuid>`, a fresh one per campaign.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use k8s_openapi::api::coordination::v1::Lease as LeaderLease;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams, PostParams};
use kube::{Client, ResourceExt};
use kube_fence_api::denial::Reason;
use kube_fence_api::names::{HOLDER_IDENTITY_LABEL, HOLDER_IS_POD};
use serde_json::{Value, json};

/// The leader-election Lease the replicas campaign on.
pub const LEASE: &str = "ctl";
/// The guarded ConfigMap the leader writes.
pub const CONFIGMAP: &str = "state";
/// The guarded Widget whose `/status` the leader writes.
pub const WIDGET: &str = "w";

/// The label of the ConfigMaps the leader creates, one per write, with `CREATE_OBJECTS=1`: no
/// kube-fence label (only its FencedController fences them).
pub const MADE_LABEL: &str = "leader-go/made";
/// The logical object all of them are, for the history checker: a create of a stale leader after
/// one of its successor is a stale write like any other.
pub const MADE: &str = "configmaps/made";
/// The annotation of the Namespace (a cluster-scoped object) the leader writes, with
/// `PATCH_NAMESPACE=1`.
pub const NAMESPACE_WRITER: &str = "leader-go/writer";

pub const WIDGET_CRD: &str = include_str!("../../examples/leader-go/widget-crd.yaml");

/// The example's custom resource, installed once per test binary.
pub async fn install_widget_crd(client: &Client) -> ApiResource {
    let crd: CustomResourceDefinition = serde_saphyr::from_str(WIDGET_CRD).expect("the Widget CRD parses");
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

/// The leader-election Lease `name` in `ns`, opted into holder binding, with no holder yet.
pub async fn opted_in_lease(client: &Client, ns: &str, name: &str) {
    let lease: LeaderLease = serde_json::from_value(json!({"metadata": {"name": name,
        "labels": {HOLDER_IDENTITY_LABEL: HOLDER_IS_POD}}, "spec": {}}))
    .unwrap();
    Api::<LeaderLease>::namespaced(client.clone(), ns).create(&PostParams::default(), &lease).await.expect("create the Lease");
}

/// As a cluster admin (`client`) would: fences every write of ServiceAccount `account` of `ns`
/// to the holder of Lease `lease` (a FencedController named after the Lease, in `mode`).
pub async fn fence_controller(client: &Client, ns: &str, lease: &str, account: &str, mode: kube_fence_api::FenceMode) {
    let mut fenced = kube_fence_api::FencedController::new(
        lease,
        kube_fence_api::FencedControllerSpec { lease: lease.into(), service_accounts: vec![account.into()], exempt: Vec::new(), mode },
    );
    fenced.metadata.namespace = Some(ns.into());
    Api::<kube_fence_api::FencedController>::namespaced(client.clone(), ns)
        .create(&PostParams::default(), &fenced)
        .await
        .expect("create the FencedController");
}

/// Polls `done` every 50 ms until it holds; panics after `limit`.
pub async fn until(what: &str, limit: Duration, mut done: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done().await {
        assert!(Instant::now() < deadline, "{what} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The holder identity of Lease [`LEASE`] in `ns` now (`""`: none).
pub async fn holder_now(client: &Client, ns: &str) -> String {
    let lease = Api::<LeaderLease>::namespaced(client.clone(), ns).get(LEASE).await.expect("lease");
    lease.spec.and_then(|s| s.holder_identity).unwrap_or_default()
}

/// Whether `writer` is the last writer of both guarded objects.
pub async fn both_written_by(client: &Client, ns: &str, widgets: &ApiResource, writer: &str) -> bool {
    let cm = Api::<ConfigMap>::namespaced(client.clone(), ns).get_opt(CONFIGMAP).await.expect("configmap");
    let w = Api::<DynamicObject>::namespaced_with(client.clone(), ns, widgets).get_opt(WIDGET).await.expect("widget");
    let (Some(cm), Some(w)) = (cm, w) else { return false };
    cm.data.unwrap_or_default().get("writer").map(String::as_str) == Some(writer) && w.data["status"]["writer"] == writer
}

/// The Pod a holder identity names (`<pod>_<uuid>`).
pub fn pod_of(identity: &str) -> &str {
    identity.split('_').next().unwrap_or_default()
}

/// Writes `identity` sent that were refused because it no longer held the Lease (409 NotHolder).
pub fn refused(lines: &[Value], identity: &str) -> usize {
    let not_holder = |l: &Value| l["accepted"] == false && l["code"] == 409 && l["reason"] == Reason::NotHolder.as_str();
    lines.iter().filter(|l| l["event"] == "write" && l["identity"] == identity && not_holder(l)).count()
}

/// Writes a replica printed as accepted.
pub fn accepted(lines: &[Value]) -> usize {
    lines.iter().filter(|l| l["event"] == "write" && l["accepted"] == true).count()
}

/// Whether the replica that printed `lines` stopped leading as `identity` and then started
/// campaigning again (which it does only once the writes of that term have stopped).
pub fn campaigns_again(lines: &[Value], identity: &str) -> bool {
    let stopped = lines.iter().rposition(|l| l["event"] == "stopped-leading" && l["identity"] == identity);
    stopped.is_some_and(|at| lines[at..].iter().any(|l| l["event"] == "started" && l["identity"] != identity))
}

/// The replicas of the example controller, however they run.
pub trait Replicas {
    /// Sends `signal` (`-STOP`, `-CONT`) to the process of the replica in Pod `pod`, and waits
    /// until it took effect.
    fn signal(&mut self, pod: &str, signal: &str);
    /// Calls `f` with the JSON lines the replica in Pod `pod` printed so far.
    fn with_lines<R>(&self, pod: &str, f: impl FnOnce(&[Value]) -> R) -> R;
}

/// What the cycles found.
pub struct Run {
    pub cycles: usize,
    pub took: Duration,
    /// Per cycle: the resumed leader's writes refused with NotHolder.
    pub refused: Vec<usize>,
}

/// Each cycle: waits for a leader that has written both objects, SIGSTOPs it past its Lease,
/// waits until another replica holds the Lease and has written both objects, SIGCONTs the old
/// leader and waits until it has stopped leading and campaigns again; counts its refused writes.
pub async fn pause_cycles(client: &Client, ns: &str, widgets: &ApiResource, cycles: usize, replicas: &mut impl Replicas) -> Run {
    let started = Instant::now();
    let mut refusals = Vec::new();
    for cycle in 0..cycles {
        // A leader that has written both objects.
        let mut leader = String::new();
        until(&format!("cycle {cycle}: a leader writes"), Duration::from_secs(60), async || {
            leader = holder_now(client, ns).await;
            !leader.is_empty() && both_written_by(client, ns, widgets, &leader).await
        })
        .await;
        let pod = pod_of(&leader).to_string();
        replicas.signal(&pod, "-STOP");
        // The other replica takes over once the Lease expires, and writes.
        let mut successor = String::new();
        until(&format!("cycle {cycle}: the other replica takes over and writes"), Duration::from_secs(60), async || {
            successor = holder_now(client, ns).await;
            !successor.is_empty() && successor != leader && both_written_by(client, ns, widgets, &successor).await
        })
        .await;
        assert_ne!(pod_of(&successor), pod, "cycle {cycle}: the stopped replica cannot have renewed");
        replicas.signal(&pod, "-CONT");
        // It sends its pending writes, learns it lost the Lease, and campaigns again.
        until(
            &format!("cycle {cycle}: the resumed leader {leader} stops leading and campaigns again"),
            Duration::from_secs(60),
            async || replicas.with_lines(&pod, |lines| campaigns_again(lines, &leader)),
        )
        .await;
        refusals.push(replicas.with_lines(&pod, |lines| refused(lines, &leader)));
    }
    Run { cycles, took: started.elapsed(), refused: refusals }
}

impl Run {
    /// Judges the watched history, prints the figures (prefixed `what`) and asserts: no stale
    /// write accepted, every accepted write by a holder the watch saw, each cycle's writes
    /// watched, and some resumed leader's pending write refused.
    pub fn check(&self, what: &str, seen: &Seen, accepted: usize) {
        let (violations, unmatched) = violations(seen);
        let (cycles, refused) = (self.cycles, &self.refused);
        let with_refusals = refused.iter().filter(|r| **r > 0).count();
        println!(
            "{what}: {cycles} cycles in {:.1?} ({:.2?} per cycle); {accepted} writes accepted, {} watched; stale writes refused per cycle: {refused:?} ({with_refusals}/{cycles} cycles had a pending write refused); violations: {}",
            self.took,
            self.took / cycles.max(1) as u32,
            seen.writes.len(),
            violations.len()
        );
        assert!(
            violations.is_empty(),
            "stale writes accepted: {}",
            violations.iter().map(|v| v.to_string()).collect::<Vec<_>>().join("; ")
        );
        assert_eq!(unmatched, 0, "every accepted write was made by a holder the watch saw");
        assert!(seen.writes.len() >= 2 * cycles, "each cycle's writes were watched");
        assert!(with_refusals > 0, "a resumed leader's pending write was refused in some cycle");
    }
}

/// Waits until the watch has seen `accepted` writes (every accepted write makes a new
/// resourceVersion, so it sees one event for each), at most `limit`: the watch catches up
/// however busy the machine is, instead of a sleep that hopes it did.
pub async fn catch_up(seen: &Mutex<Seen>, accepted: usize, limit: Duration) {
    let deadline = Instant::now() + limit;
    while seen.lock().expect("seen").writes.len() < accepted && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What the watch saw, by resourceVersion: Lease holders, and each guarded object's writer.
#[derive(Default)]
pub struct Seen {
    /// (resourceVersion, holderIdentity, leaseTransitions)
    pub holders: Vec<(u64, String, i32)>,
    /// (resourceVersion, object, writer identity)
    pub writes: Vec<(u64, String, String)>,
}

/// Watches the Lease, the ConfigMap and the Widget in `ns` into `seen` until aborted.
pub fn record(client: &Client, ns: &str, widgets: &ApiResource, seen: Arc<Mutex<Seen>>) -> tokio::task::JoinHandle<()> {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let rv = |meta: &kube::api::ObjectMeta| meta.resource_version.as_deref().and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    let by_name = |name: &str| watcher::Config::default().fields(&format!("metadata.name={name}"));
    let leases = watcher(Api::<LeaderLease>::namespaced(client.clone(), ns), by_name(LEASE)).applied_objects().map(move |l| {
        l.map(|l: LeaderLease| {
            let spec = l.spec.clone().unwrap_or_default();
            (rv(&l.metadata), None, spec.holder_identity.unwrap_or_default(), spec.lease_transitions.unwrap_or(0))
        })
    });
    let cms = watcher(Api::<ConfigMap>::namespaced(client.clone(), ns), by_name(CONFIGMAP)).applied_objects().map(move |c| {
        c.map(|c: ConfigMap| {
            let writer = c.data.as_ref().and_then(|d| d.get("writer")).cloned().unwrap_or_default();
            (rv(&c.metadata), Some(format!("configmap/{CONFIGMAP}")), writer, 0)
        })
    });
    let ws = watcher(Api::<DynamicObject>::namespaced_with(client.clone(), ns, widgets), by_name(WIDGET)).applied_objects().map(move |w| {
        w.map(|w: DynamicObject| {
            let writer = w.data["status"]["writer"].as_str().unwrap_or_default().to_string();
            (rv(&w.metadata), Some(format!("widget/{WIDGET}")), writer, 0)
        })
    });
    let made = watcher(Api::<ConfigMap>::namespaced(client.clone(), ns), watcher::Config::default().labels(&format!("{MADE_LABEL}=true")))
        .applied_objects()
        .map(move |c| {
            c.map(|c: ConfigMap| {
                let writer = c.data.as_ref().and_then(|d| d.get("writer")).cloned().unwrap_or_default();
                (rv(&c.metadata), Some(MADE.to_string()), writer, 0)
            })
        });
    let namespace = format!("namespace/{ns}");
    let nss = watcher(Api::<Namespace>::all(client.clone()), by_name(ns)).applied_objects().map(move |n| {
        n.map(|n: Namespace| {
            let writer = n.metadata.annotations.as_ref().and_then(|a| a.get(NAMESPACE_WRITER)).cloned().unwrap_or_default();
            (rv(&n.metadata), Some(namespace.clone()), writer, 0)
        })
    });
    tokio::spawn(async move {
        let mut all = futures::stream::select_all([leases.boxed(), cms.boxed(), ws.boxed(), made.boxed(), nss.boxed()]);
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

/// The stale writes the history checker finds in what the watch saw, and the writes whose writer
/// held no grant the watch saw (none are expected).
pub fn violations(seen: &Seen) -> (Vec<kube_fence_test_support::history::Violation>, usize) {
    let (history, unmatched) = observations(seen);
    // Every write under one grant carries that grant's token: equal tokens are the same leader.
    (kube_fence_test_support::history::check(&history, |_| true), unmatched)
}

/// Lets ServiceAccount `account` of `ns` patch the Namespace `ns` itself (a cluster-scoped
/// write), as a controller that annotates its namespace may.
pub async fn may_patch_namespace(admin: &Client, ns: &str, account: &str) {
    may_patch_a_namespace(admin, ns, account, ns).await;
}

/// Lets ServiceAccount `account` of `ns` read and patch the Namespace `target` (a cluster-scoped
/// object), and nothing else cluster-wide.
pub async fn may_patch_a_namespace(admin: &Client, ns: &str, account: &str, target: &str) {
    use k8s_openapi::api::rbac::v1::{ClusterRole, ClusterRoleBinding};
    let pp = PatchParams::apply("kube-fence-tests").force();
    let name = format!("{account}-{target}");
    let role: ClusterRole = serde_json::from_value(json!({"metadata": {"name": name},
        "rules": [{"apiGroups": [""], "resources": ["namespaces"], "resourceNames": [target], "verbs": ["get", "patch"]}]}))
    .expect("a literal");
    Api::<ClusterRole>::all(admin.clone()).patch(&name, &pp, &Patch::Apply(&role)).await.expect("cluster role");
    let binding: ClusterRoleBinding = serde_json::from_value(json!({"metadata": {"name": name},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": ns}]}))
    .expect("a literal");
    Api::<ClusterRoleBinding>::all(admin.clone()).patch(&name, &pp, &Patch::Apply(&binding)).await.expect("cluster role binding");
}

/// The history checker's view: a grant per holder (token = leaseTransitions + 1, which
/// client-go raises whenever the holder changes), and each accepted write under the newest grant
/// its writer had at that resourceVersion. Returns the observations and the writes whose writer
/// held no grant the watch saw (none are expected).
pub fn observations(seen: &Seen) -> (Vec<kube_fence_test_support::history::Observation>, usize) {
    use kube_fence_api::token::Token;
    use kube_fence_test_support::history::Observation;
    let token = |transitions: i32| Token::new(u64::try_from(transitions).unwrap_or(0) + 1).expect("a token");
    let mut out = Vec::new();
    let mut holders = seen.holders.clone();
    holders.sort();
    for (rv, holder, transitions) in &holders {
        if !holder.is_empty() {
            out.push(Observation::Grant { lease: LEASE.into(), holder: holder.clone(), token: token(*transitions), resource_version: *rv });
        }
    }
    let mut unmatched = 0;
    for (rv, object, writer) in &seen.writes {
        match holders.iter().rev().find(|(at, holder, _)| at < rv && holder == writer) {
            Some((_, _, transitions)) => out.push(Observation::Write {
                object: object.clone(),
                lease: LEASE.into(),
                token: token(*transitions),
                resource_version: *rv,
            }),
            None => unmatched += 1,
        }
    }
    (out, unmatched)
}
