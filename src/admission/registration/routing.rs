//! The writer webhook (`crate::admission::judge::writer`), kept in step with the
//! FencedControllers: one ValidatingWebhookConfiguration, `<configuration>-writers`, with one
//! webhook, called at `/writer` with the client configuration (Service or URL, and CA bundle) of
//! kube-fence's own configuration, for every resource and subresource, cluster-scoped included.
//! Its match condition sends only the fenced ServiceAccounts' writes, by one membership test in a
//! set: every other write in the cluster costs the API server one lookup in that set and no call,
//! however many fences there are (1 or 1,000).
//!
//! The set ([`Routes`]) holds, as keys of one CEL map, each fenced username, and beside it what
//! that username's writes to pass unjudged: `<user> <group>/<resource>` for a resource every fence
//! of that user exempts, `<user> lease:<namespace>/<name>` for the fences' own Lease (campaigning;
//! the API server's fenced-holder policy judges those). Events and reviews that store nothing
//! are never sent.
//!
//! Bounded and isolated: a fence's size is bounded by its schema (8 ServiceAccounts, 32
//! exemptions), and the whole set by [`MAX_CONDITION_BYTES`]: fences are routed oldest first, and
//! one that would not fit is left out (its status says `NotRouted`) without touching the others.
//!
//! [`keep_in_step`] watches the FencedControllers and applies the configuration (server-side apply,
//! one field manager) once a burst of changes has settled ([`SETTLE`], at most [`MAX_DELAY`] after
//! the first), only when its content changed, and every [`RESYNC`] in any case (the CA bundle of
//! kube-fence's own configuration may rotate). Several replicas apply the same content from the
//! same FencedControllers.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::admissionregistration::v1::{
    MatchCondition, RuleWithOperations, ValidatingWebhook, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, ObjectMeta, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube_fence_api::FencedController;
use tokio::time::Instant;

use crate::admission::judge::fence::{Fence, FenceError};
use crate::admission::judge::writer::PATH;
use crate::admission::registration::scope::Scope;
use crate::telemetry::Chain;

/// How often the configuration is applied again without a change of the FencedControllers.
pub const RESYNC: Duration = Duration::from_secs(10);
/// How long the FencedControllers must stay unchanged before a change is applied (a burst of
/// creations is applied once).
pub const SETTLE: Duration = Duration::from_millis(200);
/// How long after the first change of a burst it is applied at the latest.
pub const MAX_DELAY: Duration = Duration::from_secs(2);
/// The largest match condition the routing registers: the API server stores the configuration
/// in etcd (at most 1.5 MiB an object) and compiles the condition on every change.
pub const MAX_CONDITION_BYTES: usize = 512 * 1024;
/// The suffix of the writers configuration's name.
pub const SUFFIX: &str = "-writers";
/// The name of the writer webhook.
pub const WEBHOOK_NAME: &str = "writers.kubefence.io";
/// The name of the writer webhook's match condition.
pub const CONDITION_NAME: &str = "fenced-writer";
const FIELD_MANAGER: &str = "kube-fence-writers";

/// The writers configuration that goes with kube-fence's configuration `configuration`.
pub fn configuration_name(configuration: &str) -> String {
    format!("{configuration}{SUFFIX}")
}

/// A CEL string literal.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// The keys of the routing set that one fence contributes for `user`: what passes unjudged.
fn passing(fence: &Fence, user: &str) -> BTreeSet<String> {
    let mut keys: BTreeSet<String> = fence.exempt.iter().map(|e| format!("{user} {}", e.key())).collect();
    keys.insert(format!("{user} lease:{}/{}", fence.namespace, fence.lease));
    keys
}

/// What the writer webhook routes: the fenced usernames and what passes for each, and which
/// fences are in it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Routes {
    /// The keys of the CEL map the match condition tests.
    keys: BTreeSet<String>,
    /// The fences routed (`namespace`, `name`).
    pub routed: BTreeSet<(String, String)>,
    /// The fences left out, with why.
    pub left_out: Vec<((String, String), RouteError)>,
}

/// Why a FencedController is not routed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error(transparent)]
    Invalid(#[from] FenceError),
    #[error("the writer webhook's match condition would exceed {MAX_CONDITION_BYTES} bytes with this fence (older fences fill it)")]
    Full,
}

