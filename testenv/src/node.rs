//! Node mode: a whole single-node cluster — etcd, kube-apiserver, kube-controller-manager,
//! kube-scheduler, containerd, kubelet and kube-proxy — inside a network namespace of its own
//! that has no route out (see ../shared/NODE.md for the facts this follows).
//!
//! Topology (all inside netns `kfnode`): `lo`; `kfn0`, a bridge without ports holding the node
//! IP 10.99.0.1/32; `kfbr0`, the CNI bridge (pods in 10.88.0.0/24, gateway 10.88.0.1); one route,
//! 10.96.0.0/24 (the Service CIDR) via `kfn0`, so processes in the namespace can connect() to
//! ClusterIPs before kube-proxy's DNAT rewrites them. No default route: packets can only go to
//! loopback or to addresses inside the namespace. The host reaches the API through two socat
//! relays joined by a unix socket in the state directory (host `127.0.0.1:<port>` -> netns
//! `127.0.0.1:6443`).
//!
//! What the node changes outside its namespace, and how each is undone on stop (also after
//! Ctrl-C, via the signal handler below, and after a crash, via the record file the next start
//! or `kf-env down` reads): host sysctls the kubelet sets (saved before, written back after);
//! `/run/xtables.lock` and other host paths the components create (removed when they did not
//! exist before); cgroups (all under `/<CGROUP_ROOT>` in every hierarchy, removed); mounts
//! (all under the state directory: overlay rootfs, pod volumes, pod netns files; unmounted);
//! processes (components, containerd shims and pods: found by network namespace and cgroup,
//! killed).

use std::collections::BTreeSet;
use std::fs;
use std::io::Read as _;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::{ControlPlane, Options, free_port, pki};

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
const API_PORT: u16 = 6443;
/// An abstract unix socket bound by the process that runs the node: one node per machine, since
/// the namespace name, the node IP and the cgroup root are fixed. The kernel releases it when
/// that process dies, and it leaves no file behind.
const LOCK_NAME: &[u8] = b"kube-fence-node.lock";
/// What to undo, written before anything is changed; read by a later start or `kf-env down`
/// when the process that ran the node died without cleaning up (SIGKILL).
const RECORD_FILE: &str = "/run/kube-fence-node.record";

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

/// The node part of a running [`ControlPlane`].
pub(crate) struct NodeRun {
    /// The lock ([`LOCK_NAME`]); released when dropped (after teardown).
    _lock: std::os::unix::net::UnixListener,
    pub(crate) netns: fs::File,
}

fn say(opts: &Options, msg: &str) {
    if opts.verbose {
        eprintln!("[node] {msg}");
    }
}

fn sysctl_path(name: &str) -> PathBuf {
    Path::new("/proc/sys").join(name.replace('.', "/"))
}

/// Current values of [`HOST_SYSCTLS`] (those this kernel has).
pub fn host_sysctls() -> Vec<(String, String)> {
    HOST_SYSCTLS.iter().filter_map(|k| fs::read_to_string(sysctl_path(k)).ok().map(|v| (k.to_string(), v.trim().to_string()))).collect()
}

fn run(cmd: &mut Command) -> Result<()> {
    let out = cmd.stdin(Stdio::null()).output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!("{cmd:?} failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

fn ip(args: &[&str]) -> Result<()> {
    run(Command::new("ip").args(args))
}

fn hack(script: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../hack").join(script)
}

fn cache_dir() -> PathBuf {
    if let Ok(c) = std::env::var("KUBE_FENCE_CACHE") {
        return PathBuf::from(c);
    }
    let base = std::env::var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into())).join(".cache"));
    base.join("kube-fence")
}

/// Runs `hack/node-prereqs.sh`: installs missing Debian packages (containerd, runc, CNI
/// plugins, iptables, socat, conntrack) and checks the kernel features the node needs. Fails
/// with its message when the node cannot run here.
pub fn prerequisites() -> Result<()> {
    let script = hack("node-prereqs.sh");
    let status = Command::new("bash").arg(&script).stdout(Stdio::null()).stderr(Stdio::inherit()).status()?;
    if !status.success() {
        bail!("this machine cannot run the node ({} failed; its message is above)", script.display());
    }
    Ok(())
}

