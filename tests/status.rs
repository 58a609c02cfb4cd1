//! `kube-fence status` against the shared control plane: a FencedController and a kube-fence
//! Lease written as the admin, Warning Events about them (in the last hour and older, counted and
//! not, and Events about other objects that must not count), then the binary's table and JSON,
//! through `kubectl fence` too, in the kubeconfig's namespace by default, and its one-line error
//! for a user who may not list what it shows. (The CRDs cannot be removed from the shared cluster:
//! the "not served" message is tested in `src/cli/error.rs`.)

mod common;

use std::path::Path;
use std::process::{Command, Output};

use k8s_openapi::api::core::v1::ObjectReference;
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, ListParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube_fence::cli::status::Kind;
use kube_fence_api::{FenceMode, FencedController, FencedControllerSpec, fence_events};
use serde_json::{Value, json};

const KUBE_FENCE: &str = env!("CARGO_BIN_EXE_kube-fence");

/// `program args` with `kubeconfig`, and nothing of this process's cluster settings.
fn run(program: &Path, kubeconfig: &Path, home: &Path, args: &[&str], path: Option<&str>) -> Output {
    let mut cmd = Command::new(program);
    cmd.args(args)
        .env("HOME", home)
        .env("KUBECONFIG", kubeconfig)
        .env_remove("KUBE_FENCE_NAMESPACE")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("RUST_LOG");
    if let Some(path) = path {
        cmd.env("PATH", path);
    }
    cmd.output().unwrap_or_else(|e| panic!("running {}: {e}", program.display()))
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).trim().to_string()
}

