//! Simulated grants: a Lease's status written as the admin, so a test can say "the lease is held
//! by `holder` with `token`" without running the lease controller.

use std::time::Duration;

use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube_fence_api::token::Token;
use kube_fence_api::{Lease, LeaseSpec};
use kube_fence_client::Grant;
use serde_json::json;

/// How long a simulated grant says it is valid ([`Grant::duration`]); nothing expires it.
pub const SIMULATED_DURATION: Duration = Duration::from_secs(60);

/// Simulates a grant: lease `lease` in `ns` (created with the default spec when missing) is held
/// by `holder` with `token`, its status written as the admin. Returns the grant a worker would
/// hold, to write with.
pub async fn grant(client: &Client, ns: &str, lease: &str, holder: &str, token: u64) -> Grant {
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    if leases.get_opt(lease).await.expect("get lease").is_none() {
        leases.create(&PostParams::default(), &Lease::new(lease, LeaseSpec::default())).await.expect("create lease");
    }
    let status = json!({"status": {"phase": "Held", "holder": holder, "token": token}});
    leases.patch_status(lease, &PatchParams::default(), &Patch::Merge(&status)).await.expect("write lease status");
    Grant {
        namespace: ns.into(),
        lease: lease.into(),
        holder: holder.into(),
        token: Token::new(token).expect("a token"),
        duration: SIMULATED_DURATION,
        valid_until: tokio::time::Instant::now() + SIMULATED_DURATION,
        uid: None,
    }
}
