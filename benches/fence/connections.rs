//! Section 7 (`--only connections`): the webhook port under a flood of idle connections (issue
//! 24). A fresh `kube-fence webhook` process with the default connection bounds
//! (`--max-connections`, `--max-connections-per-source`) is registered for the bench namespace;
//! guarded ConfigMap updates, judged by the API server through it, are timed (interleaved with
//! unguarded ones, which show what the machine alone does to a write) at rest, while
//! `--connections` idle HTTP/2-by-prior-knowledge connections are held against its port, while
//! as many idle TLS connections are held, and after they are gone. Each phase reports the
//! webhook's resident memory (peak and at the end), its open descriptors and connections, its CPU
//! and the attackers', and how many attack connections the webhook let in or refused.
//!
//! The attackers are separate processes (this binary, `--attack SPEC`), so each holds its share
//! of the connections within its own descriptor limit and their CPU is counted apart. They come
//! from 40 loopback addresses (127.0.0.2–127.0.0.41, the source bound before connect), and every
//! connection, once refused or closed by the webhook, is opened again a second later: the flood
//! lasts as long as the phase. It measures and reports; it asserts nothing.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, PostParams};
use kube_fence::admission::registration::{Endpoint, Registration};
use kube_fence_api::Lease;
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;

use crate::cluster::{Bench, Proc, cpu, memory, meta, set_issued, spawn_webhook, updates};
use crate::decision::{ISSUED, LEASE};
use crate::report::{Met, Samples, Table, mib, ms};
use crate::{Args, common, load};

/// Loopback source addresses the attack comes from.
const SOURCES: u8 = 40;
/// Attacker processes (each holds its share of the connections).
const ATTACKERS: usize = 2;
/// How long an attack connection waits before it is opened again, once refused or closed.
const REOPEN_AFTER: Duration = Duration::from_secs(1);

/// What an idle attack connection does once its TLS handshake is done.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Kind {
    /// Sends the HTTP/2 connection preface and an empty SETTINGS frame (prior knowledge, no
    /// ALPN), then nothing.
    Http2,
    /// Sends nothing.
    Tls,
}

impl Kind {
    fn label(self) -> &'static str {
        match self {
            Kind::Http2 => "idle HTTP/2 (prior knowledge)",
            Kind::Tls => "idle TLS",
        }
    }
}

/// One attacker process's orders (`--attack`, JSON).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Spec {
    pub kind: Kind,
    pub target: SocketAddr,
    pub ca_file: PathBuf,
    pub connections: usize,
    /// Its sources: 127.0.0.<first_source> and the next `sources - 1`.
    pub first_source: u8,
    pub sources: u8,
    /// Where its [`Tally`] is written (atomically, every half second and on exit).
    pub tally_file: PathBuf,
}

/// What one attacker saw so far (its tally file, JSON).
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct Tally {
    /// Connections whose first attempt has ended (let in or refused).
    pub settled: u64,
    pub attempts: u64,
    /// TLS handshakes completed: the webhook gave the connection a place.
    pub admitted: u64,
    /// Closed before the handshake completed (no place), or the connect failed.
    pub refused: u64,
    /// Admitted, then closed by the webhook (its deadlines).
    pub closed: u64,
    /// Admitted and open now.
    pub open: u64,
    pub peak_open: u64,
}

impl Tally {
    fn add(self, o: Tally) -> Tally {
        Tally {
            settled: self.settled + o.settled,
            attempts: self.attempts + o.attempts,
            admitted: self.admitted + o.admitted,
            refused: self.refused + o.refused,
            closed: self.closed + o.closed,
            open: self.open + o.open,
            peak_open: self.peak_open + o.peak_open,
        }
    }

    fn since(self, before: Tally) -> Tally {
        Tally {
            attempts: self.attempts - before.attempts,
            admitted: self.admitted - before.admitted,
            refused: self.refused - before.refused,
            closed: self.closed - before.closed,
            ..self
        }
    }
}

#[derive(Default)]
struct Counters {
    settled: AtomicU64,
    attempts: AtomicU64,
    admitted: AtomicU64,
    refused: AtomicU64,
    closed: AtomicU64,
    open: AtomicU64,
    peak_open: AtomicU64,
}

