//! The project's shell scripts: shellcheck-clean, with every pinned version in hack/versions.env
//! alone; the in-cluster suite (run for real by `hack/e2e-node.sh` and by `hack/kind-e2e.sh`,
//! which needs Docker) uses names that exist — the chart's objects, the CRD, the test targets —
//! and both cluster scripts run it through the one shared script instead of a copy of its steps.

use std::path::Path;
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");

fn scripts() -> Vec<String> {
    let mut all: Vec<String> = std::fs::read_dir(Path::new(ROOT).join("hack"))
        .expect("hack/")
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "sh"))
        .map(|p| p.display().to_string())
        .collect();
    all.push(format!("{ROOT}/.ci/run"));
    all.sort();
    all
}

#[test]
fn every_script_is_shellcheck_clean() {
    let scripts = scripts();
    assert!(scripts.len() >= 5, "found the scripts: {scripts:?}");
    let out = Command::new("shellcheck")
        .arg("-x")
        .args(&scripts)
        .output()
        .unwrap_or_else(|e| panic!("shellcheck is needed for this test (apt-get install shellcheck; .ci/run installs it): {e}"));
    assert!(out.status.success(), "shellcheck:\n{}", String::from_utf8_lossy(&out.stdout));
}

fn assignment(script: &str, name: &str) -> String {
    script
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name}=")))
        .map(|v| v.trim_matches('"').to_string())
        .unwrap_or_else(|| panic!("{SHARED} sets {name}"))
}

/// What the node and kind runs share: what is built, installed and run.
const SHARED: &str = "hack/e2e-install-and-test.sh";

#[test]
fn the_in_cluster_suite_names_the_chart_the_crds_and_the_tests() {
    let script = std::fs::read_to_string(format!("{ROOT}/{SHARED}")).expect(SHARED);
    let release = assignment(&script, "RELEASE");
    let namespace = assignment(&script, "NAMESPACE");
    let chart = assignment(&script, "CHART");
    assert!(Path::new(ROOT).join(&chart).join("Chart.yaml").is_file(), "CHART={chart} is a chart");

    let helm = kube_fence_testenv::binaries().expect("helm").join("helm");
    let out =
        Command::new(helm).args(["template", &release, &format!("{ROOT}/{chart}"), "-n", &namespace]).output().expect("helm template");
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rendered = String::from_utf8_lossy(&out.stdout);
    for (kind, used_as) in
        [("Deployment", "deployment/$RELEASE"), ("ValidatingWebhookConfiguration", "validatingwebhookconfiguration \"$RELEASE\"")]
    {
        assert!(script.contains(used_as), "the script uses {used_as}");
        assert!(
            rendered.contains(&format!("kind: {kind}\nmetadata:\n  name: {release}\n")),
            "the chart renders a {kind} named {release} for release {release}"
        );
    }

    let crds = kube_fence_api::crds_yaml().expect("crds");
    let crd_name = script.split("crd/").nth(1).and_then(|s| s.split_whitespace().next()).expect("the script waits for a CRD");
    assert!(crds.contains(&format!("name: {crd_name}\n")), "crd/{crd_name} is the generated CRD");

    let tests: Vec<&str> = script.split("--test ").skip(1).filter_map(|s| s.split_whitespace().next()).collect();
    for test in ["e2e", "operations"] {
        assert!(tests.contains(&test), "the script runs --test {test}: {tests:?}");
    }
    for test in tests {
        let source = std::fs::read_to_string(format!("{ROOT}/tests/{test}.rs"))
            .unwrap_or_else(|_| panic!("--test {test} exists as tests/{test}.rs"));
        assert!(source.contains("KUBE_FENCE_E2E"), "tests/{test}.rs reads the installed release the script sets (KUBE_FENCE_E2E_*)");
    }
    assert!(script.contains("KUBE_FENCE_E2E_INSTALLED=1"), "the script tells the suite kube-fence is installed");
    assert!(script.contains("image.pullPolicy=Never"), "loaded images must not be pulled");
}

/// The node and kind differ only in how the cluster is made and how an image gets in: both run
/// the shared script, and neither runs a test suite or installs the chart itself, so a test added
/// to the in-cluster suite runs on both.
#[test]
fn the_node_and_kind_run_the_one_in_cluster_suite() {
    use std::os::unix::fs::PermissionsExt;
    for script in [SHARED, "hack/e2e-node.sh", "hack/kind-e2e.sh"] {
        let mode = std::fs::metadata(format!("{ROOT}/{script}")).expect(script).permissions().mode();
        assert_eq!(mode & 0o111, 0o111, "{script} is executable (mode {mode:o}): the scripts run it as a command");
    }
    for cluster in ["hack/e2e-node.sh", "hack/kind-e2e.sh"] {
        let script = std::fs::read_to_string(format!("{ROOT}/{cluster}")).expect(cluster);
        let code: Vec<&str> = script.lines().filter(|l| !l.trim_start().starts_with('#')).collect();
        assert!(code.iter().any(|l| l.contains(SHARED)), "{cluster} runs {SHARED}");
        for own in ["cargo test", "helm install", "kubectl apply"] {
            assert!(!code.iter().any(|l| l.contains(own)), "{cluster} does not `{own}` itself: that belongs in {SHARED}");
        }
    }
}

