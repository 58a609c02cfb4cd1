//! `kube_fence_test_support::identity` on the shared test cluster: the functions that build a
//! client read its kubeconfig ([`super::kubeconfig`]).

use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use kube::config::Kubeconfig;
use kube_fence_test_support::identity as on;
pub use kube_fence_test_support::identity::{grant_worker_rbac, pod_token, pods_of, wait_authorized, wait_user_authorized, worker_pods};

/// A client that acts as `user`.
pub async fn client_as(user: &str) -> Client {
    on::client_as(&super::kubeconfig().await, user).await
}

/// The shared cluster's kubeconfig with `token` as its only credential.
pub async fn kubeconfig_with_token(token: &str) -> Kubeconfig {
    on::kubeconfig_with_token(&super::kubeconfig().await, token)
}

/// A client that authenticates with a ServiceAccount token bound to Pod `pod`.
pub async fn client_as_pod(admin: &Client, ns: &str, service_account: &str, pod: &Pod) -> Client {
    on::client_as_pod(&super::kubeconfig().await, admin, ns, service_account, pod).await
}

/// A kubeconfig file that authenticates as Pod `pod`, for a process run as that Pod would be.
pub async fn kubeconfig_as_pod(admin: &Client, ns: &str, service_account: &str, pod: &Pod) -> tempfile::NamedTempFile {
    on::kubeconfig_as_pod(&super::kubeconfig().await, admin, ns, service_account, pod).await
}
