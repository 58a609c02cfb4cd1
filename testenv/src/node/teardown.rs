//! Undoing a node: what it changes on the host is recorded before it changes anything (in
//! memory and in [`RECORD_FILE`]), and [`teardown`] undoes it all — on stop, on Ctrl-C (the
//! signal handler below), and after the process that ran the node died ([`cleanup_stale`]).

use std::collections::BTreeSet;
use std::fs;
use std::io::Read as _;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::Result;

use super::cgroups::{cgroup_leftovers, cgroup_pids};
use super::netns::{self, ip, netns_pids};
use super::{HOST_PATHS, HOST_SYSCTLS, NETNS};

/// What to undo, written before anything is changed; read by a later start or `kf-env down`
/// when the process that ran the node died without cleaning up (SIGKILL).
const RECORD_FILE: &str = "/run/kube-fence-node.record";

/// Everything teardown needs, kept in memory and in [`RECORD_FILE`].
#[derive(Clone, Debug, Default)]
pub(crate) struct Record {
    state_dir: PathBuf,
    sysctls: Vec<(String, String)>,
    absent_paths: Vec<PathBuf>,
}

impl Record {
    fn to_text(&self) -> String {
        let mut s = format!("state_dir={}\n", self.state_dir.display());
        for (k, v) in &self.sysctls {
            s += &format!("sysctl {k}={v}\n");
        }
        for p in &self.absent_paths {
            s += &format!("absent={}\n", p.display());
        }
        s
    }

    fn from_text(text: &str) -> Record {
        let mut r = Record::default();
        for line in text.lines() {
            if let Some(v) = line.strip_prefix("state_dir=") {
                r.state_dir = PathBuf::from(v);
            } else if let Some(kv) = line.strip_prefix("sysctl ") {
                if let Some((k, v)) = kv.split_once('=') {
                    r.sysctls.push((k.to_string(), v.to_string()));
                }
            } else if let Some(v) = line.strip_prefix("absent=") {
                r.absent_paths.push(PathBuf::from(v));
            }
        }
        r
    }
}

/// Records what the node is about to change (the host sysctls, which host paths are absent),
/// before it changes anything; from here on stop, Ctrl-C and a later start undo it.
pub(super) fn record_host_state(state_dir: &Path) -> Result<()> {
    let record = Record {
        state_dir: state_dir.to_path_buf(),
        sysctls: host_sysctls(),
        absent_paths: HOST_PATHS.iter().map(PathBuf::from).filter(|p| fs::symlink_metadata(p).is_err()).collect(),
    };
    fs::write(RECORD_FILE, record.to_text())?;
    set_active(Some(Active { record, pgids: Vec::new() }));
    Ok(())
}

fn sysctl_path(name: &str) -> PathBuf {
    Path::new("/proc/sys").join(name.replace('.', "/"))
}

/// Current values of [`HOST_SYSCTLS`] (those this kernel has).
pub fn host_sysctls() -> Vec<(String, String)> {
    HOST_SYSCTLS.iter().filter_map(|k| fs::read_to_string(sysctl_path(k)).ok().map(|v| (k.to_string(), v.trim().to_string()))).collect()
}

/// Cleans up after a node whose process died without tearing it down (SIGKILL, power loss of
/// the process). Does nothing when no such node is recorded. Fails if a live node holds the lock.
pub fn cleanup_stale(verbose: bool) -> Result<Vec<String>> {
    let record = fs::read_to_string(RECORD_FILE).ok();
    if record.is_none() && !Path::new("/run/netns").join(NETNS).exists() {
        return Ok(Vec::new());
    }
    // A live node holds the lock: nothing is stale.
    let Ok(_lock) = netns::lock() else { return Ok(Vec::new()) };
    let Some(text) = record else {
        return Ok(teardown(&Record::default(), verbose));
    };
    let record = Record::from_text(&text);
    if verbose {
        eprintln!("[node] cleaning up a node left behind by a process that died (state {})", record.state_dir.display());
    }
    Ok(teardown(&record, verbose))
}

/// Mount points under `dir` (from /proc/self/mountinfo), deepest first.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let Ok(text) = fs::read_to_string("/proc/self/mountinfo") else { return Vec::new() };
    let mut v: Vec<PathBuf> =
        text.lines().filter_map(|l| l.split(' ').nth(4)).map(unescape_mount).map(PathBuf::from).filter(|p| p.starts_with(dir)).collect();
    v.sort_by_key(|p| std::cmp::Reverse(p.as_os_str().len()));
    v.dedup();
    v
}

