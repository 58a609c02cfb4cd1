//! The contract between kube-fence and its workers: what the operator, the webhook and the
//! client library (`kube-fence-client`) all speak, and nothing of any of them.
//!
//! - the `Lease` custom resource (`kubefence.io/v1alpha1`, [`Lease`]), the writer fence's opt-in
//!   ([`FencedController`]) and the policy path's parameters ([`LeaseTokens`]), with the CRDs generated from them ([`crds`], [`crds_yaml`]);
//! - [`token`]: what a fencing token is, how it is written and parsed;
//! - [`names`]: the labels and annotations that guard an object and carry a token;
//! - [`state`]: a Lease's state as the controller writes it (who holds it, for how long);
//! - [`denial`]: why the webhook denied a write ([`denial::Reason`]) and the facts it sends
//!   with the denial, typed, written by the webhook and read back by the writer;
//! - [`policy_path`]: the same for the writes the API server judges itself (`--policy-path`).
//!
//! A worker does not depend on this crate directly: `kube-fence-client` re-exports it.
#![forbid(unsafe_code)]

pub mod denial;
mod fenced;
mod lease;
pub mod names;
pub mod policy_path;
mod reason;
pub mod state;
pub mod token;
mod tokens;

pub use fenced::*;
pub use lease::*;
pub use tokens::*;

use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
use kube::CustomResourceExt;

/// The API group of kube-fence's custom resources.
pub const GROUP: &str = "kubefence.io";

/// All CRDs kube-fence owns: the Lease, the policy path's parameters (`LeaseTokens`), and the
/// writer fence's opt-in (`FencedController`).
pub fn crds() -> [CustomResourceDefinition; 3] {
    [Lease::crd(), LeaseTokens::crd(), FencedController::crd()]
}

/// All CRDs kube-fence owns, as one multi-document YAML stream (what `kube-fence crd` prints and
/// what `crds/kubefence.io_leases.yaml` holds).
pub fn crds_yaml() -> Result<String, serde_saphyr::ser::Error> {
    let mut out = String::new();
    for crd in crds() {
        out.push_str("---\n");
        out.push_str(&serde_saphyr::to_string(&crd)?);
    }
    Ok(out)
}
