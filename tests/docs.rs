//! The documentation, run: every `sh` block of README.md and docs/**/*.md is run with bash
//! (`set -euo pipefail`), and every relative link and `#anchor` in them must resolve.
//!
//! How a page's blocks run (locally, against the shared test cluster):
//! - all the page's blocks, in order, in one bash session (a variable set in one block is there in
//!   the next), from the repository's root, with kube-fence's and the control plane's binaries
//!   first on `PATH`;
//! - in a namespace of its own, made the kubeconfig's current namespace (a copy of it), deleted
//!   afterwards, with a `KUBE_FENCE_ENV_DIR` of its own (a page may start a control plane);
//! - a page marked `<!-- docs-test: with kube-fence -->` gets `kube-fence run --local` fencing
//!   that namespace while its blocks run;
//! - whatever the blocks left running is stopped (their process group) when the page ends.
//!
//! Markers, each an HTML comment on its own line:
//! - before a block, `<!-- docs-test: in-cluster -->`: it needs kube-fence installed by the chart
//!   on a real node; the in-cluster suite (hack/e2e-install-and-test.sh) runs those with
//!   `cargo test --test docs -- --ignored`, in page order, against the installed release;
//! - before a block, `<!-- docs-test: not run: REASON -->`: not run; the test lists them;
//! - anywhere in a page, `<!-- docs-test: run by tests/NAME.rs -->`: that test runs the page's
//!   blocks (and checks more than their exit status).
//!
//! A failing block fails the test with the page, the line and the command that failed.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

/// How a block is run.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Mark {
    /// By `every_shell_block_runs`, against the local control plane.
    Local,
    /// By `in_cluster_blocks_run_against_the_installed_chart`, on a real node.
    InCluster,
    /// Not at all, for this reason.
    NotRun(String),
}

/// One `sh` block of a page.
#[derive(Clone, Debug)]
struct Block {
    /// The page's line of the block's first command (1-based).
    line: usize,
    body: Vec<String>,
    mark: Mark,
}

/// One page: its path (relative to the repository's root) and what its markers say.
#[derive(Debug)]
struct Page {
    path: String,
    blocks: Vec<Block>,
    with_kube_fence: bool,
    run_by: Option<String>,
}

const MARKER: &str = "<!-- docs-test: ";

/// The blocks and markers of `text`. A block marker applies to the next block when only blank
/// lines and other HTML comments stand between them.
fn parse(path: &str, text: &str) -> Page {
    let mut page = Page { path: path.to_string(), blocks: Vec::new(), with_kube_fence: false, run_by: None };
    let mut pending: Option<Mark> = None;
    // The open fence: its indentation and whether it is a shell block.
    let mut open: Option<(usize, bool, Block)> = None;
    for (n, line) in text.lines().enumerate() {
        let trimmed = line.trim();
        if let Some((indent, shell, block)) = &mut open {
            if trimmed.starts_with("```") && trimmed.trim_start_matches('`').is_empty() {
                let (_, shell, block) = open.take().expect("open block");
                if shell {
                    page.blocks.push(block);
                }
            } else if *shell {
                if block.body.is_empty() {
                    block.line = n + 1;
                }
                let cut = line.len() - line.trim_start().len();
                block.body.push(line[cut.min(*indent)..].to_string());
            }
            continue;
        }
        if let Some(fence) = trimmed.strip_prefix("```") {
            let lang = fence.split_whitespace().next().unwrap_or("");
            let shell = matches!(lang, "sh" | "bash" | "shell");
            let mark = pending.take().unwrap_or(Mark::Local);
            let indent = line.len() - line.trim_start().len();
            open = Some((indent, shell, Block { line: n + 2, body: Vec::new(), mark }));
        } else if let Some(rest) = trimmed.strip_prefix(MARKER).and_then(|r| r.strip_suffix("-->")) {
            let rest = rest.trim();
            if rest == "with kube-fence" {
                page.with_kube_fence = true;
            } else if let Some(test) = rest.strip_prefix("run by ") {
                page.run_by = Some(test.trim().to_string());
            } else if rest == "in-cluster" {
                pending = Some(Mark::InCluster);
            } else if let Some(reason) = rest.strip_prefix("not run:") {
                pending = Some(Mark::NotRun(reason.trim().to_string()));
            } else {
                panic!("{path}:{}: unknown marker {trimmed:?}", n + 1);
            }
        } else if !trimmed.is_empty() && !trimmed.starts_with("<!--") {
            assert!(pending.is_none(), "{path}:{}: a docs-test marker must stand right before its block", n + 1);
        }
    }
    assert!(open.is_none(), "{path}: a code block is not closed");
    assert!(pending.is_none(), "{path}: a docs-test marker has no block after it");
    page
}

