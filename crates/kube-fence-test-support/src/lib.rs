//! What kube-fence's tests and benchmark share, for any test that runs against a real API server
//! with kube-fence in it: one cluster per test binary (the caller brings its kubeconfig: a
//! control plane of its own, `KUBECONFIG`, ...) and a namespace per test, so tests never see each
//! other's objects.
//!
//! - [`cluster`]: a client with kube-fence's CRDs installed, a fresh namespace, waiting for an
//!   object to be gone.
//! - [`writes`]: how the API server answered one write ([`accepted`], [`rejected`], denied by
//!   kube-fence for a [`Reason`](kube_fence_api::denial::Reason)), and a guarded ConfigMap.
//! - [`fencing`]: waiting until the API server sends a namespace's guarded writes to kube-fence
//!   ([`wait_fenced`]), or judges them with the policy path ([`wait_policy_path`]).
//! - [`grants`]: a simulated grant (a Lease status written as the admin) and its [`Grant`].
//! - [`identity`]: clients that act as a worker or as a Pod, and the RBAC a worker has.
//! - [`partition`]: a client cut from its API server and healed again (a relay on loopback).
//! - [`process`]: stopping and resuming a worker process (the pause tests).
//! - [`history`]: the history checker, the oracle of the fault-injection tests.
//! - The fake lease reader for pure tests of the webhook is `kube_fence::admission::judge::fake`:
//!   its trait belongs to the operator crate, which this crate (contract and client only) does not
//!   depend on.
//!
//! Everything here reads the API server's typed answers (code and reason), never message text,
//! and panics with what it saw when something is not as the test needs: it is test code.
//!
//! [`Grant`]: kube_fence_client::Grant
#![forbid(unsafe_code)]

pub mod cluster;
pub mod fencing;
pub mod grants;
pub mod history;
pub mod identity;
pub mod partition;
pub mod process;
pub mod writes;

pub use cluster::{client, client_for, install_crds, namespace, wait_gone};
pub use fencing::{Fencing, policy_path, wait_fenced, wait_policy_path};
pub use grants::grant;
pub use process::{is_stopped, signal_and_wait};
pub use writes::{accepted, denied_by_kube_fence, failed_closed, guarded_configmap, rejected};
