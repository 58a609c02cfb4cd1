//! `cargo bench --bench fence` (or `hack/bench.sh`): how close kube-fence runs to its limits.
//!
//! Measures side by side in one run and prints one table of ratios (issue 9):
//! 1. the admission decision in-process (parse → facts → decision → response JSON);
//! 2. the webhook over HTTPS on loopback vs a no-op axum+rustls server (the limit);
//! 3. guarded vs unguarded ConfigMap updates through the real API server;
//!    3p. the webhook path vs the policy path vs unguarded, with the API server's CPU per write;
//! 4. lease acquire latency vs two raw API server writes, and takeover delay vs lease duration;
//! 5. many leases churning: grants/s and the controller's and webhook's resident memory;
//! 6. holder-only `/status` writes vs the same writes to an unlabelled object (`holder.rs`);
//! 7. the webhook port under 20,000 idle HTTP/2 and then TLS connections: guarded-write latency,
//!    the webhook's memory and descriptors, connections let in and refused (`connections.rs`).
//!
//! It measures and reports; it never asserts a timing. Run without `--bench` (as
//! `cargo test --all-targets` does) it only smoke-tests the in-process path and exits.
//! The controller and the webhook run as separate `kube-fence` processes (the binary of the same
//! profile: release under `cargo bench`), so their memory can be read from /proc.

mod cluster;
mod connections;
mod decision;
mod holder;
mod load;
mod policy;
mod report;

use clap::Parser;

use report::Table;

/// The cluster the benchmark shares with nothing else (kube-fence-testenv: `KUBECONFIG`, else a
/// local control plane) and the helpers kube-fence's tests use (kube-fence-test-support).
mod common {
    pub use kube_fence_test_support::*;

    /// The benchmark's cluster's kubeconfig (off the async runtime: the first call may start a
    /// control plane).
    pub async fn kubeconfig() -> std::path::PathBuf {
        tokio::task::spawn_blocking(kube_fence_testenv::shared_kubeconfig).await.expect("control plane thread")
    }

    /// A client for the benchmark's cluster, with kube-fence's CRDs installed.
    pub async fn client() -> kube::Client {
        kube_fence_test_support::client(&kubeconfig().await).await
    }
}

/// Bench sizes. `--quick` picks small ones (a few minutes in all); each can be set.
#[derive(Debug, Clone, Parser)]
#[command(name = "fence-bench")]
pub struct Args {
    /// Passed by `cargo bench`; without it only a smoke test runs (what `cargo test` does).
    #[arg(long)]
    bench: bool,
    /// Small sizes: finishes in a few minutes.
    #[arg(long)]
    quick: bool,
    /// Sections to run (decision, webhook, apiserver, policy, acquire, scale, holder,
    /// connections; `fenced`: the writer fence's rows of apiserver alone); default all.
    #[arg(long, value_delimiter = ',')]
    pub only: Vec<String>,
    /// Seconds per object size for the in-process decision.
    #[arg(long)]
    decision_secs: Option<f64>,
    /// Concurrent HTTPS connections of the load generator.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Seconds per server and object size for the HTTPS load (also bounded by --requests).
    #[arg(long)]
    webhook_secs: Option<f64>,
    /// At most this many requests per server and object size.
    #[arg(long)]
    requests: Option<usize>,
    /// ConfigMap updates per kind (guarded, unguarded) through the API server.
    #[arg(long)]
    updates: Option<usize>,
    /// Concurrent writers for the API server throughput comparison.
    #[arg(long, default_value_t = 8)]
    writers: usize,
    /// Lease acquisitions (and raw two-write pairs) to time.
    #[arg(long)]
    acquires: Option<usize>,
    /// Takeover samples (run at the same time, each on its own lease).
    #[arg(long)]
    takeovers: Option<usize>,
    /// Lease duration for the takeover samples, seconds.
    #[arg(long, default_value_t = 2)]
    takeover_lease_secs: u32,
    /// Leases in the scale test.
    #[arg(long)]
    leases: Option<usize>,
    /// Seconds of churn in the scale test.
    #[arg(long)]
    churn_secs: Option<f64>,
    /// Concurrent churning clients in the scale test.
    #[arg(long, default_value_t = 32)]
    churners: usize,
    /// Section 3p: also take a CPU profile of the kube-apiserver (its /debug/pprof, 10 s) under
    /// each kind of write with --writers writers, into this directory (read with `go tool pprof`).
    #[arg(long, value_name = "DIR")]
    profile_apiserver: Option<std::path::PathBuf>,
    /// Idle connections held against the webhook port in section 6 (each kind in turn).
    #[arg(long)]
    connections: Option<usize>,
    /// Seconds of guarded writes per phase of section 6.
    #[arg(long)]
    connection_phase_secs: Option<f64>,
    /// Internal: an attacker process of section 6 (its orders, JSON).
    #[arg(long, value_name = "SPEC", hide = true)]
    attack: Option<String>,
    /// Internal: serve the no-op webhook (the limit) on this address, with these PEM files; its
    /// address goes to the ready file once bound.
    #[arg(long, num_args = 4, value_names = ["ADDR", "CERT", "KEY", "READY_FILE"], hide = true)]
    noop_server: Option<Vec<String>>,
}

