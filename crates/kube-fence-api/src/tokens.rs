use std::collections::BTreeMap;

use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::token::Token;

/// The policy path's parameters for one namespace: the newest issued token of every kube-fence
/// Lease there, which the API server judges fresh-token writes against. Written only by the
/// kube-fence controller, which keeps one, named kube-fence-tokens, in every namespace with
/// Leases and none elsewhere.
//
// Workers get no RBAC on this kind, and a policy refuses every write to it from anyone but the
// controller (and the namespace controller and garbage collector, which delete what a namespace
// holds): kube-fence's `admission::registration::Registration::params_policy`. The policy reads it:
// `kube_fence::admission::registration::policy_path`; the controller keeps it: `kube_fence::lease::params`.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "kubefence.io",
    version = "v1alpha1",
    kind = "LeaseTokens",
    plural = "leasetokens",
    singular = "leasetokens",
    namespaced,
    doc = "The newest issued fencing token of every kube-fence Lease in this namespace, for the policy path (the API server judges fresh-token writes against it). Written only by the kube-fence controller.",
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
pub struct LeaseTokensSpec {
    /// Lease name → the newest token it issued (`status.token`). Exactly the namespace's Leases
    /// that have issued one. Replaced as a whole by every write (an atomic map), so no writer's
    /// keys outlive its write.
    #[serde(default)]
    #[schemars(extend("x-kubernetes-map-type" = "atomic"))]
    pub tokens: BTreeMap<String, Token>,
}
