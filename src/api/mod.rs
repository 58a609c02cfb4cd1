//! The public API: custom resource types, and the CRD manifests generated from them. They live
//! in the contract crate the workers share (`kube-fence-api`); re-exported here.

pub use kube_fence_api::{
    Comparison, DEFAULT_LEASE_DURATION_SECONDS, Enforcement, FencingPolicy, GROUP, HolderIdentity, Lease, LeaseSpec, LeaseStatus,
    LeaseTokens, LeaseTokensSpec, Phase, crds, crds_yaml,
};