/// README.md and every page under docs/, by path relative to the root, sorted.
fn page_paths() -> Vec<String> {
    fn walk(dir: &Path, out: &mut Vec<String>) {
        for entry in std::fs::read_dir(dir).expect("read docs/") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path.strip_prefix(ROOT).expect("under the root").display().to_string());
            }
        }
    }
    let mut out = Vec::new();
    walk(&Path::new(ROOT).join("docs"), &mut out);
    out.sort();
    out.insert(0, "README.md".to_string());
    out
}

fn pages() -> Vec<Page> {
    page_paths()
        .into_iter()
        .map(|p| {
            let text = std::fs::read_to_string(Path::new(ROOT).join(&p)).unwrap_or_else(|e| panic!("{p}: {e}"));
            parse(&p, &text)
        })
        .collect()
}

/// Where a page's blocks run: the cluster (a kubeconfig), the namespace to make current, extra
/// environment.
struct Setting {
    kubeconfig: Option<PathBuf>,
    /// Directories put on `PATH` after kube-fence's (the control plane's binaries).
    bin: Vec<PathBuf>,
    env: Vec<(String, String)>,
    timeout: Duration,
}

/// What went wrong running some blocks: the page, the line, the command, and the output.
#[derive(Debug)]
struct Failure {
    at: String,
    command: String,
    status: String,
    output: String,
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: the block failed at `{}` ({})\n--- output ---\n{}", self.at, self.command, self.status, self.output)
    }
}

/// The trap line a failing command prints: `DOCS-TEST-FAILED <script line> <status> <command>`.
const FAILED: &str = "DOCS-TEST-FAILED";

