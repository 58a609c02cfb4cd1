//! The denial contract between the webhook and the writers lives in the contract crate both
//! sides depend on (`kube_fence_api::denial`); re-exported here under its old path.

pub use kube_fence_api::denial::*;
