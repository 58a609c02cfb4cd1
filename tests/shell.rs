//! kube-fence as a shell user meets it, against the shared control plane: the real kubectl
//! running the binary as its plugin `kubectl fence` with the plugin's own `--context`,
//! `--kubeconfig` and `-n`, and `lease run`, which holds a lease for as long as a command runs
//! (released when it exits, the command stopped when the grant is lost).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::cli::{Cluster, KUBE_FENCE, Local, command, kube_fence, text};
use kube::api::Api;
use kube_fence_api::Lease;

/// A directory holding `kubectl-fence` and `kubectl_complete-fence` (links to the binary under
/// test): put first on the PATH, kubectl finds the plugin `fence` and its completion.
fn plugin_dir(home: &Path) -> PathBuf {
    let dir = home.join("plugins");
    std::fs::create_dir_all(&dir).expect("plugin dir");
    for name in ["kubectl-fence", "kubectl_complete-fence"] {
        let link = dir.join(name);
        if !link.exists() {
            std::os::unix::fs::symlink(KUBE_FENCE, &link).expect("link the plugin");
        }
    }
    dir
}

/// The real kubectl with `kubectl-fence` on its PATH, in a clean environment: `KUBECONFIG` as
/// given (or none), an empty HOME.
fn kubectl(home: &Path, kubeconfig: Option<&Path>, args: &[&str]) -> Output {
    let bin = kube_fence_testenv::binaries().expect("the control plane's binaries (kubectl)");
    let path = format!("{}:{}", plugin_dir(home).display(), std::env::var("PATH").unwrap_or_default());
    let mut cmd = Command::new(bin.join("kubectl"));
    cmd.args(args)
        .env("PATH", path)
        .env("HOME", home)
        .env_remove("KUBECONFIG")
        .env_remove("KUBE_FENCE_NAMESPACE")
        .env_remove("POD_NAME")
        .env_remove("KUBE_FENCE_GRANT")
        .env_remove("KUBERNETES_SERVICE_HOST");
    if let Some(path) = kubeconfig {
        cmd.env("KUBECONFIG", path);
    }
    cmd.stdin(Stdio::null()).output().expect("run kubectl")
}

