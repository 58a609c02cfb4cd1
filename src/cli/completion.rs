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

/// The executable kubectl (1.26 and later) runs to complete `kubectl fence ...`: a link to this
/// binary by that name on the PATH.
pub const KUBECTL_COMPLETE_EXECUTABLE: &str = "kubectl_complete-fence";

/// What kubectl's completion asks of `kubectl_complete-fence WORD... PARTIAL` (the words after
/// `fence`, the last one being completed, maybe empty): the candidates, one a line, then cobra's
/// directive — `:4` (no file names) or `:0` (let the shell complete a file name, for an option
/// that takes a path).
pub fn kubectl_complete(words: &[String]) -> String {
    let root = super::command("kubectl fence");
    let (partial, before) = words.split_last().map(|(p, b)| (p.as_str(), b)).unwrap_or(("", &[]));
    // The subcommand the words name so far, and the options it takes (its own and global ones).
    let mut path = vec![&root];
    for word in before {
        let current = path[path.len() - 1];
        if let Some(sub) = current.get_subcommands().find(|s| s.get_name() == word.as_str()) {
            path.push(sub);
        }
    }
    let current = path[path.len() - 1];
    let depth = path.len();
    let options: Vec<&clap::Arg> = path
        .iter()
        .enumerate()
        .flat_map(|(i, cmd)| cmd.get_arguments().filter(move |a| i + 1 == depth || a.is_global_set()))
        .filter(|a| !a.is_positional() && !a.is_hide_set())
        .collect();
    let takes_value = |arg: &&clap::Arg| arg.get_action().takes_values();
    // The word before is an option that takes a value: complete that value.
    let previous = before.last().map(String::as_str).unwrap_or_default();
    let valued = options.iter().find(|a| {
        takes_value(a)
            && (a.get_long().is_some_and(|l| previous == format!("--{l}")) || a.get_short().is_some_and(|s| previous == format!("-{s}")))
    });
    let (candidates, directive): (Vec<String>, u8) = match valued {
        Some(arg) => {
            let values: Vec<String> =
                arg.get_possible_values().iter().filter(|v| !v.is_hide_set()).map(|v| v.get_name().to_string()).collect();
            let paths = matches!(arg.get_value_hint(), clap::ValueHint::FilePath | clap::ValueHint::AnyPath | clap::ValueHint::DirPath)
                || arg.get_value_names().is_some_and(|n| n.iter().any(|n| n.as_str() == "FILE"));
            (values, if paths { 0 } else { 4 })
        }
        None if partial.starts_with('-') => {
            let mut flags: Vec<String> = options.iter().filter_map(|a| a.get_long().map(|l| format!("--{l}"))).collect();
            flags.extend(["--help".to_string()]);
            (flags, 4)
        }
        None => (current.get_subcommands().filter(|s| !s.is_hide_set()).map(|s| s.get_name().to_string()).collect(), 4),
    };
    let mut out: String = candidates.iter().filter(|c| c.starts_with(partial)).map(|c| format!("{c}\n")).collect();
    out.push_str(&format!(":{directive}\n"));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kubectl_completes_subcommands_options_and_their_values() {
        let complete = |words: &[&str]| kubectl_complete(&words.iter().map(|w| w.to_string()).collect::<Vec<_>>());
        assert_eq!(complete(&["le"]), "lease\n:4\n");
        assert_eq!(complete(&["lease", "ac"]), "acquire\n:4\n");
        assert_eq!(complete(&["status", "--con"]), "--context\n:4\n");
        assert_eq!(complete(&["status", "-o", ""]), "table\nwide\njson\n:4\n");
        assert_eq!(complete(&["--kubeconfig", ""]), ":0\n", "a path: the shell completes file names");
        assert!(complete(&["lease", "run", "--gr"]).starts_with("--grace-period\n"));
        assert!(complete(&[""]).contains("status\n") && !complete(&[""]).contains("--"), "subcommands, no options, for an empty word");
    }

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
