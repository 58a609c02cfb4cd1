//! Logs and metrics shared by every long-running subcommand, and the one router for what every
//! port serves besides its own work: `/metrics`, `/healthz`, `/readyz` ([`router`]).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use prometheus_client::registry::Registry;
use tracing_subscriber::{EnvFilter, fmt, prelude::*};

/// Log format for `--log-format`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line, for log collectors.
    Json,
}

/// Installs the global tracing subscriber. `RUST_LOG` overrides the default `info` filter.
pub fn init_logging(format: LogFormat) {
    // Targets match by prefix, so `kube=warn` alone would also silence `kube_fence`: name it. An
    // empty RUST_LOG counts as unset.
    let filter = std::env::var("RUST_LOG")
        .ok()
        .filter(|v| !v.trim().is_empty())
        .and_then(|v| EnvFilter::try_new(v).ok())
        .unwrap_or_else(|| EnvFilter::new("info,kube=warn,tower=warn,hyper=warn,kube_fence=info"));
    let registry = tracing_subscriber::registry().with(filter);
    // try_init: a second call (tests, `run` starting two components) keeps the first subscriber.
    let _ = match format {
        // Colour only on a terminal: escape codes in a Pod's log or a CI file are noise.
        LogFormat::Text => {
            let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr()) && std::env::var_os("NO_COLOR").is_none();
            registry.with(fmt::layer().with_ansi(ansi).with_writer(std::io::stderr)).try_init()
        }
        LogFormat::Json => registry.with(fmt::layer().json().with_writer(std::io::stderr)).try_init(),
    };
}

/// Renders a registry in the Prometheus text exposition format.
pub fn render(registry: &Registry) -> String {
    let mut out = String::new();
    // Encoding into a String cannot fail (fmt::Write for String is infallible).
    let _ = prometheus_client::encoding::text::encode(&mut out, registry);
    out
}

/// Binds the plain-HTTP port of [`serve_metrics`] (port 0: one the kernel picks; the listener
/// says which).
pub async fn bind_metrics(addr: SocketAddr) -> std::io::Result<tokio::net::TcpListener> {
    tokio::net::TcpListener::bind(addr).await
}

/// The routes every port serves besides its own work: `/metrics` (`registry`, OpenMetrics
/// text), `/healthz` (the process answers) and `/readyz` (`ready()`: `Err(why)` is a 503 with
/// `why`). The controller's metrics port serves them alone ([`serve_metrics`]); the webhook's
/// HTTPS port merges them with its reviews' routes.
pub fn router<F>(registry: Arc<Registry>, ready: F) -> Router
where
    F: Fn() -> Result<(), &'static str> + Clone + Send + Sync + 'static,
{
    Router::new()
        .route(
            "/metrics",
            get(move || {
                let registry = registry.clone();
                async move { ([(http::header::CONTENT_TYPE, OPENMETRICS)], render(&registry)) }
            }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(move || {
                let ready = ready.clone();
                async move {
                    match ready() {
                        Ok(()) => (StatusCode::OK, "ok"),
                        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, why),
                    }
                }
            }),
        )
}

/// The content type of [`render`]'s text.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Serves [`router`] over plain HTTP on `listener` ([`bind_metrics`]) for a process that has no
/// webhook server of its own (the `controller` subcommand): ready as soon as it serves. Metrics
/// carry no secrets; the webhook's own port is HTTPS only.
pub async fn serve_metrics(
    listener: tokio::net::TcpListener,
    registry: Arc<Registry>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    axum::serve(listener, router(registry, || Ok(()))).with_graceful_shutdown(shutdown).await
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicBool, Ordering};

    use axum::body::Body;
    use prometheus_client::metrics::counter::Counter;
    use tower_service::Service;

    use super::*;

    async fn get(router: &mut Router, path: &str) -> (StatusCode, Option<String>, String) {
        std::future::poll_fn(|cx| Service::<http::Request<Body>>::poll_ready(router, cx)).await.expect("ready");
        let response = router.call(http::Request::get(path).body(Body::empty()).expect("a request")).await.expect("a response");
        let content_type = response.headers().get(http::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).map(str::to_string);
        let status = response.status();
        let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.expect("a body");
        (status, content_type, String::from_utf8_lossy(&body).into_owned())
    }

    #[tokio::test]
    async fn one_router_serves_metrics_health_and_readiness() {
        let mut registry = Registry::default();
        let counter = Counter::<u64>::default();
        counter.inc();
        registry.register("probe_test", "A counter the test reads back", counter);
        let ready = Arc::new(AtomicBool::new(false));
        let flag = ready.clone();
        let mut router = router(Arc::new(registry), move || if flag.load(Ordering::Relaxed) { Ok(()) } else { Err("not yet") });

        let (status, content_type, body) = get(&mut router, "/metrics").await;
        assert_eq!((status, content_type.as_deref()), (StatusCode::OK, Some(OPENMETRICS)));
        assert!(body.contains("probe_test_total 1"), "{body}");
        assert_eq!(get(&mut router, "/healthz").await.0, StatusCode::OK);
        let (status, _, body) = get(&mut router, "/readyz").await;
        assert_eq!((status, body.as_str()), (StatusCode::SERVICE_UNAVAILABLE, "not yet"));
        ready.store(true, Ordering::Relaxed);
        let (status, _, body) = get(&mut router, "/readyz").await;
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));
    }
}