/// A port on 127.0.0.1 where nothing listens while the returned socket lives.
fn closed_port() -> (tokio::net::TcpSocket, u16) {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.bind("127.0.0.1:0".parse().expect("addr")).expect("bind");
    let port = socket.local_addr().expect("addr").port();
    (socket, port)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kubectl_runs_the_plugin_with_its_own_context_kubeconfig_and_namespace() {
    let client = common::client().await;
    let ns = common::namespace(&client, "plugin").await;
    let other_ns = common::namespace(&client, "plugin-other").await;
    let kubeconfig = common::kubeconfig().await;
    let home = tempfile::tempdir().expect("an empty HOME");
    let home = home.path();
    let mut local = Local::start(&kubeconfig, home, &ns, "plugin", &[]);
    local.wait_ready();

    // One kubeconfig, two contexts: `work` (the test cluster, default namespace `ns`) and the
    // current one, `unreachable` (a server where nothing listens). Only a plugin that honours
    // --context reaches the cluster.
    let (_closed, port) = closed_port();
    let two_contexts = common::kubeconfig_variant(home, "two-contexts", |config| {
        let context = config["contexts"][0]["context"].clone();
        let mut work = context.clone();
        work["namespace"] = ns.clone().into();
        let mut unreachable = context;
        unreachable["cluster"] = "nowhere".into();
        config["contexts"] = serde_json::json!([{"name": "work", "context": work}, {"name": "unreachable", "context": unreachable}]);
        let mut nowhere = config["clusters"][0].clone();
        nowhere["name"] = "nowhere".into();
        nowhere["cluster"]["server"] = format!("https://127.0.0.1:{port}").into();
        config["clusters"].as_array_mut().expect("clusters").push(nowhere);
        config["current-context"] = "unreachable".into();
    });
    let run = |kubeconfig: Option<&Path>, args: &[&str]| {
        let out = kubectl(home, kubeconfig, args);
        eprintln!("kubectl {}: exit {:?}\n  {}\n  {}", args.join(" "), out.status.code(), text(&out.stdout), text(&out.stderr));
        out
    };

    // The documented form: the plugin's flags after its name, before or after the subcommand.
    let acquired = run(Some(&two_contexts), &["fence", "--context", "work", "lease", "acquire", "plugin-lease", "--holder", "a"]);
    assert!(acquired.status.success(), "kubectl fence --context work lease acquire: {}", text(&acquired.stderr));
    let token = text(&acquired.stdout);
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let lease = leases.get("plugin-lease").await.expect("the lease, in the context's namespace");
    assert_eq!(lease.status.as_ref().and_then(|s| s.token).map(|t| t.to_string()).as_deref(), Some(token.as_str()));

    let status = run(Some(&two_contexts), &["fence", "status", "--context", "work"]);
    assert!(status.status.success(), "kubectl fence status --context work: {}", text(&status.stderr));
    let listed = text(&status.stdout);
    assert!(listed.contains("plugin-lease") && listed.contains(&token), "the context's namespace is listed:\n{listed}");
    let all = run(Some(&two_contexts), &["fence", "status", "-A", "--context", "work", "-o", "json"]);
    assert!(all.status.success(), "kubectl fence status -A: {}", text(&all.stderr));
    let all: serde_json::Value = serde_json::from_slice(&all.stdout).expect("status -o json is JSON");
    let rows = all.as_array().expect("an array");
    assert!(rows.iter().any(|r| r["namespace"] == ns.as_str() && r["name"] == "plugin-lease"), "-A lists {ns}: {all}");

    // Without --context, the current context: unreachable, so the flag above was honoured.
    let current = run(Some(&two_contexts), &["fence", "status"]);
    assert_eq!(current.status.code(), Some(3), "the current context's server is unreachable: {}", text(&current.stderr));
    assert!(
        text(&current.stderr).contains(&format!("cannot reach the API server at https://127.0.0.1:{port}")),
        "{}",
        text(&current.stderr)
    );

    // --kubeconfig, with KUBECONFIG naming no file (kubectl reads no kubeconfig to run a plugin).
    let missing = home.join("no-such-kubeconfig");
    let file = two_contexts.display().to_string();
    let by_flag =
        run(Some(&missing), &["fence", "lease", "acquire", "plugin-flag", "--holder", "b", "--kubeconfig", &file, "--context", "work"]);
    assert!(by_flag.status.success(), "kubectl fence lease acquire --kubeconfig: {}", text(&by_flag.stderr));
    assert!(leases.get("plugin-flag").await.is_ok(), "acquired in the context's namespace");
    let renewed =
        run(Some(&missing), &["fence", "lease", "renew", "plugin-lease", "--holder", "a", "--kubeconfig", &file, "--context", "work"]);
    assert!(renewed.status.success(), "kubectl fence lease renew --kubeconfig --context: {}", text(&renewed.stderr));
    assert_eq!(text(&renewed.stdout), token);
    // -n overrides the context's namespace.
    let elsewhere =
        run(Some(&missing), &["fence", "lease", "get", "plugin-lease", "--kubeconfig", &file, "--context", "work", "-n", &other_ns]);
    assert_eq!(elsewhere.status.code(), Some(5), "{}", text(&elsewhere.stderr));
    assert!(
        text(&elsewhere.stderr).contains(&format!("lease \"plugin-lease\" in namespace \"{other_ns}\" does not exist")),
        "{}",
        text(&elsewhere.stderr)
    );

    // kubectl itself refuses its own flags before a plugin's name (kubectl 1.37): docs/reference/cli.md
    // says so, and this pins it.
    let before = run(Some(&two_contexts), &["--context", "work", "fence", "status"]);
    assert!(!before.status.success());
    assert!(text(&before.stderr).contains("flags cannot be placed before plugin name: --context"), "{}", text(&before.stderr));

    // Help and usage name the plugin as it is typed.
    let help = run(None, &["fence", "lease", "acquire", "--help"]);
    assert!(text(&help.stdout).contains("Usage: kubectl fence lease acquire"), "{}", text(&help.stdout));
    let usage = run(None, &["fence", "lease", "acquire", "x"]);
    assert_eq!(usage.status.code(), Some(2));
    let plain = kube_fence(Cluster::None, home, &["--help"]);
    assert!(text(&plain.stdout).contains("Usage: kube-fence [OPTIONS] <COMMAND>"), "{}", text(&plain.stdout));

    // kubectl completes `kubectl fence ...` by running kubectl_complete-fence (kubectl >= 1.26).
    for (words, want) in
        [(&["le"][..], "lease"), (&["lease", "ac"], "acquire"), (&["status", "--con"], "--context"), (&["status", "-o", "w"], "wide")]
    {
        let mut args = vec!["__complete", "fence"];
        args.extend(words);
        let out = kubectl(home, None, &args);
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "kubectl __complete fence {words:?}: {}", text(&out.stderr));
        assert_eq!(stdout.lines().collect::<Vec<_>>(), [want, ":4"], "kubectl __complete fence {words:?}");
    }

    // The completion script loads in a real bash and completes what it is invoked as.
    for (invoker, name) in
        [(KUBE_FENCE.to_string(), "kube-fence"), (plugin_dir(home).join("kubectl-fence").display().to_string(), "kubectl-fence")]
    {
        let loaded = Command::new("bash")
            .args(["--norc", "-c", &format!("source <(\"{invoker}\" completion bash) && complete -p {name}")])
            .output()
            .expect("run bash");
        assert!(loaded.status.success(), "bash loads the completion of {name}: {}", text(&loaded.stderr));
        assert!(text(&loaded.stdout).ends_with(&format!(" {name}")), "{}", text(&loaded.stdout));
    }
    local.stop();
}

