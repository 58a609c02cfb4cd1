//! Section 3p (issue 16): guarded ConfigMap updates through the API server on the webhook path
//! and on the policy path, beside unguarded ones — throughput, p50/p99, and the API server's own
//! CPU time per write (utime + stime of the kube-apiserver process, from /proc), for 1 and for
//! `--writers` writers.
//!
//! Two namespaces are fenced at once, so the three kinds of write can alternate round by round:
//! `ns_hook` by a registration without the policy path (every guarded write calls the webhook
//! process), `ns_policy` by one with it (fresh-token updates judged by the API server's policy;
//! its parameters kept in-process by `lease::params`, the lease controller's job). The webhook
//! process's CPU per write is reported too: on 2 shared cores it competes with the API server.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ObjectMeta, Patch, PatchParams, PostParams};
use kube_fence::admission::registration::{Endpoint, Registration};
use kube_fence_api::names::TOKEN_ANNOTATION;
use kube_fence_api::{Lease, LeaseSpec};
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::cluster::{Bench, cpu, merge, meta, set_issued, updates};
use crate::decision::{ISSUED, LEASE};
use crate::report::{Met, Samples, Table, met, ms, rate};
use crate::{Args, common, load};

/// The pid of the kube-apiserver serving `kubeconfig` (found by its `--secure-port`), if it runs
/// on this machine.
pub fn apiserver_pid(kubeconfig: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(kubeconfig).ok()?;
    let server = text.lines().find_map(|l| l.trim().strip_prefix("server:"))?.trim().trim_matches('"').to_string();
    let port = server.rsplit(':').next()?.trim_end_matches('/').to_string();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else { continue };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let args: Vec<String> = cmdline.split(|b| *b == 0).map(|a| String::from_utf8_lossy(a).into_owned()).collect();
        let is_apiserver = args.first().is_some_and(|a| a.ends_with("kube-apiserver"));
        let on_port = args.windows(2).any(|w| w[0] == "--secure-port" && w[1] == port)
            || args.iter().any(|a| a.strip_prefix("--secure-port=") == Some(port.as_str()));
        if is_apiserver && on_port {
            return Some(pid);
        }
    }
    None
}

/// One kind of write, measured over rounds: writes, latency, and CPU of the API server and the
/// webhook process.
#[derive(Default)]
struct Kind {
    loads: Vec<load::Load>,
    apiserver_cpu: Duration,
    webhook_cpu: Duration,
}

impl Kind {
    fn merged(&mut self) -> load::Load {
        merge(std::mem::take(&mut self.loads))
    }
}

pub async fn run(args: &Args, table: &mut Table, bench: &mut Bench) -> anyhow::Result<()> {
    let client = bench.client.clone();
    let Some(apiserver) = apiserver_pid(&bench.kubeconfig) else {
        anyhow::bail!("section 3p needs the kube-apiserver's process on this machine (found none serving {})", bench.kubeconfig.display());
    };
    let ns_policy = common::namespace(&client, "bench-policy").await;
    let mut webhook_path = Registration::new(format!("kf-bench-{}", bench.ns_hook), Endpoint::Url(bench.webhook_url.clone()));
    webhook_path.ca_bundle = Some(bench.ca_pem.clone());
    webhook_path.only_namespaces = Some(vec![bench.ns_hook.clone()]);
    let mut policy_path = Registration::new(format!("kf-bench-{ns_policy}"), Endpoint::Url(bench.webhook_url.clone()));
    policy_path.ca_bundle = Some(bench.ca_pem.clone());
    policy_path.only_namespaces = Some(vec![ns_policy.clone()]);
    policy_path.policy_path = true;
    let stop = CancellationToken::new();
    let result = async {
        webhook_path.apply(&client).await?;
        let me = kube_fence::admission::registration::whoami(&client).await?;
        policy_path.apply_policy_path(&client, std::slice::from_ref(&me)).await?;
        policy_path.apply(&client).await?;
        tokio::spawn(kube_fence::lease::params::maintain(client.clone(), Some(ns_policy.clone()), stop.clone()));
        measure(args, table, bench, &ns_policy, apiserver).await
    }
    .await;
    stop.cancel();
    webhook_path.remove(&client).await?;
    policy_path.remove(&client).await?;
    let _ = Api::<k8s_openapi::api::core::v1::Namespace>::all(client.clone()).delete(&ns_policy, &kube::api::DeleteParams::default()).await;
    let crds = Api::<k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition>::all(client.clone());
    let _ = crds.delete(BENCH_CRD, &kube::api::DeleteParams::default()).await;
    result
}

