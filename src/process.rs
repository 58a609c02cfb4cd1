//! What a long-running kube-fence process knows about itself: its name among replicas, and when
//! to stop. Every subcommand and component asks here, so the answers are the same everywhere.

use tokio_util::sync::CancellationToken;

/// This process's name in leader election and Events: `POD_NAME` (the chart sets it from the
/// downward API), else `<host name>-<process id>`. The process id makes two kube-fence processes
/// on one machine (`run --local` twice) distinct, so they never share a leader-election identity.
pub(crate) fn identity() -> String {
    if let Some(pod) = std::env::var("POD_NAME").ok().filter(|n| !n.trim().is_empty()) {
        return pod;
    }
    let host = std::env::var("HOSTNAME")
        .ok()
        .or_else(|| std::fs::read_to_string("/etc/hostname").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "kube-fence".to_string());
    format!("{host}-{}", std::process::id())
}

/// A token cancelled when SIGINT (Ctrl-C) or SIGTERM arrives.
pub(crate) fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        signalled().await;
        tracing::info!("shutting down");
        cancel.cancel();
    });
    token
}

/// Resolves on SIGINT or SIGTERM (on SIGINT alone where SIGTERM cannot be watched).
async fn signalled() {
    #[cfg(unix)]
    if let Ok(mut term) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
        return;
    }
    let _ = tokio::signal::ctrl_c().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_identity_names_this_process() {
        // POD_NAME is not set in tests (the chart sets it in Pods only).
        if std::env::var_os("POD_NAME").is_none() {
            let id = identity();
            assert!(id.ends_with(&format!("-{}", std::process::id())), "{id}");
            assert!(id.len() > format!("-{}", std::process::id()).len(), "{id}");
        }
    }
}
