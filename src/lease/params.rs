//! The policy path's parameters (`--policy-path`, docs/design.md §9): in every namespace with
//! kube-fence Leases, the `LeaseTokens` object `kube-fence-tokens` maps each lease name to its
//! newest issued token (`status.token`). The API server's policy reads it to judge `presented <=
//! issued` (`crate::admission::policy_path`).
//!
//! The controller owns it, not the webhook: the controller is where tokens are issued, it runs
//! one active replica (leader election) where the webhook runs several, and it already watches
//! every Lease. It reconciles the parameters completely, from two watches — the Leases and the
//! `LeaseTokens` themselves: in a namespace with Leases the object exists and its tokens are
//! exactly those of the Leases (keys of deleted leases removed, values equal to their tokens,
//! re-created when deleted, rewritten when anything else changed it); in a namespace without
//! Leases there is none. It writes only when what it observes differs from that ([`plan`]; a
//! renewal changes nothing), by server-side apply of the whole map (an atomic map: no key of
//! another writer survives the write). It can only lag behind the truth, never lead it: every
//! value was read from a status the controller wrote.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures::{FutureExt, StreamExt};
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, Preconditions};
use kube::runtime::WatchStreamExt;
use kube::runtime::reflector::{self, Store};
use kube::runtime::watcher::{self, Event};
use kube::{Client, Resource, ResourceExt};
use tokio_util::sync::CancellationToken;

use kube_fence_api::policy_path::PARAMS_NAME;
use kube_fence_api::token::Token;
use kube_fence_api::{Lease, LeaseTokens, LeaseTokensSpec};

const FIELD_MANAGER: &str = "kube-fence-tokens";
/// Back-off after a failed write of a namespace's parameters.
const RETRY: Duration = Duration::from_millis(500);

/// The parameters of `namespace` as `leases` show them: lease name → newest issued token (pure).
pub fn tokens_of<'l>(leases: impl IntoIterator<Item = &'l Lease>, namespace: &str) -> BTreeMap<String, Token> {
    leases
        .into_iter()
        .filter(|l| l.namespace().as_deref() == Some(namespace))
        .filter_map(|l| Some((l.name_any(), l.status.as_ref()?.token?)))
        .collect()
}

/// What a namespace's parameters need.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Write the object with exactly these tokens.
    Write(BTreeMap<String, Token>),
    /// Delete the object (the namespace has no Leases): the observed version, as a precondition.
    Delete { uid: Option<String>, resource_version: Option<String> },
}

/// What the parameters of `namespace` need, given every Lease and the parameter object observed
/// there (`None`: absent). Pure.
pub fn plan<'l>(leases: impl IntoIterator<Item = &'l Lease>, namespace: &str, observed: Option<&LeaseTokens>) -> Option<Step> {
    let leases: Vec<&Lease> = leases.into_iter().filter(|l| l.namespace().as_deref() == Some(namespace)).collect();
    match observed {
        _ if !leases.is_empty() => {
            let tokens = tokens_of(leases, namespace);
            (observed.map(|o| &o.spec.tokens) != Some(&tokens)).then_some(Step::Write(tokens))
        }
        Some(o) => Some(Step::Delete { uid: o.uid(), resource_version: o.resource_version() }),
        None => None,
    }
}

/// Which of the two watches.
#[derive(Clone, Copy)]
enum Watch {
    Leases,
    Params,
}

/// What one of the two watches saw, as far as reconciling goes.
enum Seen {
    /// An object of this namespace changed or went away.
    Changed(Option<String>),
    /// The watch (re-)listed everything.
    Listed(Watch),
    Nothing,
}

fn seen<K: Resource>(watch: Watch, event: Result<Event<K>, watcher::Error>) -> Seen {
    match event {
        Ok(Event::Apply(o) | Event::Delete(o)) => Seen::Changed(o.meta().namespace.clone()),
        Ok(Event::InitDone) => Seen::Listed(watch),
        Ok(Event::Init | Event::InitApply(_)) => Seen::Nothing,
        // E.g. the LeaseTokens CRD is not installed (`kubectl apply -f crds/`): nothing is
        // written until both watches have listed.
        Err(err) => {
            tracing::warn!(%err, "policy-path parameters: watch failed; retrying");
            Seen::Nothing
        }
    }
}

