//! The fencing webhook on a real control plane (etcd + kube-apiserver + kube-controller-manager).
//!
//! Each test serves the webhook in-process on 127.0.0.1 with a CA it makes, registers it by URL
//! with a namespaceSelector matching only its own namespace (or an object label of its own), and
//! simulates grants by writing Lease status directly as admin — the lease controller is not
//! needed to judge writes.

#[path = "webhook/attacks.rs"]
mod attacks;
mod common;
#[path = "webhook/fenced_policy.rs"]
mod fenced_policy;
#[path = "webhook/fenced_status.rs"]
mod fenced_status;
#[path = "webhook/holders.rs"]
mod holders;
#[path = "webhook/leader.rs"]
mod leader;
#[path = "webhook/neighbours.rs"]
mod neighbours;
#[path = "webhook/scheduler.rs"]
mod scheduler;
#[path = "webhook/writers.rs"]
mod writers;

use common::Fencing;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::TryStreamExt;
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::api::{Api, ApiResource, DeleteParams, DynamicObject, Patch, PatchParams, PostParams, Preconditions, WatchEvent, WatchParams};
use kube::core::Status;
use kube::{Client, Resource, ResourceExt};
use kube_fence::admission::http::server::Metrics;
use kube_fence::admission::local::{LocalOptions, LocalWebhook};
use kube_fence_api::Lease;
use prometheus_client::registry::Registry;
use serde_json::json;

const LEASE: &str = "kubefence.io/lease";
const TOKEN: &str = "kubefence.io/token";

struct Fixture {
    client: Client,
    ns: String,
    hook: Option<LocalWebhook>,
    registry: Arc<Registry>,
    /// With `KF_POLICY_PATH=1`: stops the policy path's parameter keeper when dropped.
    _params: Option<tokio_util::sync::DropGuard>,
}

impl Fixture {
    async fn new(test: &str) -> Fixture {
        let client = common::client().await;
        let ns = common::namespace(&client, test).await;
        let mut options = LocalOptions::new(format!("kf-test-{ns}"));
        options.webhook.scope.only_namespaces = Some(vec![ns.clone()]);
        options.policy_path = common::policy_path();
        Fixture::with_options(client, ns, options).await
    }

    async fn with_options(client: Client, ns: String, options: LocalOptions) -> Fixture {
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        let registry = Arc::new(registry);
        let policy_path = options.policy_path;
        let hook = LocalWebhook::start(client.clone(), options, metrics, registry.clone()).await.expect("start the webhook");
        // The parameters are the lease controller's job; the tests grant by writing Lease status,
        // so they run only the parameter keeper.
        let params = policy_path.then(|| {
            let stop = tokio_util::sync::CancellationToken::new();
            tokio::spawn(kube_fence::lease::params::maintain(client.clone(), Some(ns.clone()), stop.clone()));
            stop.drop_guard()
        });
        let f = Fixture { client, ns, hook: Some(hook), registry, _params: params };
        f.wait_enforced(&BTreeMap::new()).await;
        if policy_path {
            common::wait_policy_path(&f.client, &f.ns, Duration::from_secs(30)).await;
        }
        f
    }

    fn leases(&self) -> Api<Lease> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    fn api<K: Resource<DynamicType = ()>>(&self) -> Api<DynamicObject> {
        Api::namespaced_with(self.client.clone(), &self.ns, &ApiResource::erase::<K>(&()))
    }

    /// Waits until the API server calls this test's webhook for the namespace's guarded
    /// objects (those carrying `extra` labels too).
    async fn wait_enforced(&self, extra: &BTreeMap<String, String>) {
        common::wait_fenced(&self.client, &self.ns, extra, Fencing::Judged, Duration::from_secs(30)).await;
    }

    /// Simulates a grant: the lease says `holder` holds it with `token` (status written as admin).
    async fn grant(&self, lease: &str, holder: &str, token: u64) {
        common::grant(&self.client, &self.ns, lease, holder, token).await;
    }

    /// Grants lease `work` to `a` with `token` and creates the guarded ConfigMap `name` with it.
    async fn create_guarded(&self, name: &str, token: u64) -> DynamicObject {
        self.grant("work", "a", token).await;
        self.api::<ConfigMap>()
            .create(&PostParams::default(), &configmap(name, "work", token))
            .await
            .expect("create the guarded object with the lease's token")
    }

    async fn set_policy(&self, lease: &str, policy: serde_json::Value) {
        self.leases()
            .patch(lease, &PatchParams::default(), &Patch::Merge(&json!({"spec": {"fencing": policy}})))
            .await
            .expect("set fencing policy");
    }

