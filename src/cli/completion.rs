//! `kube-fence completion bash|zsh|fish`: a shell completion script, from the command line's own
//! definition (clap_complete), for the name the binary was invoked by.

use std::io::Write;

use super::error::Error;

/// Arguments of `kube-fence completion`.
#[derive(Debug, clap::Args)]
#[command(after_help = "Load it in the current shell, e.g.:
  source <(kube-fence completion bash)
  kube-fence completion zsh > \"${fpath[1]}/_kube-fence\"
  kube-fence completion fish > ~/.config/fish/completions/kube-fence.fish
Invoked as kubectl-fence, the script completes the command kubectl-fence.")]
pub struct CompletionArgs {
    /// The shell to complete for.
    #[arg(value_enum)]
    pub shell: Shell,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Shell {
    Bash,
    Zsh,
    Fish,
}

pub fn run(args: CompletionArgs) -> Result<(), Error> {
    let script = script(args.shell, super::invoked_as(std::env::args_os().next().as_deref()));
    std::io::stdout().lock().write_all(&script)?;
    Ok(())
}

/// The completion script for `shell`, for the binary invoked as `invoked_as` ([`super::invoked_as`]):
/// shells complete an executable, so `kubectl fence` completes as `kubectl-fence`.
pub fn script(shell: Shell, invoked_as: &'static str) -> Vec<u8> {
    let executable = if invoked_as == "kube-fence" { "kube-fence" } else { super::PLUGIN_EXECUTABLE };
    let mut command = super::command(executable);
    let mut out = Vec::new();
    let shell = match shell {
        Shell::Bash => clap_complete::Shell::Bash,
        Shell::Zsh => clap_complete::Shell::Zsh,
        Shell::Fish => clap_complete::Shell::Fish,
    };
    clap_complete::generate(shell, &mut command, executable, &mut out);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scripts_complete_the_subcommands_and_the_cluster_flags() {
        for shell in [Shell::Bash, Shell::Zsh, Shell::Fish] {
            // fish spells a long option `-l context`.
            let long = |name: &str| if shell == Shell::Fish { format!("-l {name}") } else { format!("--{name}") };
            for (invoked_as, executable) in [("kube-fence", "kube-fence"), ("kubectl fence", "kubectl-fence")] {
                let script = String::from_utf8(script(shell, invoked_as)).unwrap_or_default();
                let words = [
                    executable.to_string(),
                    "acquire".into(),
                    "status".into(),
                    long("context"),
                    long("kubeconfig"),
                    long("all-namespaces"),
                ];
                for word in words {
                    assert!(script.contains(&word), "{shell:?} as {invoked_as}: {word} in\n{script}");
                }
                if shell == Shell::Bash {
                    let registered = script.lines().rev().map(str::trim).find(|l| l.starts_with("complete ")).unwrap_or_default();
                    assert!(registered.ends_with(&format!(" {executable}")), "bash completes {executable}: {registered}");
                }
            }
        }
    }
}
