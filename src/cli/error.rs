//! Every way the `kube-fence` binary fails, in one place: one variant per action that failed,
//! each mapped here to an exit code ([`Error::exit`]) and a one-line message ([`Display`]) that
//! states the cause once, names the object and namespace it concerns and, where there is one,
//! the next step. Kubernetes types never reach the message through `Debug`; `-v` prints the whole
//! chain of causes, each once. The library's errors leave their source out of their message (the
//! chain tells it), so where a message quotes one it quotes the chain ([`causes`]).
//!
//! [`Display`]: std::fmt::Display

use std::error::Error as _;
use std::fmt::{self, Write as _};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use kube::config::{InferConfigError, KubeconfigError, LoadDataError};

use crate::admission::http::tls::TlsError;
use crate::admission::local::LocalError;
use crate::client::{self, Loss};
use crate::telemetry::Chain;

/// The exit status of `kube-fence`, one per kind of cause a script may act on. The table
/// [`EXIT_STATUS_HELP`] (shown by `--help`) documents them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Exit {
    /// Anything not listed below; the message says what.
    Failed = 1,
    /// The command line is wrong (unknown option, bad duration, missing argument).
    Usage = 2,
    /// No cluster configured, or its API server cannot be reached.
    NoCluster = 3,
    /// Not allowed: RBAC forbids it, or the API server rejected the credentials.
    Forbidden = 4,
    /// The namespace, lease, object or resource type does not exist.
    NotFound = 5,
    /// `lease acquire` gave up after `--wait`.
    TimedOut = 6,
    /// The lease is not held by `--holder`: another holds it, or the grant expired or was released.
    NotHeld = 7,
    /// A fenced write was rejected: the object records a token at least as new as the one presented.
    StaleToken = 8,
}

impl Exit {
    pub const ALL: [Exit; 8] =
        [Exit::Failed, Exit::Usage, Exit::NoCluster, Exit::Forbidden, Exit::NotFound, Exit::TimedOut, Exit::NotHeld, Exit::StaleToken];

    pub fn code(self) -> u8 {
        self as u8
    }
}

impl From<Exit> for std::process::ExitCode {
    fn from(exit: Exit) -> Self {
        std::process::ExitCode::from(exit.code())
    }
}

/// The exit statuses, as `kube-fence --help` prints them (a test checks it against [`Exit`]).
pub const EXIT_STATUS_HELP: &str = "\
Exit status:
  0  success
  1  any other failure (the message says what)
  2  bad command line: unknown option, bad duration, missing argument
  3  no cluster: none configured (KUBECONFIG, in-cluster), or its API server cannot be reached
  4  not allowed: RBAC forbids the request, or the API server rejected the credentials
  5  not found: the namespace, lease, object or resource type does not exist
  6  timed out waiting for the lease (lease acquire --wait)
  7  the lease is not held by --holder: another holds it, or the grant expired or was released
  8  stale token: the fenced write was rejected, the object records a newer token

Errors are one line on stderr; -v adds the chain of causes.";

/// A Kubernetes object a failure concerns, as the message names it: `lease "jobs" in namespace "work"`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Object {
    /// What a user calls it: `lease`, `configmap`, `ValidatingWebhookConfiguration`.
    pub kind: String,
    pub name: String,
    /// `None` for cluster-scoped objects.
    pub namespace: Option<String>,
}

impl Object {
    pub fn namespaced(kind: impl Into<String>, namespace: impl Into<String>, name: impl Into<String>) -> Object {
        Object { kind: kind.into(), name: name.into(), namespace: Some(namespace.into()) }
    }

    pub fn cluster_scoped(kind: impl Into<String>, name: impl Into<String>) -> Object {
        Object { kind: kind.into(), name: name.into(), namespace: None }
    }
}

impl fmt::Display for Object {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {:?}", self.kind, self.name)?;
        if let Some(ns) = &self.namespace {
            write!(f, " in namespace {ns:?}")?;
        }
        Ok(())
    }
}

/// What `kube-fence status` lists: kube-fence's two custom resources, and the Events about them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listed {
    FencedControllers,
    Leases,
    Events,
}

impl Listed {
    /// The resource, as kubectl and RBAC name it.
    pub fn resource(self) -> &'static str {
        match self {
            Listed::FencedControllers => "fencedcontrollers.kubefence.io",
            Listed::Leases => "leases.kubefence.io",
            Listed::Events => "events.events.k8s.io",
        }
    }
}

