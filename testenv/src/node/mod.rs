//! Node mode: a whole single-node cluster — etcd, kube-apiserver, kube-controller-manager,
//! kube-scheduler, containerd, kubelet and kube-proxy — inside a network namespace of its own
//! that has no route out.
//!
//! Topology (all inside netns `kfnode`): `lo`; `kfn0`, a bridge without ports holding the node
//! IP 10.99.0.1/32; `kfbr0`, the CNI bridge (pods in 10.88.0.0/24, gateway 10.88.0.1); one route,
//! 10.96.0.0/24 (the Service CIDR) via `kfn0`, so processes in the namespace can connect() to
//! ClusterIPs before kube-proxy's DNAT rewrites them. No default route: packets can only go to
//! loopback or to addresses inside the namespace. The host reaches the API through two socat
//! relays joined by a unix socket in the state directory (host `127.0.0.1:<port>` -> netns
//! 127.0.0.1:6443).
//!
//! What the node changes outside its namespace, and how each is undone on stop (also after
//! Ctrl-C, via the signal handler in [`teardown`], and after a crash, via the record file the
//! next start or `kf-env down` reads): host sysctls the kubelet sets (saved before, written back
//! after); `/run/xtables.lock` and other host paths the components create (removed when they did
//! not exist before); cgroups (all under `/<CGROUP_ROOT>` in every hierarchy, removed); mounts
//! (all under the state directory: overlay rootfs, pod volumes, pod netns files; unmounted);
//! processes (components, containerd shims and pods: found by network namespace and cgroup,
//! killed).
//!
//! The parts: [`netns`] (the namespace, the one-node lock, running inside it), [`control_plane`]
//! (etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the API relay),
//! [`containerd`] (the runtime, CNI and images), [`kubelet`] (kubelet and kube-proxy),
//! [`cgroups`], [`teardown`] (the record, undoing everything, Ctrl-C).

mod cgroups;
mod containerd;
mod control_plane;
mod kubelet;
pub(crate) mod netns;
mod teardown;

use std::fs;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};

pub use cgroups::{cgroup_leftovers, cgroup_pids};
pub use containerd::{go_image, pause_image};
pub use netns::netns_pids;
pub use teardown::{cleanup_stale, host_sysctls, mounts_under};

use crate::{ControlPlane, Options};

/// Name of the network namespace (`/run/netns/kfnode`) and of the Node object.
pub const NETNS: &str = "kfnode";
pub const NODE_NAME: &str = "kfnode";
pub const NODE_IP: Ipv4Addr = Ipv4Addr::new(10, 99, 0, 1);
pub const POD_CIDR: &str = "10.88.0.0/24";
pub const SERVICE_CIDR: &str = "10.96.0.0/24";
/// ClusterIP of `default/kubernetes`: the first address of the Service CIDR.
pub const KUBERNETES_SERVICE_IP: Ipv4Addr = Ipv4Addr::new(10, 96, 0, 1);
/// The sandbox ("pause") image, built locally from `testenv/images/pause`.
pub const PAUSE_IMAGE: &str = "localhost/kf/pause:1.0";
/// Every cgroup the kubelet and runc create lives under this one, in every hierarchy.
pub const CGROUP_ROOT: &str = "kube-fence-node";
/// The API server's port inside the namespace.
const API_PORT: u16 = 6443;

/// Host-global sysctls the kubelet sets at start (it never sets them back). Saved and restored.
pub const HOST_SYSCTLS: &[&str] = &[
    "vm.overcommit_memory",
    "vm.panic_on_oom",
    "kernel.panic",
    "kernel.panic_on_oops",
    "kernel.keys.root_maxkeys",
    "kernel.keys.root_maxbytes",
];

/// Host paths a component may create outside the state directory. Removed on stop when they did
/// not exist before start (iptables' lock file, containerd's shim socket directory, the CNI
/// result cache, the kubelet's `/var/log/containers` symlink directory...).
pub const HOST_PATHS: &[&str] = &[
    "/run/xtables.lock",
    "/run/mount",
    "/run/containerd",
    "/var/lib/cni",
    "/var/log/containers",
    "/var/log/pods",
    "/var/lib/kubelet",
    "/var/lib/containerd",
    "/opt/containerd",
    "/etc/cni",
    "/opt/cni",
    "/etc/kubernetes",
    "/var/run/kubernetes",
];