impl Routes {
    /// The routes of `fences`, routed oldest first (by creation time, then namespace and name)
    /// while the condition stays within [`MAX_CONDITION_BYTES`] (pure).
    pub fn of<'f>(fences: impl IntoIterator<Item = &'f FencedController>) -> Routes {
        let mut ordered: Vec<&FencedController> = fences.into_iter().collect();
        let created = |f: &FencedController| f.metadata.creation_timestamp.clone().map(|Time(t)| t);
        ordered.sort_by(|a, b| {
            (created(a), &a.metadata.namespace, &a.metadata.name).cmp(&(created(b), &b.metadata.namespace, &b.metadata.name))
        });
        let mut routes = Routes::default();
        // Per username: what passes in every fence of it so far; and the condition's size.
        let mut passes: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut size = condition(&BTreeSet::new()).len();
        let user_size = |user: &str, passing: &BTreeSet<String>| entry_size(user) + passing.iter().map(|k| entry_size(k)).sum::<usize>();
        for fenced in ordered {
            let key = (fenced.metadata.namespace.clone().unwrap_or_default(), fenced.metadata.name.clone().unwrap_or_default());
            let fence = match Fence::of(fenced) {
                Ok(fence) => fence,
                Err(err) => {
                    routes.left_out.push((key, err.into()));
                    continue;
                }
            };
            let mut changed = Vec::new();
            let mut grown = size;
            for user in fence.usernames() {
                let mine = passing(&fence, &user);
                let (kept, before) = match passes.get(&user) {
                    Some(before) => (before.intersection(&mine).cloned().collect(), user_size(&user, before)),
                    None => (mine, 0),
                };
                grown = grown + user_size(&user, &kept) - before;
                changed.push((user, kept));
            }
            if grown > MAX_CONDITION_BYTES {
                routes.left_out.push((key, RouteError::Full));
                continue;
            }
            size = grown;
            passes.extend(changed);
            routes.routed.insert(key);
        }
        routes.keys = passes.into_iter().flat_map(|(user, passing)| std::iter::once(user).chain(passing)).collect();
        routes
    }

    /// Whether `username` is routed to the writer webhook.
    pub fn routes(&self, username: &str) -> bool {
        self.keys.contains(username)
    }

    /// The match condition (CEL, evaluated by the API server) that sends the writer webhook
    /// exactly the writes it judges: by a fenced username, not to what passes for it, not an
    /// Event, not a review that stores nothing. Written so that it cannot fail to evaluate (every
    /// field it reads is always in a request). `None` when nothing is routed.
    pub fn match_condition(&self) -> Option<String> {
        (!self.keys.is_empty()).then(|| condition(&self.keys))
    }
}

/// The bytes one key adds to the condition: `'key': true, `.
fn entry_size(key: &str) -> usize {
    quote(key).len() + ": true, ".len()
}

fn condition(keys: &BTreeSet<String>) -> String {
    let set: Vec<String> = keys.iter().map(|k| format!("{}: true", quote(k))).collect();
    format!(
        "cel.bind(fenced, {{{set}}}, \
         request.userInfo.username in fenced \
         && !((request.userInfo.username + ' ' + request.resource.group + '/' + request.resource.resource) in fenced) \
         && !(request.resource.group == 'coordination.k8s.io' && request.resource.resource == 'leases' \
              && (request.userInfo.username + ' lease:' + request.namespace + '/' + request.name) in fenced) \
         && !(request.resource.resource == 'events' && request.resource.group in ['', 'events.k8s.io']) \
         && !(request.resource.group in ['authentication.k8s.io', 'authorization.k8s.io']))",
        set = set.join(", "),
    )
}

/// Whether the configuration `applied` routes `username`'s writes (what a FencedController's
/// status reports as routed).
pub fn routes_in(applied: &ValidatingWebhookConfiguration, username: &str) -> bool {
    let key = format!("{}: true", quote(username));
    applied.webhooks.iter().flatten().filter(|w| w.name == WEBHOOK_NAME).flat_map(|w| w.match_conditions.iter().flatten()).any(|c| {
        // A key is preceded by `{` or `, ` in the set literal.
        c.expression.contains(&format!("{{{key}")) || c.expression.contains(&format!(", {key}"))
    })
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

/// The writers configuration that goes with `scope`'s configuration, for `routes`, calling
/// kube-fence as `template` (the client configuration of `scope`'s configuration) does, with
/// `scope`'s timeout (pure): what [`apply`] applies.
pub fn desired(scope: &Scope, template: &WebhookClientConfig, routes: &Routes) -> ValidatingWebhookConfiguration {
    configuration(&configuration_name(&scope.configuration_name), template, routes, scope.timeout_seconds)
}

/// The writers configuration for `routes`, calling kube-fence as `template` does (pure). Nothing
/// routed: a configuration with no webhooks.
pub fn configuration(
    name: &str,
    template: &WebhookClientConfig,
    routes: &Routes,
    timeout_seconds: i32,
) -> ValidatingWebhookConfiguration {
    let webhooks = routes
        .match_condition()
        .map(|expression| ValidatingWebhook {
            name: WEBHOOK_NAME.into(),
            client_config: client_config_at(template, PATH),
            rules: Some(vec![RuleWithOperations {
                api_groups: Some(vec!["*".into()]),
                api_versions: Some(vec!["*".into()]),
                resources: Some(vec!["*/*".into()]),
                operations: Some(vec!["CREATE".into(), "UPDATE".into(), "DELETE".into()]),
                scope: Some("*".into()),
            }]),
            match_conditions: Some(vec![MatchCondition { name: CONDITION_NAME.into(), expression }]),
            failure_policy: Some("Fail".into()),
            side_effects: "None".into(),
            match_policy: Some("Equivalent".into()),
            timeout_seconds: Some(timeout_seconds),
            admission_review_versions: vec!["v1".into()],
            namespace_selector: None,
            object_selector: None,
        })
        .into_iter()
        .collect();
    // Only the webhooks: the chart owns the object's labels (it creates the configuration, and
    // a field of two managers would make `helm upgrade` conflict).
    ValidatingWebhookConfiguration { metadata: ObjectMeta { name: Some(name.to_string()), ..Default::default() }, webhooks: Some(webhooks) }
}

/// The routes of those `fences` that are in `scope`'s namespaces (pure): what [`keep_in_step`]
/// registers.
pub fn routes_in_scope<'f>(scope: &Scope, fences: impl IntoIterator<Item = &'f FencedController>) -> Routes {
    Routes::of(fences.into_iter().filter(|f| scope.includes(f.metadata.namespace.as_deref().unwrap_or_default())))
}

