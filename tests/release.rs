//! One version for the whole release: Cargo.toml's `[workspace.package]`. Every published crate
//! inherits it, the workspace pins its own crates at it, and the chart's version and appVersion,
//! the image tag the chart runs by default, the newest release in CHANGELOG.md and what
//! hack/release.sh reads all agree with it; the release script refuses to build when they do not.
//! Pure file reads (plus `cargo metadata`, and the script's `--check`, which reads the same
//! files); no cluster.

use std::path::Path;
use std::process::Command;

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
/// `[workspace.package] version` of Cargo.toml (the root package inherits it), as cargo read it.
const VERSION: &str = env!("CARGO_PKG_VERSION");

fn read(path: &str) -> String {
    std::fs::read_to_string(Path::new(ROOT).join(path)).unwrap_or_else(|e| panic!("reading {path}: {e}"))
}

fn yaml(path: &str) -> serde_json::Value {
    serde_saphyr::from_str(&read(path)).unwrap_or_else(|e| panic!("{path} is YAML: {e}"))
}

fn string<'a>(value: &'a serde_json::Value, path: &[&str]) -> &'a str {
    let mut v = value;
    for key in path {
        v = v.get(*key).unwrap_or_else(|| panic!("no {} in the YAML", path.join(".")));
    }
    v.as_str().unwrap_or_else(|| panic!("{} is a string (quote it: a YAML number drops trailing zeros)", path.join(".")))
}

/// The release headings of a Keep a Changelog file, newest first (`## [0.1.0] - 2026-12-02`).
fn changelog_releases(changelog: &str) -> Vec<(String, String)> {
    changelog
        .lines()
        .filter_map(|l| l.strip_prefix("## ["))
        .filter_map(|l| l.split_once(']'))
        .map(|(name, rest)| (name.to_string(), rest.trim().trim_start_matches('-').trim().to_string()))
        .collect()
}

#[test]
fn the_chart_runs_the_crate_version() {
    let chart = yaml("charts/kube-fence/Chart.yaml");
    assert_eq!(string(&chart, &["version"]), VERSION, "Chart.yaml version");
    assert_eq!(string(&chart, &["appVersion"]), VERSION, "Chart.yaml appVersion");

    // The image tag defaults to the chart's appVersion: values.yaml leaves it empty (or names the
    // same version) and the template falls back to .Chart.AppVersion.
    let values = yaml("charts/kube-fence/values.yaml");
    let tag = string(&values, &["image", "tag"]);
    assert!(tag.is_empty() || tag == VERSION, "values.yaml image.tag {tag:?} is empty (= appVersion) or {VERSION}");
    let helpers = read("charts/kube-fence/templates/_helpers.tpl");
    assert!(
        helpers.contains(".Values.image.tag | default .Chart.AppVersion"),
        "the image reference falls back to appVersion when image.tag is empty"
    );
}

#[test]
fn the_changelog_has_an_unreleased_section_then_the_crate_version() {
    let changelog = read("CHANGELOG.md");
    let releases = changelog_releases(&changelog);
    assert_eq!(releases.first().map(|(n, _)| n.as_str()), Some("Unreleased"), "CHANGELOG.md opens with [Unreleased]: {releases:?}");
    let (newest, date) = releases.get(1).unwrap_or_else(|| panic!("CHANGELOG.md has a release after [Unreleased]: {releases:?}"));
    assert_eq!(newest, VERSION, "CHANGELOG.md's newest release");
    let is_date = date.len() == 10 && date.char_indices().all(|(i, c)| if i == 4 || i == 7 { c == '-' } else { c.is_ascii_digit() });
    assert!(is_date, "[{newest}] is dated YYYY-MM-DD: {date:?}");
    for (name, _) in &releases {
        assert!(changelog.contains(&format!("\n[{name}]: ")), "CHANGELOG.md has a link for [{name}]");
    }
}

