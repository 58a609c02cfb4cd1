//! The `kube-fence` binary (also usable as the kubectl plugin `kubectl-fence`).
//! Everything lives in the library; this only parses arguments and reports errors: one line,
//! and the exit status `kube-fence --help` documents.

use std::process::ExitCode;

use clap::error::ErrorKind;
use kube_fence::cli::completion::{KUBECTL_COMPLETE_EXECUTABLE, kubectl_complete};
use kube_fence::cli::{parse_from, run, usage_error};

/// Gives the free pages of glibc's arenas back to the system (after a burst of connections).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn release_free_memory() {
    // SAFETY: malloc_trim only walks the allocator's own free lists; any thread may call it.
    unsafe {
        libc::malloc_trim(0);
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    kube_fence::admission::http::bounds::set_memory_release(release_free_memory);
    // Linked as kubectl_complete-fence, kubectl runs it to complete `kubectl fence ...`.
    let argv0 = std::env::args_os().next().map(std::path::PathBuf::from);
    if argv0.as_deref().and_then(|p| p.file_name()).is_some_and(|n| n == KUBECTL_COMPLETE_EXECUTABLE) {
        let words: Vec<String> = std::env::args_os().skip(1).map(|w| w.to_string_lossy().into_owned()).collect();
        print!("{}", kubectl_complete(&words));
        return ExitCode::SUCCESS;
    }
    // Named as invoked: as the kubectl plugin `kubectl-fence`, help and usage say `kubectl fence`.
    let cli = match parse_from(std::env::args_os()) {
        Ok(cli) => cli,
        Err(err)
            if matches!(
                err.kind(),
                ErrorKind::DisplayHelp | ErrorKind::DisplayVersion | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) =>
        {
            err.exit()
        }
        Err(err) => {
            let err = usage_error(&err);
            eprintln!("kube-fence: error: {err}");
            return err.exit().into();
        }
    };
    let verbose = cli.verbose;
    match run(cli).await {
        Ok(status) => ExitCode::from(status),
        Err(err) => {
            if verbose {
                eprintln!("kube-fence: error: {}", err.verbose());
            } else {
                eprintln!("kube-fence: error: {err}");
            }
            err.exit().into()
        }
    }
}
