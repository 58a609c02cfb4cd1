//! The public API: custom resource types, and the CRD manifests generated from them.

mod lease;
mod tokens;

pub use lease::*;
pub use tokens::*;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

/// The API group of kube-fence's custom resources.
pub const GROUP: &str = "kubefence.io";

/// All CRDs kube-fence owns: the Lease, and the policy path's parameters (`LeaseTokens`).
pub fn crds() -> [CustomResourceDefinition; 2] {
    [Lease::crd(), LeaseTokens::crd()]
}

/// All CRDs kube-fence owns, as one multi-document YAML stream (what `kube-fence crd` prints and
/// what `crds/kubefence.io_leases.yaml` holds).
pub fn crds_yaml() -> Result<String, serde_yaml::Error> {
    let mut out = String::new();
    for crd in crds() {
        out.push_str("---\n");
        out.push_str(&serde_yaml::to_string(&crd)?);
    }
    Ok(out)
}
