//! HA mode (`kf-env up --ha`): the control-plane topology production clusters run — three etcd
//! members and two kube-apiservers (+ kube-controller-manager) — each component in a network
//! namespace of its own, so a test can cut the links between them.
//!
//! Topology. A bridge namespace `kfha-net` holds the bridge `br0`; every other namespace has one
//! veth (`eth0`) whose peer is a port of `br0`, all in 10.97.0.0/24 and none with a route out:
//!
//! | namespace | address | runs |
//! | --- | --- | --- |
//! | `kfha-e1`, `kfha-e2`, `kfha-e3` | 10.97.0.1–3 | etcd members m1–m3 (client :2379, peer :2380) |
//! | `kfha-a`, `kfha-b` | 10.97.0.11, 10.97.0.12 | kube-apiserver A and B (:6443; A also runs kube-controller-manager) |
//! | `kfha-c` | 10.97.0.21 (workers), 10.97.0.22 (kube-fence) | the clients' ends of the relays |
//!
//! Nothing is added to the host's own network: the host reaches each API server through two
//! socat relays joined by a unix socket in the state directory (host `127.0.0.1:<port>` → unix
//! socket → socat in `kfha-c` → 10.97.0.1x:6443 over the bridge), once for workers (source
//! 10.97.0.21) and once for kube-fence (source 10.97.0.22), so the two paths can be cut apart.
//! The API servers reach the webhook the same way backwards: `https://127.0.0.1:9443` inside
//! `kfha-a` is relayed to host 127.0.0.1:[`HaCluster::webhook_ports`]\[0\] (replica A), inside
//! `kfha-b` to …\[1\] (replica B), like one Service in front of two replicas whose traffic each
//! API server sends to a different one.
//!
//! Partitions ([`Partition`]) are routes inside the namespaces: blackhole routes (and, in
//! `kfha-c`, blackhole rules by source address) on both ends of a cut, or the member's `eth0`
//! set down. Packets are dropped, not refused: a cut looks to TCP like a network that lost them.
//! [`HaCluster::heal`] removes them. Every namespace, with its links and routes, goes with
//! [`HaCluster::stop`]; one left behind by a killed process is removed by [`cleanup_stale`]
//! (every start and `kf-env down` call it). One HA control plane per machine (a lock).

use std::collections::BTreeMap;
use std::fs;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

use crate::node::netns::{enter_on_exec, ip, lock_named, pids_in};
use crate::{ApiServerFlags, ControlPlane, listen_port, pki};

/// Every namespace of the HA mode starts with this.
pub const NS_PREFIX: &str = "kfha-";
const BRIDGE_NS: &str = "kfha-net";
const LOCK_NAME: &[u8] = b"kube-fence-ha.lock";
/// The port each API server calls the webhook on, inside its own namespace.
pub const WEBHOOK_PORT: u16 = 9443;
const API_PORT: u16 = 6443;
const SUBNET_BITS: u8 = 24;

/// A namespace of the topology.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Place {
    /// etcd member 0, 1 or 2 (m1–m3).
    Etcd(usize),
    /// kube-apiserver 0 (A) or 1 (B).
    Api(usize),
    /// The clients' ends of the relays (workers and kube-fence).
    Clients,
}

impl Place {
    pub fn ns(self) -> String {
        match self {
            Place::Etcd(i) => format!("{NS_PREFIX}e{}", i + 1),
            Place::Api(i) => format!("{NS_PREFIX}{}", api_letter(i)),
            Place::Clients => format!("{NS_PREFIX}c"),
        }
    }
    pub fn ip(self) -> Ipv4Addr {
        match self {
            Place::Etcd(i) => Ipv4Addr::new(10, 97, 0, 1 + i as u8),
            Place::Api(i) => Ipv4Addr::new(10, 97, 0, 11 + i as u8),
            Place::Clients => WORKERS_IP,
        }
    }
    const ALL: [Place; 6] = [Place::Etcd(0), Place::Etcd(1), Place::Etcd(2), Place::Api(0), Place::Api(1), Place::Clients];
}

/// The source address of the workers' connections to the API servers.
pub const WORKERS_IP: Ipv4Addr = Ipv4Addr::new(10, 97, 0, 21);
/// The source address of kube-fence's connections (its watches, its lease controller).
pub const KUBE_FENCE_IP: Ipv4Addr = Ipv4Addr::new(10, 97, 0, 22);