/// Runs `blocks` (of `page`) in one bash session; a block's failure is reported with its page
/// line and command.
fn run_blocks(page: &str, blocks: &[&Block], setting: &Setting) -> Result<String, Failure> {
    // The script, and for each of its lines the page line it came from.
    let mut script = String::new();
    let mut origin: Vec<usize> = Vec::new();
    let mut push = |line: &str, from: usize, script: &mut String| {
        script.push_str(line);
        script.push('\n');
        origin.push(from);
    };
    push("set -euo pipefail", 0, &mut script);
    push(&format!("trap 's=$?; echo \"{FAILED} $LINENO $s $BASH_COMMAND\" >&2' ERR"), 0, &mut script);
    for block in blocks {
        for (i, line) in block.body.iter().enumerate() {
            push(line, block.line + i, &mut script);
        }
    }
    let work = tempfile::tempdir().expect("work dir");
    let log = work.path().join("output");
    let file = std::fs::File::create(&log).expect("output file");
    let bin = Path::new(env!("CARGO_BIN_EXE_kube-fence")).parent().expect("the binary's directory").to_path_buf();
    let mut path = vec![bin];
    path.extend(setting.bin.iter().cloned());
    path.extend(std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()));
    let mut command = Command::new("bash");
    command
        .arg("-c")
        .arg(&script)
        .current_dir(ROOT)
        .env("PATH", std::env::join_paths(path).expect("PATH"))
        .env("HELM_CACHE_HOME", std::env::temp_dir().join("kube-fence-helm-cache"))
        .stdin(Stdio::null())
        .stdout(file.try_clone().expect("output file"))
        .stderr(file);
    std::os::unix::process::CommandExt::process_group(&mut command, 0);
    match &setting.kubeconfig {
        Some(kubeconfig) => command.env("KUBECONFIG", kubeconfig),
        None => command.env_remove("KUBECONFIG"),
    };
    for (k, v) in &setting.env {
        command.env(k, v);
    }
    let mut child = command.spawn().expect("run bash");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for bash") {
            break Some(status);
        }
        if started.elapsed() > setting.timeout {
            break None;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    // Whatever the blocks started and left running (a background kube-fence, a port-forward).
    let group = format!("-{}", child.id());
    let _ = Command::new("kill").args(["-TERM", "--", &group]).stderr(Stdio::null()).status();
    if status.is_none() {
        let _ = child.wait();
    }
    // Time to stop cleanly (a kube-fence removes its webhook registration on SIGTERM), then KILL.
    let alive = || Command::new("kill").args(["-0", "--", &group]).stderr(Stdio::null()).status().is_ok_and(|s| s.success());
    let deadline = Instant::now() + Duration::from_secs(15);
    while alive() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    let _ = Command::new("kill").args(["-KILL", "--", &group]).stderr(Stdio::null()).status();
    let output = std::fs::read_to_string(&log).unwrap_or_default();
    match status {
        Some(status) if status.success() => Ok(output),
        Some(status) => {
            let trapped = output.lines().rev().find_map(|l| l.strip_prefix(FAILED)).map(|rest| {
                let mut parts = rest.trim().splitn(3, ' ');
                let line: usize = parts.next().and_then(|l| l.parse().ok()).unwrap_or(0);
                let code = parts.next().unwrap_or("?").to_string();
                (line, code, parts.next().unwrap_or("").to_string())
            });
            let (at, command, status) = match trapped {
                Some((line, code, command)) => {
                    // bash names a line inside a command continued with `\`: report the command
                    // from its first line, as the page has it (and what bash ran, for a pipeline).
                    let lines: Vec<&str> = script.lines().collect();
                    let mut first = line.clamp(1, lines.len());
                    while first > 1 && lines[first - 2].trim_end().ends_with('\\') {
                        first -= 1;
                    }
                    let mut last = first;
                    while last < lines.len() && lines[last - 1].trim_end().ends_with('\\') {
                        last += 1;
                    }
                    let source = lines[first - 1..last].join("\n");
                    let from = origin.get(first - 1).copied().unwrap_or(0);
                    let words = |s: &str| s.replace("\\\n", " ").split_whitespace().collect::<Vec<_>>().join(" ");
                    let command = if words(&source).contains(&words(&command)) { source } else { format!("{source}` (bash: `{command}") };
                    (format!("{page}:{from}"), command, format!("exit status {code}"))
                }
                None => (format!("{page}:{}", blocks.first().map_or(0, |b| b.line)), "(bash)".to_string(), status.to_string()),
            };
            Err(Failure { at, command, status, output })
        }
        None => Err(Failure {
            at: format!("{page}:{}", blocks.first().map_or(0, |b| b.line)),
            command: "(the page's blocks)".to_string(),
            status: format!("still running after {:?}", setting.timeout),
            output,
        }),
    }
}

