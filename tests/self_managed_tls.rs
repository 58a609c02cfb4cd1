//! Self-managed TLS, the chart's default, against a real API server: replicas of
//! `kube-fence webhook --self-managed-tls` agree on one CA kept in a Secret, serve a certificate
//! that the CA signs for the Service's DNS name, and keep the webhook configuration's caBundle
//! equal to that CA; the serving certificate is short-lived and reissued under the same CA before
//! it expires.

mod common;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use kube::api::Api;
use kube_fence::admission::http::tls::SERVING_NOT_AFTER_ANNOTATION;
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
    replica_with(ns, configuration, ready_file, &[])
}

fn replica_with(ns: &str, configuration: &str, ready_file: &Path, extra: &[&str]) -> Replica {
    let child = Command::new(env!("CARGO_BIN_EXE_kube-fence"))
        .args(["webhook", "--self-managed-tls", "--namespace", ns, "--service-name", "fence", "--webhook-configuration", configuration])
        .args(["--addr=127.0.0.1:0", "--ready-file"])
        .arg(ready_file)
        .args(extra)
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

/// The certificate a replica serves for `fence.<ns>.svc`, in PEM (openssl s_client).
fn served_certificate(ns: &str, port: u16) -> String {
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "openssl s_client -connect 127.0.0.1:{port} -servername fence.{ns}.svc </dev/null 2>/dev/null | openssl x509 -outform PEM"
        ))
        .output()
        .expect("run openssl");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

/// A forced short lifetime (9 s, checked every 1.5 s): the replica reissues the serving
/// certificate under the same CA with a third of its lifetime left, writes it to the Secret and
/// serves it; the caBundle (the CA) never changes. What is asserted is read off the Secret's
/// annotations (when each certificate expires), not raced against the clock: the new one was
/// issued before the old one expired.
#[tokio::test]
async fn a_short_lived_serving_certificate_is_reissued_under_the_same_ca_before_it_expires() {
    let client = common::client().await;
    let ns = common::namespace(&client, "tls-rotate").await;
    let configuration = format!("kf-tls-{ns}");
    let mut registration = Registration::new(&configuration, Endpoint::Service { namespace: ns.clone(), name: "fence".into(), port: 443 });
    registration.only_namespaces = Some(vec![format!("{ns}-nothing")]);
    registration.apply(&client).await.expect("create the webhook configuration");

    let dir = tempfile::tempdir().expect("tempdir");
    let ready_file = dir.path().join("replica.ready");
    let mut replica = replica_with(&ns, &configuration, &ready_file, &["--self-managed-tls-lifetime", "9s"]);
    let ready = common::wait_ready_file(&ready_file, &mut replica.0, Duration::from_secs(60)).await;
    let port = ready.webhook.expect("the ready file names the webhook's address").port();

    let secrets: Api<Secret> = Api::namespaced(client.clone(), &ns);
    let read = |secret: &Secret| {
        let data = secret.data.clone().unwrap_or_default();
        let field = |key: &str| String::from_utf8_lossy(&data.get(key).unwrap_or_else(|| panic!("the Secret holds {key}")).0).into_owned();
        let not_after: Timestamp = secret
            .annotations()
            .get(SERVING_NOT_AFTER_ANNOTATION)
            .and_then(|t| t.parse().ok())
            .unwrap_or_else(|| panic!("the Secret records when its serving certificate expires"));
        (field("ca.crt"), field("tls.crt"), not_after)
    };
    let (ca, first, first_not_after) = read(&secrets.get("kube-fence-webhook-tls").await.expect("the Secret"));
    let ca_file = dir.path().join("ca.crt");
    std::fs::write(&ca_file, &ca).expect("write CA");
    assert!(healthz(&ca_file, &ns, port), "the first certificate is served");

    let deadline = Instant::now() + Duration::from_secs(60);
    let (ca_after, second, second_not_after) = loop {
        let seen = read(&secrets.get("kube-fence-webhook-tls").await.expect("the Secret"));
        if seen.1 != first {
            break seen;
        }
        assert!(Instant::now() < deadline, "the serving certificate was not reissued within 60 s (lifetime 9 s)");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(ca_after, ca, "the CA is kept");
    let issued = second_not_after.checked_sub(SignedDuration::from_secs(9)).expect("a time");
    assert!(issued < first_not_after, "reissued at {issued}, before the first certificate expired at {first_not_after}");
    let bundle =
        Api::<ValidatingWebhookConfiguration>::all(client.clone()).get(&configuration).await.expect("get").webhooks.unwrap_or_default()[0]
            .client_config
            .ca_bundle
            .clone()
            .map(|b| b.0);
    assert_eq!(bundle.as_deref(), Some(ca.as_bytes()), "the caBundle is still the CA");

    // The replica serves the reissued certificate (or a later one), still trusted through the CA.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let served = served_certificate(&ns, port);
        let latest = read(&secrets.get("kube-fence-webhook-tls").await.expect("the Secret")).1;
        if served != first.trim() && latest.trim().starts_with(&served) && healthz(&ca_file, &ns, port) {
            break;
        }
        assert!(Instant::now() < deadline, "the replica does not serve the reissued certificate:\n{served}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let _ = second;
    registration.remove(&client).await.expect("remove the configuration");
}
