//! kube-fence: fencing tokens for Kubernetes.
//!
//! A lease says who may *try*; a fencing token says whose effect may *stick*. kube-fence's
//! controller gives every grant of a `Lease` (`kubefence.io/v1alpha1`) a strictly increasing
//! token, and its validating webhook rejects every write to a guarded object (one labelled
//! `kubefence.io/lease`) whose token is not newer than the one the object already records. This
//! crate is the library workers use ([`client`]) and the whole of kube-fence itself (the
//! `kube-fence` binary is a thin [`cli`] over it).
//!
//! # A worker
//!
//! Acquire a lease, keep it alive, write a guarded object with the grant's token, release. If a
//! newer holder wrote the object in between, the write fails with [`client::Error::StaleToken`]:
//! this worker's effect can no longer stick, whatever its clock said or however long it was
//! paused. It needs a cluster running kube-fence (see the README: `helm install`, or
//! `hack/run.sh` locally).
//!
//! ```no_run
//! use std::time::Duration;
//!
//! use k8s_openapi::api::core::v1::ConfigMap;
//! use kube::api::{Api, ObjectMeta};
//! use kube_fence::client::{AcquireOptions, Error, Leases};
//!
//! #[tokio::main]
//! async fn main() -> Result<(), Error> {
//!     let client = kube::Client::try_default().await?;
//!     let leases = Leases::new(client.clone(), "jobs");
//!     // Waits up to 30 s while another worker holds `nightly-report`; creates the Lease if missing.
//!     let options = AcquireOptions::default().duration(Duration::from_secs(15)).timeout(Duration::from_secs(30));
//!     let grant = leases.acquire("nightly-report", "worker-7", options).await?;
//!     let mut keep_alive = leases.keep_alive(&grant); // heartbeats, and says when the lease is lost
//!
//!     // The guarded object. The grant stamps it with the lease label and its token annotation.
//!     let reports: Api<ConfigMap> = Api::namespaced(client, "jobs");
//!     let data = Some([("total".to_string(), "42".to_string())].into());
//!     let write = async {
//!         match reports.get_opt("nightly-report").await? {
//!             None => {
//!                 let name = Some("nightly-report".to_string());
//!                 grant.create(&reports, &ConfigMap { metadata: ObjectMeta { name, ..Default::default() }, data, ..Default::default() }).await
//!             }
//!             Some(report) => grant.replace(&reports, &ConfigMap { data, ..report }).await,
//!         }
//!     };
//!     tokio::select! {
//!         written = write => match written {
//!             Ok(_) => println!("written with token {}", grant.token),
//!             // Normal recovery, not a failure: a newer holder wrote first. Stop; reread later.
//!             Err(Error::StaleToken { presented, recorded }) => {
//!                 eprintln!("fenced off: the report records token {recorded}, ours is {presented}");
//!             }
//!             Err(other) => return Err(other),
//!         },
//!         loss = keep_alive.lost() => eprintln!("lost the lease ({loss}); stopping"),
//!     }
//!     keep_alive.stop().await;
//!     leases.release(&grant).await
//! }
//! ```
//!
//! # Modules
//!
//! - [`client`]: the library workers use: acquire, keep alive, release, fenced writes.
//! - [`token`]: what a token is, how it is written and parsed.
//! - [`api`]: the `Lease` custom resource (`kubefence.io/v1alpha1`).
//! - [`lease`]: where a token is issued — the lease state machine and its controller.
//! - [`admission`]: where a write is judged — the decision table and the webhook server.
//! - [`cli`]: the `kube-fence` command line.
//! - [`telemetry`]: logs and metrics shared by every long-running subcommand.
//! - `history` (cargo feature `history`, off by default): checks a recorded history of grants and
//!   accepted writes for fencing violations; the oracle of kube-fence's own fault-injection tests.
//! - [`process`]: a running process's identity and shutdown signal.
//! - [`ready`]: the ready file, where a process that bound its ports says which they are.
#![forbid(unsafe_code)]

pub mod admission;
pub mod api;
pub mod cli;
pub mod client;
#[cfg(feature = "history")]
pub mod history;
pub mod lease;
pub mod process;
pub mod ready;
pub mod telemetry;
pub mod token;
