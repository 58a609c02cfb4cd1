//! A real Kubernetes control plane on loopback — etcd, kube-apiserver and
//! kube-controller-manager built from pinned Go modules (`hack/build-control-plane.sh`) — for
//! kube-fence's tests and for people trying kube-fence without a cluster.
//!
//! Node mode ([`Options::node`], `kf-env up --node`) runs a whole single-node cluster instead —
//! also kube-scheduler, containerd, kubelet and kube-proxy — in a network namespace of its own
//! with no route out, so Pods, Services and in-cluster API access really work; see [`node`].
//!
//! Two ways in:
//! - [`ControlPlane::start`] starts one and stops it (removing its files) when dropped.
//! - [`shared_kubeconfig`] gives every test in a test binary the same cluster: the one in
//!   `KUBECONFIG` when that is set (kind, a real cluster, or one `kf-env up` started), otherwise a
//!   control plane started on first use and stopped when the test process exits — however it
//!   exits: its processes are bound to the test process with `PR_SET_PDEATHSIG`.
// The module overviews name the private modules that do the work; `cargo doc
// --document-private-items` resolves them.
#![allow(rustdoc::private_intra_doc_links)]

pub mod ha;
pub mod node;
mod pki;
mod template;

use std::fs;
use std::io::Write;
use std::net::TcpListener;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};

/// Where the control-plane binaries come from: `KUBE_FENCE_BIN_DIR` when it holds them, else
/// built (or found cached) by `hack/build-control-plane.sh` — once per process. Rust code and
/// `kf-env build` get the binaries here; the scripts that need what kf-env does not build (the
/// kind node image's kubeadm: `hack/kind-node-image.sh` runs it with `--kind`), or that run where
/// kf-env may not be built (`hack/kind-e2e.sh` and `hack/release.sh`, for kubectl and helm when
/// none is on PATH), run the script themselves. It holds a lock, so concurrent callers wait for
/// one build instead of building twice.
pub fn binaries() -> Result<PathBuf> {
    binaries_for(false)
}

/// [`binaries`], with `node` also kubelet, kube-scheduler and kube-proxy (`--node`). Once per
/// process and mode: the script is quick when cached, but tests ask for the binaries often.
pub fn binaries_for(node: bool) -> Result<PathBuf> {
    static DIRS: [OnceLock<Result<PathBuf, String>>; 2] = [OnceLock::new(), OnceLock::new()];
    DIRS[usize::from(node)].get_or_init(|| build_binaries(node).map_err(|e| format!("{e:#}"))).clone().map_err(|e| anyhow::anyhow!(e))
}

/// What `hack/build-control-plane.sh` builds, and with `--node` also.
const PLAIN_BINARIES: [&str; 5] = ["etcd", "kube-apiserver", "kube-controller-manager", "kubectl", "helm"];
const NODE_BINARIES: [&str; 3] = ["kubelet", "kube-scheduler", "kube-proxy"];

fn build_binaries(node: bool) -> Result<PathBuf> {
    // Given (by `kf-env up`'s exports or a script that asked `kf-env build` once): used as is
    // when it holds everything this mode needs.
    if let Ok(dir) = std::env::var("KUBE_FENCE_BIN_DIR").map(PathBuf::from) {
        let needed = PLAIN_BINARIES.iter().chain(if node { &NODE_BINARIES[..] } else { &[] });
        if needed.into_iter().all(|b| dir.join(b).is_file()) {
            return Ok(dir);
        }
    }
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../hack/build-control-plane.sh");
    let out = Command::new("bash")
        .arg(&script)
        .args(node.then_some("--node"))
        .stderr(Stdio::inherit())
        .output()
        .with_context(|| format!("running {}", script.display()))?;
    if !out.status.success() {
        bail!("{} failed ({}); see its messages above", script.display(), out.status);
    }
    let dir = String::from_utf8(out.stdout)?.lines().last().unwrap_or_default().trim().to_string();
    if dir.is_empty() {
        bail!("{} printed no binary directory", script.display());
    }
    Ok(PathBuf::from(dir))
}

