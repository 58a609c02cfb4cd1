//! End to end: the real lease controller, the real fencing webhook and the worker library
//! together, as users run them.
//!
//! By default kube-fence runs in this process, scoped to each test's namespace (controller
//! watching that namespace only; webhook registered by a 127.0.0.1 URL for that namespace only).
//! With `KUBE_FENCE_E2E_INSTALLED=1` the tests start nothing and rely on a kube-fence installed
//! in the cluster (hack/kind-e2e.sh, the node suite): the same tests then prove the installed
//! Pods — webhook behind its Service, controller with in-cluster config and the chart's RBAC.

mod common;
#[path = "e2e/delegation.rs"]
mod delegation;
#[path = "e2e/leader.rs"]
mod leader;
#[path = "e2e/status.rs"]
mod status;

use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::{Api, ObjectMeta};
use kube_fence::admission::http::server::Metrics;
use kube_fence::admission::local::{LocalOptions, LocalWebhook};
use kube_fence::client::{AcquireOptions, Error, Leases};
use kube_fence::lease::controller::{self, ControllerOptions};
use prometheus_client::registry::Registry;

/// kube-fence for one test: in-process and scoped to the test namespace, or the installed one.
struct KubeFence {
    client: Client,
    ns: String,
    local: Option<(LocalWebhook, tokio::task::JoinHandle<()>)>,
}

fn installed() -> bool {
    std::env::var("KUBE_FENCE_E2E_INSTALLED").is_ok_and(|v| !v.is_empty() && v != "0")
}

impl KubeFence {
    async fn start(test: &str) -> KubeFence {
        let client = common::client().await;
        let ns = common::namespace(&client, test).await;
        let local = if installed() {
            None
        } else {
            let mut registry = Registry::default();
            let run = controller::run(
                client.clone(),
                ControllerOptions::new(format!("e2e-{test}")).namespace(&ns),
                &mut registry,
                futures::future::pending(),
            );
            let controller = tokio::spawn(async move {
                if let Err(err) = run.await {
                    panic!("controller failed: {err}");
                }
            });
            let metrics = Metrics::register(&mut registry);
            let mut options = LocalOptions::new(format!("kf-e2e-{ns}"));
            options.webhook.scope.only_namespaces = Some(vec![ns.clone()]);
            let hook = LocalWebhook::start(client.clone(), options, metrics, Arc::new(registry)).await.expect("start the webhook");
            Some((hook, controller))
        };
        let kf = KubeFence { client, ns, local };
        kf.wait_until_fenced().await;
        kf
    }

    /// The API server calls the webhook for this namespace.
    async fn wait_until_fenced(&self) {
        common::wait_fenced(&self.client, &self.ns, &Default::default(), common::Fencing::Judged, Duration::from_secs(60)).await;
    }

    async fn stop(mut self) {
        if let Some((hook, controller)) = self.local.take() {
            hook.stop(&self.client).await.expect("remove the webhook registration");
            controller.abort();
        }
    }
}

fn guarded_configmap(name: &str, lease: &str, writer: &str) -> ConfigMap {
    ConfigMap { data: Some([("writer".to_string(), writer.to_string())].into()), ..common::guarded_configmap(name, lease) }
}

