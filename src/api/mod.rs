//! The public API: custom resource types, and the CRD manifests generated from them.

mod lease;

pub use lease::*;

use kube::CustomResourceExt;

/// The API group of kube-fence's custom resources.
pub const GROUP: &str = "kubefence.io";

/// All CRDs kube-fence owns, as one multi-document YAML stream (what `kube-fence crd` prints and
/// what `crds/` holds).
pub fn crds_yaml() -> Result<String, serde_yaml::Error> {
    let mut out = String::new();
    #[allow(clippy::single_element_loop)] // one CRD today; the stream is the interface
    for crd in [Lease::crd()] {
        out.push_str("---\n");
        out.push_str(&serde_yaml::to_string(&crd)?);
    }
    Ok(out)
}