/// What failed. Each variant is the action; its fields are what the message needs.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The command line did not parse (clap's message, on one line).
    #[error("{0}")]
    ParseArguments(String),
    /// Finding the cluster: KUBECONFIG, `~/.kube/config`, or the Pod's service account.
    #[error("{}", find_cluster(.source))]
    FindCluster {
        #[source]
        source: InferConfigError,
    },
    /// Reading the kubeconfig `--kubeconfig` names (`path`; `None`: `$KUBECONFIG` or
    /// `~/.kube/config`) at `--context`.
    #[error("{}", load_kubeconfig(.path.as_deref(), .context.as_deref(), .source))]
    LoadKubeconfig {
        path: Option<PathBuf>,
        context: Option<String>,
        #[source]
        source: KubeconfigError,
    },
    /// Making a client for the cluster found (its TLS settings).
    #[error("{}", explain_api(.server, .source).1)]
    ConnectCluster {
        server: String,
        #[source]
        source: kube::Error,
    },
    #[error("{}", explain_lease(.server, .lease, Some(.holder), Some(*.wait), .source).1)]
    AcquireLease {
        lease: Object,
        holder: String,
        wait: Duration,
        server: String,
        #[source]
        source: client::Error,
    },
    #[error("{}", explain_lease(.server, .lease, Some(.holder), None, .source).1)]
    RenewLease {
        lease: Object,
        holder: String,
        server: String,
        #[source]
        source: client::Error,
    },
    #[error("{}", explain_lease(.server, .lease, Some(.holder), None, .source).1)]
    ReleaseLease {
        lease: Object,
        holder: String,
        server: String,
        #[source]
        source: client::Error,
    },
    #[error("{}", explain_lease(.server, .lease, None, None, .source).1)]
    GetLease {
        lease: Object,
        server: String,
        #[source]
        source: client::Error,
    },
    /// `lease run`: the grant was lost while the command ran; the command was stopped.
    #[error(
        "lost {lease} (token {token}, holder {holder:?}) while running `{command}`: {loss}; {}",
        stopped_how(*.stopped, *.grace_period)
    )]
    LostLease {
        lease: Object,
        holder: String,
        token: kube_fence_api::token::Token,
        loss: Loss,
        command: String,
        stopped: Stopped,
        grace_period: Duration,
    },
    /// `lease run`: the command could not be started (or waited for).
    #[error("cannot run `{command}`: {}", io(.source))]
    StartCommand {
        command: String,
        #[source]
        source: std::io::Error,
    },
    /// `lease run`: SIGINT/SIGTERM could not be watched (to forward them to the command).
    #[error("cannot watch for signals: {}", io(.source))]
    WatchSignals {
        #[source]
        source: std::io::Error,
    },
    /// `lease get --holder H`: the lease is held by someone else, or by no one.
    #[error("{lease} is {}, not by {holder:?}", .held_by.as_ref().map(|h| format!("held by {h:?}")).unwrap_or_else(|| "not held".into()))]
    CheckHolder { lease: Object, holder: String, held_by: Option<String> },
    /// `lease get -o token` on a lease that never granted.
    #[error("{lease} has issued no token yet; `kube-fence lease acquire` grants one")]
    ReadToken { lease: Object },
    /// `patch TYPE/NAME`: TYPE is not a resource type the API server serves.
    #[error(
        "the API server at {server} serves no resource type {resource:?}; use a name `kubectl api-resources` lists, e.g. configmaps or deployments.apps"
    )]
    ResolveResourceType { resource: String, server: String },
    #[error("{}", explain_api(.server, .source).1)]
    DiscoverResourceTypes {
        server: String,
        #[source]
        source: kube::Error,
    },
    /// `patch`/`delegate` with neither `--lease`/`--token` nor a delegated grant.
    #[error(
        "no grant to write with: give --lease and --token (the token `kube-fence lease acquire` printed), or run where {} holds a delegated grant (a Pod started with `kube-fence delegate`)",
        client::GRANT_ENV
    )]
    NoGrant,
    /// `$KUBE_FENCE_GRANT` is set but is not a grant.
    #[error("{} is not a usable grant: {}", client::GRANT_ENV, causes(.source))]
    ReadDelegatedGrant {
        #[source]
        source: client::DelegationError,
    },
    /// `-n` names another namespace than the delegated grant's lease.
    #[error(
        "the delegated grant is for lease {:?} in namespace {:?}, which guards objects in that namespace only, not in {namespace:?}: leave -n out",
        .grant.lease, .grant.namespace
    )]
    DelegatedElsewhere { grant: client::Delegated, namespace: String },
    #[error("cannot read the manifests {}: {}", .path.display(), io(.source))]
    ReadManifest {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot stamp the manifests {}: {why}", .path.display())]
    ParseManifest { path: PathBuf, why: String },
    #[error("{}", explain_write(.server, .object, .lease, .source).1)]
    WriteFenced {
        object: Object,
        lease: String,
        server: String,
        #[source]
        source: client::Error,
    },
    /// `webhook`/`run` without `--local`: some source of certificates must be given.
    #[error("the webhook serves HTTPS only: give --tls-cert-file and --tls-key-file, or --self-managed-tls")]
    ChooseTls,
    #[error("{}", tls(.source))]
    LoadTls {
        #[source]
        source: TlsError,
    },
    #[error("{}", manage_tls(.secret, .server, .source).1)]
    ManageTls {
        secret: Object,
        server: String,
        #[source]
        source: TlsError,
    },
    #[error("{}", listen(*.addr, "--addr", .source))]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the webhook server stopped: {}", io(.source))]
    ServeWebhook {
        #[source]
        source: std::io::Error,
    },
    #[error("{}", start_local(.server, .source).1)]
    StartLocalWebhook {
        server: String,
        #[source]
        source: LocalError,
    },
    #[error("{}", unregister(.configuration, .server, .source).1)]
    UnregisterLocalWebhook {
        configuration: Object,
        server: String,
        #[source]
        source: kube::Error,
    },
    #[error("{}", run_controller(.server, .source).1)]
    RunController {
        server: String,
        #[source]
        source: crate::lease::controller::Error,
    },
    #[error("the lease controller stopped unexpectedly (it panicked); run with RUST_LOG=debug to see why")]
    ControllerPanicked,
    #[error("{}", listen(*.addr, "--metrics-addr", .source))]
    ServeMetrics {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write the ready file {}: {}", .path.display(), io(.source))]
    WriteReadyFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot write {}: {}", .path.display(), io(.source))]
    WriteFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// `status`: listing the fences, the Leases or their Events, in `namespace` (`None`: all).
    #[error("{}", explain_list(.server, *.listed, .namespace.as_deref(), .source).1)]
    ListStatus {
        listed: Listed,
        namespace: Option<String>,
        server: String,
        #[source]
        source: kube::Error,
    },
    #[error("cannot encode the output: {}", causes(.source.as_ref()))]
    EncodeOutput {
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// `selftest`: the stale write was admitted.
    #[error(
        "fencing does not work: the write to {object} with the released, older token {token} was admitted; is that namespace fenced (not kube-fence's own, not excluded, in webhook.onlyNamespaces if set) and kube-fence's ValidatingWebhookConfiguration registered?"
    )]
    StaleWriteAdmitted { object: Object, token: String },
    #[error("cannot write to stdout: {}", io(.source))]
    WriteOutput {
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// The exit status for this failure.
    pub fn exit(&self) -> Exit {
        match self {
            Error::ParseArguments(_)
            | Error::ChooseTls
            | Error::NoGrant
            | Error::ReadDelegatedGrant { .. }
            | Error::DelegatedElsewhere { .. }
            | Error::ParseManifest { .. } => Exit::Usage,
            Error::FindCluster { .. } | Error::LoadKubeconfig { .. } => Exit::NoCluster,
            Error::AcquireLease { lease, holder, wait, source, server } => {
                explain_lease(server, lease, Some(holder), Some(*wait), source).0
            }
            Error::RenewLease { lease, holder, source, server } | Error::ReleaseLease { lease, holder, source, server } => {
                explain_lease(server, lease, Some(holder), None, source).0
            }
            Error::GetLease { lease, source, server } => explain_lease(server, lease, None, None, source).0,
            Error::CheckHolder { .. } | Error::LostLease { .. } => Exit::NotHeld,
            Error::StaleWriteAdmitted { .. } => Exit::Failed,
            Error::ReadToken { .. } => Exit::Failed,
            Error::ResolveResourceType { .. } => Exit::NotFound,
            Error::ConnectCluster { server, source } | Error::DiscoverResourceTypes { server, source } => explain_api(server, source).0,
            Error::UnregisterLocalWebhook { configuration, server, source } => unregister(configuration, server, source).0,
            Error::WriteFenced { object, lease, source, server } => explain_write(server, object, lease, source).0,
            Error::ManageTls { secret, server, source } => manage_tls(secret, server, source).0,
            Error::StartLocalWebhook { server, source } => start_local(server, source).0,
            Error::RunController { server, source } => run_controller(server, source).0,
            Error::ListStatus { listed, namespace, server, source } => explain_list(server, *listed, namespace.as_deref(), source).0,
            Error::LoadTls { .. }
            | Error::Listen { .. }
            | Error::ServeWebhook { .. }
            | Error::ControllerPanicked
            | Error::ServeMetrics { .. }
            | Error::WriteReadyFile { .. }
            | Error::EncodeOutput { .. }
            | Error::WriteFile { .. }
            | Error::ReadManifest { .. }
            | Error::WriteOutput { .. }
            | Error::StartCommand { .. }
            | Error::WatchSignals { .. } => Exit::Failed,
        }
    }

    /// What `-v` prints: the message, then every cause down the chain on a line of its own,
    /// each once (then `Debug`, since a verbose reader may want the API's whole answer).
    pub fn verbose(&self) -> String {
        let message = self.to_string();
        let links = self.source().map(|source| Chain(source).links()).unwrap_or_default();
        // A message that ends with the chain (`... is not a usable grant: CAUSE: CAUSE`) drops it
        // here: the lines below say each cause.
        let inline = format!(": {}", one_line(&links.join(": ")));
        let headline = message.strip_suffix(&inline).filter(|_| !links.is_empty()).unwrap_or(&message);
        let mut out = format!("{headline}\n  failed action: {}", self.action());
        for link in &links {
            let _ = write!(out, "\n  caused by: {}", one_line(link));
        }
        let _ = write!(out, "\n  in full: {self:?}");
        out
    }

    /// The variant's name: the action that failed.
    fn action(&self) -> String {
        let debug = format!("{self:?}");
        debug.split([' ', '(', '{']).next().unwrap_or_default().to_string()
    }
}

impl From<std::io::Error> for Error {
    fn from(source: std::io::Error) -> Self {
        Error::WriteOutput { source }
    }
}

/// How `lease run` stopped its command after the grant was lost.
/// How a lost grant ended the command `lease run` ran (part of [`Error`], so the error names it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stopped {
    /// It exited within the grace period after SIGTERM (or had already exited).
    Terminated,
    /// It was still running after the grace period: SIGKILL.
    Killed,
}