/// The seed's failure, end to end with the worker library: A holds the lease and is paused after
/// its grant and before its write; its lease expires; B acquires and commits; A's write is let
/// go — and fails with `StaleToken { presented: A's token, recorded: B's token }`, every round.
#[tokio::test]
async fn a_paused_holder_is_fenced_off_with_a_typed_error() {
    let kf = KubeFence::start("e2e-pause").await;
    let leases = Leases::new(kf.client.clone(), &kf.ns);
    let configmaps: Api<ConfigMap> = Api::namespaced(kf.client.clone(), &kf.ns);
    let short = AcquireOptions::default().duration(Duration::from_secs(1)).timeout(Duration::from_secs(30));

    let first = leases.acquire("work", "setup", short.clone()).await.expect("first grant");
    first.create(&configmaps, &guarded_configmap("state", "work", "setup")).await.expect("fenced create with the newest token");
    leases.release(&first).await.expect("release");

    let rounds = 5;
    for round in 0..rounds {
        let a = leases.acquire("work", "worker-a", short.clone()).await.expect("A acquires");
        let mut a_view = configmaps.get("state").await.expect("A reads the state");
        // A pauses here (no heartbeat, no write) for longer than its lease.
        let b = leases.acquire("work", "worker-b", short.clone()).await.expect("B acquires once A's lease expired");
        assert!(b.token > a.token, "round {round}: B's token {} is greater than A's {}", b.token, a.token);
        let mut b_view = configmaps.get("state").await.expect("B reads the state");
        b_view.data.get_or_insert_default().insert("writer".into(), format!("worker-b-{round}"));
        b.replace(&configmaps, &b_view).await.expect("B's write commits");

        // A wakes up and sends its delayed write, based on what it read before pausing.
        a_view.metadata.resource_version = None; // even an unconditional write must be fenced
        a_view.data.get_or_insert_default().insert("writer".into(), format!("worker-a-{round}"));
        match a.replace(&configmaps, &a_view).await {
            Err(Error::StaleToken { presented, recorded }) => {
                assert_eq!((presented, recorded), (a.token, b.token), "round {round}: the rejection names both tokens");
            }
            other => panic!("round {round}: A's stale write must fail with StaleToken, got {other:?}"),
        }
        let stored = configmaps.get("state").await.expect("read back");
        assert_eq!(
            stored.data.unwrap_or_default().get("writer").cloned(),
            Some(format!("worker-b-{round}")),
            "round {round}: B's effect stuck"
        );
        leases.release(&b).await.expect("B releases");
    }

    // Each rejection is also a Warning Event on the guarded object (kubectl describe shows it).
    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(kf.client.clone(), &kf.ns);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let seen = events.list(&Default::default()).await.expect("list events");
        let stale = seen
            .items
            .iter()
            .find(|e| e.reason.as_deref() == Some("StaleToken") && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some("state"));
        if let Some(event) = stale {
            assert_eq!(event.type_.as_deref(), Some("Warning"));
            assert!(event.note.as_deref().unwrap_or_default().contains("presented token"), "{event:?}");
            break;
        }
        assert!(Instant::now() < deadline, "no StaleToken Event on the guarded ConfigMap within 15 s");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    kf.stop().await;
}

/// The rejection's Event is written for an object whose name is as long as a name may be (253
/// characters): the Event's own name, built from the object's, is kept a valid name (the API
/// server refused `<253 characters>.<moment>` before). Threat case: an honest but stale writer,
/// whose refusal an operator must be able to see on the object.
#[tokio::test]
async fn a_refusal_of_a_write_to_an_object_with_the_longest_name_is_an_event_on_it() {
    let kf = KubeFence::start("e2e-long-name").await;
    let leases = Leases::new(kf.client.clone(), &kf.ns);
    let configmaps: Api<ConfigMap> = Api::namespaced(kf.client.clone(), &kf.ns);
    let options = AcquireOptions::default().duration(Duration::from_secs(30)).timeout(Duration::from_secs(30));
    let name = format!("long-{}", "n".repeat(248));
    assert_eq!(name.len(), 253);

    let a = leases.acquire("work", "worker-a", options.clone()).await.expect("A acquires");
    a.create(&configmaps, &guarded_configmap(&name, "work", "worker-a")).await.expect("A creates");
    let mut a_view = configmaps.get(&name).await.expect("A reads");
    leases.release(&a).await.expect("A releases");
    let b = leases.acquire("work", "worker-b", options).await.expect("B acquires");
    let mut b_view = configmaps.get(&name).await.expect("B reads");
    b_view.data.get_or_insert_default().insert("writer".into(), "worker-b".into());
    b.replace(&configmaps, &b_view).await.expect("B writes");
    a_view.metadata.resource_version = None;
    a_view.data.get_or_insert_default().insert("writer".into(), "worker-a".into());
    assert!(matches!(a.replace(&configmaps, &a_view).await, Err(Error::StaleToken { .. })), "A's stale write is refused");

    let events: Api<k8s_openapi::api::events::v1::Event> = Api::namespaced(kf.client.clone(), &kf.ns);
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let seen = events.list(&Default::default()).await.expect("list events");
        let on_it = |e: &&k8s_openapi::api::events::v1::Event| {
            e.reason.as_deref() == Some("StaleToken") && e.regarding.as_ref().and_then(|r| r.name.as_deref()) == Some(name.as_str())
        };
        if seen.items.iter().any(|e| on_it(&e)) {
            break;
        }
        assert!(Instant::now() < deadline, "no StaleToken Event on the ConfigMap with a 253-character name within 15 s");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    kf.stop().await;
}

