//! The `kube-fence` command line. Each subcommand lives in a file of its own; every failure is
//! an [`Error`] (`error.rs`), which alone decides the message and the exit status.

// An `Error` ends the process, once: carrying its facts unboxed costs nothing that matters.
#![allow(clippy::result_large_err)]

use clap::{CommandFactory, FromArgMatches, Parser, Subcommand};

mod chart_templates;
pub mod cluster;
pub mod completion;
pub mod controller;
mod crd;
pub mod delegate;
pub mod delete;
pub mod error;
pub mod grant;
pub mod lease;
pub mod lease_run;
pub mod patch;
pub mod run;
pub mod selftest;
pub mod status;
pub mod webhook;

pub use error::{EXIT_STATUS_HELP, Error, Exit};

/// Fencing tokens for Kubernetes: leases that grant strictly increasing tokens, and a validating
/// webhook that rejects every write carrying a stale one.
#[derive(Debug, Parser)]
#[command(name = "kube-fence", version, about, long_about = None, propagate_version = true, after_help = EXIT_STATUS_HELP)]
pub struct Cli {
    /// On failure, print the whole chain of causes (the API server's answer included).
    #[arg(short, long, global = true)]
    pub verbose: bool,

    #[command(flatten)]
    pub cluster: cluster::ClusterArgs,

    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the CustomResourceDefinitions generated from kube-fence's Rust types (what crds/ holds).
    Crd(crd::CrdArgs),
    /// Write the Helm chart's webhook configurations and policies, rendered from what local mode
    /// registers, into the chart's templates directory (what charts/kube-fence/templates holds).
    ChartTemplates(chart_templates::ChartTemplatesArgs),
    /// Serve the fencing webhook (HTTPS): judges writes to objects labelled kubefence.io/lease.
    #[command(after_help = EXIT_STATUS_HELP)]
    Webhook(webhook::WebhookCommand),
    /// Run the lease controller and the fencing webhook in one process (--local: on this
    /// machine, registered by URL on the cluster in KUBECONFIG).
    #[command(after_help = EXIT_STATUS_HELP)]
    Run(run::RunArgs),
    /// Run the Lease controller: grants tokens, records renewals, expires and releases leases.
    #[command(after_help = EXIT_STATUS_HELP)]
    Controller(controller::ControllerArgs),
    /// Acquire, renew, release or show a lease (acquire prints the fencing token).
    #[command(after_help = EXIT_STATUS_HELP)]
    Lease(lease::LeaseArgs),
    /// Patch an object with a lease's fencing token (a fenced write): rejected, exit status 8,
    /// when the object records a token at least as new.
    #[command(after_help = EXIT_STATUS_HELP)]
    Patch(patch::PatchArgs),
    /// Delete exactly the version of an object read (the resourceVersion precondition a guarded
    /// DELETE needs): as the holder of a holder-only object, or with a lease's token (exit
    /// status 8 when the object records a newer one).
    #[command(after_help = EXIT_STATUS_HELP)]
    Delete(delete::DeleteArgs),
    /// Stamp a grant onto manifests a holder starts (a Job, a Pod, a work item) and print them:
    /// their Pods get it in $KUBE_FENCE_GRANT, with which `patch` and `delete` then write.
    #[command(after_help = EXIT_STATUS_HELP)]
    Delegate(delegate::DelegateArgs),
    /// Show every FencedController and kube-fence Lease in a namespace, one line each, with the
    /// writes refused (and warned of) in the last hour.
    #[command(long_about = status::LONG_ABOUT, after_help = EXIT_STATUS_HELP)]
    Status(status::StatusArgs),
    /// Print a shell completion script (bash, zsh or fish) for kube-fence, or for kubectl-fence
    /// when invoked by that name.
    Completion(completion::CompletionArgs),
    /// Check fencing end to end in a fenced namespace (the chart's `helm test`): a lease's
    /// newer grant writes a guarded ConfigMap, then the older grant's write must be refused.
    #[command(after_help = EXIT_STATUS_HELP)]
    Selftest(selftest::SelftestArgs),
}

