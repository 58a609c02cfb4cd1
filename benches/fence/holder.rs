//! What a holder-only object's `/status` write costs (`kubefence.io/writer: holder`): the
//! webhook call plus one quorum read of the lease, against the same status write to an object
//! without the label (which the webhook's match condition never sends). One writer, the two
//! interleaved so drift hits both alike. Reported, never asserted.

use std::time::{Duration, Instant};

use k8s_openapi::api::apps::v1::Deployment;
use kube::Client;
use kube::api::{Api, Patch, PatchParams, PostParams};
use kube_fence::admission::registration::{self, Endpoint, Registration};
use kube_fence_api::Lease;
use kube_fence_api::names::{HOLDER_ONLY, LEASE_LABEL, TOKEN_ANNOTATION, WRITER_LABEL};
use serde_json::json;

use crate::report::{Met, Samples, Table, ms};
use crate::{Args, common};

const LEASE: &str = "holder-bench";

fn deployment(name: &str, holder_only: bool) -> anyhow::Result<Deployment> {
    let mut metadata = json!({"name": name});
    if holder_only {
        metadata["labels"] = json!({LEASE_LABEL: LEASE, WRITER_LABEL: HOLDER_ONLY});
        metadata["annotations"] = json!({TOKEN_ANNOTATION: "1"});
    }
    Ok(serde_json::from_value(json!({
        "metadata": metadata,
        "spec": {"replicas": 0, "selector": {"matchLabels": {"app": name}},
                 "template": {"metadata": {"labels": {"app": name}}, "spec": {"containers": [{"name": "c", "image": "registry.invalid/none"}]}}}
    }))?)
}

/// Section 6: a holder-only status write vs an unlabelled one.
pub async fn status_writes(
    args: &Args,
    table: &mut Table,
    client: &Client,
    ns: &str,
    webhook_url: &str,
    ca_pem: &str,
) -> anyhow::Result<()> {
    let mut reg = Registration::new(format!("kf-bench-holder-{ns}"), Endpoint::Url(webhook_url.to_string()));
    reg.ca_bundle = Some(ca_pem.to_string());
    reg.only_namespaces = Some(vec![ns.to_string()]);
    reg.apply(client).await?;
    let result = measure(args, table, client, ns).await;
    reg.remove(client).await?;
    result
}

async fn measure(args: &Args, table: &mut Table, client: &Client, ns: &str) -> anyhow::Result<()> {
    common::wait_fenced(client, ns, &Default::default(), common::Fencing::Judged, Duration::from_secs(30)).await;
    // A User-bound lease held by whoever runs the bench, with token 1.
    let me = registration::whoami(client).await?;
    let leases: Api<Lease> = Api::namespaced(client.clone(), ns);
    let lease = serde_json::from_value(json!({"apiVersion": "kubefence.io/v1alpha1", "kind": "Lease",
        "metadata": {"name": LEASE}, "spec": {"identity": "User"}}))?;
    leases.create(&PostParams::default(), &lease).await?;
    let status = json!({"status": {"phase": "Held", "holder": me, "token": 1}});
    leases.patch_status(LEASE, &PatchParams::default(), &Patch::Merge(&status)).await?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), ns);
    deployments.create(&PostParams::default(), &deployment("holder-only", true)?).await?;
    deployments.create(&PostParams::default(), &deployment("unlabelled", false)?).await?;

    let n = args.updates() / 2;
    eprintln!("[6] /status writes: holder-only (webhook + quorum read) vs unlabelled, {n} each, 1 writer");
    let write = |name: &'static str, seq: usize| {
        let deployments = deployments.clone();
        async move {
            let body = json!({"status": {"observedGeneration": seq}});
            let started = Instant::now();
            deployments.patch_status(name, &PatchParams::default(), &Patch::Merge(&body)).await?;
            anyhow::Ok(started.elapsed())
        }
    };
    for seq in 0..20 {
        write("holder-only", seq).await?;
        write("unlabelled", seq).await?;
    }
    let (mut fenced, mut plain) = (Samples::default(), Samples::default());
    for seq in 20..20 + n {
        fenced.push(write("holder-only", seq).await?);
        plain.push(write("unlabelled", seq).await?);
    }
    table.add(
        "6",
        "holder-only /status write, 1 writer: p50 / p99 (added)",
        format!("{} / {}", ms(fenced.p50()), ms(fenced.p99())),
        format!("{} / {}", ms(plain.p50()), ms(plain.p99())),
        format!("+{} / +{}", ms(fenced.p50().saturating_sub(plain.p50())), ms(fenced.p99().saturating_sub(plain.p99()))),
        "",
        Met::Info,
    );
    Ok(())
}