/// The pause image tarball (cached by its source's content): built with Go and
/// `hack/make-image.sh`, a second at most.
pub fn pause_image() -> Result<PathBuf> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("images/pause");
    let main = fs::read(src.join("main.go"))?;
    let key: u64 = main.iter().fold(0xcbf29ce484222325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x100000001b3));
    let out = cache_dir().join("images").join(format!("pause-1.0-{key:016x}.tar"));
    if out.is_file() {
        return Ok(out);
    }
    fs::create_dir_all(out.parent().unwrap_or(Path::new("/")))?;
    let work = tempfile::tempdir()?;
    let bin = work.path().join("pause");
    run(Command::new("go")
        .args(["build", "-trimpath", "-ldflags", "-s -w", "-o"])
        .arg(&bin)
        .arg(".")
        .current_dir(&src)
        .env("CGO_ENABLED", "0")
        .env("GOFLAGS", "-mod=mod")
        .env("GOTOOLCHAIN", "local"))
    .context("building the pause binary (needs Go)")?;
    run(Command::new("bash")
        .arg(hack("make-image.sh"))
        .args(["--binary"])
        .arg(&bin)
        .args(["--path", "/pause", "--ref", PAUSE_IMAGE, "--user", "65535:65535", "--out"])
        .arg(&out))?;
    Ok(out)
}

fn lock() -> Result<std::os::unix::net::UnixListener> {
    use std::os::linux::net::SocketAddrExt as _;
    let addr = std::os::unix::net::SocketAddr::from_abstract_name(LOCK_NAME)?;
    std::os::unix::net::UnixListener::bind_addr(&addr).map_err(|e| {
        anyhow::anyhow!(
            "another kube-fence node is running on this machine (it holds the abstract socket @{}: {e}); stop it first with `kf-env down`",
            String::from_utf8_lossy(LOCK_NAME)
        )
    })
}

/// Cleans up after a node whose process died without tearing it down (SIGKILL, power loss of
/// the process). Does nothing when no such node is recorded. Fails if a live node holds the lock.
pub fn cleanup_stale(verbose: bool) -> Result<Vec<String>> {
    let record = fs::read_to_string(RECORD_FILE).ok();
    if record.is_none() && !Path::new("/run/netns").join(NETNS).exists() {
        return Ok(Vec::new());
    }
    // A live node holds the lock: nothing is stale.
    let Ok(_lock) = lock() else { return Ok(Vec::new()) };
    let Some(text) = record else {
        return Ok(teardown(&Record::default(), verbose));
    };
    let record = Record::from_text(&text);
    if verbose {
        eprintln!("[node] cleaning up a node left behind by a process that died (state {})", record.state_dir.display());
    }
    Ok(teardown(&record, verbose))
}

