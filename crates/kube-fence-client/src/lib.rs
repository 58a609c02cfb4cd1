//! The library workers use: acquire a lease, keep it alive, release it, and write guarded
//! objects with the grant's fencing token. A worker depends on this crate alone: it brings the
//! contract it shares with kube-fence's webhook ([`api`]: the Lease types, [`Token`], the label
//! and annotation names, the typed denials) and nothing of the operator (no server, no CLI).
//!
//! ```no_run
//! # async fn example() -> Result<(), kube_fence_client::Error> {
//! use std::time::Duration;
//! use k8s_openapi::api::core::v1::ConfigMap;
//! use kube::api::Api;
//! use kube_fence_client::{AcquireOptions, Error, Leases};
//!
//! let client = kube::Client::try_default().await?;
//! let leases = Leases::new(client.clone(), "jobs");
//! // Waits while another worker holds `report-writer`, up to 30 s.
//! let grant = leases
//!     .acquire("report-writer", "worker-7", AcquireOptions::default().duration(Duration::from_secs(15)).timeout(Duration::from_secs(30)))
//!     .await?;
//! let mut keep_alive = leases.keep_alive(&grant);
//!
//! let configmaps: Api<ConfigMap> = Api::namespaced(client, "jobs");
//! let mut report = configmaps.get("report").await?;
//! report.data.get_or_insert_with(Default::default).insert("total".into(), "42".into());
//! tokio::select! {
//!     // The write carries the token; a newer holder's write makes it fail with StaleToken.
//!     written = grant.replace(&configmaps, &report) => match written {
//!         Ok(_) => {}
//!         Err(Error::StaleToken { presented, recorded }) => {
//!             eprintln!("a newer holder (token {recorded}) wrote after us (token {presented}); rereading");
//!         }
//!         Err(other) => return Err(other),
//!     },
//!     loss = keep_alive.lost() => eprintln!("lost the lease: {loss}"),
//! }
//! leases.release(&grant).await?;
//! # Ok(()) }
//! ```
//!
//! A holder that starts work someone else finishes — a Job, a Pod, a work item — hands its
//! grant down with [`Grant::delegate`]; the worker writes with [`Delegated::from_env`] (or
//! [`Delegated::from_object`]), fenced exactly like the holder, with nothing to renew or release.
//!
//! Safety never rests on the keep-alive or on clocks: a write is accepted only if its token is
//! newer than the one the object records, and that is judged by the API server in the same
//! compare-and-swap as the write. The keep-alive exists so a worker *stops trying* promptly.

#![forbid(unsafe_code)]

/// The README's worker, compiled by `cargo test --doc` so it cannot drift.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;

mod delegate;
mod fenced;
mod lease;

/// The contract shared with kube-fence (the `kube-fence-api` crate): the `Lease` custom resource,
/// tokens, label and annotation names, and the typed denials.
pub use kube_fence_api as api;
pub use kube_fence_api::names::DELEGATED_GRANT_ANNOTATION;
pub use kube_fence_api::token::Token;

pub use delegate::{Delegated, DelegationError, GRANT_ENV, stamp_delegation};
pub use fenced::{UNSEEN_TOKEN_BUDGET, delete_read_version, retry_unseen_token, stamp, write_id};
pub use lease::{AcquireOptions, Grant, Holding, KeepAlive, KeepAliveOptions, Leases, Loss, Step, loss, next_step};

use std::time::Duration;

/// The holder name a worker running in a Pod should use: `POD_NAME` (set it from the downward
/// API), else — inside a Pod, where a ServiceAccount token is mounted — the host name, which
/// Kubernetes sets to the Pod's name. This is the name a Lease with `spec.identity: Pod` checks
/// against the requester's token. `None` outside a Pod without `POD_NAME`.
pub fn pod_name() -> Option<String> {
    let nonempty = |v: String| Some(v.trim().to_string()).filter(|v| !v.is_empty());
    if let Some(pod) = std::env::var("POD_NAME").ok().and_then(nonempty) {
        return Some(pod);
    }
    let in_pod = std::path::Path::new("/var/run/secrets/kubernetes.io/serviceaccount/token").exists();
    in_pod.then(|| std::env::var("HOSTNAME").ok().and_then(nonempty)).flatten()
}

/// What can go wrong for a worker. [`Error::StaleToken`] is normal recovery, not a failure of
/// the system: a newer holder wrote first, so reread the state.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The fencing webhook rejected the write: the object already records a token at least as
    /// new as the one presented.
    #[error("stale fencing token: presented token {presented}, recorded token {recorded}")]
    StaleToken { presented: Token, recorded: Token },
    /// The object is holder-only (`kubefence.io/writer: holder`) and the requester is not the
    /// current holder of its identity-bound lease: another holder took over. Normal recovery,
    /// like [`Error::StaleToken`]: stop acting as the holder.
    #[error("not the holder of lease {lease}: {} is held by {}, the write came from {}", .lease, .holder.as_deref().unwrap_or("nobody"), .requester.as_deref().unwrap_or("an unknown requester"))]
    NotHolder { lease: String, holder: Option<String>, requester: Option<String> },
    /// The fencing webhook rejected the write for another reason (no token, a token the lease
    /// never issued, a lease that does not exist, ...); the denial's facts are typed.
    #[error("kube-fence denied the write ({}): {}", .0.reason, .0.lease.as_deref().map(|l| format!("lease {l}")).unwrap_or_else(|| "no lease".into()))]
    Fenced(kube_fence_api::denial::Denial),
    /// The object changed since it was read (resourceVersion precondition failed).
    #[error("the object changed since it was read: {0}")]
    Conflict(String),
    /// The lease was not granted within the timeout.
    #[error("timed out after {waited:?} waiting for lease {lease}{}", held_by.as_ref().map(|h| format!(" (held by {h})")).unwrap_or_default())]
    Timeout { lease: String, waited: Duration, held_by: Option<String> },
    /// The wait was cancelled.
    #[error("cancelled while waiting for lease {lease}")]
    Cancelled { lease: String },
    /// No Lease of that name exists.
    #[error("lease {lease} not found")]
    LeaseNotFound { lease: String },
    /// The lease is not held by this holder with this grant's token.
    #[error("lease {lease} is not held by {holder}: {loss}")]
    NotHeld { lease: String, holder: String, loss: Loss },
    /// Only merge, strategic-merge and apply patches can be stamped with a token.
    #[error("cannot stamp a token into this patch: {0}")]
    UnsupportedPatch(&'static str),
    /// The object lacks something a fenced write needs (a name, a resourceVersion).
    #[error("the object has no {0}")]
    Missing(&'static str),
    /// Any other API error.
    #[error(transparent)]
    Kube(#[from] kube::Error),
}

impl Error {
    /// Stable short name of the variant, for logs and metrics.
    pub fn reason(&self) -> &'static str {
        match self {
            Error::StaleToken { .. } => "StaleToken",
            Error::NotHolder { .. } => "NotHolder",
            Error::Fenced(denial) => denial.reason.as_str(),
            Error::Conflict(_) => "Conflict",
            Error::Timeout { .. } => "Timeout",
            Error::Cancelled { .. } => "Cancelled",
            Error::LeaseNotFound { .. } => "LeaseNotFound",
            Error::NotHeld { .. } => "NotHeld",
            Error::UnsupportedPatch(_) => "UnsupportedPatch",
            Error::Missing(_) => "Missing",
            Error::Kube(_) => "Kube",
        }
    }
}