    async fn stop(mut self) {
        if let Some(hook) = self.hook.take() {
            hook.stop(&self.client).await.expect("remove the registration");
        }
    }
}

/// A fenced write: a merge patch that stamps `token` and changes `writer`.
fn write(token: Option<u64>, writer: &str) -> serde_json::Value {
    json!({"metadata": {"annotations": {TOKEN: token.map(|t| t.to_string())}, "labels": {"writer": writer}}})
}

/// A merge patch, retried while the policy path's parameter cache has not seen its token yet
/// (as the client library does; a no-op with the policy path off).
async fn patch(api: &Api<DynamicObject>, name: &str, body: &serde_json::Value) -> Result<DynamicObject, kube::Error> {
    let params = PatchParams::default();
    let body = Patch::Merge(body);
    kube_fence::client::retry_unseen_token(|| api.patch(name, &params, &body)).await
}

fn token_of(obj: &DynamicObject) -> Option<u64> {
    obj.metadata.annotations.as_ref()?.get(TOKEN)?.parse().ok()
}

fn guarded_meta(name: &str, lease: &str, token: u64) -> serde_json::Value {
    json!({"name": name, "labels": {LEASE: lease}, "annotations": {TOKEN: token.to_string()}})
}

fn configmap(name: &str, lease: &str, token: u64) -> DynamicObject {
    serde_json::from_value(
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": guarded_meta(name, lease, token), "data": {"k": "v"}}),
    )
    .unwrap()
}

fn deployment(name: &str, lease: &str, token: u64) -> DynamicObject {
    serde_json::from_value(json!({
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": guarded_meta(name, lease, token),
        "spec": {"replicas": 0, "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": [{"name": "c", "image": "registry.invalid/none"}]}}}
    }))
    .unwrap()
}

/// A kube-fence Lease used as an ordinary guarded custom resource (bound to another lease).
fn custom_resource(name: &str, lease: &str, token: u64) -> DynamicObject {
    serde_json::from_value(
        json!({"apiVersion": "kubefence.io/v1alpha1", "kind": "Lease", "metadata": guarded_meta(name, lease, token), "spec": {}}),
    )
    .unwrap()
}

/// The pause test: A is granted n and pauses before its write; the lease moves on to B with
/// n+1 and B commits; A's write is released and must be rejected — every time.
async fn pause_test(f: &Fixture, api: Api<DynamicObject>, object: DynamicObject, rounds: u64) {
    let name = object.metadata.name.clone().unwrap();
    let mut token = 1_000;
    f.grant("work", "a", token).await;
    api.create(&PostParams::default(), &object).await.expect("create the guarded object with the current token");
    let mut rejected = 0;
    for _ in 0..rounds {
        let n = token + 1;
        f.grant("work", "a", n).await; // A acquires: token n
        let a_write = write(Some(n), "a"); // ... and pauses before sending it
        f.grant("work", "b", n + 1).await; // A's lease expires; B acquires: n+1
        patch(&api, &name, &write(Some(n + 1), "b")).await.expect("B's write is admitted");
        let Status { code, message, .. } = common::rejected(patch(&api, &name, &a_write).await); // A resumes
        assert_eq!(code, 409, "{message}");
        assert!(message.contains(&format!("presented token {n}")) && message.contains(&format!("recorded token {}", n + 1)), "{message}");
        assert!(
            message.contains(&format!("{}/work", f.ns)) && message.contains("StaleToken") || message.contains("stale write"),
            "{message}"
        );
        rejected += 1;
        token = n + 1;
    }
    assert_eq!(rejected, rounds);
    let stored = api.get(&name).await.unwrap();
    assert_eq!(token_of(&stored), Some(token));
    assert_eq!(stored.labels().get("writer").map(String::as_str), Some("b"));
}

#[rstest::rstest]
#[case::configmaps("pause-cm", ApiResource::erase::<ConfigMap>(&()), configmap("state", "work", 1_000))]
#[case::deployment("pause-deploy", ApiResource::erase::<Deployment>(&()), deployment("app", "work", 1_000))]
#[case::custom_resource("pause-cr", ApiResource::erase::<Lease>(&()), custom_resource("guarded", "work", 1_000))]
#[tokio::test]
async fn pause_test_on(#[case] test: &str, #[case] resource: ApiResource, #[case] object: DynamicObject) {
    let f = Fixture::new(test).await;
    pause_test(&f, Api::namespaced_with(f.client.clone(), &f.ns, &resource), object, 100).await;
    f.stop().await;
}

