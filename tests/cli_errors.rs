//! Every failure a user can cause with the `kube-fence` binary, caused for real (against the
//! shared control plane where one is needed): the message is one line on stderr, names its
//! cause once, carries no Rust debug output (`Status {`, `Some(`, `os error`) unless `-v` is
//! given, and the exit status is the one `kube-fence --help` documents for that cause.
//! `run --local` is exercised too: a free port by default, a ready file a script can wait on,
//! two instances at once, and a clean exit on SIGTERM.

mod common;

use common::cli::{Cluster, Local, command, kube_fence, kube_fence_with, text};

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::ConfigMap;
use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
use kube::api::{Api, ObjectMeta, PostParams};

/// Debug renderings of Rust/Kubernetes types and raw OS errors: never in a plain message.
const NOISE: [&str; 3] = ["Status {", "Some(", "os error"];

/// A port on 127.0.0.1 where nothing listens, for as long as the returned socket lives: it is
/// bound (so nobody else can take the port) but never listens (so a connection is refused).
fn closed_port() -> (tokio::net::TcpSocket, u16) {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.bind("127.0.0.1:0".parse().expect("address")).expect("bind");
    let port = socket.local_addr().expect("addr").port();
    (socket, port)
}

/// A self-signed serving certificate and key for 127.0.0.1, written to `dir`; returns the CA,
/// certificate and key files.
fn serving_files(dir: &Path) -> (PathBuf, PathBuf, PathBuf) {
    use kube_fence::admission::http::tls::SelfSigned;
    let made = SelfSigned::generate(&["localhost".to_string()], &[std::net::Ipv4Addr::LOCALHOST.into()]).expect("certificates");
    let files = (dir.join("ca.crt"), dir.join("tls.crt"), dir.join("tls.key"));
    std::fs::write(&files.0, &made.ca_cert).expect("write CA");
    std::fs::write(&files.1, &made.serving.cert).expect("write certificate");
    std::fs::write(&files.2, &made.serving.key).expect("write key");
    files
}

