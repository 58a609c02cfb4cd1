//! Where a write is judged: the fencing webhook. Layers, each importing only those below it (an
//! import graph of `src/` has no circle: `tests/layers.rs`):
//!
//! - [`judge`]: the pure core — the vocabulary and read values, the guards (token, leader
//!   election, writer fence), the pipeline that combines them.
//! - [`metrics`]: the webhook's metrics (counted by the reader and the transport).
//! - [`reads`]: the real lease reads — watch cache and quorum reads, budgeted per source, shared.
//! - [`http`]: the wire and the transport — AdmissionReview in and out, the HTTPS server, its
//!   bounds, TLS, Events for rejected writes.
//! - [`registration`]: what is registered with the API server — the webhook configurations (and
//!   the chart's templates of them), the writer fence's routing, the policy path.
//! - [`start`]: startup — the webhook as one process runs it, in a cluster or locally: one
//!   configuration, one start function (lease cache, server, writer routing).
//! - [`local`]: local mode — a loopback port, a CA made in-process, the configuration registered
//!   by URL; started by [`start`].

pub mod http;
pub mod judge;
pub mod local;
pub(crate) mod metrics;
pub mod reads;
pub mod registration;
pub mod start;
