//! kube-fence: fencing tokens for Kubernetes.
//!
//! A lease says who may *try*; a fencing token says whose effect may *stick*. kube-fence's
//! controller gives every grant of a `Lease` (`kubefence.io/v1alpha1`) a strictly increasing
//! token, and its validating webhook rejects every write to a guarded object (one labelled
//! `kubefence.io/lease`) whose token is not newer than the one the object already records. This
//! crate is the operator: the controller, the webhook and the `kube-fence` binary (a thin
//! [`cli`] over them). Workers depend on `kube-fence-client` alone (re-exported here as
//! [`client`]); the contract both sides speak is `kube-fence-api` (the `Lease` custom resource,
//! tokens, the names on objects, denials).
//!
//! # A worker
//!
//! A worker acquires a lease, keeps it alive, writes guarded objects with the grant's token and
//! releases it; if a newer holder wrote in between, the write fails with
//! [`client::Error::StaleToken`]. Workers depend on the `kube-fence-client` crate alone (its
//! README has the whole worker), not on this one.
//!
//! # Modules
//!
//! - [`client`]: the library workers use (the `kube-fence-client` crate, re-exported): acquire,
//!   keep alive, release, fenced writes.
//! - [`lease`]: where a token is issued — the lease state machine and its controller.
//! - [`admission`]: where a write is judged — the decision table and the webhook server.
//! - [`fenced`]: the FencedController status — whether each writer fence works, and who holds its Lease.
//! - [`cli`]: the `kube-fence` command line.
//! - [`telemetry`]: logs and metrics shared by every long-running subcommand.
//! - [`process`]: a running process's identity and shutdown signal.
//! - [`ready`]: the ready file, where a process that bound its ports says which they are.
//! - [`limit`]: the one rate limiter (a token bucket per key), pure.
//! - [`events`]: the one Kubernetes Event publisher (budgeted, bounded in flight, never waited on).
#![forbid(unsafe_code)]
// The module overviews name the private modules that do the work; `cargo doc
// --document-private-items` (how this crate is read by those who change it) resolves them.
#![allow(rustdoc::private_intra_doc_links)]
// What is not part of the crate's API says so: `pub` only where another crate may name it.
#![warn(unreachable_pub)]

pub mod admission;
pub mod cli;
pub(crate) mod events;
pub mod fenced;
pub use kube_fence_client as client;
pub mod lease;
pub(crate) mod limit;
pub(crate) mod process;
pub mod ready;
pub mod telemetry;