/// One failure: how to cause it, and what the user must see.
struct Case {
    name: &'static str,
    args: Vec<String>,
    kubeconfig: Option<PathBuf>,
    exit: i32,
    /// A word the `--help` line of that exit status holds.
    documented_as: &'static str,
    /// The cause, as the message must state it (exactly once).
    cause: String,
    /// Extra environment (a delegated grant).
    env: Vec<(&'static str, String)>,
}

fn case(name: &'static str, kubeconfig: Option<&Path>, args: &[&str], exit: i32, documented_as: &'static str, cause: &str) -> Case {
    Case {
        name,
        args: args.iter().map(|a| a.to_string()).collect(),
        kubeconfig: kubeconfig.map(Path::to_path_buf),
        exit,
        documented_as,
        cause: cause.to_string(),
        env: Vec::new(),
    }
}

impl Case {
    fn with_env(mut self, name: &'static str, value: &str) -> Case {
        self.env.push((name, value.to_string()));
        self
    }
}

/// The `--help` line documenting exit status `code`.
fn documented(help: &str, code: i32) -> Option<String> {
    help.lines().find(|l| l.trim_start().starts_with(&format!("{code}  "))).map(str::to_string)
}

/// Checks one case; returns what is wrong with it, if anything.
fn check(case: &Case, home: &Path, help: &str) -> Vec<String> {
    let args: Vec<&str> = case.args.iter().map(String::as_str).collect();
    let cluster = case.kubeconfig.as_deref().map_or(Cluster::None, Cluster::Kubeconfig);
    let env: Vec<(&str, &str)> = case.env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let out = kube_fence_with(cluster, home, &args, &env);
    let stderr = text(&out.stderr);
    eprintln!("{:<34} exit {:?}  {}", case.name, out.status.code(), stderr.lines().last().unwrap_or_default());
    let mut wrong = Vec::new();
    let mut fail = |what: String| wrong.push(format!("{}: {what}\n    stderr: {stderr}", case.name));
    if out.status.code() != Some(case.exit) {
        fail(format!("exit status {:?}, want {}", out.status.code(), case.exit));
    }
    match documented(help, case.exit) {
        Some(line) if line.contains(case.documented_as) => {}
        line => fail(format!("--help documents exit status {} as {line:?}, not as {:?}", case.exit, case.documented_as)),
    }
    // Servers log to stderr before they fail; everything else prints the error line alone.
    let serves = matches!(args.first(), Some(&"run" | &"webhook" | &"controller"));
    let message = stderr.lines().last().unwrap_or_default().to_string();
    if !serves && stderr.lines().count() != 1 {
        fail(format!("{} lines, want one", stderr.lines().count()));
    }
    if stderr.lines().filter(|l| l.contains("kube-fence: error:")).count() != 1 || !message.starts_with("kube-fence: error: ") {
        fail("the error is not one line `kube-fence: error: ...`, last".into());
    }
    let times = message.matches(&case.cause).count();
    if times != 1 {
        fail(format!("names the cause {:?} {times} times, want once", case.cause));
    }
    for noise in NOISE {
        if message.contains(noise) {
            fail(format!("contains {noise:?}"));
        }
    }
    if !out.stdout.is_empty() {
        fail(format!("printed to stdout: {}", text(&out.stdout)));
    }
    wrong
}

fn run_ok(kubeconfig: &Path, home: &Path, args: &[&str]) -> String {
    let out = kube_fence(Cluster::Kubeconfig(kubeconfig), home, args);
    assert!(out.status.success(), "kube-fence {}: {}", args.join(" "), text(&out.stderr));
    text(&out.stdout)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_failure_a_user_can_cause_is_one_line_with_its_documented_exit_status() {
    let client = common::client().await;
    let ns = common::namespace(&client, "cli-errors").await;
    let kubeconfig = tokio::task::spawn_blocking(kube_fence_testenv::shared_kubeconfig).await.expect("kubeconfig");
    let home = tempfile::tempdir().expect("an empty HOME");
    let home = home.path();
    let help = text(&kube_fence(Cluster::None, home, &["--help"]).stdout);

    // kube-fence for this namespace: the lease controller and the fencing webhook.
    let mut local = Local::start(&kubeconfig, home, &ns, "table", &[]);
    local.wait_ready();

    // Worker a guards a ConfigMap with its token, releases; worker b gets a newer token and
    // writes. a's token is now stale.
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let shared = ConfigMap { metadata: ObjectMeta { name: Some("shared".into()), ..Default::default() }, ..Default::default() };
    configmaps.create(&PostParams::default(), &shared).await.expect("create the ConfigMap");
    let token_a = run_ok(&kubeconfig, home, &["lease", "acquire", "l", "--holder", "a", "--duration", "60s", "-n", &ns]);
    run_ok(
        &kubeconfig,
        home,
        &["patch", "configmap/shared", "--lease", "l", "--token", &token_a, "-n", &ns, "-p", r#"{"data":{"writer":"a"}}"#],
    );
    run_ok(&kubeconfig, home, &["lease", "release", "l", "--holder", "a", "-n", &ns]);
    let token_b = run_ok(&kubeconfig, home, &["lease", "acquire", "l", "--holder", "b", "--duration", "120s", "-n", &ns]);
    assert!(token_b.parse::<u64>().expect("token") > token_a.parse::<u64>().expect("token"), "b's token {token_b} > a's {token_a}");
    run_ok(
        &kubeconfig,
        home,
        &["patch", "configmaps/shared", "--lease", "l", "--token", &token_b, "-n", &ns, "-p", r#"{"data":{"writer":"b"}}"#],
    );

    let (_closed, port) = closed_port();
    let unreachable = common::kubeconfig_variant(home, "unreachable", |config| {
        for cluster in common::entries(config, "clusters", "cluster") {
            cluster.insert("server".into(), format!("https://127.0.0.1:{port}").into());
        }
    });
    let nobody = common::kubeconfig_variant(home, "nobody", |config| {
        for user in common::entries(config, "users", "user") {
            user.insert("as".into(), "kube-fence-test-nobody".into());
        }
    });
    // Users allowed everything `lease acquire` does to a Lease but watch it (nowatch), or list
    // and watch it (nolist): the watch acquire waits with is refused, at its start or at its
    // initial list.
    let limited = |user: &str, verbs: &[&str]| {
        let kubeconfig = common::kubeconfig_variant(home, user, |config| {
            for entry in common::entries(config, "users", "user") {
                entry.insert("as".into(), user.into());
            }
        });
        let role: Role = serde_json::from_value(serde_json::json!({
            "metadata": {"name": user},
            "rules": [{"apiGroups": ["kubefence.io"], "resources": ["leases"], "verbs": verbs}],
        }))
        .expect("a Role");
        let binding: RoleBinding = serde_json::from_value(serde_json::json!({
            "metadata": {"name": user},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": user},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}],
        }))
        .expect("a RoleBinding");
        (kubeconfig, role, binding)
    };
    let mut limited_kubeconfigs = Vec::new();
    for (user, verbs) in [
        ("kube-fence-test-nowatch", &["get", "list", "create", "update", "patch"][..]),
        ("kube-fence-test-nolist", &["get", "create", "update", "patch"][..]),
    ] {
        let (kubeconfig, role, binding) = limited(user, verbs);
        Api::<Role>::namespaced(client.clone(), &ns).create(&PostParams::default(), &role).await.expect("create the Role");
        Api::<RoleBinding>::namespaced(client.clone(), &ns).create(&PostParams::default(), &binding).await.expect("create the RoleBinding");
        // In effect before the cases run: the refusal they show is of the verb left out.
        common::identity::wait_user_authorized(&client, user, &ns, "kubefence.io", "leases", "get", None).await;
        limited_kubeconfigs.push(kubeconfig);
    }
    let missing_ns = format!("{ns}-missing");
    let busy = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let busy_port = busy.local_addr().expect("addr").port().to_string();
    let kc = Some(kubeconfig.as_path());
    let missing_cert = home.join("no-such.crt").display().to_string();
    let missing_kubeconfig = home.join("no-such-kubeconfig").display().to_string();
    let (_, cert, key) = serving_files(home);
    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    let unwritable = home.join("no-such-dir/ready").display().to_string();
    let cases = [
        case(
            "no kubeconfig",
            None,
            &["lease", "get", "l", "-n", &ns],
            3,
            "no cluster",
            "no cluster configured: set KUBECONFIG or run inside a Pod",
        ),
        case(
            "KUBECONFIG names no file",
            Some(&home.join("no-such-kubeconfig")),
            &["lease", "get", "l", "-n", &ns],
            3,
            "no cluster",
            "does not exist: fix KUBECONFIG",
        ),
        case(
            "--kubeconfig names no file",
            None,
            &["lease", "get", "l", "-n", &ns, "--kubeconfig", &missing_kubeconfig],
            3,
            "no cluster",
            &format!("the kubeconfig {missing_kubeconfig} named by --kubeconfig does not exist"),
        ),
        case(
            "--context names no context",
            kc,
            &["--context", "nosuch", "lease", "get", "l", "-n", &ns],
            3,
            "no cluster",
            "the kubeconfig named by KUBECONFIG has no context \"nosuch\" (--context)",
        ),
        case(
            "lease run without a command",
            kc,
            &["lease", "run", "l", "-n", &ns],
            2,
            "bad command line",
            "the following required arguments were not provided: <COMMAND>...",
        ),
        case(
            "lease run of a missing program",
            kc,
            &["lease", "run", "run-missing", "--holder", "c", "-n", &ns, "--", &missing_cert],
            1,
            "any other failure",
            &format!("cannot run `{missing_cert}`: no such file or directory"),
        ),
        case(
            "unreachable API server",
            Some(&unreachable),
            &["lease", "acquire", "l", "--holder", "c", "--wait", "20s", "-n", &ns],
            3,
            "cannot be reached",
            &format!("cannot reach the API server at https://127.0.0.1:{port}: connection refused"),
        ),
        case(
            "forbidden by RBAC (get)",
            Some(&nobody),
            &["lease", "get", "l", "-n", &ns],
            4,
            "RBAC",
            "User \"kube-fence-test-nobody\" cannot get resource \"leases\"",
        ),
        case(
            "forbidden by RBAC (acquire)",
            Some(&nobody),
            &["lease", "acquire", "l", "--holder", "c", "--wait", "20s", "-n", &ns],
            4,
            "RBAC",
            "User \"kube-fence-test-nobody\" cannot get resource \"leases\"",
        ),
        case(
            "forbidden by RBAC (acquire's watch)",
            Some(&limited_kubeconfigs[0]),
            &["lease", "acquire", "nowatch", "--holder", "c", "--wait", "60s", "-n", &ns],
            4,
            "RBAC",
            "User \"kube-fence-test-nowatch\" cannot watch resource \"leases\"",
        ),
        case(
            "forbidden by RBAC (acquire's list)",
            Some(&limited_kubeconfigs[1]),
            &["lease", "acquire", "nolist", "--holder", "c", "--wait", "60s", "-n", &ns],
            4,
            "RBAC",
            "User \"kube-fence-test-nolist\" cannot list resource \"leases\"",
        ),
        case(
            "forbidden by RBAC (lease run's watch)",
            Some(&limited_kubeconfigs[0]),
            &["lease", "run", "nowatch-run", "--holder", "c", "--wait", "60s", "-n", &ns, "--", "true"],
            4,
            "RBAC",
            "User \"kube-fence-test-nowatch\" cannot watch resource \"leases\"",
        ),
        case(
            "missing namespace (get)",
            kc,
            &["lease", "get", "l", "-n", &missing_ns],
            5,
            "namespace",
            &format!("namespace \"{missing_ns}\" does not exist"),
        ),
        case(
            "missing namespace (acquire)",
            kc,
            &["lease", "acquire", "l", "--holder", "c", "--wait", "20s", "-n", &missing_ns],
            5,
            "namespace",
            &format!("namespace \"{missing_ns}\" does not exist"),
        ),
        case(
            "missing lease",
            kc,
            &["lease", "renew", "nosuchlease", "--holder", "c", "-n", &ns],
            5,
            "lease",
            &format!("lease \"nosuchlease\" in namespace \"{ns}\" does not exist"),
        ),
        case(
            "missing object (fenced write)",
            kc,
            &["patch", "configmap/nosuchobject", "--lease", "l", "--token", &token_b, "-n", &ns, "-p", "{}"],
            5,
            "object",
            &format!("ConfigMap \"nosuchobject\" in namespace \"{ns}\" does not exist"),
        ),
        case(
            "missing object (fenced delete)",
            kc,
            &["delete", "configmap/nosuchobject", "-n", &ns],
            5,
            "object",
            &format!("ConfigMap \"nosuchobject\" in namespace \"{ns}\" does not exist"),
        ),
        case(
            "fenced write without a grant",
            kc,
            &["patch", "configmap/shared", "-n", &ns, "-p", "{}"],
            2,
            "bad command line",
            "no grant to write with: give --lease and --token",
        ),
        case(
            "malformed delegated grant",
            kc,
            &["patch", "configmap/shared", "-p", "{}"],
            2,
            "bad command line",
            "KUBE_FENCE_GRANT is not a usable grant",
        )
        .with_env("KUBE_FENCE_GRANT", "no-namespace:12"),
        case(
            "delegated grant, other namespace",
            kc,
            &["delete", "configmap/shared", "-n", "elsewhere"],
            2,
            "bad command line",
            &format!("the delegated grant is for lease \"l\" in namespace \"{ns}\""),
        )
        .with_env("KUBE_FENCE_GRANT", &format!("{ns}/l:{token_b}")),
        case(
            "manifests to delegate missing",
            kc,
            &["delegate", "--lease", "l", "--token", "5", "-n", &ns, "-f", &missing_cert],
            1,
            "any other failure",
            &format!("cannot read the manifests {missing_cert}: no such file or directory"),
        ),
        case(
            "bad duration",
            kc,
            &["lease", "acquire", "l", "--holder", "c", "--duration", "soon", "-n", &ns],
            2,
            "bad duration",
            "not a duration",
        ),
        case(
            "wait timeout",
            kc,
            &["lease", "acquire", "l", "--holder", "c", "--wait", "1s", "-n", &ns],
            6,
            "timed out",
            &format!("timed out after 1s waiting for lease \"l\" in namespace \"{ns}\": it is held by \"b\""),
        ),
        case(
            "lease held by another (renew)",
            kc,
            &["lease", "renew", "l", "--holder", "c", "-n", &ns],
            7,
            "another holds it",
            &format!("lease \"l\" in namespace \"{ns}\" is held by \"b\", not by \"c\""),
        ),
        case(
            "lease held by another (get --holder)",
            kc,
            &["lease", "get", "l", "--holder", "c", "-n", &ns],
            7,
            "another holds it",
            &format!("lease \"l\" in namespace \"{ns}\" is held by \"b\", not by \"c\""),
        ),
        case(
            "lease held by another (release)",
            kc,
            &["lease", "release", "l", "--holder", "a", "-n", &ns],
            7,
            "another holds it",
            &format!("lease \"l\" in namespace \"{ns}\" is held by \"b\", not by \"a\""),
        ),
        case(
            "stale token on a fenced write",
            kc,
            &["patch", "configmap/shared", "--lease", "l", "--token", &token_a, "-n", &ns, "-p", r#"{"data":{"writer":"a"}}"#],
            8,
            "stale token",
            &format!(
                "stale token: ConfigMap \"shared\" in namespace \"{ns}\" records token {token_b} of lease \"l\", the write presented {token_a}"
            ),
        ),
        case(
            "stale token on a fenced delete",
            kc,
            &["delete", "configmap/shared", "--lease", "l", "--token", &token_a, "-n", &ns],
            8,
            "stale token",
            &format!(
                "stale token: ConfigMap \"shared\" in namespace \"{ns}\" records token {token_b} of lease \"l\", the write presented {token_a}"
            ),
        ),
        case(
            "stale delegated grant",
            kc,
            &["patch", "configmap/shared", "-p", r#"{"data":{"writer":"a"}}"#],
            8,
            "stale token",
            &format!("records token {token_b} of lease \"l\", the write presented {token_a}"),
        )
        .with_env("KUBE_FENCE_GRANT", &format!("{ns}/l:{token_a}")),
        case("webhook without TLS", kc, &["webhook", "--addr", "127.0.0.1:0"], 2, "bad command line", "the webhook serves HTTPS only"),
        case(
            "local with a metrics port",
            kc,
            &["run", "--local", "--metrics-addr", "127.0.0.1:0"],
            2,
            "bad command line",
            "--metrics-addr is not served with --local",
        ),
        case(
            "local webhook port taken",
            kc,
            &[
                "run",
                "--local",
                "--local-port",
                &busy_port,
                "--watch-namespace",
                &ns,
                "--local-configuration",
                &format!("kf-cli-busy-{ns}"),
            ],
            1,
            "any other failure",
            &format!("cannot listen on 127.0.0.1:{busy_port}: the address is already in use"),
        ),
        case(
            "webhook TLS file missing",
            kc,
            &["webhook", "--addr", "127.0.0.1:0", "--tls-cert-file", &missing_cert, "--tls-key-file", &missing_cert],
            1,
            "any other failure",
            &format!("cannot read the TLS file {missing_cert}: no such file or directory"),
        ),
        case(
            "webhook ready file unwritable",
            kc,
            &["webhook", "--addr", "127.0.0.1:0", "--tls-cert-file", &cert, "--tls-key-file", &key, "--ready-file", &unwritable],
            1,
            "any other failure",
            &format!("cannot write the ready file {unwritable}: no such file or directory"),
        ),
        case(
            "controller ready file unwritable",
            kc,
            &["controller", "--namespace", &ns, "--metrics-addr", "127.0.0.1:0", "--ready-file", &unwritable],
            1,
            "any other failure",
            &format!("cannot write the ready file {unwritable}: no such file or directory"),
        ),
        case(
            "controller metrics port taken",
            kc,
            &["controller", "--namespace", &ns, "--metrics-addr", &format!("127.0.0.1:{busy_port}")],
            1,
            "any other failure",
            &format!(
                "cannot listen on 127.0.0.1:{busy_port}: the address is already in use; another process listens there: stop it or choose another --metrics-addr"
            ),
        ),
    ];
    let wrong: Vec<String> = cases.iter().flat_map(|c| check(c, home, &help)).collect();
    assert!(wrong.is_empty(), "{} of {} failures are reported wrongly:\n{}", wrong.len(), cases.len(), wrong.join("\n"));

    // The stale write did not stick.
    let writer = configmaps.get("shared").await.expect("get").data.unwrap_or_default().get("writer").cloned();
    assert_eq!(writer.as_deref(), Some("b"));

    // -v shows the whole chain, the API server's answer included, after the same first line.
    let out = kube_fence(Cluster::Kubeconfig(&nobody), home, &["-v", "lease", "get", "l", "-n", &ns]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}");
    assert!(stderr.lines().count() > 1 && stderr.contains("caused by:") && stderr.contains("Status {"), "-v shows the chain:\n{stderr}");

    // A clean stop removes the ready file and the registration.
    let configuration = local.configuration.clone();
    let status = local.stop();
    assert!(status.success(), "kube-fence run --local on SIGTERM: {status}\n{}", local.log());
    assert!(!local.ready_file.exists(), "the ready file is removed on exit");
    let vwcs: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    assert!(vwcs.get_opt(&configuration).await.expect("get").is_none(), "the registration is removed on exit");
    drop(busy);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_local_instances_run_at_once_on_free_ports() {
    let client = common::client().await;
    let first_ns = common::namespace(&client, "cli-two-a").await;
    let second_ns = common::namespace(&client, "cli-two-b").await;
    let kubeconfig = tokio::task::spawn_blocking(kube_fence_testenv::shared_kubeconfig).await.expect("kubeconfig");
    let home = tempfile::tempdir().expect("HOME");

    let mut first = Local::start(&kubeconfig, home.path(), &first_ns, "first", &[]);
    let mut second = Local::start(&kubeconfig, home.path(), &second_ns, "second", &[]);
    let (first_url, second_url) = (first.wait_ready(), second.wait_ready());
    assert!(first_url.starts_with("https://127.0.0.1:") && second_url.starts_with("https://127.0.0.1:"), "{first_url} {second_url}");
    assert_ne!(first_url, second_url, "each instance picked its own port");

    // Both serve: in each namespace, its controller grants and its webhook judges (a second
    // write with the same token is stale).
    for ns in [&first_ns, &second_ns] {
        let token = run_ok(&kubeconfig, home.path(), &["lease", "acquire", "l", "--holder", "w", "--duration", "30s", "-n", ns]);
        let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
        let cm = ConfigMap { metadata: ObjectMeta { name: Some("x".into()), ..Default::default() }, ..Default::default() };
        configmaps.create(&PostParams::default(), &cm).await.expect("create");
        let write = ["patch", "configmap/x", "--lease", "l", "--token", &token, "-n", ns, "-p", r#"{"data":{"k":"v"}}"#];
        run_ok(&kubeconfig, home.path(), &write);
        let again = kube_fence(Cluster::Kubeconfig(&kubeconfig), home.path(), &write);
        assert_eq!(again.status.code(), Some(8), "the webhook for {ns} judges: {}", text(&again.stderr));
    }
    for local in [&mut first, &mut second] {
        let status = local.stop();
        assert!(status.success(), "{status}\n{}", local.log());
    }
}

/// `kube-fence webhook` and `kube-fence controller` on port 0: each writes the address it was
/// given to its ready file (the port bound, never picked first and bound later), serves there,
/// and removes the file on SIGTERM.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhook_and_controller_write_where_they_listen_to_their_ready_files() {
    let client = common::client().await;
    let ns = common::namespace(&client, "cli-ready").await;
    let kubeconfig = tokio::task::spawn_blocking(kube_fence_testenv::shared_kubeconfig).await.expect("kubeconfig");
    let home = tempfile::tempdir().expect("HOME");
    let (ca, cert, key) = serving_files(home.path());
    let (webhook_ready, controller_ready) = (home.path().join("webhook.ready"), home.path().join("controller.ready"));
    let spawn = |args: Vec<String>, log: &str| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let log = std::fs::File::create(home.path().join(log)).expect("log file");
        command(Cluster::Kubeconfig(&kubeconfig), home.path(), &args).stdout(Stdio::null()).stderr(log).spawn().expect("start kube-fence")
    };
    let path = |p: &Path| p.display().to_string();
    let mut webhook = spawn(
        ["webhook", "--addr", "127.0.0.1:0", "--namespace", &ns, "--webhook-configuration", &format!("kf-cli-ready-{ns}")]
            .into_iter()
            .map(String::from)
            .chain([
                "--tls-cert-file".into(),
                path(&cert),
                "--tls-key-file".into(),
                path(&key),
                "--ready-file".into(),
                path(&webhook_ready),
            ])
            .collect(),
        "webhook.log",
    );
    let mut controller = spawn(
        ["controller", "--namespace", &ns, "--metrics-addr", "127.0.0.1:0", "--ready-file", &path(&controller_ready)]
            .into_iter()
            .map(String::from)
            .collect(),
        "controller.log",
    );

    let at_webhook = common::wait_ready_file(&webhook_ready, &mut webhook, Duration::from_secs(60)).await;
    let at_controller = common::wait_ready_file(&controller_ready, &mut controller, Duration::from_secs(60)).await;
    let webhook_addr = at_webhook.webhook.expect("the webhook's ready file names its address");
    let metrics_addr = at_controller.metrics.expect("the controller's ready file names its metrics address");
    assert_eq!((at_webhook.metrics, at_controller.webhook), (None, None), "each names only the port it serves");
    assert!(webhook_addr.ip().is_loopback() && webhook_addr.port() != 0, "{webhook_addr}");
    assert!(metrics_addr.ip().is_loopback() && metrics_addr.port() != 0, "{metrics_addr}");

    let healthz = |url: String, ca: Option<&Path>| {
        let mut curl = Command::new("curl");
        curl.args(["-sf", "--max-time", "5"]);
        if let Some(ca) = ca {
            curl.arg("--cacert").arg(ca);
        }
        curl.arg(&url).stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
    };
    assert!(healthz(format!("https://{webhook_addr}/healthz"), Some(&ca)), "the webhook serves HTTPS at {webhook_addr}");
    assert!(healthz(format!("http://{metrics_addr}/healthz"), None), "the controller serves /healthz at {metrics_addr}");

    for (child, ready) in [(&mut webhook, &webhook_ready), (&mut controller, &controller_ready)] {
        let status = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("run kill");
        assert!(status.success());
        let deadline = Instant::now() + Duration::from_secs(30);
        let exited = loop {
            if let Some(status) = child.try_wait().expect("wait") {
                break status;
            }
            assert!(Instant::now() < deadline, "kube-fence did not stop within 30 s of SIGTERM");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        assert!(exited.success(), "{exited}");
        assert!(!ready.exists(), "{} is removed on exit", ready.display());
    }
}

/// The exit-status table of docs/reference/exit-statuses.md and `--help` list the same statuses.
#[test]
fn the_reference_and_the_help_document_the_same_exit_statuses() {
    let home = tempfile::tempdir().expect("HOME");
    let help = text(&kube_fence(Cluster::None, home.path(), &["--help"]).stdout);
    let page = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/reference/exit-statuses.md")).expect("exit-statuses.md");
    let in_page: Vec<i32> = page
        .lines()
        .skip_while(|l| !l.starts_with("| exit | cause |"))
        .take_while(|l| l.starts_with('|'))
        .filter_map(|l| l.strip_prefix("| ")?.split_once(" |").map(|(code, _)| code.trim().to_string()))
        .filter_map(|code| code.parse().ok())
        .collect();
    let in_help: Vec<i32> = (0..=255).filter(|code| documented(&help, *code).is_some()).collect();
    assert!(in_help.len() >= 9, "--help documents the exit statuses:\n{help}");
    assert_eq!(in_page, in_help, "docs/reference/exit-statuses.md's exit table and --help agree");
}

/// A failure with a nested cause, without a cluster: a delegated grant whose token does not parse
/// (the grant's error, caused by the token's). `-v` names each cause once, on its own `caused by:`
/// line after the failed action; without `-v`, the one line names each cause once too.
#[test]
fn verbose_names_each_cause_of_a_nested_failure_once() {
    let home = tempfile::tempdir().expect("HOME");
    let manifest = home.path().join("configmap.yaml");
    std::fs::write(&manifest, "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n").expect("write the manifest");
    let manifest = manifest.display().to_string();
    let args = ["delegate", "-f", &manifest];
    let grant = [("KUBE_FENCE_GRANT", "work/jobs:012")];
    let causes = ["the delegated grant \"work/jobs:012\" has a bad token", "the token \"012\" has a leading zero"];

    let verbose = kube_fence_with(Cluster::None, home.path(), &["-v", "delegate", "-f", &manifest], &grant);
    let stderr = text(&verbose.stderr);
    eprintln!("kube-fence -v {}:\n{stderr}", args.join(" "));
    assert_eq!(verbose.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().next(), Some("kube-fence: error: KUBE_FENCE_GRANT is not a usable grant"), "{stderr}");
    for cause in causes {
        assert_eq!(stderr.matches(cause).count(), 1, "-v names {cause:?} once:\n{stderr}");
        assert!(stderr.lines().any(|l| l.starts_with("  caused by: ") && l.contains(cause)), "-v names {cause:?} as a cause:\n{stderr}");
    }

    let plain = kube_fence_with(Cluster::None, home.path(), &args, &grant);
    let stderr = text(&plain.stderr);
    assert_eq!(plain.status.code(), Some(2), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("kube-fence: error: KUBE_FENCE_GRANT is not a usable grant: "), "{stderr}");
    for cause in causes {
        assert_eq!(stderr.matches(cause).count(), 1, "the one line names {cause:?} once: {stderr}");
    }
}

/// The same for a chain of kube's errors, whose messages quote their causes: a KUBECONFIG that
/// names no file (the config could not be inferred, because the kubeconfig could not be read,
/// because the file does not exist). No `caused by:` line says again what a line above it said.
#[test]
fn verbose_names_each_cause_of_a_kubeconfig_failure_once() {
    let home = tempfile::tempdir().expect("HOME");
    let kubeconfig = home.path().join("no-such-kubeconfig");
    let out = kube_fence(Cluster::Kubeconfig(&kubeconfig), home.path(), &["-v", "lease", "get", "l", "-n", "work"]);
    let stderr = text(&out.stderr);
    eprintln!("kube-fence -v lease get l -n work:\n{stderr}");
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    let causes: Vec<&str> = stderr.lines().filter_map(|l| l.strip_prefix("  caused by: ")).collect();
    assert!(!causes.is_empty(), "-v shows the chain:\n{stderr}");
    for (i, cause) in causes.iter().enumerate() {
        assert!(causes[..i].iter().all(|above| !above.contains(cause)), "{cause:?} is said again:\n{stderr}");
    }
    let missing = std::io::Error::from_raw_os_error(2).to_string();
    assert_eq!(stderr.matches(&missing).count(), 1, "-v names {missing:?} once:\n{stderr}");
}

/// `kube-fence delete` deletes exactly the version it read, which a guarded DELETE needs and
/// `kubectl delete` cannot send: of a token-guarded object with the grant's token, and of a
/// holder-only object as the lease's holder Pod, whose plain DELETE (what `kubectl delete`
/// sends) the webhook refuses with `DeletePreconditionRequired`. Threat case: a stale-but-honest
/// writer (a stale token's delete exits 8 in the table above; here another Pod's delete of the
/// holder's object exits 8 `NotHolder`), and the holder's own delete works from the shell.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_removes_exactly_the_version_read_as_holder_or_with_a_token() {
    use kube::api::DeleteParams;
    use kube_fence_api::Lease;
    use kube_fence_api::denial::{Denial, Reason};
    use kube_fence_api::names::{HOLDER_ONLY, LEASE_LABEL, TOKEN_ANNOTATION, WRITER_LABEL};

    let client = common::client().await;
    let ns = common::namespace(&client, "cli-delete").await;
    let kubeconfig = tokio::task::spawn_blocking(kube_fence_testenv::shared_kubeconfig).await.expect("kubeconfig");
    let home = tempfile::tempdir().expect("HOME");
    let home = home.path();
    let mut local = Local::start(&kubeconfig, home, &ns, "delete", &[]);
    local.wait_ready();
    let configmaps: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
    let precondition_required = |result: Result<_, kube::Error>| match result {
        Err(kube::Error::Api(status)) => Denial::from_status(&status).is_some_and(|d| d.reason == Reason::DeletePreconditionRequired),
        _ => false,
    };

    // A token-guarded ConfigMap: a plain DELETE is refused; `kube-fence delete` with the token
    // deletes it; delegated, the grant comes from KUBE_FENCE_GRANT.
    let token = run_ok(&kubeconfig, home, &["lease", "acquire", "t", "--holder", "a", "--duration", "60s", "-n", &ns]);
    for name in ["by-flags", "by-delegation"] {
        configmaps.create(&PostParams::default(), &common::guarded_configmap(name, "t")).await.expect_err("no token: refused");
        let guarded = ConfigMap {
            metadata: ObjectMeta {
                annotations: Some([(TOKEN_ANNOTATION.into(), token.clone())].into()),
                ..common::guarded_configmap(name, "t").metadata
            },
            ..Default::default()
        };
        configmaps.create(&PostParams::default(), &guarded).await.expect("created with the newest token");
        assert!(precondition_required(configmaps.delete(name, &DeleteParams::default()).await), "a plain DELETE of {name} is refused");
    }
    let out = run_ok(&kubeconfig, home, &["delete", "configmap/by-flags", "--lease", "t", "--token", &token, "-n", &ns]);
    assert!(out.starts_with("configmaps/by-flags deleted (resourceVersion "), "{out}");
    let delegated = format!("{ns}/t:{token}");
    let out = kube_fence_with(
        Cluster::Kubeconfig(&kubeconfig),
        home,
        &["delete", "configmap/by-delegation"],
        &[("KUBE_FENCE_GRANT", &delegated)],
    );
    assert!(out.status.success(), "a delegated delete: {}", text(&out.stderr));
    for name in ["by-flags", "by-delegation"] {
        assert!(configmaps.get_opt(name).await.expect("get").is_none(), "{name} is gone");
    }

    // `kube-fence delegate` stamps a Job manifest; `kubectl create` makes it, and the Pod the Job
    // controller makes carries the grant where the kubelet fills KUBE_FENCE_GRANT from.
    let manifest = home.join("job.yaml");
    std::fs::write(
        &manifest,
        "apiVersion: batch/v1\nkind: Job\nmetadata: {name: delegated}\nspec:\n  template:\n    spec:\n      restartPolicy: Never\n      \
         schedulingGates: [{name: kubefence.io/never-run}]\n      containers: [{name: work, image: registry.invalid/none}]\n",
    )
    .expect("write the manifest");
    let stamped =
        run_ok(&kubeconfig, home, &["delegate", "--lease", "t", "--token", &token, "-n", &ns, "-f", &manifest.display().to_string()]);
    let stamped_file = home.join("job-delegated.yaml");
    std::fs::write(&stamped_file, stamped).expect("write the stamped manifest");
    let bin = kube_fence_testenv::binaries().expect("kubectl");
    let created = Command::new(bin.join("kubectl"))
        .args(["create", "-n", &ns, "-f"])
        .arg(&stamped_file)
        .env("KUBECONFIG", &kubeconfig)
        .output()
        .expect("kubectl create");
    assert!(created.status.success(), "kubectl create the delegated Job: {}", text(&created.stderr));
    let pods: Api<k8s_openapi::api::core::v1::Pod> = Api::namespaced(client.clone(), &ns);
    let deadline = Instant::now() + Duration::from_secs(60);
    let pod = loop {
        let listed =
            pods.list(&kube::api::ListParams::default().labels("batch.kubernetes.io/job-name=delegated")).await.expect("list Pods");
        if let Some(pod) = listed.items.into_iter().next() {
            break pod;
        }
        assert!(Instant::now() < deadline, "the Job controller made no Pod within 60 s");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let annotation = pod.metadata.annotations.unwrap_or_default().get("kubefence.io/delegated-grant").cloned();
    assert_eq!(annotation, Some(delegated.clone()), "the Job's Pod carries the grant");
    let env = pod
        .spec
        .map(|s| s.containers)
        .unwrap_or_default()
        .into_iter()
        .flat_map(|c| c.env.unwrap_or_default())
        .find(|e| e.name == "KUBE_FENCE_GRANT");
    let path = env.and_then(|e| e.value_from).and_then(|v| v.field_ref).map(|f| f.field_path);
    assert_eq!(path.as_deref(), Some("metadata.annotations['kubefence.io/delegated-grant']"), "from the annotation, by the kubelet");

    // A holder-only ConfigMap of a Pod-identity lease, held by Pod p1.
    let made = common::identity::worker_pods(&client, &ns, &["p1", "p2"]).await;
    let lease: Lease = serde_json::from_value(serde_json::json!({"apiVersion": "kubefence.io/v1alpha1", "kind": "Lease",
        "metadata": {"name": "work"}, "spec": {"identity": "Pod"}}))
    .expect("a Lease literal");
    Api::<Lease>::namespaced(client.clone(), &ns).create(&PostParams::default(), &lease).await.expect("create the lease");
    let p1 = common::identity::kubeconfig_as_pod(&client, &ns, "worker", &made[0]).await;
    let p2 = common::identity::kubeconfig_as_pod(&client, &ns, "worker", &made[1]).await;
    let p1_client = common::identity::client_as_pod(&client, &ns, "worker", &made[0]).await;
    common::identity::wait_authorized(&p1_client, &ns, "", "configmaps", "delete").await;
    let token = run_ok(p1.path(), home, &["lease", "acquire", "work", "--holder", "p1", "--duration", "60s", "-n", &ns]);
    let holder_only = ConfigMap {
        metadata: ObjectMeta {
            name: Some("state".into()),
            labels: Some([(LEASE_LABEL.into(), "work".into()), (WRITER_LABEL.into(), HOLDER_ONLY.into())].into()),
            annotations: Some([(TOKEN_ANNOTATION.into(), token.clone())].into()),
            ..Default::default()
        },
        ..Default::default()
    };
    let p1_configmaps: Api<ConfigMap> = Api::namespaced(p1_client, &ns);
    p1_configmaps.create(&PostParams::default(), &holder_only).await.expect("the holder creates its object");
    // What `kubectl delete` sends, from the holder itself: refused, it names no version.
    assert!(precondition_required(p1_configmaps.delete("state", &DeleteParams::default()).await), "the holder's plain DELETE is refused");
    let kubectl = Command::new(bin.join("kubectl"))
        .args(["delete", "configmap", "state", "-n", &ns])
        .env("KUBECONFIG", p1.path())
        .output()
        .expect("run kubectl delete");
    let kubectl_err = text(&kubectl.stderr);
    assert!(!kubectl.status.success() && kubectl_err.contains("resourceVersion"), "the holder's kubectl delete is refused: {kubectl_err}");

    // Another Pod cannot delete it (exit 8, NotHolder, one line naming the holder).
    let out = kube_fence(Cluster::Kubeconfig(p2.path()), home, &["delete", "configmap/state", "-n", &ns]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(8), "{stderr}");
    assert!(
        stderr.starts_with("kube-fence: error: not the holder:") && stderr.contains("is held by p1") && stderr.lines().count() == 1,
        "{stderr}"
    );
    assert!(configmaps.get_opt("state").await.expect("get").is_some(), "the refused delete left it");

    // The holder deletes it from the shell.
    let out = run_ok(p1.path(), home, &["delete", "configmap/state", "-n", &ns]);
    assert!(out.starts_with("configmaps/state deleted"), "{out}");
    assert!(configmaps.get_opt("state").await.expect("get").is_none(), "the holder's delete removed it");
    let status = local.stop();
    assert!(status.success(), "{status}\n{}", local.log());
}

/// `kube-fence selftest` (what the chart's `helm test` runs): where kube-fence fences (a local
/// instance watching the namespace), the older grant's write is refused and it exits 0, twice in
/// a row (the second run's grants are newer than the first's objects); where nothing is fenced,
/// the stale write lands and it exits 1 with one line saying fencing does not work there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn selftest_passes_where_writes_are_fenced_and_fails_where_they_are_not() {
    let client = common::client().await;
    let fenced = common::namespace(&client, "cli-selftest").await;
    let unfenced = common::namespace(&client, "cli-selftest-not").await;
    let kubeconfig = tokio::task::spawn_blocking(kube_fence_testenv::shared_kubeconfig).await.expect("kubeconfig");
    let home = tempfile::tempdir().expect("HOME");
    let mut local = Local::start(&kubeconfig, home.path(), &fenced, "selftest", &[]);
    local.wait_ready();
    for run in 0..2 {
        let out = kube_fence(Cluster::Kubeconfig(&kubeconfig), home.path(), &["selftest", "-n", &fenced]);
        let stdout = text(&out.stdout);
        assert!(out.status.success(), "run {run}: {}\n{stdout}", text(&out.stderr));
        assert!(
            stdout.contains("refused (StaleToken), as it must be") && stdout.ends_with(&format!("fencing works in namespace {fenced}")),
            "{stdout}"
        );
    }
    let stored = Api::<ConfigMap>::namespaced(client.clone(), &fenced).get("kube-fence-selftest").await.expect("the selftest's object");
    assert_eq!(stored.data.unwrap_or_default().get("written-by").map(String::as_str), Some("newer"));

    // As the chart's `helm test` runs it: as the test's ServiceAccount, with the Role the chart
    // gives it (one Lease and one ConfigMap, by name), nothing more.
    let bin = kube_fence_testenv::binaries().expect("binaries");
    let rendered = Command::new(bin.join("helm"))
        .args(["template", "cmp", concat!(env!("CARGO_MANIFEST_DIR"), "/charts/kube-fence"), "-n", "kf-system"])
        .args(["--show-only", "templates/tests/selftest.yaml", "--set", &format!("tests.namespace={fenced}")])
        .env("HELM_CACHE_HOME", std::env::temp_dir().join("kube-fence-helm-cache"))
        .output()
        .expect("helm template");
    assert!(rendered.status.success(), "{}", text(&rendered.stderr));
    let rbac: Vec<serde_json::Value> = String::from_utf8_lossy(&rendered.stdout)
        .split("\n---")
        .filter_map(|doc| serde_saphyr::from_str::<serde_json::Value>(doc).ok())
        .filter(|doc| doc["kind"] == "Role" || doc["kind"] == "RoleBinding")
        .collect();
    assert_eq!(rbac.len(), 2, "Role, RoleBinding");
    let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": rbac});
    let mut apply = Command::new(bin.join("kubectl"))
        .args(["apply", "-f", "-"])
        .env("KUBECONFIG", &kubeconfig)
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .spawn()
        .expect("kubectl apply");
    std::io::Write::write_all(&mut apply.stdin.take().expect("stdin"), list.to_string().as_bytes()).expect("write");
    assert!(apply.wait().expect("kubectl").success(), "the chart's test RBAC applies");
    // The ServiceAccount of the release's namespace the RoleBinding names (impersonated: its
    // Pod's identity, without the Pod).
    let account = "system:serviceaccount:kf-system:cmp-kube-fence-selftest".to_string();
    let as_test = common::kubeconfig_variant(home.path(), "selftest-account", |config| {
        for user in common::entries(config, "users", "user") {
            user.insert("as".into(), account.clone().into());
        }
    });
    // The Role in effect first: acquire fails at once on a refused watch.
    let lease = "cmp-kube-fence-selftest";
    common::identity::wait_user_authorized(&client, &account, &fenced, "kubefence.io", "leases", "watch", Some(lease)).await;
    let out = kube_fence(Cluster::Kubeconfig(&as_test), home.path(), &["selftest", "-n", &fenced, "--name", lease]);
    assert!(out.status.success(), "the test's ServiceAccount can run it: {}\n{}", text(&out.stderr), text(&out.stdout));
    // Any other name is beyond its Role: it writes nothing, and fails at once with the refusal
    // of the list its acquire watches with (exit status 4), not after --wait as a timeout (6).
    let out = kube_fence(Cluster::Kubeconfig(&as_test), home.path(), &["selftest", "-n", &fenced, "--name", "other", "--wait", "60s"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(4), "{stderr}\n{}", text(&out.stdout));
    assert!(stderr.contains(&format!("User \"{account}\" cannot list resource \"leases\"")), "{stderr}");
    let leases: Api<kube_fence_api::Lease> = Api::namespaced(client.clone(), &fenced);
    assert!(leases.get_opt("other").await.expect("get").is_none(), "no Lease beyond the Role was written");

    // The controller of `fenced` grants only there: the unfenced namespace's lease needs a
    // controller too, which this instance is not. A second local instance watching it, with its
    // webhook scoped to a namespace that does not exist, grants there and fences nothing.
    let nothing = format!("{unfenced}-nothing");
    let mut granting = Local::start(&kubeconfig, home.path(), &unfenced, "selftest-grants", &["--only-namespace", &nothing]);
    granting.wait_ready();
    let out = kube_fence(Cluster::Kubeconfig(&kubeconfig), home.path(), &["selftest", "-n", &unfenced, "--name", "probe"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(
        stderr.starts_with("kube-fence: error: fencing does not work: the write to ConfigMap \"probe\"") && stderr.contains(&unfenced),
        "{stderr}"
    );
    for instance in [&mut local, &mut granting] {
        let status = instance.stop();
        assert!(status.success(), "{status}\n{}", instance.log());
    }
}
