//! Node mode: a real single-node cluster in a network namespace of its own runs Pods and
//! Services, Pods reach the API server in-cluster, and stopping it leaves nothing behind on the
//! host — no process, mount, network namespace, cgroup, file or changed sysctl.
//!
//! Needs root (it creates a network namespace and runs a kubelet). One node per machine, so the
//! tests here take turns.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use kube_fence_testenv::node::{self, HOST_PATHS, NETNS};
use kube_fence_testenv::{ControlPlane, Options};

static ONE_NODE_AT_A_TIME: Mutex<()> = Mutex::new(());

/// What a node may change on the host, taken before start and compared after stop.
#[derive(Debug, PartialEq)]
struct HostState {
    sysctls: Vec<(String, String)>,
    entries: BTreeSet<String>,
    netns: BTreeSet<String>,
    mounts: usize,
}

fn host_state() -> HostState {
    let mut entries = BTreeSet::new();
    for dir in ["/run", "/var/lib", "/var/log", "/etc", "/opt"] {
        if let Ok(rd) = fs::read_dir(dir) {
            entries.extend(rd.filter_map(|e| e.ok()).map(|e| e.path().display().to_string()));
        }
    }
    for p in HOST_PATHS {
        if Path::new(p).exists() {
            entries.insert(format!("exists {p}"));
        }
    }
    let netns = fs::read_dir("/run/netns")
        .map(|rd| rd.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    let mounts = fs::read_to_string("/proc/self/mountinfo").map(|s| s.lines().count()).unwrap_or(0);
    HostState { sysctls: node::host_sysctls(), entries, netns, mounts }
}

/// A node test's turn: one node per machine, so one test at a time; a scratch directory; the
/// host as it was before the test.
struct Turn {
    _one_at_a_time: std::sync::MutexGuard<'static, ()>,
    work: tempfile::TempDir,
    before: HostState,
}

fn turn() -> Turn {
    let one_at_a_time = ONE_NODE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    Turn { _one_at_a_time: one_at_a_time, work: tempfile::tempdir().expect("tempdir"), before: host_state() }
}

impl Turn {
    /// After the node stopped: its state directory is gone, no node process is left, and the
    /// host is as it was.
    fn assert_left_nothing(&self, dir: &Path) {
        assert!(!dir.exists(), "state directory {} removed", dir.display());
        assert!(!Path::new("/run/netns").join(NETNS).exists(), "network namespace removed");
        assert!(node::netns_pids().is_empty() && node::cgroup_pids().is_empty(), "no node process left");
        assert_eq!(host_state(), self.before, "host as before");
    }
}

/// Runs `kf-env --state-dir DIR ARGS..`.
fn kf_env(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_kf-env")).arg("--state-dir").arg(dir).args(args).output().expect("run kf-env")
}

fn alive(pid: u32) -> bool {
    // Not a zombie we have yet to reap: a zombie has no memory map.
    fs::read_to_string(format!("/proc/{pid}/stat")).map(|s| !s.contains(") Z ")).unwrap_or(false)
}

fn kubectl(cp_kubeconfig: &Path, args: &[&str]) -> std::process::Output {
    let bin = kube_fence_testenv::binaries().expect("control-plane binaries");
    Command::new(bin.join("kubectl")).arg("--kubeconfig").arg(cp_kubeconfig).args(args).output().expect("run kubectl")
}

/// The test workload (testenv/images/incluster) as an image tarball.
fn incluster_image(dir: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("images/incluster");
    let tar = dir.join("incluster.tar");
    node::go_image(&src, dir, "localhost/kf/incluster:test", &[], &tar).expect("build the incluster image");
    tar
}

const WORKLOAD: &str = r#"
apiVersion: v1
kind: Namespace
metadata: {name: kf-node-test}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: reader, namespace: kf-node-test}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: noperm, namespace: kf-node-test}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: Role
metadata: {name: pod-reader, namespace: kf-node-test}
rules: [{apiGroups: [""], resources: [pods], verbs: [get]}]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: RoleBinding
metadata: {name: reader, namespace: kf-node-test}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: Role, name: pod-reader}
subjects: [{kind: ServiceAccount, name: reader, namespace: kf-node-test}]
---
apiVersion: v1
kind: Service
metadata: {name: server, namespace: kf-node-test}
spec:
  selector: {app: server}
  ports: [{port: 80, targetPort: 8080}]