/// Two writers race with n and n+1 on one object; the history a watch sees never goes back.
#[tokio::test]
async fn racing_writers_never_move_the_recorded_token_backwards() {
    let f = Fixture::new("race").await;
    let api = f.api::<ConfigMap>();
    let created = f.create_guarded("state", 10).await;
    let rv = created.metadata.resource_version.clone().unwrap();
    let rounds = 60u64;
    let last = 10 + 2 * rounds; // the last round's n+1

    let watch_api = api.clone();
    let history = tokio::spawn(async move {
        let stream = watch_api.watch(&WatchParams::default().fields("metadata.name=state").timeout(120), &rv).await.expect("watch");
        let mut stream = std::pin::pin!(stream);
        let mut tokens = vec![10];
        while let Some(event) = stream.try_next().await.expect("watch event") {
            if let WatchEvent::Modified(obj) = event {
                let t = token_of(&obj).expect("every accepted write carries a token");
                tokens.push(t);
                if t == last {
                    break;
                }
            }
        }
        tokens
    });

    let (mut low_won, mut low_lost) = (0, 0);
    for round in 0..rounds {
        let n = 10 + 2 * round + 1;
        f.grant("work", "b", n + 1).await; // both n and n+1 were issued; n+1 is newer
        let (a, b) = (write(Some(n), "a"), write(Some(n + 1), "b"));
        let (low, high) = tokio::join!(patch(&api, "state", &a), patch(&api, "state", &b));
        high.expect("the newest token is always admitted");
        match low {
            Ok(_) => low_won += 1,
            Err(kube::Error::Api(e)) if e.code == 409 => low_lost += 1,
            Err(e) => panic!("unexpected error: {e}"),
        }
    }
    let tokens = tokio::time::timeout(Duration::from_secs(60), history).await.expect("watch saw the last write").unwrap();
    eprintln!("race: {rounds} rounds, low token landed first {low_won} times, rejected {low_lost} times; history {} writes", tokens.len());
    assert!(tokens.windows(2).all(|w| w[0] < w[1]), "history went backwards: {tokens:?}");
    assert_eq!(tokens.last(), Some(&last));
    f.stop().await;
}

#[tokio::test]
async fn create_after_delete_with_a_stale_token_is_rejected() {
    let f = Fixture::new("recreate").await;
    let api = f.api::<ConfigMap>();
    let created = f.create_guarded("state", 5).await;
    let rv = created.metadata.resource_version.clone();
    api.delete("state", &DeleteParams { preconditions: Some(Preconditions { resource_version: rv, uid: None }), ..Default::default() })
        .await
        .expect("delete with precondition");
    f.grant("work", "b", 6).await;
    let Status { code, message, .. } = common::rejected(api.create(&PostParams::default(), &configmap("state", "work", 5)).await);
    assert_eq!(code, 409, "{message}");
    assert!(message.contains("presented token 5") && message.contains("recorded token 6"), "{message}");
    // A token the lease has not issued is not accepted either, nor a missing one.
    let Status { code, message, .. } = common::rejected(api.create(&PostParams::default(), &configmap("state", "work", 7)).await);
    assert_eq!(code, 403, "{message}");
    assert!(message.contains("not issued"), "{message}");
    api.create(&PostParams::default(), &configmap("state", "work", 6)).await.expect("create with the newest token");
    f.stop().await;
}

#[tokio::test]
async fn delete_needs_a_resource_version_precondition() {
    let f = Fixture::new("delete").await;
    let api = f.api::<ConfigMap>();
    let created = f.create_guarded("state", 5).await;
    let e = common::rejected(api.delete("state", &DeleteParams::default()).await);
    assert_eq!(e.code, 403, "an unconditional delete is denied: {e:?}");
    assert!(e.message.contains("resourceVersion precondition"), "{}", e.message);
    let rv = created.metadata.resource_version.clone();
    api.delete("state", &DeleteParams { preconditions: Some(Preconditions { resource_version: rv, uid: None }), ..Default::default() })
        .await
        .expect("delete of the version read");
    f.stop().await;
}

