//! Shared support for the tests (and benchmarks) that run against a real API server.
//!
//! Every test binary shares one cluster (`kube_fence_testenv::shared_kubeconfig`: `KUBECONFIG`
//! when set, else a local control plane started once for the whole test binary) and every test
//! gets a namespace of its own, so tests never see each other's objects.
//!
//! Judging writes: [`wait_fenced`] waits until the API server sends a namespace's guarded writes
//! to kube-fence; [`accepted`] and [`rejected`] say how the API server answered one write.
//! They read the API server's typed Status (code and reason), never its message text.
#![allow(dead_code)]

pub mod identity;
pub mod leader;

use std::collections::BTreeMap;
use std::fmt::Debug;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, DeleteParams, ListParams, ObjectMeta, Patch, PatchParams, PostParams, Preconditions};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::core::Status;
use kube::{Client, Config};
use kube_fence::admission::decision::Reason;
use kube_fence::token::LEASE_LABEL;
use tokio::sync::OnceCell;

static CRDS: OnceCell<()> = OnceCell::const_new();

/// The shared test cluster's kubeconfig (`kube_fence_testenv::shared_kubeconfig`, off the
/// async runtime: the first call may start a control plane).
pub async fn kubeconfig() -> PathBuf {
    tokio::task::spawn_blocking(kube_fence_testenv::shared_kubeconfig).await.expect("control plane thread")
}

/// A client for the shared test cluster, with kube-fence's CRDs installed and established.
pub async fn client() -> Client {
    let client = client_for(&kubeconfig().await).await;
    CRDS.get_or_init(|| install_crds(client.clone())).await;
    client
}

/// A client for the cluster of the kubeconfig at `path`.
pub async fn client_for(path: &Path) -> Client {
    let kubeconfig = Kubeconfig::read_from(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await.expect("kubeconfig is usable");
    Client::try_from(config).expect("client from kubeconfig")
}

/// Applies kube-fence's CRDs (from the Rust types) and waits until they are established.
pub async fn install_crds(client: Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    for crd in kube_fence::api::crds() {
        let name = crd.metadata.name.clone().expect("CRD has a name");
        crds.patch(&name, &PatchParams::apply("kube-fence-tests").force(), &Patch::Apply(&crd)).await.expect("apply CRD");
        let established = kube::runtime::wait::await_condition(crds.clone(), &name, kube::runtime::wait::conditions::is_crd_established());
        tokio::time::timeout(Duration::from_secs(30), established).await.expect("CRD established in 30s").expect("watch CRD");
    }
    // Established is not yet served: for a moment after it, requests for the new resource can
    // still get 404. Tests with short timeouts must not spend them on that.
    let leases: Api<kube_fence::api::Lease> = Api::all(client.clone());
    let tokens: Api<kube_fence::api::LeaseTokens> = Api::all(client);
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(e) = async {
        leases.list(&ListParams::default().limit(1)).await?;
        tokens.list(&ListParams::default().limit(1)).await
    }
    .await
    {
        assert!(Instant::now() < deadline, "kube-fence's resources are not served 30 s after their CRDs were established: {e}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A fresh namespace for one test, named after it.
pub async fn namespace(client: &Client, test: &str) -> String {
    let suffix: String =
        format!("{:x}", std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0));
    let mut name: String = format!("kf-{}-{}", test.replace('_', "-"), &suffix[suffix.len().saturating_sub(6)..]);
    name.truncate(63);
    let name = name.trim_end_matches('-').to_string();
    let ns = Namespace { metadata: kube::api::ObjectMeta { name: Some(name.clone()), ..Default::default() }, ..Default::default() };
    Api::<Namespace>::all(client.clone()).create(&PostParams::default(), &ns).await.expect("create test namespace");
    name
}

/// A ConfigMap guarded by `lease` (bound by its label), without a token.
/// Waits until `name` is gone from `api` (deleted, finalizers and all), asserting it is gone
/// within `limit` of `since`; returns how long after `since` that was (tests report it).
pub async fn wait_gone<K>(api: &Api<K>, name: &str, since: Instant, limit: Duration, what: &str) -> Duration
where
    K: kube::Resource + Clone + serde::de::DeserializeOwned + Debug,
{
    while api.get_opt(name).await.expect("get").is_some() {
        assert!(since.elapsed() < limit, "{what} within {limit:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    since.elapsed()
}

pub fn guarded_configmap(name: &str, lease: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some([(LEASE_LABEL.to_string(), lease.to_string())].into()),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// What the API server answered a write: the write must have been refused (panics if it was
/// admitted or failed some other way, e.g. a transport error).
pub fn rejected<T: Debug>(result: Result<T, kube::Error>) -> Status {
    match result {
        Err(kube::Error::Api(e)) => *e,
        Ok(obj) => panic!("the write was admitted: {obj:?}"),
        Err(e) => panic!("the write failed without an answer from the API server: {e}"),
    }
}

/// What the API server stored: the write must have been admitted.
pub fn accepted<T>(result: Result<T, kube::Error>) -> T {
    result.unwrap_or_else(|e| panic!("the write was refused: {e}"))
}

/// Whether the API server refused a write because kube-fence judged and denied it: the Status
/// the webhook answered with travels to the writer unchanged, with kube-fence's `reason`.
pub fn denied_by_kube_fence(e: &Status, reason: Reason) -> bool {
    e.reason == reason.as_str()
}

/// Whether the API server refused a guarded write because it could not call the webhook
/// (`failurePolicy: Fail`): an internal error, 500, instead of the write.
pub fn failed_closed(e: &Status) -> bool {
    e.code == 500 && e.reason == "InternalError"
}

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
    use kube_fence::admission::policy_path::PolicyDenial;
    use kube_fence::api::{Lease, LeaseSpec};
    use kube_fence::token::TOKEN_ANNOTATION;
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

/// Whether process `pid` is stopped (state `T` in `/proc/<pid>/stat`: SIGSTOP took effect).
pub fn is_stopped(pid: u32) -> bool {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_else(|e| panic!("/proc/{pid}/stat: {e}"));
    stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next()) == Some("T")
}

/// Sends `signal` (`-STOP`, `-CONT`) to process `pid` and waits until it took effect (stopped,
/// or running again), at most 10 s.
pub fn signal_and_wait(pid: u32, signal: &str) {
    let status = std::process::Command::new("kill").args([signal, &pid.to_string()]).status().expect("run kill");
    assert!(status.success(), "kill {signal} {pid}");
    let deadline = Instant::now() + Duration::from_secs(10);
    while is_stopped(pid) != (signal == "-STOP") {
        assert!(Instant::now() < deadline, "kill {signal} {pid} took no effect in 10 s");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Waits (at most `limit`) for the ready file at `path` of the kube-fence process `child`
/// (`--ready-file`, [`kube_fence::ready`]), and returns where it serves. Panics if the process
/// exits first.
pub async fn wait_ready_file(path: &Path, child: &mut std::process::Child, limit: Duration) -> kube_fence::ready::Ready {
    let deadline = Instant::now() + limit;
    loop {
        match kube_fence::ready::Ready::read(path) {
            Ok(Some(ready)) => return ready,
            Ok(None) => {}
            Err(err) => panic!("{err}"),
        }
        if let Ok(Some(status)) = child.try_wait() {
            panic!("kube-fence exited ({status}) before writing its ready file {}", path.display());
        }
        assert!(Instant::now() < deadline, "no ready file {} within {limit:?}", path.display());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
