//! `kf-env`: the project's own local Kubernetes control plane, from the shell.
//!
//! ```text
//! kf-env build [--node]        build (or find cached) etcd, kube-apiserver, kube-controller-manager, kubectl, helm
//!                              (and the node's kubelet, kube-scheduler, kube-proxy) and print their directory
//! kf-env up [--foreground]     start one on loopback and print `export KUBECONFIG=...`
//! kf-env up --node             a whole single-node cluster (kubelet, containerd, kube-proxy,
//!                              kube-scheduler too) in a network namespace of its own; also
//!                              prints CONTAINERD_ADDRESS/CONTAINERD_NAMESPACE for `ctr images import`
//! kf-env up --ha             three etcd members and two kube-apiservers (+ kube-controller-manager),
//!                              each in a network namespace of its own (partitions for tests); prints
//!                              a kubeconfig per API server (KF_HA_KUBECONFIG_A/B) and the webhook ports
//! kf-env import IMAGE.tar      load an image tarball into the running node
//! kf-env env                   print the exports again
//! kf-env down                  stop it and remove its files
//! ```

use std::fs;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use kube_fence_testenv::ha::{HaCluster, HaOptions};
use kube_fence_testenv::{ControlPlane, Options, binaries_for, write_env, write_node_env};

/// A real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager) on loopback,
/// built from pinned Go modules. For kube-fence's tests and for trying kube-fence without a cluster.
#[derive(Parser)]
#[command(name = "kf-env", version)]
struct Cli {
    /// Where the running control plane keeps its state (certificates, etcd data, kubeconfig, logs).
    #[arg(long, global = true, env = "KUBE_FENCE_ENV_DIR", default_value_os_t = default_state_dir())]
    state_dir: PathBuf,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Build the control-plane binaries from pinned Go modules (cached by version) and print their directory.
    Build {
        /// Also the node's binaries (kubelet, kube-scheduler, kube-proxy), for `up --node`.
        #[arg(long)]
        node: bool,
    },
    /// Start a control plane and print shell exports (eval "$(kf-env up)").
    Up {
        /// Stay in the foreground; Ctrl-C stops everything and removes the state directory.
        #[arg(long)]
        foreground: bool,
        /// Leave out kube-controller-manager (no garbage collection or namespace deletion).
        #[arg(long)]
        no_controller_manager: bool,
        /// Run a real node: kubelet, containerd, kube-proxy and kube-scheduler as well, all in a
        /// network namespace with no route out, so Pods and Services run (needs root).
        #[arg(long, conflicts_with = "ha")]
        node: bool,
        /// The HA topology: etcd m1–m3 and kube-apiservers A and B (+ kube-controller-manager),
        /// each in a network namespace of its own joined by veth links (needs root).
        #[arg(long)]
        ha: bool,
    },
    /// Import an image tarball (docker-archive or OCI) into the running node's containerd.
    Import { tarball: PathBuf },
    /// Print shell exports for the running control plane.
    Env,
    /// Stop the control plane and remove its state directory.
    Down,
}

fn default_state_dir() -> PathBuf {
    std::env::temp_dir().join(format!("kube-fence-env-{}", current_uid()))
}