#[test]
fn every_published_crate_has_the_one_version() {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--no-deps", "--format-version", "1", "--manifest-path"])
        .arg(Path::new(ROOT).join("Cargo.toml"))
        .output()
        .expect("run cargo metadata");
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    let metadata: serde_json::Value = serde_json::from_slice(&out.stdout).expect("cargo metadata is JSON");
    let packages = metadata["packages"].as_array().expect("packages");
    // `publish = false` reads as an empty registry list.
    let published: Vec<&serde_json::Value> = packages.iter().filter(|p| p["publish"].as_array().is_none_or(|r| !r.is_empty())).collect();
    let names: Vec<&str> = published.iter().filter_map(|p| p["name"].as_str()).collect();
    for crate_name in ["kube-fence", "kube-fence-api", "kube-fence-client", "kube-fence-test-support"] {
        assert!(names.contains(&crate_name), "{crate_name} is a published workspace member: {names:?}");
    }
    for package in published {
        assert_eq!(package["version"].as_str(), Some(VERSION), "{} has the workspace's version", package["name"]);
        // Whatever of the workspace it depends on, it depends on at exactly this version.
        for dep in package["dependencies"].as_array().into_iter().flatten().filter(|d| d["path"].is_string()) {
            let req = dep["req"].as_str().unwrap_or_default();
            let is_dev_only = dep["kind"].as_str() == Some("dev") && req == "*";
            assert!(is_dev_only || req == format!("={VERSION}"), "{} depends on {} at {req}, not ={VERSION}", package["name"], dep["name"]);
        }
    }
}

