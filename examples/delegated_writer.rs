//! The worker a holder starts: a Job's Pod that writes its result into a guarded ConfigMap with
//! the grant its holder delegated to it.
//!
//! ```sh
//! # In a Pod started with `kube-fence delegate` / `Grant::delegate`: KUBE_FENCE_GRANT is set.
//! cargo run --example delegated_writer -- CONFIGMAP [--pause-before-write]
//! ```
//!
//! It takes the grant from the environment (`Delegated::from_env`: no lease to acquire, no RBAC
//! on Leases, nothing to renew or release), reads the ConfigMap, prepares its result and writes
//! it with the delegated token — the reread-and-retry shape a fenced worker has:
//!
//! - the object changed since it was read, but no newer grant wrote it (`Error::Conflict`):
//!   read it again and redo the work on the new state;
//! - a newer grant of the lease wrote it (`Error::StaleToken`): the work is superseded. Retrying
//!   with this token can never succeed; read the state the newer holder left, report, stop.
//!
//! `--pause-before-write` stops the process (SIGSTOP, raised by itself) between preparing its
//! first write and sending it — the pause fencing exists for — until someone sends SIGCONT.
//! `--unfenced` writes without the token (what a worker does that was handed no grant), to an
//! object that is not guarded: the control that shows what fencing prevents.
//!
//! One JSON line per step on stdout (`prepared`, `written`, `refused`, `gave-up`), for
//! people and for the tests (`tests/delegation.rs`, `tests/e2e/delegated.rs`).

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, PostParams};
use kube_fence::client::{Delegated, Error};
use serde_json::json;

/// How often a write that lost a race with an equal-or-older writer is redone.
const ATTEMPTS: usize = 8;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let pause = args.iter().any(|a| a == "--pause-before-write");
    let unfenced = args.iter().any(|a| a == "--unfenced");
    let Some(name) = args.iter().find(|a| !a.starts_with("--")) else {
        eprintln!("usage: delegated_writer CONFIGMAP [--pause-before-write] [--unfenced]");
        std::process::exit(2);
    };
    let grant = match Delegated::from_env() {
        Ok(grant) => grant,
        Err(err) => {
            // The error names what failed, its source why (a bad token): print the chain.
            let why: Vec<String> =
                std::iter::successors(Some(&err as &dyn std::error::Error), |e| e.source()).map(|e| e.to_string()).collect();
            eprintln!("delegated_writer: {}; start it with a delegated grant (kube-fence delegate)", why.join(": "));
            std::process::exit(2);
        }
    };
    let me = kube_fence::client::pod_name().unwrap_or_else(|| format!("pid-{}", std::process::id()));
    let client = kube::Client::try_default().await?;
    let configmaps: Api<ConfigMap> = Api::namespaced(client, &grant.namespace);

    for attempt in 1..=ATTEMPTS {
        // Read the state, and prepare the result from it.
        let read = configmaps.get_opt(name).await?;
        let mut result = read
            .clone()
            .unwrap_or_else(|| ConfigMap { metadata: ObjectMeta { name: Some(name.clone()), ..Default::default() }, ..Default::default() });
        let data = result.data.get_or_insert_with(Default::default);
        data.insert("writer".into(), me.clone());
        data.insert("token".into(), grant.token.to_string());
        println!("{}", json!({"event": "prepared", "attempt": attempt, "token": grant.token.get(), "pid": std::process::id()}));
        if pause && attempt == 1 {
            // Deterministic pause: this process stops itself here, after preparing and before
            // sending, and goes on when it receives SIGCONT.
            rustix::process::kill_process(rustix::process::getpid(), rustix::process::Signal::STOP)?;
        }
        let written = match (read, unfenced) {
            (None, false) => grant.create(&configmaps, &result).await,
            (Some(_), false) => grant.replace(&configmaps, &result).await,
            (None, true) => configmaps.create(&PostParams::default(), &result).await.map_err(unfenced_error),
            (Some(_), true) => configmaps.replace(name, &PostParams::default(), &result).await.map_err(unfenced_error),
        };
        match written {
            Ok(stored) => {
                let rv = stored.metadata.resource_version.unwrap_or_default();
                println!("{}", json!({"event": "written", "token": grant.token.get(), "resourceVersion": rv}));
                return Ok(());
            }
            // Changed since it was read, by a write no newer than ours: reread and redo.
            Err(Error::Conflict(why)) => {
                eprintln!("delegated_writer: {name} changed since it was read ({why}); reading it again");
                continue;
            }
            // A newer grant wrote it: our result is superseded. Reread what the newer holder left.
            Err(Error::StaleToken { presented, recorded }) => {
                let now = configmaps.get_opt(name).await?.and_then(|cm| cm.data).unwrap_or_default();
                println!(
                    "{}",
                    json!({"event": "refused", "reason": "StaleToken", "presented": presented.get(), "recorded": recorded.get(),
                           "current_writer": now.get("writer")})
                );
                return Ok(());
            }
            Err(err) => {
                println!("{}", json!({"event": "refused", "reason": err.reason(), "error": err.to_string()}));
                return Ok(());
            }
        }
    }
    println!("{}", json!({"event": "gave-up", "attempts": ATTEMPTS}));
    Ok(())
}

/// An unfenced write's failure in the library's terms: the API server's own 409 is a conflict.
fn unfenced_error(err: kube::Error) -> Error {
    match err {
        kube::Error::Api(status) if status.code == 409 => Error::Conflict(status.message.clone()),
        other => Error::Kube(other),
    }
}
