//! docs/operations/when-kube-fence-is-down.md, run: every `sh` block of the page, in order, with
//! its RELEASE and NAMESPACE, against the shared control plane, where the chart installs but no
//! kube-fence Pod ever runs (there is no node) — kube-fence is down. Guarded writes fail closed;
//! after the page's "break glass" block they are admitted (unjudged); after its "restore" block
//! they fail closed again, the configurations back as the chart renders them.

mod common;

use std::time::{Duration, Instant};

use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, DeleteParams, PostParams};

const ROOT: &str = env!("CARGO_MANIFEST_DIR");
const PAGE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/docs/operations/when-kube-fence-is-down.md");

/// The page's `sh` blocks, each with the marker comment above it (`<!-- when-down: NAME -->`),
/// or none.
fn blocks(page: &str) -> Vec<(Option<String>, String)> {
    let mut out = Vec::new();
    let (mut marker, mut block): (Option<String>, Option<String>) = (None, None);
    let mut last_marker = None;
    for line in page.lines() {
        match &mut block {
            Some(body) if line.trim() == "```" => {
                out.push((marker.take(), std::mem::take(body)));
                block = None;
            }
            Some(body) => {
                body.push_str(line);
                body.push('\n');
            }
            None if line.trim() == "```sh" => {
                marker = last_marker.take();
                block = Some(String::new());
            }
            None => {
                if let Some(name) = line.trim().strip_prefix("<!-- when-down: ").and_then(|l| l.strip_suffix(" -->")) {
                    last_marker = Some(name.to_string());
                } else if !line.trim().is_empty() {
                    last_marker = None;
                }
            }
        }
    }
    out
}

/// Runs one block with bash (-euo pipefail), after the page's variables block, as `release` in
/// `namespace`, from the repository's root (the page's `charts/kube-fence`).
fn run_block(variables: &str, body: &str, release: &str, namespace: &str) -> String {
    let bin = kube_fence_testenv::binaries().expect("binaries");
    let path = format!("{}:{}", bin.display(), std::env::var("PATH").unwrap_or_default());
    // The page's variables block (which keeps RELEASE and NAMESPACE when set), then the block.
    let script = format!("set -euo pipefail\n{variables}{body}");
    let out = std::process::Command::new("bash")
        .arg("-c")
        .arg(&script)
        .current_dir(ROOT)
        .env("PATH", path)
        .env("RELEASE", release)
        .env("NAMESPACE", namespace)
        .env("KUBECONFIG", kube_fence_testenv::shared_kubeconfig())
        .env("HELM_CACHE_HOME", std::env::temp_dir().join("kube-fence-helm-cache"))
        .output()
        .expect("run bash");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the page's block failed:\n{body}\n{text}");
    text
}

#[tokio::test]
async fn the_pages_commands_break_glass_and_put_fencing_back() {
    let page = std::fs::read_to_string(PAGE).expect("the page");
    let blocks = blocks(&page);
    let names: Vec<Option<&str>> = blocks.iter().map(|(m, _)| m.as_deref()).collect();
    assert_eq!(names, [None, Some("look"), Some("break-glass"), Some("restore")], "the page's sh blocks, in order");
    let variables = &blocks[0].1;
    assert!(variables.contains("RELEASE=${RELEASE:-") && variables.contains("NAMESPACE=${NAMESPACE:-"), "{variables}");

    let client = common::client().await;
    let namespace = common::namespace(&client, "when-down").await;
    let fenced = common::namespace(&client, "when-down-app").await;
    // A name of this run (cluster-scoped objects carry it), without "kube-fence": the chart
    // names its objects <release>-kube-fence.
    let release = format!("down-{}", namespace.rsplit('-').next().expect("a suffix"));
    let release = release.as_str();
    let name = format!("{release}-kube-fence");
    let helm = kube_fence_testenv::binaries().expect("binaries").join("helm");
    let installed = std::process::Command::new(&helm)
        .args(["install", release, &format!("{ROOT}/charts/kube-fence"), "-n", &namespace, "--set", "leaderElection=false"])
        .arg("--set")
        .arg(format!("webhook.onlyNamespaces={{{fenced}}}"))
        .env("KUBECONFIG", kube_fence_testenv::shared_kubeconfig())
        .env("HELM_CACHE_HOME", std::env::temp_dir().join("kube-fence-helm-cache"))
        .output()
        .expect("helm install");
    assert!(installed.status.success(), "{}", String::from_utf8_lossy(&installed.stderr));
    // No node: no Pod runs, so guarded writes fail closed.
    common::wait_fenced(&client, &fenced, &Default::default(), common::Fencing::FailsClosed, Duration::from_secs(30)).await;

    let looked = run_block(variables, &blocks[1].1, release, &namespace);
    assert!(looked.contains(&format!("{name}-writers")), "the page's look shows both configurations:\n{looked}");

    run_block(variables, &blocks[2].1, release, &namespace);
    let configurations: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    for name in [name.clone(), format!("{name}-writers")] {
        assert!(configurations.get_opt(&name).await.expect("get").is_none(), "{name} deleted");
    }
    let cms: Api<ConfigMap> = Api::namespaced(client.clone(), &fenced);
    let deadline = Instant::now() + Duration::from_secs(30);
    while let Err(e) = cms.create(&PostParams::default(), &common::guarded_configmap("after-break-glass", "l")).await {
        assert!(Instant::now() < deadline, "guarded writes are admitted after breaking glass: {e}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    cms.delete("after-break-glass", &DeleteParams::default()).await.expect("clean up");

    let restored = run_block(variables, &blocks[3].1, release, &namespace);
    assert!(restored.contains(&format!("{name}-writers")), "{restored}");
    let configuration = configurations.get(&name).await.expect("the webhook configuration is back");
    let hook = &configuration.webhooks.expect("webhooks")[0];
    assert_eq!(hook.failure_policy.as_deref(), Some("Fail"));
    common::wait_fenced(&client, &fenced, &Default::default(), common::Fencing::FailsClosed, Duration::from_secs(30)).await;

    let uninstalled = std::process::Command::new(&helm)
        .args(["uninstall", release, "-n", &namespace, "--wait"])
        .env("KUBECONFIG", kube_fence_testenv::shared_kubeconfig())
        .output()
        .expect("helm uninstall");
    assert!(uninstalled.status.success(), "{}", String::from_utf8_lossy(&uninstalled.stderr));
}

#[test]
fn sh_blocks_are_read_with_their_markers() {
    let page = "x\n```sh\nA=1\n```\n<!-- when-down: one -->\n```sh\necho 1\necho 2\n```\n<!-- when-down: lost -->\ntext\n```sh\nz\n```\n```yaml\nno: 1\n```\n";
    assert_eq!(
        blocks(page),
        [(None, "A=1\n".to_string()), (Some("one".to_string()), "echo 1\necho 2\n".to_string()), (None, "z\n".to_string())]
    );
}
