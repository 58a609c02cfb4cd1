//! The policy path (`--policy-path`, docs/design.md §9) on a real control plane: the API server
//! judges fresh-token UPDATEs of guarded objects itself (a ValidatingAdmissionPolicy reading one
//! parameter ConfigMap per namespace) and the webhook skips them; everything else still goes to
//! the webhook.
//!
//! Each test serves the webhook in-process with the policy path registered, scoped to its own
//! namespace, runs the parameter keeper (`lease::params`) for it, and simulates grants by
//! writing Lease status as admin. Which component judged a write is read from the webhook's own
//! decision counter.

mod common;

use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::admissionregistration::v1::{ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding};
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, PostParams};
use kube::core::Status;
use kube::{Client, ResourceExt};
use kube_fence::admission::http::server::Metrics;
use kube_fence::admission::local::{LocalOptions, LocalWebhook};
use kube_fence::client::{self as fence, Grant};
use kube_fence_api::denial::Reason;
use kube_fence_api::names::{LEASE_LABEL, TOKEN_ANNOTATION, WRITE_ANNOTATION, WRITER_LABEL};
use kube_fence_api::policy_path::{PARAMS_NAME, PolicyDenial};
use kube_fence_api::token::Token;
use kube_fence_api::{Comparison, FencingPolicy, Lease, LeaseSpec, LeaseTokens, LeaseTokensSpec};
use prometheus_client::registry::Registry;
use serde_json::json;
use tokio_util::sync::{CancellationToken, DropGuard};

struct Fixture {
    client: Client,
    ns: String,
    hook: Option<LocalWebhook>,
    registry: Arc<Registry>,
    params: Option<DropGuard>,
}

impl Fixture {
    async fn new(test: &str) -> Fixture {
        let client = common::client().await;
        let ns = common::namespace(&client, test).await;
        Fixture::start(client, ns).await
    }

    /// Turns the policy path on for `ns` (which may already hold objects).
    async fn start(client: Client, ns: String) -> Fixture {
        let mut options = LocalOptions::new(format!("kf-pp-{ns}"));
        options.webhook.scope.only_namespaces = Some(vec![ns.clone()]);
        options.policy_path = true;
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        let registry = Arc::new(registry);
        let hook = LocalWebhook::start(client.clone(), options, metrics, registry.clone()).await.expect("start the webhook");
        let stop = CancellationToken::new();
        tokio::spawn(kube_fence::lease::params::maintain(client.clone(), Some(ns.clone()), stop.clone()));
        common::wait_fenced(&client, &ns, &Default::default(), common::Fencing::Judged, Duration::from_secs(30)).await;
        common::wait_policy_path(&client, &ns, Duration::from_secs(30)).await;
        let f = Fixture { client, ns, hook: Some(hook), registry, params: Some(stop.drop_guard()) };
        f.wait_skipped().await;
        f
    }

    /// Waits until the webhook skips fast-path writes too (the API server loads the webhook
    /// configuration, with its skip condition, apart from the policy): a dry-run fast-path write
    /// to the probe object (lease token 3, recorded 1, presented 2) that the webhook does not
    /// count. Panics after 30 s with the last answer.
    async fn wait_skipped(&self) {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), &self.ns);
        let status = json!({"status": {"phase": "Held", "holder": "probe", "token": 3}});
        leases.patch_status(PROBE, &PatchParams::default(), &Patch::Merge(&status)).await.expect("probe lease status");
        let (cms, dry) = (self.cms(), PatchParams { dry_run: true, ..Default::default() });
        let body = Patch::Merge(json!({"metadata": {"annotations": {TOKEN_ANNOTATION: "2"}}}));
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let before = self.webhook_decisions();
            let answer = fence::retry_unseen_token(|| cms.patch(PROBE, &dry, &body)).await;
            if answer.is_ok() && self.webhook_decisions() == before {
                return;
            }
            assert!(std::time::Instant::now() < deadline, "fast-path writes still reach the webhook after 30 s: {answer:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// kube-fence killed: the webhook stops answering (its registration stays, as after a
    /// crash) and nothing keeps the parameters any more.
    async fn kill(&mut self) {
        self.hook.as_mut().expect("the webhook").stop_serving().await;
        self.params.take();
    }

    fn cms(&self) -> Api<ConfigMap> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// Simulates a grant: lease `lease` held by `holder` with `token` (status written as admin).
    async fn grant(&self, lease: &str, holder: &str, token: u64) -> Grant {
        common::grant(&self.client, &self.ns, lease, holder, token).await
    }

    /// How many writes the webhook has judged so far.
    fn webhook_decisions(&self) -> u64 {
        decisions(&self.registry)
    }

    async fn stop(mut self) {
        if let Some(hook) = self.hook.take() {
            hook.stop(&self.client).await.expect("remove the registration");
        }
    }
}

