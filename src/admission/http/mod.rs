//! The webhook's wire and transport.
//!
//! - [`review`]: the wire — AdmissionReview in, decision facts out, AdmissionResponse back.
//! - [`server`]: the HTTPS server (`/validate`, `/writer/…`, `/healthz`, `/readyz`, `/metrics`)
//!   and its deadlines.
//! - [`bounds`]: what one client can cost: connections open at once (a quarter kept for sources
//!   that send reviews), idle connections of other sources, failed connections.
//! - [`failures`]: which connections failed (charged to their source).
//! - [`events`]: Kubernetes Events for rejected writes, budgeted per source.
//! - [`tls`]: serving certificates — files hot-reloaded, or self-managed in a Secret.

pub mod bounds;
pub(crate) mod events;
pub(crate) mod failures;
pub mod review;
pub mod server;
pub mod tls;
