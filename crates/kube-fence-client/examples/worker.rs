//! A worker that appends to a guarded ConfigMap under a lease, with fencing.
//!
//! ```sh
//! export KUBECONFIG=...                      # a cluster running kube-fence (controller + webhook)
//! cargo run --example worker -- default my-job worker-a
//! ```
//!
//! It acquires the lease `my-job` (waiting while another worker holds it), keeps it alive, and
//! every second writes its progress into the ConfigMap `my-job-progress` with the grant's token.
//! If a newer holder has written in between, the write fails with `StaleToken` and the worker
//! stops: its effects can no longer stick, whatever its clock or pauses.
//!
//! The worker writes the ConfigMap several times under one grant, so it creates the Lease (when
//! missing) with `fencing.comparison: AllowEqual`; under the default `Strict` comparison each
//! grant may write an object once.

use std::time::Duration;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, PostParams};
use kube_fence_client::api::{Comparison, FencingPolicy, Lease, LeaseSpec};
use kube_fence_client::{AcquireOptions, Error, Leases};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(namespace), Some(lease), Some(holder)) = (args.next(), args.next(), args.next()) else {
        eprintln!("usage: worker NAMESPACE LEASE HOLDER");
        std::process::exit(2);
    };
    let client = kube::Client::try_default().await?;
    let leases = Leases::new(client.clone(), &namespace);
    let policy = FencingPolicy { comparison: Some(Comparison::AllowEqual), enforcement: None };
    let lease_object = Lease::new(&lease, LeaseSpec { fencing: Some(policy), ..Default::default() });
    match Api::<Lease>::namespaced(client.clone(), &namespace).create(&PostParams::default(), &lease_object).await {
        Err(kube::Error::Api(status)) if status.is_already_exists() => {}
        other => drop(other?),
    }

    let options = AcquireOptions::default().duration(Duration::from_secs(10)).timeout(Duration::from_secs(60));
    let grant = leases.acquire(&lease, &holder, options).await?;
    eprintln!("{holder} holds {lease} with token {}", grant.token);
    let mut keep_alive = leases.keep_alive(&grant);

    let configmaps: Api<ConfigMap> = Api::namespaced(client, &namespace);
    let name = format!("{lease}-progress");
    for step in 1..=10 {
        let write = async {
            match configmaps.get_opt(&name).await? {
                None => {
                    let cm = ConfigMap { metadata: ObjectMeta { name: Some(name.clone()), ..Default::default() }, ..Default::default() };
                    grant.create(&configmaps, &cm).await
                }
                Some(mut cm) => {
                    cm.data.get_or_insert_with(Default::default).insert("step".into(), format!("{step} by {holder}"));
                    grant.replace(&configmaps, &cm).await
                }
            }
        };
        tokio::select! {
            written = write => match written {
                Ok(_) => eprintln!("step {step} written with token {}", grant.token),
                Err(Error::StaleToken { presented, recorded }) => {
                    eprintln!("fenced off: a newer holder wrote with token {recorded} (ours: {presented}); stopping");
                    return Ok(());
                }
                Err(err) => return Err(err.into()),
            },
            loss = keep_alive.lost() => {
                eprintln!("lost the lease ({loss}); stopping");
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    keep_alive.stop().await;
    leases.release(&grant).await?;
    eprintln!("released {lease}");
    Ok(())
}
