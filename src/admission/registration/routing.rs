//! The writer webhook (`crate::admission::judge::writer`), kept in step with the
//! FencedControllers: one ValidatingWebhookConfiguration, `<configuration>-writers`, with one
//! webhook, called at `/writer` with the client configuration (Service or URL, and CA bundle) of
//! kube-fence's own configuration, for every resource and subresource, cluster-scoped included.
//! Its match condition sends only the fenced ServiceAccounts' writes, by one membership test in a
//! set: a write by anyone but a ServiceAccount costs one string comparison, and any other write
//! one lookup in the set and no call, however many fences there are.
//!
//! The set ([`Routes`]) is one CEL map from each fenced ServiceAccount (`<namespace>:<name>`) to
//! what its writes to pass unjudged: `<group>/<resource>` for a resource every fence of it
//! exempts, `lease:<namespace>/<name>` for the fences' own Lease (campaigning; the API server's
//! fenced-holder policy judges those). Events and reviews that store nothing are never sent. CEL
//! in a match condition has no `let` (`cel.bind` is not offered there), so the map is bound once
//! by a one-element comprehension (`[{…}].exists(fenced, …)`).
//!
//! Bounded and isolated: the API server compiles at most [`MAX_EXPRESSION_CODE_POINTS`] code
//! points per expression, so the set is split over at most [`MAX_SHARDS`] webhooks of at most
//! [`SHARD_BYTES`] each. A fence's size is bounded by its schema (8 ServiceAccounts, 32
//! exemptions); fences are routed oldest first, and one that would not fit is left out (its
//! status says `NotRouted`) without touching the others.
//!
//! [`keep_in_step`] watches the FencedControllers and, once a burst of changes has settled
//! ([`SETTLE`], at most [`MAX_DELAY`] after the first) and every [`RESYNC`] in any case (the CA
//! bundle of kube-fence's own configuration may rotate), lists them by a consistent read and
//! applies the configuration for that list (server-side apply, one field manager).
//!
//! Monotonic across replicas: the configuration records the revision of the list it was made
//! from ([`REVISION_ANNOTATION`]), and a replica applies only a list at least as new, with the
//! configuration's `resourceVersion` as a precondition. So a replica whose view is older (its
//! watch lagging, its apply delayed past another's) never puts an older set of fences back: a new
//! fence, once routed, stays routed, and a deleted one stays gone (docs/design.md §10a).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use futures::StreamExt;
use k8s_openapi::api::admissionregistration::v1::{
    MatchCondition, RuleWithOperations, ValidatingWebhook, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::api::{Api, ListParams, ObjectMeta, Patch, PatchParams};
use kube::runtime::{WatchStreamExt, watcher};
use kube_fence_api::FencedController;
use tokio::time::Instant;

use crate::admission::judge::facts::SERVICE_ACCOUNT_PREFIX;
use crate::admission::judge::fence::{Fence, FenceError, ResourceName};
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
/// The longest expression the API server compiles (its CEL parser's limit).
pub const MAX_EXPRESSION_CODE_POINTS: usize = 100_000;
/// The most bytes of set one webhook's match condition carries (the rest of the condition fits
/// in what is left of [`MAX_EXPRESSION_CODE_POINTS`]).
pub const SHARD_BYTES: usize = 95_000;
/// The most webhooks the set is split over: every write of a ServiceAccount evaluates each.
pub const MAX_SHARDS: usize = 8;
/// The largest entry one ServiceAccount takes in the set: its name and 32 exemptions and a
/// Lease, each at most a qualified name (what a shard may leave unused at its end).
const MAX_ENTRY_BYTES: usize = 10_000;
/// The most bytes of set routed in all.
pub const MAX_SET_BYTES: usize = MAX_SHARDS * (SHARD_BYTES - MAX_ENTRY_BYTES);
/// The suffix of the writers configuration's name.
pub const SUFFIX: &str = "-writers";
/// The name of the writer webhook (of its first shard; the others are `writers-<n>.kubefence.io`).
pub const WEBHOOK_NAME: &str = "writers.kubefence.io";
/// The name of the writer webhook's match condition.
pub const CONDITION_NAME: &str = "fenced-writer";
const FIELD_MANAGER: &str = "kube-fence-writers";
/// The writers configuration's annotation that records the revision (the list's
/// `resourceVersion`) of the FencedControllers it was made from.
pub const REVISION_ANNOTATION: &str = "kubefence.io/fences-revision";

/// The writers configuration that goes with kube-fence's configuration `configuration`.
pub fn configuration_name(configuration: &str) -> String {
    format!("{configuration}{SUFFIX}")
}

/// A CEL string literal.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// What one fence lets pass unjudged, as the set names it.
fn passing(fence: &Fence) -> BTreeSet<String> {
    let mut keys: BTreeSet<String> = fence.exempt.iter().map(ResourceName::key).collect();
    keys.insert(format!("lease:{}/{}", fence.namespace, fence.lease));
    keys
}

/// The set's key for a ServiceAccount's username (`None`: not a ServiceAccount).
fn account_key(username: &str) -> Option<&str> {
    username.strip_prefix(SERVICE_ACCOUNT_PREFIX)
}

/// What the writer webhook routes: the fenced usernames and what passes for each, and which
/// fences are in it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Routes {
    /// The CEL map the match condition tests: `<namespace>:<account>` → what passes.
    accounts: BTreeMap<String, BTreeSet<String>>,
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
    #[error("the writer webhooks' set would exceed {MAX_SET_BYTES} bytes with this fence (older fences fill it)")]
    Full,
}

