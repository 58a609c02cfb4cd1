//! The foundation works: a real API server answers, and the CRDs kube-fence generates are
//! accepted, served and enforced by it.

mod common;

use kube::api::{Api, PostParams};
use kube_fence::api::{Lease, LeaseSpec};

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