impl Counters {
    fn tally(&self) -> Tally {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        Tally {
            settled: get(&self.settled),
            attempts: get(&self.attempts),
            admitted: get(&self.admitted),
            refused: get(&self.refused),
            closed: get(&self.closed),
            open: get(&self.open),
            peak_open: get(&self.peak_open),
        }
    }
}

/// Raises this process's soft limit on open descriptors to its hard limit; returns it.
fn raise_descriptor_limit() -> u64 {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let limit = getrlimit(Resource::Nofile);
    let _ = setrlimit(Resource::Nofile, Rlimit { current: limit.maximum, maximum: limit.maximum });
    getrlimit(Resource::Nofile).current.unwrap_or(u64::MAX)
}

/// The attacker process (`--attack SPEC`): holds `spec.connections` connections until its
/// standard input closes.
pub async fn attack(spec: &str) -> anyhow::Result<()> {
    use rustls::pki_types::pem::PemObject;
    let spec: Spec = serde_json::from_str(spec)?;
    raise_descriptor_limit();
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_file_iter(&spec.ca_file)? {
        roots.add(cert?)?;
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = tokio_rustls::TlsConnector::from(Arc::new(tls));
    let counters = Arc::new(Counters::default());
    let stop = CancellationToken::new();
    let slots: Vec<_> = (0..spec.connections)
        .map(|i| {
            let source = IpAddr::V4(Ipv4Addr::new(127, 0, 0, spec.first_source + (i % spec.sources as usize) as u8));
            tokio::spawn(hold(spec.kind, source, spec.target, connector.clone(), counters.clone(), stop.clone()))
        })
        .collect();
    let writer = {
        let (counters, path, stop) = (counters.clone(), spec.tally_file.clone(), stop.clone());
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                let _ = kube_fence::ready::write_atomically(&path, &serde_json::to_string(&counters.tally()).unwrap_or_default());
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };
    // Until the bench closes our standard input.
    let _ = tokio::task::spawn_blocking(|| std::io::Read::read_to_end(&mut std::io::stdin(), &mut Vec::new())).await;
    stop.cancel();
    for slot in slots {
        let _ = slot.await;
    }
    let _ = writer.await;
    kube_fence::ready::write_atomically(&spec.tally_file, &serde_json::to_string(&counters.tally())?)?;
    Ok(())
}

/// One attack connection, opened again [`REOPEN_AFTER`] each time it is refused or closed.
async fn hold(
    kind: Kind,
    source: IpAddr,
    target: SocketAddr,
    connector: tokio_rustls::TlsConnector,
    counters: Arc<Counters>,
    stop: CancellationToken,
) {
    let mut first = true;
    while !stop.is_cancelled() {
        counters.attempts.fetch_add(1, Ordering::Relaxed);
        let connected = async {
            let socket = tokio::net::TcpSocket::new_v4()?;
            socket.bind(SocketAddr::new(source, 0))?;
            let tcp = socket.connect(target).await?;
            let name = rustls::pki_types::ServerName::IpAddress(target.ip().into());
            tokio::time::timeout(Duration::from_secs(30), connector.connect(name, tcp)).await.map_err(std::io::Error::other)?
        };
        let outcome = tokio::select! {
            outcome = connected => outcome,
            _ = stop.cancelled() => return,
        };
        if first {
            counters.settled.fetch_add(1, Ordering::Relaxed);
            first = false;
        }
        match outcome {
            Err(_) => {
                counters.refused.fetch_add(1, Ordering::Relaxed);
            }
            Ok(mut tls) => {
                counters.admitted.fetch_add(1, Ordering::Relaxed);
                let open = counters.open.fetch_add(1, Ordering::Relaxed) + 1;
                counters.peak_open.fetch_max(open, Ordering::Relaxed);
                if kind == Kind::Http2 {
                    let mut preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
                    preface.extend_from_slice(&[0, 0, 0, 4, 0, 0, 0, 0, 0]); // SETTINGS, empty
                    let _ = tls.write_all(&preface).await;
                    let _ = tls.flush().await;
                }
                // Idle until the webhook closes it (whatever it answers is read and dropped).
                let mut buf = [0u8; 1024];
                let closed = async {
                    loop {
                        match tls.read(&mut buf).await {
                            Ok(0) | Err(_) => break,
                            Ok(_) => {}
                        }
                    }
                };
                tokio::select! {
                    _ = closed => { counters.closed.fetch_add(1, Ordering::Relaxed); }
                    _ = stop.cancelled() => {}
                }
                counters.open.fetch_sub(1, Ordering::Relaxed);
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(REOPEN_AFTER) => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// The attacker processes of one phase.
struct Attack {
    procs: Vec<(Child, Option<ChildStdin>, PathBuf)>,
}

impl Attack {
    fn start(kind: Kind, target: SocketAddr, ca_file: &Path, connections: usize, dir: &Path) -> anyhow::Result<Attack> {
        let mut procs = Vec::new();
        let per_source = SOURCES / ATTACKERS as u8;
        for a in 0..ATTACKERS {
            let tally_file = dir.join(format!("attack-{kind:?}-{a}.json"));
            let _ = std::fs::remove_file(&tally_file);
            let spec = Spec {
                kind,
                target,
                ca_file: ca_file.to_path_buf(),
                connections: connections / ATTACKERS + usize::from(a < connections % ATTACKERS),
                first_source: 2 + a as u8 * per_source,
                sources: per_source,
                tally_file: tally_file.clone(),
            };
            let log = std::fs::File::create(dir.join(format!("attack-{kind:?}-{a}.log")))?;
            let mut child = Command::new(std::env::current_exe()?)
                .args(["--attack", &serde_json::to_string(&spec)?])
                .stdin(Stdio::piped())
                .stdout(log.try_clone()?)
                .stderr(log)
                .spawn()?;
            let stdin = child.stdin.take();
            procs.push((child, stdin, tally_file));
        }
        Ok(Attack { procs })
    }

    fn tally(&self) -> Tally {
        self.procs
            .iter()
            .filter_map(|(_, _, file)| std::fs::read_to_string(file).ok())
            .filter_map(|text| serde_json::from_str::<Tally>(&text).ok())
            .fold(Tally::default(), Tally::add)
    }

    fn cpu(&self) -> Duration {
        self.procs.iter().map(|(child, _, _)| cpu(child.id())).sum()
    }

    /// Waits until every connection's first attempt has ended (at most 120 s).
    async fn settled(&mut self, connections: usize) -> anyhow::Result<Tally> {
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            for (child, _, _) in &mut self.procs {
                if let Some(status) = child.try_wait()? {
                    anyhow::bail!("an attacker exited ({status})");
                }
            }
            let tally = self.tally();
            if tally.settled as usize >= connections || Instant::now() > deadline {
                return Ok(tally);
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Closes the attackers' standard input and waits for them to close their connections.
    async fn stop(mut self) {
        for (_, stdin, _) in &mut self.procs {
            drop(stdin.take());
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        for (child, _, _) in &mut self.procs {
            while matches!(child.try_wait(), Ok(None)) && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Attack {
    fn drop(&mut self) {
        for (child, _, _) in &mut self.procs {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Open descriptors of `pid`.
fn descriptors(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

/// A sample of the webhook's /metrics: (open connections, refused per source, refused in all).
async fn webhook_connections(https: &load::Https, metrics_url: &str) -> (f64, f64, f64, f64) {
    let text = match load::request(https, http::Method::GET, metrics_url, Bytes::new()).await {
        Ok((200, body)) => String::from_utf8_lossy(&body).into_owned(),
        _ => return (f64::NAN, f64::NAN, f64::NAN, f64::NAN),
    };
    let value = |sample: &str| {
        text.lines().find(|l| l.starts_with(sample)).and_then(|l| l.split_whitespace().last()).and_then(|v| v.parse().ok()).unwrap_or(0.0)
    };
    (
        value("kube_fence_webhook_open_connections "),
        value("kube_fence_webhook_refused_connections_total{cause=\"per_source\"}"),
        value("kube_fence_webhook_refused_connections_total{cause=\"total\"}"),
        value("kube_fence_webhook_refused_connections_total{cause=\"failing\"}"),
    )
}

/// What one phase measured.
struct Phase {
    name: String,
    guarded: Samples,
    plain: Samples,
    rss_peak: u64,
    rss_end: u64,
    fds: usize,
    open: f64,
    webhook_cpu: Duration,
    attack_cpu: Duration,
    elapsed: Duration,
    attack: Option<Tally>,
    /// Connections the webhook refused at once: per source, in all, for their source's failures.
    refused_by_webhook: (f64, f64, f64),
    load: String,
}

/// The 1-minute load average, as `uptime` prints it.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg").ok().map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" ")).unwrap_or_default()
}

pub async fn run(args: &Args, table: &mut Table, bench: &mut Bench) -> anyhow::Result<()> {
    let connections = args.connections();
    let secs = args.connection_phase_secs();
    eprintln!("[7] the webhook port under {connections} idle connections ({ATTACKERS} attacker processes, {SOURCES} source addresses)");
    eprintln!("    descriptor limit of the bench (inherited by the webhook): {}", raise_descriptor_limit());
    // A fresh webhook process: its memory is this section's alone.
    let (mut webhook, port) =
        spawn_webhook(&bench.https, &bench.kubeconfig, bench.dir.path(), &bench.cert, &bench.key, &bench.ns_hook).await?;
    let target = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let mut registration =
        Registration::new(format!("kf-bench-conn-{}", bench.ns_hook), Endpoint::Url(format!("https://{target}/validate")));
    registration.ca_bundle = Some(bench.ca_pem.clone());
    registration.only_namespaces = Some(vec![bench.ns_hook.clone()]);
    registration.apply(&bench.client).await?;
    let result = phases(table, bench, &mut webhook, target, connections, secs).await;
    registration.remove(&bench.client).await?;
    webhook.alive()?;
    result
}

async fn phases(
    table: &mut Table,
    bench: &mut Bench,
    webhook: &mut Proc,
    target: SocketAddr,
    connections: usize,
    secs: f64,
) -> anyhow::Result<()> {
    let cms: Api<ConfigMap> = Api::namespaced(bench.client.clone(), &bench.ns_hook);
    let leases: Api<Lease> = Api::namespaced(bench.client.clone(), &bench.ns_hook);
    common::wait_fenced(&bench.client, &bench.ns_hook, &Default::default(), common::Fencing::Judged, Duration::from_secs(30)).await;
    // Tokens above any other section's: a guarded create presents the newest issued token, an
    // update one greater than the recorded, at most the newest issued.
    let first = ISSUED * 4;
    set_issued(&leases, first).await?;
    let data = Some([("seq".to_string(), "0".to_string())].into());
    for (name, lease) in [("conn-guarded-0", Some(LEASE)), ("conn-plain-0", None)] {
        let metadata = meta(name, lease, lease.map(|_| first));
        cms.create(&PostParams::default(), &ConfigMap { metadata, data: data.clone(), ..Default::default() }).await?;
    }
    set_issued(&leases, first * 2).await?;
    let tokens = Arc::new(AtomicU64::new(first + 1));
    let ca_file = bench.dir.path().join("ca.crt");
    std::fs::write(&ca_file, &bench.ca_pem)?;
    let metrics_url = format!("https://{target}/metrics");

    let mut results = Vec::new();
    results.push(measure("at rest", secs, &cms, &tokens, webhook, &bench.https, &metrics_url, None).await?);
    for kind in [Kind::Http2, Kind::Tls] {
        let mut attack = Attack::start(kind, target, &ca_file, connections, bench.dir.path())?;
        let ramp = Instant::now();
        let settled = attack.settled(connections).await?;
        eprintln!(
            "    {}: every connection tried once in {:.1?} ({} let in, {} refused; {} open now)",
            kind.label(),
            ramp.elapsed(),
            settled.admitted,
            settled.refused,
            settled.open
        );
        let phase =
            measure(&format!("{connections} {}", kind.label()), secs, &cms, &tokens, webhook, &bench.https, &metrics_url, Some(&attack))
                .await;
        attack.stop().await;
        results.push(phase?);
    }
    // After: the attack's connections gone from the webhook.
    let deadline = Instant::now() + Duration::from_secs(60);
    while webhook_connections(&bench.https, &metrics_url).await.0 > 8.0 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    results.push(measure("after", secs, &cms, &tokens, webhook, &bench.https, &metrics_url, None).await?);

    let rest = (results[0].guarded.p50(), results[0].guarded.p99());
    for p in &results {
        let attack = p.attack.map_or(String::new(), |t| {
            format!(
                "; attack: {} attempts, {} let in, {} refused, {} closed by the webhook, at most {} open",
                t.attempts, t.admitted, t.refused, t.closed, t.peak_open
            )
        });
        eprintln!(
            "    {}: {} guarded writes p50 {} p99 {} (unguarded p50 {} p99 {}); webhook RSS peak {} end {}, {} fds, {} connections open; \
             refused by the webhook per source {} / in all {} / failing {}; CPU webhook {:.1?} attackers {:.1?} in {:.1?}; load {}{attack}",
            p.name,
            p.guarded.len(),
            ms(p.guarded.p50()),
            ms(p.guarded.p99()),
            ms(p.plain.p50()),
            ms(p.plain.p99()),
            mib(p.rss_peak),
            mib(p.rss_end),
            p.fds,
            p.open,
            p.refused_by_webhook.0,
            p.refused_by_webhook.1,
            p.refused_by_webhook.2,
            p.webhook_cpu,
            p.attack_cpu,
            p.elapsed,
            p.load,
        );
        table.add(
            "7",
            format!("guarded update p50 / p99, {}", p.name),
            format!("{} / {}", ms(p.guarded.p50()), ms(p.guarded.p99())),
            format!("{} / {} unguarded", ms(p.plain.p50()), ms(p.plain.p99())),
            format!("{:.2}× p99 at rest", p.guarded.p99().as_secs_f64() / rest.1.as_secs_f64().max(1e-9)),
            "",
            Met::Info,
        );
        table.add(
            "7",
            format!("… webhook RSS peak / end, fds, {}", p.name),
            format!("{} / {}, {} fds", mib(p.rss_peak), mib(p.rss_end), p.fds),
            "256 MiB chart limit",
            "",
            "< 256 MiB",
            crate::report::met(p.rss_peak < 256 * 1024 * 1024),
        );
        if let Some(t) = p.attack {
            table.add(
                "7",
                format!("… attack connections, {}", p.name),
                format!("{} let in, {} refused, ≤ {} open at once", t.admitted, t.refused, t.peak_open),
                format!("{} attempts", t.attempts),
                "",
                "",
                Met::Info,
            );
        }
    }
    Ok(())
}

/// Guarded and unguarded updates, interleaved, for `secs`; the webhook's memory sampled
/// throughout.
#[allow(clippy::too_many_arguments)]
async fn measure(
    name: &str,
    secs: f64,
    cms: &Api<ConfigMap>,
    tokens: &Arc<AtomicU64>,
    webhook: &mut Proc,
    https: &load::Https,
    metrics_url: &str,
    attack: Option<&Attack>,
) -> anyhow::Result<Phase> {
    webhook.alive()?;
    let pid = webhook.pid();
    let (_, refused_source_before, refused_total_before, refused_failing_before) = webhook_connections(https, metrics_url).await;
    let tally_before = attack.map(Attack::tally);
    let (cpu_before, attack_cpu_before) = (cpu(pid), attack.map_or(Duration::ZERO, Attack::cpu));
    let peak = Arc::new(AtomicU64::new(memory(pid).0));
    let sampler = {
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                peak.fetch_max(memory(pid).0, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };
    let started = Instant::now();
    let (mut guarded, mut plain) = (Samples::default(), Samples::default());
    let mut fds = 0;
    while started.elapsed().as_secs_f64() < secs {
        guarded.extend(updates(cms, 1, 1, true, tokens, "conn-").await?.latency);
        plain.extend(updates(cms, 1, 1, false, tokens, "conn-").await?.latency);
        fds = fds.max(descriptors(pid));
    }
    let elapsed = started.elapsed();
    sampler.abort();
    let (open, refused_source, refused_total, refused_failing) = webhook_connections(https, metrics_url).await;
    let attack_tally = match (attack, tally_before) {
        (Some(a), Some(before)) => Some(a.tally().since(before)),
        _ => None,
    };
    Ok(Phase {
        name: name.to_string(),
        guarded,
        plain,
        rss_peak: peak.load(Ordering::Relaxed),
        rss_end: memory(pid).0,
        fds,
        open,
        webhook_cpu: cpu(pid) - cpu_before,
        attack_cpu: attack.map_or(Duration::ZERO, Attack::cpu) - attack_cpu_before,
        elapsed,
        attack: attack_tally,
        refused_by_webhook: (
            refused_source - refused_source_before,
            refused_total - refused_total_before,
            refused_failing - refused_failing_before,
        ),
        load: load_average(),
    })
}