/// The sum of the webhook's decision counters whose sample line `selected` keeps.
fn decisions_where(registry: &Registry, selected: impl Fn(&str) -> bool) -> u64 {
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, registry).expect("encode metrics");
    text.lines()
        .filter(|l| l.starts_with("kube_fence_webhook_decisions_total") && selected(l))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum::<f64>() as u64
}

/// How many writes the webhook serving `registry` has judged so far.
fn decisions(registry: &Registry) -> u64 {
    decisions_where(registry, |_| true)
}

/// How many writes the webhook serving `registry` has denied for `reason` so far. Counting one
/// reason, not every decision, keeps a late verdict out: on a busy machine the API server can
/// give up on a slow review (its timeout) that the webhook still finishes and counts after the
/// retried write succeeded.
fn denials(registry: &Registry, reason: Reason) -> u64 {
    let label = format!("reason=\"{}\"", reason.as_str());
    decisions_where(registry, |l| l.contains("verdict=\"denied\"") && l.contains(&label))
}

/// Asserts that the webhook judged one write, from its count before and after. "At least once",
/// not "exactly once": the API server may run validating admission twice for one write. It
/// first tries the write on the object its watch cache holds and, when that attempt fails (a
/// denial, or the stored object has moved on), reads the object from etcd and tries again —
/// seen in CI as three StaleToken decisions for two stale writes. A write the API server judged
/// alone leaves the count where it was, and fails this.
#[track_caller]
fn assert_judged_by_webhook(before: u64, after: u64, what: &str) {
    assert!(after > before, "{what}: the webhook did not judge it (decisions {before} before, {after} after)");
}

/// The probe lease and object of `common::wait_policy_path`.
const PROBE: &str = "kube-fence-probe-pp";

fn data(value: &str) -> serde_json::Value {
    json!({"data": {"v": value}})
}

/// A raw merge patch carrying `token` (and a fresh write id), not retried.
async fn raw_write(api: &Api<ConfigMap>, name: &str, token: u64) -> Result<ConfigMap, kube::Error> {
    let body = json!({"metadata": {"annotations": {TOKEN_ANNOTATION: token.to_string(), WRITE_ANNOTATION: fence::write_id()}}, "data": {"v": token.to_string()}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&body)).await
}

fn policy_denial(status: &Status) -> PolicyDenial {
    PolicyDenial::from_status(status).unwrap_or_else(|| panic!("not denied by the policy path: {status:?}"))
}

