//! `kube-fence chart-templates`: the Helm chart's webhook configurations and policies, rendered
//! from the objects local mode registers (`admission::registration::chart`).

use std::path::PathBuf;

use super::error::Error;
use crate::admission::registration::chart;

/// Arguments of `kube-fence chart-templates`.
#[derive(Debug, clap::Args)]
pub struct ChartTemplatesArgs {
    /// The chart's templates directory the files are written into.
    #[arg(default_value = "charts/kube-fence/templates")]
    pub dir: PathBuf,
}

pub(super) fn run(args: ChartTemplatesArgs) -> Result<(), Error> {
    let templates = chart::templates().map_err(|e| Error::EncodeOutput { source: e.into() })?;
    for template in templates {
        let path = args.dir.join(template.file);
        std::fs::write(&path, template.content).map_err(|source| Error::WriteFile { path, source })?;
    }
    Ok(())
}