impl Routes {
    /// The routes of `fences`, routed oldest first (by creation time, then namespace and name)
    /// while the condition stays within `MAX_CONDITION_BYTES` (pure).
    pub fn of<'f>(fences: impl IntoIterator<Item = &'f FencedController>) -> Routes {
        let mut ordered: Vec<&FencedController> = fences.into_iter().collect();
        let created = |f: &FencedController| f.metadata.creation_timestamp.clone().map(|Time(t)| t);
        ordered.sort_by(|a, b| {
            (created(a), &a.metadata.namespace, &a.metadata.name).cmp(&(created(b), &b.metadata.namespace, &b.metadata.name))
        });
        let mut routes = Routes::default();
        let mut size = 0;
        for fenced in ordered {
            let key = (fenced.metadata.namespace.clone().unwrap_or_default(), fenced.metadata.name.clone().unwrap_or_default());
            let fence = match Fence::of(fenced) {
                Ok(fence) => fence,
                Err(err) => {
                    routes.left_out.push((key, err.into()));
                    continue;
                }
            };
            let mine = passing(&fence);
            let mut changed = Vec::new();
            let mut grown = size;
            for username in fence.usernames() {
                let Some(account) = account_key(&username) else { continue };
                let (kept, before) = match routes.accounts.get(account) {
                    Some(before) => (before.intersection(&mine).cloned().collect(), entry_size(account, before)),
                    None => (mine.clone(), 0),
                };
                grown = grown + entry_size(account, &kept) - before;
                changed.push((account.to_string(), kept));
            }
            if grown > MAX_SET_BYTES {
                routes.left_out.push((key, RouteError::Full));
                continue;
            }
            size = grown;
            routes.accounts.extend(changed);
            routes.routed.insert(key);
        }
        routes
    }

    /// Whether `username` is routed to the writer webhook.
    pub fn routes(&self, username: &str) -> bool {
        account_key(username).is_some_and(|account| self.accounts.contains_key(account))
    }

    /// The match conditions (CEL, evaluated by the API server), one per webhook, that send the
    /// writer webhook exactly the writes it judges: by a fenced ServiceAccount, not to what passes
    /// for it, not an Event, not a review that stores nothing. Written so that they cannot fail
    /// to evaluate (every field they read is always in a request). None when nothing is routed.
    pub fn match_conditions(&self) -> Vec<String> {
        let mut shards = Vec::new();
        let mut shard: Vec<String> = Vec::new();
        let mut bytes = 0;
        for (account, passing) in &self.accounts {
            let entry = entry(account, passing);
            if bytes + entry.len() > SHARD_BYTES && !shard.is_empty() {
                shards.push(condition(&shard));
                (shard, bytes) = (Vec::new(), 0);
            }
            bytes += entry.len() + 2;
            shard.push(entry);
        }
        if !shard.is_empty() {
            shards.push(condition(&shard));
        }
        shards
    }
}

