//! Where a write is judged: the fencing webhook.
//!
//! - [`pipeline`]: one request judged end to end — the preamble every guard kind shares, the
//!   plan (pure), the reads it asks for, the verdict (pure) — for the server, tests and bench.
//! - [`decision`]: the pure decision table of the token guard (docs/design.md §5).
//! - [`review`]: the wire — AdmissionReview in, decision facts out, AdmissionResponse back.
//! - [`denial`]: the typed facts of a denial, written by the webhook, read by the client.
//! - [`leader`]: fencing an unmodified leader-elected controller by who holds its
//!   `coordination.k8s.io` Lease (pure, plus its one quorum read).
//! - [`writer`]: fencing every write of an opted-in ServiceAccount (`kubefence.io/writers` on
//!   its leader-election Lease) by who holds that Lease (pure, plus its one quorum read), and
//!   [`writer_routing`]: the webhooks that send exactly those writes, kept in step.
//! - [`reads`]: the lease reads judging makes, behind one interface (`LeaseReads`): the real
//!   ones, budgeted per source, and an in-memory fake for tests; the read values only a reader
//!   makes.
//! - [`leases`]: reading leases from the API server — watch cache, or a quorum read when the
//!   cache could be stale in the unsafe direction.
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
pub mod failures;
pub mod leader;
pub mod leases;
pub mod local;
pub mod metrics;
pub mod pipeline;
pub mod policy_path;
pub mod reads;
pub mod registration;
pub mod review;
pub mod server;
pub mod shared_reads;
pub mod tls;
pub mod writer;
pub mod writer_routing;