/// Keeps the parameters of `namespace` (or every namespace) until `stop`.
pub async fn maintain(client: Client, namespace: Option<String>, stop: CancellationToken) {
    let (leases, params): (Api<Lease>, Api<LeaseTokens>) = match &namespace {
        Some(ns) => (Api::namespaced(client.clone(), ns), Api::namespaced(client.clone(), ns)),
        None => (Api::all(client.clone()), Api::all(client.clone())),
    };
    let (lease_store, lease_writer) = reflector::store();
    let (params_store, params_writer) = reflector::store();
    let lease_events = reflector::reflector(lease_writer, watcher::watcher(leases, watcher::Config::default()).default_backoff());
    let params_events = reflector::reflector(params_writer, watcher::watcher(params, watcher::Config::default()).default_backoff());
    let events = futures::stream::select(lease_events.map(|e| seen(Watch::Leases, e)), params_events.map(|e| seen(Watch::Params, e)));
    let mut events = std::pin::pin!(events);
    let mut dirty: BTreeSet<String> = BTreeSet::new();
    // Both watches listed once: only then is "absent" known to mean absent.
    let (mut leases_synced, mut params_synced) = (false, false);
    loop {
        let synced = leases_synced && params_synced;
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
                Seen::Changed(namespace) => dirty.extend(namespace),
                // After a (re-)list, every namespace either store knows: what vanished meanwhile
                // is absent from one store and still present in the other.
                Seen::Listed(watch) => {
                    match watch {
                        Watch::Leases => leases_synced = true,
                        Watch::Params => params_synced = true,
                    }
                    dirty.extend(lease_store.state().iter().filter_map(|l| l.namespace()));
                    dirty.extend(params_store.state().iter().filter_map(|p| p.namespace()));
                }
                Seen::Nothing => {}
            }
            next = events.next().now_or_never().flatten();
        }
        if leases_synced && params_synced {
            reconcile(&client, &lease_store, &params_store, &mut dirty).await;
        }
    }
}

