//! Clients that act as someone other than the cluster admin: a worker with ordinary namespace
//! RBAC, impersonated by the admin's credentials (the API server authorizes the impersonated
//! user exactly as if it had logged in).

use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use kube::api::{Api, ObjectMeta, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

/// A client that acts as `user`.
pub async fn client_as(user: &str) -> Client {
    let path = tokio::task::spawn_blocking(kube_fence_testenv::shared_kubeconfig).await.expect("control plane thread");
    let kubeconfig = Kubeconfig::read_from(&path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    let mut config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await.expect("kubeconfig is usable");
    config.auth_info.impersonate = Some(user.to_string());
    config.auth_info.impersonate_groups = Some(vec!["system:authenticated".into()]);
    Client::try_from(config).expect("client from kubeconfig")
}

/// Gives `user` what a worker ordinarily has in `ns`: the built-in `edit` role (every write on
/// the namespace's workloads, their `/scale` and `pods/eviction` included), plus kube-fence
/// Leases, their status, and Pods' ephemeral containers — more than a worker needs, so that the
/// attacks show what admission (not RBAC) stops.
pub async fn grant_worker_rbac(admin: &Client, ns: &str, user: &str) {
    let pp = PatchParams::apply("kube-fence-tests").force();
    let name = format!("worker-{user}");
    let role = Role {
        metadata: ObjectMeta { name: Some(name.clone()), namespace: Some(ns.into()), ..Default::default() },
        rules: Some(vec![
            PolicyRule {
                api_groups: Some(vec![kube_fence::api::GROUP.into()]),
                resources: Some(vec!["leases".into(), "leases/status".into()]),
                verbs: vec!["*".into()],
                ..Default::default()
            },
            PolicyRule {
                api_groups: Some(vec![String::new()]),
                resources: Some(vec!["pods/ephemeralcontainers".into(), "pods/status".into()]),
                verbs: vec!["*".into()],
                ..Default::default()
            },
            PolicyRule {
                api_groups: Some(vec!["apps".into()]),
                resources: Some(vec!["deployments/status".into()]),
                verbs: vec!["*".into()],
                ..Default::default()
            },
        ]),
    };
    Api::<Role>::namespaced(admin.clone(), ns).patch(&name, &pp, &Patch::Apply(&role)).await.expect("worker role");
    for (binding, kind, role_name) in [(format!("{name}-edit"), "ClusterRole", "edit".to_string()), (name.clone(), "Role", name.clone())] {
        let rb = RoleBinding {
            metadata: ObjectMeta { name: Some(binding.clone()), namespace: Some(ns.into()), ..Default::default() },
            role_ref: RoleRef { api_group: Some("rbac.authorization.k8s.io".into()), kind: kind.into(), name: role_name },
            subjects: Some(vec![Subject {
                api_group: Some("rbac.authorization.k8s.io".into()),
                kind: "User".into(),
                name: user.into(),
                namespace: None,
            }]),
        };
        Api::<RoleBinding>::namespaced(admin.clone(), ns).patch(&binding, &pp, &Patch::Apply(&rb)).await.expect("worker role binding");
    }
}