/// Options for [`ControlPlane::start`].
#[derive(Clone, Debug)]
pub struct Options {
    /// Directory that holds the binaries (default: build or reuse them with [`binaries`]).
    pub bin_dir: Option<PathBuf>,
    /// State directory (default: a fresh temporary directory, removed on stop).
    pub state_dir: Option<PathBuf>,
    /// Also run kube-controller-manager (garbage collection, namespace deletion).
    pub controller_manager: bool,
    /// Kill the processes when the process that started them dies (`PR_SET_PDEATHSIG`). That
    /// signal follows the *thread* that spawned them, so start from a thread that lives as long
    /// as the process (see [`shared_kubeconfig`]).
    pub die_with_parent: bool,
    /// Print progress to stderr.
    pub verbose: bool,
    /// Node mode: run the whole cluster — also kube-scheduler, containerd, kubelet and
    /// kube-proxy — in a network namespace of its own, so Pods and Services really run (see
    /// [`node`]). Needs root, the `--node` binaries and the Debian packages
    /// `hack/node-prereqs.sh` installs. One node per machine.
    pub node: bool,
}

impl Default for Options {
    fn default() -> Self {
        Options { bin_dir: None, state_dir: None, controller_manager: true, die_with_parent: false, verbose: true, node: false }
    }
}

const AUDIT_POLICY_FILE: &str = "audit-policy.yaml";
/// The audit log's name, in the state directory beside the kubeconfig.
pub const AUDIT_LOG_FILE: &str = "audit.log";

/// What every API server started here keeps in its audit log: every ConfigMap write, at
/// `Metadata` (who, what, the answer's code, and the admission webhooks' audit annotations —
/// kube-fence names the Lease's holder and the Lease version it read when it admits a write for
/// the holder); nothing else. The HA torture run tells by them a create that commits after a
/// takeover but was judged before it (docs/design.md §6b).
pub const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    verbs: [create, update, patch, delete, deletecollection]
    resources:
      - group: \"\"
        resources: [configmaps]
  - level: None
";

/// The kube-apiserver flags that differ between plain and node mode.
pub(crate) struct ApiServerFlags<'a> {
    pub etcd: &'a str,
    pub bind: &'a str,
    pub advertise: &'a str,
    pub port: u16,
    pub issuer: &'a str,
    pub service_cidr: &'a str,
    pub endpoint_reconciler: &'a str,
    /// Where the API server writes its audit log ([`AUDIT_POLICY`]).
    pub audit_log: &'a str,
}

struct Component {
    name: &'static str,
    child: Child,
    log: PathBuf,
    /// How it was started, so [`ControlPlane::restart`] can start it again the same way.
    program: std::ffi::OsString,
    args: Vec<std::ffi::OsString>,
    cwd: Option<PathBuf>,
    die_with_parent: bool,
}

/// A running control plane. Dropping it stops every process and removes its state directory.
pub struct ControlPlane {
    dir: PathBuf,
    remove_dir: bool,
    components: Vec<Component>,
    /// `https://127.0.0.1:<port>`
    pub server: String,
    /// Admin kubeconfig (bearer token, group system:masters).
    pub kubeconfig: PathBuf,
    /// The CA that signed the API server's certificate, PEM.
    pub ca_pem: String,
    /// Versions of the binaries.
    pub bin_dir: PathBuf,
    /// Node mode: containerd's socket (for `ctr --address`, or `CONTAINERD_ADDRESS`).
    pub containerd_address: Option<PathBuf>,
    node: Option<node::NodeRun>,
    /// Node mode got far enough to change the host: stop must undo it.
    node_mode: bool,
}

