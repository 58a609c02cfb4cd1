//! The foundation works: a real API server answers, and the CRDs kube-fence generates are
//! accepted, served and enforced by it.

mod common;

use kube::api::{Api, PostParams};
use kube_fence_api::{Lease, LeaseSpec};

#[tokio::test]
async fn crds_are_served_and_validated_by_the_api_server() {
    let client = common::client().await;
    let ns = common::namespace(&client, "crds").await;
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);

    let ok = Lease::new("ok", LeaseSpec { holder: Some("worker-a".into()), ..Default::default() });
    let created = leases.create(&PostParams::default(), &ok).await.expect("a valid Lease is accepted");
    assert_eq!(created.spec.holder.as_deref(), Some("worker-a"));

    // The schema's bounds are enforced by the API server, not only documented.
    let bad = Lease::new("bad", LeaseSpec { lease_duration_seconds: Some(0), ..Default::default() });
    let err = leases.create(&PostParams::default(), &bad).await.expect_err("a zero duration is rejected");
    assert!(err.to_string().contains("leaseDurationSeconds"), "error names the field: {err}");
}

/// `kubectl explain` explains: every field's doc comment reaches the API server's schema.
#[tokio::test]
async fn kubectl_explain_describes_the_lease_fields() {
    let client = common::client().await; // CRDs installed
    let kubectl = kube_fence_testenv::binaries().expect("kubectl").join("kubectl");
    let kubeconfig = kube_fence_testenv::shared_kubeconfig();
    for (field, words) in [
        ("flease.spec.holder", "clear it to release the lease"),
        ("flease.spec.heartbeatTime", "Only the change"),
        ("flease.spec.fencing.comparison", "greater than the one the object records"),
        ("flease.spec.fencing.enforcement", "never back"),
        ("flease.spec.identity", "ServiceAccount token"),
        ("flease.status.token", "Strictly greater than every token"),
        ("flease.status.expireTime", "controller clock"),
    ] {
        // The API server publishes a new CRD's schema to OpenAPI a moment after it is established.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let (out, text) = loop {
            let out = tokio::task::spawn_blocking({
                let (kubectl, kubeconfig, field) = (kubectl.clone(), kubeconfig.clone(), field.to_string());
                move || {
                    std::process::Command::new(kubectl)
                        .args(["explain", &field])
                        .env("KUBECONFIG", kubeconfig)
                        .output()
                        .expect("kubectl explain")
                }
            })
            .await
            .expect("thread");
            let text = String::from_utf8_lossy(&out.stdout).split_whitespace().collect::<Vec<_>>().join(" ");
            if out.status.success() || std::time::Instant::now() > deadline {
                break (out, text);
            }
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
        };
        assert!(
            out.status.success() && text.contains(words),
            "kubectl explain {field} says {words:?}:\n{text}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // `kubectl get flease` shows holder, token, phase, identity binding, expiry and age.
    let ns = common::namespace(&client, "columns").await;
    Api::<Lease>::namespaced(client.clone(), &ns)
        .create(&PostParams::default(), &Lease::new("shown", LeaseSpec::default()))
        .await
        .expect("create lease");
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(kubectl).args(["get", "flease", "-n", &ns]).env("KUBECONFIG", kubeconfig).output().expect("kubectl get")
    })
    .await
    .expect("thread");
    let header = String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or_default().split_whitespace().collect::<Vec<_>>().join(" ");
    assert_eq!(header, "NAME HOLDER TOKEN PHASE IDENTITY EXPIRES AGE");
}