#[tokio::test]
async fn rebinding_unguarding_and_malformed_tokens() {
    let f = Fixture::new("binding").await;
    let api = f.api::<ConfigMap>();
    f.create_guarded("state", 5).await;
    f.grant("other", "a", 50).await;
    f.grant("work", "a", 8).await;

    // Changing the bound lease: never, whatever the token.
    let Status { code, message, .. } =
        common::rejected(patch(&api, "state", &json!({"metadata": {"labels": {LEASE: "other"}, "annotations": {TOKEN: "50"}}})).await);
    assert_eq!(code, 403, "{message}");
    assert!(message.contains("never allowed"), "{message}");

    // Malformed tokens are denied, naming the problem.
    for (raw, names) in [
        ("", "empty"),
        (" 6", "whitespace"),
        ("06", "leading zero"),
        ("+6", "sign"),
        ("6.0", "not a decimal"),
        ("0x6", "not a decimal"),
        ("9223372036854775808", "larger than"),
        ("\u{0666}", "not a decimal"),
    ] {
        let Status { code, message, .. } =
            common::rejected(patch(&api, "state", &json!({"metadata": {"annotations": {TOKEN: raw}}})).await);
        assert_eq!(code, 400, "{raw:?}: {message}");
        assert!(message.contains(names), "{raw:?}: {message}");
    }
    let Status { code, message, .. } = common::rejected(patch(&api, "state", &write(None, "x")).await);
    assert_eq!(code, 403, "missing token: {message}");

    // Unguarding is an UPDATE like any other: the stale token is refused, a fresh one admitted.
    let Status { code, message, .. } = common::rejected(patch(&api, "state", &json!({"metadata": {"labels": {LEASE: null}}})).await);
    assert_eq!(code, 409, "{message}");
    patch(&api, "state", &json!({"metadata": {"labels": {LEASE: null}, "annotations": {TOKEN: "6"}}}))
        .await
        .expect("unguard with a valid token");
    // Unguarded now: written freely (the webhook is not even called).
    patch(&api, "state", &write(None, "anyone")).await.expect("unguarded write");
    // Guarding it again is a CREATE-strength check: the lease's newest token only.
    let Status { code, message, .. } =
        common::rejected(patch(&api, "state", &json!({"metadata": {"labels": {LEASE: "work"}, "annotations": {TOKEN: "7"}}})).await);
    assert_eq!(code, 409, "{message}");
    patch(&api, "state", &json!({"metadata": {"labels": {LEASE: "work"}, "annotations": {TOKEN: "8"}}}))
        .await
        .expect("guard with the newest token");
    f.stop().await;
}

/// Warn mode: set when a lease is created (a rollout), it admits stale writes with a warning
/// and counts them; it can be tightened to Enforce, never relaxed back (see attacks.rs).
#[tokio::test]
async fn warn_mode_admits_with_a_warning_until_tightened() {
    let f = Fixture::new("modes").await;
    let api = f.api::<ConfigMap>();
    let warn: Lease = serde_json::from_value(json!({
        "apiVersion": "kubefence.io/v1alpha1", "kind": "Lease", "metadata": {"name": "work"},
        "spec": {"fencing": {"enforcement": "Warn"}}
    }))
    .unwrap();
    f.leases().create(&PostParams::default(), &warn).await.expect("a lease created in Warn mode");
    f.grant("work", "a", 5).await;
    api.create(&PostParams::default(), &configmap("state", "work", 5)).await.unwrap();
    patch(&api, "state", &write(Some(3), "old")).await.expect("Warn admits a stale write");
    let metrics = kube_fence::telemetry::render(&f.registry);
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("kube_fence_webhook_decisions_total") && l.contains("verdict=\"warned\"") && l.contains("StaleToken")),
        "{metrics}"
    );
    // (Warn admitted the stale write, so the object now records 3: Warn is for rollouts only.)
    f.set_policy("work", json!({"enforcement": "Enforce"})).await;
    // The tightened policy is read with a quorum read while the cache still says Warn.
    assert_eq!(common::rejected(patch(&api, "state", &write(Some(2), "old")).await).code, 409);
    f.stop().await;
}

