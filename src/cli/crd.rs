use std::io::Write;
use std::process::ExitCode;

/// Arguments of `kube-fence crd`.
#[derive(Debug, clap::Args)]
pub struct CrdArgs {}

pub fn run(_: CrdArgs) -> anyhow::Result<ExitCode> {
    let yaml = crate::api::crds_yaml()?;
    std::io::stdout().lock().write_all(yaml.as_bytes())?;
    Ok(ExitCode::SUCCESS)
}
