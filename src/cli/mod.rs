//! The `kube-fence` command line. Each subcommand lives in a file of its own; every failure is
//! an [`Error`] (`error.rs`), which alone decides the message and the exit status.

// An `Error` ends the process, once: carrying its facts unboxed costs nothing that matters.
#![allow(clippy::result_large_err)]

use clap::{Parser, Subcommand};

mod chart_templates;
pub mod cluster;
pub mod controller;
mod crd;
pub mod delegate;
pub mod delete;
pub mod error;
pub mod grant;
pub mod lease;
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
    /// Check fencing end to end in a fenced namespace (the chart's `helm test`): a lease's
    /// newer grant writes a guarded ConfigMap, then the older grant's write must be refused.
    #[command(after_help = EXIT_STATUS_HELP)]
    Selftest(selftest::SelftestArgs),
}

/// Runs one parsed command line.
pub async fn run(cli: Cli) -> Result<(), Error> {
    match cli.command {
        Command::Crd(args) => crd::run(args),
        Command::ChartTemplates(args) => chart_templates::run(args),
        Command::Webhook(args) => webhook::run(args).await,
        Command::Run(args) => run::run(args).await,
        Command::Controller(args) => controller::run(args).await,
        Command::Lease(args) => lease::run(args).await,
        Command::Patch(args) => patch::run(args).await,
        Command::Delete(args) => delete::run(args).await,
        Command::Delegate(args) => delegate::run(args).await,
        Command::Status(args) => status::run(args).await,
        Command::Selftest(args) => selftest::run(args).await,
    }
}

/// clap's complaint about a command line, on one line: its own layout puts the cause, the
/// offending arguments and a usage block on separate lines.
pub fn usage_error(err: &clap::Error) -> Error {
    let rendered = err.render().to_string();
    let mut words: Vec<&str> = Vec::new();
    for line in rendered.lines() {
        let line = line.trim();
        if line.starts_with("Usage:") || line.starts_with("For more information") {
            break;
        }
        if !line.is_empty() {
            words.push(line);
        }
    }
    let message = words.join(" ");
    let message = message.strip_prefix("error: ").unwrap_or(&message);
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
        let err = parse(&["lease", "acquire", "l"]).err().map(|e| usage_error(&e).to_string()).unwrap_or_default();
        assert_eq!(err, "the following required arguments were not provided: --holder <HOLDER> (see --help)");
        assert_eq!(usage_error(&parse(&["nonsense"]).err().unwrap_or_else(|| panic!("parses"))).exit(), Exit::Usage);
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