/// Cascading deletion by the garbage collector, and namespace deletion by the namespace
/// controller, complete for guarded objects (both are exempt identities).
#[tokio::test]
async fn garbage_collection_and_namespace_deletion_complete() {
    let f = Fixture::new("gc").await;
    let cms: Api<ConfigMap> = Api::namespaced(f.client.clone(), &f.ns);
    let owner = cms
        .create(
            &PostParams::default(),
            &ConfigMap { metadata: kube::api::ObjectMeta { name: Some("owner".into()), ..Default::default() }, ..Default::default() },
        )
        .await
        .unwrap();
    f.grant("work", "a", 5).await;
    let mut dependent = configmap("dependent", "work", 5);
    dependent.metadata.owner_references = Some(vec![k8s_openapi::apimachinery::pkg::apis::meta::v1::OwnerReference {
        api_version: "v1".into(),
        kind: "ConfigMap".into(),
        name: "owner".into(),
        uid: owner.metadata.uid.clone().unwrap(),
        ..Default::default()
    }]);
    f.api::<ConfigMap>().create(&PostParams::default(), &dependent).await.unwrap();
    cms.delete("owner", &DeleteParams::background()).await.unwrap();
    let took = common::wait_gone(
        &cms,
        "dependent",
        Instant::now(),
        Duration::from_secs(90),
        "the garbage collector deletes the guarded dependent",
    )
    .await;
    eprintln!("gc: guarded dependent collected {took:?} after its owner was deleted");

    // A namespace full of guarded objects of several kinds.
    for i in 0..5 {
        f.api::<ConfigMap>().create(&PostParams::default(), &configmap(&format!("cm-{i}"), "work", 5)).await.unwrap();
    }
    f.api::<Deployment>().create(&PostParams::default(), &deployment("app", "work", 5)).await.unwrap();
    f.api::<Lease>().create(&PostParams::default(), &custom_resource("guarded", "work", 5)).await.unwrap();
    let namespaces: Api<Namespace> = Api::all(f.client.clone());
    namespaces.delete(&f.ns, &DeleteParams::default()).await.unwrap();
    let took = common::wait_gone(&namespaces, &f.ns, Instant::now(), Duration::from_secs(120), "the namespace is deleted").await;
    eprintln!("namespace deletion with guarded objects took {took:?}");
    f.stop().await;
}

/// With the webhook down, guarded writes fail closed; unguarded writes and kube-system do not
/// depend on it. The registration uses the production namespaceSelector (system namespaces
/// excluded) and is scoped by an extra object label to this test's objects, so other tests
/// running meanwhile are never affected; it is removed at the end.
#[tokio::test]
async fn webhook_down_fails_closed_but_spares_system_and_unguarded_objects() {
    let client = common::client().await;
    let ns = common::namespace(&client, "fail-closed").await;
    let scope: BTreeMap<String, String> = [("kubefence.io/test-scope".to_string(), ns.clone())].into();
    let mut options = LocalOptions::new(format!("kf-test-{ns}"));
    options.extra_object_labels = scope.clone();
    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    let hook = LocalWebhook::start(client.clone(), options, metrics, Arc::new(registry)).await.unwrap();
    let mut f =
        Fixture { client: client.clone(), ns: ns.clone(), hook: Some(hook), registry: Arc::new(Registry::default()), _params: None };
    f.wait_enforced(&scope).await;
    f.grant("work", "a", 5).await;

    let scoped = |name: &str| {
        let mut cm = configmap(name, "work", 5);
        cm.metadata.labels.get_or_insert_default().extend(scope.clone());
        cm
    };
    let api = f.api::<ConfigMap>();
    api.create(&PostParams::default(), &scoped("state")).await.expect("guarded create while the webhook serves");
    api.create(
        &PostParams::default(),
        &ConfigMap { metadata: kube::api::ObjectMeta { name: Some("plain".into()), ..Default::default() }, ..Default::default() }
            .into_dynamic(),
    )
    .await
    .unwrap();
    f.grant("work", "a", 6).await;

    let mut hook = f.hook.take().unwrap();
    hook.stop_serving().await;

    let err = common::rejected(patch(&api, "state", &write(Some(6), "a")).await);
    assert!(common::failed_closed(&err), "a guarded write fails closed: {err:?}");
    patch(&api, "plain", &write(None, "anyone")).await.expect("unguarded writes do not need the webhook");
    let system: Api<DynamicObject> = Api::namespaced_with(client.clone(), "kube-system", &ApiResource::erase::<ConfigMap>(&()));
    let mut sys = scoped(&format!("kf-guarded-{ns}"));
    sys.metadata.annotations = None;
    system.create(&PostParams::default(), &sys).await.expect("kube-system is never fenced");
    system.delete(&sys.metadata.name.clone().unwrap(), &DeleteParams::default()).await.expect("kube-system delete");

    hook.registration.remove(&client).await.expect("remove the registration");
    hook.stop(&client).await.unwrap();
}

trait IntoDynamic {
    fn into_dynamic(self) -> DynamicObject;
}

