//! `kube-fence lease run NAME -- COMMAND [ARGS...]`: run a command while holding a lease (the
//! etcdctl `lock ... exec` pattern).
//!
//! The lease is acquired first (waiting while another holder has it), the grant is handed to the
//! command in its environment, and a keep-alive renews it in the background. When the command
//! exits the lease is released and its exit status becomes ours. When the grant is lost —
//! a renewal refused, the lease expired or taken (a newer token exists), or no renewal confirmed
//! within the lease duration — the command is stopped (SIGTERM, then SIGKILL after the grace
//! period) and `lease run` exits with status 7 and a message naming the lease and why.
//!
//! Stopping the command is the best a local supervisor can do, not what makes the writes safe: a
//! command can act between the loss and its stop (and `lease run` itself may have been paused
//! past the loss, its command still running). Writes with the exported token are fenced by the
//! webhook, which rejects them once a newer token exists, whatever this process noticed.
//!
//! The command runs in a process group of its own, so that stopping it stops what it started; a
//! terminal on stdin is handed to that group (Ctrl-C then reaches the command; the shell takes
//! the terminal back when `lease run` exits). SIGINT and SIGTERM sent to `lease run` are
//! forwarded to the group.

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::process::ExitStatus;
use std::time::Duration;

use rustix::process::{Pid, Signal};
use tokio::signal::unix::{SignalKind, signal};

use super::cluster::Cluster;
use super::error::{Error, Object, Stopped};
use crate::client::{self, AcquireOptions, Delegated, Grant, Leases, Loss};

/// What `lease run` was asked to do.
pub struct RunLease {
    pub name: String,
    pub namespace: String,
    pub holder: String,
    pub duration: Option<Duration>,
    /// `None`: wait until granted.
    pub wait: Option<Duration>,
    pub grace_period: Duration,
    pub command: Vec<OsString>,
}

/// The environment variables the command gets (besides `KUBE_FENCE_GRANT`, the delegated grant
/// `namespace/lease:token` that `kube-fence patch` and `delete` write with when given no
/// `--lease`/`--token`, and `KUBE_FENCE_NAMESPACE`, their default namespace).
pub const TOKEN_ENV: &str = "KUBE_FENCE_TOKEN";
pub const LEASE_ENV: &str = "KUBE_FENCE_LEASE";
pub const HOLDER_ENV: &str = "KUBE_FENCE_HOLDER";
pub const NAMESPACE_ENV: &str = "KUBE_FENCE_NAMESPACE";

/// The default holder identity outside a Pod: this host and process, unique per run (a run
/// that reused an identity would be handed the previous run's grant, and its token).
pub fn default_holder() -> String {
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
    let host = if host.is_empty() { "localhost".to_string() } else { host };
    format!("{host}-{}", std::process::id())
}

pub async fn run(cluster: &Cluster, request: RunLease) -> Result<ExitStatus, Error> {
    let server = cluster.server.clone();
    let leases = Leases::new(cluster.client.clone(), &request.namespace);
    let lease = Object::namespaced("lease", &request.namespace, &request.name);
    let holder = request.holder.clone();

    // Acquire as `lease acquire` does (one read first, so an unreachable API server or a
    // missing namespace is not reported as a timeout; a refused watch fails at once in
    // acquire), but cancellable by SIGINT/SIGTERM: the claim is then withdrawn.
    let cancel = tokio_util::sync::CancellationToken::new();
    let mut options = AcquireOptions::default().cancel(cancel.clone());
    options.duration = request.duration;
    options.timeout = request.wait;
    let acquire = async {
        match leases.get(&request.name).await {
            Ok(_) | Err(client::Error::LeaseNotFound { .. }) => leases.acquire(&request.name, &holder, options).await,
            Err(err) => Err(err),
        }
    };
    let mut interrupt = signal(SignalKind::interrupt()).map_err(|source| Error::WatchSignals { source })?;
    let mut terminate = signal(SignalKind::terminate()).map_err(|source| Error::WatchSignals { source })?;
    let acquired = {
        tokio::pin!(acquire);
        loop {
            tokio::select! {
                acquired = &mut acquire => break acquired,
                _ = interrupt.recv() => cancel.cancel(),
                _ = terminate.recv() => cancel.cancel(),
            }
        }
    };
    let wait = request.wait.unwrap_or(Duration::MAX);
    let grant = acquired.map_err(|source| Error::AcquireLease {
        lease: lease.clone(),
        holder: holder.clone(),
        wait,
        server: server.clone(),
        source,
    })?;

    let mut keep_alive = leases.keep_alive(&grant);
    let delegated = Delegated { namespace: grant.namespace.clone(), lease: grant.lease.clone(), token: grant.token };
    let mut command = tokio::process::Command::new(&request.command[0]);
    command
        .args(&request.command[1..])
        .env(TOKEN_ENV, grant.token.to_string())
        .env(LEASE_ENV, &grant.lease)
        .env(HOLDER_ENV, &grant.holder)
        .env(NAMESPACE_ENV, &grant.namespace)
        .env(client::GRANT_ENV, delegated.to_string())
        .process_group(0);
    let shown = shown(&request.command);
    let mut child = match command.spawn() {
        Ok(child) => child,
        Err(source) => {
            keep_alive.stop().await;
            release(&leases, &grant).await;
            return Err(Error::StartCommand { command: shown, source });
        }
    };
    let pgid = child.id().and_then(|id| i32::try_from(id).ok()).and_then(Pid::from_raw);
    hand_terminal_to(pgid);

    let outcome = loop {
        tokio::select! {
            status = child.wait() => break Ok(status),
            loss = keep_alive.lost() => break Err(loss),
            _ = interrupt.recv() => signal_group(pgid, Signal::INT),
            _ = terminate.recv() => signal_group(pgid, Signal::TERM),
        }
    };
    match outcome {
        Ok(status) => {
            keep_alive.stop().await;
            let status = status.map_err(|source| Error::StartCommand { command: shown.clone(), source })?;
            match tokio::time::timeout(RELEASE_WAIT, leases.release(&grant)).await {
                Ok(Ok(())) => {}
                Ok(Err(err)) => {
                    let (_, why) = super::error::explain_lease(&server, &lease, Some(&holder), None, &err);
                    eprintln!("kube-fence: warning: the command exited, but {why}; the lease expires unless renewed");
                }
                Err(_) => eprintln!(
                    "kube-fence: warning: the command exited, but releasing lease {lease} got no answer from {server} within {}s; the lease expires unless renewed",
                    RELEASE_WAIT.as_secs()
                ),
            }
            Ok(status)
        }
        Err(loss) => {
            let loss = precise(&leases, &grant, loss).await;
            let stopped = stop(&mut child, pgid, request.grace_period).await;
            // A grant only unconfirmed may still be ours: give it back (refused for a newer one).
            release(&leases, &grant).await;
            Err(Error::LostLease { lease, holder, token: grant.token, loss, command: shown, stopped, grace_period: request.grace_period })
        }
    }
}

