//! A real API server for a test: a client with kube-fence's CRDs installed, and a namespace of
//! the test's own, so tests never see each other's objects.

use std::fmt::Debug;
use std::path::Path;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::{Namespace, ServiceAccount};
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use tokio::sync::OnceCell;

static CRDS: OnceCell<()> = OnceCell::const_new();

/// A client for the cluster of the kubeconfig at `path`, with kube-fence's CRDs installed and
/// established (once per process: every test of a binary shares the cluster).
pub async fn client(kubeconfig: &Path) -> Client {
    let client = client_for(kubeconfig).await;
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
    for crd in kube_fence_api::crds() {
        let name = crd.metadata.name.clone().expect("CRD has a name");
        crds.patch(&name, &PatchParams::apply("kube-fence-tests").force(), &Patch::Apply(&crd)).await.expect("apply CRD");
        let established = kube::runtime::wait::await_condition(crds.clone(), &name, kube::runtime::wait::conditions::is_crd_established());
        tokio::time::timeout(Duration::from_secs(30), established).await.expect("CRD established in 30s").expect("watch CRD");
    }
    // Established is not yet served: for a moment after it, requests for the new resource can
    // still get 404. Tests with short timeouts must not spend them on that.
    let leases: Api<kube_fence_api::Lease> = Api::all(client.clone());
    let tokens: Api<kube_fence_api::LeaseTokens> = Api::all(client.clone());
    let fences: Api<kube_fence_api::FencedController> = Api::all(client);
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(e) = async {
        leases.list(&ListParams::default().limit(1)).await?;
        fences.list(&ListParams::default().limit(1)).await?;
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
    // Pods need the namespace's `default` ServiceAccount, which kube-controller-manager creates
    // some time after the namespace: on a busy machine a test's first Pod can come first
    // ("serviceaccount default not found"). Created here, so no test races that controller.
    let default_sa =
        ServiceAccount { metadata: kube::api::ObjectMeta { name: Some("default".into()), ..Default::default() }, ..Default::default() };
    match Api::<ServiceAccount>::namespaced(client.clone(), &name).create(&PostParams::default(), &default_sa).await {
        Ok(_) => {}
        Err(kube::Error::Api(status)) if status.code == 409 => {}
        Err(e) => panic!("create the default ServiceAccount of {name}: {e}"),
    }
    name
}

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