/// A `kubectl` against `kubeconfig`, which must succeed.
fn kubectl(kubeconfig: &Path, args: &[&str]) -> String {
    let bin = kube_fence_testenv::binaries().expect("the control plane's binaries");
    let out = Command::new(bin.join("kubectl")).args(args).env("KUBECONFIG", kubeconfig).output().expect("run kubectl");
    assert!(out.status.success(), "kubectl {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `kube-fence run --local` fencing one namespace, stopped (and unregistered) on drop.
struct KubeFence(std::process::Child);

impl KubeFence {
    fn start(kubeconfig: &Path, namespace: &str, dir: &Path) -> KubeFence {
        let ready = dir.join("kube-fence.ready");
        let log = std::fs::File::create(dir.join("kube-fence.log")).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_kube-fence"))
            .args(["run", "--local", "--watch-namespace", namespace])
            .args(["--local-configuration", &format!("kube-fence-{namespace}")])
            .arg("--ready-file")
            .arg(&ready)
            .env("KUBECONFIG", kubeconfig)
            .stdout(log.try_clone().expect("log file"))
            .stderr(log)
            .spawn()
            .expect("start kube-fence");
        let mut kf = KubeFence(child);
        let deadline = Instant::now() + Duration::from_secs(60);
        while !ready.exists() {
            if let Ok(Some(status)) = kf.0.try_wait() {
                panic!("kube-fence exited ({status}): {}", std::fs::read_to_string(dir.join("kube-fence.log")).unwrap_or_default());
            }
            assert!(Instant::now() < deadline, "kube-fence was not ready within 60 s");
            std::thread::sleep(Duration::from_millis(100));
        }
        kf
    }
}

impl Drop for KubeFence {
    fn drop(&mut self) {
        let _ = Command::new("kill").args(["-TERM", &self.0.id().to_string()]).status();
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.0.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Runs the local blocks of `page` in a namespace of its own on the shared cluster.
fn run_page_locally(page: &Page, shared: &Path) -> Result<usize, Failure> {
    let blocks: Vec<&Block> = page.blocks.iter().filter(|b| b.mark == Mark::Local).collect();
    if blocks.is_empty() {
        return Ok(0);
    }
    let dir = tempfile::tempdir().expect("page dir");
    let slug: String =
        page.path.trim_end_matches(".md").chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_lowercase() } else { '-' }).collect();
    let namespace = format!("docs-{}-{}", &slug[..slug.len().min(40)].trim_end_matches('-'), std::process::id());
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::copy(shared, &kubeconfig).expect("copy the kubeconfig");
    kubectl(&kubeconfig, &["create", "namespace", &namespace]);
    kubectl(&kubeconfig, &["config", "set-context", "--current", "--namespace", &namespace]);
    let kube_fence = page.with_kube_fence.then(|| KubeFence::start(&kubeconfig, &namespace, dir.path()));
    let env_dir = dir.path().join("env");
    let setting = Setting {
        kubeconfig: Some(kubeconfig.clone()),
        bin: vec![kube_fence_testenv::binaries().expect("the control plane's binaries")],
        env: vec![("KUBE_FENCE_ENV_DIR".into(), env_dir.display().to_string())],
        timeout: Duration::from_secs(600),
    };
    let result = run_blocks(&page.path, &blocks, &setting);
    drop(kube_fence);
    // A control plane a page started and did not stop.
    if env_dir.exists() {
        let _ = Command::new("cargo")
            .args(["run", "-q", "--locked", "-p", "kube-fence-testenv", "--", "down"])
            .current_dir(ROOT)
            .env("KUBE_FENCE_ENV_DIR", &env_dir)
            .status();
    }
    let _ = Command::new(kube_fence_testenv::binaries().expect("binaries").join("kubectl"))
        .args(["delete", "namespace", &namespace, "--wait=false", "--ignore-not-found"])
        .env("KUBECONFIG", shared)
        .output();
    result.map(|_| blocks.len())
}

/// The blocks that are not run, and why: kept short, and changed here on purpose.
const NOT_RUN: &[(&str, &str)] = &[
    ("README.md", "hack/run.sh     # run kube-fence for real, ending in a demonstration of a stale write being rejected"),
    ("docs/development.md", "KUBECONFIG=~/.kube/kind-config hack/test.sh"),
    ("docs/development.md", "hack/e2e-node.sh     # node up, then the in-cluster suite (hack/e2e-install-and-test.sh): images"),
    ("docs/development.md", "hack/kind-e2e.sh                        # kind's published node image (falls back to the local one)"),
    ("docs/development.md", "hack/release.sh            # artifacts into dist/<version>/, printed at the end"),
    ("docs/install.md", "kubectl apply -f crds/"),
    ("docs/proof.md", "hack/torture.sh --ha --short          # 20 faults, then the unfenced run (about 5 min warm)"),
    ("docs/proof/ha-runs/README.md", "flock /tmp/kube-fence-heavy.lock hack/torture.sh --ha --chunk 1     # then --chunk 2, 3, ..."),
    (
        "docs/proof/ha-runs/README.md",
        "hack/torture.sh --ha --sum            # or --sum DIR; prints the combined table; for this directory, rewrites the tables",
    ),
];

#[test]
fn the_blocks_not_run_are_the_listed_ones_each_with_a_reason() {
    let mut not_run = Vec::new();
    for page in pages() {
        for block in &page.blocks {
            if let Mark::NotRun(reason) = &block.mark {
                assert!(reason.len() > 20, "{}:{}: say why the block is not run", page.path, block.line);
                eprintln!("not run: {}:{}: {reason}", page.path, block.line);
                not_run.push((page.path.clone(), block.body.first().cloned().unwrap_or_default()));
            }
        }
    }
    let expected: Vec<(String, String)> = NOT_RUN.iter().map(|(p, l)| (p.to_string(), l.to_string())).collect();
    assert_eq!(not_run, expected, "the blocks marked `not run` (update NOT_RUN on purpose)");
}

#[test]
fn pages_run_by_another_test_name_it_and_are_named_by_it() {
    for page in pages() {
        if let Some(test) = &page.run_by {
            let code = std::fs::read_to_string(Path::new(ROOT).join(test)).unwrap_or_else(|e| panic!("{}: {test}: {e}", page.path));
            assert!(code.contains(&page.path), "{test} runs {}: it names the page", page.path);
            assert!(page.blocks.iter().all(|b| b.mark == Mark::Local), "{}: a page run by {test} has no other marks", page.path);
        }
    }
}

/// Every local block of every page, on the shared test cluster.
#[test]
fn every_shell_block_runs() {
    let shared = kube_fence_testenv::shared_kubeconfig();
    // The CRDs, as a cluster with kube-fence has them (the README's tour applies them too).
    kubectl(&shared, &["apply", "-f", &format!("{ROOT}/crds/")]);
    kubectl(
        &shared,
        &["wait", "--for", "condition=established", "--timeout=60s", "crd/leases.kubefence.io", "crd/fencedcontrollers.kubefence.io"],
    );
    let (mut ran, mut failures, mut summary) = (0, Vec::new(), String::new());
    for page in pages() {
        let counts = |m: fn(&Mark) -> bool| page.blocks.iter().filter(|b| m(&b.mark)).count();
        let in_cluster = counts(|m| *m == Mark::InCluster);
        let not_run = counts(|m| matches!(m, Mark::NotRun(_)));
        if let Some(test) = &page.run_by {
            let _ = writeln!(summary, "{}: {} blocks run by {test}", page.path, page.blocks.len());
            continue;
        }
        let started = Instant::now();
        match run_page_locally(&page, &shared) {
            Ok(n) => {
                ran += n;
                let _ = writeln!(
                    summary,
                    "{}: {n} run ({:.1} s), {in_cluster} in-cluster, {not_run} not run",
                    page.path,
                    started.elapsed().as_secs_f64()
                );
            }
            Err(failure) => {
                let _ = writeln!(summary, "{}: FAILED", page.path);
                failures.push(failure.to_string());
            }
        }
    }
    eprintln!("{summary}{ran} blocks run");
    assert!(failures.is_empty(), "{} page(s) failed:\n{}", failures.len(), failures.join("\n\n"));
    assert!(ran >= 8, "the pages have runnable blocks: {ran}");
}

/// The in-cluster blocks, in page order, against the release the in-cluster suite installed
/// (hack/e2e-install-and-test.sh: release kube-fence in namespace kube-fence, on a real node).
#[test]
#[ignore = "needs kube-fence installed by the chart on a real node (hack/e2e-install-and-test.sh runs it)"]
fn in_cluster_blocks_run_against_the_installed_chart() {
    assert!(std::env::var_os("KUBE_FENCE_E2E_INSTALLED").is_some(), "run by hack/e2e-install-and-test.sh against the installed chart");
    let kubeconfig = PathBuf::from(std::env::var_os("KUBECONFIG").expect("KUBECONFIG"));
    // kubectl and helm from PATH, as the suite has them.
    let setting = Setting { kubeconfig: Some(kubeconfig), bin: Vec::new(), env: Vec::new(), timeout: Duration::from_secs(600) };
    let mut ran = 0;
    for page in pages() {
        let blocks: Vec<&Block> = page.blocks.iter().filter(|b| b.mark == Mark::InCluster).collect();
        for block in blocks {
            eprintln!("running {}:{}", page.path, block.line);
            if let Err(failure) = run_blocks(&page.path, &[block], &setting) {
                panic!("{failure}");
            }
            ran += 1;
        }
    }
    assert!(ran > 0, "the pages have in-cluster blocks");
}

const PLANTED: &str = "# A page\n\
\n\
<!-- docs-test: with kube-fence -->\n\
\n\
```sh\n\
GREETING=hello\n\
```\n\
\n\
```text\n\
not a command\n\
```\n\
\n\
<!-- docs-test: not run: needs the internet to reach a registry -->\n\
```sh\n\
curl https://example.com\n\
```\n\
\n\
- a list item:\n\
\n\
  ```sh\n\
  test \"$GREETING\" = hello\n\
  echo \"$GREETING from a list\"\n\
  false && true\n\
  test \"$GREETING\" = goodbye   # the planted failure\n\
  echo never\n\
  ```\n\
\n\
<!-- docs-test: in-cluster -->\n\
```sh\n\
helm test kube-fence -n kube-fence\n\
```\n";

#[test]
fn the_extractor_finds_the_blocks_their_lines_and_marks() {
    let page = parse("planted.md", PLANTED);
    assert!(page.with_kube_fence);
    let found: Vec<(usize, Mark, usize)> = page.blocks.iter().map(|b| (b.line, b.mark.clone(), b.body.len())).collect();
    assert_eq!(
        found,
        [
            (6, Mark::Local, 1),
            (15, Mark::NotRun("needs the internet to reach a registry".into()), 1),
            (21, Mark::Local, 5),
            (30, Mark::InCluster, 1)
        ]
    );
    assert_eq!(page.blocks[2].body[0], "test \"$GREETING\" = hello", "a list item's block loses its indentation");
}

/// A planted failing block is reported with the page, the line and the command (no cluster).
#[test]
fn a_failing_block_is_reported_with_its_page_line_and_command() {
    let page = parse("planted.md", PLANTED);
    let local: Vec<&Block> = page.blocks.iter().filter(|b| b.mark == Mark::Local).collect();
    let setting = Setting { kubeconfig: None, bin: Vec::new(), env: Vec::new(), timeout: Duration::from_secs(30) };
    let failure = run_blocks(&page.path, &local, &setting).expect_err("the planted block fails");
    let report = failure.to_string();
    assert_eq!(failure.at, "planted.md:24", "{report}");
    assert!(failure.command.contains("test \"$GREETING\" = goodbye"), "{report}");
    assert_eq!(failure.status, "exit status 1", "{report}");
    assert!(failure.output.contains("hello from a list") && !failure.output.contains("never"), "{report}");
    // The blocks before it ran in the same session; one that passes is Ok.
    assert!(run_blocks(&page.path, &local[..1], &setting).is_ok());
    // A command continued over lines is named from its first line, whole.
    let continued = parse("continued.md", "```sh\necho one\ntest 1 = \\\n  2\necho never\n```\n");
    let failure = run_blocks("continued.md", &continued.blocks.iter().collect::<Vec<_>>(), &setting).expect_err("fails");
    assert_eq!((failure.at.as_str(), failure.command.as_str()), ("continued.md:3", "test 1 = \\\n  2"), "{failure}");
    // A block that does not end in time is reported too.
    let slow = parse("slow.md", "```sh\nsleep 30\n```\n");
    let quick = Setting { timeout: Duration::from_secs(1), ..setting };
    let failure = run_blocks("slow.md", &slow.blocks.iter().collect::<Vec<_>>(), &quick).expect_err("too slow");
    assert!(failure.status.contains("still running"), "{failure}");
}

/// GitHub's anchor for a heading: lower case, letters, digits, `-` and `_` kept, spaces to `-`,
/// everything else dropped.
fn anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a page's headings (outside code blocks), with GitHub's `-1`, `-2` for repeats.
fn anchors(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut in_code = false;
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code || !line.starts_with('#') {
            continue;
        }
        let heading = line.trim_start_matches('#');
        if !heading.starts_with(' ') {
            continue;
        }
        // A link in a heading anchors by its text: drop each `(target)` after a `]`.
        let mut text = heading.to_string();
        while let Some(at) = text.find("](") {
            let end = text[at..].find(')').map_or(text.len(), |e| at + e + 1);
            text.replace_range(at + 1..end, "");
        }
        let base = anchor(&text);
        let repeats =
            out.iter().filter(|a| **a == base || a.starts_with(&format!("{base}-")) && a[base.len() + 1..].parse::<u32>().is_ok()).count();
        out.push(if repeats == 0 { base } else { format!("{base}-{repeats}") });
    }
    out
}

/// The `](target)` links of a page, outside code blocks and inline code, with their lines.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut in_code = false;
    for (n, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            in_code = !in_code;
            continue;
        }
        if in_code {
            continue;
        }
        // Drop inline code.
        let mut plain = String::new();
        for (i, part) in line.split('`').enumerate() {
            if i % 2 == 0 {
                plain.push_str(part);
            }
        }
        let mut rest = plain.as_str();
        while let Some(at) = rest.find("](") {
            let target: String = rest[at + 2..].chars().take_while(|c| *c != ')' && !c.is_whitespace()).collect();
            out.push((n + 1, target));
            rest = &rest[at + 2..];
        }
    }
    out
}