/// Runs one parsed command line; on success, the exit status (0, or `lease run`'s command's).
pub async fn run(cli: Cli) -> Result<u8, Error> {
    let at = &cli.cluster;
    let done = match cli.command {
        Command::Crd(args) => crd::run(args),
        Command::ChartTemplates(args) => chart_templates::run(args),
        Command::Webhook(args) => webhook::run(args, at).await,
        Command::Run(args) => run::run(args, at).await,
        Command::Controller(args) => controller::run(args, at).await,
        Command::Lease(args) => return lease::run(args, at).await,
        Command::Patch(args) => patch::run(args, at).await,
        Command::Delete(args) => delete::run(args, at).await,
        Command::Delegate(args) => delegate::run(args, at).await,
        Command::Status(args) => status::run(args, at).await,
        Command::Completion(args) => completion::run(args),
        Command::Selftest(args) => selftest::run(args, at).await,
    };
    done.map(|()| 0)
}

/// The name kubectl runs a plugin by: `kubectl-fence` on the PATH is `kubectl fence`.
pub const PLUGIN_EXECUTABLE: &str = "kubectl-fence";

/// How the binary was invoked (`argv[0]`'s file name): as the kubectl plugin `kubectl-fence`, its
/// help and usage say `kubectl fence ...`; otherwise `kube-fence ...`.
pub fn invoked_as(argv0: Option<&std::ffi::OsStr>) -> &'static str {
    let name = argv0.map(std::path::Path::new).and_then(|p| p.file_name()).and_then(|n| n.to_str()).unwrap_or_default();
    if name == PLUGIN_EXECUTABLE || name.starts_with("kubectl-fence.") { "kubectl fence" } else { "kube-fence" }
}

/// The command line's definition, named as it was invoked (see [`invoked_as`]).
pub fn command(bin_name: &'static str) -> clap::Command {
    Cli::command().bin_name(bin_name)
}

/// Parses `args` (`argv[0]` first) as the binary does: named by how it was invoked.
pub fn parse_from<I, T>(args: I) -> Result<Cli, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<std::ffi::OsString> + Clone,
{
    let args: Vec<std::ffi::OsString> = args.into_iter().map(Into::into).collect();
    let mut command = command(invoked_as(args.first().map(|a| a.as_os_str())));
    let matches = command.try_get_matches_from_mut(args)?;
    Cli::from_arg_matches(&matches).map_err(|err| err.format(&mut command))
}

