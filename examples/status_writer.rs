//! A controller-like worker that writes the `/status` of a holder-only object under an
//! identity-bound lease, as it would run in a Pod.
//!
//! ```sh
//! export KUBECONFIG=...      # in a Pod: nothing to set; the Pod's own ServiceAccount token is used
//! cargo run --example status_writer -- NAMESPACE LEASE DEPLOYMENT [THINK_MS] [--stop-before-write N[,N...]]
//! ```
//!
//! It acquires `LEASE` (a kube-fence Lease with `spec.identity: Pod`) as its own Pod
//! (`kube_fence::client::pod_name()`: `POD_NAME`, else in a Pod its host name — what the identity
//! policy checks), keeps it alive, and writes the status of
//! the Deployment `DEPLOYMENT` (labelled `kubefence.io/lease: LEASE` and
//! `kubefence.io/writer: holder`) again and again: it prepares a write, thinks for `THINK_MS`
//! (default 300), then sends it. A status write carries no token; the webhook admits it only
//! while this Pod holds the lease. Paused past its lease (SIGSTOP) and resumed, the write it had
//! prepared is refused with `NotHolder`, and the worker stops. With `--stop-before-write N` it
//! pauses itself exactly there: having prepared write `N` (or each of a comma-separated list)
//! it stops its own process (SIGSTOP) before sending it, until someone sends it SIGCONT — the
//! pause test's deterministic pause.
//!
//! One JSON line per step on stdout (`granted`, `prepared`, `written`, `refused`), for people and
//! for the pause test (`tests/e2e.rs`).

use std::time::Duration;

use k8s_openapi::api::apps::v1::Deployment;
use kube::api::{Api, Patch, PatchParams};
use kube_fence::client::{AcquireOptions, Error, Leases};
use serde_json::json;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let usage = "usage: status_writer NAMESPACE LEASE DEPLOYMENT [THINK_MS] [--stop-before-write N[,N...]]";
    let [namespace, lease, name, rest @ ..] = args.as_slice() else {
        eprintln!("{usage}");
        std::process::exit(2);
    };
    let (mut think, mut stop_before) = (Duration::from_millis(300), Vec::<u64>::new());
    let mut rest = rest.iter();
    while let Some(arg) = rest.next() {
        match (arg.as_str(), rest.clone().next()) {
            ("--stop-before-write", Some(list)) if list.split(',').all(|n| n.parse::<u64>().is_ok()) => {
                stop_before = list.split(',').filter_map(|n| n.parse().ok()).collect();
                rest.next();
            }
            (ms, _) if ms.parse::<u64>().is_ok() => think = Duration::from_millis(ms.parse()?),
            (other, _) => {
                eprintln!("status_writer: unexpected argument {other:?}; {usage}");
                std::process::exit(2);
            }
        }
    }
    let Some(me) = kube_fence::client::pod_name() else {
        eprintln!("status_writer runs as a Pod: set POD_NAME (the downward API does) or run it in a Pod");
        std::process::exit(2);
    };
    let client = kube::Client::try_default().await?;
    let leases = Leases::new(client.clone(), namespace);
    let options = AcquireOptions::default().duration(Duration::from_secs(1)).timeout(Duration::from_secs(120));
    let grant = leases.acquire(lease, &me, options).await?;
    println!("{}", json!({"event": "granted", "holder": me, "token": grant.token.get()}));
    let _keep_alive = leases.keep_alive(&grant);
    let deployments: Api<Deployment> = Api::namespaced(client, namespace);
    for seq in 1u64.. {
        println!("{}", json!({"event": "prepared", "seq": seq}));
        // The worker is busy here; a pause (SIGSTOP, a long GC) between preparing a write and
        // sending it is what fencing is for.
        if stop_before.contains(&seq) {
            // stdout is line-buffered: the line above is out. SIGSTOP stops every thread.
            // SAFETY: raise(3) with a signal number; no memory is involved.
            unsafe { libc::raise(libc::SIGSTOP) };
        } else {
            tokio::time::sleep(think).await;
        }
        let status = json!({"status": {"conditions": [{
            "type": "Progressing", "status": "True", "reason": "StatusWriter", "message": format!("{me} {seq}"),
        }]}});
        match grant.patch_status(&deployments, name, &PatchParams::default(), Patch::Merge(status)).await {
            Ok(written) => {
                let rv = written.metadata.resource_version.unwrap_or_default();
                println!("{}", json!({"event": "written", "seq": seq, "resourceVersion": rv}));
            }
            Err(Error::NotHolder { holder, requester, .. }) => {
                println!("{}", json!({"event": "refused", "seq": seq, "reason": "NotHolder", "holder": holder, "requester": requester}));
                return Ok(());
            }
            Err(err) => {
                println!("{}", json!({"event": "refused", "seq": seq, "reason": err.reason(), "error": err.to_string()}));
                return Ok(());
            }
        }
    }
    Ok(())
}