fn stopped_how(stopped: Stopped, grace: Duration) -> String {
    match stopped {
        Stopped::Terminated => "stopped the command (SIGTERM)".to_string(),
        Stopped::Killed => format!(
            "the command did not stop within {} of SIGTERM: killed it (SIGKILL); raise --grace-period if it needs longer",
            humantime::format_duration(grace)
        ),
    }
}

/// One line: a message from elsewhere (the API server, a parser) may hold line breaks.
pub(crate) fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// An error of the library and its causes, for a one-line message: `a: b: c`, each said once
/// (the error's own message leaves its source out).
fn causes(err: &(dyn std::error::Error + 'static)) -> String {
    one_line(&Chain(err).to_string())
}

/// An I/O error in words, without the `(os error N)` suffix.
fn io(err: &std::io::Error) -> String {
    use std::io::ErrorKind;
    match err.kind() {
        ErrorKind::NotFound => "no such file or directory".to_string(),
        ErrorKind::PermissionDenied => "permission denied".to_string(),
        ErrorKind::AddrInUse => "the address is already in use".to_string(),
        ErrorKind::AddrNotAvailable => "the address is not available on this machine".to_string(),
        ErrorKind::ConnectionRefused => "connection refused".to_string(),
        _ if err.raw_os_error().is_none() => one_line(&err.to_string()),
        kind => kind.to_string(),
    }
}

fn listen(addr: SocketAddr, flag: &str, err: &std::io::Error) -> String {
    let next = match err.kind() {
        std::io::ErrorKind::AddrInUse => format!("; another process listens there: stop it or choose another {flag}"),
        std::io::ErrorKind::PermissionDenied => format!("; ports below 1024 need privileges: choose another {flag}"),
        _ => String::new(),
    };
    format!("cannot listen on {addr}: {}{next}", io(err))
}

/// The cluster could not be found or its configuration not read.
fn find_cluster(err: &InferConfigError) -> String {
    let kubeconfig_env = std::env::var_os("KUBECONFIG").filter(|v| !v.is_empty());
    let in_pod = std::env::var_os("KUBERNETES_SERVICE_HOST").is_some();
    let kubeconfig = err.source().and_then(|s| s.downcast_ref::<KubeconfigError>());
    match kubeconfig {
        Some(missing @ KubeconfigError::ReadConfig(io_err, _)) if io_err.kind() == std::io::ErrorKind::NotFound => {
            match (kubeconfig_env, in_pod) {
                (Some(_), _) => kubeconfig_problem(missing, "KUBECONFIG", None),
                (None, true) => "running in a Pod, but its service account credentials cannot be read: mount the service account token \
                             (automountServiceAccountToken), or set KUBECONFIG"
                    .to_string(),
                (None, false) => "no cluster configured: set KUBECONFIG or run inside a Pod".to_string(),
            }
        }
        Some(other) => kubeconfig_problem(other, "KUBECONFIG", None),
        None => "no cluster configured: set KUBECONFIG or run inside a Pod".to_string(),
    }
}

/// `--kubeconfig` or `--context` named a kubeconfig or context that cannot be used.
fn load_kubeconfig(path: Option<&std::path::Path>, context: Option<&str>, err: &KubeconfigError) -> String {
    let named_by = match path {
        Some(_) => "--kubeconfig",
        None if std::env::var_os("KUBECONFIG").is_some_and(|v| !v.is_empty()) => "KUBECONFIG",
        None => "the default kubeconfig (~/.kube/config)",
    };
    match err {
        KubeconfigError::FindPath if path.is_none() => {
            format!(
                "--context {:?} needs a kubeconfig, and there is none: set KUBECONFIG or give --kubeconfig",
                context.unwrap_or_default()
            )
        }
        KubeconfigError::ReadConfig(io_err, _)
            if path.is_none() && named_by != "KUBECONFIG" && io_err.kind() == std::io::ErrorKind::NotFound =>
        {
            let context = context.unwrap_or_default();
            format!("--context {context:?} needs a kubeconfig, and there is none: set KUBECONFIG or give --kubeconfig")
        }
        other => kubeconfig_problem(other, named_by, context),
    }
}

/// What is wrong with a kubeconfig (`named_by`: the flag or variable that named it).
fn kubeconfig_problem(err: &KubeconfigError, named_by: &str, context: Option<&str>) -> String {
    match err {
        KubeconfigError::ReadConfig(io_err, path) if io_err.kind() == std::io::ErrorKind::NotFound => {
            format!("the kubeconfig {} named by {named_by} does not exist: fix {named_by}", path.display())
        }
        KubeconfigError::ReadConfig(io_err, path) => format!("cannot read the kubeconfig {}: {}", path.display(), io(io_err)),
        KubeconfigError::Parse(parse) => format!("the kubeconfig is not valid YAML: {}", one_line(&parse.to_string())),
        KubeconfigError::LoadContext(name) => {
            let flag = if context.is_some() { "--context" } else { "its current-context" };
            format!("the kubeconfig named by {named_by} has no context {name:?} ({flag}); `kubectl config get-contexts` lists those it has")
        }
        KubeconfigError::CurrentContextNotSet => {
            format!("the kubeconfig named by {named_by} sets no current-context: give --context (`kubectl config get-contexts` lists them)")
        }
        KubeconfigError::LoadClusterOfContext(name) => {
            format!(
                "the kubeconfig named by {named_by} has no cluster {name:?}, which its context names; check it with `kubectl config view`"
            )
        }
        KubeconfigError::LoadCertificateAuthority(data)
        | KubeconfigError::LoadClientCertificate(data)
        | KubeconfigError::LoadClientKey(data) => {
            let what = match err {
                KubeconfigError::LoadCertificateAuthority(_) => "certificate authority",
                KubeconfigError::LoadClientCertificate(_) => "client certificate",
                _ => "client key",
            };
            match data {
                LoadDataError::ReadFile(io_err, path) => format!("cannot read the kubeconfig's {what} {}: {}", path.display(), io(io_err)),
                other => format!("the kubeconfig's {what} is unusable: {}", one_line(&other.to_string())),
            }
        }
        other => format!("the kubeconfig is unusable: {}; check it with `kubectl config view`", one_line(&other.to_string())),
    }
}

/// Why an API call failed, in the terms a user acts on.
pub fn explain_api(server: &str, err: &kube::Error) -> (Exit, String) {
    explain_api_about(server, None, err)
}

/// Like [`explain_api`]; a 404 is about `about` (in words with its namespace), unless the
/// namespace itself is missing.
fn explain_api_about(server: &str, about: Option<&Object>, err: &kube::Error) -> (Exit, String) {
    match err {
        kube::Error::Api(status) => {
            let message = one_line(&status.message);
            let details = status.details.as_ref();
            match status.code {
                401 => (
                    Exit::Forbidden,
                    format!(
                        "the API server at {server} rejected the kubeconfig's credentials (401 Unauthorized): log in again or fix the user in KUBECONFIG"
                    ),
                ),
                403 if status.reason == "Forbidden" => {
                    (Exit::Forbidden, format!("{message}; ask a cluster admin for that permission (RBAC), or use another user"))
                }
                404 => match (details, about) {
                    (Some(d), _) if d.kind == "namespaces" && !d.name.is_empty() => {
                        (Exit::NotFound, format!("namespace {:?} does not exist", d.name))
                    }
                    (_, Some(object)) => (Exit::NotFound, format!("{object} does not exist")),
                    (Some(d), None) if !d.name.is_empty() && !d.kind.is_empty() => {
                        (Exit::NotFound, format!("{} {:?} does not exist", kind_in_words(&d.kind, &d.group), d.name))
                    }
                    _ => (Exit::NotFound, format!("not found: {message}")),
                },
                _ if message.is_empty() => (Exit::Failed, format!("the API server answered {} {}", status.code, status.reason)),
                _ => (Exit::Failed, message),
            }
        }
        kube::Error::Auth(auth) => (Exit::NoCluster, format!("cannot get credentials for the API server at {server}: {}", deepest(auth))),
        kube::Error::SerdeError(e) => (Exit::Failed, format!("the API server at {server} sent an answer kube-fence cannot read: {e}")),
        kube::Error::HyperError(_) | kube::Error::Service(_) | kube::Error::HttpError(_) | kube::Error::RustlsTls(_) => {
            (Exit::NoCluster, unreachable(server, err as &(dyn std::error::Error + 'static)))
        }
        other => (Exit::Failed, deepest(other)),
    }
}

/// `leases.kubefence.io` → `leases.kubefence.io`, `configmaps` (core group) → `configmaps`.
fn kind_in_words(kind: &str, group: &str) -> String {
    if group.is_empty() { kind.to_string() } else { format!("{kind}.{group}") }
}

/// The API server did not answer: say why in the words of the innermost cause.
fn unreachable(server: &str, err: &(dyn std::error::Error + 'static)) -> String {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(c) = cause {
        if let Some(io_err) = c.downcast_ref::<std::io::Error>() {
            // An io::Error may carry the real cause (a TLS alert) inside.
            if io_err.get_ref().and_then(|inner| inner.downcast_ref::<rustls::Error>()).is_none() {
                return format!(
                    "cannot reach the API server at {server}: {}; is it running, and is the server in KUBECONFIG right?",
                    io(io_err)
                );
            }
        }
        if let Some(tls) = c.downcast_ref::<rustls::Error>() {
            return format!(
                "TLS with the API server at {server} failed: {tls}; check the certificate-authority of the cluster in KUBECONFIG"
            );
        }
        cause = c.source();
    }
    format!("cannot reach the API server at {server}: {}", deepest(err))
}

/// The innermost cause's own words, on one line.
fn deepest(err: &(dyn std::error::Error + 'static)) -> String {
    let mut last = err;
    while let Some(next) = last.source() {
        last = next;
    }
    match last.downcast_ref::<std::io::Error>() {
        Some(io_err) => io(io_err),
        None => one_line(&last.to_string()),
    }
}

/// A lease subcommand failed.
pub(super) fn explain_lease(
    server: &str,
    lease: &Object,
    holder: Option<&String>,
    wait: Option<Duration>,
    err: &client::Error,
) -> (Exit, String) {
    match err {
        client::Error::Timeout { held_by, .. } => {
            let waited = wait.map(|w| humantime::format_duration(w).to_string()).unwrap_or_else(|| "the timeout".into());
            match held_by {
                Some(other) => (
                    Exit::TimedOut,
                    format!(
                        "timed out after {waited} waiting for {lease}: it is held by {other:?}; wait longer (--wait) or ask its holder to release it"
                    ),
                ),
                None => (
                    Exit::TimedOut,
                    format!("timed out after {waited} waiting for {lease}: no grant came; is the kube-fence controller running?"),
                ),
            }
        }
        client::Error::LeaseNotFound { .. } => (Exit::NotFound, format!("{lease} does not exist; `kube-fence lease acquire` creates it")),
        client::Error::NotHeld { loss: Loss::HeldBy(other), .. } => {
            let holder = holder.map(|h| format!(", not by {h:?}")).unwrap_or_default();
            (Exit::NotHeld, format!("{lease} is held by {other:?}{holder}"))
        }
        client::Error::NotHeld { holder: not_holder, loss, .. } => {
            (Exit::NotHeld, format!("{not_holder:?} does not hold {lease}: {loss}; acquire it again"))
        }
        client::Error::Cancelled { .. } => (Exit::Failed, format!("cancelled while waiting for {lease}")),
        client::Error::Conflict(_) => (Exit::Failed, format!("{lease} kept changing while kube-fence wrote it; try again")),
        // A 404 that names nothing is about the URL: the API server does not serve the type.
        client::Error::Kube(kube::Error::Api(status))
            if status.code == 404 && status.details.as_ref().is_none_or(|d| d.name.is_empty()) =>
        {
            (Exit::NotFound, "the API server does not serve kubefence.io Leases: install the CRDs (kubectl apply -f crds/)".to_string())
        }
        client::Error::Kube(kube) => explain_api_about(server, Some(lease), kube),
        other => (Exit::Failed, format!("{lease}: {}", causes(other))),
    }
}

/// `kube-fence status` could not list what it shows: a 404 naming no object means the API server
/// does not serve the resource (the CRDs are missing); a 403 names every permission `status` needs.
fn explain_list(server: &str, listed: Listed, namespace: Option<&str>, err: &kube::Error) -> (Exit, String) {
    match err {
        kube::Error::Api(status)
            if status.code == 404 && listed != Listed::Events && status.details.as_ref().is_none_or(|d| d.name.is_empty()) =>
        {
            (
                Exit::NotFound,
                format!(
                    "the API server at {server} does not serve {}: install kube-fence's CRDs (kubectl apply -f crds/)",
                    listed.resource()
                ),
            )
        }
        kube::Error::Api(status) if status.code == 403 && status.reason == "Forbidden" => {
            let place = namespace.map(|ns| format!("in namespace {ns:?}")).unwrap_or_else(|| "in all namespaces".into());
            (
                Exit::Forbidden,
                format!(
                    "{}; `kube-fence status` lists {}, {} and {} {place}: ask a cluster admin for that permission (RBAC), or use another user",
                    one_line(&status.message),
                    Listed::FencedControllers.resource(),
                    Listed::Leases.resource(),
                    Listed::Events.resource()
                ),
            )
        }
        other => explain_api(server, other),
    }
}

/// A fenced write (`kube-fence patch`) failed.
fn explain_write(server: &str, object: &Object, lease: &str, err: &client::Error) -> (Exit, String) {
    match err {
        client::Error::StaleToken { presented, recorded } => (
            Exit::StaleToken,
            format!(
                "stale token: {object} records token {recorded} of lease {lease:?}, the write presented {presented}; \
                 a newer holder has written: read the object again before writing"
            ),
        ),
        client::Error::NotHolder { lease, holder, requester } => (
            Exit::StaleToken,
            format!(
                "not the holder: {object} is holder-only and lease {lease} is held by {}, while this write came from {}; another holder took over",
                holder.as_deref().unwrap_or("nobody"),
                requester.as_deref().unwrap_or("an unknown requester")
            ),
        ),
        client::Error::Fenced(denial) => (
            Exit::Forbidden,
            format!(
                "kube-fence refused the write to {object}: {}{}",
                denial.reason,
                denial.lease.as_deref().map(|l| format!(" (lease {l})")).unwrap_or_default()
            ),
        ),
        client::Error::Conflict(_) => (Exit::Failed, format!("{object} changed while kube-fence wrote it; read it again and retry")),
        client::Error::UnsupportedPatch(why) => (Exit::Usage, format!("cannot stamp the token into this patch: {why}")),
        client::Error::Kube(kube) => explain_api_about(server, Some(object), kube),
        other => (Exit::Failed, format!("{object}: {}", causes(other))),
    }
}

fn tls(err: &TlsError) -> String {
    match err {
        TlsError::Read { path, source } => format!("cannot read the TLS file {}: {}", path.display(), io(source)),
        // Only self-managed TLS talks to the API; `manage_tls` explains that with the server.
        TlsError::Kube(kube) => explain_api("the cluster's API server", kube).1,
        other => causes(other),
    }
}

fn manage_tls(secret: &Object, server: &str, err: &TlsError) -> (Exit, String) {
    match err {
        TlsError::Kube(kube) => {
            let (exit, why) = explain_api(server, kube);
            (exit, format!("cannot keep the self-managed TLS certificate in {secret}: {why}"))
        }
        other => (Exit::Failed, format!("cannot keep the self-managed TLS certificate in {secret}: {}", tls(other))),
    }
}

fn start_local(server: &str, err: &LocalError) -> (Exit, String) {
    match err {
        LocalError::Bind { port, source } => {
            (Exit::Failed, format!("cannot listen on 127.0.0.1:{port}: {}; leave --local-port out to pick a free port", io(source)))
        }
        LocalError::Tls(tls_err) => (Exit::Failed, tls(tls_err)),
        LocalError::CacheNotReady(waited) => (
            Exit::Failed,
            format!(
                "could not list the kubefence.io Leases within {}: are the CRDs installed (kubectl apply -f crds/), and may this user list them?",
                humantime::format_duration(*waited)
            ),
        ),
        LocalError::Register(kube) => {
            let (exit, why) = explain_api(server, kube);
            (exit, format!("cannot register the local webhook: {why}"))
        }
    }
}

/// The registration outlives the process: guarded writes now fail closed until it is removed.
fn unregister(configuration: &Object, server: &str, err: &kube::Error) -> (Exit, String) {
    let (exit, why) = explain_api(server, err);
    let kind = configuration.kind.to_ascii_lowercase();
    (
        exit,
        format!(
            "could not remove {configuration} ({why}); guarded writes fail until it is removed: kubectl delete {kind} {}",
            configuration.name
        ),
    )
}

fn run_controller(server: &str, err: &crate::lease::controller::Error) -> (Exit, String) {
    match err {
        crate::lease::controller::Error::WriteStatus { lease, source } => {
            let (exit, why) = explain_api(server, source);
            (exit, format!("the lease controller cannot write the status of lease {lease}: {why}"))
        }
        other => (Exit::Failed, format!("the lease controller failed: {}", causes(other))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::core::Status;
    use kube::core::response::StatusDetails;

    fn api(code: u16, reason: &str, message: &str, details: Option<(&str, &str, &str)>) -> kube::Error {
        kube::Error::Api(Box::new(Status {
            code,
            reason: reason.into(),
            message: message.into(),
            details: details.map(|(group, kind, name)| StatusDetails {
                group: group.into(),
                kind: kind.into(),
                name: name.into(),
                uid: String::new(),
                causes: Vec::new(),
                retry_after_seconds: 0,
            }),
            ..Default::default()
        }))
    }

    fn lease() -> Object {
        Object::namespaced("lease", "work", "jobs")
    }

    #[test]
    fn the_help_documents_every_exit_status() {
        for exit in Exit::ALL {
            let line = format!("\n  {}  ", exit.code());
            assert!(EXIT_STATUS_HELP.contains(&line), "exit status {} ({exit:?}) is documented", exit.code());
        }
        assert_eq!(Exit::ALL.len(), EXIT_STATUS_HELP.lines().filter(|l| l.starts_with("  ") && !l.starts_with("  0")).count());
    }

    #[test]
    fn api_errors_are_named_by_cause_without_debug_output() {
        let cases = [
            (
                api(404, "NotFound", "namespaces \"nosuchns\" not found", Some(("", "namespaces", "nosuchns"))),
                Exit::NotFound,
                "namespace \"nosuchns\" does not exist",
            ),
            (
                api(
                    403,
                    "Forbidden",
                    "leases.kubefence.io \"jobs\" is forbidden: User \"nobody\" cannot get resource",
                    Some(("kubefence.io", "leases", "jobs")),
                ),
                Exit::Forbidden,
                "User \"nobody\" cannot get resource",
            ),
            (api(401, "Unauthorized", "Unauthorized", None), Exit::Forbidden, "rejected the kubeconfig's credentials"),
            (
                api(404, "NotFound", "configmaps \"x\" not found", Some(("", "configmaps", "x"))),
                Exit::NotFound,
                "configmaps \"x\" does not exist",
            ),
        ];
        for (err, exit, says) in cases {
            let (got_exit, message) = explain_api("https://127.0.0.1:6443", &err);
            assert_eq!(got_exit, exit, "{message}");
            assert!(message.contains(says), "{message:?} says {says:?}");
            assert!(!message.contains("Status {") && !message.contains("Some("), "{message}");
        }
    }

    #[test]
    fn lease_failures_map_to_their_exit_status() {
        let timeout = client::Error::Timeout { lease: "work/jobs".into(), waited: Duration::from_millis(2003), held_by: Some("a".into()) };
        let (exit, message) =
            explain_lease("https://127.0.0.1:6443", &lease(), Some(&"b".to_string()), Some(Duration::from_secs(2)), &timeout);
        assert_eq!(exit, Exit::TimedOut);
        assert_eq!(
            message,
            "timed out after 2s waiting for lease \"jobs\" in namespace \"work\": it is held by \"a\"; wait longer (--wait) or ask its holder to release it"
        );

        let held = client::Error::NotHeld { lease: "work/jobs".into(), holder: "b".into(), loss: Loss::HeldBy("a".into()) };
        assert_eq!(
            explain_lease("https://127.0.0.1:6443", &lease(), Some(&"b".to_string()), None, &held),
            (Exit::NotHeld, "lease \"jobs\" in namespace \"work\" is held by \"a\", not by \"b\"".into())
        );

        let missing = client::Error::LeaseNotFound { lease: "work/jobs".into() };
        assert_eq!(explain_lease("https://127.0.0.1:6443", &lease(), None, None, &missing).0, Exit::NotFound);
    }

    #[test]
    fn status_says_when_the_crds_are_missing_or_listing_is_forbidden() {
        let server = "https://127.0.0.1:6443";
        let missing = api(404, "NotFound", "the server could not find the requested resource", None);
        let (exit, message) = explain_list(server, Listed::FencedControllers, Some("work"), &missing);
        assert_eq!(exit, Exit::NotFound);
        assert_eq!(
            message,
            "the API server at https://127.0.0.1:6443 does not serve fencedcontrollers.kubefence.io: install kube-fence's CRDs (kubectl apply -f crds/)"
        );
        let forbidden = api(
            403,
            "Forbidden",
            "leases.kubefence.io is forbidden: User \"nobody\" cannot list resource \"leases\"",
            Some(("kubefence.io", "leases", "")),
        );
        let (exit, message) = explain_list(server, Listed::Leases, None, &forbidden);
        assert_eq!(exit, Exit::Forbidden);
        assert!(message.starts_with("leases.kubefence.io is forbidden: User \"nobody\" cannot list"), "{message}");
        assert!(message.contains("events.events.k8s.io in all namespaces: ask a cluster admin"), "{message}");
        let unreachable = api(500, "InternalError", "etcd is down", None);
        assert_eq!(explain_list(server, Listed::Events, Some("work"), &unreachable), (Exit::Failed, "etcd is down".into()));
    }

    #[test]
    fn a_stale_write_names_both_tokens() {
        let (exit, message) = explain_write(
            "https://127.0.0.1:6443",
            &Object::namespaced("configmap", "work", "report"),
            "jobs",
            &client::Error::StaleToken {
                presented: kube_fence_api::token::Token::new(3).unwrap_or(kube_fence_api::token::Token::MAX),
                recorded: kube_fence_api::token::Token::new(5).unwrap_or(kube_fence_api::token::Token::MAX),
            },
        );
        assert_eq!(exit, Exit::StaleToken);
        assert!(message.contains("records token 5") && message.contains("presented 3"), "{message}");
    }

    #[test]
    fn a_nested_cause_is_said_once_in_the_line_and_once_under_v() {
        let source = "work/jobs:012".parse::<client::Delegated>().expect_err("a leading zero is refused");
        let err = Error::ReadDelegatedGrant { source };
        let (grant, token) = ("the delegated grant \"work/jobs:012\" has a bad token", "the token \"012\" has a leading zero");
        let line = err.to_string();
        assert!(line.starts_with(&format!("KUBE_FENCE_GRANT is not a usable grant: {grant}: {token}")), "{line}");
        let verbose = err.verbose();
        assert!(verbose.starts_with("KUBE_FENCE_GRANT is not a usable grant\n  failed action: ReadDelegatedGrant\n"), "{verbose}");
        for cause in [grant, token] {
            assert_eq!(verbose.matches(cause).count(), 1, "{cause:?} once in:\n{verbose}");
        }
    }

    #[test]
    fn io_errors_lose_the_os_error_suffix() {
        let refused = std::io::Error::from_raw_os_error(111);
        assert!(refused.to_string().contains("os error"));
        assert_eq!(io(&refused), "connection refused");
        let err = Error::Listen {
            addr: "127.0.0.1:80".parse().unwrap_or_else(|_| unreachable!()),
            source: std::io::Error::from_raw_os_error(98),
        };
        assert_eq!(
            err.to_string(),
            "cannot listen on 127.0.0.1:80: the address is already in use; another process listens there: stop it or choose another --addr"
        );
    }
}