/// Stale-but-honest writer: a write with a fresh token is admitted by the API server alone (the
/// webhook is not called); a stale write still gets the webhook's typed 409; a token the lease
/// never issued is denied by the policy (403, with the lease and both tokens in its message).
#[tokio::test]
async fn fresh_writes_are_judged_in_the_api_server_and_stale_ones_still_rejected() {
    let f = Fixture::new("pp-fresh").await;
    let cms = f.cms();
    let a = f.grant("work", "a", 100).await;
    let mut cm = common::guarded_configmap("state", "work");
    cm.data = Some([("v".to_string(), "0".to_string())].into());
    a.create(&cms, &cm).await.expect("the create is judged by the webhook");
    let before = f.webhook_decisions();
    assert!(before >= 1, "the create went to the webhook");

    let b = f.grant("work", "b", 101).await;
    // The client library retries while the parameter cache has not seen token 101 yet.
    b.patch(&cms, "state", &PatchParams::default(), Patch::Merge(data("b"))).await.expect("a fresh token is admitted");
    assert_eq!(f.webhook_decisions(), before, "the fresh-token update was judged by the API server alone");

    let stale_before = denials(&f.registry, Reason::StaleToken);
    let stale = common::rejected(raw_write(&cms, "state", 100).await);
    assert_eq!(stale.code, 409, "{stale:?}");
    assert!(common::denied_by_kube_fence(&stale, Reason::StaleToken), "{stale:?}");
    let stale_between = denials(&f.registry, Reason::StaleToken);
    assert_judged_by_webhook(stale_before, stale_between, "the raw stale write");
    match a.patch(&cms, "state", &PatchParams::default(), Patch::Merge(data("a"))).await {
        Err(fence::Error::StaleToken { presented, recorded }) => assert_eq!((presented.get(), recorded.get()), (100, 101)),
        other => panic!("the stale holder's write must be a typed StaleToken: {other:?}"),
    }
    assert_judged_by_webhook(stale_between, denials(&f.registry, Reason::StaleToken), "the stale holder's write");

    let forged = common::rejected(raw_write(&cms, "state", 5_000_000).await);
    let denied = policy_denial(&forged);
    assert_eq!(forged.code, 403);
    assert_eq!(denied.lease, format!("{}/work", f.ns));
    assert_eq!((denied.presented.map(Token::get), denied.issued.map(Token::get)), (Some(5_000_000), Some(101)));
    assert!(forged.message.contains("never issued"), "{}", forged.message);
    let stored = cms.get("state").await.expect("get");
    assert_eq!(stored.annotations().get(TOKEN_ANNOTATION).map(String::as_str), Some("101"));
    f.stop().await;
}

/// Availability: with the webhook down (registration left in place, as after a crash), fresh
/// UPDATEs of guarded objects keep working through the policy, a never-issued token is still
/// denied, and everything the policy does not judge fails closed (stale writes, creates).
#[tokio::test]
async fn with_the_webhook_down_fresh_updates_keep_working_and_the_rest_fails_closed() {
    let mut f = Fixture::new("pp-down").await;
    let cms = f.cms();
    let a = f.grant("work", "a", 10).await;
    a.create(&cms, &common::guarded_configmap("state", "work")).await.expect("create");
    f.hook.as_mut().expect("the webhook").stop_serving().await;

    let b = f.grant("work", "b", 11).await;
    b.patch(&cms, "state", &PatchParams::default(), Patch::Merge(data("b")))
        .await
        .expect("a fresh token is admitted with the webhook down");
    let forged = common::rejected(raw_write(&cms, "state", 9_000_000).await);
    assert_eq!(policy_denial(&forged).issued.map(Token::get), Some(11));
    let stale = common::rejected(raw_write(&cms, "state", 10).await);
    assert!(common::failed_closed(&stale), "a stale write goes to the (unreachable) webhook and fails closed: {stale:?}");
    let create = common::rejected(b.create(&cms, &common::guarded_configmap("other", "work")).await.map_err(|e| match e {
        fence::Error::Kube(e) => e,
        other => panic!("{other:?}"),
    }));
    assert!(common::failed_closed(&create), "{create:?}");
    let stored = cms.get("state").await.expect("get");
    assert_eq!(stored.annotations().get(TOKEN_ANNOTATION).map(String::as_str), Some("11"));
    f.stop().await;
}