/// "a" or "b".
pub fn api_letter(i: usize) -> char {
    (b'a' + i as u8) as char
}

/// Who talks to an API server through the clients' namespace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Source {
    Workers,
    KubeFence,
}

impl Source {
    fn ip(self) -> Ipv4Addr {
        match self {
            Source::Workers => WORKERS_IP,
            Source::KubeFence => KUBE_FENCE_IP,
        }
    }
}

/// A cut in the network. Healed by [`HaCluster::heal`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Partition {
    /// `source` cannot reach API server `api` (nor it them).
    ClientFromApi { api: usize, source: Source },
    /// API server `api` cannot reach these etcd members (nor they it).
    ApiFromEtcd { api: usize, members: Vec<usize> },
    /// etcd member `member` is cut off from everything (its link is down).
    EtcdIsolated { member: usize },
}

impl std::fmt::Display for Partition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Partition::ClientFromApi { api, source } => write!(f, "{source:?} cut from kube-apiserver {}", api_letter(*api)),
            Partition::ApiFromEtcd { api, members } => {
                let m: Vec<String> = members.iter().map(|m| format!("m{}", m + 1)).collect();
                write!(f, "kube-apiserver {} cut from etcd {}", api_letter(*api), m.join(","))
            }
            Partition::EtcdIsolated { member } => write!(f, "etcd m{} isolated", member + 1),
        }
    }
}

/// Options for [`HaCluster::start`].
#[derive(Clone, Debug)]
pub struct HaOptions {
    pub bin_dir: Option<PathBuf>,
    /// State directory (default: a fresh temporary directory, removed on stop).
    pub state_dir: Option<PathBuf>,
    pub controller_manager: bool,
    pub verbose: bool,
}

impl Default for HaOptions {
    fn default() -> Self {
        HaOptions { bin_dir: None, state_dir: None, controller_manager: true, verbose: true }
    }
}

struct Component {
    name: String,
    place: Option<Place>,
    child: Option<Child>,
    log: PathBuf,
    program: PathBuf,
    args: Vec<String>,
}

/// A running HA control plane. Dropping it stops every process, removes every namespace and
/// (when it made it) the state directory.
pub struct HaCluster {
    base: ControlPlane,
    remove_dir: bool,
    verbose: bool,
    components: Vec<Component>,
    netns: BTreeMap<Place, fs::File>,
    partitions: Vec<Partition>,
    /// Workers' URL of API server A and B (`https://127.0.0.1:<port>`).
    pub servers: [String; 2],
    /// Workers' admin kubeconfigs for API server A and B.
    pub kubeconfigs: [PathBuf; 2],
    /// kube-fence's admin kubeconfigs for A and B (another source address: cut apart from the workers').
    pub fence_kubeconfigs: [PathBuf; 2],
    /// Host loopback ports the webhook replica for A and for B must listen on; the API servers
    /// call `https://127.0.0.1:`[`WEBHOOK_PORT`] in their namespaces and reach them there.
    pub webhook_ports: [u16; 2],
    /// The audit logs of API server A and B (JSON lines, [`crate::AUDIT_POLICY`]).
    pub audit_logs: [PathBuf; 2],
    pub bin_dir: PathBuf,
    _lock: Option<std::os::unix::net::UnixListener>,
}

fn say(verbose: bool, msg: &str) {
    if verbose {
        eprintln!("[ha] {msg}");
    }
}

/// Stops what an HA control plane whose process died left behind: the processes in its
/// namespaces, then the namespaces (their links and routes go with them). Does nothing when a
/// live one holds the lock. Idempotent.
/// The host programs the topology runs, each with the Debian package that has it: `ip` makes the
/// namespaces and cuts, `socat` relays host ports into them, `curl` asks etcd and the API
/// servers whether they are healthy.
const HOST_TOOLS: [(&str, &str); 3] = [("ip", "iproute2"), ("socat", "socat"), ("curl", "curl")];

/// The tools of [`HOST_TOOLS`] that no directory of `path` (a `PATH` value) has as a file,
/// with their packages: checked before anything starts, so that a machine without them is told
/// which, instead of "No such file or directory" from the first relay.
fn missing_tools(path: &std::ffi::OsStr) -> Vec<(&'static str, &'static str)> {
    let dirs: Vec<PathBuf> = std::env::split_paths(path).collect();
    HOST_TOOLS.into_iter().filter(|(tool, _)| !dirs.iter().any(|d| d.join(tool).is_file())).collect()
}