impl IntoDynamic for ConfigMap {
    fn into_dynamic(self) -> DynamicObject {
        let mut v = serde_json::to_value(self).unwrap();
        v["apiVersion"] = json!("v1");
        v["kind"] = json!("ConfigMap");
        serde_json::from_value(v).unwrap()
    }
}

/// Admission latency: measured at the server (histogram) and as added latency of a guarded vs
/// an unguarded update through the API server. Printed, not asserted.
#[tokio::test]
async fn admission_latency_is_measured() {
    let f = Fixture::new("latency").await;
    let api = f.api::<ConfigMap>();
    f.create_guarded("guarded", 1_000_000).await;
    api.create(
        &PostParams::default(),
        &ConfigMap { metadata: kube::api::ObjectMeta { name: Some("plain".into()), ..Default::default() }, ..Default::default() }
            .into_dynamic(),
    )
    .await
    .unwrap();
    f.grant("work", "a", 2_000_000).await;
    let n = 300u64;
    let (mut guarded, mut plain) = (Vec::new(), Vec::new());
    for i in 0..n {
        let t = Instant::now();
        patch(&api, "guarded", &write(Some(1_000_001 + i), "a")).await.unwrap();
        guarded.push(t.elapsed());
        let t = Instant::now();
        patch(&api, "plain", &write(None, &format!("w{i}"))).await.unwrap();
        plain.push(t.elapsed());
    }
    let q = |v: &mut Vec<Duration>, p: f64| {
        v.sort();
        v[((v.len() as f64 - 1.0) * p).round() as usize]
    };
    let metrics = kube_fence::telemetry::render(&f.registry);
    eprintln!(
        "latency through the API server ({n} updates each): guarded p50 {:?} p99 {:?}; unguarded p50 {:?} p99 {:?}",
        q(&mut guarded, 0.5),
        q(&mut guarded, 0.99),
        q(&mut plain, 0.5),
        q(&mut plain, 0.99)
    );
    eprintln!(
        "server-side decision histogram:\n{}",
        metrics.lines().filter(|l| l.contains("decision_duration") || l.contains("lease_reads")).collect::<Vec<_>>().join("\n")
    );
    f.stop().await;
}

/// A client that never finishes its headers (slowloris) is disconnected, and the server keeps
/// serving others meanwhile.
#[tokio::test]
async fn a_client_trickling_headers_is_cut_off() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let f = Fixture::new("slowloris").await;
    let hook = f.hook.as_ref().unwrap();
    let (addr, ca) = (hook.addr, hook.ca_pem.clone());
    let mut slow = tls_connect(addr, &ca).await;
    slow.write_all(b"POST /validate HTTP/1.1\r\nHost: localhost\r\n").await.expect("partial headers");
    let started = Instant::now();
    // Others are served while the slow client hangs on.
    let (code, _, _) = https(addr, &ca, "GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n", b"").await;
    assert_eq!(code, 200);
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(30), slow.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "the trickling connection was still open after 30 s");
    eprintln!(
        "MEASURED slow client cut off after {:?} (header read timeout {:?})",
        started.elapsed(),
        kube_fence::admission::http::server::HEADER_READ_TIMEOUT
    );
    f.stop().await;
}

/// A TLS connection to the webhook, trusting only `ca_pem` and checking its IP address.
async fn tls_connect(addr: std::net::SocketAddr, ca_pem: &str) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    tls_connect_from(None, addr, ca_pem).await
}

/// A TLS connection to the webhook from `source` (a loopback address of this machine) when
/// given, trusting `ca_pem`.
async fn tls_connect_from(
    source: Option<std::net::IpAddr>,
    addr: std::net::SocketAddr,
    ca_pem: &str,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.unwrap()).unwrap();
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    if let Some(source) = source {
        socket.bind(std::net::SocketAddr::new(source, 0)).unwrap();
    }
    let tcp = socket.connect(addr).await.unwrap();
    let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
    tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp).await.expect("TLS handshake with the webhook")
}

/// One HTTPS request to the webhook, trusting `ca_pem`: (status code, body, served leaf DER).
async fn https(addr: std::net::SocketAddr, ca_pem: &str, head: &str, body: &[u8]) -> (u16, String, Vec<u8>) {
    https_via(tls_connect(addr, ca_pem).await, head, body).await
}

/// [`https`] from the loopback address `source`.
async fn https_from(source: &str, addr: std::net::SocketAddr, ca_pem: &str, head: &str, body: &[u8]) -> (u16, String, Vec<u8>) {
    https_via(tls_connect_from(Some(source.parse().unwrap()), addr, ca_pem).await, head, body).await
}