/// Brings the parameters of every dirty namespace to what its Leases say; keeps the failed ones
/// dirty.
async fn reconcile(client: &Client, leases: &Store<Lease>, params: &Store<LeaseTokens>, dirty: &mut BTreeSet<String>) {
    let all = leases.state();
    for ns in std::mem::take(dirty) {
        let observed = params.get(&reflector::ObjectRef::new(PARAMS_NAME).within(&ns));
        let Some(step) = plan(all.iter().map(|l| l.as_ref()), &ns, observed.as_deref()) else { continue };
        let api: Api<LeaseTokens> = Api::namespaced(client.clone(), &ns);
        let result = match &step {
            Step::Write(tokens) => {
                let mut object = LeaseTokens::new(PARAMS_NAME, LeaseTokensSpec { tokens: tokens.clone() });
                object.metadata = ObjectMeta {
                    name: Some(PARAMS_NAME.into()),
                    namespace: Some(ns.clone()),
                    labels: Some([("app.kubernetes.io/managed-by".to_string(), "kube-fence".to_string())].into()),
                    ..ObjectMeta::default()
                };
                let mut value = serde_json::to_value(&object).unwrap_or_default();
                value["apiVersion"] = LeaseTokens::api_version(&()).into();
                value["kind"] = LeaseTokens::kind(&()).into();
                api.patch(PARAMS_NAME, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&value)).await.map(|_| ())
            }
            Step::Delete { uid, resource_version } => {
                let preconditions = Preconditions { uid: uid.clone(), resource_version: resource_version.clone() };
                api.delete(PARAMS_NAME, &DeleteParams { preconditions: Some(preconditions), ..DeleteParams::default() }).await.map(|_| ())
            }
        };
        match result {
            Ok(()) => tracing::debug!(namespace = %ns, ?step, "policy-path parameters reconciled"),
            // Already gone; or a namespace being deleted, which refuses new objects and needs no
            // parameters.
            Err(kube::Error::Api(e)) if e.code == 404 || (e.code == 403 && e.message.contains("being terminated")) => {}
            // Changed since observed (a precondition failed): the watch brings the change.
            Err(kube::Error::Api(e)) if e.code == 409 => {}
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
    use kube_fence_api::{LeaseSpec, LeaseStatus};

    fn lease(ns: &str, name: &str, token: Option<u64>) -> Lease {
        let mut l = Lease::new(name, LeaseSpec::default());
        l.metadata.namespace = Some(ns.into());
        l.status = token.map(|t| LeaseStatus { token: Token::new(t), ..LeaseStatus::default() });
        l
    }

    fn tokens(pairs: &[(&str, u64)]) -> BTreeMap<String, Token> {
        pairs.iter().filter_map(|(k, v)| Some((k.to_string(), Token::new(*v)?))).collect()
    }

    fn params(ns: &str, pairs: &[(&str, u64)]) -> LeaseTokens {
        let mut p = LeaseTokens::new(PARAMS_NAME, LeaseTokensSpec { tokens: tokens(pairs) });
        p.metadata.namespace = Some(ns.into());
        p.metadata.uid = Some("u1".into());
        p.metadata.resource_version = Some("7".into());
        p
    }

    #[test]
    fn the_parameters_are_the_issued_tokens_of_the_namespace() {
        let leases = [lease("a", "x", Some(7)), lease("a", "y", None), lease("b", "z", Some(9)), lease("a", "w", Some(12))];
        assert_eq!(tokens_of(leases.iter(), "a"), tokens(&[("x", 7), ("w", 12)]));
        assert!(tokens_of(leases.iter(), "c").is_empty());
    }

    /// Each row: the Leases, what is observed in namespace `a`, and what it needs.
    #[test]
    fn the_parameters_are_reconciled_completely() {
        let leases = [lease("a", "x", Some(7)), lease("a", "y", None), lease("b", "z", Some(9))];
        let delete = Some(Step::Delete { uid: Some("u1".into()), resource_version: Some("7".into()) });
        let rows: [(&[Lease], Option<LeaseTokens>, Option<Step>); 8] = [
            // Leases, nothing observed: created.
            (&leases, None, Some(Step::Write(tokens(&[("x", 7)])))),
            // Exactly right: nothing to do (a renewal changes nothing).
            (&leases, Some(params("a", &[("x", 7)])), None),
            // A value that is not the lease's token, in either direction.
            (&leases, Some(params("a", &[("x", 6)])), Some(Step::Write(tokens(&[("x", 7)])))),
            (&leases, Some(params("a", &[("x", 9_223_372_036_854_775_807)])), Some(Step::Write(tokens(&[("x", 7)])))),
            // A key for a lease that does not exist (here or only elsewhere), or has issued none.
            (&leases, Some(params("a", &[("x", 7), ("ghost", 9_223_372_036_854_775_807)])), Some(Step::Write(tokens(&[("x", 7)])))),
            (&leases, Some(params("a", &[("x", 7), ("z", 9), ("y", 1)])), Some(Step::Write(tokens(&[("x", 7)])))),
            // No Leases in the namespace: none, whatever it says.
            (&leases[2..], Some(params("a", &[("ghost", 9_223_372_036_854_775_807)])), delete.clone()),
            (&[], None, None),
        ];
        for (i, (leases, observed, want)) in rows.into_iter().enumerate() {
            assert_eq!(plan(leases.iter(), "a", observed.as_ref()), want, "row {i}");
        }
        // Leases without any token yet: the object exists, empty (its fast-path writes are denied
        // as never issued, retried by the client, rather than failing for want of parameters).
        assert_eq!(plan([lease("a", "y", None)].iter(), "a", None), Some(Step::Write(BTreeMap::new())));
        assert_eq!(plan([lease("a", "y", None)].iter(), "a", Some(&params("a", &[]))), None);
    }
}
