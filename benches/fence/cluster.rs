//! Items 2–5: everything that needs the control plane. kube-fence runs as separate processes —
//! `kube-fence webhook` (HTTPS on 127.0.0.1, registered by URL for the bench namespace only) and
//! `kube-fence controller` (scoped to the lease namespace) — so their memory and CPU can be read
//! from /proc.

use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use http_body_util::{BodyExt, Full};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace};
use kube::Client;
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube_fence::admission::http::tls::SelfSigned;
use kube_fence::admission::registration::{Endpoint, Registration};
use kube_fence::client::{AcquireOptions, Leases};
use kube_fence::ready::Ready;
use kube_fence_api::names::{LEASE_LABEL, TOKEN_ANNOTATION};
use kube_fence_api::{Lease, LeaseSpec};
use serde_json::json;

use crate::decision::{ISSUED, LEASE, SIZES};
use crate::report::{Met, Samples, Table, met, mib, ms, rate, us};
use crate::{Args, common, load};

/// A child process, killed when dropped.
pub(crate) struct Proc {
    name: &'static str,
    child: Child,
    log: PathBuf,
}

impl Proc {
    fn spawn(name: &'static str, program: &Path, args: &[String], kubeconfig: &Path, dir: &Path) -> anyhow::Result<Proc> {
        let log = dir.join(format!("{name}.log"));
        let out = std::fs::File::create(&log)?;
        let child = Command::new(program)
            .args(args)
            .env("KUBECONFIG", kubeconfig)
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .map_err(|e| anyhow::anyhow!("starting {name} ({}): {e}", program.display()))?;
        Ok(Proc { name, child, log })
    }

    pub(crate) fn pid(&self) -> u32 {
        self.child.id()
    }

    pub(crate) fn alive(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            anyhow::bail!(
                "{} exited ({status}):\n{}",
                self.name,
                log.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect::<Vec<_>>().join("\n")
            );
        }
        Ok(())
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Resident memory (VmRSS, VmHWM) of `pid`, bytes.
pub(crate) fn memory(pid: u32) -> (u64, u64) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field = |name: &str| {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .unwrap_or(0)
            * 1024
    };
    (field("VmRSS:"), field("VmHWM:"))
}

/// CPU time (user + system) `pid` has used so far.
pub(crate) fn cpu(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
    let fields: Vec<u64> = rest.split_whitespace().map(|f| f.parse().unwrap_or(0)).collect();
    let ticks = fields.get(11).copied().unwrap_or(0) + fields.get(12).copied().unwrap_or(0);
    // USER_HZ is 100 on every Linux this runs on.
    Duration::from_millis(ticks * 10)
}

impl Proc {
    /// Waits (at most 60 s) for the ready file at `path` the process writes once its ports are
    /// bound (`--ready-file`; they are asked for port 0, so none is picked first and bound later).
    pub(crate) async fn ready(&mut self, path: &Path) -> anyhow::Result<Ready> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            self.alive()?;
            if let Some(ready) = Ready::read(path)? {
                return Ok(ready);
            }
            anyhow::ensure!(Instant::now() < deadline, "{} wrote no ready file {} within 60 s", self.name, path.display());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// Polls `url` until it answers 200, at most 60 s.
async fn wait_ready(https: &load::Https, url: &str, proc: &mut Proc) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        proc.alive()?;
        if let Ok((200, _)) = load::request(https, http::Method::GET, url, Bytes::new()).await {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "{} did not become ready at {url} within 60 s", proc.name);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The shared setup: namespaces, TLS files, the webhook process.
pub(crate) struct Bench {
    pub(crate) client: Client,
    pub(crate) kubeconfig: PathBuf,
    pub(crate) dir: tempfile::TempDir,
    pub(crate) ca_pem: String,
    pub(crate) cert: PathBuf,
    pub(crate) key: PathBuf,
    /// Guarded objects and the no-controller lease live here; the webhook is registered for it.
    pub(crate) ns_hook: String,
    /// The controller runs here (acquire, takeover, scale).
    ns_lease: String,
    pub(crate) webhook: Proc,
    pub(crate) webhook_url: String,
    pub(crate) https: load::Https,
    /// The bench's own API server and etcd processes (their CPU), when found.
    apiserver: Option<u32>,
    etcd: Option<u32>,
}

pub async fn run(args: &Args, table: &mut Table) -> anyhow::Result<()> {
    let kubeconfig = common::kubeconfig().await;
    let client = common::client().await;
    let dir = tempfile::Builder::new().prefix("kube-fence-bench.").tempdir()?;
    let made = SelfSigned::generate(&["localhost".to_string()], &[IpAddr::V4(Ipv4Addr::LOCALHOST)])?;
    let (cert, key) = (dir.path().join("tls.crt"), dir.path().join("tls.key"));
    std::fs::write(&cert, &made.serving.cert)?;
    std::fs::write(&key, &made.serving.key)?;
    let ns_hook = common::namespace(&client, "bench-hook").await;
    let ns_lease = common::namespace(&client, "bench-lease").await;

    // The lease the guarded objects are bound to; no controller runs in ns_hook, so its status
    // (the issued token) is written here as admin, as tests/webhook.rs does.
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns_hook);
    leases.create(&PostParams::default(), &Lease::new(LEASE, LeaseSpec::default())).await?;
    set_issued(&leases, ISSUED).await?;

    let https = load::client(&made.ca_cert, args.concurrency)?;
    let (webhook, port) = spawn_webhook(&https, &kubeconfig, dir.path(), &cert, &key, &ns_hook).await?;
    let (apiserver, etcd) = control_plane(&kubeconfig);
    let mut bench = Bench {
        apiserver,
        etcd,
        client,
        kubeconfig,
        dir,
        ca_pem: made.ca_cert.clone(),
        cert,
        key,
        ns_hook,
        ns_lease,
        webhook,
        webhook_url: format!("https://127.0.0.1:{port}/validate"),
        https,
    };
    let result = sections(args, table, &mut bench).await;
    // Leave nothing behind (the namespaces go in the background).
    for ns in [&bench.ns_hook, &bench.ns_lease] {
        let _ = Api::<Namespace>::all(bench.client.clone()).delete(ns, &DeleteParams::default()).await;
    }
    if std::env::var_os("KF_BENCH_KEEP").is_some() {
        eprintln!("logs kept in {}", bench.dir.keep().display());
    }
    result
}

