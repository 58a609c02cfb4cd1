//! kube-fence: fencing tokens for Kubernetes.
//!
//! A lease says who may *try*; a fencing token says whose effect may *stick*.
//!
//! - [`token`]: what a token is, how it is written and parsed.
//! - [`api`]: the `Lease` custom resource (`kubefence.io/v1alpha1`).
//! - [`lease`]: where a token is issued — the lease state machine and its controller.
//! - [`admission`]: where a write is judged — the decision table and the webhook server.
//! - [`client`]: the library workers use: acquire, keep alive, release, fenced writes.
//! - [`cli`]: the `kube-fence` command line.
//! - [`process`]: a running process's identity and shutdown signal.
#![forbid(unsafe_code)]

pub mod admission;
pub mod api;
pub mod cli;
pub mod client;
pub mod history;
pub mod lease;
pub mod process;
pub mod telemetry;
pub mod token;
