//! The HTTPS load generator (hyper + rustls, loopback only, bounded by a request count and a
//! time), and the no-op webhook it is compared with: axum over rustls served by the same
//! `kube_fence::admission::http::server::serve` as kube-fence, answering "allowed" to every review
//! after reading it just enough to learn its uid (an answer without the uid is rejected by the
//! API server, so no real webhook can do less).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::DefaultBodyLimit;
use axum::routing::post;
use axum_server::tls_rustls::RustlsConfig;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use kube_fence::admission::http::server::MAX_BODY_BYTES;
use rustls::pki_types::CertificateDer;
use rustls::pki_types::pem::PemObject;

use crate::report::Samples;

pub type Https = Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>;

/// An HTTPS client trusting only `ca_pem`, keeping up to `connections` connections open.
pub fn client(ca_pem: &str, connections: usize) -> anyhow::Result<Https> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert?)?;
    }
    let tls = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let connector = hyper_rustls::HttpsConnectorBuilder::new().with_tls_config(tls).https_only().enable_http1().build();
    Ok(Client::builder(TokioExecutor::new()).pool_max_idle_per_host(connections).build(connector))
}

/// One request: (HTTP status, body).
pub async fn request(client: &Https, method: http::Method, url: &str, body: Bytes) -> anyhow::Result<(u16, Bytes)> {
    let req =
        http::Request::builder().method(method).uri(url).header(http::header::CONTENT_TYPE, "application/json").body(Full::new(body))?;
    let resp = client.request(req).await?;
    let status = resp.status().as_u16();
    Ok((status, resp.into_body().collect().await?.to_bytes()))
}

/// The outcome of one load run.
pub struct Load {
    pub ok: usize,
    pub failed: usize,
    pub elapsed: Duration,
    pub latency: Samples,
}

impl Load {
    pub fn per_sec(&self) -> f64 {
        self.ok as f64 / self.elapsed.as_secs_f64()
    }
}

/// POSTs `body` to `url` from `concurrency` workers until `requests` were sent or `secs` passed.
/// A response counts as ok when it is 200 and admits.
pub async fn run(client: &Https, url: &str, body: Bytes, concurrency: usize, requests: usize, secs: f64) -> Load {
    let left = Arc::new(AtomicUsize::new(requests));
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let started = Instant::now();
    let workers: Vec<_> = (0..concurrency)
        .map(|_| {
            let (client, url, body, left) = (client.clone(), url.to_string(), body.clone(), left.clone());
            tokio::spawn(async move {
                let (mut ok, mut failed, mut latency) = (0, 0, Samples::default());
                while Instant::now() < deadline && left.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1)).is_ok() {
                    let t = Instant::now();
                    match request(&client, http::Method::POST, &url, body.clone()).await {
                        Ok((200, resp)) if memfind(&resp, br#""allowed":true"#) => {
                            latency.push(t.elapsed());
                            ok += 1;
                        }
                        _ => failed += 1,
                    }
                }
                (ok, failed, latency)
            })
        })
        .collect();
    let mut load = Load { ok: 0, failed: 0, elapsed: Duration::ZERO, latency: Samples::default() };
    for w in workers {
        if let Ok((ok, failed, latency)) = w.await {
            load.ok += ok;
            load.failed += failed;
            load.latency.extend(latency);
        }
    }
    load.elapsed = started.elapsed();
    load
}

fn memfind(haystack: &[u8], needle: &[u8]) -> bool {
    haystack.windows(needle.len()).any(|w| w == needle)
}

#[derive(serde::Deserialize)]
struct UidOnly {
    request: UidRequest,
}

#[derive(serde::Deserialize)]
struct UidRequest {
    uid: String,
}

/// `--noop-server ADDR CERT KEY`: the limit. Serves until killed.
pub async fn serve_noop(args: &[String]) -> anyhow::Result<()> {
    let [addr, cert, key, ready_file] = args else { anyhow::bail!("--noop-server ADDR CERT KEY READY_FILE") };
    let addr: SocketAddr = addr.parse()?;
    let config = kube_fence::admission::http::tls::server_config(&std::fs::read(cert)?, &std::fs::read(key)?)?;
    let router = axum::Router::new()
        .route(
            "/validate",
            post(|body: Bytes| async move {
                match serde_json::from_slice::<UidOnly>(&body) {
                    Ok(review) => axum::Json(serde_json::json!({
                        "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                        "response": {"uid": review.request.uid, "allowed": true}
                    }))
                    .into_response_parts(),
                    Err(_) => (http::StatusCode::BAD_REQUEST, "not an AdmissionReview").into_response_parts(),
                }
            }),
        )
        .route("/readyz", axum::routing::get(|| async { "ok" }))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES));
    let listener = std::net::TcpListener::bind(addr)?;
    kube_fence::ready::Ready { webhook: Some(listener.local_addr()?), metrics: None }.write(std::path::Path::new(ready_file))?;
    let gate = kube_fence::admission::http::bounds::ConnectionGate::new(Default::default(), Default::default());
    kube_fence::admission::http::server::serve(listener, RustlsConfig::from_config(config), router, gate, std::future::pending()).await?;
    Ok(())
}

trait IntoResponseParts {
    fn into_response_parts(self) -> axum::response::Response;
}

impl<T: axum::response::IntoResponse> IntoResponseParts for T {
    fn into_response_parts(self) -> axum::response::Response {
        self.into_response()
    }
}