/// A port on 127.0.0.1 for a server that binds it itself, free now, and outside the range the
/// kernel hands out to outgoing connections and `bind(0)` (`ip_local_port_range`): no client
/// on the machine can take it in between, only another program that picks ports the same
/// way, which a start retried on a clash survives ([`is_bind_conflict`]).
pub fn listen_port() -> Result<u16> {
    let (low, _) = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|r| {
            let mut parts = r.split_whitespace().map(|p| p.parse::<u16>().ok());
            Some((parts.next()??, parts.next()??))
        })
        .unwrap_or((32768, 60999));
    // Above the well-known and the usual service ports, below the ephemeral range.
    let (from, to) = (10_000u16, low.max(10_001));
    for _ in 0..100 {
        let mut bytes = [0u8; 2];
        std::io::Read::read_exact(&mut fs::File::open("/dev/urandom")?, &mut bytes)?;
        let port = from + u16::from_le_bytes(bytes) % (to - from);
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    bail!("no free port in {from}..{to} on 127.0.0.1 after 100 tries")
}

/// Whether a component's log says it could not bind its port because another process has it
/// (Go's "address already in use", socat's "Address already in use").
pub fn is_bind_conflict(log: &str) -> bool {
    log.to_ascii_lowercase().contains("address already in use")
}

