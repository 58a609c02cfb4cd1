//! Fencing tokens and the names that carry them, from the contract crate the workers share
//! (`kube_fence_api::token`, `kube_fence_api::names`); re-exported here under their old paths.

pub use kube_fence_api::names::{HOLDER_ONLY, LEASE_LABEL, TOKEN_ANNOTATION, WRITE_ANNOTATION, WRITER_LABEL};
pub use kube_fence_api::token::*;
