//! The `kube-fence` binary as the CLI tests run it: a clean environment pointed at one cluster
//! (or none), and `kube-fence run --local` (the lease controller and the webhook for one
//! namespace) as a child process.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const KUBE_FENCE: &str = env!("CARGO_BIN_EXE_kube-fence");

/// Which cluster the binary is pointed at.
#[derive(Clone, Copy)]
pub enum Cluster<'a> {
    /// KUBECONFIG unset, an empty HOME, not in a Pod.
    None,
    Kubeconfig(&'a Path),
}

/// `kube-fence args` with a clean environment (no KUBECONFIG, grant, namespace or Pod
/// variables of the test's own) and `cluster`.
pub fn command(cluster: Cluster<'_>, home: &Path, args: &[&str]) -> Command {
    let mut cmd = Command::new(KUBE_FENCE);
    cmd.args(args)
        .env("HOME", home)
        .env_remove("KUBECONFIG")
        .env_remove("KUBE_FENCE_NAMESPACE")
        .env_remove("POD_NAME")
        .env_remove("POD_NAMESPACE")
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("RUST_LOG")
        .env_remove("KUBE_FENCE_GRANT");
    if let Cluster::Kubeconfig(path) = cluster {
        cmd.env("KUBECONFIG", path);
    }
    cmd
}

/// `kube-fence run --local` as a child process, stopped with SIGTERM (a clean exit that
/// unregisters) when dropped.
pub struct Local {
    pub child: Option<Child>,
    pub ready_file: PathBuf,
    pub configuration: String,
    pub stderr: PathBuf,
}

impl Local {
    pub fn start(kubeconfig: &Path, home: &Path, ns: &str, name: &str, extra: &[&str]) -> Local {
        let ready_file = home.join(format!("{name}.ready"));
        let stderr = home.join(format!("{name}.log"));
        let configuration = format!("kf-cli-{name}-{ns}");
        let log = std::fs::File::create(&stderr).expect("log file");
        let mut args = vec!["run", "--local", "--watch-namespace", ns, "--local-configuration", &configuration];
        let ready = ready_file.display().to_string();
        args.extend(["--ready-file", &ready]);
        args.extend(extra);
        let child = command(Cluster::Kubeconfig(kubeconfig), home, &args)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap_or_else(|e| panic!("starting kube-fence run --local: {e}"));
        Local { child: Some(child), ready_file, configuration, stderr }
    }

    /// Waits for the ready file; returns what it says (the webhook's URL).
    pub fn wait_ready(&mut self) -> String {
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            if let Ok(contents) = std::fs::read_to_string(&self.ready_file) {
                assert!(contents.ends_with('\n'), "the ready file is written whole: {contents:?}");
                return contents.trim().to_string();
            }
            if let Some(status) = self.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
                panic!("kube-fence run --local exited ({status}) before it was ready:\n{}", self.log());
            }
            assert!(Instant::now() < deadline, "kube-fence run --local was not ready in 90s:\n{}", self.log());
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// SIGTERM, then the exit status.
    pub fn stop(&mut self) -> std::process::ExitStatus {
        let mut child = self.child.take().expect("running");
        let _ = Command::new("kill").arg("-TERM").arg(child.id().to_string()).status();
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return status;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                return child.wait().expect("wait");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        if self.child.is_some() {
            self.stop();
        }
    }
}

/// Runs `kube-fence args` with a clean environment and `cluster`; a run that does not end
/// within two minutes is killed and fails the test (a failure must end the process).
pub fn kube_fence(cluster: Cluster<'_>, home: &Path, args: &[&str]) -> Output {
    kube_fence_with(cluster, home, args, &[])
}

/// [`kube_fence`] with extra environment variables (a delegated grant, as a Pod has it).
pub fn kube_fence_with(cluster: Cluster<'_>, home: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let out = tempfile::tempdir().expect("output dir");
    let (stdout, stderr) = (out.path().join("stdout"), out.path().join("stderr"));
    let mut child = command(cluster, home, args)
        .envs(env.iter().copied())
        .stdout(std::fs::File::create(&stdout).expect("stdout file"))
        .stderr(std::fs::File::create(&stderr).expect("stderr file"))
        .spawn()
        .unwrap_or_else(|e| panic!("running {KUBE_FENCE}: {e}"));
    let deadline = Instant::now() + Duration::from_secs(120);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("kube-fence {} did not end within 120s:\n{}", args.join(" "), std::fs::read_to_string(&stderr).unwrap_or_default());
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Output { status, stdout: std::fs::read(&stdout).unwrap_or_default(), stderr: std::fs::read(&stderr).unwrap_or_default() }
}

/// Output as text, trimmed.
pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).trim().to_string()
}