---
apiVersion: v1
kind: Pod
metadata: {name: server, namespace: kf-node-test, labels: {app: server}}
spec:
  serviceAccountName: reader
  containers:
  - name: main
    image: localhost/kf/incluster:test
    imagePullPolicy: Never
    env: [{name: POD_NAME, valueFrom: {fieldRef: {fieldPath: metadata.name}}}]
    ports: [{containerPort: 8080}]
    readinessProbe: {httpGet: {path: /, port: 8080}, periodSeconds: 1}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: kf-node-test}
spec:
  serviceAccountName: reader
  containers:
  - name: main
    image: localhost/kf/incluster:test
    imagePullPolicy: Never
    env:
    - {name: POD_NAME, valueFrom: {fieldRef: {fieldPath: metadata.name}}}
    - {name: PEER_URL, value: "http://$(SERVER_SERVICE_HOST):$(SERVER_SERVICE_PORT)/"}
---
apiVersion: v1
kind: Pod
metadata: {name: noperm, namespace: kf-node-test}
spec:
  serviceAccountName: noperm
  containers:
  - name: main
    image: localhost/kf/incluster:test
    imagePullPolicy: Never
    env: [{name: POD_NAME, valueFrom: {fieldRef: {fieldPath: metadata.name}}}]
"#;

