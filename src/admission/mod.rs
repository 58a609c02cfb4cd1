//! Where a write is judged: the fencing webhook.
//!
//! - [`decision`]: the pure decision table (docs/design.md §5).
//! - [`review`]: the wire — AdmissionReview in, decision facts out, AdmissionResponse back.
//! - [`denial`]: the typed facts of a denial, written by the webhook, read by the client.
//! - [`leader`]: fencing an unmodified leader-elected controller by who holds its
//!   `coordination.k8s.io` Lease (pure, plus its one quorum read).
//! - [`writer`]: fencing every write of an opted-in ServiceAccount (`kubefence.io/writers` on
//!   its leader-election Lease) by who holds that Lease (pure, plus its one quorum read), and
//!   [`writer_routing`]: the webhooks that send exactly those writes, kept in step.
//! - [`leases`]: reading the bound lease — watch cache, or a quorum read when the cache could be
//!   stale in the unsafe direction.
//! - [`server`]: the HTTPS server (`/validate`, `/healthz`, `/readyz`, `/metrics`) and its deadlines.
//! - [`bounds`]: what one client can cost: connections open at once, quorum reads per source.
//! - [`events`]: Kubernetes Events for rejected writes, budgeted per source.
//! - [`metrics`]: the webhook's metrics.
//! - [`tls`]: serving certificates — files hot-reloaded, or self-managed in a Secret.
//! - [`policy_path`]: the writes the API server judges itself with `--policy-path` (CEL).
//! - [`registration`]: the ValidatingWebhookConfiguration and the lease-status policy.

pub mod bounds;
pub mod decision;
pub mod denial;
pub mod events;
pub mod leader;
pub mod leases;
pub mod local;
pub mod metrics;
pub mod policy_path;
pub mod registration;
pub mod review;
pub mod server;
pub mod shared_reads;
pub mod tls;
pub mod writer;
pub mod writer_routing;