/// One entry of the set: `'<namespace>:<account>': ['<pass>', ...]`.
fn entry(account: &str, passing: &BTreeSet<String>) -> String {
    let passing: Vec<String> = passing.iter().map(|p| quote(p)).collect();
    format!("{}: [{}]", quote(account), passing.join(", "))
}

/// The bytes an entry takes in the set, its separator included.
fn entry_size(account: &str, passing: &BTreeSet<String>) -> usize {
    entry(account, passing).len() + 2
}

/// The match condition of one shard of the set.
fn condition(entries: &[String]) -> String {
    format!(
        "request.userInfo.username.startsWith('{SERVICE_ACCOUNT_PREFIX}') \
         && [request.userInfo.username.substring({prefix})].exists(account, [{{{set}}}].exists(fenced, account in fenced \
         && !((request.resource.group + '/' + request.resource.resource) in fenced[account]) \
         && !(request.resource.group == 'coordination.k8s.io' && request.resource.resource == 'leases' \
              && ('lease:' + request.namespace + '/' + request.name) in fenced[account]))) \
         && !(request.resource.resource == 'events' && request.resource.group in ['', 'events.k8s.io']) \
         && !(request.resource.group in ['authentication.k8s.io', 'authorization.k8s.io'])",
        prefix = SERVICE_ACCOUNT_PREFIX.len(),
        set = entries.join(", "),
    )
}

/// The name of shard `n`'s webhook.
fn webhook_name(n: usize) -> String {
    if n == 0 { WEBHOOK_NAME.to_string() } else { format!("writers-{n}.kubefence.io") }
}