/// What the policy cannot judge exactly still goes to the webhook: an equal token restated under
/// AllowEqual, a tokenless write, holder-only objects (`kubefence.io/writer`), a DELETE without
/// precondition, and a write moving the object to another lease. (Stale-but-honest writer, and
/// a worker with ordinary RBAC trying the shapes the policy skips.)
#[tokio::test]
async fn unsafe_cases_still_go_to_the_webhook() {
    let f = Fixture::new("pp-unsafe").await;
    let cms = f.cms();
    let leases: Api<Lease> = Api::namespaced(f.client.clone(), &f.ns);
    let spec =
        LeaseSpec { fencing: Some(FencingPolicy { comparison: Some(Comparison::AllowEqual), ..Default::default() }), ..Default::default() };
    leases.create(&PostParams::default(), &Lease::new("equal", spec)).await.expect("create an AllowEqual lease");
    let a = f.grant("equal", "a", 20).await;
    a.create(&cms, &common::guarded_configmap("eq", "equal")).await.expect("create");
    let before = f.webhook_decisions();
    a.patch(&cms, "eq", &PatchParams::default(), Patch::Merge(data("again"))).await.expect("AllowEqual admits a restated token");
    assert_judged_by_webhook(before, f.webhook_decisions(), "the equal token");

    let tokenless = json!({"metadata": {"annotations": {TOKEN_ANNOTATION: null}}});
    let missing = common::rejected(cms.patch("eq", &PatchParams::default(), &Patch::Merge(&tokenless)).await);
    assert!(common::denied_by_kube_fence(&missing, Reason::TokenMissing), "{missing:?}");

    let rebound = json!({"metadata": {"labels": {LEASE_LABEL: "work"}, "annotations": {TOKEN_ANNOTATION: "21"}}});
    let moved = common::rejected(cms.patch("eq", &PatchParams::default(), &Patch::Merge(&rebound)).await);
    assert!(common::denied_by_kube_fence(&moved, Reason::LeaseRebound), "{moved:?}");

    let unconditional = common::rejected(cms.delete("eq", &DeleteParams::default()).await);
    assert!(common::denied_by_kube_fence(&unconditional, Reason::DeletePreconditionRequired), "{unconditional:?}");

    // Holder-only objects (`kubefence.io/writer`): a write that makes an object holder-only, and
    // any write to one, go to the webhook even with a fresh token (its identity check).
    let w = f.grant("work", "w", 30).await;
    w.create(&cms, &common::guarded_configmap("holder-only", "work")).await.expect("create");
    for token in [31, 32] {
        f.grant("work", "w", token).await;
        let before = f.webhook_decisions();
        let body = json!({"metadata": {"labels": {WRITER_LABEL: "holder"}, "annotations": {TOKEN_ANNOTATION: token.to_string()}}});
        let _ = cms.patch("holder-only", &PatchParams::default(), &Patch::Merge(&body)).await;
        assert_judged_by_webhook(before, f.webhook_decisions(), &format!("token {token}: the write naming the writer label"));
    }
    f.stop().await;
}