#[test]
fn every_relative_link_and_anchor_resolves() {
    let root = Path::new(ROOT).canonicalize().expect("root");
    let mut broken = Vec::new();
    for path in page_paths() {
        let file = root.join(&path);
        let text = std::fs::read_to_string(&file).expect("page");
        for (line, target) in links(&text) {
            if target.starts_with("http://") || target.starts_with("https://") || target.starts_with("mailto:") {
                continue;
            }
            let (file_part, fragment) = target.split_once('#').map_or((target.as_str(), None), |(f, a)| (f, Some(a)));
            let resolved = if file_part.is_empty() { file.clone() } else { file.parent().expect("dir").join(file_part) };
            let Ok(resolved) = resolved.canonicalize() else {
                broken.push(format!("{path}:{line}: {target}: no such file"));
                continue;
            };
            if !resolved.starts_with(&root) {
                broken.push(format!("{path}:{line}: {target}: outside the repository"));
                continue;
            }
            if let Some(fragment) = fragment {
                let target_text = std::fs::read_to_string(&resolved).unwrap_or_default();
                if !anchors(&target_text).iter().any(|a| a == fragment) {
                    broken.push(format!("{path}:{line}: {target}: no heading with anchor #{fragment}"));
                }
            }
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

#[test]
fn anchors_and_links_are_read_as_github_does() {
    let page = "# Title\n\n## The policy path (section 3p)\n\n```sh\n# not a heading\n```\n\n## `status`\n\n## Holder-only objects: status — and deletes\n\n## Title\n\n## See [the page](other.md#x)\n\nSee [a](other.md#x) and `[b](not-a-link.md)`.\n";
    assert_eq!(
        anchors(page),
        ["title", "the-policy-path-section-3p", "status", "holder-only-objects-status--and-deletes", "title-1", "see-the-page"]
    );
    assert_eq!(links(page), [(15, "other.md#x".to_string()), (17, "other.md#x".to_string())]);
}
