//! The project's shell scripts: shellcheck-clean; the in-cluster suite (run for real by
//! `hack/e2e-node.sh` and by `hack/kind-e2e.sh`, which needs Docker) uses names that exist — the
//! chart's objects, the CRD, the test targets — and both cluster scripts run it through the one
//! shared script instead of a copy of its steps.

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

    let crds = kube_fence::api::crds_yaml().expect("crds");
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
