//! `kube-fence delegate -f MANIFEST`: hands a grant down to what a holder starts.
//!
//! Reads manifests (YAML or JSON, several documents, `kind: List`), stamps each with the grant —
//! the annotation `kubefence.io/delegated-grant` and, on a Pod, a Job, a CronJob or any workload
//! with a Pod template, the template's annotation and the `KUBE_FENCE_GRANT` variable on every
//! container (downward API) — and prints them, for `kubectl create -f -`:
//!
//! ```sh
//! TOKEN=$(kube-fence lease acquire jobs --holder "$HOSTNAME" -n work)
//! kube-fence delegate --lease jobs --token "$TOKEN" -n work -f job.yaml | kubectl create -n work -f -
//! ```
//!
//! In a Pod started that way, `kube-fence patch` and `kube-fence delete` write with the delegated
//! grant when given no `--lease`/`--token`, and `kube-fence delegate` hands it down again.

use std::io::{Read, Write};
use std::path::PathBuf;

use super::cluster::ClusterArgs;
use super::error::Error;
use super::grant::GrantArgs;
use crate::client::stamp_delegation;

/// Arguments of `kube-fence delegate`.
#[derive(Debug, clap::Args)]
pub struct DelegateArgs {
    /// The manifests to stamp, YAML or JSON; `-` reads stdin.
    #[arg(short = 'f', long = "filename")]
    pub file: PathBuf,
    /// Namespace of the lease (default: the kubeconfig context's, or the delegated grant's).
    #[arg(short = 'n', long, env = "KUBE_FENCE_NAMESPACE")]
    pub namespace: Option<String>,
    #[command(flatten)]
    pub grant: GrantArgs,
}

pub async fn run(args: DelegateArgs, at: &ClusterArgs) -> Result<(), Error> {
    // The kubeconfig's namespace only when a namespace is needed and not given: nothing is sent.
    let default_namespace = match (&args.namespace, &args.grant.lease) {
        (None, Some(_)) => at.config().await.map(|c| c.default_namespace).unwrap_or_else(|_| "default".into()),
        _ => "default".into(),
    };
    let Some((grant, _)) = args.grant.resolve(args.namespace.as_deref(), &default_namespace)? else {
        return Err(Error::NoGrant);
    };
    let text = read(&args.file)?;
    let stamped = stamp_manifests(&text, &grant.to_string()).map_err(|why| Error::ParseManifest { path: args.file.clone(), why })?;
    std::io::stdout().lock().write_all(stamped.as_bytes())?;
    Ok(())
}

fn read(path: &PathBuf) -> Result<String, Error> {
    let mut text = String::new();
    let read = if path.as_os_str() == "-" {
        std::io::stdin().read_to_string(&mut text).map(|_| ())
    } else {
        std::fs::read_to_string(path).map(|t| text = t)
    };
    read.map_err(|source| Error::ReadManifest { path: path.clone(), source })?;
    Ok(text)
}

/// Every document of `text` stamped with `grant`, as YAML documents. Pure.
pub fn stamp_manifests(text: &str, grant: &str) -> Result<String, String> {
    let mut out = String::new();
    let mut count = 0;
    // Empty documents (a trailing `---`) are skipped.
    let documents: Vec<serde_json::Value> =
        serde_saphyr::from_str_multiple(text).map_err(|e| format!("not YAML: {}", super::error::one_line(&e.to_string())))?;
    for (i, mut value) in documents.into_iter().enumerate() {
        if value.is_null() {
            continue;
        }
        let stamp = |v: &mut serde_json::Value| stamp_delegation(v, grant).map_err(|e| format!("document {}: {e}", i + 1));
        if value.get("kind").and_then(|k| k.as_str()).is_some_and(|k| k.ends_with("List")) {
            for item in value.get_mut("items").and_then(|items| items.as_array_mut()).into_iter().flatten() {
                stamp(item)?;
            }
        } else {
            stamp(&mut value)?;
        }
        out.push_str("---\n");
        out.push_str(&serde_saphyr::to_string(&value).map_err(|e| format!("document {}: {e}", i + 1))?);
        count += 1;
    }
    if count == 0 {
        return Err("it holds no object".to_string());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_document_and_list_item_is_stamped_and_bad_input_is_named() {
        let text = "apiVersion: v1\nkind: Pod\nmetadata: {name: p}\nspec: {containers: [{name: c, image: c}]}\n---\n\
                    apiVersion: v1\nkind: List\nitems:\n- {apiVersion: v1, kind: ConfigMap, metadata: {name: item}}\n---\n";
        let out = stamp_manifests(text, "work/jobs:3").unwrap_or_default();
        let docs: Vec<serde_json::Value> = serde_saphyr::from_str_multiple(&out).unwrap_or_default();
        assert_eq!(docs.len(), 2, "{out}");
        assert_eq!(docs[0]["metadata"]["annotations"]["kubefence.io/delegated-grant"], "work/jobs:3");
        assert_eq!(docs[0]["spec"]["containers"][0]["env"][0]["name"], "KUBE_FENCE_GRANT");
        assert_eq!(docs[1]["items"][0]["metadata"]["annotations"]["kubefence.io/delegated-grant"], "work/jobs:3");
        assert!(docs[1]["metadata"].is_null(), "the List itself carries nothing");
        assert_eq!(stamp_manifests("", "work/jobs:3"), Err("it holds no object".into()));
        assert!(stamp_manifests("- 1\n", "work/jobs:3").is_err_and(|e| e.contains("document 1")));
        assert!(stamp_manifests("a: [", "work/jobs:3").is_err_and(|e| e.starts_with("not YAML: ") && !e.contains('\n')), "one line");
    }
}
