//! The writer webhooks (`super::writer`), kept in step with the opted-in Leases: one
//! ValidatingWebhookConfiguration, `<configuration>-writers`, with one webhook per Lease that
//! carries `kubefence.io/holder-identity: Pod` and `kubefence.io/writers`. Each is called at
//! `/writer/<namespace>/<name>` with the client configuration (Service or URL, and CA bundle) of
//! kube-fence's own configuration, for every resource and subresource, cluster-scoped included,
//! and its match condition sends only the Lease's ServiceAccounts' writes: every other write in
//! the cluster costs the API server one CEL evaluation and no call.
//!
//! [`keep_in_step`] watches the opted-in Leases and re-applies the configuration (server-side
//! apply, one field manager) whenever they change, and every [`RESYNC`] in any case (the CA
//! bundle of kube-fence's own configuration may rotate). Several replicas apply the same content
//! from the same Leases. A Lease whose opt-in cannot be read ([`super::writer::OptInError`]) is
//! left out and logged.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::admissionregistration::v1::{
    MatchCondition, RuleWithOperations, ValidatingWebhook, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::api::coordination::v1::Lease as LeaderElectionLease;
use kube::api::{Api, ObjectMeta, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};

use crate::telemetry::Chain;

use kube_fence_api::names::HOLDER_IDENTITY_LABEL;

use crate::admission::registration::opt_in::OptIn;
use crate::admission::registration::scope::Scope;
use kube_fence_api::names::HOLDER_IS_POD;

/// How often the configuration is applied again without a change of the Leases.
pub const RESYNC: Duration = Duration::from_secs(10);
/// The suffix of the writers configuration's name.
pub const SUFFIX: &str = "-writers";
/// The name of the writer webhooks' match condition.
pub const CONDITION_NAME: &str = "opted-in-writer";
const FIELD_MANAGER: &str = "kube-fence-writers";

/// The writers configuration that goes with kube-fence's configuration `configuration`.
pub fn configuration_name(configuration: &str) -> String {
    format!("{configuration}{SUFFIX}")
}

/// The client configuration of `template` (kube-fence's own webhook), called at `path`.
fn client_config_at(template: &WebhookClientConfig, path: &str) -> WebhookClientConfig {
    let url = template.url.as_ref().map(|url| {
        // `https://host:port/validate` → `https://host:port<path>`.
        let authority_end = url.find("://").map(|i| i + 3).and_then(|start| url[start..].find('/').map(|j| start + j));
        format!("{}{path}", authority_end.map_or(url.as_str(), |end| &url[..end]))
    });
    let service = template.service.clone().map(|mut service| {
        service.path = Some(path.to_string());
        service
    });
    WebhookClientConfig { ca_bundle: template.ca_bundle.clone(), url, service }
}

/// The webhook's name in the configuration: `<lease>.<namespace>.writer.kubefence.io` (a
/// namespace has no dots, so the name is unique), or a digest when that is too long.
fn webhook_name(opt_in: &OptIn) -> String {
    let name = format!("{}.{}.writer.kubefence.io", opt_in.name, opt_in.namespace);
    if name.len() <= 253 {
        return name;
    }
    use std::hash::{Hash, Hasher};
    let mut hasher = std::collections::hash_map::DefaultHasher::new();
    (&opt_in.namespace, &opt_in.name).hash(&mut hasher);
    format!("{:016x}.writer.kubefence.io", hasher.finish())
}

/// The writers configuration that goes with `scope`'s configuration, for `opt_ins`, calling
/// kube-fence as `template` (the client configuration of `scope`'s configuration) does, each
/// webhook with `scope`'s timeout (pure): what [`apply`] applies.
pub fn desired(scope: &Scope, template: &WebhookClientConfig, opt_ins: &BTreeSet<OptIn>) -> ValidatingWebhookConfiguration {
    configuration(&configuration_name(&scope.configuration_name), template, opt_ins, scope.timeout_seconds)
}