#[test]
fn the_release_script_reads_the_same_version() {
    let out = Command::new(Path::new(ROOT).join("hack/release.sh")).arg("--check").output().expect("run hack/release.sh --check");
    assert!(out.status.success(), "hack/release.sh --check: {}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), VERSION);
}

#[test]
fn the_release_script_refuses_versions_that_disagree() {
    // A copy of the files the script reads, with one of them changed at a time.
    let originals = ["hack/release.sh", "Cargo.toml", "CHANGELOG.md", "charts/kube-fence/Chart.yaml", "charts/kube-fence/values.yaml"];
    let other = "9.9.9";
    // (file, text, replacement): one version changed in one file.
    let breakages = [
        ("charts/kube-fence/Chart.yaml", format!("\nversion: {VERSION}\n"), format!("\nversion: {other}\n")),
        ("charts/kube-fence/Chart.yaml", format!("appVersion: \"{VERSION}\""), format!("appVersion: \"{other}\"")),
        ("charts/kube-fence/values.yaml", "  tag: \"\"".to_string(), format!("  tag: \"{other}\"")),
        ("CHANGELOG.md", format!("## [{VERSION}]"), format!("## [{other}]")),
        ("Cargo.toml", format!("\nversion = \"{VERSION}\"\n"), format!("\nversion = \"{other}\"\n")),
        (
            "Cargo.toml",
            format!("kube-fence-client = {{ path = \"crates/kube-fence-client\", version = \"={VERSION}\" }}"),
            format!("kube-fence-client = {{ path = \"crates/kube-fence-client\", version = \"={other}\" }}"),
        ),
    ];
    for (broken, from, to) in &breakages {
        let dir = tempfile::tempdir().expect("tempdir");
        for file in originals {
            let text = read(file);
            let text = if file == *broken {
                let changed = text.replacen(from.as_str(), to, 1);
                assert_ne!(changed, text, "the test changed {file}");
                changed
            } else {
                text
            };
            let to = dir.path().join(file);
            std::fs::create_dir_all(to.parent().expect("parent")).expect("mkdir");
            std::fs::write(&to, text).expect("write");
        }
        let out = Command::new("bash").arg(dir.path().join("hack/release.sh")).arg("--check").output().expect("run the copied script");
        assert!(!out.status.success(), "hack/release.sh --check accepted a changed {broken}: {}", String::from_utf8_lossy(&out.stdout));
        assert!(String::from_utf8_lossy(&out.stderr).contains(other), "the refusal names the disagreeing version");

        // The unchanged copy passes, so the refusal above was the change's doing.
        std::fs::write(dir.path().join(broken), read(broken)).expect("restore");
        let out = Command::new("bash").arg(dir.path().join("hack/release.sh")).arg("--check").output().expect("run the copied script");
        assert!(out.status.success(), "the restored copy passes: {}", String::from_utf8_lossy(&out.stderr));
    }
}

/// The kubectl plugin as krew installs it: hack/krew.sh (which hack/release.sh runs on the
/// release binary) packs the binary under test and writes fence.yaml; the manifest's sha256 is
/// the archive's (computed here), its URI names the archive under the release's tag, and what
/// the archive holds runs as `kubectl fence`.
#[test]
fn the_krew_manifest_names_the_plugin_archive_by_its_checksum() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = Command::new(Path::new(ROOT).join("hack/krew.sh"))
        .args([env!("CARGO_BIN_EXE_kube-fence"), VERSION])
        .arg(dir.path())
        .output()
        .expect("run hack/krew.sh");
    assert!(out.status.success(), "hack/krew.sh: {}", String::from_utf8_lossy(&out.stderr));
    let manifest_path = dir.path().join("fence.yaml");
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), manifest_path.display().to_string());
    let manifest: serde_json::Value =
        serde_saphyr::from_str(&std::fs::read_to_string(&manifest_path).expect("fence.yaml")).expect("fence.yaml is YAML");
    assert_eq!(manifest["apiVersion"], "krew.googlecontainertools.github.com/v1alpha2");
    assert_eq!(manifest["kind"], "Plugin");
    assert_eq!(manifest["metadata"]["name"], "fence", "krew names the plugin as kubectl runs it: kubectl fence");
    assert_eq!(manifest["spec"]["version"], format!("v{VERSION}"));
    for field in ["homepage", "shortDescription", "description"] {
        assert!(manifest["spec"][field].as_str().is_some_and(|s| !s.trim().is_empty()), "spec.{field} is set");
    }
    let platforms = manifest["spec"]["platforms"].as_array().expect("spec.platforms");
    assert_eq!(platforms.len(), 1, "one platform: the release builds x86_64 Linux only");
    let platform = &platforms[0];
    assert_eq!(platform["selector"]["matchLabels"], serde_json::json!({"os": "linux", "arch": "amd64"}));
    assert_eq!(platform["bin"], "kubectl-fence");

    let archive_name = format!("kubectl-fence-{VERSION}-x86_64-unknown-linux-gnu.tar.gz");
    let uri = platform["uri"].as_str().expect("uri");
    assert!(uri.ends_with(&format!("/releases/download/v{VERSION}/{archive_name}")), "{uri}");
    let archive = std::fs::read(dir.path().join(&archive_name)).expect("the archive");
    let sha256: String = ring::digest::digest(&ring::digest::SHA256, &archive).as_ref().iter().map(|b| format!("{b:02x}")).collect();
    assert_eq!(platform["sha256"].as_str(), Some(sha256.as_str()), "the manifest's sha256 is the archive's");

    // What krew does: extract, then run `bin`, which the files list put in place.
    let extracted = dir.path().join("extracted");
    std::fs::create_dir(&extracted).expect("mkdir");
    let untar = Command::new("tar").arg("xzf").arg(dir.path().join(&archive_name)).arg("-C").arg(&extracted).status().expect("run tar");
    assert!(untar.success());
    for file in platform["files"].as_array().expect("files") {
        let from = file["from"].as_str().expect("from");
        assert!(extracted.join(from).exists(), "the archive holds {from}");
    }
    let help = Command::new(extracted.join("kubectl-fence")).arg("--help").output().expect("run the extracted kubectl-fence");
    assert!(String::from_utf8_lossy(&help.stdout).contains("Usage: kubectl fence"), "{}", String::from_utf8_lossy(&help.stdout));

    // The release runs it on the release binary and sums what it wrote.
    let script = read("hack/release.sh");
    assert!(script.contains("hack/krew.sh \"$bin\" \"$version\" \"$out\""), "hack/release.sh packs the plugin");
    assert!(script.contains("sha256sum kube-fence* kubectl-fence* fence.yaml > SHA256SUMS"), "SHA256SUMS covers the plugin");
}
