//! Logs and metrics shared by every long-running subcommand, and the one router for what every
//! port serves besides its own work: `/metrics`, `/healthz`, `/readyz` ([`router`]).

use std::net::SocketAddr;
use std::sync::Arc;

use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;
use tracing_subscriber::{EnvFilter, fmt, prelude::*};

pub mod process;

/// The labels of `kube_fence_build_info`: `version` (the crate's), and `git_commit` and `rustc`
/// when the build was given them (`KUBE_FENCE_GIT_COMMIT`, `KUBE_FENCE_RUSTC` at compile time, as
/// hack/build-image.sh does).
pub fn build_labels() -> Vec<(&'static str, &'static str)> {
    let mut labels = vec![("version", env!("CARGO_PKG_VERSION"))];
    if let Some(commit) = option_env!("KUBE_FENCE_GIT_COMMIT").filter(|c| !c.is_empty()) {
        labels.push(("git_commit", commit));
    }
    if let Some(rustc) = option_env!("KUBE_FENCE_RUSTC").filter(|r| !r.is_empty()) {
        labels.push(("rustc", rustc));
    }
    labels
}

/// A registry with what every kube-fence process exposes before its own metrics:
/// `kube_fence_build_info` (1, its labels [`build_labels`]) and the process metrics
/// ([`process::ProcessCollector`]: CPU, memory, file descriptors, start time).
pub fn registry() -> Registry {
    let mut registry = Registry::default();
    registry.register(
        "kube_fence_build",
        "kube-fence's build: version (and commit and compiler when known) as labels; always 1",
        Info::new(build_labels()),
    );
    registry.register_collector(Box::new(process::ProcessCollector));
    registry
}

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

/// An error and its causes on one line, each cause said once: `writing the status of Lease
/// team/jobs: ApiError: ...`. kube-fence's errors leave their source out of their own message, so
/// that a chain printed whole (the CLI's `-v`) says each cause once; a log field or a one-line
/// message therefore shows the chain (`err = %Chain(&err)`), since `%err` alone would drop the
/// causes. Errors of other crates (kube's) often end their message with their source's: that
/// repeat is cut here.
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl Chain<'_> {
    /// Each error of the chain in its own words, outermost first, without the words of its
    /// causes (which follow it). An error that says nothing but its cause is left out, and so is
    /// a cause whose words the message above it already says (kube's `ApiError: {status} (..)`,
    /// `kubeconfig: ({source})`).
    pub fn links(&self) -> Vec<String> {
        let text = self.0.to_string();
        let Some(source) = self.0.source() else { return vec![text] };
        let mut causes = Chain(source).links();
        // What the message may end with: its causes as this renders them (a message that quotes
        // a `Chain`, as the CLI's do), or its source's message (an error of another crate).
        let Some(own) = own_words(&text, &[&causes.join(": "), &source.to_string()]).filter(|own| !own.is_empty()) else {
            return causes;
        };
        let said = causes.iter().take_while(|cause| own.contains(cause.as_str())).count();
        causes.drain(..said);
        causes.insert(0, own.to_string());
        causes
    }
}

/// `text` without a trailing `: CAUSE` for one of `causes`; `None` when `text` is a cause alone.
fn own_words<'t>(text: &'t str, causes: &[&str]) -> Option<&'t str> {
    for cause in causes.iter().filter(|cause| !cause.is_empty()) {
        if text == *cause {
            return None;
        }
        if let Some(own) = text.strip_suffix(cause).and_then(|own| own.strip_suffix(": ")) {
            return Some(own);
        }
    }
    Some(text)
}

impl std::fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.links().join(": "))
    }
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

    /// Every registry starts with kube_fence_build_info (1, the crate's version) and the process
    /// metrics.
    #[test]
    fn every_registry_says_the_build_and_the_process() {
        let text = render(&registry());
        let info = format!("kube_fence_build_info{{version=\"{}\"", env!("CARGO_PKG_VERSION"));
        let line = text.lines().find(|l| l.starts_with(&info)).unwrap_or_else(|| panic!("{text}"));
        assert!(line.ends_with("} 1"), "{line}");
        assert!(text.contains("# TYPE kube_fence_build info"), "{text}");
        for (name, kind) in [
            ("process_cpu_seconds", "counter"),
            ("process_resident_memory_bytes", "gauge"),
            ("process_virtual_memory_bytes", "gauge"),
            ("process_open_fds", "gauge"),
            ("process_start_time_seconds", "gauge"),
        ] {
            assert!(text.contains(&format!("# TYPE {name} {kind}")), "{name}: {text}");
        }
        assert!(text.lines().any(|l| l.starts_with("process_cpu_seconds_total ")), "{text}");
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

#[cfg(test)]
mod chain_tests {
    use super::Chain;

    /// An error with a message and an optional source, as thiserror would make it.
    #[derive(Debug)]
    struct Failed(&'static str, Option<Box<Failed>>);

    impl std::fmt::Display for Failed {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str(self.0)
        }
    }

    impl std::error::Error for Failed {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            self.1.as_deref().map(|e| e as &(dyn std::error::Error + 'static))
        }
    }

    /// The first message, caused by the second, caused by the third...
    fn chain(first: &'static str, causes: &[&'static str]) -> Failed {
        let source = causes.iter().rev().fold(None, |source, message| Some(Box::new(Failed(message, source))));
        Failed(first, source)
    }

    #[test]
    fn each_cause_is_said_once() {
        // kube-fence's errors: a message without its source.
        let ours = chain("reading the grant", &["a bad token", "a leading zero"]);
        assert_eq!(Chain(&ours).to_string(), "reading the grant: a bad token: a leading zero");
        // Another crate's: each message ends with its source's, as kube's do.
        let theirs = chain("loading the key: reading key.pem: no such file", &["reading key.pem: no such file", "no such file"]);
        assert_eq!(Chain(&theirs).links(), ["loading the key", "reading key.pem", "no such file"]);
        // Mixed: a message that ends with the causes as this renders them, or says only its cause.
        let mixed = chain("the grant is unusable: a bad token: a leading zero", &["a bad token", "a leading zero", "a leading zero"]);
        assert_eq!(Chain(&mixed).links(), ["the grant is unusable", "a bad token", "a leading zero"]);
        // A message that quotes its cause elsewhere than at its end, as kube's `ApiError` does.
        let quoted = chain("ApiError: forbidden: Forbidden (Status { .. })", &["forbidden: Forbidden"]);
        assert_eq!(Chain(&quoted).to_string(), "ApiError: forbidden: Forbidden (Status { .. })");
        let nested = chain("infer: kubeconfig: (reading cfg: no such file)", &["reading cfg: no such file", "no such file"]);
        assert_eq!(Chain(&nested).links(), ["infer: kubeconfig: (reading cfg: no such file)"]);
    }
}