async fn https_via(mut tls: tokio_rustls::client::TlsStream<tokio::net::TcpStream>, head: &str, body: &[u8]) -> (u16, String, Vec<u8>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let leaf = tls.get_ref().1.peer_certificates().and_then(|c| c.first()).map(|c| c.to_vec()).unwrap_or_default();
    let _ = tls.write_all(head.as_bytes()).await;
    let _ = tls.write_all(body).await;
    let mut out = Vec::new();
    // A refused body may leave the connection open (the server waits for the rest): read what
    // arrives within a few seconds.
    let _ = tokio::time::timeout(Duration::from_secs(3), tls.read_to_end(&mut out)).await;
    let text = String::from_utf8_lossy(&out).into_owned();
    let code = text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string()).unwrap_or_default();
    (code, body, leaf)
}

fn post(body: &[u8]) -> String {
    format!(
        "POST /validate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    )
}

/// Bad input gets a 400 or a clear denial, never a panic, and the server keeps serving.
#[tokio::test]
async fn malformed_input_is_refused_and_the_server_keeps_serving() {
    let f = Fixture::new("malformed").await;
    f.grant("work", "a", 5).await;
    let hook = f.hook.as_ref().unwrap();
    let (addr, ca) = (hook.addr, hook.ca_pem.clone());

    let (code, body, _) = https(addr, &ca, &post(b"not json"), b"not json").await;
    assert_eq!(code, 400, "{body}");
    let empty = br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#;
    assert_eq!(https(addr, &ca, &post(empty), empty).await.0, 400);

    let review = |object: serde_json::Value| {
        serde_json::to_vec(&json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
                        "resource": {"group": "", "version": "v1", "resource": "configmaps"},
                        "name": "x", "namespace": f.ns, "operation": "CREATE", "userInfo": {"username": "alice"},
                        "object": object}
        }))
        .unwrap()
    };
    // Annotations that are not strings: the objects cannot be read; denied, saying so.
    let bad = review(
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "labels": {LEASE: "work"}, "annotations": {TOKEN: 5}}}),
    );
    let (code, body, _) = https(addr, &ca, &post(&bad), &bad).await;
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["response"]["uid"], "u-1");
    assert_eq!(v["response"]["allowed"], false);
    assert_eq!(v["response"]["status"]["code"], 400);
    // Garbage token: denied naming the problem.
    let garbage = review(
        json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "labels": {LEASE: "work"}, "annotations": {TOKEN: "0x1f"}}}),
    );
    let (_, body, _) = https(addr, &ca, &post(&garbage), &garbage).await;
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["response"]["status"]["reason"], "TokenMalformed", "{body}");
    assert!(v["response"]["status"]["message"].as_str().unwrap().contains("not a decimal integer"), "{body}");
    // Oversized: refused from the Content-Length alone.
    let huge = format!(
        "POST /validate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        4 * 1024 * 1024
    );
    assert_eq!(https(addr, &ca, &huge, b"{").await.0, 413);
    // Still serving.
    let (code, body, _) = https(addr, &ca, "GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n", b"").await;
    assert_eq!((code, body.trim()), (200, "ok"));
    let (code, body, _) = https(addr, &ca, "GET /readyz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n", b"").await;
    assert_eq!(code, 200, "{body}");
    let (_, metrics, _) = https(addr, &ca, "GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n", b"").await;
    assert!(metrics.contains("reason=\"MalformedRequest\"") && metrics.contains("reason=\"TokenMalformed\""), "{metrics}");
    f.stop().await;
}