/// A stale worker cannot sneak in through a delete either: without a resourceVersion
/// precondition it is refused; with its stale view's resourceVersion it conflicts.
#[tokio::test]
async fn a_paused_holder_cannot_delete_what_a_newer_holder_wrote() {
    let kf = KubeFence::start("e2e-delete").await;
    let leases = Leases::new(kf.client.clone(), &kf.ns);
    let configmaps: Api<ConfigMap> = Api::namespaced(kf.client.clone(), &kf.ns);
    let short = AcquireOptions::default().duration(Duration::from_secs(1)).timeout(Duration::from_secs(30));

    let a = leases.acquire("work", "worker-a", short.clone()).await.expect("A acquires");
    let a_view = a.create(&configmaps, &guarded_configmap("state", "work", "a")).await.expect("A creates");
    let b = leases.acquire("work", "worker-b", short.clone()).await.expect("B acquires after A's lease expired");
    let mut b_view = configmaps.get("state").await.expect("B reads");
    b_view.data.get_or_insert_default().insert("writer".into(), "b".into());
    b.replace(&configmaps, &b_view).await.expect("B writes");

    let err = a.delete(&configmaps, &a_view).await.expect_err("A's delete of the version it saw must fail");
    assert!(matches!(err, Error::Conflict(_)), "a stale resourceVersion precondition conflicts: {err:?}");
    let err = configmaps.delete("state", &Default::default()).await.expect_err("a delete without a precondition is refused");
    assert!(err.to_string().contains("resourceVersion"), "the refusal says what is missing: {err}");
    assert!(configmaps.get_opt("state").await.expect("get").is_some(), "B's object survives");
    kf.stop().await;
}

/// `kubectl fence ...` works: the binary installed as `kubectl-fence` is a kubectl plugin.
#[tokio::test]
async fn kube_fence_works_as_a_kubectl_plugin() {
    let kf = KubeFence::start("e2e-plugin").await;
    let plugins = tempfile::tempdir().expect("tempdir");
    std::os::unix::fs::symlink(env!("CARGO_BIN_EXE_kube-fence"), plugins.path().join("kubectl-fence")).expect("symlink");
    let bin = kube_fence_testenv::binaries().expect("kubectl");
    let path = format!("{}:{}:{}", plugins.path().display(), bin.display(), std::env::var("PATH").unwrap_or_default());
    let kubeconfig = kube_fence_testenv::shared_kubeconfig();
    let ns = kf.ns.clone();
    // Off the runtime thread: the in-process controller must keep running while kubectl waits.
    let out = tokio::task::spawn_blocking(move || {
        Command::new(bin.join("kubectl"))
            .args(["fence", "lease", "acquire", "plugin", "--holder", "shell", "--duration", "10s", "-n", &ns])
            .env("PATH", &path)
            .env("KUBECONFIG", &kubeconfig)
            .output()
            .expect("run kubectl fence")
    })
    .await
    .expect("kubectl thread");
    assert!(out.status.success(), "kubectl fence lease acquire: {}", String::from_utf8_lossy(&out.stderr));
    let token: u64 = String::from_utf8_lossy(&out.stdout).trim().parse().expect("acquire prints the token alone");
    let lease = Leases::new(kf.client.clone(), &kf.ns).get("plugin").await.expect("lease exists");
    assert_eq!(lease.status.and_then(|s| s.token).map(|t| t.get()), Some(token));
    kf.stop().await;
}

/// The README's run command (its "Two commands"), exactly as written (`hack/run.sh --demo-only`), on a control plane
/// of its own: it must end with the stale write rejected.
#[test]
fn the_readme_demonstration_rejects_the_stale_write() {
    if installed() {
        return; // the demo starts kube-fence itself; nothing to prove against an installed one
    }
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new("bash")
        .arg(format!("{root}/hack/run.sh"))
        .arg("--demo-only")
        .env_remove("KUBECONFIG")
        .output()
        .expect("run hack/run.sh");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "hack/run.sh --demo-only failed:\n{stderr}");
    assert!(stderr.contains("denied the request: stale write"), "the API server's rejection is shown:\n{stderr}");
    assert!(stderr.contains("presented token") && stderr.contains("recorded token"), "the rejection names both tokens:\n{stderr}");
    assert!(stderr.contains("still says writer=worker-b"), "B's effect stuck:\n{stderr}");
}

