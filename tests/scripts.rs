//! The project's shell scripts: shellcheck-clean, and the kind end-to-end script (run for real by
//! `hack/kind-e2e.sh`, separately from `hack/test.sh`: it needs Docker) uses names that exist —
//! the chart's objects, the CRD, the test target.

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
        .unwrap_or_else(|| panic!("hack/kind-e2e.sh sets {name}"))
}

#[test]
fn kind_script_names_match_the_chart_the_crds_and_the_tests() {
    let script = std::fs::read_to_string(format!("{ROOT}/hack/kind-e2e.sh")).expect("hack/kind-e2e.sh");
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

    let test = script.split("--test ").nth(1).and_then(|s| s.split_whitespace().next()).expect("the script runs a test target");
    let test_file = format!("{ROOT}/tests/{test}.rs");
    let source = std::fs::read_to_string(&test_file).unwrap_or_else(|_| panic!("--test {test} exists as tests/{test}.rs"));
    assert!(
        source.contains("KUBE_FENCE_E2E_INSTALLED") && script.contains("KUBE_FENCE_E2E_INSTALLED"),
        "the script and the suite agree on KUBE_FENCE_E2E_INSTALLED"
    );
    assert!(script.contains("image.pullPolicy=Never"), "kind-loaded images must not be pulled");
}
