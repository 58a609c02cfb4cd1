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

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams};
use kube::core::Status;
use kube::{Client, ResourceExt};
use kube_fence::admission::decision::Reason;
use kube_fence::admission::local::{LocalOptions, LocalWebhook};
use kube_fence::admission::policy_path::{PARAMS_NAME, PolicyDenial};
use kube_fence::admission::server::Metrics;
use kube_fence::api::{Comparison, FencingPolicy, Lease, LeaseSpec};
use kube_fence::client::{self as fence, Grant};
use kube_fence::token::{LEASE_LABEL, TOKEN_ANNOTATION, Token, WRITE_ANNOTATION, WRITER_LABEL};
use prometheus_client::registry::Registry;
use serde_json::json;
use tokio_util::sync::{CancellationToken, DropGuard};

struct Fixture {
    client: Client,
    ns: String,
    hook: Option<LocalWebhook>,
    registry: Arc<Registry>,
    _params: DropGuard,
}

impl Fixture {
    async fn new(test: &str) -> Fixture {
        let client = common::client().await;
        let ns = common::namespace(&client, test).await;
        let mut options = LocalOptions::new(format!("kf-pp-{ns}"));
        options.only_namespaces = Some(vec![ns.clone()]);
        options.policy_path = true;
        let mut registry = Registry::default();
        let metrics = Metrics::register(&mut registry);
        let registry = Arc::new(registry);
        let hook = LocalWebhook::start(client.clone(), options, metrics, registry.clone()).await.expect("start the webhook");
        let stop = CancellationToken::new();
        tokio::spawn(kube_fence::lease::params::maintain(client.clone(), Some(ns.clone()), stop.clone()));
        common::wait_fenced(&client, &ns, &Default::default(), common::Fencing::Judged, Duration::from_secs(30)).await;
        common::wait_policy_path(&client, &ns, Duration::from_secs(30)).await;
        Fixture { client, ns, hook: Some(hook), registry, _params: stop.drop_guard() }
    }

    fn cms(&self) -> Api<ConfigMap> {
        Api::namespaced(self.client.clone(), &self.ns)
    }

    /// Simulates a grant: lease `lease` held by `holder` with `token` (status written as admin).
    async fn grant(&self, lease: &str, holder: &str, token: u64) -> Grant {
        let leases: Api<Lease> = Api::namespaced(self.client.clone(), &self.ns);
        if leases.get_opt(lease).await.expect("get lease").is_none() {
            leases.create(&PostParams::default(), &Lease::new(lease, LeaseSpec::default())).await.expect("create lease");
        }
        let status = json!({"status": {"phase": "Held", "holder": holder, "token": token}});
        leases.patch_status(lease, &PatchParams::default(), &Patch::Merge(&status)).await.expect("write lease status");
        Grant {
            namespace: self.ns.clone(),
            lease: lease.into(),
            holder: holder.into(),
            token: Token::new(token).expect("a token"),
            duration: Duration::from_secs(60),
            valid_until: tokio::time::Instant::now() + Duration::from_secs(60),
            uid: None,
        }
    }

    /// How many writes the webhook has judged so far.
    fn webhook_decisions(&self) -> u64 {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.registry).expect("encode metrics");
        text.lines()
            .filter(|l| l.starts_with("kube_fence_webhook_decisions_total"))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum::<f64>() as u64
    }

    async fn stop(mut self) {
        if let Some(hook) = self.hook.take() {
            hook.stop(&self.client).await.expect("remove the registration");
        }
    }
}

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

    let stale = common::rejected(raw_write(&cms, "state", 100).await);
    assert_eq!(stale.code, 409, "{stale:?}");
    assert!(common::denied_by_kube_fence(&stale, Reason::StaleToken), "{stale:?}");
    match a.patch(&cms, "state", &PatchParams::default(), Patch::Merge(data("a"))).await {
        Err(fence::Error::StaleToken { presented, recorded }) => assert_eq!((presented.get(), recorded.get()), (100, 101)),
        other => panic!("the stale holder's write must be a typed StaleToken: {other:?}"),
    }
    assert_eq!(f.webhook_decisions(), before + 2, "both stale writes were judged by the webhook");

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
    assert_eq!(f.webhook_decisions(), before + 1, "the equal token was judged by the webhook");

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
        assert_eq!(f.webhook_decisions(), before + 1, "token {token}: the write naming the writer label was judged by the webhook");
    }
    f.stop().await;
}

/// Worker with ordinary RBAC (`edit` in its namespace, so it may write ConfigMaps): it cannot
/// forge the parameters (raise the issued token to admit a forged one) or delete them.
#[tokio::test]
async fn a_worker_cannot_forge_the_parameters() {
    let f = Fixture::new("pp-forge").await;
    f.grant("work", "a", 40).await;
    common::identity::grant_worker_rbac(&f.client, &f.ns, "mallory").await;
    let mallory: Api<ConfigMap> = Api::namespaced(common::identity::client_as("mallory").await, &f.ns);
    let raise = json!({"data": {"work": "9223372036854775807"}});
    // Until RBAC lets the worker write ConfigMaps (the role binding takes a moment to apply).
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let forged = loop {
        let answer = common::rejected(mallory.patch(PARAMS_NAME, &PatchParams::default(), &Patch::Merge(&raise)).await);
        if !answer.message.contains("cannot patch resource") || std::time::Instant::now() > deadline {
            break answer;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(forged.code, 403, "{forged:?}");
    assert!(forged.message.contains("only the kube-fence controller"), "{}", forged.message);
    let deleted = common::rejected(mallory.delete(PARAMS_NAME, &DeleteParams::default()).await);
    assert_eq!(deleted.code, 403, "{deleted:?}");
    let params = f.cms().get(PARAMS_NAME).await.expect("the parameters");
    assert_eq!(params.data.unwrap_or_default().get("work").map(String::as_str), Some("40"));
    f.stop().await;
}