/// The writers configuration for `opt_ins`, calling kube-fence as `template` does (pure). No
/// opt-ins: a configuration with no webhooks.
pub fn configuration(
    name: &str,
    template: &WebhookClientConfig,
    opt_ins: &BTreeSet<OptIn>,
    timeout_seconds: i32,
) -> ValidatingWebhookConfiguration {
    let webhooks = opt_ins
        .iter()
        .map(|opt_in| ValidatingWebhook {
            name: webhook_name(opt_in),
            client_config: client_config_at(template, &opt_in.path()),
            rules: Some(vec![RuleWithOperations {
                api_groups: Some(vec!["*".into()]),
                api_versions: Some(vec!["*".into()]),
                resources: Some(vec!["*/*".into()]),
                operations: Some(vec!["CREATE".into(), "UPDATE".into(), "DELETE".into()]),
                scope: Some("*".into()),
            }]),
            match_conditions: Some(vec![MatchCondition { name: CONDITION_NAME.into(), expression: opt_in.match_condition() }]),
            failure_policy: Some("Fail".into()),
            side_effects: "None".into(),
            match_policy: Some("Equivalent".into()),
            timeout_seconds: Some(timeout_seconds),
            admission_review_versions: vec!["v1".into()],
            namespace_selector: None,
            object_selector: None,
        })
        .collect();
    // Only the webhooks: the chart owns the object's labels (it creates the configuration, and
    // a field of two managers would make `helm upgrade` conflict).
    ValidatingWebhookConfiguration { metadata: ObjectMeta { name: Some(name.to_string()), ..Default::default() }, webhooks: Some(webhooks) }
}

/// The opt-ins of `leases`, and the Leases left out with why.
pub fn opt_ins<'l>(
    leases: impl IntoIterator<Item = &'l LeaderElectionLease>,
) -> (BTreeSet<OptIn>, Vec<(String, crate::admission::registration::opt_in::OptInError)>) {
    let mut found = BTreeSet::new();
    let mut refused = Vec::new();
    for lease in leases {
        match OptIn::of(lease) {
            Ok(Some(opt_in)) => {
                found.insert(opt_in);
            }
            Ok(None) => {}
            Err(err) => refused.push((
                format!("{}/{}", lease.metadata.namespace.as_deref().unwrap_or(""), lease.metadata.name.as_deref().unwrap_or("")),
                err,
            )),
        }
    }
    (found, refused)
}

/// The opt-ins of those `leases` that are in `scope`'s namespaces, and the Leases left out with
/// why (pure): what [`keep_in_step`] registers writer webhooks for.
pub fn opt_ins_in<'l>(
    scope: &Scope,
    leases: impl IntoIterator<Item = &'l LeaderElectionLease>,
) -> (BTreeSet<OptIn>, Vec<(String, crate::admission::registration::opt_in::OptInError)>) {
    opt_ins(leases.into_iter().filter(|lease| scope.includes(lease.metadata.namespace.as_deref().unwrap_or_default())))
}

/// Why the writers configuration could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum RoutingError {
    #[error("reading ValidatingWebhookConfiguration {0} (whose client configuration the writer webhooks use)")]
    ReadConfiguration(String, #[source] kube::Error),
    #[error("ValidatingWebhookConfiguration {0} has no webhook to take the client configuration from")]
    NoTemplate(String),
    #[error("applying ValidatingWebhookConfiguration {0}")]
    Apply(String, #[source] kube::Error),
}

/// Applies the writers configuration of `scope` for `opt_ins` once.
pub async fn apply(client: &kube::Client, scope: &Scope, opt_ins: &BTreeSet<OptIn>) -> Result<(), RoutingError> {
    let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let main = &scope.configuration_name;
    let found = api.get(main).await.map_err(|e| RoutingError::ReadConfiguration(main.to_string(), e))?;
    let template = found
        .webhooks
        .and_then(|w| w.into_iter().next())
        .map(|w| w.client_config)
        .ok_or_else(|| RoutingError::NoTemplate(main.to_string()))?;
    let desired = desired(scope, &template, opt_ins);
    let name = configuration_name(main);
    api.patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&desired))
        .await
        .map(|_| ())
        .map_err(|e| RoutingError::Apply(name, e))
}