pub(crate) fn random_hex(bytes: usize) -> Result<String> {
    let mut buf = vec![0u8; bytes];
    std::io::Read::read_exact(&mut fs::File::open("/dev/urandom")?, &mut buf)?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

pub(crate) fn write_private(path: &Path, contents: &str) -> Result<()> {
    fs::write(path, contents).with_context(|| format!("writing {}", path.display()))?;
    fs::set_permissions(path, fs::Permissions::from_mode(0o600))?;
    Ok(())
}

impl ControlPlane {
    /// Starts etcd, kube-apiserver and (optionally) kube-controller-manager on free loopback
    /// ports and waits until the API answers `/readyz` and namespace `default` exists.
    pub fn start(opts: Options) -> Result<ControlPlane> {
        if opts.node {
            node::prerequisites()?;
        }
        let bin_dir = match &opts.bin_dir {
            Some(d) => d.clone(),
            None => binaries_for(opts.node)?,
        };
        for b in ["etcd", "kube-apiserver", "kube-controller-manager"] {
            if !bin_dir.join(b).is_file() {
                bail!("{} is missing: run `kf-env build`", bin_dir.join(b).display());
            }
        }
        let (dir, remove_dir) = match &opts.state_dir {
            Some(d) => {
                fs::create_dir_all(d)?;
                (d.clone(), false)
            }
            None => (tempfile::Builder::new().prefix("kube-fence-cp.").tempdir()?.keep(), true),
        };
        // Paths in the state directory end up in unix socket addresses (at most 107 bytes).
        let dir = if opts.node { fs::canonicalize(&dir)? } else { dir };
        let mut cp = ControlPlane {
            dir: dir.clone(),
            remove_dir,
            components: Vec::new(),
            server: String::new(),
            kubeconfig: dir.join("kubeconfig"),
            ca_pem: String::new(),
            bin_dir: bin_dir.clone(),
            containerd_address: None,
            node: None,
            node_mode: false,
        };
        // On any error below, dropping `cp` stops what was started.
        if opts.node {
            cp.start_node(&opts)?;
        } else {
            cp.start_components(&opts)?;
        }
        Ok(cp)
    }

    fn say(&self, opts: &Options, msg: &str) {
        if opts.verbose {
            eprintln!("[control plane] {msg}");
        }
    }

    /// Writes the PKI and the static token file into the state directory; returns the admin and
    /// kube-controller-manager tokens.
    ///
    /// kube-controller-manager runs as its own user (bound by the API server's bootstrap RBAC)
    /// and gives each controller its own service account, as kubeadm clusters do: the webhook's
    /// exemptions name those identities (generic-garbage-collector, namespace-controller), so
    /// tests must see the real ones.
    pub(crate) fn write_credentials(&mut self, pki: &pki::Pki) -> Result<(String, String)> {
        let token = random_hex(24)?;
        let kcm_token = random_hex(24)?;
        for (name, contents) in [
            ("ca.crt", &pki.ca_cert_pem),
            ("ca.key", &pki.ca_key_pem),
            ("apiserver.crt", &pki.serving_cert_pem),
            ("apiserver.key", &pki.serving_key_pem),
            ("sa.key", &pki.sa_key_pem),
            ("sa.pub", &pki.sa_pub_pem),
            ("kubelet-client.crt", &pki.kubelet_client_cert_pem),
            ("kubelet-client.key", &pki.kubelet_client_key_pem),
        ] {
            write_private(&self.dir.join(name), contents)?;
        }
        write_private(
            &self.dir.join("tokens.csv"),
            &format!("{token},admin,admin,system:masters\n{kcm_token},system:kube-controller-manager,system:kube-controller-manager\n"),
        )?;
        write_private(&self.dir.join(AUDIT_POLICY_FILE), AUDIT_POLICY)?;
        self.ca_pem = pki.ca_cert_pem.clone();
        Ok((token, kcm_token))
    }

    /// The audit log of the API server of a plain or node control plane ([`AUDIT_POLICY`]; JSON
    /// lines).
    pub fn audit_log(&self) -> PathBuf {
        self.dir.join(AUDIT_LOG_FILE)
    }

    /// kube-controller-manager's flags, the same in plain and node mode but for `controllers`
    /// (1.37 names end in `-controller`; the IPAM and volume binder controllers have nothing to
    /// manage here).
    pub(crate) fn controller_manager_args(&self, controllers: &str) -> Vec<String> {
        let kc = self.dir.join("kcm.kubeconfig").display().to_string();
        let p = |n: &str| self.dir.join(n).display().to_string();
        [
            "--kubeconfig",
            &kc,
            "--authentication-kubeconfig",
            &kc,
            "--authorization-kubeconfig",
            &kc,
            "--bind-address",
            "127.0.0.1",
            "--secure-port",
            "0",
            "--service-account-private-key-file",
            &p("sa.key"),
            "--root-ca-file",
            &p("ca.crt"),
            "--use-service-account-credentials=true",
            "--leader-elect=false",
            "--controllers",
            controllers,
            "--v",
            "0",
        ]
        .iter()
        .map(|a| a.to_string())
        .collect()
    }

    /// etcd's flags, the same in plain and node mode but for its URLs and `extra`.
    pub(crate) fn etcd_args(&self, client_url: &str, peer_url: &str, extra: &[&str]) -> Vec<String> {
        let data_dir = self.dir.join("etcd").display().to_string();
        let cluster = format!("kube-fence={peer_url}");
        let args = [
            "--name",
            "kube-fence",
            "--data-dir",
            &data_dir,
            "--listen-client-urls",
            client_url,
            "--advertise-client-urls",
            client_url,
            "--listen-peer-urls",
            peer_url,
            "--initial-advertise-peer-urls",
            peer_url,
            "--initial-cluster",
            &cluster,
        ];
        let tail = ["--unsafe-no-fsync", "--log-level", "warn"];
        args.iter().chain(extra).chain(&tail).map(|a| a.to_string()).collect()
    }

    /// kube-apiserver's flags: what differs between plain and node mode is in `flags`, and node
    /// mode adds `extra`. Credentials are the files [`ControlPlane::write_credentials`] wrote.
    pub(crate) fn apiserver_args(&self, flags: &ApiServerFlags<'_>, extra: &[&str]) -> Vec<String> {
        let p = |n: &str| self.dir.join(n).display().to_string();
        let port = flags.port.to_string();
        let policy = p(AUDIT_POLICY_FILE);
        let args = [
            "--etcd-servers",
            flags.etcd,
            "--bind-address",
            flags.bind,
            "--advertise-address",
            flags.advertise,
            "--secure-port",
            &port,
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
            flags.issuer,
            "--service-account-key-file",
            &p("sa.pub"),
            "--service-account-signing-key-file",
            &p("sa.key"),
            "--service-cluster-ip-range",
            flags.service_cidr,
            "--endpoint-reconciler-type",
            flags.endpoint_reconciler,
            "--audit-policy-file",
            &policy,
            "--audit-log-path",
            flags.audit_log,
            "--audit-log-format",
            "json",
        ];
        let tail = ["--allow-privileged=true", "--v", "0"];
        args.iter().copied().chain(extra.iter().copied()).chain(tail).map(str::to_string).collect()
    }

    fn start_components(&mut self, opts: &Options) -> Result<()> {
        let started = Instant::now();
        let dir = self.dir.clone();
        let (token, kcm_token) = self.write_credentials(&pki::generate(&[], &[])?)?;

        // etcd on unix sockets in the state directory: no port to race for. etcd wants
        // `unix://host:port` and makes the socket file `host:port` in its working directory (the
        // state directory, for it and for the kube-apiserver that connects).
        self.say(opts, &format!("starting etcd on unix sockets (state in {})", dir.display()));
        let (etcd_url, etcd_socket) = ("unix://etcd-client:0", dir.join("etcd-client:0"));
        let mut etcd = Command::new(self.bin_dir.join("etcd"));
        etcd.args(self.etcd_args(etcd_url, "unix://etcd-peer:0", &[])).current_dir(&dir);
        self.spawn(opts, "etcd", &mut etcd)?;
        self.wait_until(opts, "etcd", Duration::from_secs(30), |cp| cp.curl_unix_ok(&etcd_socket, "/health"))?;

        // kube-apiserver on a port outside the ephemeral range (no client takes it in between);
        // should another program bind it first all the same, it is started again on another.
        for attempt in 1.. {
            let api_port = listen_port()?;
            self.server = format!("https://127.0.0.1:{api_port}");
            self.write_kubeconfig(&self.kubeconfig, "admin", &token)?;
            self.write_kubeconfig(&dir.join("kcm.kubeconfig"), "system:kube-controller-manager", &kcm_token)?;
            self.say(opts, &format!("starting kube-apiserver on {}", self.server));
            let mut apiserver = Command::new(self.bin_dir.join("kube-apiserver"));
            apiserver
                .args(self.apiserver_args(
                    &ApiServerFlags {
                        etcd: etcd_url,
                        bind: "127.0.0.1",
                        advertise: "127.0.0.1",
                        port: api_port,
                        issuer: &format!("{}/", self.server),
                        service_cidr: "10.0.0.0/24",
                        // Required on 1.37 with a loopback advertise address: with the default
                        // reconciler the API server refuses to start ("may not be in the loopback range").
                        endpoint_reconciler: "none",
                        audit_log: &self.audit_log().display().to_string(),
                    },
                    &[],
                ))
                .current_dir(&dir);
            self.spawn(opts, "kube-apiserver", &mut apiserver)?;
            let readyz = format!("{}/readyz", self.server);
            let default_ns = format!("{}/api/v1/namespaces/default", self.server);
            match self.wait_until(opts, "kube-apiserver", Duration::from_secs(90), |cp| {
                cp.curl_ok(&readyz, true) && cp.curl_ok(&default_ns, true)
            }) {
                Ok(()) => break,
                Err(err) if attempt < 5 && self.lost_its_port("kube-apiserver") => {
                    self.say(opts, &format!("port {api_port} was taken before kube-apiserver bound it; another port ({err:#})"));
                }
                Err(err) => return Err(err),
            }
        }

        if opts.controller_manager {
            self.say(opts, "starting kube-controller-manager (garbage collector, namespace controller)");
            // No node here: its lifecycle controller would only mark a node that never comes.
            // `--secure-port 0`: it listens on no port.
            let args =
                self.controller_manager_args("*,-node-ipam-controller,-node-lifecycle-controller,-persistentvolume-binder-controller");
            self.spawn(opts, "kube-controller-manager", Command::new(self.bin_dir.join("kube-controller-manager")).args(args))?;
        }
        self.say(opts, &format!("ready in {:.1}s; KUBECONFIG={}", started.elapsed().as_secs_f64(), self.kubeconfig.display()));
        Ok(())
    }

    /// Whether component `name`, the last started, exited because its port was taken; if so it
    /// is forgotten (so it can be started again).
    fn lost_its_port(&mut self, name: &str) -> bool {
        let Some(last) = self.components.last_mut().filter(|c| c.name == name) else { return false };
        let exited = matches!(last.child.try_wait(), Ok(Some(_)));
        if exited && is_bind_conflict(&fs::read_to_string(&last.log).unwrap_or_default()) {
            let log = last.log.clone();
            self.components.pop();
            if let Ok(file) = fs::OpenOptions::new().append(true).open(&log) {
                let _ = writeln!(&file, "----- its port was taken: started again on another -----");
            }
            return true;
        }
        false
    }

    fn write_kubeconfig(&self, path: &Path, user: &str, token: &str) -> Result<()> {
        self.write_kubeconfig_to(path, &self.server, user, token)
    }

    fn write_kubeconfig_to(&self, path: &Path, server: &str, user: &str, token: &str) -> Result<()> {
        use base64::Engine as _;
        let ca_data = base64::engine::general_purpose::STANDARD.encode(self.ca_pem.as_bytes());
        let kubeconfig =
            template::render(template::KUBECONFIG, &[("server", server), ("ca_data", &ca_data), ("user", user), ("token", token)])?;
        write_private(path, &kubeconfig)
    }

    fn spawn(&mut self, opts: &Options, name: &'static str, cmd: &mut Command) -> Result<()> {
        let log = self.dir.join(format!("{name}.log"));
        let file = fs::OpenOptions::new().create(true).append(true).open(&log)?;
        cmd.stdin(Stdio::null()).stdout(file.try_clone()?).stderr(file);
        if opts.die_with_parent {
            // SAFETY: prctl is async-signal-safe; nothing else runs between fork and exec.
            unsafe {
                cmd.pre_exec(|| {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        let child = cmd.spawn().with_context(|| format!("starting {name}"))?;
        let (program, args) = (cmd.get_program().to_owned(), cmd.get_args().map(ToOwned::to_owned).collect());
        let cwd = cmd.get_current_dir().map(Path::to_path_buf);
        self.components.push(Component { name, child, log, program, args, cwd, die_with_parent: opts.die_with_parent });
        Ok(())
    }

    /// Kills one component (`etcd`, `kube-apiserver`, `kube-controller-manager`) with SIGKILL,
    /// as a crash would, and starts it again with the same flags, ports and state (its log is
    /// appended to). Returns once the new process runs; the caller waits for it to serve, as
    /// any client of a restarting control plane must. For fault-injection tests.
    pub fn restart(&mut self, name: &str) -> Result<()> {
        let Some(index) = self.components.iter().position(|c| c.name == name) else { bail!("no component {name}") };
        let mut old = self.components.remove(index);
        let _ = old.child.kill();
        let _ = old.child.wait();
        let file = fs::OpenOptions::new().append(true).open(&old.log)?;
        writeln!(&file, "----- restarted by ControlPlane::restart -----")?;
        let mut cmd = Command::new(&old.program);
        cmd.args(&old.args);
        if let Some(cwd) = &old.cwd {
            cmd.current_dir(cwd);
        }
        let opts = Options { die_with_parent: old.die_with_parent, ..Options::default() };
        self.spawn(&opts, old.name, &mut cmd)?;
        if let Some(c) = self.components.pop() {
            self.components.insert(index, c);
        }
        Ok(())
    }

    fn wait_until(&mut self, opts: &Options, what: &str, limit: Duration, ready: impl Fn(&ControlPlane) -> bool) -> Result<()> {
        let start = Instant::now();
        let mut last_note = Instant::now();
        loop {
            if ready(self) {
                self.say(opts, &format!("{what} is ready ({:.1}s)", start.elapsed().as_secs_f64()));
                return Ok(());
            }
            for c in &mut self.components {
                if let Some(status) = c.child.try_wait()? {
                    bail!("{} exited ({status}) while starting; last lines of {}:\n{}", c.name, c.log.display(), tail(&c.log, 25));
                }
            }
            if start.elapsed() > limit {
                let log = self.components.last().map(|c| c.log.clone()).unwrap_or_default();
                bail!("{what} was not ready after {limit:?}; last lines of {}:\n{}", log.display(), tail(&log, 25));
            }
            if last_note.elapsed() > Duration::from_secs(10) {
                self.say(opts, &format!("still waiting for {what} ({:.0}s)", start.elapsed().as_secs_f64()));
                last_note = Instant::now();
            }
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    /// Whether `path` on the HTTP server at unix socket `socket` answers 2xx.
    fn curl_unix_ok(&self, socket: &Path, path: &str) -> bool {
        let mut cmd = Command::new("curl");
        cmd.args(["-sf", "-o", "/dev/null", "--max-time", "3", "--unix-socket"]).arg(socket);
        cmd.arg(format!("http://localhost{path}")).stdout(Stdio::null()).stderr(Stdio::null());
        cmd.status().map(|s| s.success()).unwrap_or(false)
    }

    fn curl_ok(&self, url: &str, tls: bool) -> bool {
        let mut cmd = Command::new("curl");
        cmd.args(["-sf", "-o", "/dev/null", "--max-time", "3"]);
        if tls {
            cmd.arg("--cacert").arg(self.dir.join("ca.crt"));
            if let Ok(tokens) = fs::read_to_string(self.dir.join("tokens.csv")) {
                let token = tokens.split(',').next().unwrap_or_default().to_string();
                cmd.arg("-H").arg(format!("Authorization: Bearer {token}"));
            }
        }
        cmd.arg(url).stdout(Stdio::null()).stderr(Stdio::null()).status().map(|s| s.success()).unwrap_or(false)
    }

    /// The state directory (certificates, kubeconfig, logs).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// PIDs of the running components, by name.
    pub fn pids(&self) -> Vec<(&'static str, u32)> {
        self.components.iter().map(|c| (c.name, c.child.id())).collect()
    }

    /// Stops every component (SIGTERM, then SIGKILL after 10 s), newest first, and removes the
    /// state directory if this control plane created it.
    pub fn stop(&mut self) {
        if self.node_mode {
            self.node_mode = false;
            let problems = self.stop_node(true);
            if !problems.is_empty() {
                eprintln!("[node] could not undo everything: {}", problems.join("; "));
            }
            return;
        }
        while let Some(mut c) = self.components.pop() {
            let pid = c.child.id() as i32;
            terminate(&mut c.child, pid);
        }
        if self.remove_dir {
            let _ = fs::remove_dir_all(&self.dir);
        }
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Sends SIGTERM to `target` (the child's pid, or `-pgid` for its whole process group), waits up
/// to 10 s for the child to exit, then kills and reaps it.
pub(crate) fn terminate(child: &mut Child, target: i32) {
    // SAFETY: kill(2) on a child we started and have not reaped (or on its process group).
    unsafe { libc::kill(target, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match child.try_wait() {
            Ok(Some(_)) | Err(_) => return,
            Ok(None) if Instant::now() > deadline => {
                let _ = child.kill();
                let _ = child.wait();
                return;
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}

fn tail(path: &Path, lines: usize) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

static SHARED: OnceLock<Result<PathBuf, String>> = OnceLock::new();
static SHARED_CP: Mutex<Option<ControlPlane>> = Mutex::new(None);

extern "C" fn stop_shared_at_exit() {
    if let Some(mut cp) = SHARED_CP.lock().ok().and_then(|mut guard| guard.take()) {
        cp.stop();
    }
}

/// The kubeconfig every test in this process shares: `KUBECONFIG` when it is set, else a local
/// control plane started on first call. Panics with the reason when none can be had: a test
/// that needs a cluster and has none must fail loudly, never pass by skipping.
pub fn shared_kubeconfig() -> PathBuf {
    let result = SHARED.get_or_init(|| {
        if let Some(path) = std::env::var("KUBECONFIG").ok().filter(|p| !p.is_empty()) {
            return Ok(PathBuf::from(path));
        }
        // Start from a thread that lives as long as the process, so PR_SET_PDEATHSIG (which
        // fires when the *spawning thread* exits) fires only when the test process dies.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("kube-fence-control-plane".into())
            .spawn(move || {
                let started = ControlPlane::start(Options { die_with_parent: true, ..Options::default() });
                match started {
                    Ok(cp) => {
                        let path = cp.kubeconfig.clone();
                        if let Ok(mut guard) = SHARED_CP.lock() {
                            *guard = Some(cp);
                        }
                        // SAFETY: registering a plain extern "C" fn with atexit(3).
                        unsafe { libc::atexit(stop_shared_at_exit) };
                        let _ = tx.send(Ok(path));
                    }
                    Err(e) => {
                        let _ = tx.send(Err(format!("{e:#}")));
                    }
                }
                loop {
                    std::thread::park();
                }
            })
            .map_err(|e| e.to_string())?;
        rx.recv().map_err(|e| e.to_string())?
    });
    match result {
        Ok(p) => p.clone(),
        Err(e) => panic!("no Kubernetes control plane for the tests: {e}"),
    }
}

/// Writes `export NAME=value` lines for a shell: `KUBECONFIG`, and the binaries' directory on
/// `PATH` and as `KUBE_FENCE_BIN_DIR` (so tests and scripts run under these exports use these
/// binaries instead of building again).
pub fn write_env(out: &mut impl Write, kubeconfig: &Path, bin_dir: &Path) -> std::io::Result<()> {
    writeln!(out, "export KUBECONFIG={}", kubeconfig.display())?;
    writeln!(out, "export KUBE_FENCE_BIN_DIR={}", bin_dir.display())?;
    writeln!(out, "export PATH={}:$PATH", bin_dir.display())
}

/// [`write_env`] for a node: also `CONTAINERD_ADDRESS` and `CONTAINERD_NAMESPACE=k8s.io`, which
/// `ctr` reads, so `ctr images import <tarball>` loads an image where the kubelet finds it.
pub fn write_node_env(out: &mut impl Write, kubeconfig: &Path, bin_dir: &Path, containerd_address: &Path) -> std::io::Result<()> {
    write_env(out, kubeconfig, bin_dir)?;
    writeln!(out, "export CONTAINERD_ADDRESS={}", containerd_address.display())?;
    writeln!(out, "export CONTAINERD_NAMESPACE=k8s.io")
}

/// The memory the cluster's processes use: resident set size per process (components, shims,
/// pods), in bytes, summed by name. Node mode only finds shims and pods.
pub fn rss_by_process(pids: impl IntoIterator<Item = u32>) -> Vec<(String, u64)> {
    let mut v: Vec<(String, u64)> = Vec::new();
    for pid in pids {
        let Ok(status) = fs::read_to_string(format!("/proc/{pid}/status")) else { continue };
        let name = status.lines().find_map(|l| l.strip_prefix("Name:")).unwrap_or("?").trim().to_string();
        let kb: u64 = status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|r| r.split_whitespace().next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        match v.iter_mut().find(|(n, _)| *n == name) {
            Some(e) => e.1 += kb * 1024,
            None => v.push((name, kb * 1024)),
        }
    }
    v.sort_by_key(|e| std::cmp::Reverse(e.1));
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bind_conflict_is_recognised_in_go_and_socat_logs_alike() {
        for (log, conflict) in [
            ("E1204 listen tcp 127.0.0.1:12345: bind: address already in use", true),
            ("2026/12/04 16:00:00 socat[42] E bind(5, {AF=2 127.0.0.1:12345}, 16): Address already in use", true),
            ("E1204 etcd cluster is unavailable", false),
            ("", false),
        ] {
            assert_eq!(is_bind_conflict(log), conflict, "{log}");
        }
    }

    #[test]
    fn a_listen_port_lies_below_the_ephemeral_range() {
        let low = fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
            .ok()
            .and_then(|r| r.split_whitespace().next().and_then(|p| p.parse::<u16>().ok()))
            .unwrap_or(32768);
        let port = listen_port().unwrap_or_else(|e| panic!("{e:#}"));
        assert!((10_000..low.max(10_001)).contains(&port), "{port} (ephemeral range from {low})");
    }
}
