//! The `kube-fence` command line. Each subcommand lives in a file of its own.

use std::process::ExitCode;

use clap::{Parser, Subcommand};

pub mod controller;
mod crd;
pub mod lease;
pub mod run;
pub mod webhook;

/// Fencing tokens for Kubernetes: leases that grant strictly increasing tokens, and a validating
/// webhook that rejects every write carrying a stale one.
#[derive(Debug, Parser)]
#[command(name = "kube-fence", version, about, long_about = None, propagate_version = true)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print the CustomResourceDefinitions generated from kube-fence's Rust types (what crds/ holds).
    Crd(crd::CrdArgs),
    /// Serve the fencing webhook (HTTPS): judges writes to objects labelled kubefence.io/lease.
    Webhook(webhook::WebhookArgs),
    /// Run the lease controller and the fencing webhook in one process (--local: on this
    /// machine, registered by URL on the cluster in KUBECONFIG).
    Run(run::RunArgs),
    /// Run the Lease controller: grants tokens, records renewals, expires and releases leases.
    Controller(controller::ControllerArgs),
    /// Acquire, renew, release or show a lease (acquire prints the fencing token).
    Lease(lease::LeaseArgs),
}

/// Runs one parsed command line.
pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    match cli.command {
        Command::Crd(args) => crd::run(args),
        Command::Webhook(args) => webhook::run(args).await,
        Command::Run(args) => run::run(args).await,
        Command::Controller(args) => controller::run(args).await,
        Command::Lease(args) => lease::run(args).await,
    }
}
