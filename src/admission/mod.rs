//! Where a write is judged: the fencing webhook.
//!
//! - [`decision`]: the pure decision table (docs/design.md §5).
//! - [`leases`]: reading the bound lease — watch cache, or a quorum read when the cache could be
//!   stale in the unsafe direction.
//! - [`server`]: the HTTPS server (`/validate`, `/healthz`, `/readyz`, `/metrics`).
//! - [`tls`]: serving certificates — files hot-reloaded, or self-managed in a Secret.
//! - [`registration`]: the ValidatingWebhookConfiguration.

pub mod decision;
pub mod leases;
pub mod local;
pub mod registration;
pub mod server;
pub mod tls;