impl Args {
    fn runs(&self, section: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|s| s == section)
    }
    fn pick<T: Copy>(&self, given: Option<T>, quick: T, full: T) -> T {
        given.unwrap_or(if self.quick { quick } else { full })
    }
    pub fn decision_secs(&self) -> f64 {
        self.pick(self.decision_secs, 1.0, 3.0)
    }
    pub fn webhook_secs(&self) -> f64 {
        self.pick(self.webhook_secs, 3.0, 10.0)
    }
    pub fn requests(&self) -> usize {
        self.pick(self.requests, 5_000, 50_000)
    }
    pub fn updates(&self) -> usize {
        self.pick(self.updates, 400, 3_000)
    }
    pub fn acquires(&self) -> usize {
        self.pick(self.acquires, 30, 200)
    }
    pub fn takeovers(&self) -> usize {
        self.pick(self.takeovers, 3, 8)
    }
    pub fn leases(&self) -> usize {
        self.pick(self.leases, 1_000, 10_000)
    }
    pub fn churn_secs(&self) -> f64 {
        self.pick(self.churn_secs, 15.0, 60.0)
    }
    pub fn connections(&self) -> usize {
        self.pick(self.connections, 5_000, 20_000)
    }
    pub fn connection_phase_secs(&self) -> f64 {
        self.pick(self.connection_phase_secs, 10.0, 20.0)
    }
}

fn main() -> anyhow::Result<()> {
    let raw: Vec<String> = std::env::args().collect();
    if !raw.iter().any(|a| a == "--bench" || a == "--noop-server" || a == "--attack" || a == "--help") {
        // `cargo test --all-targets` runs this binary (with whatever test arguments it was
        // given): check that the measured path works, measure nothing.
        decision::smoke()?;
        eprintln!("fence bench: smoke test passed (run `hack/bench.sh` or `cargo bench --bench fence` to measure)");
        return Ok(());
    }
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    if let Some(noop) = &args.noop_server {
        return runtime.block_on(load::serve_noop(noop));
    }
    if let Some(spec) = &args.attack {
        return runtime.block_on(connections::attack(spec));
    }
    let mut table = Table::default();
    print_machine();
    if args.runs("decision") {
        decision::run(&args, &mut table)?;
    }
    let needs_cluster =
        ["webhook", "apiserver", "fenced", "policy", "acquire", "scale", "holder", "connections"].iter().any(|s| args.runs(s));
    if needs_cluster {
        runtime.block_on(cluster::run(&args, &mut table))?;
    }
    println!();
    println!("## kube-fence benchmark{}", if args.quick { " (quick)" } else { "" });
    println!();
    table.print();
    Ok(())
}

fn print_machine() {
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(0);
    let model = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| c.lines().find(|l| l.starts_with("model name")).and_then(|l| l.split(':').nth(1)).map(|s| s.trim().to_string()))
        .unwrap_or_default();
    let mem = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| m.lines().next().and_then(|l| l.split_whitespace().nth(1)).and_then(|kb| kb.parse::<u64>().ok()))
        .map(|kb| kb / 1024 / 1024)
        .unwrap_or(0);
    eprintln!("machine: {cores} cores ({model}), {mem} GiB memory");
}
