//! Finding 5 of the hardening issue (anyone who can reach the webhook port; the port is open
//! to every Pod unless the chart's NetworkPolicy or client-certificate authentication is on):
//! memory and time per connection are bounded.
//!
//! A test binary of its own, with one test, so the resident memory it reads (`/proc/self`) is
//! the webhook's and this attack's alone.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use kube_fence::admission::local::{LocalOptions, LocalWebhook};
use kube_fence::admission::server::{BODY_BUDGET_BYTES, BODY_READ_TIMEOUT, MAX_BODY_BYTES, Metrics};
use prometheus_client::registry::Registry;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn rss_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

async fn connect(addr: std::net::SocketAddr, ca_pem: &str) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    use rustls::pki_types::pem::PemObject;
    let mut roots = rustls::RootCertStore::empty();
    for cert in rustls::pki_types::CertificateDer::pem_slice_iter(ca_pem.as_bytes()) {
        roots.add(cert.expect("CA PEM")).expect("CA");
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("TLS versions")
        .with_root_certificates(roots)
        .with_no_client_auth();
    let tcp = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
    tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp).await.expect("TLS handshake")
}

fn head(length: usize) -> String {
    format!("POST /validate HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n")
}

/// The status code of the response, or 0 when the connection closed without one.
async fn status_of(tls: &mut tokio_rustls::client::TlsStream<tokio::net::TcpStream>, wait: Duration) -> u16 {
    let mut buf = vec![0u8; 256];
    match tokio::time::timeout(wait, tls.read(&mut buf)).await {
        Ok(Ok(n)) if n > 0 => String::from_utf8_lossy(&buf[..n]).split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0),
        _ => 0,
    }
}

#[tokio::test]
async fn memory_and_time_per_connection_are_bounded() {
    let client = common::client().await;
    let ns = common::namespace(&client, "bounds").await;
    let mut options = LocalOptions::new(format!("kf-test-{ns}"));
    options.only_namespaces = Some(vec![ns.clone()]);
    let mut registry = Registry::default();
    let metrics = Metrics::register(&mut registry);
    let hook = LocalWebhook::start(client.clone(), options, metrics, Arc::new(registry)).await.expect("start the webhook");
    let (addr, ca) = (hook.addr, hook.ca_pem.clone());

    // 100 connections, each declaring the largest body and sending all of it but the last byte.
    let baseline = rss_bytes();
    let peak = Arc::new(std::sync::atomic::AtomicU64::new(baseline));
    let sampler = {
        let peak = peak.clone();
        tokio::spawn(async move {
            loop {
                peak.fetch_max(rss_bytes(), std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let length = MAX_BODY_BYTES - 1;
    let started = Instant::now();
    let mut attackers = Vec::new();
    for _ in 0..100 {
        let ca = ca.clone();
        attackers.push(tokio::spawn(async move {
            let mut tls = connect(addr, &ca).await;
            let _ = tls.write_all(head(length).as_bytes()).await;
            // The body from one small chunk (this process's own memory must not grow with it).
            let chunk = [b' '; 64 * 1024];
            let send = async {
                let mut left = length - 1;
                while left > 0 {
                    let n = left.min(chunk.len());
                    if tls.write_all(&chunk[..n]).await.is_err() {
                        break;
                    }
                    left -= n;
                }
                let _ = tls.flush().await;
            };
            // A refused request may be answered before its body is sent: stop writing then.
            let _ = tokio::time::timeout(Duration::from_secs(20), send).await;
            // The body is never finished: wait for the server's answer (or its close).
            (status_of(&mut tls, BODY_READ_TIMEOUT * 3).await, started.elapsed())
        }));
    }
    let mut outcomes = Vec::new();
    for attacker in attackers {
        outcomes.push(attacker.await.expect("attacker task"));
    }
    sampler.abort();
    let grown = peak.load(std::sync::atomic::Ordering::Relaxed).saturating_sub(baseline);
    let busy = outcomes.iter().filter(|(code, _)| *code == 503).count();
    let slow = outcomes.iter().filter(|(code, _)| *code == 408).count();
    let longest = outcomes.iter().map(|(_, t)| *t).max().unwrap_or_default();
    eprintln!(
        "100 connections x {} MiB bodies: resident memory grew {} MiB (budget {} MiB); {busy} refused at once (503), {slow} cut off (408), all answered within {longest:?}",
        (length + 1) >> 20,
        grown >> 20,
        BODY_BUDGET_BYTES >> 20,
    );
    assert_eq!(busy + slow, 100, "every connection was refused or cut off: {outcomes:?}");
    assert!(busy > 0, "the in-flight budget refused some bodies");
    // The chart's memory limit is 256 MiB; the bodies in flight must stay well inside it.
    assert!(grown < (BODY_BUDGET_BYTES + 48 * 1024 * 1024) as u64, "resident memory grew by {} MiB", grown >> 20);

    // One body trickled a byte at a time is cut off at the body deadline.
    let mut tls = connect(addr, &ca).await;
    tls.write_all(head(1000).as_bytes()).await.expect("headers");
    let trickle = Instant::now();
    let code = loop {
        let _ = tls.write_all(b" ").await;
        let code = status_of(&mut tls, Duration::from_secs(2)).await;
        if code != 0 || trickle.elapsed() > BODY_READ_TIMEOUT * 4 {
            break code;
        }
    };
    eprintln!("a body trickled at a byte per 2 s was answered {code} after {:?}", trickle.elapsed());
    assert_eq!(code, 408, "the trickled body is cut off");
    hook.stop(&client).await.expect("remove the registration");
}