/// Keeps `<configuration>-writers` of `scope` in step with the opted-in Leases of `scope`'s
/// namespaces, its webhooks with `scope`'s timeout, until `shutdown` resolves. Errors are logged
/// and retried at the next change or resync: the configuration that was last applied keeps
/// judging meanwhile (failing closed for the writers it names).
pub async fn keep_in_step(client: kube::Client, scope: Scope, shutdown: impl std::future::Future<Output = ()>) {
    let api: Api<LeaderElectionLease> = Api::all(client.clone());
    let selector = format!("{HOLDER_IDENTITY_LABEL}={HOLDER_IS_POD}");
    let stream = watcher(api, watcher::Config::default().labels(&selector)).default_backoff();
    let mut stream = std::pin::pin!(stream);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut resync = tokio::time::interval(RESYNC);
    let mut last: Option<BTreeSet<OptIn>> = None;
    // The opted-in Leases by namespace and name, once the first list is in (`None` before).
    let mut leases: Option<BTreeMap<(String, String), LeaderElectionLease>> = None;
    let mut listing = BTreeMap::new();
    let key = |l: &LeaderElectionLease| (l.metadata.namespace.clone().unwrap_or_default(), l.metadata.name.clone().unwrap_or_default());
    loop {
        tokio::select! {
            _ = &mut shutdown => return,
            event = stream.next() => match event {
                Some(Ok(watcher::Event::Init)) => listing = BTreeMap::new(),
                Some(Ok(watcher::Event::InitApply(lease))) => { listing.insert(key(&lease), lease); }
                Some(Ok(watcher::Event::InitDone)) => leases = Some(std::mem::take(&mut listing)),
                Some(Ok(watcher::Event::Apply(lease))) => { if let Some(known) = leases.as_mut() { known.insert(key(&lease), lease); } }
                Some(Ok(watcher::Event::Delete(lease))) => { if let Some(known) = leases.as_mut() { known.remove(&key(&lease)); } }
                Some(Err(err)) => { tracing::warn!(error = %Chain(&err), "watching opted-in leader-election Leases"); continue }
                None => return,
            },
            _ = resync.tick() => { last = None; }
        }
        let Some(leases) = leases.as_ref() else { continue };
        let (found, refused) = opt_ins_in(&scope, leases.values());
        if last.as_ref() == Some(&found) {
            continue;
        }
        for (lease, err) in &refused {
            tracing::warn!(lease, error = %err, "the Lease's writer opt-in is not registered");
        }
        match apply(&client, &scope, &found).await {
            Ok(()) => {
                if last.is_some() || !found.is_empty() {
                    tracing::info!(
                        configuration = configuration_name(&scope.configuration_name),
                        writers = found.len(),
                        "writer webhooks in step"
                    );
                }
                last = Some(found);
            }
            Err(err) => tracing::warn!(error = %Chain(&err), "keeping the writer webhooks in step"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::admissionregistration::v1::ServiceReference;

    fn opt_in(namespace: &str, name: &str) -> OptIn {
        OptIn { namespace: namespace.into(), name: name.into(), accounts: ["ctl".to_string()].into(), exempt: BTreeSet::new() }
    }

    #[test]
    fn each_opt_in_gets_a_webhook_at_its_own_path_with_the_main_client_configuration() {
        let url = WebhookClientConfig { url: Some("https://127.0.0.1:8443/validate".into()), ca_bundle: None, service: None };
        let service = WebhookClientConfig {
            url: None,
            ca_bundle: Some(k8s_openapi::ByteString(b"CA".to_vec())),
            service: Some(ServiceReference {
                namespace: "kf".into(),
                name: "kube-fence".into(),
                path: Some("/validate".into()),
                port: Some(443),
            }),
        };
        let opt_ins: BTreeSet<OptIn> = [opt_in("team", "ctl"), opt_in("ops", "op.lease")].into();
        let by_url = configuration("kf-writers", &url, &opt_ins, 5);
        let hooks = by_url.webhooks.unwrap_or_default();
        assert_eq!(hooks.len(), 2);
        assert_eq!(hooks[0].name, "op.lease.ops.writer.kubefence.io");
        assert_eq!(hooks[0].client_config.url.as_deref(), Some("https://127.0.0.1:8443/writer/ops/op.lease"));
        assert_eq!(hooks[1].client_config.url.as_deref(), Some("https://127.0.0.1:8443/writer/team/ctl"));
        let rule = &hooks[1].rules.as_ref().unwrap()[0];
        assert_eq!(rule.scope.as_deref(), Some("*"), "cluster-scoped objects too");
        assert_eq!(rule.resources.as_deref(), Some(&["*/*".to_string()][..]), "every subresource too");
        assert_eq!(hooks[1].failure_policy.as_deref(), Some("Fail"));
        assert!(hooks[1].namespace_selector.is_none() && hooks[1].object_selector.is_none());
        let by_service = configuration("kf-writers", &service, &opt_ins, 5).webhooks.unwrap_or_default();
        let svc = by_service[1].client_config.service.as_ref().unwrap();
        assert_eq!((svc.name.as_str(), svc.path.as_deref()), ("kube-fence", Some("/writer/team/ctl")));
        assert_eq!(by_service[1].client_config.ca_bundle, service.ca_bundle);
        assert_eq!(configuration("kf-writers", &url, &BTreeSet::new(), 5).webhooks.map(|w| w.len()), Some(0));
    }

    /// An opted-in leader-election Lease `namespace/name` whose writer is ServiceAccount `ctl`.
    fn lease(namespace: &str, name: &str) -> LeaderElectionLease {
        LeaderElectionLease {
            metadata: ObjectMeta {
                namespace: Some(namespace.into()),
                name: Some(name.into()),
                labels: Some([(HOLDER_IDENTITY_LABEL.to_string(), HOLDER_IS_POD.to_string())].into()),
                annotations: Some([(kube_fence_api::names::WRITERS_ANNOTATION.to_string(), "ctl".to_string())].into()),
                ..Default::default()
            },
            spec: None,
        }
    }

    #[test]
    fn the_scope_names_the_configuration_sets_the_timeout_and_picks_the_leases() {
        let template = WebhookClientConfig { url: Some("https://127.0.0.1:8443/validate".into()), ca_bundle: None, service: None };
        let leases = [lease("team", "ctl"), lease("other", "ctl")];
        let scope = Scope { configuration_name: "kf".into(), timeout_seconds: 9, only_namespaces: Some(vec!["team".into()]) };
        let (found, refused) = opt_ins_in(&scope, &leases);
        assert!(refused.is_empty(), "{refused:?}");
        let routed = desired(&scope, &template, &found);
        assert_eq!(routed.metadata.name.as_deref(), Some("kf-writers"));
        let hooks = routed.webhooks.unwrap_or_default();
        assert_eq!(hooks.iter().map(|h| h.name.as_str()).collect::<Vec<_>>(), ["ctl.team.writer.kubefence.io"]);
        assert_eq!(hooks[0].timeout_seconds, Some(9));
        // Every namespace: both Leases.
        let everywhere = Scope { only_namespaces: None, ..scope };
        assert_eq!(opt_ins_in(&everywhere, &leases).0.len(), 2);
    }

    #[test]
    fn a_long_name_is_replaced_by_a_digest() {
        let long = opt_in("team", &"l".repeat(250));
        assert!(webhook_name(&long).len() <= 253 && webhook_name(&long).ends_with(".writer.kubefence.io"));
    }
}