/// Admission latency as a user sees it: guarded updates through the API server, timed, with
/// kube-fence in-process or installed (through its Service). Reported, never asserted.
#[tokio::test]
async fn guarded_update_latency_is_measured() {
    let kf = KubeFence::start("e2e-latency").await;
    let spec = kube_fence_api::LeaseSpec {
        fencing: Some(kube_fence_api::FencingPolicy { comparison: Some(kube_fence_api::Comparison::AllowEqual), enforcement: None }),
        ..Default::default()
    };
    Api::<kube_fence_api::Lease>::namespaced(kf.client.clone(), &kf.ns)
        .create(&Default::default(), &kube_fence_api::Lease::new("timed", spec))
        .await
        .expect("lease");
    let leases = Leases::new(kf.client.clone(), &kf.ns);
    let grant = leases
        .acquire("timed", "timer", AcquireOptions::default().duration(Duration::from_secs(120)).timeout(Duration::from_secs(30)))
        .await
        .expect("grant");
    let configmaps: Api<ConfigMap> = Api::namespaced(kf.client.clone(), &kf.ns);
    grant.create(&configmaps, &guarded_configmap("timed", "timed", "0")).await.expect("create");
    let mut took = Vec::new();
    for n in 0..200 {
        let started = Instant::now();
        let patch = kube::api::Patch::Merge(serde_json::json!({"data": {"writer": n.to_string()}}));
        grant.patch(&configmaps, "timed", &Default::default(), patch).await.expect("fenced update");
        took.push(started.elapsed());
    }
    took.sort();
    let at = |q: f64| took[((took.len() as f64 - 1.0) * q).round() as usize];
    eprintln!(
        "MEASURED guarded update through the API server ({}): p50 {:.2} ms, p99 {:.2} ms over {} updates",
        if installed() { "installed kube-fence, via its Service" } else { "kube-fence in-process, via 127.0.0.1" },
        at(0.5).as_secs_f64() * 1e3,
        at(0.99).as_secs_f64() * 1e3,
        took.len()
    );
    kf.stop().await;
}

