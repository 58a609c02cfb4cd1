//! crds/ is generated from the Rust types; this fails when the two drift apart.

#[test]
fn crds_directory_matches_the_rust_types() {
    let generated = kube_fence_api::crds_yaml().expect("CRDs serialize to YAML");
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/crds/kubefence.io_leases.yaml");
    let committed = std::fs::read_to_string(path).unwrap_or_default();
    assert!(
        committed == generated,
        "{path} is out of date with the types of crates/kube-fence-api: regenerate it with\n    cargo run -- crd > crds/kubefence.io_leases.yaml"
    );
}

/// The policy path's parameters: a kind of kube-fence's own (workers get no RBAC on it), whose
/// token map an apply replaces whole.
#[test]
fn lease_tokens_crd_has_the_public_names() {
    let yaml = kube_fence_api::crds_yaml().expect("CRDs serialize to YAML");
    for needle in ["name: leasetokens.kubefence.io", "kind: LeaseTokens", "x-kubernetes-map-type: atomic", "format: int64"] {
        assert!(yaml.contains(needle), "generated CRD lacks {needle:?}");
    }
}

#[test]
fn lease_crd_has_the_public_names() {
    let yaml = kube_fence_api::crds_yaml().expect("CRDs serialize to YAML");
    for needle in ["name: leases.kubefence.io", "- flease", "- kubefence", "subresources:", "status: {}", "x-kubernetes-validations"] {
        assert!(yaml.contains(needle), "generated CRD lacks {needle:?}");
    }
}