/// Every file under `dir` (recursively).
fn files_under(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())).filter_map(|e| e.ok()) {
        let path = entry.path();
        if path.is_dir() { files.extend(files_under(&path)) } else { files.push(path) }
    }
    files
}

/// A version written out: `v1.2.3`, `1.2.3` or `1.2.3-rc.1` (three numbers; addresses have four).
fn version_literals(line: &str) -> Vec<&str> {
    line.split(|c: char| !(c.is_ascii_alphanumeric() || c == '.' || c == '-'))
        .filter(|token| {
            let bare = token.strip_prefix('v').unwrap_or(token);
            let core = bare.split('-').next().unwrap_or_default();
            let parts: Vec<&str> = core.split('.').collect();
            parts.len() == 3 && parts.iter().all(|p| !p.is_empty() && p.chars().all(|c| c.is_ascii_digit()))
        })
        // The version k8s.io/kubernetes' go.mod requires its staging modules at (a placeholder).
        .filter(|token| *token != "v0.0.0")
        .collect()
}

/// The versions the project pins are in hack/versions.env, read by every script that needs one:
/// no script, testenv file or Dockerfile writes a version of its own, assigns a `*_VERSION` a
/// literal, or reads a version out of another script.
#[test]
fn versions_are_pinned_in_hack_versions_env_only() {
    let data = format!("{ROOT}/hack/versions.env");
    let pins: Vec<(String, String)> = std::fs::read_to_string(&data)
        .expect("hack/versions.env")
        .lines()
        .filter(|l| !l.trim_start().starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let (key, value) = l.split_once('=').unwrap_or_else(|| panic!("hack/versions.env: {l:?} is KEY=value"));
            assert!(!value.contains([' ', '"', '\'', '$']), "hack/versions.env: {l:?} is a plain value");
            (key.to_string(), value.to_string())
        })
        .collect();
    assert!(pins.iter().any(|(k, _)| k == "KUBE_VERSION"), "hack/versions.env pins KUBE_VERSION");

    let mut files = files_under(&Path::new(ROOT).join("hack"));
    files.extend(files_under(&Path::new(ROOT).join("testenv/src")));
    files.extend(files_under(&Path::new(ROOT).join("testenv/tests")));
    files.push(Path::new(ROOT).join(".ci/run"));
    files.push(Path::new(ROOT).join("Dockerfile"));
    let common = std::fs::read_to_string(format!("{ROOT}/hack/kind/common.sh")).expect("hack/kind/common.sh");
    let sources_pins = |text: &str| text.lines().any(|l| l.trim_start().starts_with("source") && l.contains("versions.env"));
    assert!(sources_pins(&common), "hack/kind/common.sh sources hack/versions.env");
    let mut problems = Vec::new();
    for file in files.iter().filter(|f| **f != Path::new(&data)) {
        let name = file.strip_prefix(ROOT).unwrap_or(file).display().to_string();
        let Ok(text) = std::fs::read_to_string(file) else { continue };
        let code: Vec<&str> = text.lines().filter(|l| !l.trim_start().starts_with('#') && !l.trim_start().starts_with("//")).collect();
        for line in &code {
            // A file format's version (a CNI configuration's), not software the project pins.
            let format_version = line.contains("cniVersion") || line.contains("apiVersion");
            for literal in version_literals(line).into_iter().filter(|_| !format_version) {
                problems.push(format!("{name}: version {literal} written out (pin it in hack/versions.env): {line}"));
            }
            let assigned = line.trim_start().trim_start_matches("export ").split_once('=');
            if let Some((key, value)) = assigned
                && key.ends_with("VERSION")
                && key.chars().all(|c| c.is_ascii_uppercase() || c == '_')
                && !value.starts_with('$')
            {
                problems.push(format!("{name}: {key} assigned a literal (hack/versions.env holds it): {line}"));
            }
            if line.contains("VERSION") && ["sed ", "awk ", "grep "].iter().any(|t| line.contains(t)) && line.contains("hack/") {
                problems.push(format!("{name}: reads a version out of a script (source hack/versions.env): {line}"));
            }
        }
        // A script that uses a pinned version sources the file (itself or through common.sh).
        let uses = pins.iter().any(|(k, _)| code.iter().any(|l| l.contains(&format!("${k}")) || l.contains(&format!("${{{k}"))));
        let is_shell = name.ends_with(".sh") || name == ".ci/run";
        if is_shell && uses && !sources_pins(&text) && !text.contains("source hack/kind/common.sh") {
            problems.push(format!("{name}: uses a pinned version without sourcing hack/versions.env"));
        }
    }
    let dockerfile = std::fs::read_to_string(format!("{ROOT}/Dockerfile")).expect("Dockerfile");
    let rust_image = pins.iter().find(|(k, _)| k == "RUST_IMAGE").map(|(_, v)| v.as_str()).expect("hack/versions.env pins RUST_IMAGE");
    let from: Vec<&str> = dockerfile
        .lines()
        .filter_map(|l| l.strip_prefix("FROM "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|i| *i != "scratch")
        .collect();
    assert_eq!(from, [rust_image], "the Dockerfile builds in hack/versions.env's RUST_IMAGE (a Dockerfile cannot source the file)");
    assert!(problems.is_empty(), "versions pinned outside hack/versions.env:\n{}", problems.join("\n"));
}
