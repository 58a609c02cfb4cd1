//! `kube-fence lease acquire|renew|release|get`: the lease client for shell scripts.
//!
//! `acquire` prints the token alone on stdout, so a script can do
//! `token=$(kube-fence lease acquire job --holder "$HOSTNAME" --wait 30s)`. Diagnostics go to
//! stderr; a failure exits non-zero.

use std::io::Write;
use std::time::Duration;

use k8s_openapi::api::core::v1::Namespace;
use kube::ResourceExt;
use kube::api::Api;

use super::cluster::{Cluster, ClusterArgs};
use super::error::{Error, Object};
use crate::client::{self, AcquireOptions, Leases};

/// Arguments of `kube-fence lease`.
#[derive(Debug, clap::Args)]
pub struct LeaseArgs {
    #[command(subcommand)]
    pub command: LeaseCommand,
}

/// Options every lease subcommand takes.
#[derive(Debug, clap::Args)]
pub struct Target {
    /// Name of the Lease (kubefence.io/v1alpha1).
    pub name: String,
    /// Namespace of the Lease (default: the kubeconfig context's namespace).
    #[arg(short = 'n', long, env = "KUBE_FENCE_NAMESPACE")]
    pub namespace: Option<String>,
}

#[derive(Debug, clap::Subcommand)]
pub enum LeaseCommand {
    /// Acquire the lease (creating it when missing) and print the fencing token. Waits up to
    /// --wait while another holder has it. Nothing renews it afterwards: call `renew` within the
    /// duration, or it expires.
    #[command(after_help = super::EXIT_STATUS_HELP)]
    Acquire {
        #[command(flatten)]
        target: Target,
        /// Identity of the holder (unique per worker incarnation). In a Pod it defaults to
        /// $POD_NAME (set it from the downward API: what a Lease with `spec.identity: Pod` checks).
        #[arg(long, env = "POD_NAME")]
        holder: String,
        /// Lease duration (whole seconds, 1s..24h), e.g. 15s, 2m.
        #[arg(long, value_parser = parse_lease_duration)]
        duration: Option<Duration>,
        /// How long to wait for the grant (while another holder has it, too), e.g. 30s.
        #[arg(long, default_value = "30s", value_parser = parse_wait)]
        wait: Duration,
    },
    /// Send one heartbeat for the holder's grant and print its (unchanged) token.
    #[command(after_help = super::EXIT_STATUS_HELP)]
    Renew {
        #[command(flatten)]
        target: Target,
        /// Identity of the holder; defaults to $POD_NAME.
        #[arg(long, env = "POD_NAME")]
        holder: String,
    },
    /// Release the holder's grant. The token stays recorded; the next grant is greater.
    #[command(after_help = super::EXIT_STATUS_HELP)]
    Release {
        #[command(flatten)]
        target: Target,
        /// Identity of the holder; defaults to $POD_NAME.
        #[arg(long, env = "POD_NAME")]
        holder: String,
    },
    /// Run a command while holding the lease: acquire it (waiting while another holder has it),
    /// give the command the grant in its environment (KUBE_FENCE_TOKEN, KUBE_FENCE_LEASE,
    /// KUBE_FENCE_HOLDER, KUBE_FENCE_NAMESPACE, and KUBE_FENCE_GRANT, with which `kube-fence
    /// patch` and `delete` write), renew it in the background, and release it when the command
    /// exits; the exit status is the command's. If the grant is lost (renewal refused, the lease
    /// expired or taken), the command is stopped (SIGTERM, SIGKILL after --grace-period) and the
    /// exit status is 7. SIGINT and SIGTERM are forwarded to the command.
    #[command(after_help = super::EXIT_STATUS_HELP)]
    Run {
        #[command(flatten)]
        target: Target,
        /// Identity of the holder (unique per run). Defaults to $POD_NAME in a Pod (what a Lease
        /// with `spec.identity: Pod` checks), else to this host's name and the process id.
        #[arg(long, visible_alias = "identity", env = "POD_NAME")]
        holder: Option<String>,
        /// Lease duration (whole seconds, 1s..24h), e.g. 15s, 2m; renewed every third of it.
        #[arg(long, value_parser = parse_lease_duration)]
        duration: Option<Duration>,
        /// How long to wait for the grant (default: until granted).
        #[arg(long, value_parser = parse_wait)]
        wait: Option<Duration>,
        /// After the grant is lost, how long the command has between SIGTERM and SIGKILL.
        #[arg(long, default_value = "10s", value_parser = parse_wait)]
        grace_period: Duration,
        /// The command to run and its arguments, after `--`.
        #[arg(last = true, required = true, value_name = "COMMAND")]
        command: Vec<std::ffi::OsString>,
    },
    /// Show the lease: holder, token, phase, expiry.
    #[command(after_help = super::EXIT_STATUS_HELP)]
    Get {
        #[command(flatten)]
        target: Target,
        /// Succeed only if this holder holds the lease.
        #[arg(long)]
        holder: Option<String>,
        /// Output format.
        #[arg(short = 'o', long, value_enum, default_value_t = Output::Table)]
        output: Output,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// One line per field group, like `kubectl get`.
    Table,
    /// The newest token alone.
    Token,
    Yaml,
    Json,
}

/// A lease duration: whole seconds from 1 s to 24 h (what `spec.leaseDurationSeconds` holds).
/// clap names the value in its message; these say only what is wrong with it.
fn parse_lease_duration(s: &str) -> Result<Duration, String> {
    let d = humantime::parse_duration(s).map_err(|e| format!("not a duration ({e}); write e.g. 15s or 2m"))?;
    if d.subsec_nanos() != 0 || d.as_secs() == 0 || d.as_secs() > 86_400 {
        return Err("a lease duration is whole seconds from 1s to 24h".to_string());
    }
    Ok(d)
}

fn parse_wait(s: &str) -> Result<Duration, String> {
    humantime::parse_duration(s).map_err(|e| format!("not a duration ({e}); write e.g. 30s or 2m"))
}

pub async fn run(args: LeaseArgs, at: &ClusterArgs) -> Result<u8, Error> {
    let cluster = Cluster::connect(at).await?;
    if let LeaseCommand::Run { target, holder, duration, wait, grace_period, command } = args.command {
        let namespace = target.namespace.clone().unwrap_or_else(|| cluster.namespace.clone());
        let holder = holder.unwrap_or_else(super::lease_run::default_holder);
        let request = super::lease_run::RunLease { name: target.name, namespace, holder, duration, wait, grace_period, command };
        return super::lease_run::run(&cluster, request).await.map(super::lease_run::exit_code);
    }
    let server = cluster.server.clone();
    let at = |target: &Target| {
        let ns = target.namespace.clone().unwrap_or_else(|| cluster.namespace.clone());
        (Leases::new(cluster.client.clone(), &ns), Object::namespaced("lease", ns, &target.name))
    };
    let mut out = std::io::stdout().lock();
    match args.command {
        LeaseCommand::Acquire { target, holder, duration, wait } => {
            let (leases, lease) = at(&target);
            let mut options = AcquireOptions::default().timeout(wait);
            options.duration = duration;
            // One read first: acquire fails at once on a refused watch (RBAC), but retries one
            // that fails otherwise (no API server, no such namespace) until --wait runs out,
            // which would report the cause as a timeout.
            let readable = match leases.get(&target.name).await {
                Ok(_) | Err(client::Error::LeaseNotFound { .. }) => Ok(()),
                Err(err) => Err(err),
            };
            let acquired = match readable {
                Ok(()) => leases.acquire(&target.name, &holder, options).await,
                Err(err) => Err(err),
            };
            let grant = match acquired {
                Ok(grant) => grant,
                Err(source) => return Err(Error::AcquireLease { lease, holder, wait, server, source }),
            };
            writeln!(out, "{}", grant.token)?;
        }
        LeaseCommand::Renew { target, holder } => {
            let (leases, lease) = at(&target);
            let renewed = match leases.current_grant(&target.name, &holder).await {
                Ok(grant) => leases.renew(&grant).await,
                Err(err) => Err(or_missing_namespace(&cluster, &lease, err).await),
            };
            match renewed {
                Ok(grant) => writeln!(out, "{}", grant.token)?,
                Err(source) => return Err(Error::RenewLease { lease, holder, server, source }),
            }
        }
        LeaseCommand::Release { target, holder } => {
            let (leases, lease) = at(&target);
            let released = match leases.current_grant(&target.name, &holder).await {
                Ok(grant) => leases.release(&grant).await,
                Err(err) => Err(or_missing_namespace(&cluster, &lease, err).await),
            };
            if let Err(source) = released {
                return Err(Error::ReleaseLease { lease, holder, server, source });
            }
        }
        LeaseCommand::Run { .. } => unreachable!("handled above"),
        LeaseCommand::Get { target, holder, output } => {
            let (leases, object) = at(&target);
            let lease = match leases.get(&target.name).await {
                Ok(lease) => lease,
                Err(err) => {
                    let source = or_missing_namespace(&cluster, &object, err).await;
                    return Err(Error::GetLease { lease: object, server, source });
                }
            };
            let status = lease.status.clone().unwrap_or_default();
            if let Some(holder) = holder {
                let held_by = kube_fence_api::state::held(lease.status.as_ref()).map(|(h, _)| h.to_string());
                if held_by.as_deref() != Some(holder.as_str()) {
                    return Err(Error::CheckHolder { lease: object, holder, held_by });
                }
            }
            let encode = |source: Box<dyn std::error::Error + Send + Sync>| Error::EncodeOutput { source };
            match output {
                Output::Token => match status.token {
                    Some(token) => writeln!(out, "{token}")?,
                    None => return Err(Error::ReadToken { lease: object }),
                },
                Output::Yaml => out.write_all(serde_saphyr::to_string(&lease).map_err(|e| encode(e.into()))?.as_bytes())?,
                Output::Json => writeln!(out, "{}", serde_json::to_string_pretty(&lease).map_err(|e| encode(e.into()))?)?,
                Output::Table => {
                    let or_none = |s: Option<String>| s.unwrap_or_else(|| "<none>".to_string());
                    writeln!(out, "NAME\tHOLDER\tTOKEN\tPHASE\tEXPIRES")?;
                    writeln!(
                        out,
                        "{}\t{}\t{}\t{:?}\t{}",
                        lease.name_any(),
                        or_none(status.holder.clone()),
                        or_none(status.token.map(|t| t.to_string())),
                        status.phase,
                        or_none(status.expire_time.map(|t| t.0.to_string())),
                    )?;
                }
            }
        }
    }
    Ok(0)
}

/// A lease that is not found may be missing because its namespace is: then the namespace's own
/// 404 (from the API server, with its typed details) is the cause worth reporting.
async fn or_missing_namespace(cluster: &Cluster, lease: &Object, err: client::Error) -> client::Error {
    let (client::Error::LeaseNotFound { .. }, Some(ns)) = (&err, &lease.namespace) else {
        return err;
    };
    match Api::<Namespace>::all(cluster.client.clone()).get_metadata(ns).await {
        Err(missing @ kube::Error::Api(_)) if matches!(&missing, kube::Error::Api(s) if s.code == 404) => client::Error::Kube(missing),
        _ => err,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rstest::rstest;

    #[rstest]
    #[case("15s", Ok(15))]
    #[case("2m", Ok(120))]
    #[case("24h", Ok(86_400))]
    #[case("0s", Err("whole seconds from 1s to 24h"))]
    #[case("1500ms", Err("whole seconds"))]
    #[case("25h", Err("1s to 24h"))]
    #[case("15", Err("not a duration"))]
    #[case("soon", Err("not a duration"))]
    fn lease_durations(#[case] input: &str, #[case] expected: Result<u64, &str>) {
        match (parse_lease_duration(input), expected) {
            (Ok(d), Ok(secs)) => assert_eq!(d.as_secs(), secs),
            (Err(e), Err(why)) => assert!(e.contains(why), "{e}"),
            (got, want) => panic!("{input}: got {got:?}, want {want:?}"),
        }
    }
}