fn unescape_mount(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn kill_all(pids: &BTreeSet<u32>) {
    for pid in pids {
        // SAFETY: kill(2); these are processes the node started (found in its netns or cgroups).
        unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
    }
}

/// Undoes everything a node did. Idempotent; returns what could not be undone.
pub(crate) fn teardown(record: &Record, verbose: bool) -> Vec<String> {
    let mut problems = Vec::new();
    // 1. Processes: pods and runc (by cgroup), shims and components (by network namespace).
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let mut pids = cgroup_pids();
        pids.extend(netns_pids());
        if pids.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            problems.push(format!("processes still running after SIGKILL: {pids:?}"));
            break;
        }
        kill_all(&pids);
        std::thread::sleep(Duration::from_millis(100));
    }
    // 2. Mounts: overlay rootfs, pod volumes (tmpfs), pod network namespace files.
    if !record.state_dir.as_os_str().is_empty() {
        for attempt in 0..5 {
            let mounts = mounts_under(&record.state_dir);
            if mounts.is_empty() {
                break;
            }
            for m in &mounts {
                if let Ok(c) = std::ffi::CString::new(m.as_os_str().as_encoded_bytes()) {
                    // SAFETY: umount2(2) on a NUL-terminated path under our state directory.
                    unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
                }
            }
            if attempt == 4 && !mounts_under(&record.state_dir).is_empty() {
                problems.push(format!("mounts left: {:?}", mounts_under(&record.state_dir)));
            }
        }
    }
    // 3. cgroups, deepest first (they are empty now).
    for d in cgroup_leftovers() {
        if let Err(e) = fs::remove_dir(&d)
            && d.exists()
        {
            problems.push(format!("cgroup {}: {e}", d.display()));
        }
    }
    // 4. The network namespace (its bridges and iptables rules go with it).
    if Path::new("/run/netns").join(NETNS).exists()
        && let Err(e) = ip(&["netns", "del", NETNS])
    {
        problems.push(format!("{e:#}"));
    }
    // 5. Host settings the kubelet changed.
    for (k, v) in &record.sysctls {
        let path = sysctl_path(k);
        if fs::read_to_string(&path).map(|now| now.trim() != v).unwrap_or(false) {
            if let Err(e) = fs::write(&path, v) {
                problems.push(format!("restoring {k}={v}: {e}"));
            } else if verbose {
                eprintln!("[node] restored {k}={v}");
            }
        }
    }
    // 6. Host paths created while the node ran.
    for p in &record.absent_paths {
        if let Ok(m) = fs::symlink_metadata(p) {
            let r = if m.is_dir() { fs::remove_dir_all(p) } else { fs::remove_file(p) };
            if let Err(e) = r {
                problems.push(format!("removing {}: {e}", p.display()));
            }
        }
    }
    // 7. The state directory, now that nothing is mounted in it.
    if !record.state_dir.as_os_str().is_empty()
        && record.state_dir.exists()
        && mounts_under(&record.state_dir).is_empty()
        && let Err(e) = fs::remove_dir_all(&record.state_dir)
    {
        problems.push(format!("removing {}: {e}", record.state_dir.display()));
    }
    if problems.is_empty() {
        let _ = fs::remove_file(RECORD_FILE);
    } else if verbose {
        eprintln!("[node] teardown incomplete: {}", problems.join("; "));
    }
    problems
}

// ---- Ctrl-C: a node must be torn down even when the process is interrupted ----

/// The node this process runs: what to undo, and the process groups of its components.
pub(super) struct Active {
    pub(super) record: Record,
    pgids: Vec<u32>,
}

static ACTIVE: Mutex<Option<Active>> = Mutex::new(None);

fn set_active(a: Option<Active>) {
    if let Ok(mut g) = ACTIVE.lock() {
        *g = a;
    }
}

pub(super) fn add_active_pgid(pid: u32) {
    if let Ok(mut g) = ACTIVE.lock()
        && let Some(a) = g.as_mut()
    {
        a.pgids.push(pid);
    }
}

pub(super) fn take_active() -> Option<Active> {
    ACTIVE.lock().ok().and_then(|mut g| g.take())
}

static SIGNAL_PIPE_W: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

extern "C" fn on_signal(sig: libc::c_int) {
    let fd = SIGNAL_PIPE_W.load(std::sync::atomic::Ordering::Relaxed);
    let b = sig as u8;
    // SAFETY: write(2) is async-signal-safe.
    unsafe { libc::write(fd, (&b as *const u8).cast(), 1) };
}

/// SIGINT/SIGTERM/SIGHUP: tear the node down, then exit as the signal would have. A process that
/// blocks these signals to `sigwait` for them (kf-env) never runs the handler.
pub(super) fn install_signal_teardown() {
    static ONCE: OnceLock<()> = OnceLock::new();
    ONCE.get_or_init(|| {
        let mut fds = [0; 2];
        // SAFETY: pipe2(2) into a local array.
        if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
            return;
        }
        SIGNAL_PIPE_W.store(fds[1], std::sync::atomic::Ordering::Relaxed);
        let read_fd = fds[0];
        let spawned = std::thread::Builder::new().name("kube-fence-node-signals".into()).spawn(move || {
            let mut f = unsafe { <fs::File as std::os::fd::FromRawFd>::from_raw_fd(read_fd) };
            let mut b = [0u8; 1];
            if f.read_exact(&mut b).is_err() {
                return;
            }
            let sig = b[0] as libc::c_int;
            if let Some(active) = take_active() {
                eprintln!("[node] signal {sig}: tearing the node down");
                for pg in &active.pgids {
                    // SAFETY: kill(2) on process groups this process created.
                    unsafe { libc::kill(-(*pg as i32), libc::SIGTERM) };
                }
                std::thread::sleep(Duration::from_secs(2));
                for pg in &active.pgids {
                    // SAFETY: as above.
                    unsafe { libc::kill(-(*pg as i32), libc::SIGKILL) };
                }
                teardown(&active.record, true);
            }
            std::process::exit(128 + sig);
        });
        if spawned.is_err() {
            return;
        }
        for sig in [libc::SIGINT, libc::SIGTERM, libc::SIGHUP] {
            // SAFETY: installing a handler that only calls write(2).
            unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
        }
    });
}