/// Waits until the namespace's parameters say `tokens` (the controller writes them after each
/// change); panics after 30 s with what they said.
async fn wait_params(f: &Fixture, tokens: serde_json::Value) -> LeaseTokens {
    let api: Api<LeaseTokens> = Api::namespaced(f.client.clone(), &f.ns);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let params = api.get_opt(PARAMS_NAME).await.expect("get the parameters");
        match &params {
            Some(p) if serde_json::to_value(&p.spec.tokens).ok().as_ref() == Some(&tokens) => return params.expect("some"),
            _ if std::time::Instant::now() > deadline => panic!("the parameters are not {tokens} within 30 s: {params:?}"),
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Malicious writer with ordinary RBAC (`edit` in its namespace, so it may write and
/// deletecollection ConfigMaps): it has no RBAC on the parameters at all; and one given RBAC on
/// them by mistake is still refused by the parameter guard — create, patch, delete,
/// deletecollection. The parameters stay what the controller wrote.
#[tokio::test]
async fn a_worker_cannot_forge_the_parameters() {
    let f = Fixture::new("pp-forge").await;
    f.grant("work", "a", 40).await;
    let written = wait_params(&f, json!({"kube-fence-probe-pp": 3, "work": 40})).await;
    let raise = json!({"spec": {"tokens": {"work": 9_223_372_036_854_775_807_i64, "ghost": 9_223_372_036_854_775_807_i64}}});
    let mut planted = LeaseTokens::new("planted", LeaseTokensSpec::default());
    planted.spec.tokens.insert("ghost".into(), Token::MAX);

    common::identity::grant_worker_rbac(&f.client, &f.ns, "mallory").await;
    let mallory: Api<LeaseTokens> = Api::namespaced(common::identity::client_as("mallory").await, &f.ns);
    for (what, answer) in [
        ("patch", mallory.patch(PARAMS_NAME, &PatchParams::default(), &Patch::Merge(&raise)).await.map(|_| ())),
        ("create", mallory.create(&PostParams::default(), &planted).await.map(|_| ())),
        ("delete", mallory.delete(PARAMS_NAME, &DeleteParams::default()).await.map(|_| ())),
        ("deletecollection", mallory.delete_collection(&DeleteParams::default(), &ListParams::default()).await.map(|_| ())),
    ] {
        let denied = common::rejected(answer);
        assert_eq!((denied.code, denied.reason.as_str()), (403, "Forbidden"), "{what}: {denied:?}");
    }

    // RBAC on LeaseTokens given by mistake: the guard still refuses every write.
    let pp = PatchParams::apply("kube-fence-tests").force();
    let role: Role = serde_json::from_value(json!({
        "metadata": {"name": "tokens-by-mistake", "namespace": f.ns},
        "rules": [{"apiGroups": [kube_fence_api::GROUP], "resources": ["leasetokens"], "verbs": ["*"]}],
    }))
    .expect("role");
    Api::<Role>::namespaced(f.client.clone(), &f.ns).patch("tokens-by-mistake", &pp, &Patch::Apply(&role)).await.expect("role");
    let binding: RoleBinding = serde_json::from_value(json!({
        "metadata": {"name": "tokens-by-mistake", "namespace": f.ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "tokens-by-mistake"},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": "trudy"}],
    }))
    .expect("binding");
    Api::<RoleBinding>::namespaced(f.client.clone(), &f.ns)
        .patch("tokens-by-mistake", &pp, &Patch::Apply(&binding))
        .await
        .expect("binding");
    let raise_patch = Patch::Merge(&raise);
    let trudy: Api<LeaseTokens> = Api::namespaced(common::identity::client_as("trudy").await, &f.ns);
    let guarded = |what: &str, answer: Result<(), kube::Error>| {
        let denied = common::rejected(answer);
        assert_eq!(denied.code, 403, "{what}: {denied:?}");
        assert!(denied.message.contains("only the kube-fence controller"), "{what}: {}", denied.message);
    };
    guarded("patch", once_authorized(|| trudy.patch(PARAMS_NAME, &PATCH, &raise_patch)).await.map(|_| ()));
    guarded("create", once_authorized(|| trudy.create(&POST, &planted)).await.map(|_| ()));
    guarded("delete", once_authorized(|| trudy.delete(PARAMS_NAME, &DELETE)).await.map(|_| ()));
    let all = ListParams::default();
    guarded("deletecollection", once_authorized(|| trudy.delete_collection(&DELETE, &all)).await.map(|_| ()));

    let params = Api::<LeaseTokens>::namespaced(f.client.clone(), &f.ns).get(PARAMS_NAME).await.expect("the parameters");
    assert_eq!((params.uid(), params.spec), (written.uid(), written.spec));
    f.stop().await;
}

/// Stale-but-honest writer, and parameters changed by someone allowed to (here the controller's
/// own identity, as an admin acting as it would): the controller puts them right — a deleted
/// object re-created while the holder's write is retried, a key of no lease and a wrong value
/// removed, the object deleted when its namespace has no Leases left.
#[tokio::test]
async fn the_controller_keeps_the_parameters_equal_to_the_leases() {
    let f = Fixture::new("pp-reconcile").await;
    let cms = f.cms();
    let a = f.grant("work", "a", 70).await;
    a.create(&cms, &common::guarded_configmap("s0", "work")).await.expect("create");
    let params: Api<LeaseTokens> = Api::namespaced(f.client.clone(), &f.ns);
    let first = wait_params(&f, json!({"kube-fence-probe-pp": 3, "work": 70})).await;
    params.delete(PARAMS_NAME, &DeleteParams::default()).await.expect("delete the parameters");
    let b = f.grant("work", "b", 71).await;
    b.patch(&cms, "s0", &PatchParams::default(), Patch::Merge(data("b"))).await.expect("admitted once the parameters are back");
    let again = wait_params(&f, json!({"kube-fence-probe-pp": 3, "work": 71})).await;
    assert_ne!(again.uid(), first.uid(), "re-created");

    let tampered = json!({"spec": {"tokens": {"kube-fence-probe-pp": 3, "work": 9_000_000, "ghost": 9_223_372_036_854_775_807_i64}}});
    params
        .patch(PARAMS_NAME, &PatchParams { field_manager: Some("someone-else".into()), ..Default::default() }, &Patch::Merge(&tampered))
        .await
        .expect("tamper");
    wait_params(&f, json!({"kube-fence-probe-pp": 3, "work": 71})).await;

    let leases: Api<Lease> = Api::namespaced(f.client.clone(), &f.ns);
    for lease in ["work", PROBE] {
        leases.delete(lease, &DeleteParams::default()).await.expect("delete the lease");
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while params.get_opt(PARAMS_NAME).await.expect("get").is_some() {
        assert!(std::time::Instant::now() < deadline, "the parameters of a namespace without Leases are not deleted within 30 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    f.stop().await;
}

const POST: PostParams = PostParams { dry_run: false, field_manager: None };
const PATCH: PatchParams = PatchParams { dry_run: false, force: false, field_manager: None, field_validation: None };
const DELETE: DeleteParams = DeleteParams { dry_run: false, grace_period_seconds: None, propagation_policy: None, preconditions: None };

/// Retries `write` while the worker's RBAC (just bound) is not in effect yet.
async fn once_authorized<T, F, Fut>(mut write: F) -> Result<T, kube::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, kube::Error>>,
{
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        match write().await {
            Err(kube::Error::Api(e))
                if e.code == 403 && e.reason == "Forbidden" && e.message.contains("cannot ") && std::time::Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            other => return other,
        }
    }
}

/// The recorded token of `name`.
async fn recorded(cms: &Api<ConfigMap>, name: &str) -> Option<String> {
    cms.get(name).await.expect("get").annotations().get(TOKEN_ANNOTATION).cloned()
}

/// Malicious writer with ordinary RBAC (`edit` in its namespace): what it wrote before the
/// policy path was turned on — the parameter ConfigMap earlier versions read, naming a lease
/// that does not exist with the largest token — admits nothing, with kube-fence running or
/// killed, in a namespace with leases or without, and the object keeps its token (it is not
/// locked out for a re-created lease).
#[tokio::test]
async fn parameters_a_worker_wrote_before_the_policy_path_admit_nothing() {
    let client = common::client().await;
    let ns = common::namespace(&client, "pp-ghost").await;
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    // Guarded by lease `ghost` (which does not exist), token 5 recorded: nothing is registered yet.
    let mut victim = common::guarded_configmap("victim", "ghost");
    victim.metadata.annotations = Some([(TOKEN_ANNOTATION.to_string(), "5".to_string())].into());
    cms.create(&PostParams::default(), &victim).await.expect("create the guarded object");
    common::identity::grant_worker_rbac(&client, &ns, "mallory").await;
    let mallory: Api<ConfigMap> = Api::namespaced(common::identity::client_as("mallory").await, &ns);
    let mut planted = ConfigMap::default();
    planted.metadata.name = Some("kube-fence-tokens".into());
    planted.data = Some([("ghost".to_string(), "9223372036854775807".to_string())].into());
    once_authorized(|| mallory.create(&POST, &planted)).await.expect("the worker plants the parameters");

    let mut f = Fixture::start(client.clone(), ns.clone()).await;
    let forged = Patch::Merge(json!({"metadata": {"annotations": {TOKEN_ANNOTATION: "9223372036854775806"}}, "data": {"v": "mallory"}}));
    let write = || mallory.patch("victim", &PATCH, &forged);
    // The namespace has a lease (the probe's): the ghost is not among its tokens.
    let denied = common::rejected(write().await);
    assert_eq!(policy_denial(&denied).issued, None, "{denied:?}");
    // Without leases (the probe's deleted), and with kube-fence killed.
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    leases.delete(PROBE, &DeleteParams::default()).await.expect("delete the probe lease");
    let denied = common::rejected(write().await);
    assert!(denied.code == 403 || denied.code == 422, "{denied:?}");
    f.kill().await;
    let denied = common::rejected(write().await);
    assert!(denied.code == 403 || denied.code == 422, "{denied:?}");
    assert_eq!(recorded(&cms, "victim").await.as_deref(), Some("5"));
    f.stop().await;
}

/// Malicious writer with ordinary RBAC (`edit`, which has `deletecollection`): deleting the
/// namespace's ConfigMaps by label does not take the policy path's parameters away, and the
/// holder's fresh writes keep being admitted.
#[tokio::test]
async fn deleting_configmaps_by_label_does_not_deny_the_holder() {
    let f = Fixture::new("pp-delcoll").await;
    let cms = f.cms();
    let a = f.grant("work", "a", 60).await;
    for name in ["s0", "s1", "s2"] {
        a.create(&cms, &common::guarded_configmap(name, "work")).await.expect("create");
    }
    let b = f.grant("work", "b", 61).await;
    b.patch(&cms, "s0", &PatchParams::default(), Patch::Merge(data("b"))).await.expect("the parameters have token 61");
    common::identity::grant_worker_rbac(&f.client, &f.ns, "mallory").await;
    let mallory: Api<ConfigMap> = Api::namespaced(common::identity::client_as("mallory").await, &f.ns);
    let managed = ListParams::default().labels("app.kubernetes.io/managed-by=kube-fence");
    once_authorized(|| mallory.delete_collection(&DELETE, &managed)).await.expect("deletecollection");
    b.patch(&cms, "s1", &PatchParams::default(), Patch::Merge(data("b"))).await.expect("the holder's fresh write is admitted");
    assert_eq!(recorded(&cms, "s1").await.as_deref(), Some("61"));
    f.stop().await;
}

/// Stale-but-honest writer: `run --local` started without the policy path after a crashed one
/// with it removes the crashed one's policy, so a guarded fast-path write in a namespace nobody
/// keeps parameters for is judged by the webhook, not denied by a policy left behind.
#[tokio::test]
async fn a_local_run_without_the_policy_path_removes_a_crashed_ones_policy() {
    let client = common::client().await;
    let ns = common::namespace(&client, "pp-leftover").await;
    let name = format!("kf-pp-{ns}");
    let mut options = LocalOptions::new(name.clone());
    options.webhook.scope.only_namespaces = Some(vec![ns.clone()]);
    options.policy_path = true;
    let start = |options: LocalOptions| {
        let client = client.clone();
        async move {
            let mut registry = Registry::default();
            let metrics = Metrics::register(&mut registry);
            let registry = Arc::new(registry);
            let hook = LocalWebhook::start(client, options, metrics, registry.clone()).await.expect("start the webhook");
            (hook, registry)
        }
    };
    let (crashed, _) = start(options.clone()).await;
    crashed.crash().await;
    options.policy_path = false;
    let (hook, registry) = start(options).await;
    common::wait_fenced(&client, &ns, &Default::default(), common::Fencing::Judged, Duration::from_secs(30)).await;

    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    leases.create(&PostParams::default(), &Lease::new("work", LeaseSpec::default())).await.expect("create lease");
    let grant = |holder: &str, token: u64| {
        let leases = leases.clone();
        let (ns, holder) = (ns.clone(), holder.to_string());
        async move {
            let status = json!({"status": {"phase": "Held", "holder": holder, "token": token}});
            leases.patch_status("work", &PatchParams::default(), &Patch::Merge(&status)).await.expect("write lease status");
            Grant {
                namespace: ns,
                lease: "work".into(),
                holder,
                token: Token::new(token).expect("a token"),
                duration: Duration::from_secs(60),
                valid_until: tokio::time::Instant::now() + Duration::from_secs(60),
                uid: None,
            }
        }
    };
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    grant("a", 7).await.create(&cms, &common::guarded_configmap("state", "work")).await.expect("create");
    let before = decisions(&registry);
    grant("b", 8).await.patch(&cms, "state", &PatchParams::default(), Patch::Merge(data("b"))).await.expect("the fresh write is admitted");
    assert_judged_by_webhook(before, decisions(&registry), "the fresh write without the policy path");
    let policy = format!("{name}-policy-path");
    assert!(Api::<ValidatingAdmissionPolicy>::all(client.clone()).get_opt(&policy).await.expect("get").is_none(), "{policy} is left");
    assert!(Api::<ValidatingAdmissionPolicyBinding>::all(client.clone()).get_opt(&policy).await.expect("get").is_none());
    hook.stop(&client).await.expect("remove the registration");
}

/// While an API server cannot resolve the policy path's `paramKind` (a policy compiled before
/// its CRD was discoverable: created with it, or any policy on an API server that has just
/// started; kube-apiserver refreshes that mapping every 30 s), it fails fast-path writes closed
/// with a fixed 422. The client library retries that answer like an unseen token, for at most
/// its budget, and then returns it as the API server gave it. A policy of the policy path's
/// shape whose `paramKind` no API server serves stands in for that moment (the CRD cannot be
/// taken from the shared control plane); the answer is a real kube-apiserver's, so a change of
/// its wording fails here. Threat case: none (availability: a genuine write is held, never
/// admitted without a judgement).
#[tokio::test]
async fn an_unresolved_parameter_kind_fails_closed_and_is_retried_for_the_budget() {
    let client = common::client().await;
    let ns = common::namespace(&client, "pp-kind").await;
    let name = format!("kf-{ns}{}", kube_fence_api::policy_path::POLICY_SUFFIX);
    let policy: ValidatingAdmissionPolicy = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "paramKind": {"apiVersion": "unserved.kubefence.io/v1", "kind": "LeaseTokens"},
            "matchConstraints": {
                "resourceRules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE"], "resources": ["configmaps"]}],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
            },
            "validations": [{"expression": "true"}],
        }
    }))
    .expect("a policy");
    let binding: ValidatingAdmissionPolicyBinding = serde_json::from_value(json!({
        "metadata": {"name": name},
        "spec": {"policyName": name, "validationActions": ["Deny"], "paramRef": {"name": PARAMS_NAME, "parameterNotFoundAction": "Deny"}},
    }))
    .expect("a binding");
    let (policies, bindings) =
        (Api::<ValidatingAdmissionPolicy>::all(client.clone()), Api::<ValidatingAdmissionPolicyBinding>::all(client.clone()));
    policies.create(&PostParams::default(), &policy).await.expect("create the policy");
    bindings.create(&PostParams::default(), &binding).await.expect("create the binding");

    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let dry = PostParams { dry_run: true, ..Default::default() };
    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "made"}})).expect("a ConfigMap");
    // The API server loads the policy from its informer: wait until it judges with it.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let unresolved = loop {
        match cms.create(&dry, &cm).await {
            Err(kube::Error::Api(status)) if kube_fence_api::policy_path::params_kind_unresolved(&status) => break status,
            other => assert!(std::time::Instant::now() < deadline, "the policy is not in force after 30 s: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(unresolved.code, 422, "{unresolved:?}");

    let attempts = std::sync::atomic::AtomicU32::new(0);
    let answer = fence::retry_unseen_token(|| {
        attempts.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        cms.create(&dry, &cm)
    })
    .await;
    match answer {
        Err(kube::Error::Api(status)) => assert_eq!(status.message, unresolved.message, "returned as the API server gave it"),
        other => panic!("a write no API server can judge is never admitted: {other:?}"),
    }
    assert!(attempts.into_inner() > 1, "the answer was not retried");
    bindings.delete(&name, &DeleteParams::default()).await.expect("delete the binding");
    policies.delete(&name, &DeleteParams::default()).await.expect("delete the policy");
}
