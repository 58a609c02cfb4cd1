//! Self-managed TLS, the chart's default, against a real API server: replicas of
//! `kube-fence webhook --self-managed-tls` agree on one CA kept in a Secret, serve a certificate
//! that the CA signs for the Service's DNS name, and keep the webhook configuration's caBundle
//! equal to that CA.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use kube::api::Api;
use kube_fence::admission::registration::{Endpoint, Registration};

struct Replica(Child);

impl Drop for Replica {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A replica on a port the kernel picks; it says which in its ready file.
fn replica(ns: &str, configuration: &str, ready_file: &Path) -> Replica {
    let child = Command::new(env!("CARGO_BIN_EXE_kube-fence"))
        .args(["webhook", "--self-managed-tls", "--namespace", ns, "--service-name", "fence", "--webhook-configuration", configuration])
        .args(["--addr=127.0.0.1:0", "--ready-file"])
        .arg(ready_file)
        .env("KUBECONFIG", kube_fence_testenv::shared_kubeconfig())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start kube-fence webhook");
    Replica(child)
}

/// GET /healthz over HTTPS as the API server would: trusting only `ca`, checking the Service name.
fn healthz(ca: &std::path::Path, ns: &str, port: u16) -> bool {
    let host = format!("fence.{ns}.svc");
    Command::new("curl")
        .args(["-sf", "--max-time", "3", "--cacert"])
        .arg(ca)
        .arg("--resolve")
        .arg(format!("{host}:{port}:127.0.0.1"))
        .arg(format!("https://{host}:{port}/healthz"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

#[tokio::test]
async fn replicas_share_one_ca_and_keep_the_ca_bundle_right() {
    let client = common::client().await;
    let ns = common::namespace(&client, "self-tls").await;
    let configuration = format!("kf-tls-{ns}");
    // A configuration like the chart's, but fencing only a namespace that does not exist: its
    // Service has no Pods here, and it must not judge other tests' objects.
    let mut registration = Registration::new(&configuration, Endpoint::Service { namespace: ns.clone(), name: "fence".into(), port: 443 });
    registration.only_namespaces = Some(vec![format!("{ns}-nothing")]);
    registration.apply(&client).await.expect("create the webhook configuration");

    let dir = tempfile::tempdir().expect("tempdir");
    let ready_files = [dir.path().join("replica-0.ready"), dir.path().join("replica-1.ready")];
    let mut replicas: Vec<Replica> = ready_files.iter().map(|path| replica(&ns, &configuration, path)).collect();
    let mut ports = vec![];
    for (replica, path) in replicas.iter_mut().zip(&ready_files) {
        let ready = common::wait_ready_file(path, &mut replica.0, Duration::from_secs(60)).await;
        ports.push(ready.webhook.expect("the ready file names the webhook's address").port());
    }

    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let vwcs: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let deadline = Instant::now() + Duration::from_secs(60);
    let ca = loop {
        let secret = secrets.get_opt("kube-fence-webhook-tls").await.expect("get secret");
        let bundle =
            vwcs.get(&configuration).await.expect("get configuration").webhooks.unwrap_or_default()[0].client_config.ca_bundle.clone();
        if let (Some(secret), Some(bundle)) = (secret, bundle) {
            let ca = secret.data.unwrap_or_default().get("ca.crt").cloned().expect("the Secret holds ca.crt");
            assert_eq!(bundle.0, ca.0, "the caBundle is the Secret's CA");
            break ca.0;
        }
        assert!(Instant::now() < deadline, "no Secret and caBundle within 60 s");
        tokio::time::sleep(Duration::from_millis(250)).await;
    };

    let ca_file = dir.path().join("ca.crt");
    std::fs::write(&ca_file, &ca).expect("write CA");
    for port in ports {
        let deadline = Instant::now() + Duration::from_secs(30);
        while !healthz(&ca_file, &ns, port) {
            assert!(Instant::now() < deadline, "replica on {port} does not serve a certificate the shared CA signs for fence.{ns}.svc");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    // Someone resets the caBundle: the replicas put it back.
    let mut vwc = vwcs.get(&configuration).await.expect("get");
    for w in vwc.webhooks.iter_mut().flatten() {
        w.client_config.ca_bundle = None;
    }
    vwcs.replace(&configuration, &Default::default(), &vwc).await.expect("clear caBundle");
    let deadline = Instant::now() + Duration::from_secs(45);
    loop {
        let bundle = vwcs.get(&configuration).await.expect("get").webhooks.unwrap_or_default()[0].client_config.ca_bundle.clone();
        if bundle.map(|b| b.0) == Some(ca.clone()) {
            break;
        }
        assert!(Instant::now() < deadline, "the caBundle was not restored within 45 s");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    registration.remove(&client).await.expect("remove the configuration");

    // A replica told to stop removes its ready file.
    for (replica, path) in replicas.iter_mut().zip(&ready_files) {
        let status = Command::new("kill").args(["-TERM", &replica.0.id().to_string()]).status().expect("run kill");
        assert!(status.success());
        let deadline = Instant::now() + Duration::from_secs(30);
        while replica.0.try_wait().expect("wait for the replica").is_none() {
            assert!(Instant::now() < deadline, "replica did not stop within 30 s of SIGTERM");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(!path.exists(), "{} is removed on exit", path.display());
    }
}