/// Starts `kube-fence webhook` on a loopback port the kernel picks and waits until it is ready.
pub(crate) async fn spawn_webhook(
    https: &load::Https,
    kubeconfig: &Path,
    dir: &Path,
    cert: &Path,
    key: &Path,
    own_namespace: &str,
) -> anyhow::Result<(Proc, u16)> {
    // Each webhook process of the run has a ready file of its own.
    static STARTED: AtomicU64 = AtomicU64::new(0);
    let ready_file = dir.join(format!("webhook-{}.ready", STARTED.fetch_add(1, Ordering::Relaxed)));
    let args: Vec<String> = [
        "webhook",
        "--addr",
        "127.0.0.1:0",
        "--ready-file",
        &ready_file.display().to_string(),
        "--namespace",
        own_namespace,
        "--tls-cert-file",
        &cert.display().to_string(),
        "--tls-key-file",
        &key.display().to_string(),
        // The writer webhooks (section 3, writer fence) take their client configuration from it.
        "--webhook-configuration",
        &format!("kf-bench-{own_namespace}"),
        // The quorum-read budget stays at its default (per source and lease namespace): genuine
        // traffic must not be throttled by it.
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    let mut webhook = Proc::spawn("kube-fence-webhook", Path::new(env!("CARGO_BIN_EXE_kube-fence")), &args, kubeconfig, dir)?;
    let addr = webhook.ready(&ready_file).await?.webhook.ok_or_else(|| anyhow::anyhow!("the webhook's ready file names no address"))?;
    let port = addr.port();
    wait_ready(https, &format!("https://{addr}/readyz"), &mut webhook).await?;
    eprintln!("webhook process {} serving on {addr} (logs in {})", webhook.pid(), dir.display());
    Ok((webhook, port))
}

pub(crate) async fn set_issued(leases: &Api<Lease>, token: u64) -> anyhow::Result<()> {
    let status = json!({"status": {"phase": "Held", "holder": "bench", "token": token}});
    leases.patch_status(LEASE, &PatchParams::default(), &Patch::Merge(&status)).await?;
    Ok(())
}

async fn sections(args: &Args, table: &mut Table, bench: &mut Bench) -> anyhow::Result<()> {
    if args.runs("webhook") {
        webhook_vs_noop(args, table, bench).await?;
    }
    if args.runs("apiserver") {
        guarded_vs_unguarded(args, table, bench).await?;
    }
    if !args.runs("apiserver") && args.only.iter().any(|s| s == "fenced") {
        fenced_only(args, table, bench).await?;
    }
    if args.runs("policy") {
        crate::policy::run(args, table, bench).await?;
    }
    if args.runs("holder") {
        crate::holder::status_writes(args, table, &bench.client, &bench.ns_hook, &bench.webhook_url, &bench.ca_pem).await?;
    }
    if args.runs("acquire") || args.runs("scale") {
        let ready_file = bench.dir.path().join("controller.ready");
        let controller_args: Vec<String> = [
            "controller",
            "--namespace",
            &bench.ns_lease,
            "--metrics-addr",
            "127.0.0.1:0",
            "--ready-file",
            &ready_file.display().to_string(),
            "--identity",
            "bench-controller",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let mut controller = Proc::spawn(
            "kube-fence-controller",
            Path::new(env!("CARGO_BIN_EXE_kube-fence")),
            &controller_args,
            &bench.kubeconfig,
            bench.dir.path(),
        )?;
        let metrics = controller.ready(&ready_file).await?.metrics;
        let metrics = metrics.ok_or_else(|| anyhow::anyhow!("the controller's ready file names no metrics address"))?;
        let metrics_url = format!("http://{metrics}/metrics");
        wait_metrics(&metrics_url, &mut controller).await?;
        eprintln!("controller process {} running in namespace {}", controller.pid(), bench.ns_lease);
        if args.runs("acquire") {
            acquire(args, table, bench).await?;
            takeover(args, table, bench).await?;
        }
        if args.runs("scale") {
            // A fresh webhook process, so its memory shows the lease cache rather than what the
            // HTTPS load of section 2 left behind.
            let (webhook, port) =
                spawn_webhook(&bench.https, &bench.kubeconfig, bench.dir.path(), &bench.cert, &bench.key, &bench.ns_hook).await?;
            bench.webhook = webhook;
            bench.webhook_url = format!("https://127.0.0.1:{port}/validate");
            scale(args, table, bench, &mut controller, &metrics_url).await?;
        }
        controller.alive()?;
    }
    if args.runs("connections") {
        crate::connections::run(args, table, bench).await?;
    }
    bench.webhook.alive()?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 2. Webhook HTTPS vs the no-op server.

async fn webhook_vs_noop(args: &Args, table: &mut Table, bench: &mut Bench) -> anyhow::Result<()> {
    let ready_file = bench.dir.path().join("noop.ready");
    let noop_args = vec![
        "--noop-server".to_string(),
        "127.0.0.1:0".to_string(),
        bench.cert.display().to_string(),
        bench.key.display().to_string(),
        ready_file.display().to_string(),
    ];
    let mut noop = Proc::spawn("noop-webhook", &std::env::current_exe()?, &noop_args, &bench.kubeconfig, bench.dir.path())?;
    let addr = noop.ready(&ready_file).await?.webhook.ok_or_else(|| anyhow::anyhow!("the no-op server's ready file names no address"))?;
    wait_ready(&bench.https, &format!("https://{addr}/readyz"), &mut noop).await?;
    let noop_url = format!("https://{addr}/validate");
    let c = args.concurrency;
    eprintln!(
        "[2] webhook over HTTPS vs a no-op axum+rustls server ({c} connections, ≤ {} requests or {} s per server and size)",
        args.requests(),
        args.webhook_secs()
    );
    let rounds = 2;
    for (size, label) in SIZES {
        let body = Bytes::from(crate::decision::review(&bench.ns_hook, size));
        // Warm up both (connections, TLS sessions, allocator).
        load::run(&bench.https, &noop_url, body.clone(), c, c * 4, 2.0).await;
        load::run(&bench.https, &bench.webhook_url, body.clone(), c, c * 4, 2.0).await;
        let (mut fence, mut limit) = (Vec::new(), Vec::new());
        let (mut fence_cpu, mut limit_cpu) = (Duration::ZERO, Duration::ZERO);
        let secs = args.webhook_secs() / rounds as f64;
        let requests = args.requests() / rounds;
        for _ in 0..rounds {
            let before = cpu(noop.pid());
            limit.push(load::run(&bench.https, &noop_url, body.clone(), c, requests, secs).await);
            limit_cpu += cpu(noop.pid()) - before;
            let before = cpu(bench.webhook.pid());
            fence.push(load::run(&bench.https, &bench.webhook_url, body.clone(), c, requests, secs).await);
            fence_cpu += cpu(bench.webhook.pid()) - before;
        }
        let (f, l) = (merge(fence), merge(limit));
        anyhow::ensure!(
            f.ok > 0 && l.ok > 0,
            "no admitted responses for {label} (kube-fence {} failed, no-op {} failed)",
            f.failed,
            l.failed
        );
        let ratio = f.per_sec() / l.per_sec();
        let failures = if f.failed + l.failed > 0 { format!(" ({} / {} failed)", f.failed, l.failed) } else { String::new() };
        table.add(
            "2",
            format!("webhook HTTPS {label}, c={c}: throughput{failures}"),
            rate(f.per_sec(), "req"),
            rate(l.per_sec(), "req"),
            format!("{ratio:.2}×"),
            "≥ 0.80×",
            met(ratio >= 0.8),
        );
        table.add(
            "2",
            format!("webhook HTTPS {label}: p50 / p99"),
            format!("{} / {}", ms(f.latency.p50()), ms(f.latency.p99())),
            format!("{} / {}", ms(l.latency.p50()), ms(l.latency.p99())),
            format!("{:.2}× / {:.2}×", ratio_of(f.latency.p50(), l.latency.p50()), ratio_of(f.latency.p99(), l.latency.p99())),
            "",
            Met::Info,
        );
        table.add(
            "2",
            format!("webhook HTTPS {label}: server CPU per request"),
            us(fence_cpu / f.ok.max(1) as u32),
            us(limit_cpu / l.ok.max(1) as u32),
            format!("{:.2}×", ratio_of(fence_cpu / f.ok.max(1) as u32, limit_cpu / l.ok.max(1) as u32)),
            "",
            Met::Info,
        );
    }
    let (fence_hwm, noop_hwm) = (memory(bench.webhook.pid()).1, memory(noop.pid()).1);
    table.add(
        "2",
        "… server resident memory, peak over the HTTPS load",
        mib(fence_hwm),
        mib(noop_hwm),
        format!("{:.2}×", fence_hwm as f64 / noop_hwm.max(1) as f64),
        "",
        Met::Info,
    );
    noop.alive()?;
    Ok(())
}

pub(crate) fn merge(loads: Vec<load::Load>) -> load::Load {
    let mut all = load::Load { ok: 0, failed: 0, elapsed: Duration::ZERO, latency: Samples::default() };
    for l in loads {
        all.ok += l.ok;
        all.failed += l.failed;
        all.elapsed += l.elapsed;
        all.latency.extend(l.latency);
    }
    all
}

fn ratio_of(a: Duration, b: Duration) -> f64 {
    if b.is_zero() { 0.0 } else { a.as_secs_f64() / b.as_secs_f64() }
}

// ---------------------------------------------------------------------------------------------
// 3. Guarded vs unguarded ConfigMap updates through the API server.

/// The webhook's registration for section 3: by its URL, for the bench namespace only.
fn bench_registration(bench: &Bench) -> Registration {
    let mut registration = Registration::new(format!("kf-bench-{}", bench.ns_hook), Endpoint::Url(bench.webhook_url.clone()));
    registration.ca_bundle = Some(bench.ca_pem.clone());
    registration.only_namespaces = Some(vec![bench.ns_hook.clone()]);
    registration
}

async fn guarded_vs_unguarded(args: &Args, table: &mut Table, bench: &mut Bench) -> anyhow::Result<()> {
    let client = bench.client.clone();
    let registration = bench_registration(bench);
    registration.apply(&client).await?;
    let result = guarded_vs_unguarded_registered(args, table, bench).await;
    registration.remove(&client).await?;
    result
}

async fn guarded_vs_unguarded_registered(args: &Args, table: &mut Table, bench: &mut Bench) -> anyhow::Result<()> {
    let cms: Api<ConfigMap> = Api::namespaced(bench.client.clone(), &bench.ns_hook);
    let leases: Api<Lease> = Api::namespaced(bench.client.clone(), &bench.ns_hook);
    // A guarded create needs the lease's newest token; wait until the API server calls the
    // webhook.
    common::wait_fenced(&bench.client, &bench.ns_hook, &Default::default(), common::Fencing::Judged, Duration::from_secs(30)).await;
    let writers = args.writers;
    for w in 0..writers {
        let data = Some([("seq".to_string(), "0".to_string())].into());
        cms.create(
            &PostParams::default(),
            &ConfigMap { metadata: meta(&format!("guarded-{w}"), Some(LEASE), Some(ISSUED)), data: data.clone(), ..Default::default() },
        )
        .await?;
        cms.create(&PostParams::default(), &ConfigMap { metadata: meta(&format!("plain-{w}"), None, None), data, ..Default::default() })
            .await?;
    }
    // Later grants: room for every update's token (t > recorded, t <= issued).
    set_issued(&leases, ISSUED * 2).await?;
    let tokens = Arc::new(AtomicU64::new(ISSUED + 1));
    eprintln!(
        "[3] guarded vs unguarded ConfigMap updates through the API server ({} each, {writers} writers, then 1 writer)",
        args.updates()
    );

    // Throughput under load: rounds alternate so drift hits both alike.
    updates(&cms, writers, writers * 5, true, &tokens, "").await?;
    updates(&cms, writers, writers * 5, false, &tokens, "").await?;
    let rounds = 3;
    let (mut guarded, mut plain) = (Vec::new(), Vec::new());
    for _ in 0..rounds {
        guarded.push(updates(&cms, writers, args.updates() / rounds, true, &tokens, "").await?);
        plain.push(updates(&cms, writers, args.updates() / rounds, false, &tokens, "").await?);
    }
    let (g, p) = (merge(guarded), merge(plain));
    let ratio = g.per_sec() / p.per_sec();
    let added99 = g.latency.p99().saturating_sub(p.latency.p99());
    table.add(
        "3",
        format!("ConfigMap updates via API server, {writers} writers: throughput"),
        rate(g.per_sec(), "upd"),
        rate(p.per_sec(), "upd"),
        format!("{ratio:.2}×"),
        "≥ 0.85×",
        met(ratio >= 0.85),
    );
    table.add(
        "3",
        format!("… {writers} writers: p50 / p99 (added)"),
        format!("{} / {}", ms(g.latency.p50()), ms(g.latency.p99())),
        format!("{} / {}", ms(p.latency.p50()), ms(p.latency.p99())),
        format!("+{} / +{}", ms(g.latency.p50().saturating_sub(p.latency.p50())), ms(added99)),
        "≤ +1.5 ms p99",
        met(added99 <= Duration::from_micros(1500)),
    );
    // Latency alone: one writer, guarded and unguarded interleaved.
    let (mut g1, mut p1) = (Samples::default(), Samples::default());
    for _ in 0..(args.updates() / 2) {
        g1.extend(updates(&cms, 1, 1, true, &tokens, "").await?.latency);
        p1.extend(updates(&cms, 1, 1, false, &tokens, "").await?.latency);
    }
    let added99 = g1.p99().saturating_sub(p1.p99());
    table.add(
        "3",
        "… 1 writer: p50 / p99 (added)",
        format!("{} / {}", ms(g1.p50()), ms(g1.p99())),
        format!("{} / {}", ms(p1.p50()), ms(p1.p99())),
        format!("+{} / +{}", ms(g1.p50().saturating_sub(p1.p50())), ms(added99)),
        "≤ +1.5 ms p99",
        met(added99 <= Duration::from_micros(1500)),
    );
    leader_guarded(args, table, bench).await
}

/// Section 3, the leader-election guard: one writer (a Pod-bound token, the Lease's holder)
/// updating a ConfigMap labelled `kubefence.io/leader-lease` — judged by a quorum read of the
/// Lease's holder — interleaved with updates of an unlabelled one.
async fn leader_guarded(args: &Args, table: &mut Table, bench: &mut Bench) -> anyhow::Result<()> {
    let cms = leader_holder(bench).await?;
    eprintln!("[3] leader-lease guarded vs unguarded ConfigMap updates by the Lease's holder ({} each, 1 writer)", args.updates() / 2);
    let (mut g, mut p) = (Samples::default(), Samples::default());
    for i in 0..(args.updates() / 2) {
        let patch = json!({"data": {"seq": i.to_string()}});
        for (name, samples) in [("leader-guarded", &mut g), ("leader-plain", &mut p)] {
            let t = Instant::now();
            cms.patch(name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
            samples.push(t.elapsed());
        }
    }
    let added99 = g.p99().saturating_sub(p.p99());
    table.add(
        "3",
        "… leader-lease guard (quorum read of the holder), 1 writer: p50 / p99 (added)",
        format!("{} / {}", ms(g.p50()), ms(g.p99())),
        format!("{} / {}", ms(p.p50()), ms(p.p99())),
        format!("+{} / +{}", ms(g.p50().saturating_sub(p.p50())), ms(added99)),
        "",
        Met::Info,
    );
    writer_fenced(args, table, bench, &cms).await
}

/// `--only fenced`: the writer fence's rows of section 3 alone (issue 35), registered as
/// section 3 registers the webhook.
async fn fenced_only(args: &Args, table: &mut Table, bench: &mut Bench) -> anyhow::Result<()> {
    let client = bench.client.clone();
    let registration = bench_registration(bench);
    registration.apply(&client).await?;
    let result = async {
        let cms = leader_holder(bench).await?;
        writer_fenced(args, table, bench, &cms).await
    }
    .await;
    registration.remove(&client).await?;
    result
}

/// The holder of the leader-election Lease `leader` of the bench namespace: ServiceAccount
/// `leader`, Pod `leader-0` (a bound token), allowed every ConfigMap verb; with the ConfigMaps
/// `leader-guarded` (labelled with the Lease) and `leader-plain` made as it.
async fn leader_holder(bench: &mut Bench) -> anyhow::Result<Api<ConfigMap>> {
    use k8s_openapi::api::coordination::v1::Lease as LeaderLease;
    use k8s_openapi::api::core::v1::{Pod, ServiceAccount};
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    use kube_fence_api::names::LEADER_LEASE_LABEL;
    let (admin, ns) = (bench.client.clone(), bench.ns_hook.clone());
    let pp = PostParams::default();
    Api::<ServiceAccount>::namespaced(admin.clone(), &ns)
        .create(&pp, &serde_json::from_value(json!({"metadata": {"name": "leader"}}))?)
        .await?;
    let role = json!({"metadata": {"name": "leader"}, "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["*"]}]});
    Api::<Role>::namespaced(admin.clone(), &ns).create(&pp, &serde_json::from_value(role)?).await?;
    let binding = json!({"metadata": {"name": "leader"}, "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "leader"},
        "subjects": [{"kind": "ServiceAccount", "name": "leader", "namespace": ns}]});
    Api::<RoleBinding>::namespaced(admin.clone(), &ns).create(&pp, &serde_json::from_value(binding)?).await?;
    let pod: Pod = serde_json::from_value(
        json!({"metadata": {"name": "leader-0"}, "spec": {"serviceAccountName": "leader", "containers": [{"name": "c", "image": "registry.invalid/none"}]}}),
    )?;
    let pod = Api::<Pod>::namespaced(admin.clone(), &ns).create(&pp, &pod).await?;
    let lease: LeaderLease = serde_json::from_value(json!({"metadata": {"name": "leader"}, "spec": {"holderIdentity": "leader-0_bench"}}))?;
    Api::<LeaderLease>::namespaced(admin.clone(), &ns).create(&pp, &lease).await?;
    let as_pod = common::identity::client_as_pod(&common::kubeconfig().await, &admin, &ns, "leader", &pod).await;
    let cms: Api<ConfigMap> = Api::namespaced(as_pod, &ns);
    let labels = |guarded: bool| guarded.then(|| [(LEADER_LEASE_LABEL.to_string(), "leader".to_string())].into());
    for (name, guarded) in [("leader-guarded", true), ("leader-plain", false)] {
        let cm = ConfigMap {
            metadata: ObjectMeta { name: Some(name.into()), labels: labels(guarded), ..Default::default() },
            ..Default::default()
        };
        // The Role takes a moment to reach the authorizer.
        let deadline = Instant::now() + Duration::from_secs(30);
        while let Err(err) = cms.create(&pp, &cm).await {
            anyhow::ensure!(Instant::now() < deadline, "creating {name} as the Lease's holder: {err}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(cms)
}

/// Section 3, the writer fence: the same holder's updates of the unlabelled ConfigMap with its
/// ServiceAccount fenced (a FencedController on its Lease: one quorum read of the Lease per write)
/// and not, in alternating rounds; and an admin's updates of another ConfigMap (an identity no
/// fence names) with 0, 100 and 1,000 FencedControllers routed — what fences cost everyone else.
async fn writer_fenced(args: &Args, table: &mut Table, bench: &mut Bench, holder: &Api<ConfigMap>) -> anyhow::Result<()> {
    use futures::StreamExt;
    use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
    use kube::api::DeleteParams;
    use kube_fence::admission::registration::routing;
    use kube_fence_api::{FenceMode, FencedController, FencedControllerSpec};
    let (admin, ns) = (bench.client.clone(), bench.ns_hook.clone());
    let pp = PostParams::default();
    let others: Api<ConfigMap> = Api::namespaced(admin.clone(), &ns);
    others.create(&pp, &serde_json::from_value(json!({"metadata": {"name": "others-plain"}}))?).await?;
    let fences: Api<FencedController> = Api::namespaced(admin.clone(), &ns);
    let routed = routing::configuration_name(&format!("kf-bench-{ns}"));
    let configurations: Api<ValidatingWebhookConfiguration> = Api::all(admin.clone());
    let fence = |name: &str| {
        let mut fenced = FencedController::new(
            name,
            FencedControllerSpec { lease: name.into(), service_accounts: vec![name.into()], exempt: Vec::new(), mode: FenceMode::Enforce },
        );
        fenced.metadata.namespace = Some(ns.clone());
        fenced
    };
    // Waits until the applied routing says `user` is routed (or not), then for the API server's
    // webhook informer to follow.
    let routed_as = async |user: String, on: bool| -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            let applied = configurations.get_opt(&routed).await?;
            if applied.is_some_and(|c| routing::routes_in(&c, &user)) == on {
                break;
            }
            anyhow::ensure!(Instant::now() < deadline, "the routing of {user} did not become {on} within 120 s");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
        Ok(())
    };
    let leader_user = format!("system:serviceaccount:{ns}:leader");
    let set_fenced = async |on: bool| -> anyhow::Result<()> {
        if on {
            fences.create(&pp, &fence("leader")).await?;
        } else if fences.get_opt("leader").await?.is_some() {
            fences.delete("leader", &DeleteParams::default()).await?;
        }
        routed_as(leader_user.clone(), on).await
    };
    let rounds = 2;
    let per_round = (args.updates() / 2 / rounds).max(1);
    eprintln!("[3] writer fence: the fenced holder's updates with and without its FencedController ({rounds} rounds of {per_round})");
    let (mut fenced, mut unfenced) = (Samples::default(), Samples::default());
    let mut seq = 0;
    for _ in 0..rounds {
        for on in [false, true] {
            set_fenced(on).await?;
            for _ in 0..per_round {
                seq += 1;
                let patch = json!({"data": {"seq": seq.to_string()}});
                let t = Instant::now();
                holder.patch("leader-plain", &PatchParams::default(), &Patch::Merge(&patch)).await?;
                (if on { &mut fenced } else { &mut unfenced }).push(t.elapsed());
            }
        }
    }
    set_fenced(false).await?;
    let added = |a: &Samples, b: &Samples| format!("+{} / +{}", ms(a.p50().saturating_sub(b.p50())), ms(a.p99().saturating_sub(b.p99())));
    table.add(
        "3",
        "… writer fence: a fenced controller's update (quorum read of its Lease), 1 writer: p50 / p99 (added)",
        format!("{} / {}", ms(fenced.p50()), ms(fenced.p99())),
        format!("{} / {}", ms(unfenced.p50()), ms(unfenced.p99())),
        added(&fenced, &unfenced),
        "",
        Met::Info,
    );
    fenced_throughput(args, table, bench, holder, &set_fenced).await?;
    set_fenced(false).await?;
    // Everyone else's cost, as fences grow: 0, 100, 1,000 FencedControllers of ServiceAccounts
    // that write nothing here.
    let mut by_count = Vec::new();
    let mut made = 0;
    for count in [0usize, 100, 1_000] {
        let created: Vec<_> = futures::stream::iter((made..count).map(|i| {
            let (fences, fenced) = (fences.clone(), fence(&format!("other-{i}")));
            async move { fences.create(&PostParams::default(), &fenced).await.map(|_| ()) }
        }))
        .buffer_unordered(16)
        .collect()
        .await;
        created.into_iter().collect::<Result<Vec<_>, _>>()?;
        if count > 0 {
            routed_as(format!("system:serviceaccount:{ns}:other-{}", count - 1), true).await?;
        }
        made = count;
        eprintln!("[3] writer fence: another identity's updates with {count} FencedControllers routed ({per_round})");
        let mut samples = Samples::default();
        for _ in 0..per_round * rounds {
            seq += 1;
            let patch = json!({"data": {"seq": seq.to_string()}});
            let t = Instant::now();
            others.patch("others-plain", &PatchParams::default(), &Patch::Merge(&patch)).await?;
            samples.push(t.elapsed());
        }
        if let Some(dir) = &args.profile_apiserver
            && (count == 0 || count == 1_000)
        {
            // Where everyone else's added CPU goes: 10 s profiles of the admin's updates with 0 and
            // 1,000 FencedControllers routed (`go tool pprof -top -diff_base 0 1000`).
            std::fs::create_dir_all(dir)?;
            let file = dir.join(format!("apiserver-others-{count}-routed.pprof"));
            let writes = profile_while(&bench.client, &file, async || {
                for _ in 0..50 {
                    let patch = json!({"data": {"seq": Instant::now().elapsed().as_nanos().to_string()}});
                    others.patch("others-plain", &PatchParams::default(), &Patch::Merge(&patch)).await?;
                }
                Ok(50)
            })
            .await?;
            eprintln!("[3] kube-apiserver CPU profile over {writes} of another identity's writes: {}", file.display());
        }
        by_count.push((count, samples));
    }
    let base = by_count[0].1.clone();
    for (count, samples) in &by_count[1..] {
        table.add(
            "3",
            format!("… {count} FencedControllers routed: another identity's update, p50 / p99 (added)"),
            format!("{} / {}", ms(samples.p50()), ms(samples.p99())),
            format!("{} / {}", ms(base.p50()), ms(base.p99())),
            added(samples, &base),
            "flat",
            Met::Info,
        );
    }
    fences.delete_collection(&DeleteParams::default(), &Default::default()).await?;
    Ok(())
}

/// `workers` tasks, each updating a ConfigMap of its own `per_worker` times as the fenced
/// controller's holder: the updates a second, their latencies, and how many were refused (429
/// or anything else: genuine traffic).
async fn holder_updates(holder: &Api<ConfigMap>, workers: usize, per_worker: usize) -> anyhow::Result<(f64, Samples, usize)> {
    let started = Instant::now();
    let tasks: Vec<_> = (0..workers)
        .map(|w| {
            let cms = holder.clone();
            tokio::spawn(async move {
                let (mut samples, mut refused) = (Samples::default(), 0usize);
                for i in 0..per_worker {
                    let patch = json!({"data": {"seq": i.to_string()}});
                    let t = Instant::now();
                    match cms.patch(&format!("throughput-{w}"), &PatchParams::default(), &Patch::Merge(&patch)).await {
                        Ok(_) => samples.push(t.elapsed()),
                        Err(_) => refused += 1,
                    }
                }
                (samples, refused)
            })
        })
        .collect();
    let (mut all, mut refused) = (Samples::default(), 0);
    for task in tasks {
        let (samples, r) = task.await?;
        all.0.extend(samples.0);
        refused += r;
    }
    let rate = (workers * per_worker) as f64 / started.elapsed().as_secs_f64();
    Ok((rate, all, refused))
}

/// Section 3, a fenced controller at full speed (issue 35): its holder's updates with 1 and 8
/// workers, fenced and not, at rest and while a tenant floods labelled creates in a namespace of
/// its own (each create a quorum read, each refused); and beside them a raw quorum GET of the
/// Lease, the price of the linearizable read a fenced write makes.
async fn fenced_throughput(
    args: &Args,
    table: &mut Table,
    bench: &mut Bench,
    holder: &Api<ConfigMap>,
    set_fenced: &impl AsyncFn(bool) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    use k8s_openapi::api::coordination::v1::Lease as LeaderLease;
    let (admin, ns) = (bench.client.clone(), bench.ns_hook.clone());
    for w in 0..8 {
        let cm = ConfigMap { metadata: ObjectMeta { name: Some(format!("throughput-{w}")), ..Default::default() }, ..Default::default() };
        holder.create(&PostParams::default(), &cm).await?;
    }
    // The raw quorum GET of the Lease (no resourceVersion: served from etcd), as the webhook
    // makes it.
    let leases: Api<LeaderLease> = Api::namespaced(admin.clone(), &ns);
    let mut raw = Samples::default();
    for _ in 0..args.updates() / 4 {
        let t = Instant::now();
        leases.get("leader").await?;
        raw.push(t.elapsed());
    }
    // The tenant: its own namespace, labelled creates naming leases that do not exist.
    let tenant = format!("{ns}-tenant");
    Api::<Namespace>::all(admin.clone())
        .create(&PostParams::default(), &serde_json::from_value(json!({"metadata": {"name": tenant}}))?)
        .await?;
    let per_worker = (args.updates() / 4).max(10);
    for flood in [false, true] {
        let stop = Arc::new(AtomicBool::new(false));
        let flooders: Vec<_> = (0..if flood { 8 } else { 0 })
            .map(|f| {
                let (cms, stop) = (Api::<ConfigMap>::namespaced(admin.clone(), &tenant), stop.clone());
                tokio::spawn(async move {
                    let mut i = 0u64;
                    while !stop.load(Ordering::Relaxed) {
                        i += 1;
                        let cm = json!({"metadata": {"name": format!("flood-{f}-{i}"), "labels": {LEASE_LABEL: format!("nothing-{f}-{i}")},
                            "annotations": {TOKEN_ANNOTATION: "1"}}});
                        let _ = cms.create(&PostParams::default(), &serde_json::from_value::<ConfigMap>(cm).expect("a ConfigMap")).await;
                    }
                    i
                })
            })
            .collect();
        for workers in [1usize, 8] {
            eprintln!(
                "[3] fenced controller, {workers} workers{}: fenced and not ({per_worker} each)",
                if flood { ", tenant flooding" } else { "" }
            );
            set_fenced(false).await?;
            let before = Timings::scrape(bench).await?;
            let (plain_rate, plain, _) = holder_updates(holder, workers, per_worker).await?;
            let plain_spent = Timings::scrape(bench).await?.since(&before);
            set_fenced(true).await?;
            let before = Timings::scrape(bench).await?;
            let (fenced_rate, fenced, refused) = holder_updates(holder, workers, per_worker).await?;
            let spent = Timings::scrape(bench).await?.since(&before);
            let during = if flood { ", a tenant flooding" } else { "" };
            let ratio = fenced_rate / plain_rate.max(f64::MIN_POSITIVE);
            let target = if workers == 8 { 0.8 } else { 0.6 };
            table.add(
                "3",
                format!("… fenced controller, {workers} writer(s){during}: throughput, p50 / p99 (refused)"),
                format!("{} , {} / {} ({refused})", rate(fenced_rate, "upd"), ms(fenced.p50()), ms(fenced.p99())),
                format!("{} , {} / {}", rate(plain_rate, "upd"), ms(plain.p50()), ms(plain.p99())),
                format!("{ratio:.2}×, +{} p50", ms(fenced.p50().saturating_sub(plain.p50()))),
                format!("≥ {target}×, 0 refused"),
                met(ratio >= target && refused == 0),
            );
            table.add(
                "3",
                format!("… of which, mean per fenced write{during} ({workers} writer(s)): API server calling the webhook / the webhook judging / its quorum read"),
                format!("{} / {} / {}", ms(spent.calls), ms(spent.judging), ms(spent.read)),
                ms(fenced.mean().saturating_sub(plain.mean())),
                "(added mean)",
                "",
                Met::Info,
            );
            let n = (fenced.len().max(1) as u32, plain.len().max(1) as u32);
            table.add(
                "3",
                format!("… CPU per write{during} ({workers} writer(s)): API server / etcd / webhook; quorum reads per fenced write"),
                format!(
                    "{} / {} / {}; {:.2}",
                    us(spent.cpu[0] / n.0),
                    us(spent.cpu[1] / n.0),
                    us(spent.cpu[2] / n.0),
                    spent.reads as f64 / f64::from(n.0)
                ),
                format!("{} / {} / {}", us(plain_spent.cpu[0] / n.1), us(plain_spent.cpu[1] / n.1), us(plain_spent.cpu[2] / n.1)),
                "",
                "",
                Met::Info,
            );
            if let (Some(dir), false) = (&args.profile_apiserver, flood) {
                // Where the API server's added CPU goes: 10 s profiles of the same writes, fenced
                // and not (`go tool pprof -top -diff_base PLAIN FENCED`).
                std::fs::create_dir_all(dir)?;
                for on in [false, true] {
                    set_fenced(on).await?;
                    let file = dir.join(format!("apiserver-fenced-controller-{}-{workers}w.pprof", if on { "fenced" } else { "plain" }));
                    let writes =
                        profile_while(&bench.client, &file, async || Ok(holder_updates(holder, workers, per_worker).await?.1.len()))
                            .await?;
                    eprintln!("[3] kube-apiserver CPU profile over {writes} writes: {}", file.display());
                }
            }
            if workers == 1 && !flood {
                let added = fenced.p50().saturating_sub(plain.p50());
                table.add(
                    "3",
                    "… fenced controller, 1 writer: p50 added against a raw quorum GET of the Lease (p50)",
                    ms(added),
                    ms(raw.p50()),
                    format!("{:+.2} ms", (added.as_secs_f64() - raw.p50().as_secs_f64()) * 1000.0),
                    "≤ the GET + 0.5 ms",
                    met(added <= raw.p50() + Duration::from_micros(500)),
                );
            }
        }
        stop.store(true, Ordering::Relaxed);
        let mut flooded = 0;
        for f in flooders {
            flooded += f.await?;
        }
        if flood {
            eprintln!("[3] the tenant sent {flooded} labelled creates");
        }
    }
    let _ = Api::<Namespace>::all(admin).delete(&tenant, &DeleteParams::default()).await;
    Ok(())
}

/// Writes the kube-apiserver's CPU profile over 10 s into `file`, running `work` again and again
/// meanwhile; how many writes it made.
pub(crate) async fn profile_while(client: &Client, file: &Path, work: impl AsyncFn() -> anyhow::Result<usize>) -> anyhow::Result<usize> {
    const PROFILE_SECS: u64 = 10;
    let request = http::Request::get(format!("/debug/pprof/profile?seconds={PROFILE_SECS}")).body(Vec::new())?;
    let profile = {
        let client = client.clone();
        tokio::spawn(async move {
            use futures::AsyncReadExt;
            let mut bytes = Vec::new();
            client.request_stream(request).await?.read_to_end(&mut bytes).await?;
            anyhow::Ok(bytes)
        })
    };
    let stop = Instant::now() + Duration::from_secs(PROFILE_SECS + 1);
    let mut writes = 0;
    while Instant::now() < stop {
        writes += work().await?;
    }
    std::fs::write(file, profile.await??)?;
    Ok(writes)
}

/// Where a fenced write's time goes, from the API server's and the webhook's own metrics: the
/// API server's `apiserver_admission_webhook_admission_duration_seconds` for the writer webhooks
/// (its call, round trip included) and the webhook's `decision_duration_seconds` (body received
/// to response, the quorum read included); sums and counts.
struct Timings {
    calls: (f64, f64),
    judging: (f64, f64),
    read: (f64, f64),
    /// The webhook's quorum reads.
    reads: f64,
    /// CPU of every kube-apiserver, every etcd and the webhook.
    cpu: [Duration; 3],
}

/// Mean durations, reads and CPU between two [`Timings`].
struct Spent {
    calls: Duration,
    judging: Duration,
    read: Duration,
    reads: u64,
    cpu: [Duration; 3],
}

/// The command line of every process named `comm`, by pid (arguments NUL-separated).
fn processes(comm: &str) -> Vec<(u32, String)> {
    let Ok(entries) = std::fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| std::fs::read_to_string(format!("/proc/{pid}/comm")).is_ok_and(|c| c.trim() == comm))
        .filter_map(|pid| Some((pid, String::from_utf8_lossy(&std::fs::read(format!("/proc/{pid}/cmdline")).ok()?).into_owned())))
        .collect()
}

/// The bench's own API server (by the port of its kubeconfig) and etcd (by the client URL that
/// API server was given) — not another engineer's on the same machine.
fn control_plane(kubeconfig: &Path) -> (Option<u32>, Option<u32>) {
    let port = kube::config::Kubeconfig::read_from(kubeconfig)
        .ok()
        .and_then(|k| k.clusters.first()?.cluster.as_ref()?.server.clone())
        .and_then(|server| server.parse::<http::Uri>().ok()?.port_u16());
    let Some(port) = port else { return (None, None) };
    let Some((apiserver, line)) = processes("kube-apiserver").into_iter().find(|(_, l)| l.contains(&format!("--secure-port\0{port}\0")))
    else {
        return (None, None);
    };
    let etcd_url = line.split('\0').skip_while(|a| *a != "--etcd-servers").nth(1).unwrap_or("").split(',').next().unwrap_or("").to_string();
    // Other control planes on the machine (the HA topology's members, in network namespaces of
    // their own) may listen on the same URL: the bench's etcd shares the API server's.
    let net = |pid: u32| std::fs::read_link(format!("/proc/{pid}/ns/net")).ok();
    let etcd = processes("etcd")
        .into_iter()
        .find(|(pid, l)| !etcd_url.is_empty() && l.contains(&etcd_url) && net(*pid) == net(apiserver))
        .map(|(pid, _)| pid);
    (Some(apiserver), etcd)
}

impl Timings {
    async fn scrape(bench: &Bench) -> anyhow::Result<Timings> {
        let api = bench.client.request_text(http::Request::get("/metrics").body(Vec::new())?).await?;
        let url = bench.webhook_url.replace("/validate", "/metrics");
        let (_, webhook) = load::request(&bench.https, http::Method::GET, &url, Bytes::new()).await?;
        let webhook = String::from_utf8_lossy(&webhook);
        Ok(Timings {
            calls: sum_count(&api, "apiserver_admission_webhook_admission_duration_seconds", "name=\"writers"),
            judging: sum_count(&webhook, "kube_fence_webhook_decision_duration_seconds", ""),
            read: sum_count(&webhook, "kube_fence_webhook_quorum_read_duration_seconds", ""),
            reads: webhook
                .lines()
                .filter(|l| l.starts_with("kube_fence_webhook_lease_reads_total") && l.contains("linearizable"))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum(),
            cpu: [bench.apiserver.map(cpu).unwrap_or_default(), bench.etcd.map(cpu).unwrap_or_default(), cpu(bench.webhook.pid())],
        })
    }

    fn since(&self, before: &Timings) -> Spent {
        let mean = |(s, c): (f64, f64), (s0, c0): (f64, f64)| {
            if c > c0 { Duration::from_secs_f64((s - s0) / (c - c0)) } else { Duration::ZERO }
        };
        Spent {
            calls: mean(self.calls, before.calls),
            judging: mean(self.judging, before.judging),
            read: mean(self.read, before.read),
            reads: (self.reads - before.reads).max(0.0) as u64,
            cpu: [0, 1, 2].map(|i| self.cpu[i].saturating_sub(before.cpu[i])),
        }
    }
}

/// The sum of `metric`'s `_sum` and `_count` samples whose labels contain `labels`.
fn sum_count(text: &str, metric: &str, labels: &str) -> (f64, f64) {
    let total = |suffix: &str| -> f64 {
        let name = format!("{metric}{suffix}");
        text.lines()
            .filter(|l| l.starts_with(&name) && l[name.len()..].starts_with(['{', ' ']) && l.contains(labels))
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum()
    };
    (total("_sum"), total("_count"))
}

pub(crate) fn meta(name: &str, lease: Option<&str>, token: Option<u64>) -> ObjectMeta {
    ObjectMeta {
        name: Some(name.to_string()),
        labels: lease.map(|l| [(LEASE_LABEL.to_string(), l.to_string())].into()),
        annotations: token.map(|t| [(TOKEN_ANNOTATION.to_string(), t.to_string())].into()),
        ..Default::default()
    }
}

/// `total` merge-patch updates from `writers` writers, each on its own object (a ConfigMap, or a
/// custom resource with a `data` map: `{prefix}guarded-{w}` / `{prefix}plain-{w}`; guarded ones stamped with a fresh, greater token,
/// unguarded ones with an annotation of the same size).
pub(crate) async fn updates<K>(
    cms: &Api<K>,
    writers: usize,
    total: usize,
    guarded: bool,
    tokens: &Arc<AtomicU64>,
    prefix: &'static str,
) -> anyhow::Result<load::Load>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug + Send + Sync + 'static,
{
    let started = Instant::now();
    let per = total.div_ceil(writers);
    let tasks: Vec<_> = (0..writers)
        .map(|w| {
            let (cms, tokens) = (cms.clone(), tokens.clone());
            tokio::spawn(async move {
                let mut latency = Samples::default();
                let name = if guarded { format!("{prefix}guarded-{w}") } else { format!("{prefix}plain-{w}") };
                for i in 0..per {
                    let token = tokens.fetch_add(1, Ordering::Relaxed);
                    let annotation = if guarded { TOKEN_ANNOTATION } else { "bench.kubefence.io/seq" };
                    let patch = json!({"metadata": {"annotations": {annotation: token.to_string()}}, "data": {"seq": i.to_string()}});
                    let t = Instant::now();
                    cms.patch(&name, &PatchParams::default(), &Patch::Merge(&patch)).await?;
                    latency.push(t.elapsed());
                }
                anyhow::Ok(latency)
            })
        })
        .collect();
    let mut out = load::Load { ok: 0, failed: 0, elapsed: Duration::ZERO, latency: Samples::default() };
    for t in tasks {
        let latency = t.await??;
        out.ok += latency.len();
        out.latency.extend(latency);
    }
    out.elapsed = started.elapsed();
    Ok(out)
}

// ---------------------------------------------------------------------------------------------
// 4. Acquire latency vs two raw writes; takeover delay vs the lease duration.

async fn acquire(args: &Args, table: &mut Table, bench: &mut Bench) -> anyhow::Result<()> {
    let n = args.acquires();
    eprintln!("[4] lease acquire latency ({n} acquisitions) vs two raw API server writes");
    let api: Api<Lease> = Api::namespaced(bench.client.clone(), &bench.ns_lease);
    for i in 0..n {
        api.create(&PostParams::default(), &Lease::new(&format!("acq-{i}"), LeaseSpec::default())).await?;
    }
    // The raw pair: a spec write then a status write (compare-and-swap each), on a Lease no
    // controller watches — the two writes an acquisition needs at the least.
    let raw_api: Api<Lease> = Api::namespaced(bench.client.clone(), &bench.ns_hook);
    let mut raw_lease = raw_api.create(&PostParams::default(), &Lease::new("raw", LeaseSpec::default())).await?;
    tokio::time::sleep(Duration::from_secs(1)).await;
    let leases = Leases::new(bench.client.clone(), &bench.ns_lease);
    let observer = Observer::start(api.clone());
    let (mut acquired, mut raw) = (Samples::default(), Samples::default());
    let mut calls = Vec::new();
    for i in 0..n {
        let t = Instant::now();
        let grant =
            leases.acquire(&format!("acq-{i}"), &format!("holder-{i}"), AcquireOptions::default().timeout(Duration::from_secs(30))).await?;
        let returned = Instant::now();
        acquired.push(returned - t);
        calls.push((format!("acq-{i}"), t, returned));
        leases.release(&grant).await?;

        let t = Instant::now();
        raw_lease.spec.holder = Some(format!("holder-{i}"));
        raw_lease.metadata.managed_fields = None;
        raw_lease = raw_api.replace("raw", &PostParams::default(), &raw_lease).await?;
        raw_lease.status =
            Some(kube_fence_api::LeaseStatus { holder: Some(format!("holder-{i}")), ..raw_lease.status.clone().unwrap_or_default() });
        raw_lease = raw_api.replace_status("raw", &PostParams::default(), &raw_lease).await?;
        raw.push(t.elapsed());
    }
    let ratio = ratio_of(acquired.p99(), raw.p99());
    table.add(
        "4",
        format!("lease acquire, request → token ({n}): p50 / p99"),
        format!("{} / {}", ms(acquired.p50()), ms(acquired.p99())),
        format!("2 raw writes: {} / {}", ms(raw.p50()), ms(raw.p99())),
        format!("{:.2}× / {ratio:.2}×", ratio_of(acquired.p50(), raw.p50())),
        "p99 ≤ 2×",
        met(ratio <= 2.0),
    );
    // The side watcher may lag the client: give it a moment.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (mut to_claim, mut to_grant, mut to_client) = (Samples::default(), Samples::default(), Samples::default());
    for (name, called, returned) in calls {
        if let Some((claim, granted)) = observer.seen(&name) {
            to_claim.push(claim.saturating_duration_since(called));
            to_grant.push(granted.saturating_duration_since(claim));
            to_client.push(returned.saturating_duration_since(granted));
        }
    }
    // Where the time goes, as a third watcher of the same Leases saw it: the request until the
    // claim is visible (the client's read and claim write), the controller's reaction until the
    // grant is visible (its watch, reconcile and status write), and the grant reaching the client.
    let stages = [("call → claim seen", to_claim), ("claim → grant seen (controller)", to_grant), ("grant seen → call returns", to_client)];
    for (stage, samples) in stages {
        table.add(
            "4",
            format!("… {stage} ({}): p50 / p99", samples.len()),
            format!("{} / {}", ms(samples.p50()), ms(samples.p99())),
            "",
            "",
            "",
            Met::Info,
        );
    }
    observer.stop();
    Ok(())
}

/// When each Lease's claim, then its grant, was first seen.
type Sightings = Arc<std::sync::Mutex<std::collections::HashMap<String, (Option<Instant>, Option<Instant>)>>>;

/// Watches the acquire Leases from the side and notes when each claim, then each grant, was first
/// seen (one watch for the whole section, so its cost is not in the acquisitions).
struct Observer {
    seen: Sightings,
    task: tokio::task::JoinHandle<()>,
}

impl Observer {
    fn start(api: Api<Lease>) -> Observer {
        use futures::StreamExt;
        use kube::runtime::{WatchStreamExt, watcher};
        let seen: Sightings = Arc::default();
        let noted = seen.clone();
        let task = tokio::spawn(async move {
            let mut leases = watcher(api, watcher::Config::default()).default_backoff().applied_objects().boxed();
            while let Some(Ok(lease)) = leases.next().await {
                let at = Instant::now();
                let Some(name) = lease.metadata.name.clone() else { continue };
                let claimed = lease.spec.holder.is_some();
                let granted = claimed && lease.status.as_ref().is_some_and(|s| s.holder == lease.spec.holder && s.token.is_some());
                if let Ok(mut seen) = noted.lock() {
                    let entry = seen.entry(name).or_default();
                    if claimed && entry.0.is_none() {
                        entry.0 = Some(at);
                    }
                    if granted && entry.1.is_none() {
                        entry.1 = Some(at);
                    }
                }
            }
        });
        Observer { seen, task }
    }

    /// When the claim and the grant on `name` were first seen.
    fn seen(&self, name: &str) -> Option<(Instant, Instant)> {
        let seen = self.seen.lock().ok()?;
        match seen.get(name) {
            Some((Some(claim), Some(grant))) => Some((*claim, *grant)),
            _ => None,
        }
    }

    fn stop(self) {
        self.task.abort();
    }
}

async fn takeover(args: &Args, table: &mut Table, bench: &mut Bench) -> anyhow::Result<()> {
    let k = args.takeovers();
    let secs = args.takeover_lease_secs;
    let duration = Duration::from_secs(u64::from(secs));
    eprintln!("[4] takeover after the holder dies ({k} at once, lease duration {secs} s)");
    let tasks: Vec<_> = (0..k)
        .map(|j| {
            let leases = Leases::new(bench.client.clone(), &bench.ns_lease);
            tokio::spawn(async move {
                let name = format!("take-{j}");
                let first =
                    leases.acquire(&name, "dies", AcquireOptions::default().duration(duration).timeout(Duration::from_secs(30))).await?;
                // The holder dies here: no heartbeat, no release.
                let died = Instant::now();
                let next =
                    leases.acquire(&name, "successor", AcquireOptions::default().timeout(duration * 5 + Duration::from_secs(10))).await?;
                anyhow::ensure!(next.token > first.token, "takeover token {} is not greater than {}", next.token, first.token);
                anyhow::Ok(died.elapsed())
            })
        })
        .collect();
    let mut delays = Samples::default();
    for t in tasks {
        delays.push(t.await??);
    }
    table.add(
        "4",
        format!("takeover after the holder dies ({k}): mean / max"),
        format!("{} / {}", ms(delays.mean()), ms(delays.quantile(1.0))),
        format!("lease duration {}", ms(duration)),
        format!("{:.2}× / {:.2}×", ratio_of(delays.mean(), duration), ratio_of(delays.quantile(1.0), duration)),
        "≈ 1× (+ ≤ 1 s rounding)",
        Met::Info,
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// 5. Many leases churning.

async fn wait_metrics(url: &str, controller: &mut Proc) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        controller.alive()?;
        if grants(url).await.is_ok() {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "the controller's metrics did not answer within 60 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The controller's grant counter, from its /metrics.
async fn grants(url: &str) -> anyhow::Result<u64> {
    let client: hyper_util::client::legacy::Client<_, Full<Bytes>> =
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .build(hyper_util::client::legacy::connect::HttpConnector::new());
    let resp = client.request(http::Request::get(url).body(Full::new(Bytes::new()))?).await?;
    let body = resp.into_body().collect().await?.to_bytes();
    let text = String::from_utf8_lossy(&body);
    text.lines()
        .find(|l| l.starts_with("kube_fence_lease_grants_total"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .map(|v| v as u64)
        .ok_or_else(|| anyhow::anyhow!("no kube_fence_lease_grants_total in the controller's metrics"))
}

/// Peak resident memory of a process, sampled every 200 ms while it runs.
struct Sampler {
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<u64>,
}

impl Sampler {
    fn start(pid: u32) -> Sampler {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let task = tokio::spawn(async move {
            let mut peak = 0;
            while !flag.load(Ordering::Relaxed) {
                peak = peak.max(memory(pid).0);
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            peak
        });
        Sampler { stop, task }
    }
    async fn peak(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.unwrap_or(0)
    }
}

async fn scale(args: &Args, table: &mut Table, bench: &mut Bench, controller: &mut Proc, metrics_url: &str) -> anyhow::Result<()> {
    let n = args.leases();
    let churners = args.churners.max(1);
    let api: Api<Lease> = Api::namespaced(bench.client.clone(), &bench.ns_lease);
    let (controller_idle, webhook_idle) = (memory(controller.pid()).0, memory(bench.webhook.pid()).0);
    eprintln!("[5] scale: {n} leases, {churners} clients churning for {} s", args.churn_secs());
    let (controller_peak, webhook_peak) = (Sampler::start(controller.pid()), Sampler::start(bench.webhook.pid()));

    let created = Instant::now();
    let tasks: Vec<_> = (0..churners)
        .map(|w| {
            let api = api.clone();
            tokio::spawn(async move {
                for i in (w..n).step_by(churners) {
                    api.create(&PostParams::default(), &Lease::new(&format!("s-{i:05}"), LeaseSpec::default())).await?;
                }
                anyhow::Ok(())
            })
        })
        .collect();
    for t in tasks {
        t.await??;
    }
    let created = created.elapsed();
    eprintln!("    created {n} leases in {created:.1?}");

    let (grants_before, cpu_before, started) = (grants(metrics_url).await?, cpu(controller.pid()), Instant::now());
    let deadline = started + Duration::from_secs_f64(args.churn_secs());
    let tasks: Vec<_> = (0..churners)
        .map(|w| {
            let api = api.clone();
            tokio::spawn(async move {
                let mine: Vec<String> = (w..n).step_by(churners).map(|i| format!("s-{i:05}")).collect();
                let mut claimed = vec![false; mine.len()];
                let (mut writes, mut busy, mut round) = (0u64, 0u64, 0u64);
                'churn: loop {
                    for (j, name) in mine.iter().enumerate() {
                        if Instant::now() >= deadline {
                            break 'churn;
                        }
                        // Claim (a new holder) or release (clear the holder), alternately.
                        let holder = if claimed[j] { serde_json::Value::Null } else { json!(format!("w{w}-{round}")) };
                        match api.patch(name, &PatchParams::default(), &Patch::Merge(&json!({"spec": {"holder": holder}}))).await {
                            Ok(_) => {
                                claimed[j] = !claimed[j];
                                writes += 1;
                            }
                            // Still held by the previous holder (the release not judged yet): the
                            // CEL rule refuses the claim; come back next round.
                            Err(kube::Error::Api(e)) if e.code == 422 => busy += 1,
                            Err(e) => return Err(anyhow::Error::from(e)),
                        }
                    }
                    round += 1;
                }
                anyhow::Ok((writes, busy))
            })
        })
        .collect();
    let (mut writes, mut busy) = (0, 0);
    for t in tasks {
        let (w, b) = t.await??;
        writes += w;
        busy += b;
    }
    let churned = started.elapsed();
    // Let the controller finish the writes already made before reading its counter.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (granted, controller_cpu) = (grants(metrics_url).await? - grants_before, cpu(controller.pid()) - cpu_before);
    let (controller_peak, webhook_peak) = (controller_peak.peak().await, webhook_peak.peak().await);
    let (controller_now, webhook_now) = (memory(controller.pid()).0, memory(bench.webhook.pid()).0);
    let cached = api.list_metadata(&Default::default()).await?.items.len();
    eprintln!(
        "    {writes} client writes, {busy} claims refused while still held, {granted} grants in {churned:.1?}; {cached} leases exist"
    );

    table.add(
        "5",
        format!("{n} leases, {churners} clients churning {:.0} s: grants/s", churned.as_secs_f64()),
        rate(granted as f64 / churned.as_secs_f64(), "grants"),
        format!("client writes {}", rate(writes as f64 / churned.as_secs_f64(), "w")),
        "",
        "",
        Met::Info,
    );
    table.add("5", "… controller CPU per grant", ms(controller_cpu / granted.max(1) as u32), "", "", "", Met::Info);
    table.add(
        "5",
        format!("… controller resident memory, peak (idle {})", mib(controller_idle)),
        mib(controller_peak),
        format!("after: {}", mib(controller_now)),
        "",
        "≤ 64 MiB",
        met(controller_peak <= 64 << 20),
    );
    table.add(
        "5",
        format!("… webhook resident memory, peak (idle {})", mib(webhook_idle)),
        mib(webhook_peak),
        format!("after: {}", mib(webhook_now)),
        "",
        "≤ 32 MiB",
        met(webhook_peak <= 32 << 20),
    );
    Ok(())
}
