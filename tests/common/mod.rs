//! Shared support for the tests that run against a real API server.
//!
//! Every test binary shares one cluster (`kube_fence_testenv::shared_kubeconfig`: `KUBECONFIG`
//! when set, else a local control plane started once for the whole test binary) and every test
//! gets a namespace of its own, so tests never see each other's objects.
#![allow(dead_code)]

pub mod identity;

use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config, CustomResourceExt};
use tokio::sync::OnceCell;

static CRDS: OnceCell<()> = OnceCell::const_new();

/// A client for the shared test cluster, with kube-fence's CRDs installed and established.
pub async fn client() -> Client {
    let path = tokio::task::spawn_blocking(kube_fence_testenv::shared_kubeconfig).await.expect("control plane thread");
    let kubeconfig = Kubeconfig::read_from(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await.expect("kubeconfig is usable");
    let client = Client::try_from(config).expect("client from kubeconfig");
    CRDS.get_or_init(|| install_crds(client.clone())).await;
    client
}

async fn install_crds(client: Client) {
    let crds: Api<CustomResourceDefinition> = Api::all(client);
    for crd in [kube_fence::api::Lease::crd()] {
        let name = crd.metadata.name.clone().expect("CRD has a name");
        crds.patch(&name, &PatchParams::apply("kube-fence-tests").force(), &Patch::Apply(&crd)).await.expect("apply CRD");
        let established = kube::runtime::wait::await_condition(crds.clone(), &name, kube::runtime::wait::conditions::is_crd_established());
        tokio::time::timeout(Duration::from_secs(30), established).await.expect("CRD established in 30s").expect("watch CRD");
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
