//! The control-plane tool starts a working API server and leaves nothing behind when stopped.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use kube_fence_testenv::{ControlPlane, Options};

fn alive(pid: u32) -> bool {
    // A reaped child's pid no longer exists; /proc is the plainest check without unsafe.
    Path::new(&format!("/proc/{pid}")).exists()
}

fn kubectl(kubeconfig: &Path, args: &[&str]) -> std::process::Output {
    let bin = kube_fence_testenv::binaries().expect("control-plane binaries");
    Command::new(bin.join("kubectl")).arg("--kubeconfig").arg(kubeconfig).args(args).output().expect("run kubectl")
}

#[test]
fn start_serves_the_api_and_stop_removes_every_process_and_file() {
    let mut cp = ControlPlane::start(Options::default()).expect("control plane starts");
    let dir = cp.dir().to_path_buf();
    let pids = cp.pids();
    let names: Vec<_> = pids.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, ["etcd", "kube-apiserver", "kube-controller-manager"]);
    assert!(pids.iter().all(|(_, p)| alive(*p)), "all components run: {pids:?}");

    let out = kubectl(&cp.kubeconfig, &["get", "--raw", "/version"]);
    assert!(out.status.success(), "kubectl reaches the API: {}", String::from_utf8_lossy(&out.stderr));
    // The version hack/versions.env pins, stamped by hack/build-control-plane.sh.
    let versions = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../hack/versions.env")).expect("hack/versions.env");
    let pinned = versions.lines().find_map(|l| l.strip_prefix("KUBE_VERSION=")).expect("hack/versions.env pins KUBE_VERSION");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!("\"gitVersion\": \"{pinned}\"")),
        "version is stamped: {}",
        String::from_utf8_lossy(&out.stdout)
    );

    // kube-controller-manager really runs its controllers: namespace deletion completes.
    assert!(kubectl(&cp.kubeconfig, &["create", "namespace", "doomed"]).status.success());
    assert!(kubectl(&cp.kubeconfig, &["delete", "namespace", "doomed", "--timeout=60s"]).status.success(), "namespace deletion completes");

    cp.stop();
    assert!(pids.iter().all(|(_, p)| !alive(*p)), "no component survives stop: {pids:?}");
    assert!(!dir.exists(), "state directory {} is removed", dir.display());
}

#[test]
fn kf_env_up_env_down_from_the_shell() {
    let state = tempfile::tempdir().expect("tempdir");
    let dir = state.path().join("cp");
    let kf_env = env!("CARGO_BIN_EXE_kf-env");
    let up = Command::new(kf_env).arg("--state-dir").arg(&dir).arg("up").output().expect("run kf-env up");
    assert!(up.status.success(), "kf-env up: {}", String::from_utf8_lossy(&up.stderr));
    let exports = String::from_utf8_lossy(&up.stdout).to_string();
    let kubeconfig = exports
        .lines()
        .find_map(|l| l.strip_prefix("export KUBECONFIG="))
        .unwrap_or_else(|| panic!("up prints export KUBECONFIG=...: {exports}"))
        .to_string();
    assert!(kubectl(Path::new(&kubeconfig), &["get", "namespace", "default"]).status.success());

    let env = Command::new(kf_env).arg("--state-dir").arg(&dir).arg("env").output().expect("run kf-env env");
    assert_eq!(String::from_utf8_lossy(&env.stdout), exports, "env prints the same exports");

    // Keep a copy of the kubeconfig: down removes the state directory it lives in.
    let kept = state.path().join("kubeconfig.kept");
    std::fs::copy(&kubeconfig, &kept).expect("copy kubeconfig");
    let supervisor: u32 = std::fs::read_to_string(dir.join("supervisor.pid")).expect("pid file").trim().parse().expect("pid");
    let down = Command::new(kf_env).arg("--state-dir").arg(&dir).arg("down").output().expect("run kf-env down");
    assert!(down.status.success(), "kf-env down: {}", String::from_utf8_lossy(&down.stderr));
    let deadline = Instant::now() + Duration::from_secs(5);
    while alive(supervisor) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(!alive(supervisor), "supervisor exited");
    assert!(!dir.exists(), "state directory removed");
    // Nothing listens on the old API port any more.
    let out = kubectl(&kept, &["get", "--raw", "/readyz", "--request-timeout=2s"]);
    assert!(!out.status.success(), "API server is gone");
}

#[test]
fn env_without_a_running_control_plane_says_so() {
    let state = tempfile::tempdir().expect("tempdir");
    let out = Command::new(env!("CARGO_BIN_EXE_kf-env"))
        .arg("--state-dir")
        .arg(state.path().join("none"))
        .arg("env")
        .output()
        .expect("run kf-env env");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no control plane is running"), "{}", String::from_utf8_lossy(&out.stderr));
}

/// A supervisor that was killed leaves its pid file behind, and on a busy machine its pid soon
/// belongs to another program: `down` must leave that program alone (it once sent it SIGTERM).
#[test]
fn down_never_signals_a_stranger_that_got_a_dead_supervisors_pid() {
    let state = tempfile::tempdir().expect("tempdir");
    let dir = state.path().join("env");
    std::fs::create_dir_all(&dir).expect("state dir");
    let mut stranger = Command::new("sleep").arg("120").spawn().expect("start sleep");
    std::fs::write(dir.join("supervisor.pid"), stranger.id().to_string()).expect("pid file");
    let down = Command::new(env!("CARGO_BIN_EXE_kf-env")).arg("--state-dir").arg(&dir).arg("down").output().expect("run kf-env down");
    let still_running = stranger.try_wait().expect("wait").is_none();
    let _ = stranger.kill();
    let _ = stranger.wait();
    assert!(down.status.success(), "kf-env down: {}", String::from_utf8_lossy(&down.stderr));
    assert!(still_running, "kf-env down signalled a process that is not its supervisor");
    assert!(!dir.exists(), "the stale state directory is removed");
}
