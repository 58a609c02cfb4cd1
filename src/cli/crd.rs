//! `kube-fence crd`: the CustomResourceDefinitions, generated from the Rust types.

use std::io::Write;

use super::error::Error;

/// Arguments of `kube-fence crd`.
#[derive(Debug, clap::Args)]
pub struct CrdArgs {}

pub(super) fn run(_: CrdArgs) -> Result<(), Error> {
    let yaml = kube_fence_api::crds_yaml().map_err(|e| Error::EncodeOutput { source: e.into() })?;
    std::io::stdout().lock().write_all(yaml.as_bytes())?;
    Ok(())
}