/// Writers racing with tokens n and n+1 on one object: whatever order the API server commits
/// them in, the accepted history (read from a watch) never goes backwards.
#[tokio::test]
async fn racing_writers_never_move_an_object_backwards() {
    use futures::StreamExt;
    use kube::runtime::{WatchStreamExt, watcher};
    let kf = KubeFence::start("e2e-race").await;
    let leases = Leases::new(kf.client.clone(), &kf.ns);
    let configmaps: Api<ConfigMap> = Api::namespaced(kf.client.clone(), &kf.ns);
    let opts = AcquireOptions::default().duration(Duration::from_secs(30)).timeout(Duration::from_secs(30));
    let setup = leases.acquire("race", "setup", opts.clone()).await.expect("setup grant");
    setup.create(&configmaps, &guarded_configmap("raced", "race", "setup")).await.expect("create");
    leases.release(&setup).await.expect("release");

    let seen = Arc::new(std::sync::Mutex::new(Vec::<u64>::new()));
    // The newest version the watch delivered, so the test can wait for it to catch up.
    let watched = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let recorder = {
        let (seen, watched) = (seen.clone(), watched.clone());
        let stream = watcher(configmaps.clone(), watcher::Config::default().fields("metadata.name=raced")).applied_objects();
        tokio::spawn(async move {
            let mut stream = std::pin::pin!(stream);
            while let Some(Ok(cm)) = stream.next().await {
                let token = cm.metadata.annotations.as_ref().and_then(|a| a.get("kubefence.io/token")).and_then(|t| t.parse().ok());
                if let (Some(token), Ok(mut seen)) = (token, seen.lock()) {
                    seen.push(token);
                }
                let version = cm.metadata.resource_version.as_deref().and_then(|v| v.parse().ok()).unwrap_or(0);
                watched.fetch_max(version, std::sync::atomic::Ordering::SeqCst);
            }
        })
    };
    let (mut low_won, mut low_rejected) = (0, 0);
    for round in 0..10 {
        let low = leases.acquire("race", "low", opts.clone()).await.expect("low grant");
        leases.release(&low).await.expect("release");
        let high = leases.acquire("race", "high", opts.clone()).await.expect("high grant");
        leases.release(&high).await.expect("release");
        let write = |grant: kube_fence::client::Grant, who: &'static str| {
            let configmaps = configmaps.clone();
            async move {
                grant
                    .patch(
                        &configmaps,
                        "raced",
                        &Default::default(),
                        kube::api::Patch::Merge(serde_json::json!({"data": {"writer": format!("{who}-{round}")}})),
                    )
                    .await
            }
        };
        let (l, h) = tokio::join!(write(low.clone(), "low"), write(high.clone(), "high"));
        h.unwrap_or_else(|e| panic!("round {round}: the higher token is always admitted: {e}"));
        match l {
            Ok(_) => low_won += 1,
            Err(Error::StaleToken { .. }) => low_rejected += 1,
            Err(e) => panic!("round {round}: unexpected error {e}"),
        }
    }
    // The watch has delivered every accepted version once it delivered the current one.
    let current: u64 = configmaps.get("raced").await.expect("get").metadata.resource_version.and_then(|v| v.parse().ok()).unwrap_or(0);
    let deadline = Instant::now() + Duration::from_secs(30);
    while watched.load(std::sync::atomic::Ordering::SeqCst) < current {
        assert!(Instant::now() < deadline, "the watch did not deliver version {current} within 30 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    recorder.abort();
    let history = seen.lock().map(|s| s.clone()).unwrap_or_default();
    eprintln!(
        "MEASURED racing writers: low token landed first {low_won} times, rejected {low_rejected} times; {} accepted versions watched",
        history.len()
    );
    assert!(history.windows(2).all(|w| w[0] < w[1]), "the accepted history is strictly increasing: {history:?}");
    kf.stop().await;
}

/// Kubernetes' own controllers keep working on guarded objects: the garbage collector removes a
/// guarded dependent whose owner is gone, and a namespace full of guarded objects is deleted.
#[tokio::test]
async fn garbage_collection_and_namespace_deletion_complete() {
    use k8s_openapi::api::core::v1::Namespace;
    use kube::api::{DeleteParams, PostParams};
    let kf = KubeFence::start("e2e-gc").await;
    let leases = Leases::new(kf.client.clone(), &kf.ns);
    let configmaps: Api<ConfigMap> = Api::namespaced(kf.client.clone(), &kf.ns);
    let grant = leases
        .acquire("gc", "worker", AcquireOptions::default().duration(Duration::from_secs(60)).timeout(Duration::from_secs(30)))
        .await
        .expect("grant");
    let owner = configmaps
        .create(
            &PostParams::default(),
            &ConfigMap { metadata: ObjectMeta { name: Some("owner".into()), ..Default::default() }, ..Default::default() },
        )
        .await
        .expect("owner");
    let mut dependent = guarded_configmap("dependent", "gc", "worker");
    dependent.metadata.owner_references = Some(vec![k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
        api_version: "v1".into(),
        kind: "ConfigMap".into(),
        name: "owner".into(),
        uid: owner.metadata.uid.clone().expect("uid"),
        ..Default::default()
    }]);
    grant.create(&configmaps, &dependent).await.expect("guarded dependent");
    grant
        .create(&configmaps, &guarded_configmap("bystander", "gc", "worker"))
        .await
        .expect("another guarded object, for the namespace deletion");
    configmaps.delete("owner", &DeleteParams::background()).await.expect("delete owner");
    let took = common::wait_gone(
        &configmaps,
        "dependent",
        Instant::now(),
        Duration::from_secs(60),
        "the garbage collector removes the guarded dependent",
    )
    .await;
    eprintln!("MEASURED garbage collection of a guarded dependent: {took:?}");

    let namespaces: Api<Namespace> = Api::all(kf.client.clone());
    let ns = kf.ns.clone();
    let started = Instant::now();
    namespaces.delete(&ns, &DeleteParams::default()).await.expect("delete namespace");
    let took =
        common::wait_gone(&namespaces, &ns, started, Duration::from_secs(120), "the namespace with guarded objects is deleted").await;
    eprintln!("MEASURED deletion of a namespace holding guarded objects: {took:?}");
    kf.stop().await;
}