/// The node part of a running [`ControlPlane`].
pub(crate) struct NodeRun {
    /// The one-node lock ([`netns::lock`]); released when dropped (after teardown).
    _lock: std::os::unix::net::UnixListener,
    pub(crate) netns: fs::File,
}

fn say(opts: &Options, msg: &str) {
    if opts.verbose {
        eprintln!("[node] {msg}");
    }
}

pub(crate) fn run(cmd: &mut Command) -> Result<()> {
    let out = cmd.stdin(Stdio::null()).output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

fn hack(script: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../hack").join(script)
}

/// Checks that `hack/node-prereqs.sh` has prepared this machine for the node (Debian's
/// containerd, runc, CNI plugins, iptables, socat, conntrack; the kernel features). The script
/// owns that job and records its success; this only reads the record (`--check`), so a test
/// run installs and probes once, not once per node. Fails with what to run when it has not.
pub fn prerequisites() -> Result<()> {
    let script = hack("node-prereqs.sh");
    let out = Command::new("bash").arg(&script).arg("--check").stdin(Stdio::null()).output()?;
    if !out.status.success() {
        bail!("this machine is not ready to run the node: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

impl ControlPlane {
    /// Starts the node: each part waits until it serves before the next starts. On an error
    /// the caller drops the control plane, which tears down what was started.
    pub(crate) fn start_node(&mut self, opts: &Options) -> Result<()> {
        let started = Instant::now();
        // The kubelet changes host sysctls; a node must restore them even when this process is
        // interrupted. Install the Ctrl-C handler before anything changes.
        teardown::install_signal_teardown();
        let problems = cleanup_stale(opts.verbose)?;
        if !problems.is_empty() {
            bail!("could not clean up a node left behind earlier: {}", problems.join("; "));
        }
        let lock = netns::lock()?;
        for b in ["kubelet", "kube-scheduler", "kube-proxy", "kubectl"] {
            if !self.bin_dir.join(b).is_file() {
                bail!("{} is missing: run `kf-env build --node`", self.bin_dir.join(b).display());
            }
        }
        let pause = pause_image()?;

        teardown::record_host_state(&self.dir)?;
        self.node_mode = true;

        say(
            opts,
            &format!("creating network namespace {NETNS} (node IP {NODE_IP}, pods {POD_CIDR}, services {SERVICE_CIDR}, no route out)"),
        );
        let netns = netns::create()?;
        self.node = Some(NodeRun { _lock: lock, netns });

        self.start_node_control_plane(opts)?;
        self.start_containerd(opts)?;
        self.import_image(&pause)?;
        self.start_kubelet(opts)?;
        self.start_kube_proxy(opts)?;
        self.wait_node_usable(opts)?;
        self.say(
            opts,
            &format!("node {NODE_NAME} Ready in {:.1}s; KUBECONFIG={}", started.elapsed().as_secs_f64(), self.kubeconfig.display()),
        );
        Ok(())
    }

    /// A path in the state directory, as a string for a component's flags.
    fn state_path(&self, name: &str) -> String {
        self.dir.join(name).to_string_lossy().into_owned()
    }

    /// Stops the node: components, pods and shims, mounts, cgroups, the namespace, host settings.
    pub(crate) fn stop_node(&mut self, verbose: bool) -> Vec<String> {
        // The signal handler may already have done it all.
        let Some(active) = teardown::take_active() else {
            self.reap_components();
            self.node = None;
            return Vec::new();
        };
        self.stop_components_by_group();
        let problems = teardown::teardown(&active.record, verbose);
        self.node = None;
        problems
    }

    fn stop_components_by_group(&mut self) {
        while let Some(mut c) = self.components.pop() {
            let pid = c.child.id() as i32;
            crate::terminate(&mut c.child, -pid); // the whole process group
            // Leftover members of its group (socat's connection children).
            // SAFETY: kill(2) on a process group this process created.
            unsafe { libc::kill(-pid, libc::SIGKILL) };
        }
    }

    fn reap_components(&mut self) {
        while let Some(mut c) = self.components.pop() {
            let _ = c.child.kill();
            let _ = c.child.wait();
        }
    }
}