impl ControlPlane {
    pub(crate) fn start_node(&mut self, opts: &Options) -> Result<()> {
        let started = Instant::now();
        let dir = self.dir.clone();
        // The kubelet changes host sysctls; a node must restore them even when this process is
        // interrupted. Install the Ctrl-C handler before anything changes.
        install_signal_teardown();
        let problems = cleanup_stale(opts.verbose)?;
        if !problems.is_empty() {
            bail!("could not clean up a node left behind earlier: {}", problems.join("; "));
        }
        let lock = lock()?;
        for b in ["kubelet", "kube-scheduler", "kube-proxy", "kubectl"] {
            if !self.bin_dir.join(b).is_file() {
                bail!("{} is missing: run hack/build-control-plane.sh --node", self.bin_dir.join(b).display());
            }
        }
        let pause = pause_image()?;

        // Record what to undo before changing anything.
        let record = Record {
            state_dir: dir.clone(),
            sysctls: host_sysctls(),
            absent_paths: HOST_PATHS.iter().map(PathBuf::from).filter(|p| fs::symlink_metadata(p).is_err()).collect(),
        };
        fs::write(RECORD_FILE, record.to_text())?;
        set_active(Some(Active { record, pgids: Vec::new() }));
        self.node_mode = true;

        say(
            opts,
            &format!("creating network namespace {NETNS} (node IP {NODE_IP}, pods {POD_CIDR}, services {SERVICE_CIDR}, no route out)"),
        );
        let ns = NETNS;
        ip(&["netns", "add", ns]).context("creating the node's network namespace")?;
        let netns = fs::File::open(Path::new("/run/netns").join(ns))?;
        self.node = Some(NodeRun { _lock: lock, netns });
        ip(&["-n", ns, "link", "set", "lo", "up"])?;
        // No dummy driver on every kernel: a bridge without ports holds the node IP as well.
        ip(&["-n", ns, "link", "add", "kfn0", "type", "bridge"])?;
        ip(&["-n", ns, "addr", "add", &format!("{NODE_IP}/32"), "dev", "kfn0"])?;
        ip(&["-n", ns, "link", "set", "kfn0", "up"])?;
        ip(&["-n", ns, "route", "add", SERVICE_CIDR, "dev", "kfn0"])?;

        // PKI: the serving certificate also names what in-cluster clients dial.
        let pki = pki::generate(
            &[KUBERNETES_SERVICE_IP, NODE_IP],
            &["kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"],
        )?;
        let (token, kcm_token) = self.write_credentials(&pki)?;
        let host_port = free_port()?;
        self.server = format!("https://127.0.0.1:{host_port}");
        let in_ns = format!("https://127.0.0.1:{API_PORT}");
        self.write_kubeconfig_to(&self.kubeconfig, &self.server, "admin", &token)?;
        self.write_kubeconfig_to(&dir.join("node.kubeconfig"), &in_ns, "admin", &token)?;
        self.write_kubeconfig_to(&dir.join("kcm.kubeconfig"), &in_ns, "system:kube-controller-manager", &kcm_token)?;
        let p = |n: &str| dir.join(n).to_string_lossy().into_owned();

        // The API from the host: host 127.0.0.1:<port> -> unix socket -> netns 127.0.0.1:6443.
        let sock = p("kas.sock");
        self.spawn_node(
            opts,
            "socat-netns",
            Command::new("socat").args([&format!("UNIX-LISTEN:{sock},fork,unlink-early,mode=600"), &format!("TCP:127.0.0.1:{API_PORT}")]),
            true,
        )?;
        self.spawn_node(
            opts,
            "socat-host",
            Command::new("socat").args([&format!("TCP-LISTEN:{host_port},bind=127.0.0.1,fork,reuseaddr"), &format!("UNIX-CONNECT:{sock}")]),
            false,
        )?;

        say(opts, &format!("starting etcd (state in {})", dir.display()));
        self.spawn_node(
            opts,
            "etcd",
            Command::new(self.bin_dir.join("etcd")).args([
                "--name",
                "kube-fence",
                "--data-dir",
                &p("etcd"),
                "--listen-client-urls",
                "http://127.0.0.1:2379",
                "--advertise-client-urls",
                "http://127.0.0.1:2379",
                "--listen-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-advertise-peer-urls",
                "http://127.0.0.1:2380",
                "--initial-cluster",
                "kube-fence=http://127.0.0.1:2380",
                "--listen-metrics-urls",
                "",
                "--unsafe-no-fsync",
                "--log-level",
                "warn",
            ]),
            true,
        )?;

        say(opts, &format!("starting kube-apiserver (in the namespace on {NODE_IP}:{API_PORT}; from the host {})", self.server));
        self.spawn_node(
            opts,
            "kube-apiserver",
            Command::new(self.bin_dir.join("kube-apiserver")).args([
                "--etcd-servers",
                "http://127.0.0.1:2379",
                // 0.0.0.0 of the node's namespace: loopback, the node IP and the CNI gateway only.
                "--bind-address",
                "0.0.0.0",
                "--advertise-address",
                &NODE_IP.to_string(),
                "--secure-port",
                &API_PORT.to_string(),
                "--tls-cert-file",
                &p("apiserver.crt"),
                "--tls-private-key-file",
                &p("apiserver.key"),
                "--client-ca-file",
                &p("ca.crt"),
                "--token-auth-file",
                &p("tokens.csv"),
                "--authorization-mode",
                "RBAC",
                "--service-account-issuer",
                "https://kubernetes.default.svc",
                "--service-account-key-file",
                &p("sa.pub"),
                "--service-account-signing-key-file",
                &p("sa.key"),
                "--service-cluster-ip-range",
                SERVICE_CIDR,
                // The apiserver itself keeps default/kubernetes -> 10.99.0.1:6443.
                "--endpoint-reconciler-type",
                "lease",
                "--enable-aggregator-routing=true",
                "--kubelet-preferred-address-types",
                "InternalIP",
                "--kubelet-client-certificate",
                &p("kubelet-client.crt"),
                "--kubelet-client-key",
                &p("kubelet-client.key"),
                "--allow-privileged=true",
                "--v",
                "0",
            ]),
            true,
        )?;
        let readyz = format!("{}/readyz", self.server);
        let default_ns = format!("{}/api/v1/namespaces/default", self.server);
        self.wait_until(opts, "kube-apiserver", Duration::from_secs(90), |cp| cp.curl_ok(&readyz, true) && cp.curl_ok(&default_ns, true))?;

        let args = self.controller_manager_args("*,-node-ipam-controller,-persistentvolume-binder-controller");
        self.spawn_node(opts, "kube-controller-manager", Command::new(self.bin_dir.join("kube-controller-manager")).args(args), true)?;
        let nkc = p("node.kubeconfig");
        self.spawn_node(
            opts,
            "kube-scheduler",
            Command::new(self.bin_dir.join("kube-scheduler")).args([
                "--kubeconfig",
                &nkc,
                "--authentication-kubeconfig",
                &nkc,
                "--authorization-kubeconfig",
                &nkc,
                "--bind-address",
                "127.0.0.1",
                "--secure-port",
                "0",
                "--leader-elect=false",
                "--v",
                "0",
            ]),
            true,
        )?;

        // containerd, with every path under the state directory.
        create_cgroup_root()?;
        let ctrd = dir.join("containerd");
        fs::create_dir_all(&ctrd)?;
        fs::create_dir_all(dir.join("cni/net.d"))?;
        fs::write(
            dir.join("cni/net.d/10-kfbr.conflist"),
            format!(
                r#"{{"cniVersion": "0.4.0", "name": "kfnet", "plugins": [
  {{"type": "bridge", "bridge": "kfbr0", "isGateway": true, "isDefaultGateway": true, "ipMasq": false,
   "hairpinMode": true,
   "ipam": {{"type": "host-local", "ranges": [[{{"subnet": "{POD_CIDR}"}}]], "dataDir": "{}"}}}}]}}
"#,
                p("cni/ipam")
            ),
        )?;
        let sock = ctrd.join("containerd.sock");
        fs::write(
            ctrd.join("config.toml"),
            format!(
                r#"version = 2
root = "{root}"
state = "{state}"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs", "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing"]
[grpc]
  address = "{sock}"
[ttrpc]
  address = "{sock}.ttrpc"
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{opt}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  # runc cannot lower oom_score_adj without CAP_SYS_RESOURCE (NODE.md pitfall 3)
  restrict_oom_score_adj = true
  # pod network namespace files under the state directory, not /run/netns: unmounted on stop
  netns_mounts_under_state_dir = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{cni}"
"#,
                root = ctrd.join("root").display(),
                state = ctrd.join("state").display(),
                sock = sock.display(),
                opt = ctrd.join("opt").display(),
                cni = p("cni/net.d"),
            ),
        )?;
        say(opts, "starting containerd");
        self.spawn_node(opts, "containerd", Command::new("containerd").arg("--config").arg(ctrd.join("config.toml")), true)?;
        let ctr_ok = {
            let sock = sock.clone();
            move || {
                Command::new("ctr")
                    .arg("--address")
                    .arg(&sock)
                    .args(["version"])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .map(|s| s.success())
                    .unwrap_or(false)
            }
        };
        self.wait_until(opts, "containerd", Duration::from_secs(30), |_| ctr_ok())?;
        self.containerd_address = Some(sock.clone());
        self.import_image(&pause)?;

        let kubelet_dir = dir.join("kubelet");
        fs::create_dir_all(&kubelet_dir)?;
        fs::write(
            dir.join("kubelet-config.yaml"),
            format!(
                r#"apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
failCgroupV1: false
cgroupDriver: cgroupfs
cgroupRoot: /{CGROUP_ROOT}
address: {NODE_IP}
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
healthzPort: 10248
containerRuntimeEndpoint: unix://{sock}
podLogsDirectory: {logs}
authentication:
  anonymous: {{enabled: false}}
  webhook: {{enabled: true}}
  x509: {{clientCAFile: {ca}}}
authorization:
  mode: Webhook
resolvConf: ""
failSwapOn: false
clusterDomain: cluster.local
serializeImagePulls: false
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
evictionHard:
  memory.available: "50Mi"
  nodefs.available: "1%"
  nodefs.inodesFree: "1%"
  imagefs.available: "1%"
"#,
                sock = sock.display(),
                logs = p("pod-logs"),
                ca = p("ca.crt"),
            ),
        )?;
        say(opts, "starting kubelet");
        self.spawn_node(
            opts,
            "kubelet",
            Command::new(self.bin_dir.join("kubelet")).args([
                "--config",
                &p("kubelet-config.yaml"),
                "--kubeconfig",
                &nkc,
                "--root-dir",
                &kubelet_dir.to_string_lossy(),
                "--hostname-override",
                NODE_NAME,
                "--node-ip",
                &NODE_IP.to_string(),
                "--v",
                "1",
            ]),
            true,
        )?;
        self.wait_until(opts, "node registration", Duration::from_secs(90), |cp| cp.node_ready().is_some())?;

        say(opts, "starting kube-proxy (iptables mode, rules inside the namespace)");
        self.spawn_node(
            opts,
            "kube-proxy",
            Command::new(self.bin_dir.join("kube-proxy")).args([
                "--kubeconfig",
                &nkc,
                "--hostname-override",
                NODE_NAME,
                "--proxy-mode",
                "iptables",
                "--cluster-cidr",
                POD_CIDR,
                // 0 = leave as is: nf_conntrack_max is read-only in a non-init netns and the hashsize
                // module parameter is host-global.
                "--conntrack-max-per-core",
                "0",
                "--conntrack-tcp-timeout-established",
                "0",
                "--conntrack-tcp-timeout-close-wait",
                "0",
                "--healthz-bind-address",
                "127.0.0.1:10256",
                "--metrics-bind-address",
                "127.0.0.1:10249",
                "--v",
                "2",
            ]),
            true,
        )?;
        self.wait_until(opts, "kube-proxy's first rule sync", Duration::from_secs(60), |cp| {
            cp.in_netns(Command::new("curl").args(["-sf", "-o", "/dev/null", "--max-time", "2", "http://127.0.0.1:10256/healthz"]))
        })?;
        self.wait_until(opts, "node Ready", Duration::from_secs(120), |cp| cp.node_ready() == Some(true))?;
        let tokens = fs::read_to_string(dir.join("tokens.csv"))?;
        let admin = tokens.split(',').next().unwrap_or_default().to_string();
        let ca = p("ca.crt");
        self.wait_until(opts, "the kubernetes Service (10.96.0.1:443, TLS-verified) from the namespace", Duration::from_secs(60), |cp| {
            cp.in_netns(Command::new("curl").args([
                "-sf",
                "-o",
                "/dev/null",
                "--max-time",
                "3",
                "--cacert",
                &ca,
                "-H",
                &format!("Authorization: Bearer {admin}"),
                &format!("https://{KUBERNETES_SERVICE_IP}:443/readyz"),
            ]))
        })?;
        // Pods can be created as soon as start returns: the namespace `default` has its service
        // account and the CA bundle the kubelet projects into Pods.
        let sa = format!("{}/api/v1/namespaces/default/serviceaccounts/default", self.server);
        let root_ca = format!("{}/api/v1/namespaces/default/configmaps/kube-root-ca.crt", self.server);
        self.wait_until(opts, "service account default/default", Duration::from_secs(60), |cp| {
            cp.curl_ok(&sa, true) && cp.curl_ok(&root_ca, true)
        })?;
        self.say(
            opts,
            &format!("node {NODE_NAME} Ready in {:.1}s; KUBECONFIG={}", started.elapsed().as_secs_f64(), self.kubeconfig.display()),
        );
        Ok(())
    }

    /// `Some(true)` when the Node object exists and is Ready, `Some(false)` when it exists.
    fn node_ready(&self) -> Option<bool> {
        let out = Command::new(self.bin_dir.join("kubectl"))
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(["get", "node", NODE_NAME, "--request-timeout=3s", "-o", "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}"])
            .stderr(Stdio::null())
            .output()
            .ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim() == "True")
    }

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

    /// Imports a docker-archive or OCI tarball into the node's containerd (namespace `k8s.io`,
    /// where the kubelet looks). Pods then use the image with `imagePullPolicy: IfNotPresent`
    /// or `Never`; nothing is ever pulled.
    pub fn import_image(&self, tarball: &Path) -> Result<()> {
        let Some(sock) = &self.containerd_address else {
            bail!("images can only be imported into a node (start with Options {{ node: true, .. }})");
        };
        run(Command::new("ctr").arg("--address").arg(sock).args(["-n", "k8s.io", "images", "import"]).arg(tarball))
            .with_context(|| format!("importing {}", tarball.display()))
    }

    fn spawn_node(&mut self, opts: &Options, name: &'static str, cmd: &mut Command, in_netns: bool) -> Result<()> {
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
            add_active_pgid(c.child.id());
        }
        Ok(())
    }

    /// Stops the node: components, pods and shims, mounts, cgroups, the namespace, host settings.
    pub(crate) fn stop_node(&mut self, verbose: bool) -> Vec<String> {
        // The signal handler may already have done it all.
        let Some(active) = take_active() else {
            self.reap_components();
            self.node = None;
            return Vec::new();
        };
        self.stop_components_by_group();
        let problems = teardown(&active.record, verbose);
        self.node = None;
        problems
    }

    fn stop_components_by_group(&mut self) {
        while let Some(mut c) = self.components.pop() {
            let pid = c.child.id() as i32;
            crate::terminate(&mut c.child, -pid); // the whole process group
            // Leftover members of its group (socat's connection children).
            // SAFETY: as above.
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

fn create_cgroup_root() -> Result<()> {
    for h in cgroup_hierarchies() {
        let dir = h.join(CGROUP_ROOT);
        fs::create_dir_all(&dir).with_context(|| format!("creating cgroup {}", dir.display()))?;
        // A new cpuset cgroup starts with no CPUs and no memory nodes: copy the parent's.
        for f in ["cpuset.cpus", "cpuset.mems"] {
            if let Ok(v) = fs::read_to_string(h.join(f)) {
                fs::write(dir.join(f), v.trim()).with_context(|| format!("setting {}", dir.join(f).display()))?;
            }
        }
    }
    Ok(())
}

/// Mounted cgroup hierarchies: `/sys/fs/cgroup` itself on a pure cgroup v2 host, else each v1
/// hierarchy (and the hybrid `unified` one).
fn cgroup_hierarchies() -> Vec<PathBuf> {
    let root = Path::new("/sys/fs/cgroup");
    if root.join("cgroup.controllers").exists() {
        return vec![root.to_path_buf()];
    }
    let mut v: Vec<PathBuf> = fs::read_dir(root)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.join("cgroup.procs").exists() && !fs::symlink_metadata(p).map(|m| m.file_type().is_symlink()).unwrap_or(true))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn cgroup_dirs_depth_first(dir: &Path, out: &mut Vec<PathBuf>) {
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.filter_map(|e| e.ok()) {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                cgroup_dirs_depth_first(&e.path(), out);
            }
        }
    }
    if dir.is_dir() {
        out.push(dir.to_path_buf());
    }
}

