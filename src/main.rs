//! The `kube-fence` binary (also usable as the kubectl plugin `kubectl-fence`).
//! Everything lives in the library; this only parses arguments and reports errors.

use clap::Parser;

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = kube_fence::cli::Cli::parse();
    match kube_fence::cli::run(cli).await {
        Ok(code) => code,
        Err(err) => {
            eprintln!("kube-fence: error: {err:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