/// Why the writers configuration could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum RoutingError {
    #[error("reading ValidatingWebhookConfiguration {0} (whose client configuration the writer webhook uses)")]
    ReadConfiguration(String, #[source] kube::Error),
    #[error("ValidatingWebhookConfiguration {0} has no webhook to take the client configuration from")]
    NoTemplate(String),
    #[error("applying ValidatingWebhookConfiguration {0}")]
    Apply(String, #[source] kube::Error),
}

/// Applies the writers configuration of `scope` for `routes` once.
pub async fn apply(client: &kube::Client, scope: &Scope, routes: &Routes) -> Result<(), RoutingError> {
    let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let main = &scope.configuration_name;
    let found = api.get(main).await.map_err(|e| RoutingError::ReadConfiguration(main.to_string(), e))?;
    let template = found
        .webhooks
        .and_then(|w| w.into_iter().next())
        .map(|w| w.client_config)
        .ok_or_else(|| RoutingError::NoTemplate(main.to_string()))?;
    let desired = desired(scope, &template, routes);
    let name = configuration_name(main);
    api.patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&desired))
        .await
        .map(|_| ())
        .map_err(|e| RoutingError::Apply(name, e))
}

/// Keeps `<configuration>-writers` of `scope` in step with the FencedControllers of `scope`'s
/// namespaces, until `shutdown` resolves. Errors are logged and retried at the next change or
/// resync: the configuration that was last applied keeps judging meanwhile (failing closed for
/// the writers it names).
pub async fn keep_in_step(client: kube::Client, scope: Scope, shutdown: impl std::future::Future<Output = ()>) {
    let api: Api<FencedController> = Api::all(client.clone());
    let stream = watcher(api, watcher::Config::default()).default_backoff();
    let mut stream = std::pin::pin!(stream);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut resync = tokio::time::interval(RESYNC);
    let mut last: Option<Routes> = None;
    // The FencedControllers by namespace and name, once the first list is in (`None` before).
    let mut fences: Option<BTreeMap<(String, String), FencedController>> = None;
    let mut listing = BTreeMap::new();
    // When the pending change is applied: SETTLE after the latest event, MAX_DELAY after the first.
    let mut due: Option<(Instant, Instant)> = None;
    let key = |f: &FencedController| (f.metadata.namespace.clone().unwrap_or_default(), f.metadata.name.clone().unwrap_or_default());
    loop {
        let deadline = due.map(|(settle, latest)| settle.min(latest));
        tokio::select! {
            _ = &mut shutdown => return,
            event = stream.next() => {
                match event {
                    Some(Ok(watcher::Event::Init)) => listing = BTreeMap::new(),
                    Some(Ok(watcher::Event::InitApply(f))) => { listing.insert(key(&f), f); }
                    Some(Ok(watcher::Event::InitDone)) => fences = Some(std::mem::take(&mut listing)),
                    Some(Ok(watcher::Event::Apply(f))) => { if let Some(known) = fences.as_mut() { known.insert(key(&f), f); } }
                    Some(Ok(watcher::Event::Delete(f))) => { if let Some(known) = fences.as_mut() { known.remove(&key(&f)); } }
                    Some(Err(err)) => { tracing::warn!(error = %Chain(&err), "watching FencedControllers"); continue }
                    None => return,
                }
                let now = Instant::now();
                due = Some((now + SETTLE, due.map_or(now + MAX_DELAY, |(_, latest)| latest)));
                continue;
            }
            _ = async { if let Some(at) = deadline { tokio::time::sleep_until(at).await } else { std::future::pending::<()>().await } } => { due = None; }
            _ = resync.tick() => { last = None; }
        }
        let Some(fences) = fences.as_ref() else { continue };
        let routes = routes_in_scope(&scope, fences.values());
        if last.as_ref() == Some(&routes) {
            continue;
        }
        for ((namespace, name), err) in &routes.left_out {
            tracing::warn!(namespace, name, error = %err, "the FencedController is not routed");
        }
        match apply(&client, &scope, &routes).await {
            Ok(()) => {
                if last.is_some() || !routes.routed.is_empty() {
                    tracing::info!(
                        configuration = configuration_name(&scope.configuration_name),
                        fences = routes.routed.len(),
                        "writer webhook in step"
                    );
                }
                last = Some(routes);
            }
            Err(err) => tracing::warn!(error = %Chain(&err), "keeping the writer webhook in step"),
        }
    }
}

#[cfg(test)]
mod tests;