/// PIDs of every process in a cgroup under [`CGROUP_ROOT`] (pods, runc).
pub fn cgroup_pids() -> BTreeSet<u32> {
    let mut pids = BTreeSet::new();
    for h in cgroup_hierarchies() {
        let mut dirs = Vec::new();
        cgroup_dirs_depth_first(&h.join(CGROUP_ROOT), &mut dirs);
        for d in dirs {
            if let Ok(s) = fs::read_to_string(d.join("cgroup.procs")) {
                pids.extend(s.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
            }
        }
    }
    pids
}

/// Every cgroup directory under [`CGROUP_ROOT`], in all hierarchies.
pub fn cgroup_leftovers() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for h in cgroup_hierarchies() {
        cgroup_dirs_depth_first(&h.join(CGROUP_ROOT), &mut dirs);
    }
    dirs
}

/// PIDs of every process in the node's network namespace (components, shims, hostNetwork pods).
pub fn netns_pids() -> BTreeSet<u32> {
    let Ok(ns) = fs::metadata(Path::new("/run/netns").join(NETNS)) else { return BTreeSet::new() };
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

struct Active {
    record: Record,
    pgids: Vec<u32>,
}

static ACTIVE: Mutex<Option<Active>> = Mutex::new(None);

fn set_active(a: Option<Active>) {
    if let Ok(mut g) = ACTIVE.lock() {
        *g = a;
    }
}

fn add_active_pgid(pid: u32) {
    if let Ok(mut g) = ACTIVE.lock()
        && let Some(a) = g.as_mut()
    {
        a.pgids.push(pid);
    }
}

fn take_active() -> Option<Active> {
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
fn install_signal_teardown() {
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