/// Whether the configuration `applied` routes `username`'s writes (what a FencedController's
/// status reports as routed).
pub fn routes_in(applied: &ValidatingWebhookConfiguration, username: &str) -> bool {
    let Some(account) = account_key(username) else { return false };
    let key = format!("{}: [", quote(account));
    applied.webhooks.iter().flatten().flat_map(|w| w.match_conditions.iter().flatten()).any(|c| {
        // A key is preceded by `{` or `, ` in the set literal.
        c.name == CONDITION_NAME && (c.expression.contains(&format!("{{{key}")) || c.expression.contains(&format!(", {key}")))
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
pub fn configuration(name: &str, template: &WebhookClientConfig, routes: &Routes, timeout_seconds: i32) -> ValidatingWebhookConfiguration {
    let webhooks = routes
        .match_conditions()
        .into_iter()
        .enumerate()
        .map(|(n, expression)| ValidatingWebhook {
            name: webhook_name(n),
            client_config: client_config_at(template, PATH),
            rules: Some(vec![RuleWithOperations {
                api_groups: Some(vec!["*".into()]),
                api_versions: Some(vec!["*".into()]),
                resources: Some(vec!["*/*".into()]),
                // CONNECT too: `pods/exec`, `attach`, `portforward` and `proxy` act on what the
                // controller manages, and a follower must not.
                operations: Some(vec!["CREATE".into(), "UPDATE".into(), "DELETE".into(), "CONNECT".into()]),
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

/// The FencedControllers of a scope as one consistent read returned them: their routes, and the
/// revision the read was at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listed {
    pub routes: Routes,
    pub revision: u64,
}

/// What an [`apply`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Applied {
    /// The configuration now routes the list.
    InStep,
    /// The configuration records a newer list (`recorded`) than this one: left as it is.
    Superseded { recorded: u64 },
    /// Another replica changed the configuration between this one's read and its apply: nothing
    /// applied; list again.
    Raced,
    /// The configuration was absent and is now made from the list; look once more (another
    /// replica's create, from an older list, may have landed over it).
    Created,
}

/// Whether a list at `revision` may replace a configuration made from the list at `recorded`
/// (pure): only when it is at least as new. A configuration that records none (made before
/// the annotation, or by hand) is replaced.
pub fn supersedes(revision: u64, recorded: Option<u64>) -> bool {
    recorded.is_none_or(|recorded| revision >= recorded)
}

/// The revision `found` records (`None`: none, or not a number, or not from this cluster). The
/// list is read before the configuration is written, so a genuine record is below the
/// configuration's own `resourceVersion`; one that is not was copied from elsewhere (a backup of
/// another cluster restored here) and is ignored, or it would hold the routing until this
/// cluster's revisions passed it.
pub fn recorded_revision(found: &ValidatingWebhookConfiguration) -> Option<u64> {
    let recorded: u64 = found.metadata.annotations.as_ref()?.get(REVISION_ANNOTATION)?.parse().ok()?;
    let written: u64 = found.metadata.resource_version.as_deref()?.parse().ok()?;
    (recorded < written).then_some(recorded)
}

/// Why the writers configuration could not be applied.
#[derive(Debug, thiserror::Error)]
pub enum RoutingError {
    #[error("listing the FencedControllers (a consistent read)")]
    ListFences(#[source] kube::Error),
    #[error("the FencedControllers' list has resourceVersion {0:?}, not a revision")]
    ListRevision(String),
    #[error("reading ValidatingWebhookConfiguration {0} (whose client configuration the writer webhook uses)")]
    ReadConfiguration(String, #[source] kube::Error),
    #[error("ValidatingWebhookConfiguration {0} has no webhook to take the client configuration from")]
    NoTemplate(String),
    #[error("applying ValidatingWebhookConfiguration {0}")]
    Apply(String, #[source] kube::Error),
}

/// Lists the FencedControllers of `scope` by a consistent read (every namespace, then the
/// scope's): the routes [`apply`] applies and the revision it records.
pub async fn list(client: &kube::Client, scope: &Scope) -> Result<Listed, RoutingError> {
    let listed = Api::<FencedController>::all(client.clone()).list(&ListParams::default()).await.map_err(RoutingError::ListFences)?;
    let version = listed.metadata.resource_version.unwrap_or_default();
    let revision = version.parse().map_err(|_| RoutingError::ListRevision(version))?;
    Ok(Listed { routes: routes_in_scope(scope, &listed.items), revision })
}

/// Applies the writers configuration of `scope` for `listed` once, unless the configuration was
/// made from a newer list ([`Applied::Superseded`]) or changed since it was read
/// ([`Applied::Raced`], the `resourceVersion` precondition). Absent (the chart makes it; local
/// mode does not), it is created ([`Applied::Created`]).
pub async fn apply(client: &kube::Client, scope: &Scope, listed: &Listed) -> Result<Applied, RoutingError> {
    let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let main = &scope.configuration_name;
    let found = api.get(main).await.map_err(|e| RoutingError::ReadConfiguration(main.to_string(), e))?;
    let template = found
        .webhooks
        .and_then(|w| w.into_iter().next())
        .map(|w| w.client_config)
        .ok_or_else(|| RoutingError::NoTemplate(main.to_string()))?;
    let name = configuration_name(main);
    let current = api.get_opt(&name).await.map_err(|e| RoutingError::ReadConfiguration(name.clone(), e))?;
    let mut desired = desired(scope, &template, &listed.routes);
    desired.metadata.annotations = Some([(REVISION_ANNOTATION.to_string(), listed.revision.to_string())].into());
    let created = current.is_none();
    let written = match current {
        Some(current) => {
            if let Some(recorded) = recorded_revision(&current).filter(|r| !supersedes(listed.revision, Some(*r))) {
                return Ok(Applied::Superseded { recorded });
            }
            desired.metadata.resource_version = current.metadata.resource_version;
            api.patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&desired)).await.map(|_| ())
        }
        // Absent (not made by the chart): applying creates it, with no precondition to give, so
        // another replica's create may land over this one; [`Applied::Created`] looks once more.
        None => api.patch(&name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&desired)).await.map(|_| ()),
    };
    match (written, created) {
        (Ok(()), false) => Ok(Applied::InStep),
        (Ok(()), true) => Ok(Applied::Created),
        (Err(kube::Error::Api(e)), _) if e.code == 409 => Ok(Applied::Raced),
        (Err(e), _) => Err(RoutingError::Apply(name, e)),
    }
}

/// Keeps `<configuration>-writers` of `scope` in step with the FencedControllers of `scope`'s
/// namespaces, until `shutdown` resolves: the watch says when to look, and each look lists them
/// by a consistent read and applies that list ([`list`], [`apply`]). Errors are logged and
/// retried at the next change or resync; after a race with another replica, or a create, it looks
/// again once [`SETTLE`] has passed. The configuration that was last applied keeps judging
/// meanwhile (failing closed for the writers it names).
pub async fn keep_in_step(client: kube::Client, scope: Scope, shutdown: impl std::future::Future<Output = ()>) {
    let api: Api<FencedController> = Api::all(client.clone());
    let stream = watcher(api, watcher::Config::default()).default_backoff();
    let mut stream = std::pin::pin!(stream);
    let mut shutdown = std::pin::pin!(shutdown);
    let mut resync = tokio::time::interval(RESYNC);
    // What this replica last applied (to log only what changed).
    let mut last: Option<Routes> = None;
    // When the pending change is applied: SETTLE after the latest event, MAX_DELAY after the first.
    let mut due: Option<(Instant, Instant)> = None;
    loop {
        let deadline = due.map(|(settle, latest)| settle.min(latest));
        tokio::select! {
            _ = &mut shutdown => return,
            event = stream.next() => {
                match event {
                    Some(Ok(_)) => {}
                    Some(Err(err)) => { tracing::warn!(error = %Chain(&err), "watching FencedControllers"); continue }
                    None => return,
                }
                let now = Instant::now();
                due = Some((now + SETTLE, due.map_or(now + MAX_DELAY, |(_, latest)| latest)));
                continue;
            }
            _ = async { if let Some(at) = deadline { tokio::time::sleep_until(at).await } else { std::future::pending::<()>().await } } => { due = None; }
            _ = resync.tick() => {}
        }
        let listed = match list(&client, &scope).await {
            Ok(listed) => listed,
            Err(err) => {
                tracing::warn!(error = %Chain(&err), "keeping the writer webhook in step");
                continue;
            }
        };
        match apply(&client, &scope, &listed).await {
            Ok(applied @ (Applied::InStep | Applied::Created)) => {
                if applied == Applied::Created {
                    let now = Instant::now();
                    due = Some((now + SETTLE, now + SETTLE));
                }
                if last.as_ref() != Some(&listed.routes) {
                    for ((namespace, name), err) in &listed.routes.left_out {
                        tracing::warn!(namespace, name, error = %err, "the FencedController is not routed");
                    }
                    if last.is_some() || !listed.routes.routed.is_empty() {
                        tracing::info!(
                            configuration = configuration_name(&scope.configuration_name),
                            fences = listed.routes.routed.len(),
                            revision = listed.revision,
                            "writer webhook in step"
                        );
                    }
                }
                last = Some(listed.routes);
            }
            Ok(Applied::Superseded { recorded }) => {
                tracing::debug!(revision = listed.revision, recorded, "the writer webhook was applied from a newer list");
            }
            Ok(Applied::Raced) => {
                let now = Instant::now();
                due = Some((now + SETTLE, now + SETTLE));
            }
            Err(err) => tracing::warn!(error = %Chain(&err), "keeping the writer webhook in step"),
        }
    }
}

#[cfg(test)]
mod tests;
