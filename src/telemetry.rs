//! Logs and metrics shared by every long-running subcommand.

use std::net::SocketAddr;
use std::sync::Arc;

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

/// Serves `/metrics`, `/healthz` and `/readyz` over plain HTTP on `listener` ([`bind_metrics`])
/// for a process that has no webhook server of its own (the `controller` subcommand). Metrics
/// carry no secrets; the webhook's own port is HTTPS only.
pub async fn serve_metrics(
    listener: tokio::net::TcpListener,
    registry: Arc<Registry>,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    use axum::{Router, routing::get};
    let app =
        Router::new()
            .route(
                "/metrics",
                get(move || {
                    let registry = registry.clone();
                    async move {
                        ([(http::header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], render(&registry))
                    }
                }),
            )
            .route("/healthz", get(|| async { "ok" }))
            .route("/readyz", get(|| async { "ok" }));
    axum::serve(listener, app).with_graceful_shutdown(shutdown).await
}