fn ok(out: Output, what: &str) -> String {
    assert!(out.status.success(), "{what}: exit {:?}: {}", out.status.code(), text(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A Warning Event about `regarding` in `ns`, as the webhook writes one, `age` ago.
fn warning(ns: &str, n: usize, regarding: (&str, &str, &str), reason: &str, age: SignedDuration) -> Event {
    let (api_version, kind, name) = regarding;
    Event {
        metadata: ObjectMeta { name: Some(format!("status-test-{n}")), namespace: Some(ns.into()), ..Default::default() },
        regarding: Some(ObjectReference {
            api_version: Some(api_version.into()),
            kind: Some(kind.into()),
            namespace: Some(ns.into()),
            name: Some(name.into()),
            ..Default::default()
        }),
        type_: Some("Warning".into()),
        reason: Some(reason.into()),
        action: Some("Update".into()),
        note: Some("written by tests/status.rs".into()),
        event_time: Some(MicroTime(Timestamp::now() - age)),
        reporting_controller: Some("kube-fence-webhook".into()),
        reporting_instance: Some("status-test".into()),
        ..Default::default()
    }
}

/// The row of `kind`/`name` in `ns` of a `status -o json` document.
fn row<'a>(rows: &'a Value, ns: &str, kind: &str, name: &str) -> &'a Value {
    rows.as_array()
        .expect("a JSON array")
        .iter()
        .find(|r| r["namespace"] == ns && r["kind"] == kind && r["name"] == name)
        .unwrap_or_else(|| panic!("no {kind} {ns}/{name} in {rows:#}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_shows_fences_and_leases_with_the_last_hours_refusals() {
    let client = common::client().await;
    let ns = common::namespace(&client, "status").await;
    let kubeconfig = common::kubeconfig().await;
    let home = tempfile::tempdir().expect("an empty HOME");
    let home = home.path();

    // A fence, Ready and held, as the admin and the kube-fence controller would have written it.
    let fences: Api<FencedController> = Api::namespaced(client.clone(), &ns);
    let spec = FencedControllerSpec {
        lease: "app-leader".into(),
        service_accounts: vec!["app".into()],
        exempt: Vec::new(),
        mode: FenceMode::Enforce,
    };
    fences.create(&PostParams::default(), &FencedController::new("app", spec)).await.expect("create the FencedController");
    let status = json!({"status": {"holder": "app-0", "conditions": [{
        "type": "Ready", "status": "True", "reason": kube_fence_api::ready::ENFORCING, "message": "judging",
        "lastTransitionTime": Timestamp::now().to_string()}]}});
    fences.patch_status("app", &PatchParams::default(), &Patch::Merge(&status)).await.expect("write the fence's status");
    // A kube-fence Lease held with token 7 (its status written as the admin).
    common::grants::grant(&client, &ns, "jobs", "worker-a", 7).await;

    // In the last hour: the fence refused two writes and warned of one, the Lease refused one.
    // Older than an hour, of another kind or not a refusal: not counted.
    let fence = ("kubefence.io/v1alpha1", "FencedController", "app");
    let lease = ("kubefence.io/v1alpha1", "Lease", "jobs");
    let minutes = SignedDuration::from_mins;
    let events = [
        warning(&ns, 0, fence, fence_events::REFUSED, minutes(1)),
        warning(&ns, 1, fence, fence_events::REFUSED, minutes(30)),
        warning(&ns, 2, fence, fence_events::WOULD_REFUSE, minutes(2)),
        warning(&ns, 3, fence, fence_events::REFUSED, minutes(120)),
        warning(&ns, 4, fence, fence_events::WOULD_REFUSE, minutes(61)),
        warning(&ns, 5, lease, "StaleToken", minutes(3)),
        warning(&ns, 6, ("coordination.k8s.io/v1", "Lease", "jobs"), fence_events::REFUSED, minutes(3)),
        warning(&ns, 7, lease, "TokenUnavailable", minutes(3)),
    ];
    let api: Api<Event> = Api::namespaced(client.clone(), &ns);
    for event in &events {
        api.create(&PostParams::default(), event).await.expect("create an Event");
    }

    // The API server filters Events by `regarding` itself (status falls back to listing them all
    // where it cannot): the fence's five, none of the Lease's.
    let selector = kube_fence::cli::status::event_selector(Kind::FencedController, &["app".to_string()]);
    let selected = api.list(&ListParams::default().fields(&selector)).await.expect("the API server takes the field selector");
    assert_eq!(selected.items.len(), 5, "{selector}: {:?}", selected.items.iter().map(|e| &e.reason).collect::<Vec<_>>());

    let table = ok(run(Path::new(KUBE_FENCE), &kubeconfig, home, &["status", "-n", &ns], None), "kube-fence status");
    eprintln!("{table}");
    let lines: Vec<Vec<&str>> = table.lines().map(|l| l.split_whitespace().collect()).collect();
    assert_eq!(
        lines.first().map(Vec::as_slice),
        Some(&["KIND", "NAMESPACE", "NAME", "LEASE", "MODE", "HOLDER", "READY", "PHASE", "TOKEN", "REFUSED-1H", "WARNED-1H"][..])
    );
    assert_eq!(lines.len(), 3, "a header, the fence and the Lease:\n{table}");
    assert_eq!(lines[1], ["FencedController", &ns, "app", "app-leader", "Enforce", "app-0", "True/Enforcing", "-", "-", "2", "1"]);
    assert_eq!(lines[2], ["Lease", &ns, "jobs", "-", "Enforce", "worker-a", "-", "Held", "7", "1", "0"]);

    let json = ok(run(Path::new(KUBE_FENCE), &kubeconfig, home, &["status", "-n", &ns, "-o", "json"], None), "status -o json");
    let rows: Value = serde_json::from_str(&json).expect("status -o json is JSON");
    let fence_row = row(&rows, &ns, "FencedController", "app");
    assert_eq!((&fence_row["refusedLastHour"], &fence_row["warnedLastHour"]), (&json!(2), &json!(1)), "{fence_row:#}");
    assert_eq!(fence_row["ready"], json!({"status": "True", "reason": "Enforcing"}));
    assert_eq!(fence_row["serviceAccounts"], json!(["app"]));
    let lease_row = row(&rows, &ns, "Lease", "jobs");
    assert_eq!((&lease_row["refusedLastHour"], &lease_row["warnedLastHour"]), (&json!(1), &json!(0)), "{lease_row:#}");
    assert_eq!((&lease_row["token"], &lease_row["phase"], &lease_row["holder"]), (&json!(7), &json!("Held"), &json!("worker-a")));

    // The kubeconfig context's namespace by default, and every namespace with -A.
    let in_ns = common::kubeconfig_variant(home, "in-ns", |config| {
        for context in common::entries(config, "contexts", "context") {
            context.insert("namespace".into(), ns.clone().into());
        }
    });
    let by_default = ok(run(Path::new(KUBE_FENCE), &in_ns, home, &["status", "-o", "json"], None), "status in the context's ns");
    assert_eq!(serde_json::from_str::<Value>(&by_default).expect("JSON"), rows);
    let all = ok(run(Path::new(KUBE_FENCE), &kubeconfig, home, &["status", "-A", "-o", "json"], None), "status -A");
    let all: Value = serde_json::from_str(&all).expect("JSON");
    assert_eq!(row(&all, &ns, "FencedController", "app"), fence_row);
    assert_eq!(row(&all, &ns, "Lease", "jobs")["refusedLastHour"], json!(1));

    // `kubectl fence status`: the binary installed as `kubectl-fence` is a kubectl plugin.
    let plugins = tempfile::tempdir().expect("tempdir");
    std::os::unix::fs::symlink(KUBE_FENCE, plugins.path().join("kubectl-fence")).expect("symlink");
    let bin = tokio::task::spawn_blocking(kube_fence_testenv::binaries).await.expect("thread").expect("kubectl");
    let path = format!("{}:{}:{}", plugins.path().display(), bin.display(), std::env::var("PATH").unwrap_or_default());
    let plugin = run(&bin.join("kubectl"), &kubeconfig, home, &["fence", "status", "-n", &ns, "-o", "json"], Some(&path));
    let plugin: Value = serde_json::from_str(&ok(plugin, "kubectl fence status")).expect("JSON");
    assert_eq!(plugin, rows);

    // A namespace with neither: said on stderr, an empty array in JSON.
    let empty = common::namespace(&client, "status-empty").await;
    let out = run(Path::new(KUBE_FENCE), &kubeconfig, home, &["status", "-n", &empty], None);
    assert!(out.status.success() && out.stdout.is_empty(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stderr), format!("No FencedControllers or kube-fence Leases found in namespace {empty:?}."));
    let json = ok(run(Path::new(KUBE_FENCE), &kubeconfig, home, &["status", "-n", &empty, "-o", "json"], None), "json");
    assert_eq!(json.trim(), "[]");

    // A user without RBAC: one line, exit status 4, naming what status lists.
    let nobody = common::kubeconfig_variant(home, "nobody", |config| {
        for user in common::entries(config, "users", "user") {
            user.insert("as".into(), "kube-fence-test-nobody".into());
        }
    });
    let out = run(Path::new(KUBE_FENCE), &nobody, home, &["status", "-n", &ns], None);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(out.stdout.is_empty(), "{}", text(&out.stdout));
    assert!(
        stderr.starts_with("kube-fence: error: fencedcontrollers.kubefence.io is forbidden: User \"kube-fence-test-nobody\" cannot list"),
        "{stderr}"
    );
    assert!(
        stderr.contains(&format!(
            "`kube-fence status` lists fencedcontrollers.kubefence.io, leases.kubefence.io and events.events.k8s.io in namespace {ns:?}: ask a cluster admin"
        )),
        "{stderr}"
    );
    assert!(!stderr.contains("Status {") && !stderr.contains("Some("), "{stderr}");
}
