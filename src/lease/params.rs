//! The policy path's parameters (`--policy-path`, docs/design.md §9): in every namespace with
//! kube-fence Leases, the ConfigMap `kube-fence-tokens` maps each lease name to its newest
//! issued token (`status.token`). The API server's policy reads it to judge `presented <=
//! issued` (`crate::admission::policy_path`).
//!
//! The controller owns it, not the webhook: the controller is where tokens are issued, it runs
//! one active replica (leader election) where the webhook runs several, and it already watches
//! every Lease. It is a projection of what the watch shows: rebuilt from the store after every
//! change, written only when a namespace's map changed (a renewal changes nothing), with
//! server-side apply under one field manager, so keys of deleted leases go away. It can only lag
//! behind the truth, never lead it: every value was read from a status the controller wrote.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::{Api, ObjectMeta, Patch, PatchParams};
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::{self, Event};
use kube::{Client, ResourceExt};
use tokio_util::sync::CancellationToken;

use crate::admission::policy_path::PARAMS_NAME;
use crate::api::Lease;

const FIELD_MANAGER: &str = "kube-fence-tokens";
/// Back-off after a failed write of a namespace's parameters.
const RETRY: Duration = Duration::from_millis(500);

/// The parameters of `namespace` as `leases` show them: lease name → newest issued token (pure).
pub fn tokens_of<'l>(leases: impl IntoIterator<Item = &'l Lease>, namespace: &str) -> BTreeMap<String, String> {
    leases
        .into_iter()
        .filter(|l| l.namespace().as_deref() == Some(namespace))
        .filter_map(|l| Some((l.name_any(), l.status.as_ref()?.token?.to_string())))
        .collect()
}

/// Keeps the parameter ConfigMaps of `namespace` (or every namespace) until `stop`.
pub async fn maintain(client: Client, namespace: Option<String>, stop: CancellationToken) {
    let leases: Api<Lease> = match &namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    };
    let (store, writer) = reflector::store();
    let events = reflector::reflector(writer, watcher::watcher(leases, watcher::Config::default()).default_backoff());
    let mut events = std::pin::pin!(events);
    let mut written: HashMap<String, BTreeMap<String, String>> = HashMap::new();
    let mut dirty: BTreeSet<String> = BTreeSet::new();
    let mut synced = false;
    loop {
        let retry = async {
            if dirty.is_empty() || !synced {
                std::future::pending::<()>().await
            }
            tokio::time::sleep(RETRY).await
        };
        let event = tokio::select! {
            _ = stop.cancelled() => return,
            _ = retry => None,
            event = events.next() => match event {
                Some(event) => Some(event),
                None => return,
            },
        };
        // Take this event and every one already waiting, then write once per namespace.
        let mut next = event;
        while let Some(event) = next {
            match event {
                Ok(Event::Apply(lease) | Event::Delete(lease)) => dirty.extend(lease.namespace()),
                Ok(Event::InitDone) => {
                    synced = true;
                    dirty.extend(store.state().iter().filter_map(|l| l.namespace()));
                    dirty.extend(written.keys().cloned());
                }
                Ok(Event::Init | Event::InitApply(_)) => {}
                Err(err) => tracing::debug!(%err, "policy-path parameters: lease watch"),
            }
            next = events.next().now_or_never().flatten();
        }
        if synced {
            write_changed(&client, &store, &mut dirty, &mut written).await;
        }
    }
}

/// Writes the parameters of every dirty namespace whose map changed; keeps the failed ones dirty.
async fn write_changed(
    client: &Client,
    store: &Store<Lease>,
    dirty: &mut BTreeSet<String>,
    written: &mut HashMap<String, BTreeMap<String, String>>,
) {
    let leases = store.state();
    for ns in std::mem::take(dirty) {
        let tokens = tokens_of(leases.iter().map(|l| l.as_ref()), &ns);
        if written.get(&ns) == Some(&tokens) {
            continue;
        }
        let params = ConfigMap {
            metadata: ObjectMeta {
                name: Some(PARAMS_NAME.into()),
                namespace: Some(ns.clone()),
                labels: Some([("app.kubernetes.io/managed-by".to_string(), "kube-fence".to_string())].into()),
                ..ObjectMeta::default()
            },
            data: Some(tokens.clone()),
            ..ConfigMap::default()
        };
        let mut value = serde_json::to_value(&params).unwrap_or_default();
        value["apiVersion"] = "v1".into();
        value["kind"] = "ConfigMap".into();
        let api: Api<ConfigMap> = Api::namespaced(client.clone(), &ns);
        match api.patch(PARAMS_NAME, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&value)).await {
            Ok(_) => {
                tracing::debug!(namespace = %ns, leases = tokens.len(), "policy-path parameters written");
                written.insert(ns, tokens);
            }
            // A namespace being deleted refuses new objects; nothing there needs parameters.
            Err(kube::Error::Api(e)) if e.code == 404 || (e.code == 403 && e.message.contains("being terminated")) => {
                written.remove(&ns);
            }
            Err(err) => {
                tracing::warn!(namespace = %ns, %err, "writing the policy-path parameters; retrying");
                dirty.insert(ns);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{LeaseSpec, LeaseStatus};
    use crate::token::Token;

    fn lease(ns: &str, name: &str, token: Option<u64>) -> Lease {
        let mut l = Lease::new(name, LeaseSpec::default());
        l.metadata.namespace = Some(ns.into());
        l.status = token.map(|t| LeaseStatus { token: Token::new(t), ..LeaseStatus::default() });
        l
    }

    #[test]
    fn the_parameters_are_the_issued_tokens_of_the_namespace() {
        let leases = [lease("a", "x", Some(7)), lease("a", "y", None), lease("b", "z", Some(9)), lease("a", "w", Some(12))];
        let tokens = tokens_of(leases.iter(), "a");
        assert_eq!(tokens, BTreeMap::from([("x".to_string(), "7".to_string()), ("w".to_string(), "12".to_string())]));
        assert!(tokens_of(leases.iter(), "c").is_empty());
    }
}
