//! Clients that act as someone other than the cluster admin: a worker with ordinary namespace
//! RBAC, impersonated by the admin's credentials (the API server authorizes the impersonated
//! user exactly as if it had logged in), or a Pod, with a ServiceAccount token bound to it.
//! Every function that builds a client takes the cluster's admin kubeconfig (`kubeconfig`).

use std::path::Path;

use k8s_openapi::api::rbac::v1::{PolicyRule, Role, RoleBinding, RoleRef, Subject};
use kube::api::{Api, ObjectMeta, Patch, PatchParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};

/// A client that acts as `user`, by the credentials of the kubeconfig at `path`.
pub async fn client_as(path: &Path, user: &str) -> Client {
    let kubeconfig = Kubeconfig::read_from(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
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
                api_groups: Some(vec![kube_fence_api::GROUP.into()]),
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
    // Both bindings in effect: a worker's first call is often an acquire, which fails at once
    // on a refused watch.
    wait_user_authorized(admin, user, ns, kube_fence_api::GROUP, "leases", "watch", None).await;
    wait_user_authorized(admin, user, ns, "", "configmaps", "create", None).await;
}

/// Waits, up to 30 s, until the API server's authorizer lets `user` `verb` `group`/`resource`
/// (the object `name`, if given) in `ns`, as the admin's SubjectAccessReview sees it: a Role or
/// RoleBinding just written is in effect a moment later. For a ServiceAccount, `user` is
/// `system:serviceaccount:NS:NAME`.
pub async fn wait_user_authorized(admin: &Client, user: &str, ns: &str, group: &str, resource: &str, verb: &str, name: Option<&str>) {
    use k8s_openapi::api::authorization::v1::{ResourceAttributes, SubjectAccessReview, SubjectAccessReviewSpec};
    let review = SubjectAccessReview {
        spec: SubjectAccessReviewSpec {
            user: Some(user.into()),
            groups: Some(vec!["system:authenticated".into()]),
            resource_attributes: Some(ResourceAttributes {
                namespace: Some(ns.into()),
                group: Some(group.into()),
                resource: Some(resource.into()),
                verb: Some(verb.into()),
                name: name.map(str::to_string),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let api: Api<SubjectAccessReview> = Api::all(admin.clone());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let answer = api.create(&kube::api::PostParams::default(), &review).await.expect("a subject access review");
        if answer.status.is_some_and(|s| s.allowed) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "{user} may not {verb} {group}/{resource} in {ns} within 30 s");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// Pods `names` running as ServiceAccount `service_account` in `ns`. Nothing needs to run them:
/// a Pod-bound token needs only the Pod object. A scheduling gate nobody lifts keeps them off
/// every node, so on a cluster with nodes (the node suite, kind) no kubelet tries to pull their
/// image, which no registry serves.
pub async fn pods_of(admin: &Client, ns: &str, service_account: &str, names: &[&str]) -> Vec<k8s_openapi::api::core::v1::Pod> {
    use k8s_openapi::api::core::v1::Pod;
    let pods: Api<Pod> = Api::namespaced(admin.clone(), ns);
    let mut made = Vec::new();
    for name in names {
        let pod: Pod = serde_json::from_value(serde_json::json!({"metadata": {"name": name},
            "spec": {"serviceAccountName": service_account, "schedulingGates": [{"name": "kubefence.io/never-run"}],
                     "containers": [{"name": "c", "image": "registry.invalid/none"}]}}))
        .expect("a Pod from a literal");
        made.push(pods.create(&kube::api::PostParams::default(), &pod).await.expect("create the Pod"));
    }
    made
}

/// The ServiceAccount `worker` in `ns` with what a worker ordinarily has ([`grant_worker_rbac`]),
/// and Pods `names` running as it.
pub async fn worker_pods(admin: &Client, ns: &str, names: &[&str]) -> Vec<k8s_openapi::api::core::v1::Pod> {
    use k8s_openapi::api::core::v1::ServiceAccount;
    let sa: ServiceAccount = serde_json::from_value(serde_json::json!({"metadata": {"name": "worker"}})).expect("a literal");
    Api::<ServiceAccount>::namespaced(admin.clone(), ns).create(&kube::api::PostParams::default(), &sa).await.expect("create worker");
    grant_worker_rbac(admin, ns, &format!("system:serviceaccount:{ns}:worker")).await;
    pods_of(admin, ns, "worker", names).await
}

/// A ServiceAccount token bound to Pod `pod` (as the kubelet gives a Pod): the API server then
/// knows the requester's Pod name (`userInfo.extra["authentication.kubernetes.io/pod-name"]`).
pub async fn pod_token(admin: &Client, ns: &str, service_account: &str, pod: &k8s_openapi::api::core::v1::Pod) -> String {
    use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
    use k8s_openapi::api::core::v1::ServiceAccount;
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            audiences: None,
            attestations: None,
            bound_object_ref: Some(BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: pod.metadata.name.clone(),
                uid: pod.metadata.uid.clone(),
            }),
            expiration_seconds: Some(3600),
        }),
        ..Default::default()
    };
    let accounts: Api<ServiceAccount> = Api::namespaced(admin.clone(), ns);
    let issued =
        accounts.create_token_request(service_account, &kube::api::PostParams::default(), &request).await.expect("a Pod-bound token");
    issued.status.and_then(|s| s.token).expect("token in the TokenRequest status")
}

/// The kubeconfig at `path` with `token` as its only credential.
pub fn kubeconfig_with_token(path: &Path, token: &str) -> Kubeconfig {
    let mut kubeconfig = Kubeconfig::read_from(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
    for named in &mut kubeconfig.auth_infos {
        if let Some(auth) = named.auth_info.as_mut() {
            auth.token = Some(token.to_string().into());
            auth.client_certificate_data = None;
            auth.client_key_data = None;
            auth.client_certificate = None;
            auth.client_key = None;
        }
    }
    kubeconfig
}

/// A client that authenticates with a ServiceAccount token bound to Pod `pod` ([`pod_token`]).
pub async fn client_as_pod(path: &Path, admin: &Client, ns: &str, service_account: &str, pod: &k8s_openapi::api::core::v1::Pod) -> Client {
    let token = pod_token(admin, ns, service_account, pod).await;
    let kubeconfig = kubeconfig_with_token(path, &token);
    let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await.expect("kubeconfig is usable");
    Client::try_from(config).expect("client from kubeconfig")
}

/// A kubeconfig file that authenticates as Pod `pod`, for a process run as that Pod would be.
pub async fn kubeconfig_as_pod(
    path: &Path,
    admin: &Client,
    ns: &str,
    service_account: &str,
    pod: &k8s_openapi::api::core::v1::Pod,
) -> tempfile::NamedTempFile {
    let kubeconfig = kubeconfig_with_token(path, &pod_token(admin, ns, service_account, pod).await);
    let file = tempfile::NamedTempFile::new().expect("a temporary kubeconfig");
    serde_saphyr::to_io_writer(&mut &file, &kubeconfig).expect("write the kubeconfig");
    file
}

/// Waits (at most 30 s) until `client` may `verb` `resource` in `ns`: RBAC bindings take effect
/// a moment after they are written.
pub async fn wait_authorized(client: &Client, ns: &str, group: &str, resource: &str, verb: &str) {
    use k8s_openapi::api::authorization::v1::{ResourceAttributes, SelfSubjectAccessReview, SelfSubjectAccessReviewSpec};
    let review = SelfSubjectAccessReview {
        spec: SelfSubjectAccessReviewSpec {
            resource_attributes: Some(ResourceAttributes {
                namespace: Some(ns.into()),
                group: Some(group.into()),
                resource: Some(resource.into()),
                verb: Some(verb.into()),
                ..Default::default()
            }),
            ..Default::default()
        },
        ..Default::default()
    };
    let api: Api<SelfSubjectAccessReview> = Api::all(client.clone());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let answer = api.create(&kube::api::PostParams::default(), &review).await.expect("a self subject access review");
        if answer.status.is_some_and(|s| s.allowed) {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "{verb} {group}/{resource} in {ns} was not allowed within 30 s");
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}
