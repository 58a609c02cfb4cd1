//! The node's network namespace: creating it (the topology in the module docs), the one-node
//! lock, running commands and components inside it, and finding the processes that live in it.

use std::collections::BTreeSet;
use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use anyhow::{Context, Result};

use super::{NETNS, NODE_IP, SERVICE_CIDR, run, teardown};
use crate::{ControlPlane, Options};

/// An abstract unix socket bound by the process that runs the node: one node per machine, since
/// the namespace name, the node IP and the cgroup root are fixed. The kernel releases it when
/// that process dies, and it leaves no file behind.
const LOCK_NAME: &[u8] = b"kube-fence-node.lock";

pub(crate) fn ip(args: &[&str]) -> Result<()> {
    run(Command::new("ip").args(args))
}

/// Takes the one-node lock; fails when another node runs on this machine.
pub(super) fn lock() -> Result<std::os::unix::net::UnixListener> {
    lock_named(LOCK_NAME, "kube-fence node")
}

/// Takes the machine-wide lock `name` (an abstract unix socket: released by the kernel when the
/// holder dies, no file left behind); fails when another process holds it. `what` names the
/// thing the lock guards, for the error.
pub(crate) fn lock_named(name: &[u8], what: &str) -> Result<std::os::unix::net::UnixListener> {
    use std::os::linux::net::SocketAddrExt as _;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(name)?;
    std::os::unix::net::UnixListener::bind_addr(&addr).map_err(|e| {
        anyhow::anyhow!(
            "another {what} is running on this machine (it holds the abstract socket @{}: {e}); stop it first with `kf-env down`",
            String::from_utf8_lossy(name)
        )
    })
}

/// Makes `cmd` enter the network namespace open as `fd` between fork and exec.
pub(crate) fn enter_on_exec(cmd: &mut Command, fd: std::os::fd::RawFd) {
    // SAFETY: setns(2) is async-signal-safe; the descriptor stays open across fork.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Creates the namespace with its node IP and Service route, and no route out; returns it open.
pub(super) fn create() -> Result<fs::File> {
    let ns = NETNS;
    ip(&["netns", "add", ns]).context("creating the node's network namespace")?;
    let netns = fs::File::open(Path::new("/run/netns").join(ns))?;
    ip(&["-n", ns, "link", "set", "lo", "up"])?;
    // No dummy driver on every kernel: a bridge without ports holds the node IP as well.
    ip(&["-n", ns, "link", "add", "kfn0", "type", "bridge"])?;
    ip(&["-n", ns, "addr", "add", &format!("{NODE_IP}/32"), "dev", "kfn0"])?;
    ip(&["-n", ns, "link", "set", "kfn0", "up"])?;
    ip(&["-n", ns, "route", "add", SERVICE_CIDR, "dev", "kfn0"])?;
    Ok(netns)
}

/// PIDs of every process in the node's network namespace (components, shims, hostNetwork pods).
pub fn netns_pids() -> BTreeSet<u32> {
    pids_in(NETNS)
}

/// PIDs of every process (but this one) in the named network namespace (`/run/netns/<ns>`).
pub(crate) fn pids_in(ns: &str) -> BTreeSet<u32> {
    let Ok(ns) = fs::metadata(Path::new("/run/netns").join(ns)) else { return BTreeSet::new() };
    let (dev, ino) = (ns.dev(), ns.ino());
    let me = std::process::id();
    let mut pids = BTreeSet::new();
    if let Ok(rd) = fs::read_dir("/proc") {
        for e in rd.filter_map(|e| e.ok()) {
            let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else { continue };
            if pid == me {
                continue;
            }
            if let Ok(m) = fs::metadata(e.path().join("ns/net"))
                && m.ino() == ino
                && m.dev() == dev
            {
                pids.insert(pid);
            }
        }
    }
    pids
}

impl ControlPlane {
    /// Runs a command inside the node's network namespace; true when it succeeds.
    pub fn in_netns(&self, cmd: &mut Command) -> bool {
        let Some(node) = &self.node else { return false };
        let fd = node.netns.as_raw_fd();
        // SAFETY: setns(2) is async-signal-safe; the descriptor stays open across fork.
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(fd, libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd.stdout(Stdio::null()).stderr(Stdio::null()).status().map(|s| s.success()).unwrap_or(false)
    }

    /// Starts a node component in a process group of its own (so teardown can stop the whole
    /// group), inside the namespace when `in_netns`.
    pub(super) fn spawn_node(&mut self, opts: &Options, name: &'static str, cmd: &mut Command, in_netns: bool) -> Result<()> {
        let fd = match (&self.node, in_netns) {
            (Some(n), true) => Some(n.netns.as_raw_fd()),
            _ => None,
        };
        // SAFETY: setpgid, sigprocmask, signal and setns are async-signal-safe; the descriptor
        // stays open across fork.
        unsafe {
            cmd.pre_exec(move || {
                // Own process group: socat's per-connection children are stopped with it.
                libc::setpgid(0, 0);
                // kf-env's supervisor blocks SIGINT/SIGTERM/SIGHUP to sigwait for them, and a
                // blocked mask survives exec: socat would then ignore our SIGTERM until killed.
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
                libc::signal(libc::SIGPIPE, libc::SIG_DFL);
                if let Some(fd) = fd
                    && libc::setns(fd, libc::CLONE_NEWNET) != 0
                {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        self.spawn(opts, name, cmd)?;
        if let Some(c) = self.components.last() {
            teardown::add_active_pgid(c.child.id());
        }
        Ok(())
    }
}
