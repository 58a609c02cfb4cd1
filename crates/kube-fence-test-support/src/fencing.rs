//! Waiting until the API server sends a namespace's guarded writes to kube-fence (the webhook),
//! or judges them itself (the policy path).

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::Client;
use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube_fence_api::denial::Reason;

use crate::writes::{denied_by_kube_fence, failed_closed, guarded_configmap};

/// What [`wait_fenced`] waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fencing {
    /// kube-fence judges the writes (a guarded write naming no existing lease is denied).
    Judged,
    /// The webhook is registered but cannot be called: guarded writes fail closed.
    FailsClosed,
}

/// Waits until the API server sends guarded writes in `ns` — to objects that also carry
/// `labels`, for a registration scoped by object labels — to kube-fence, as `fencing` says.
/// The probe creates a guarded ConfigMap bound to a lease that does not exist, without a token
/// (removing it again when it was admitted, i.e. the webhook was not called yet). Panics after
/// `limit` with the last answer.
pub async fn wait_fenced(client: &Client, ns: &str, labels: &BTreeMap<String, String>, fencing: Fencing, limit: Duration) {
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let mut probe = guarded_configmap("kube-fence-probe", "kube-fence-probe");
    probe.metadata.labels.get_or_insert_default().extend(labels.clone());
    let deadline = Instant::now() + limit;
    loop {
        let last = match cms.create(&PostParams::default(), &probe).await {
            Err(kube::Error::Api(e))
                if match fencing {
                    Fencing::Judged => denied_by_kube_fence(&e, Reason::LeaseNotFound),
                    Fencing::FailsClosed => failed_closed(&e),
                } =>
            {
                return;
            }
            Ok(created) => {
                let rv = created.metadata.resource_version.clone();
                let precondition = Preconditions { resource_version: rv, uid: None };
                let _ = cms.delete("kube-fence-probe", &DeleteParams { preconditions: Some(precondition), ..Default::default() }).await;
                "admitted (the webhook was not called)".to_string()
            }
            // Not yet, or a component is restarting: ask again until the deadline.
            Err(e) => e.to_string(),
        };
        assert!(
            Instant::now() < deadline,
            "guarded writes in {ns} were not {fencing:?} by kube-fence within {limit:?}; last answer: {last}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether the tests run with the policy path on (`KF_POLICY_PATH=1`): the webhook is
/// registered with its skip condition and the policy, and the parameters are kept. The fault
/// suite and the webhook tests (the pause test among them) read it.
pub fn policy_path() -> bool {
    std::env::var("KF_POLICY_PATH").is_ok_and(|v| v == "1" || v == "true")
}

/// Waits until the API server judges fresh-token UPDATEs in `ns` with the policy path: a
/// dry-run write of a never-issued token to a guarded probe object is denied by the policy
/// (its parameter read, its binding active). Creates lease `kube-fence-probe-pp` (token 1) and
/// the probe object, judged by the webhook; panics after `limit` with the last answer.
pub async fn wait_policy_path(client: &Client, ns: &str, limit: Duration) {
    use kube_fence_api::names::TOKEN_ANNOTATION;
    use kube_fence_api::policy_path::PolicyDenial;
    use kube_fence_api::{Lease, LeaseSpec};
    const PROBE: &str = "kube-fence-probe-pp";
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    if leases.get_opt(PROBE).await.expect("get the probe lease").is_none() {
        leases.create(&PostParams::default(), &Lease::new(PROBE, LeaseSpec::default())).await.expect("create the probe lease");
        let status = serde_json::json!({"status": {"phase": "Held", "holder": "probe", "token": 1}});
        leases.patch_status(PROBE, &PatchParams::default(), &Patch::Merge(&status)).await.expect("probe lease status");
    }
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
    let mut probe = guarded_configmap(PROBE, PROBE);
    probe.metadata.annotations = Some([(TOKEN_ANNOTATION.to_string(), "1".to_string())].into());
    let deadline = Instant::now() + limit;
    let mut last = String::new();
    while Instant::now() < deadline {
        if cms.get_opt(PROBE).await.ok().flatten().is_none()
            && let Err(e) = cms.create(&PostParams::default(), &probe).await
        {
            last = e.to_string();
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        let never_issued = serde_json::json!({"metadata": {"annotations": {TOKEN_ANNOTATION: "4611686018427387904"}}});
        match cms.patch(PROBE, &PatchParams { dry_run: true, ..Default::default() }, &Patch::Merge(&never_issued)).await {
            Err(kube::Error::Api(e)) if PolicyDenial::from_status(&e).is_some() => return,
            Err(e) => last = e.to_string(),
            Ok(_) => last = "admitted (the policy is not active yet)".into(),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("the policy path does not judge writes in {ns} within {limit:?}; last answer: {last}");
}