/// clap's complaint about a command line, on one line, built from its typed kind and context
/// (clap's own layout puts the cause, the offending arguments and a usage block on separate
/// lines, in words that may change between clap versions).
pub fn usage_error(err: &clap::Error) -> Error {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    let text = |kind: ContextKind, separator: &str| match err.get(kind) {
        Some(ContextValue::String(s)) => Some(s.clone()),
        Some(ContextValue::Strings(v)) => Some(v.join(separator)),
        Some(ContextValue::StyledStr(s)) => Some(s.to_string()),
        Some(ContextValue::StyledStrs(v)) => Some(v.iter().map(|s| s.to_string()).collect::<Vec<_>>().join(separator)),
        Some(ContextValue::Number(n)) => Some(n.to_string()),
        _ => None,
    };
    let arg = text(ContextKind::InvalidArg, " ").unwrap_or_default();
    let value = text(ContextKind::InvalidValue, " ").unwrap_or_default();
    let subcommand = text(ContextKind::InvalidSubcommand, " ").unwrap_or_default();
    let suggestion = text(ContextKind::SuggestedArg, "', '")
        .or_else(|| text(ContextKind::SuggestedSubcommand, "', '"))
        .or_else(|| text(ContextKind::SuggestedValue, "', '"))
        .map(|s| format!("; did you mean '{s}'?"))
        .or_else(|| text(ContextKind::Suggested, "; ").map(|tip| format!("; {tip}")))
        .unwrap_or_default();
    let message = match err.kind() {
        ErrorKind::MissingRequiredArgument => format!("the following required arguments were not provided: {arg}"),
        ErrorKind::InvalidValue if value.is_empty() => format!("a value is required for '{arg}' but none was supplied"),
        ErrorKind::InvalidValue => {
            let valid = text(ContextKind::ValidValue, ", ").map(|v| format!(" (possible values: {v})")).unwrap_or_default();
            format!("invalid value '{value}' for '{arg}'{valid}{suggestion}")
        }
        ErrorKind::ValueValidation => {
            let why = std::error::Error::source(err).map(|e| format!(": {}", error::one_line(&e.to_string()))).unwrap_or_default();
            format!("invalid value '{value}' for '{arg}'{why}")
        }
        ErrorKind::UnknownArgument => format!("unexpected argument '{arg}'{suggestion}"),
        ErrorKind::InvalidSubcommand => format!("unrecognized subcommand '{subcommand}'{suggestion}"),
        ErrorKind::MissingSubcommand => {
            let valid = text(ContextKind::ValidSubcommand, ", ").map(|v| format!(": {v}")).unwrap_or_default();
            format!("'{subcommand}' needs a subcommand{valid}")
        }
        ErrorKind::ArgumentConflict => match text(ContextKind::PriorArg, "', '") {
            Some(prior) => format!("the argument '{arg}' cannot be used with '{prior}'"),
            None => format!("the argument '{arg}' cannot be used with one or more of the other arguments given"),
        },
        ErrorKind::NoEquals => format!("'{arg}' takes its value after an equal sign ({arg}=VALUE)"),
        ErrorKind::TooManyValues => format!("unexpected value '{value}' for '{arg}'; no more were expected"),
        ErrorKind::TooFewValues | ErrorKind::WrongNumberOfValues => {
            let expected = text(ContextKind::ExpectedNumValues, " ").or_else(|| text(ContextKind::MinValues, " ")).unwrap_or_default();
            let actual = text(ContextKind::ActualNumValues, " ").unwrap_or_default();
            format!("'{arg}' takes {expected} values, {actual} were given")
        }
        ErrorKind::InvalidUtf8 => "an argument is not valid UTF-8".to_string(),
        other => {
            let kind = other.as_str().unwrap_or("the command line is wrong").trim_end_matches('.').to_string();
            if arg.is_empty() { kind } else { format!("{kind}: {arg}") }
        }
    };
    Error::ParseArguments(format!("{message} (see --help)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("kube-fence").chain(args.iter().copied()))
    }

    #[test]
    fn leader_election_has_one_spelling_and_the_old_one_still_parses() {
        for args in [
            &["run", "--leader-election"][..],
            &["run", "--leader-elect"],
            &["controller", "--leader-election"],
            &["controller", "--leader-elect", "--leader-elect-namespace", "x"],
        ] {
            let elected = match parse(args).map(|cli| cli.command) {
                Ok(Command::Run(run)) => run.leader_election,
                Ok(Command::Controller(controller)) => controller.leader_election,
                other => panic!("{args:?}: {other:?}"),
            };
            assert!(elected, "{args:?}");
        }
        for command in ["run", "controller"] {
            let help = match parse(&[command, "--help"]) {
                Err(help) => help.render().to_string(),
                Ok(_) => panic!("--help"),
            };
            assert!(help.contains("--leader-election") && !help.contains("--leader-elect "), "{command} --help:\n{help}");
        }
    }

    #[test]
    fn the_leader_identity_rule_defaults_to_client_gos_and_refuses_an_ambiguous_separator() {
        use crate::admission::judge::identity::IdentityRule;
        let rule = |args: &[&str]| match parse(args).map(|cli| cli.command) {
            Ok(Command::Run(run)) => run.webhook.leader_identity,
            Ok(Command::Webhook(command)) => command.webhook.leader_identity,
            other => panic!("{args:?}: {other:?}"),
        };
        assert_eq!(rule(&["run", "--local"]), IdentityRule::Separated("_".into()));
        assert_eq!(rule(&["webhook", "--leader-identity-separator", "none"]), IdentityRule::Exact);
        assert_eq!(rule(&["run", "--leader-identity-separator=:"]), IdentityRule::Separated(":".into()));
        let err = parse(&["webhook", "--leader-identity-separator", "-"]).err().map(|e| usage_error(&e).to_string()).unwrap_or_default();
        assert!(err.contains("--leader-identity-separator") && err.contains("a Pod name can contain"), "{err}");
    }

    #[test]
    fn status_takes_a_namespace_or_all_and_its_help_says_counts_are_lower_bounds() {
        match parse(&["status", "-n", "work", "-A", "-o", "json"]).map(|cli| cli.command) {
            Ok(Command::Status(args)) => {
                assert_eq!((args.namespace.as_deref(), args.all_namespaces), (Some("work"), true));
                assert_eq!(args.output, status::Output::Json);
            }
            other => panic!("{other:?}"),
        }
        match parse(&["status"]).map(|cli| cli.command) {
            Ok(Command::Status(args)) => assert_eq!((args.all_namespaces, args.output), (false, status::Output::Table)),
            other => panic!("{other:?}"),
        }
        assert!(parse(&["status", "-o", "yaml"]).is_err(), "table, wide or json");
        let help = match parse(&["status", "--help"]) {
            Err(help) => help.render().to_string(),
            Ok(_) => panic!("--help"),
        };
        assert!(help.contains("Event counts are lower bounds") && help.contains("rate-limits"), "{help}");
    }

    #[test]
    fn usage_errors_are_one_line() {
        let err = |args: &[&str]| parse(args).err().map(|e| usage_error(&e).to_string()).unwrap_or_default();
        assert_eq!(err(&["lease", "acquire", "l"]), "the following required arguments were not provided: --holder <HOLDER> (see --help)");
        assert_eq!(usage_error(&parse(&["nonsense"]).err().unwrap_or_else(|| panic!("parses"))).exit(), Exit::Usage);
        // One per kind of complaint clap has, each from its typed context.
        let cases: [(&[&str], &str); 8] = [
            (&["nonsense"], "unrecognized subcommand 'nonsense' (see --help)"),
            (&["stauts"], "unrecognized subcommand 'stauts'; did you mean 'status'? (see --help)"),
            (&["status", "--al-namespaces"], "unexpected argument '--al-namespaces'; did you mean '--all-namespaces'? (see --help)"),
            (&["status", "-o", "yaml"], "invalid value 'yaml' for '--output <OUTPUT>' (possible values: table, wide, json) (see --help)"),
            (&["status", "-n"], "a value is required for '--namespace <NAMESPACE>' but none was supplied (see --help)"),
            (
                &["lease", "acquire", "l", "--holder", "h", "--duration", "soon"],
                "invalid value 'soon' for '--duration <DURATION>': not a duration (expected number at 0); write e.g. 15s or 2m (see --help)",
            ),
            (&["run", "--local-port", "9443"], "the following required arguments were not provided: --local (see --help)"),
            (&["lease", "run", "l"], "the following required arguments were not provided: <COMMAND>... (see --help)"),
        ];
        for (args, want) in cases {
            assert_eq!(err(args), want, "{args:?}");
        }
    }

    #[test]
    fn run_local_takes_a_free_port_unless_told_and_run_takes_a_ready_file() {
        match parse(&["run", "--local"]).map(|cli| cli.command) {
            Ok(Command::Run(run)) => assert_eq!(run.local_port, None),
            other => panic!("{other:?}"),
        }
        match parse(&["run", "--self-managed-tls", "--metrics-addr", "127.0.0.1:0", "--ready-file", "/tmp/r"]).map(|cli| cli.command) {
            Ok(Command::Run(run)) => {
                assert_eq!(run.ready_file.as_deref(), Some(std::path::Path::new("/tmp/r")));
                assert_eq!(run.webhook.metrics_addr, Some("127.0.0.1:0".parse().unwrap_or_else(|e| panic!("{e}"))));
            }
            other => panic!("{other:?}"),
        }
        assert!(parse(&["run", "--local-port", "9443"]).is_err(), "--local-port needs --local");
    }

    #[test]
    fn the_webhook_and_the_controller_take_a_ready_file() {
        match parse(&["webhook", "--addr", "127.0.0.1:0", "--ready-file", "/tmp/w"]).map(|cli| cli.command) {
            Ok(Command::Webhook(command)) => {
                assert_eq!(command.ready_file.as_deref(), Some(std::path::Path::new("/tmp/w")));
                assert_eq!(command.webhook.addr.port(), 0);
            }
            other => panic!("{other:?}"),
        }
        match parse(&["webhook"]).map(|cli| cli.command) {
            Ok(Command::Webhook(command)) => assert_eq!(command.ready_file, None),
            other => panic!("{other:?}"),
        }
        match parse(&["controller", "--metrics-addr", "127.0.0.1:0", "--ready-file", "/tmp/c"]).map(|cli| cli.command) {
            Ok(Command::Controller(controller)) => {
                assert_eq!(controller.ready_file.as_deref(), Some(std::path::Path::new("/tmp/c")))
            }
            other => panic!("{other:?}"),
        }
        assert!(parse(&["webhook", "--ready-file"]).is_err(), "--ready-file takes a path");
    }
}