async fn measure(args: &Args, table: &mut Table, bench: &mut Bench, ns_policy: &str, apiserver: u32) -> anyhow::Result<()> {
    let hook_cms: Api<ConfigMap> = Api::namespaced(bench.client.clone(), &bench.ns_hook);
    let policy_cms: Api<ConfigMap> = Api::namespaced(bench.client.clone(), ns_policy);
    let policy_leases: Api<Lease> = Api::namespaced(bench.client.clone(), ns_policy);
    let hook_leases: Api<Lease> = Api::namespaced(bench.client.clone(), &bench.ns_hook);
    policy_leases.create(&PostParams::default(), &Lease::new(LEASE, LeaseSpec::default())).await?;
    // Past every token section 3 used on the same lease: the objects are created with the newest.
    let first = ISSUED * 3;
    set_issued(&policy_leases, first).await?;
    set_issued(&hook_leases, first).await?;
    for ns in [&bench.ns_hook, &ns_policy.to_string()] {
        common::wait_fenced(&bench.client, ns, &Default::default(), common::Fencing::Judged, Duration::from_secs(30)).await;
    }
    let max_writers = args.writers.max(1);
    let data = Some([("seq".to_string(), "0".to_string())].into());
    create_objects([&hook_cms, &policy_cms], max_writers, first, |metadata| ConfigMap {
        metadata,
        data: data.clone(),
        ..Default::default()
    })
    .await?;
    // The same objects as a custom resource: the API server holds those as unstructured objects,
    // so its CEL needs no conversion of them by reflection (a built-in kind's does).
    let resource = bench_crd(&bench.client).await?;
    let hook_crs: Api<DynamicObject> = Api::namespaced_with(bench.client.clone(), &bench.ns_hook, &resource);
    let policy_crs: Api<DynamicObject> = Api::namespaced_with(bench.client.clone(), ns_policy, &resource);
    create_objects([&hook_crs, &policy_crs], max_writers, first, |metadata| {
        let mut object = DynamicObject::new("", &resource).data(json!({"data": {"seq": "0"}}));
        object.metadata = metadata;
        object
    })
    .await?;
    // Room for every update's token (t > recorded, t <= issued) on both leases.
    set_issued(&hook_leases, first * 2).await?;
    set_issued(&policy_leases, first * 2).await?;
    common::wait_policy_path(&bench.client, ns_policy, Duration::from_secs(30)).await;
    let tokens = Arc::new(AtomicU64::new(first + 1));

    // What the API server spends with no bench load (watches, controllers, leader election): the
    // background every per-write figure below includes.
    let idle_before = cpu(apiserver);
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle = (cpu(apiserver) - idle_before) / 3;
    table.add(
        "3p",
        "API server CPU with no bench load (background in every figure below)",
        format!("{} per s", ms(idle)),
        "",
        "",
        "",
        Met::Info,
    );

    compare(args, table, bench, apiserver, idle, "ConfigMaps", &hook_cms, &policy_cms, &tokens).await?;
    compare(args, table, bench, apiserver, idle, "custom resources", &hook_crs, &policy_crs, &tokens).await?;
    fresh_grant(args, table, &policy_cms, &policy_leases, first * 2 + 1).await
}

/// Writes the kube-apiserver's CPU profile over 10 s of one kind of write into `file`;
/// returns how many writes were made meanwhile.
async fn profile_under_load<K>(
    client: &kube::Client,
    file: &Path,
    cms: &Api<K>,
    writers: usize,
    guarded: bool,
    tokens: &Arc<AtomicU64>,
) -> anyhow::Result<usize>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
{
    crate::cluster::profile_while(client, file, async || Ok(updates(cms, writers, writers * 20, guarded, tokens, "pp-").await?.ok)).await
}