/// File-mode TLS: a certificate rotated on disk is served without a restart, and guarded
/// writes running through the rotation never fail.
#[tokio::test]
async fn rotated_certificate_is_picked_up_without_a_failed_admission() {
    use kube_fence::admission::http::server;
    use kube_fence::admission::http::tls::{CertFiles, SelfSigned, issue_serving};
    use kube_fence::admission::reads::directory::LeaseDirectory;
    use kube_fence::admission::registration::{Endpoint, Registration};
    use rustls::pki_types::pem::PemObject;

    let client = common::client().await;
    let ns = common::namespace(&client, "rotate").await;
    let loopback = [std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)];
    let made = SelfSigned::generate(&["localhost".into()], &loopback).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let files = CertFiles { cert: dir.path().join("tls.crt"), key: dir.path().join("tls.key"), client_auth: Default::default() };
    std::fs::write(&files.cert, &made.serving.cert).unwrap();
    std::fs::write(&files.key, &made.serving.key).unwrap();

    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    let registry = Arc::new(registry);
    let (tls, loaded) = files.load().await.unwrap();
    let reloads = metrics.tls_reloads.clone();
    let watcher = tokio::spawn(files.clone().watch(tls.clone(), loaded, Duration::from_millis(100), reloads.clone()));
    let (leases, cache) = LeaseDirectory::new(client.clone());
    let cache = tokio::spawn(cache);
    assert!(leases.wait_ready(Duration::from_secs(30)).await);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    let serving = server::Serving { judging: Default::default(), bounds: Default::default(), listener, tls };
    let server = tokio::spawn(server::run(leases, serving, metrics, registry.clone(), stop.clone().cancelled_owned()));
    let mut registration = Registration::new(format!("kf-test-{ns}"), Endpoint::Url(format!("https://{addr}/validate")));
    registration.ca_bundle = Some(made.ca_cert.clone());
    registration.only_namespaces = Some(vec![ns.clone()]);
    registration.apply(&client).await.unwrap();

    let f = Fixture { client: client.clone(), ns: ns.clone(), hook: None, registry, _params: None };
    f.wait_enforced(&BTreeMap::new()).await;
    f.grant("work", "a", 1_000_000).await;
    let api = f.api::<ConfigMap>();
    api.create(&PostParams::default(), &configmap("state", "work", 1_000_000)).await.unwrap();
    f.grant("work", "a", 2_000_000).await;

    let done = tokio_util::sync::CancellationToken::new();
    // Admitted writes in all, and after the reload: the test waits on them, not on a clock.
    let admitted = Arc::new((std::sync::atomic::AtomicU64::new(0), std::sync::atomic::AtomicU64::new(0)));
    let writer = {
        let (api, done, reloads, admitted) = (api.clone(), done.clone(), reloads.clone(), admitted.clone());
        tokio::spawn(async move {
            let mut failed = Vec::new();
            let mut token = 1_000_000;
            while !done.is_cancelled() {
                token += 1;
                // Read before the write is sent: a write counted "after" went out after the reload.
                let reloaded = reloads.get() > 0;
                match patch(&api, "state", &write(Some(token), "a")).await {
                    Ok(_) => {
                        admitted.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        if reloaded {
                            admitted.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        }
                    }
                    Err(e) => failed.push(e.to_string()),
                }
            }
            failed
        })
    };
    let wait_admitted = |which: usize, at_least: u64, what: &'static str| {
        let admitted = admitted.clone();
        async move {
            let started = Instant::now();
            let count = || if which == 0 { &admitted.0 } else { &admitted.1 };
            while count().load(std::sync::atomic::Ordering::SeqCst) < at_least {
                assert!(started.elapsed() < Duration::from_secs(60), "fewer than {at_least} guarded writes admitted {what} within 60 s");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    wait_admitted(0, 5, "before the rotation").await;

    // Rotate: a new key and certificate from the same CA, each file replaced atomically.
    let next = issue_serving(&made.ca_key, &["localhost".into()], &loopback).unwrap();
    for (path, data) in [(&files.key, &next.key), (&files.cert, &next.cert)] {
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, data).unwrap();
        std::fs::rename(&tmp, path).unwrap();
    }
    let started = Instant::now();
    while reloads.get() == 0 {
        assert!(started.elapsed() < Duration::from_secs(60), "the rotated certificate was not loaded within 60 s");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let reloaded_after = started.elapsed();
    let new_leaf = rustls::pki_types::CertificateDer::from_pem_slice(&next.cert).unwrap();
    let (code, _, served) = https(addr, &made.ca_cert, "GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n", b"").await;
    assert_eq!(code, 200);
    assert_eq!(served, new_leaf.to_vec(), "new handshakes get the rotated certificate");
    wait_admitted(1, 5, "after the reload").await;
    done.cancel();
    let failed = writer.await.unwrap();
    let (ok, after_reload) = (admitted.0.load(std::sync::atomic::Ordering::SeqCst), admitted.1.load(std::sync::atomic::Ordering::SeqCst));
    eprintln!(
        "rotation: {ok} guarded writes admitted ({after_reload} after the reload), {} failed; reloaded {reloaded_after:?} after the files changed",
        failed.len()
    );
    assert!(failed.is_empty(), "admissions failed during the rotation: {failed:?}");
    assert!(ok > 0 && after_reload > 0);

    registration.remove(&client).await.unwrap();
    stop.cancel();
    let _ = server.await;
    watcher.abort();
    cache.abort();
}