pub fn cleanup_stale(verbose: bool) -> Result<()> {
    let Ok(_lock) = lock_named(LOCK_NAME, "kube-fence HA control plane") else { return Ok(()) };
    remove_namespaces(verbose)
}

fn our_namespaces() -> Vec<String> {
    let mut v: Vec<String> = fs::read_dir("/run/netns")
        .map(|rd| rd.filter_map(|e| e.ok()).filter_map(|e| e.file_name().into_string().ok()).filter(|n| n.starts_with(NS_PREFIX)).collect())
        .unwrap_or_default();
    v.sort();
    v
}

fn remove_namespaces(verbose: bool) -> Result<()> {
    let names = our_namespaces();
    if names.is_empty() {
        return Ok(());
    }
    say(verbose, &format!("removing namespaces {}", names.join(", ")));
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let pids: Vec<u32> = names.iter().flat_map(|n| pids_in(n)).collect();
        if pids.is_empty() {
            break;
        }
        if Instant::now() > deadline {
            bail!("stopping the HA processes: still running after SIGKILL: {pids:?}");
        }
        for pid in pids {
            // SAFETY: kill(2) on processes inside namespaces only this module creates.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut problems = Vec::new();
    for n in names {
        if let Err(e) = ip(&["netns", "del", &n]) {
            problems.push(format!("{e:#}"));
        }
    }
    if !problems.is_empty() {
        bail!("removing the HA namespaces: {}", problems.join("; "));
    }
    Ok(())
}

impl HaCluster {
    /// Creates the namespaces and links, starts etcd ×3, kube-apiserver ×2, the relays and
    /// (optionally) kube-controller-manager, and waits until both API servers serve from the
    /// host. Needs root. The processes die with the *thread* that calls this
    /// (`PR_SET_PDEATHSIG`): call it from one that lives as long as the cluster, and call
    /// `HaCluster::restart` from the same thread.
    pub fn start(opts: HaOptions) -> Result<HaCluster> {
        let started = Instant::now();
        let missing = missing_tools(&std::env::var_os("PATH").unwrap_or_default());
        if !missing.is_empty() {
            bail!(
                "the HA topology needs {} on PATH (Debian: apt-get install {}; hack/node-prereqs.sh installs them)",
                missing.iter().map(|(tool, _)| *tool).collect::<Vec<_>>().join(", "),
                missing.iter().map(|(_, package)| *package).collect::<Vec<_>>().join(" ")
            );
        }
        cleanup_stale(opts.verbose)?;
        let lock = lock_named(LOCK_NAME, "kube-fence HA control plane")?;
        let bin_dir = match &opts.bin_dir {
            Some(d) => d.clone(),
            None => crate::binaries()?,
        };
        for b in ["etcd", "kube-apiserver", "kube-controller-manager"] {
            if !bin_dir.join(b).is_file() {
                bail!("{} is missing: run `kf-env build`", bin_dir.join(b).display());
            }
        }
        let (dir, remove_dir) = match &opts.state_dir {
            Some(d) => {
                fs::create_dir_all(d)?;
                (fs::canonicalize(d)?, false)
            }
            None => (tempfile::Builder::new().prefix("kube-fence-ha.").tempdir()?.keep(), true),
        };
        let base = ControlPlane {
            dir: dir.clone(),
            remove_dir: false,
            components: Vec::new(),
            server: String::new(),
            kubeconfig: dir.join("kubeconfig-a"),
            ca_pem: String::new(),
            bin_dir: bin_dir.clone(),
            containerd_address: None,
            node: None,
            node_mode: false,
        };
        let mut ha = HaCluster {
            base,
            remove_dir,
            verbose: opts.verbose,
            components: Vec::new(),
            netns: BTreeMap::new(),
            partitions: Vec::new(),
            servers: [String::new(), String::new()],
            kubeconfigs: [dir.join("kubeconfig-a"), dir.join("kubeconfig-b")],
            fence_kubeconfigs: [dir.join("kube-fence-a.kubeconfig"), dir.join("kube-fence-b.kubeconfig")],
            webhook_ports: [0, 0],
            audit_logs: [dir.join("audit-a.log"), dir.join("audit-b.log")],
            bin_dir,
            _lock: Some(lock),
        };
        // On an error below, dropping `ha` undoes what was done.
        ha.create_network().context("creating the HA network namespaces")?;
        say(opts.verbose, "namespaces and links up (10.97.0.0/24 on bridge kfha-net/br0, no route out)");
        ha.start_components(&opts)?;
        say(
            opts.verbose,
            &format!(
                "ready in {:.1}s: kube-apiserver A {} and B {}; KUBECONFIG={}",
                started.elapsed().as_secs_f64(),
                ha.servers[0],
                ha.servers[1],
                ha.kubeconfigs[0].display()
            ),
        );
        Ok(ha)
    }

    pub fn dir(&self) -> &Path {
        &self.base.dir
    }

    /// The CA that signed the API servers' certificate, PEM.
    pub fn ca_pem(&self) -> &str {
        &self.base.ca_pem
    }

    fn create_network(&mut self) -> Result<()> {
        ip(&["netns", "add", BRIDGE_NS])?;
        ip(&["-n", BRIDGE_NS, "link", "set", "lo", "up"])?;
        ip(&["-n", BRIDGE_NS, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", BRIDGE_NS, "link", "set", "br0", "up"])?;
        for place in Place::ALL {
            let ns = place.ns();
            ip(&["netns", "add", &ns])?;
            self.netns.insert(place, fs::File::open(Path::new("/run/netns").join(&ns)).with_context(|| format!("opening namespace {ns}"))?);
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            let port = format!("v-{}", &ns[NS_PREFIX.len()..]);
            ip(&["-n", BRIDGE_NS, "link", "add", &port, "type", "veth", "peer", "name", "eth0", "netns", &ns])?;
            ip(&["-n", BRIDGE_NS, "link", "set", &port, "master", "br0"])?;
            ip(&["-n", BRIDGE_NS, "link", "set", &port, "up"])?;
            ip(&["-n", &ns, "addr", "add", &format!("{}/{SUBNET_BITS}", place.ip()), "dev", "eth0"])?;
            if place == Place::Clients {
                ip(&["-n", &ns, "addr", "add", &format!("{KUBE_FENCE_IP}/{SUBNET_BITS}"), "dev", "eth0"])?;
            }
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
        }
        Ok(())
    }

    fn path(&self, name: &str) -> String {
        self.base.dir.join(name).display().to_string()
    }

    fn start_components(&mut self, opts: &HaOptions) -> Result<()> {
        let ips: Vec<Ipv4Addr> = [Place::Api(0), Place::Api(1)].iter().map(|p| p.ip()).collect();
        let (token, kcm_token) = self.base.write_credentials(&pki::generate(&ips, &["kubernetes", "kubernetes.default"])?)?;

        let cluster: Vec<String> = (0..3).map(|i| format!("m{}=http://{}:2380", i + 1, Place::Etcd(i).ip())).collect();
        let cluster = cluster.join(",");
        say(opts.verbose, "starting etcd m1, m2, m3");
        for i in 0..3 {
            let ip = Place::Etcd(i).ip();
            let (client, peer) = (format!("http://{ip}:2379"), format!("http://{ip}:2380"));
            let args = [
                "--name",
                &format!("m{}", i + 1),
                "--data-dir",
                &self.path(&format!("etcd-m{}", i + 1)),
                "--listen-client-urls",
                &client,
                "--advertise-client-urls",
                &client,
                "--listen-peer-urls",
                &peer,
                "--initial-advertise-peer-urls",
                &peer,
                "--initial-cluster",
                &cluster,
                "--initial-cluster-state",
                "new",
                "--initial-cluster-token",
                "kube-fence-ha",
                // A busy 2-core machine: elections only when a leader is really gone.
                "--heartbeat-interval",
                "200",
                "--election-timeout",
                "2000",
                "--unsafe-no-fsync",
                "--log-level",
                "warn",
            ]
            .map(str::to_string)
            .to_vec();
            let etcd = self.bin_dir.join("etcd");
            self.spawn(&format!("etcd-m{}", i + 1), Some(Place::Etcd(i)), &etcd, args)?;
        }
        self.wait_until("etcd (a leader elected)", Duration::from_secs(60), |ha| ha.etcd_leader().is_some())?;

        let etcd_servers: Vec<String> = (0..3).map(|i| format!("http://{}:2379", Place::Etcd(i).ip())).collect();
        let etcd_servers = etcd_servers.join(",");
        for i in 0..2 {
            let advertise = Place::Api(i).ip().to_string();
            let audit_log = self.audit_logs[i].display().to_string();
            let flags = ApiServerFlags {
                etcd: &etcd_servers,
                bind: "0.0.0.0",
                advertise: &advertise,
                port: API_PORT,
                issuer: "https://kubernetes.default.svc",
                service_cidr: "10.96.0.0/24",
                // Each API server keeps its own address in default/kubernetes, as in production.
                endpoint_reconciler: "lease",
                audit_log: &audit_log,
            };
            let args = self.base.apiserver_args(&flags, &[]);
            say(opts.verbose, &format!("starting kube-apiserver {} on {advertise}:{API_PORT}", api_letter(i).to_ascii_uppercase()));
            let kas = self.bin_dir.join("kube-apiserver");
            self.spawn(&format!("kube-apiserver-{}", api_letter(i)), Some(Place::Api(i)), &kas, args)?;
        }

        // The relays: workers' and kube-fence's paths to each API server; each API server's path
        // to its webhook replica.
        for i in 0..2 {
            let l = api_letter(i);
            for (source, what) in [(Source::Workers, "workers"), (Source::KubeFence, "kube-fence")] {
                let sock = self.path(&format!("{what}-{l}.sock"));
                let to = format!("TCP:{}:{API_PORT},bind={}", Place::Api(i).ip(), source.ip());
                self.spawn_socat(
                    &format!("relay-{what}-{l}-ns"),
                    Some(Place::Clients),
                    &format!("UNIX-LISTEN:{sock},fork,unlink-early,mode=600"),
                    &to,
                )?;
            }
            let webhook_port = listen_port()?;
            self.webhook_ports[i] = webhook_port;
            let sock = self.path(&format!("webhook-{l}.sock"));
            self.spawn_socat(
                &format!("relay-webhook-{l}-ns"),
                Some(Place::Api(i)),
                &format!("TCP-LISTEN:{WEBHOOK_PORT},bind=127.0.0.1,fork,reuseaddr"),
                &format!("UNIX-CONNECT:{sock}"),
            )?;
            self.spawn_socat(
                &format!("relay-webhook-{l}-host"),
                None,
                &format!("UNIX-LISTEN:{sock},fork,unlink-early,mode=600"),
                &format!("TCP:127.0.0.1:{webhook_port}"),
            )?;
        }
        for i in 0..2 {
            let l = api_letter(i);
            for (what, kubeconfig, user, tok) in [
                ("workers", self.kubeconfigs[i].clone(), "admin", token.clone()),
                ("kube-fence", self.fence_kubeconfigs[i].clone(), "admin", token.clone()),
            ] {
                let sock = self.path(&format!("{what}-{l}.sock"));
                for attempt in 1.. {
                    let port = listen_port()?;
                    let name = format!("relay-{what}-{l}-host");
                    self.spawn_socat(
                        &name,
                        None,
                        &format!("TCP-LISTEN:{port},bind=127.0.0.1,fork,reuseaddr"),
                        &format!("UNIX-CONNECT:{sock}"),
                    )?;
                    let server = format!("https://127.0.0.1:{port}");
                    std::thread::sleep(Duration::from_millis(200));
                    if self.exited(&name) {
                        if attempt < 5 {
                            self.components.pop();
                            continue;
                        }
                        bail!("starting {name}: socat exited; see {}", self.path(&format!("{name}.log")));
                    }
                    self.base.write_kubeconfig_to(&kubeconfig, &server, user, &tok)?;
                    if what == "workers" {
                        self.servers[i] = server;
                    }
                    break;
                }
            }
        }
        for i in 0..2 {
            let readyz = format!("{}/readyz", self.servers[i]);
            let default_ns = format!("{}/api/v1/namespaces/default", self.servers[i]);
            let what = format!("kube-apiserver {}", api_letter(i).to_ascii_uppercase());
            self.wait_until(&what, Duration::from_secs(120), |ha| ha.base.curl_ok(&readyz, true) && ha.base.curl_ok(&default_ns, true))?;
        }
        fs::copy(&self.kubeconfigs[0], self.base.dir.join("kubeconfig"))?;

        if opts.controller_manager {
            // In A's namespace, talking to A on its loopback: it fails with A, as it would on A's host.
            self.base.write_kubeconfig_to(
                &self.base.dir.join("kcm.kubeconfig"),
                &format!("https://127.0.0.1:{API_PORT}"),
                "system:kube-controller-manager",
                &kcm_token,
            )?;
            let args =
                self.base.controller_manager_args("*,-node-ipam-controller,-node-lifecycle-controller,-persistentvolume-binder-controller");
            say(opts.verbose, "starting kube-controller-manager (beside kube-apiserver A)");
            let kcm = self.bin_dir.join("kube-controller-manager");
            self.spawn("kube-controller-manager", Some(Place::Api(0)), &kcm, args)?;
        }
        Ok(())
    }

    fn spawn_socat(&mut self, name: &str, place: Option<Place>, from: &str, to: &str) -> Result<()> {
        self.spawn(name, place, Path::new("socat"), vec![from.to_string(), to.to_string()])
    }

    fn spawn(&mut self, name: &str, place: Option<Place>, program: &Path, args: Vec<String>) -> Result<()> {
        let log = self.base.dir.join(format!("{name}.log"));
        let mut c = Component { name: name.to_string(), place, child: None, log, program: program.to_path_buf(), args };
        self.launch(&mut c)?;
        self.components.push(c);
        Ok(())
    }

    fn launch(&self, c: &mut Component) -> Result<()> {
        let file = fs::OpenOptions::new().create(true).append(true).open(&c.log).with_context(|| format!("opening {}", c.log.display()))?;
        let mut cmd = Command::new(&c.program);
        cmd.args(&c.args).current_dir(&self.base.dir).stdin(Stdio::null()).stdout(file.try_clone()?).stderr(file);
        // SAFETY: setpgid, sigprocmask, signal and prctl are async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                libc::setpgid(0, 0);
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigprocmask(libc::SIG_SETMASK, &set, std::ptr::null_mut());
                libc::signal(libc::SIGPIPE, libc::SIG_DFL);
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        if let Some(place) = c.place {
            let fd = self.netns.get(&place).context("the namespace is not open")?.as_raw_fd();
            enter_on_exec(&mut cmd, fd);
        }
        c.child = Some(cmd.spawn().with_context(|| format!("starting {}", c.name))?);
        Ok(())
    }

    fn exited(&mut self, name: &str) -> bool {
        self.components
            .iter_mut()
            .find(|c| c.name == name)
            .and_then(|c| c.child.as_mut())
            .is_some_and(|ch| matches!(ch.try_wait(), Ok(Some(_))))
    }

    fn wait_until(&mut self, what: &str, limit: Duration, ready: impl Fn(&HaCluster) -> bool) -> Result<()> {
        let start = Instant::now();
        loop {
            if ready(self) {
                say(self.verbose, &format!("{what} is ready ({:.1}s)", start.elapsed().as_secs_f64()));
                return Ok(());
            }
            for c in &mut self.components {
                if let Some(child) = c.child.as_mut()
                    && let Some(status) = child.try_wait()?
                {
                    bail!(
                        "{} exited ({status}) while waiting for {what}; last lines of {}:\n{}",
                        c.name,
                        c.log.display(),
                        crate::tail(&c.log, 25)
                    );
                }
            }
            if start.elapsed() > limit {
                bail!("{what} was not ready after {limit:?}; logs in {}", self.base.dir.display());
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Runs `cmd` inside `place`'s namespace; its stdout when it succeeds.
    fn output_in(&self, place: Place, cmd: &mut Command) -> Option<String> {
        let fd = self.netns.get(&place)?.as_raw_fd();
        enter_on_exec(cmd, fd);
        let out = cmd.stdin(Stdio::null()).stderr(Stdio::null()).output().ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Whether etcd member `i` is running and answers `/health` true.
    pub fn etcd_healthy(&self, i: usize) -> bool {
        let url = format!("http://{}:2379/health", Place::Etcd(i).ip());
        self.output_in(Place::Etcd(i), Command::new("curl").args(["-s", "--max-time", "2", &url]))
            .is_some_and(|body| body.contains("\"health\":\"true\""))
    }

    /// The member that says it is the leader (`etcd_server_is_leader 1` in its metrics), asked
    /// from inside its own namespace.
    pub fn etcd_leader(&self) -> Option<usize> {
        (0..3).find(|&i| {
            let url = format!("http://{}:2379/metrics", Place::Etcd(i).ip());
            self.output_in(Place::Etcd(i), Command::new("curl").args(["-s", "--max-time", "2", &url]))
                .is_some_and(|m| m.lines().any(|l| l.trim() == "etcd_server_is_leader 1"))
        })
    }

    /// Whether API server `i` answers `/readyz` ok through the workers' relay.
    pub fn api_ready(&self, i: usize) -> bool {
        self.base.curl_ok(&format!("{}/readyz", self.servers[i]), true)
    }

    /// Names of the components (etcd-m1…3, kube-apiserver-a/b, kube-controller-manager, relay-…).
    pub fn component_names(&self) -> Vec<String> {
        self.components.iter().map(|c| c.name.clone()).collect()
    }

    /// PIDs of the running components, by name.
    pub fn pids(&self) -> Vec<(String, u32)> {
        self.components.iter().filter_map(|c| c.child.as_ref().map(|ch| (c.name.clone(), ch.id()))).collect()
    }

    /// Kills component `name` with SIGKILL, as a crash would; it stays down until [`HaCluster::start_again`].
    pub fn kill(&mut self, name: &str) -> Result<()> {
        let c = self.components.iter_mut().find(|c| c.name == name).with_context(|| format!("killing {name}: no such component"))?;
        if let Some(mut child) = c.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        Ok(())
    }

    /// Starts a killed component again, with the same flags, namespace and state.
    pub fn start_again(&mut self, name: &str) -> Result<()> {
        let index = self.components.iter().position(|c| c.name == name).with_context(|| format!("restarting {name}: no such component"))?;
        let mut c = self.components.remove(index);
        if c.child.is_none() {
            if let Ok(file) = fs::OpenOptions::new().append(true).open(&c.log) {
                use std::io::Write as _;
                let _ = writeln!(&file, "----- started again by HaCluster::start_again -----");
            }
            let launched = self.launch(&mut c);
            self.components.insert(index, c);
            launched?;
        } else {
            self.components.insert(index, c);
        }
        Ok(())
    }

    /// Cuts the network as `p` says; [`HaCluster::heal`] undoes every cut.
    pub fn partition(&mut self, p: Partition) -> Result<()> {
        let result = match &p {
            Partition::ClientFromApi { api, source } => {
                let (clients, server) = (Place::Clients.ns(), Place::Api(*api).ns());
                let (from, to) = (source.ip().to_string(), Place::Api(*api).ip().to_string());
                ip(&["-n", &clients, "rule", "add", "from", &from, "to", &to, "blackhole"])
                    .and_then(|()| ip(&["-n", &server, "route", "add", "blackhole", &from]))
            }
            Partition::ApiFromEtcd { api, members } => members.iter().try_for_each(|m| {
                let (a, e) = (Place::Api(*api), Place::Etcd(*m));
                ip(&["-n", &a.ns(), "route", "add", "blackhole", &e.ip().to_string()])
                    .and_then(|()| ip(&["-n", &e.ns(), "route", "add", "blackhole", &a.ip().to_string()]))
            }),
            Partition::EtcdIsolated { member } => ip(&["-n", &Place::Etcd(*member).ns(), "link", "set", "eth0", "down"]),
        };
        // Recorded even when half made, so heal undoes that half.
        self.partitions.push(p.clone());
        result.with_context(|| format!("making the partition {p}"))
    }

    /// The cuts in place.
    pub fn partitions(&self) -> &[Partition] {
        &self.partitions
    }

    /// Undoes every cut (idempotent: what is already undone is skipped).
    pub fn heal(&mut self) -> Result<()> {
        let mut problems = Vec::new();
        for p in std::mem::take(&mut self.partitions) {
            match &p {
                Partition::ClientFromApi { api, source } => {
                    let (from, to) = (source.ip().to_string(), Place::Api(*api).ip().to_string());
                    let _ = ip(&["-n", &Place::Clients.ns(), "rule", "del", "from", &from, "to", &to, "blackhole"]);
                    let _ = ip(&["-n", &Place::Api(*api).ns(), "route", "del", "blackhole", &from]);
                }
                Partition::ApiFromEtcd { api, members } => {
                    for m in members {
                        let (a, e) = (Place::Api(*api), Place::Etcd(*m));
                        let _ = ip(&["-n", &a.ns(), "route", "del", "blackhole", &e.ip().to_string()]);
                        let _ = ip(&["-n", &e.ns(), "route", "del", "blackhole", &a.ip().to_string()]);
                    }
                }
                Partition::EtcdIsolated { member } => {
                    if let Err(e) = ip(&["-n", &Place::Etcd(*member).ns(), "link", "set", "eth0", "up"]) {
                        problems.push(format!("{e:#}"));
                    }
                }
            }
        }
        // Whatever a half-made cut left: no blackhole route or rule may survive a heal.
        for place in Place::ALL {
            if self.output_in(place, Command::new("ip").args(["route", "show", "type", "blackhole"])).is_some_and(|o| !o.trim().is_empty())
                || self.output_in(place, Command::new("ip").args(["rule", "show"])).is_some_and(|o| o.contains("blackhole"))
            {
                problems.push(format!("a cut survived in {}", place.ns()));
            }
        }
        if problems.is_empty() { Ok(()) } else { bail!("healing the partitions: {}", problems.join("; ")) }
    }

    /// The exports for a shell: `KUBECONFIG` (A), each API server's kubeconfig, kube-fence's and
    /// the webhook ports.
    pub fn write_env(&self, out: &mut impl std::io::Write) -> std::io::Result<()> {
        crate::write_env(out, &self.kubeconfigs[0], &self.bin_dir)?;
        writeln!(out, "export KF_HA_KUBECONFIG_A={}", self.kubeconfigs[0].display())?;
        writeln!(out, "export KF_HA_KUBECONFIG_B={}", self.kubeconfigs[1].display())?;
        writeln!(out, "export KF_HA_FENCE_KUBECONFIG_A={}", self.fence_kubeconfigs[0].display())?;
        writeln!(out, "export KF_HA_FENCE_KUBECONFIG_B={}", self.fence_kubeconfigs[1].display())?;
        writeln!(out, "export KF_HA_WEBHOOK_PORT_A={}", self.webhook_ports[0])?;
        writeln!(out, "export KF_HA_WEBHOOK_PORT_B={}", self.webhook_ports[1])?;
        writeln!(out, "export KF_HA_WEBHOOK_URL=https://127.0.0.1:{WEBHOOK_PORT}")
    }

    /// Stops every process (SIGTERM, then SIGKILL), removes the namespaces (links and routes go
    /// with them) and, if this cluster made it, the state directory.
    pub fn stop(&mut self) {
        while let Some(mut c) = self.components.pop() {
            if let Some(mut child) = c.child.take() {
                let pid = child.id() as i32;
                crate::terminate(&mut child, -pid);
                // SAFETY: kill(2) on a process group this process created.
                unsafe { libc::kill(-pid, libc::SIGKILL) };
            }
        }
        self.netns.clear();
        if let Err(e) = remove_namespaces(self.verbose) {
            eprintln!("[ha] {e:#}");
        }
        self._lock = None;
        if self.remove_dir {
            let _ = fs::remove_dir_all(&self.base.dir);
        }
    }
}

impl Drop for HaCluster {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_place_has_its_own_namespace_and_address_in_the_subnet() {
        let mut names: Vec<String> = Place::ALL.iter().map(|p| p.ns()).collect();
        let mut ips: Vec<Ipv4Addr> = Place::ALL.iter().map(|p| p.ip()).chain([KUBE_FENCE_IP]).collect();
        assert!(names.iter().all(|n| n.starts_with(NS_PREFIX) && n.len() <= 15), "{names:?}");
        assert!(ips.iter().all(|ip| ip.octets()[..3] == [10, 97, 0]), "{ips:?}");
        names.sort();
        names.dedup();
        ips.sort();
        ips.dedup();
        assert_eq!(names.len(), Place::ALL.len());
        assert_eq!(ips.len(), Place::ALL.len() + 1);
        assert!(!names.contains(&BRIDGE_NS.to_string()));
    }

    #[test]
    fn missing_host_tools_are_named_with_their_packages() {
        let dir = tempfile::tempdir().unwrap();
        let with = |tools: &[&str]| {
            for t in tools {
                fs::write(dir.path().join(t), "").unwrap();
            }
            missing_tools(&std::env::join_paths([Path::new("/nonexistent"), dir.path()]).unwrap())
        };
        assert_eq!(with(&[]), HOST_TOOLS.to_vec());
        assert_eq!(with(&["ip", "curl"]), vec![("socat", "socat")]);
        assert_eq!(with(&["socat"]), vec![]);
        assert_eq!(missing_tools(std::ffi::OsStr::new("")), HOST_TOOLS.to_vec());
    }

    #[test]
    fn a_partition_says_what_it_cuts() {
        assert_eq!(Partition::ClientFromApi { api: 1, source: Source::KubeFence }.to_string(), "KubeFence cut from kube-apiserver b");
        assert_eq!(Partition::ApiFromEtcd { api: 0, members: vec![0, 2] }.to_string(), "kube-apiserver a cut from etcd m1,m3");
        assert_eq!(Partition::EtcdIsolated { member: 1 }.to_string(), "etcd m2 isolated");
    }
}