/// `kube-fence lease run ...` as a child process, its output in files.
struct LeaseRun {
    child: Child,
    stderr: PathBuf,
}

impl LeaseRun {
    fn start(kubeconfig: &Path, home: &Path, args: &[&str]) -> LeaseRun {
        let stderr = home.join(format!("lease-run-{}.err", std::process::id() ^ rand_suffix()));
        let child = command(Cluster::Kubeconfig(kubeconfig), home, args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).expect("stderr file"))
            .spawn()
            .expect("start kube-fence lease run");
        LeaseRun { child, stderr }
    }

    /// The exit status, and stderr; the run must end within `limit`.
    fn wait(mut self, limit: Duration) -> (Option<i32>, String) {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("wait") {
                return (status.code(), std::fs::read_to_string(&self.stderr).unwrap_or_default());
            }
            if Instant::now() > deadline {
                let _ = self.child.kill();
                panic!("lease run did not end within {limit:?}: {}", std::fs::read_to_string(&self.stderr).unwrap_or_default());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

fn rand_suffix() -> u32 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0)
}

/// Waits (at most 60 s) until `path` exists: the command under `lease run` is running.
fn wait_for_file(path: &Path, run: &mut LeaseRun) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while !path.exists() {
        if let Ok(Some(status)) = run.child.try_wait() {
            panic!("lease run exited ({status}) before its command started: {}", std::fs::read_to_string(&run.stderr).unwrap_or_default());
        }
        assert!(Instant::now() < deadline, "the command did not start within 60 s");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The lease is free: another holder gets it at once (within 20 s, while a lease left held
/// would be held for 60 s more), and its token is greater. Released again afterwards.
fn assert_free(kubeconfig: &Path, home: &Path, ns: &str, lease: &str, previous: u64) -> u64 {
    let out =
        kube_fence(Cluster::Kubeconfig(kubeconfig), home, &["lease", "acquire", lease, "--holder", "next", "--wait", "20s", "-n", ns]);
    assert!(out.status.success(), "{lease} is free: {}", text(&out.stderr));
    let token: u64 = text(&out.stdout).parse().expect("a token");
    assert!(token > previous, "the next grant's token {token} > {previous}");
    let out = kube_fence(Cluster::Kubeconfig(kubeconfig), home, &["lease", "release", lease, "--holder", "next", "-n", ns]);
    assert!(out.status.success(), "release: {}", text(&out.stderr));
    token
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_run_releases_the_lease_when_the_command_exits_and_exits_with_its_status() {
    let client = common::client().await;
    let ns = common::namespace(&client, "lease-run").await;
    let kubeconfig = common::kubeconfig().await;
    let home = tempfile::tempdir().expect("an empty HOME");
    let home = home.path();
    let mut local = Local::start(&kubeconfig, home, &ns, "lease-run", &[]);
    local.wait_ready();

    let mut previous = 0;
    for code in [0, 3] {
        // What the command is given, written where the test reads it.
        let env = home.join(format!("env-{code}"));
        let script = format!(
            "printf '%s\\n' \"$KUBE_FENCE_TOKEN\" \"$KUBE_FENCE_LEASE\" \"$KUBE_FENCE_HOLDER\" \"$KUBE_FENCE_NAMESPACE\" \"$KUBE_FENCE_GRANT\" > {}; exit {code}",
            env.display()
        );
        let run = LeaseRun::start(
            &kubeconfig,
            home,
            &["lease", "run", "job", "-n", &ns, "--holder", "a", "--duration", "60s", "--", "sh", "-c", &script],
        );
        let (exit, stderr) = run.wait(Duration::from_secs(90));
        assert_eq!(exit, Some(code), "lease run exits with the command's status: {stderr}");
        assert!(stderr.is_empty(), "nothing on stderr: {stderr}");
        let given: Vec<String> = std::fs::read_to_string(&env).expect("the command ran").lines().map(str::to_string).collect();
        let token: u64 = given[0].parse().expect("KUBE_FENCE_TOKEN is a token");
        assert!(token > previous, "a new grant, token {token} > {previous}");
        assert_eq!(&given[1..], ["job".to_string(), "a".into(), ns.clone(), format!("{ns}/job:{token}")]);
        previous = assert_free(&kubeconfig, home, &ns, "job", token);
    }

    // SIGTERM to `lease run` is forwarded: the command exits (5, from its trap), the lease is
    // released and 5 is the exit status.
    let started = home.join("started");
    let trapped = home.join("trapped");
    let script = format!("trap 'echo term > {}; exit 5' TERM; touch {}; while :; do sleep 0.1; done", trapped.display(), started.display());
    let mut run = LeaseRun::start(
        &kubeconfig,
        home,
        &["lease", "run", "job", "-n", &ns, "--holder", "a", "--duration", "60s", "--", "sh", "-c", &script],
    );
    wait_for_file(&started, &mut run);
    let status = Command::new("kill").args(["-TERM", &run.child.id().to_string()]).status().expect("run kill");
    assert!(status.success());
    let (exit, stderr) = run.wait(Duration::from_secs(60));
    assert_eq!(exit, Some(5), "the command's status after the forwarded SIGTERM: {stderr}");
    assert!(trapped.exists(), "the command got SIGTERM");
    assert_free(&kubeconfig, home, &ns, "job", previous);
    local.stop();
}

/// Threat case: an honest but stale holder. `lease run` (the holder) is paused — SIGSTOP, as a
/// GC pause, CPU starvation or a frozen VM would — past its lease, while another client is
/// granted the lease with a newer token. Its command was not paused and is still running with
/// the old token (which the webhook now refuses). When the holder resumes it must see that the
/// grant is gone, stop the command (SIGTERM; this command ignores it, so SIGKILL after the grace
/// period) and exit 7 naming the lease and the newer grant — and must not release the new
/// holder's grant on its way out. The pause is deterministic: the test stops the process once
/// its command has started, and resumes it only after the new grant exists.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_run_stops_the_command_when_its_paused_holder_lost_the_grant() {
    let client = common::client().await;
    let ns = common::namespace(&client, "lease-run-lost").await;
    let kubeconfig = common::kubeconfig().await;
    let home = tempfile::tempdir().expect("an empty HOME");
    let home = home.path();
    let mut local = Local::start(&kubeconfig, home, &ns, "lease-run-lost", &[]);
    local.wait_ready();

    let (started, terminated) = (home.join("started"), home.join("terminated"));
    let script = format!("trap 'echo term >> {}' TERM; echo $$ > {}; while :; do sleep 0.1; done", terminated.display(), started.display());
    let mut run = LeaseRun::start(
        &kubeconfig,
        home,
        &["lease", "run", "job", "-n", &ns, "--holder", "a", "--duration", "2s", "--grace-period", "2s", "--", "sh", "-c", &script],
    );
    wait_for_file(&started, &mut run);
    let command_pid: u32 = std::fs::read_to_string(&started).expect("pid").trim().parse().expect("the command's pid");
    let token_a: u64 = {
        let out = kube_fence(Cluster::Kubeconfig(&kubeconfig), home, &["lease", "get", "job", "-o", "token", "-n", &ns]);
        text(&out.stdout).parse().expect("a's token")
    };

    common::signal_and_wait(run.child.id(), "-STOP");
    // b waits until the controller expires a's grant (no heartbeat for 2 s), then gets it.
    let out = kube_fence(
        Cluster::Kubeconfig(&kubeconfig),
        home,
        &["lease", "acquire", "job", "--holder", "b", "--duration", "60s", "--wait", "60s", "-n", &ns],
    );
    assert!(out.status.success(), "b acquires the lease a's paused holder lost: {}", text(&out.stderr));
    let token_b: u64 = text(&out.stdout).parse().expect("b's token");
    assert!(token_b > token_a);
    assert!(Path::new(&format!("/proc/{command_pid}")).exists(), "the command kept running while its holder was paused");
    common::signal_and_wait(run.child.id(), "-CONT");

    let (exit, stderr) = run.wait(Duration::from_secs(60));
    assert_eq!(exit, Some(7), "a lost grant exits 7: {stderr}");
    let message = stderr.lines().last().unwrap_or_default();
    for part in [
        format!("kube-fence: error: lost lease \"job\" in namespace \"{ns}\" (token {token_a}, holder \"a\")"),
        format!("a newer grant with token {token_b} exists"),
        "did not stop within 2s of SIGTERM: killed it (SIGKILL)".to_string(),
    ] {
        assert!(message.contains(&part), "{part:?} in {message:?}");
    }
    assert!(std::fs::read_to_string(&terminated).unwrap_or_default().contains("term"), "the command got SIGTERM first");
    assert!(!Path::new(&format!("/proc/{command_pid}")).exists(), "the command is gone");

    // b's grant survived a's exit.
    let leases: Api<Lease> = Api::namespaced(client.clone(), &ns);
    let status = leases.get("job").await.expect("the lease").status.unwrap_or_default();
    assert_eq!((status.holder.as_deref(), status.token.map(|t| t.get())), (Some("b"), Some(token_b)), "b still holds the lease");
    local.stop();
}

/// Threat case: an honest holder behind a partition. `lease run`'s connection to the API server
/// is cut (a relay that stops carrying bytes; nothing is closed, so what it sends gets no answer
/// at all) while its command runs. At the grant's deadline it must stop the command and exit 7,
/// its release bounded too (the lease is left to expire); the lease is then free for the next
/// holder. (The case of a heartbeat hanging at the deadline is forced in tests/leases.rs,
/// `a_holder_cut_from_its_api_server_loses_its_grant_at_the_deadline_while_its_heartbeat_hangs`;
/// this test passed before that fix too.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_run_stops_the_command_at_the_deadline_when_cut_from_its_api_server() {
    use kube_fence_test_support::partition::Relay;
    let client = common::client().await;
    let ns = common::namespace(&client, "lease-run-cut").await;
    let kubeconfig = common::kubeconfig().await;
    let home = tempfile::tempdir().expect("an empty HOME");
    let home = home.path();
    let mut local = Local::start(&kubeconfig, home, &ns, "lease-run-cut", &[]);
    local.wait_ready();
    let relay = Relay::to_api_server_of(&kubeconfig).await;
    let through_relay = common::kubeconfig_variant(home, "through-relay", |config| {
        for cluster in common::entries(config, "clusters", "cluster") {
            cluster.insert("server".into(), format!("https://{}", relay.addr()).into());
        }
    });

    let (started, terminated) = (home.join("started"), home.join("terminated"));
    let script =
        format!("trap 'echo term >> {}; exit 0' TERM; touch {}; while :; do sleep 0.1; done", terminated.display(), started.display());
    let mut run = LeaseRun::start(
        &through_relay,
        home,
        &["lease", "run", "job", "-n", &ns, "--holder", "a", "--duration", "3s", "--grace-period", "2s", "--", "sh", "-c", &script],
    );
    wait_for_file(&started, &mut run);
    let token_a: u64 = {
        let out = kube_fence(Cluster::Kubeconfig(&kubeconfig), home, &["lease", "get", "job", "-o", "token", "-n", &ns]);
        text(&out.stdout).parse().expect("a's token")
    };
    relay.cut();
    let cut_at = Instant::now();
    // The grant ends at most 3 s after the cut; reading who holds it now is given 5 s. The bound
    // is short of the client's 30 s connect timeout, the shortest a hung heartbeat could take.
    while !terminated.exists() {
        assert!(cut_at.elapsed() < Duration::from_secs(20), "the command was not stopped within 20 s of the cut");
        std::thread::sleep(Duration::from_millis(50));
    }
    let stopped_after = cut_at.elapsed();
    let (exit, stderr) = run.wait(Duration::from_secs(60));
    assert_eq!(exit, Some(7), "a lost grant exits 7: {stderr}");
    let message = stderr.lines().last().unwrap_or_default();
    assert!(message.contains(&format!("lost lease \"job\" in namespace \"{ns}\" (token {token_a}, holder \"a\")")), "{message}");
    relay.heal();
    assert_free(&kubeconfig, home, &ns, "job", token_a);
    eprintln!("MEASURED lease run cut from its API server: command stopped {stopped_after:.2?} after the cut (grant 3 s)");
    local.stop();
}