/// The fresh-token case: a grant (the Lease status written), then at once a write with its token.
/// Until the parameter reaches the API server's cache the policy denies it and the write is
/// retried (`client::retry_unseen_token`); reported: grant-to-admitted time and how many writes
/// met a denial first.
async fn fresh_grant(args: &Args, table: &mut Table, cms: &Api<ConfigMap>, leases: &Api<Lease>, base: u64) -> anyhow::Result<()> {
    let samples = if args.quick { 20 } else { 60 };
    let (mut lag, mut retried) = (Samples::default(), 0);
    for i in 0..samples {
        let token = base + i as u64;
        set_issued(leases, token).await?;
        let granted = Instant::now();
        let denials = std::sync::atomic::AtomicUsize::new(0);
        let patch = json!({"metadata": {"annotations": {TOKEN_ANNOTATION: token.to_string()}}});
        let params = PatchParams::default();
        kube_fence::client::retry_unseen_token(|| async {
            let answer = cms.patch("pp-guarded-0", &params, &Patch::Merge(&patch)).await;
            if answer.is_err() {
                denials.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            answer
        })
        .await?;
        lag.push(granted.elapsed());
        if denials.load(std::sync::atomic::Ordering::Relaxed) > 0 {
            retried += 1;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    table.add(
        "3p",
        format!("policy path: grant → first write with its token admitted, p50 / p99 ({retried} of {samples} denied first, then retried)"),
        format!("{} / {}", ms(lag.p50()), ms(lag.p99())),
        "",
        "",
        "",
        Met::Info,
    );
    Ok(())
}

/// One kind of object, guarded on the webhook path (`hook_objects`), guarded on the policy path
/// and unguarded (`policy_objects`), round by round, for 1 and `--writers` writers.
#[allow(clippy::too_many_arguments)]
async fn compare<K>(
    args: &Args,
    table: &mut Table,
    bench: &Bench,
    apiserver: u32,
    idle: Duration,
    what: &str,
    hook_cms: &Api<K>,
    policy_cms: &Api<K>,
    tokens: &Arc<AtomicU64>,
) -> anyhow::Result<()>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
{
    let max_writers = args.writers.max(1);
    for writers in [1, max_writers] {
        let total = args.updates();
        eprintln!(
            "[3p] {what}: webhook path vs policy path vs unguarded: {total} updates each, {writers} writer(s), API server pid {apiserver}"
        );
        // Warm up all three.
        for (cms, guarded) in [(hook_cms, true), (policy_cms, true), (policy_cms, false)] {
            updates(cms, writers, writers * 5, guarded, tokens, "pp-").await?;
        }
        let (mut hook, mut policy, mut plain) = (Kind::default(), Kind::default(), Kind::default());
        let rounds = 3;
        for _ in 0..rounds {
            for (kind, cms, guarded) in [(&mut hook, hook_cms, true), (&mut policy, policy_cms, true), (&mut plain, policy_cms, false)] {
                let (api_before, hook_before) = (cpu(apiserver), cpu(bench.webhook.pid()));
                kind.loads.push(updates(cms, writers, total / rounds, guarded, tokens, "pp-").await?);
                kind.apiserver_cpu += cpu(apiserver) - api_before;
                kind.webhook_cpu += cpu(bench.webhook.pid()) - hook_before;
            }
        }
        let (h, p, u) = (hook.merged(), policy.merged(), plain.merged());
        let per = |cpu: Duration, load: &load::Load| cpu / load.ok.max(1) as u32;
        // Net of the idle background over the same time (an estimate: the background under load
        // need not be the idle one).
        let net = |cpu: Duration, load: &load::Load| per(cpu.saturating_sub(idle.mul_f64(load.elapsed.as_secs_f64())), load);
        let u_cpu = per(plain.apiserver_cpu, &u);
        let u_net = net(plain.apiserver_cpu, &u);
        for (label, kind, load, target) in [("webhook path", &hook, &h, None), ("policy path", &policy, &p, Some(0.9))] {
            let ratio = load.per_sec() / u.per_sec();
            table.add(
                "3p",
                format!("{what}, {label}, {writers} writer(s): throughput (vs unguarded)"),
                rate(load.per_sec(), "upd"),
                rate(u.per_sec(), "upd"),
                format!("{ratio:.2}×"),
                target.map(|t| format!("≥ {t:.2}×")).unwrap_or_default(),
                target.map(|t| met(ratio >= t)).unwrap_or(Met::Info),
            );
            table.add(
                "3p",
                format!("… {what}, {label}, {writers} writer(s): p50 / p99 (added)"),
                format!("{} / {}", ms(load.latency.p50()), ms(load.latency.p99())),
                format!("{} / {}", ms(u.latency.p50()), ms(u.latency.p99())),
                format!(
                    "+{} / +{}",
                    ms(load.latency.p50().saturating_sub(u.latency.p50())),
                    ms(load.latency.p99().saturating_sub(u.latency.p99()))
                ),
                "",
                Met::Info,
            );
            let (api_cpu, api_net) = (per(kind.apiserver_cpu, load), net(kind.apiserver_cpu, load));
            table.add(
                "3p",
                format!("… {what}, {label}, {writers} writer(s): API server CPU per write, net of idle (webhook process CPU per write)"),
                format!("{}, net {} ({})", ms(api_cpu), ms(api_net), ms(per(kind.webhook_cpu, load))),
                format!("{}, net {}", ms(u_cpu), ms(u_net)),
                format!(
                    "{:.2}×, net {:.2}×",
                    api_cpu.as_secs_f64() / u_cpu.as_secs_f64().max(1e-9),
                    api_net.as_secs_f64() / u_net.as_secs_f64().max(1e-9)
                ),
                "",
                Met::Info,
            );
        }
    }
    if let Some(dir) = &args.profile_apiserver {
        std::fs::create_dir_all(dir)?;
        for (label, cms, guarded) in [("webhook-path", hook_cms, true), ("policy-path", policy_cms, true), ("unguarded", policy_cms, false)]
        {
            let file = dir.join(format!("apiserver-{}-{label}-{max_writers}w.pprof", what.to_lowercase().replace(' ', "-")));
            let writes = profile_under_load(&bench.client, &file, cms, max_writers, guarded, tokens).await?;
            eprintln!(
                "[3p] kube-apiserver CPU profile over {writes} {what} {label} writes (about 11 s; go tool pprof -top FILE): {}",
                file.display()
            );
        }
    }
    Ok(())
}

/// Creates `pp-guarded-{w}` (guarded by the bench lease with token `first`) and `pp-plain-{w}`
/// for every writer `w` through each of `apis`, unless they exist; `build` makes the object from
/// its metadata.
async fn create_objects<K>(apis: [&Api<K>; 2], writers: usize, first: u64, build: impl Fn(ObjectMeta) -> K) -> anyhow::Result<()>
where
    K: kube::Resource + Clone + serde::Serialize + serde::de::DeserializeOwned + std::fmt::Debug,
{
    for w in 0..writers {
        for api in apis {
            for (name, lease, token) in [(format!("pp-guarded-{w}"), Some(LEASE), Some(first)), (format!("pp-plain-{w}"), None, None)] {
                if api.get_opt(&name).await?.is_none() {
                    api.create(&PostParams::default(), &build(meta(&name, lease, token))).await?;
                }
            }
        }
    }
    Ok(())
}

/// The bench's custom resource (removed at the end of section 3p).
const BENCH_CRD: &str = "records.bench.kubefence.io";

/// A namespaced custom resource with a `data` map of strings, like a ConfigMap's.
async fn bench_crd(client: &kube::Client) -> anyhow::Result<ApiResource> {
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1::CustomResourceDefinition;
    let crd: CustomResourceDefinition = serde_json::from_value(json!({
        "metadata": {"name": BENCH_CRD},
        "spec": {"group": "bench.kubefence.io", "scope": "Namespaced",
                 "names": {"kind": "Record", "plural": "records", "singular": "record"},
                 "versions": [{"name": "v1", "served": true, "storage": true, "schema": {"openAPIV3Schema": {
                     "type": "object",
                     "properties": {"data": {"type": "object", "additionalProperties": {"type": "string"}}}}}}]}
    }))?;
    let crds: Api<CustomResourceDefinition> = Api::all(client.clone());
    crds.patch(BENCH_CRD, &PatchParams::apply("kube-fence-bench").force(), &Patch::Apply(&crd)).await?;
    let resource = ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk("bench.kubefence.io", "v1", "Record"), "records");
    let records: Api<DynamicObject> = Api::all_with(client.clone(), &resource);
    let deadline = Instant::now() + Duration::from_secs(30);
    while records.list(&Default::default()).await.is_err() {
        anyhow::ensure!(Instant::now() < deadline, "the bench's custom resource is not served 30 s after it was created");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(resource)
}