fn current_uid() -> u32 {
    use std::os::unix::fs::MetadataExt;
    fs::metadata("/proc/self").map(|m| m.uid()).unwrap_or(0)
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("kf-env: error: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    let dir = cli.state_dir;
    match cli.command {
        Cmd::Build { node } => {
            println!("{}", binaries_for(node)?.display());
            Ok(())
        }
        Cmd::Up { foreground: true, no_controller_manager, node: _, ha: true } => foreground_ha(&dir, !no_controller_manager),
        Cmd::Up { foreground: true, no_controller_manager, node, ha: false } => foreground(&dir, !no_controller_manager, node),
        Cmd::Up { foreground: false, no_controller_manager, node, ha } => background(&dir, !no_controller_manager, node, ha),
        Cmd::Env => {
            let kubeconfig = dir.join("kubeconfig");
            if !dir.join("ready").exists() {
                bail!("no control plane is running in {} (start one with `kf-env up`)", dir.display());
            }
            if let Ok(env) = fs::read_to_string(dir.join("ha.env")) {
                print!("{env}");
                return Ok(());
            }
            let bin_dir = PathBuf::from(fs::read_to_string(dir.join("bin-dir"))?.trim());
            match fs::read_to_string(dir.join("containerd-address")) {
                Ok(addr) => write_node_env(&mut std::io::stdout(), &kubeconfig, &bin_dir, Path::new(addr.trim()))?,
                Err(_) => write_env(&mut std::io::stdout(), &kubeconfig, &bin_dir)?,
            }
            Ok(())
        }
        Cmd::Import { tarball } => {
            let Ok(addr) = fs::read_to_string(dir.join("containerd-address")) else {
                bail!("no node is running in {} (start one with `kf-env up --node`)", dir.display());
            };
            let status = Command::new("ctr").args(["--address", addr.trim(), "-n", "k8s.io", "images", "import"]).arg(&tarball).status()?;
            if !status.success() {
                bail!("ctr images import {} failed ({status})", tarball.display());
            }
            Ok(())
        }
        Cmd::Down => down(&dir),
    }
}

/// Runs the control plane in this process until SIGINT/SIGTERM/SIGHUP.
fn foreground(dir: &Path, controller_manager: bool, node: bool) -> Result<()> {
    if dir.join("supervisor.pid").exists() && alive(&dir.join("supervisor.pid")) {
        bail!("a control plane is already running in {} (stop it with `kf-env down`)", dir.display());
    }
    if node {
        // Unmount what a killed node left in its state directory before removing it.
        kube_fence_testenv::node::cleanup_stale(true)?;
    }
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir)?;
    fs::write(dir.join("supervisor.pid"), std::process::id().to_string())?;
    // Block the stop signals in this thread (children get a clean mask from std's spawn) and
    // wait for one of them below.
    let set = stop_signals();
    // SAFETY: plain signal-mask calls on this thread.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    let bin_dir = binaries_for(node)?;
    let started = ControlPlane::start(Options {
        bin_dir: Some(bin_dir.clone()),
        state_dir: Some(dir.to_path_buf()),
        controller_manager,
        die_with_parent: true,
        verbose: true,
        node,
    });
    let mut cp = match started {
        Ok(cp) => cp,
        Err(e) => {
            let _ = fs::write(dir.join("failed"), format!("{e:#}"));
            return Err(e);
        }
    };
    fs::write(dir.join("bin-dir"), bin_dir.display().to_string())?;
    if let Some(addr) = &cp.containerd_address {
        fs::write(dir.join("containerd-address"), addr.display().to_string())?;
    }
    fs::write(dir.join("ready"), "")?;
    match &cp.containerd_address {
        Some(addr) => write_node_env(&mut std::io::stdout(), &cp.kubeconfig, &bin_dir, addr)?,
        None => write_env(&mut std::io::stdout(), &cp.kubeconfig, &bin_dir)?,
    }
    eprintln!("[control plane] running; stop with Ctrl-C or `kf-env down`");
    let mut sig: libc::c_int = 0;
    // SAFETY: sigwait on a set we blocked above.
    unsafe { libc::sigwait(&set, &mut sig) };
    eprintln!("[control plane] signal {sig}: stopping");
    cp.stop();
    drop(cp);
    fs::remove_dir_all(dir).ok();
    Ok(())
}

/// [`foreground`] for the HA topology.
fn foreground_ha(dir: &Path, controller_manager: bool) -> Result<()> {
    if dir.join("supervisor.pid").exists() && alive(&dir.join("supervisor.pid")) {
        bail!("a control plane is already running in {} (stop it with `kf-env down`)", dir.display());
    }
    kube_fence_testenv::ha::cleanup_stale(true)?;
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir)?;
    fs::write(dir.join("supervisor.pid"), std::process::id().to_string())?;
    let set = stop_signals();
    // SAFETY: plain signal-mask calls on this thread.
    unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    let options = HaOptions { bin_dir: Some(binaries_for(false)?), state_dir: Some(dir.to_path_buf()), controller_manager, verbose: true };
    let mut ha = match HaCluster::start(options) {
        Ok(ha) => ha,
        Err(e) => {
            let _ = fs::write(dir.join("failed"), format!("{e:#}"));
            return Err(e);
        }
    };
    let mut env = Vec::new();
    ha.write_env(&mut env)?;
    fs::write(dir.join("ha.env"), &env)?;
    fs::write(dir.join("ready"), "")?;
    print!("{}", String::from_utf8_lossy(&env));
    eprintln!("[ha] running; stop with Ctrl-C or `kf-env down`");
    let mut sig: libc::c_int = 0;
    // SAFETY: sigwait on a set we blocked above.
    unsafe { libc::sigwait(&set, &mut sig) };
    eprintln!("[ha] signal {sig}: stopping");
    ha.stop();
    drop(ha);
    fs::remove_dir_all(dir).ok();
    Ok(())
}

fn stop_signals() -> libc::sigset_t {
    // SAFETY: sigset manipulation on a local value.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGHUP);
        set
    }
}