fn wait_for_log(kubeconfig: &Path, pod: &str, needle: &str, limit: Duration) -> String {
    let start = Instant::now();
    loop {
        let out = kubectl(kubeconfig, &["-n", "kf-node-test", "logs", pod]);
        let logs = String::from_utf8_lossy(&out.stdout).into_owned();
        if logs.contains(needle) {
            return logs;
        }
        if start.elapsed() > limit {
            let describe = kubectl(kubeconfig, &["-n", "kf-node-test", "describe", "pod", pod]);
            panic!(
                "pod {pod} never logged {needle:?} within {limit:?}; logs:\n{logs}{}\ndescribe:\n{}",
                String::from_utf8_lossy(&out.stderr),
                String::from_utf8_lossy(&describe.stdout)
            );
        }
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[test]
fn node_runs_pods_and_services_and_stop_leaves_nothing_behind() {
    let turn = turn();
    let image = incluster_image(turn.work.path());
    let before = &turn.before;

    let started = Instant::now();
    let mut cp = ControlPlane::start(Options { node: true, ..Options::default() }).expect("the node starts");
    let start_time = started.elapsed();
    let dir = cp.dir().to_path_buf();
    assert!(Path::new("/run/netns").join(NETNS).exists(), "the node has its own network namespace");

    // Nothing leaves the namespace: its only routes are its own subnets and the Service CIDR.
    let routes = Command::new("ip").args(["-n", NETNS, "route", "show"]).output().expect("ip route");
    let routes = String::from_utf8_lossy(&routes.stdout).into_owned();
    assert!(!routes.contains("default"), "no default route in the node's namespace:\n{routes}");

    cp.import_image(&image).expect("image import");
    let applied_at = Instant::now();
    let manifest = turn.work.path().join("workload.yaml");
    fs::write(&manifest, WORKLOAD).expect("write manifest");
    let out = kubectl(&cp.kubeconfig, &["create", "-f", &manifest.to_string_lossy()]);
    assert!(out.status.success(), "kubectl create: {}", String::from_utf8_lossy(&out.stderr));

    // In-cluster API access with the pod's service account, through the kubernetes Service.
    let server_logs = wait_for_log(&cp.kubeconfig, "server", "pods/server -> 200", Duration::from_secs(90));
    let pod_to_api = applied_at.elapsed();
    assert!(server_logs.contains("api GET /api/v1/namespaces/kf-node-test/pods/server -> 200"), "{server_logs}");
    // RBAC is enforced at run time: a service account without a role is refused.
    wait_for_log(&cp.kubeconfig, "noperm", "pods/noperm -> 403", Duration::from_secs(60));
    // Pod -> Service ClusterIP -> other pod.
    wait_for_log(&cp.kubeconfig, "client", "-> 200 hello from server", Duration::from_secs(60));
    // The namespace itself (where hostNetwork pods and kubectl-in-netns run) reaches the Service too.
    let ip = kubectl(&cp.kubeconfig, &["-n", "kf-node-test", "get", "service", "server", "-o", "jsonpath={.spec.clusterIP}"]);
    let cluster_ip = String::from_utf8_lossy(&ip.stdout).into_owned();
    assert!(
        cp.in_netns(Command::new("curl").args(["-sf", "--max-time", "5", &format!("http://{cluster_ip}/")])),
        "ClusterIP {cluster_ip} answers from the node's namespace"
    );

    // Everything the node runs: components, containerd shims, pods.
    let mut pids: BTreeSet<u32> = cp.pids().into_iter().map(|(_, p)| p).collect();
    pids.extend(node::netns_pids());
    pids.extend(node::cgroup_pids());
    let rss = kube_fence_testenv::rss_by_process(pids.iter().copied());
    let total: u64 = rss.iter().map(|(_, b)| b).sum();
    eprintln!(
        "[figures] node start {:.1}s; pod created -> in-cluster GET 200 {:.1}s; {} processes, RSS total {} MiB:",
        start_time.as_secs_f64(),
        pod_to_api.as_secs_f64(),
        pids.len(),
        total >> 20
    );
    for (name, bytes) in &rss {
        eprintln!("[figures]   {name:<24} {:>5} MiB", bytes >> 20);
    }
    assert!(pids.len() >= 12, "components, shims and pods found: {pids:?}");

    let stopped = Instant::now();
    cp.stop();
    eprintln!("[figures] stop {:.1}s", stopped.elapsed().as_secs_f64());
    let survivors: Vec<u32> = pids.iter().copied().filter(|p| alive(*p)).collect();
    assert!(survivors.is_empty(), "no process survives stop: {survivors:?}");
    assert!(!Path::new("/run/netns").join(NETNS).exists(), "network namespace removed");
    assert!(node::mounts_under(&dir).is_empty(), "no mount left under {}", dir.display());
    assert!(!dir.exists(), "state directory {} removed", dir.display());
    assert!(node::cgroup_leftovers().is_empty(), "cgroups removed: {:?}", node::cgroup_leftovers());
    let after = host_state();
    assert_eq!(after.sysctls, before.sysctls, "host sysctls restored");
    assert_eq!(after.netns, before.netns, "no network namespace left in /run/netns");
    assert_eq!(after.entries, before.entries, "no file left in /run, /var/lib, /var/log, /etc, /opt");
    assert_eq!(after.mounts, before.mounts, "as many mounts as before");
}

#[test]
fn kf_env_up_node_prints_exports_imports_images_and_down_cleans_up() {
    let turn = turn();
    let dir = turn.work.path().join("env");
    let up = kf_env(&dir, &["up", "--node"]);
    assert!(up.status.success(), "kf-env up --node: {}", String::from_utf8_lossy(&up.stderr));
    let exports = String::from_utf8_lossy(&up.stdout).into_owned();
    let var = |name: &str| -> String {
        exports
            .lines()
            .find_map(|l| l.strip_prefix(&format!("export {name}=")))
            .unwrap_or_else(|| panic!("up prints export {name}=...: {exports}"))
            .to_string()
    };
    let kubeconfig = var("KUBECONFIG");
    assert!(var("PATH").ends_with(":$PATH"));
    let containerd = var("CONTAINERD_ADDRESS");
    assert_eq!(var("CONTAINERD_NAMESPACE"), "k8s.io");

    let nodes = kubectl(
        Path::new(&kubeconfig),
        &["get", "node", node::NODE_NAME, "-o", "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}"],
    );
    assert_eq!(String::from_utf8_lossy(&nodes.stdout), "True", "node Ready: {}", String::from_utf8_lossy(&nodes.stderr));

    // The documented way to load an image: `ctr images import` with the exported variables.
    let image = incluster_image(turn.work.path());
    let import = Command::new("ctr")
        .args(["images", "import"])
        .arg(&image)
        .env("CONTAINERD_ADDRESS", &containerd)
        .env("CONTAINERD_NAMESPACE", "k8s.io")
        .output()
        .expect("run ctr");
    assert!(import.status.success(), "ctr images import: {}", String::from_utf8_lossy(&import.stderr));
    let import = kf_env(&dir, &["import", &image.to_string_lossy()]);
    assert!(import.status.success(), "kf-env import: {}", String::from_utf8_lossy(&import.stderr));
    let list = Command::new("ctr").args(["--address", &containerd, "-n", "k8s.io", "images", "ls", "-q"]).output().expect("run ctr");
    assert!(String::from_utf8_lossy(&list.stdout).contains("localhost/kf/incluster:test"), "image listed");

    let env = kf_env(&dir, &["env"]);
    assert_eq!(String::from_utf8_lossy(&env.stdout), exports, "env prints the same exports");

    let down = kf_env(&dir, &["down"]);
    assert!(down.status.success(), "kf-env down: {}", String::from_utf8_lossy(&down.stderr));
    turn.assert_left_nothing(&dir);
}

/// Waits for a child to exit, at most `limit`; kills it and fails if it does not.
fn wait_exit(child: &mut std::process::Child, limit: Duration) -> std::process::ExitStatus {
    let start = Instant::now();
    loop {
        if let Some(status) = child.try_wait().expect("try_wait") {
            return status;
        }
        if start.elapsed() > limit {
            let _ = child.kill();
            panic!("process {} did not exit within {limit:?}", child.id());
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Reads lines from a child's stdout until one contains `prefix`.
fn wait_line(out: impl std::io::Read, prefix: &str) -> String {
    use std::io::BufRead as _;
    for line in std::io::BufReader::new(out).lines() {
        let line = line.expect("read child output");
        // libtest prints "test <name> ... " without a newline before the helper's own output.
        if line.contains(prefix) {
            return line;
        }
    }
    panic!("child exited without printing a line starting with {prefix:?}");
}

fn send(pid: u32, sig: &str) {
    assert!(Command::new("kill").args([&format!("-{sig}"), &pid.to_string()]).status().expect("kill").success());
}

/// Ctrl-C on `kf-env up --node --foreground` tears the node down.
#[test]
fn ctrl_c_on_kf_env_foreground_tears_the_node_down() {
    let turn = turn();
    let dir = turn.work.path().join("env");
    let mut child = Command::new(env!("CARGO_BIN_EXE_kf-env"))
        .arg("--state-dir")
        .arg(&dir)
        .args(["up", "--node", "--foreground"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start kf-env");
    wait_line(child.stdout.take().expect("stdout"), "export CONTAINERD_NAMESPACE=");
    send(child.id(), "INT");
    let status = wait_exit(&mut child, Duration::from_secs(60));
    assert!(status.success(), "kf-env exits cleanly after Ctrl-C: {status}");
    turn.assert_left_nothing(&dir);
}

/// Not a test by itself: starts a node through the library and waits forever, for the test
/// below to interrupt (as Ctrl-C on `cargo test` would).
#[test]
#[ignore = "helper: run by ctrl_c_on_a_test_process_tears_the_node_down"]
fn helper_node_until_interrupted() {
    let dir = PathBuf::from(std::env::var("KF_NODE_HELPER_DIR").expect("KF_NODE_HELPER_DIR"));
    let _cp = ControlPlane::start(Options { node: true, state_dir: Some(dir), ..Options::default() }).expect("node starts");
    println!("NODE-READY");
    loop {
        std::thread::sleep(Duration::from_secs(60));
    }
}

/// A test process that starts a node and is interrupted (Ctrl-C, SIGTERM) tears it down first.
#[test]
fn ctrl_c_on_a_test_process_tears_the_node_down() {
    let turn = turn();
    let dir = turn.work.path().join("node");
    let mut child = Command::new(std::env::current_exe().expect("test binary"))
        .args(["--ignored", "--exact", "helper_node_until_interrupted", "--nocapture", "--test-threads", "1"])
        .env("KF_NODE_HELPER_DIR", &dir)
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("start helper");
    wait_line(child.stdout.take().expect("stdout"), "NODE-READY");
    let pids: BTreeSet<u32> = node::netns_pids().into_iter().chain(node::cgroup_pids()).collect();
    assert!(!pids.is_empty());
    send(child.id(), "INT");
    let status = wait_exit(&mut child, Duration::from_secs(60));
    assert_eq!(status.code(), Some(128 + 2), "exits as interrupted");
    let survivors: Vec<u32> = pids.iter().copied().filter(|p| alive(*p)).collect();
    assert!(survivors.is_empty(), "no process survives: {survivors:?}");
    turn.assert_left_nothing(&dir);
}

/// A supervisor killed outright (SIGKILL: no handler runs) leaves the node behind; `kf-env down`
/// finds its record and undoes everything.
#[test]
fn down_cleans_up_after_a_killed_supervisor() {
    let turn = turn();
    let dir = turn.work.path().join("env");
    let up = kf_env(&dir, &["up", "--node"]);
    assert!(up.status.success(), "kf-env up --node: {}", String::from_utf8_lossy(&up.stderr));
    let supervisor: u32 = fs::read_to_string(dir.join("supervisor.pid")).expect("pid file").trim().parse().expect("pid");
    send(supervisor, "KILL");
    let deadline = Instant::now() + Duration::from_secs(10);
    while alive(supervisor) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(Path::new("/run/netns").join(NETNS).exists(), "the killed supervisor left its namespace (as expected)");
    let down = kf_env(&dir, &["down"]);
    assert!(down.status.success(), "kf-env down: {}", String::from_utf8_lossy(&down.stderr));
    turn.assert_left_nothing(&dir);
}

/// The kube-fence image hack/build-image.sh writes (no Docker) runs in the node as the
/// Dockerfile says: non-root user 65532, entrypoint /kube-fence.
#[test]
fn kube_fence_image_runs_in_the_node() {
    let turn = turn();
    let work = &turn.work;
    let tar = work.path().join("kube-fence.tar");
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let build = Command::new("bash")
        .arg(root.join("hack/build-image.sh"))
        .args(["--debug", "--ref", "localhost/kf/kube-fence:test", "--out"])
        .arg(&tar)
        .current_dir(&root)
        .output()
        .expect("run build-image.sh");
    assert!(build.status.success(), "build-image.sh: {}", String::from_utf8_lossy(&build.stderr));

    let mut cp = ControlPlane::start(Options { node: true, ..Options::default() }).expect("the node starts");
    cp.import_image(&tar).expect("import");
    let manifest = work.path().join("pod.yaml");
    // `crd` is a subcommand every kube-fence build has; it prints the CRD and exits 0.
    fs::write(
        &manifest,
        r#"
apiVersion: v1
kind: Pod
metadata: {name: kube-fence-image, namespace: default}
spec:
  restartPolicy: Never
  automountServiceAccountToken: false
  containers:
  - name: main
    image: localhost/kf/kube-fence:test
    imagePullPolicy: Never
    args: ["crd"]
    securityContext: {runAsNonRoot: true, allowPrivilegeEscalation: false, readOnlyRootFilesystem: true, capabilities: {drop: [ALL]}}
"#,
    )
    .expect("write manifest");
    let out = kubectl(&cp.kubeconfig, &["create", "-f", &manifest.to_string_lossy()]);
    assert!(out.status.success(), "kubectl create: {}", String::from_utf8_lossy(&out.stderr));
    let start = Instant::now();
    loop {
        let phase = kubectl(&cp.kubeconfig, &["get", "pod", "kube-fence-image", "-o", "jsonpath={.status.phase}"]);
        let phase = String::from_utf8_lossy(&phase.stdout).into_owned();
        if phase == "Succeeded" {
            break;
        }
        if phase == "Failed" || start.elapsed() > Duration::from_secs(60) {
            let d = kubectl(&cp.kubeconfig, &["describe", "pod", "kube-fence-image"]);
            panic!("pod phase {phase:?}:\n{}", String::from_utf8_lossy(&d.stdout));
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    let logs = kubectl(&cp.kubeconfig, &["logs", "kube-fence-image"]);
    let logs = String::from_utf8_lossy(&logs.stdout).into_owned();
    assert!(logs.contains("kind: CustomResourceDefinition"), "kube-fence crd ran in the image:\n{logs}");
    // The image's user is the Dockerfile's: the runtime reports it in the container status.
    let config = Command::new("ctr")
        .args(["--address"])
        .arg(cp.containerd_address.as_ref().expect("containerd"))
        .args(["-n", "k8s.io", "images", "ls"])
        .output()
        .expect("ctr");
    assert!(String::from_utf8_lossy(&config.stdout).contains("localhost/kf/kube-fence:test"));
    cp.stop();
}