/// The exit status a shell gives a command: its code, or 128 + the signal that ended it.
pub fn exit_code(status: ExitStatus) -> u8 {
    match (status.code(), status.signal()) {
        (Some(code), _) => u8::try_from(code & 0xff).unwrap_or(1),
        (None, Some(signal)) => u8::try_from(128 + (signal & 0x7f)).unwrap_or(1),
        (None, None) => 1,
    }
}

/// A loss seen as "no heartbeat confirmed" (the keep-alive's own clock ran out, e.g. after this
/// process was paused) says more once the Lease is read: who holds it now, with what token.
async fn precise(leases: &Leases, grant: &Grant, loss: Loss) -> Loss {
    if loss != Loss::Unconfirmed {
        return loss;
    }
    match tokio::time::timeout(Duration::from_secs(5), leases.get(&grant.lease)).await {
        Ok(Ok(lease)) => client::loss(Some(&lease), grant).unwrap_or(loss),
        Ok(Err(client::Error::LeaseNotFound { .. })) => Loss::Deleted,
        _ => loss,
    }
}

/// How long releasing may take before the lease is left to expire: a release sent into a
/// partition gets no answer at all (the client has no read timeout), and the grant ends anyway.
const RELEASE_WAIT: Duration = Duration::from_secs(10);

/// Best effort: the lease is released, or left to expire (the message said why already).
async fn release(leases: &Leases, grant: &Grant) {
    match tokio::time::timeout(RELEASE_WAIT, leases.release(grant)).await {
        Ok(Ok(())) => {}
        Ok(Err(err)) => tracing::debug!(%err, lease = %grant.lease, "releasing a lost grant"),
        Err(_) => tracing::debug!(lease = %grant.lease, "releasing a lost grant timed out"),
    }
}

/// SIGTERM to the command's process group; SIGKILL if it has not exited after `grace`.
async fn stop(child: &mut tokio::process::Child, pgid: Option<Pid>, grace: Duration) -> Stopped {
    if matches!(child.try_wait(), Ok(Some(_))) {
        return Stopped::Terminated;
    }
    signal_group(pgid, Signal::TERM);
    if tokio::time::timeout(grace, child.wait()).await.is_ok() {
        return Stopped::Terminated;
    }
    signal_group(pgid, Signal::KILL);
    let _ = child.wait().await;
    Stopped::Killed
}

/// A group that is gone already (ESRCH) needs no signal.
fn signal_group(pgid: Option<Pid>, signal: Signal) {
    if let Some(pgid) = pgid {
        let _ = rustix::process::kill_process_group(pgid, signal);
    }
}

/// When stdin is a terminal and this process is in its foreground, the command's group gets it
/// (to read it, and to receive Ctrl-C itself). A command that read it before that was stopped
/// (SIGTTIN): SIGCONT lets it go on.
fn hand_terminal_to(pgid: Option<Pid>) {
    let stdin = std::io::stdin();
    let Some(pgid) = pgid else { return };
    if !rustix::termios::isatty(&stdin) || rustix::termios::tcgetpgrp(&stdin).ok() != Some(rustix::process::getpgrp()) {
        return;
    }
    if rustix::termios::tcsetpgrp(&stdin, pgid).is_ok() {
        signal_group(Some(pgid), Signal::CONT);
    }
}

/// The command as a message shows it: its program and arguments, shortened.
fn shown(command: &[OsString]) -> String {
    let words: Vec<String> = command.iter().map(|w| w.to_string_lossy().into_owned()).collect();
    let line = words.join(" ");
    if line.chars().count() > 60 { format!("{}...", line.chars().take(57).collect::<String>()) } else { line }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_are_a_shells() {
        assert_eq!(exit_code(ExitStatus::from_raw(3 << 8)), 3);
        assert_eq!(exit_code(ExitStatus::from_raw(0)), 0);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGKILL)), 137);
        assert_eq!(exit_code(ExitStatus::from_raw(libc::SIGTERM)), 143);
    }

    #[test]
    fn a_long_command_is_shortened() {
        assert_eq!(shown(&["sh".into(), "-c".into(), "exit 3".into()]), "sh -c exit 3");
        assert_eq!(shown(&["x".repeat(100).into()]).chars().count(), 60);
    }
}