/// Starts `kf-env up --foreground` detached (its own session) and waits until it is ready.
fn background(dir: &Path, controller_manager: bool, node: bool, ha: bool) -> Result<()> {
    if dir.join("ready").exists() && alive(&dir.join("supervisor.pid")) {
        eprintln!("[control plane] already running in {}", dir.display());
        return run(Cli { state_dir: dir.to_path_buf(), command: Cmd::Env });
    }
    // Check the machine and build first, in the foreground, so what is missing and the build's
    // progress show on this terminal.
    if node {
        kube_fence_testenv::node::prerequisites()?;
    }
    binaries_for(node)?;
    if node {
        kube_fence_testenv::node::cleanup_stale(true)?;
    }
    let _ = fs::remove_dir_all(dir);
    fs::create_dir_all(dir)?;
    let log_path = supervisor_log(dir);
    let log = fs::File::create(&log_path)?;
    let mut cmd = Command::new(std::env::current_exe()?);
    cmd.arg("--state-dir").arg(dir).args(["up", "--foreground"]);
    if !controller_manager {
        cmd.arg("--no-controller-manager");
    }
    if node {
        cmd.arg("--node");
    }
    if ha {
        kube_fence_testenv::ha::cleanup_stale(true)?;
        cmd.arg("--ha");
    }
    cmd.stdin(Stdio::null()).stdout(Stdio::null()).stderr(log);
    // SAFETY: setsid is async-signal-safe; detaches the supervisor from this terminal.
    unsafe {
        cmd.pre_exec(|| {
            libc::setsid();
            Ok(())
        });
    }
    let mut child = cmd.spawn().context("starting the supervisor")?;
    let start = Instant::now();
    loop {
        if dir.join("ready").exists() {
            break;
        }
        if let Some(status) = child.try_wait()? {
            let why = fs::read_to_string(dir.join("failed")).unwrap_or_else(|_| fs::read_to_string(&log_path).unwrap_or_default());
            bail!("the control plane did not start ({status}):\n{why}");
        }
        if start.elapsed() > Duration::from_secs(300) {
            bail!("the control plane was not ready after 300 s; see {}", log_path.display());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!("[control plane] running in {} (supervisor log: {}); stop with `kf-env down`", dir.display(), log_path.display());
    run(Cli { state_dir: dir.to_path_buf(), command: Cmd::Env })
}

/// Next to the state directory (which the supervisor empties on start); `down` removes it.
fn supervisor_log(dir: &Path) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(".supervisor.log");
    dir.with_file_name(name)
}

fn alive(pid_file: &Path) -> bool {
    pid(pid_file).is_some_and(|pid| unsafe { libc::kill(pid, 0) } == 0)
}

/// The supervisor's pid from its pid file, if that process is still a kf-env. A supervisor that
/// was killed leaves its pid file behind, and on a busy machine its pid soon belongs to another
/// program (pid_max is often 32768): `down` must never signal, or wait for, that one.
fn pid(pid_file: &Path) -> Option<i32> {
    let pid: i32 = fs::read_to_string(pid_file).ok()?.trim().parse().ok()?;
    is_kf_env(pid).then_some(pid)
}

/// Whether process `pid` runs a program with kf-env's file name (`/proc/<pid>/exe`; a rebuilt
/// binary reads "kf-env (deleted)").
fn is_kf_env(pid: i32) -> bool {
    let name_of = |path: &Path| path.file_name().map(|n| n.to_string_lossy().trim_end_matches(" (deleted)").to_string());
    let ours = std::env::current_exe().ok().and_then(|p| name_of(&p));
    let theirs = fs::read_link(format!("/proc/{pid}/exe")).ok().and_then(|p| name_of(&p));
    ours.is_some() && ours == theirs
}

fn down(dir: &Path) -> Result<()> {
    // A dead supervisor's node still has mounts in the state directory: undo it before anything
    // removes that directory. (Does nothing while a live node holds the lock.)
    let problems = kube_fence_testenv::node::cleanup_stale(true)?;
    if !problems.is_empty() {
        bail!("could not undo everything the node changed: {}", problems.join("; "));
    }
    let result = down_supervisor(dir);
    // An HA control plane whose supervisor was killed left its namespaces behind.
    kube_fence_testenv::ha::cleanup_stale(true)?;
    if result.is_ok() {
        let _ = fs::remove_file(supervisor_log(dir));
    }
    // A node whose supervisor was killed (SIGKILL) left its namespace, mounts and host settings
    // behind: undo them from the record it wrote.
    let problems = kube_fence_testenv::node::cleanup_stale(true)?;
    if !problems.is_empty() {
        bail!("could not undo everything the node changed: {}", problems.join("; "));
    }
    result
}

fn down_supervisor(dir: &Path) -> Result<()> {
    let Some(pid) = pid(&dir.join("supervisor.pid")) else {
        eprintln!("[control plane] none running in {}", dir.display());
        let _ = fs::remove_dir_all(dir);
        return Ok(());
    };
    // SAFETY: kill(2) with a pid read from our own pid file.
    if unsafe { libc::kill(pid, libc::SIGTERM) } == 0 {
        let start = Instant::now();
        while unsafe { libc::kill(pid, 0) } == 0 {
            if start.elapsed() > Duration::from_secs(60) {
                bail!("supervisor {pid} did not stop within 60 s");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let _ = fs::remove_dir_all(dir);
    eprintln!("[control plane] stopped");
    Ok(())
}
