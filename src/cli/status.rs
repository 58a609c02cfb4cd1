//! `kube-fence status`: every FencedController and kube-fence Lease in scope, one line each, with
//! the Warning Events about it of the last hour (refused writes, and writes an Audit fence
//! admitted with a warning).
//!
//! Three lists at most per run, whatever the number of objects: the FencedControllers, the Leases,
//! and the Warning Events about each of the two kinds (`regarding.kind`, and `regarding.name` when
//! the scope holds one object of that kind), in the namespace or across all of them; the Events
//! are then counted per object here ([`count_events`]). Everything but the listing is pure:
//! building the rows ([`rows`]), counting ([`count_events`], [`classify`], [`occurred`]) and
//! rendering the table ([`table`]).

use std::collections::BTreeMap;
use std::io::Write;

use k8s_openapi::api::events::v1::Event;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, ListParams};
use kube::{Resource, ResourceExt};
use serde::Serialize;

use super::cluster::{Cluster, ClusterArgs};
use super::error::{Error, Listed};
use kube_fence_api::denial::Reason;
use kube_fence_api::{FencedController, Lease, fence_events};

/// How far back Events are counted.
pub const WINDOW: SignedDuration = SignedDuration::from_hours(1);

/// What `kube-fence status --help` says first (the one-line summary is the subcommand's doc).
pub const LONG_ABOUT: &str = "Show every FencedController and kube-fence Lease in a namespace (or in all of them), one line each: \
a fence's Lease, mode, holder and readiness; a Lease's enforcement, holder, phase and token; and for both the \
number of Warning Events about it in the last hour: REFUSED-1H (writes kube-fence refused: NotHolder and the \
webhook's other denial reasons) and WARNED-1H (writes an Audit fence admitted with a warning: WouldRefuse).\n\n\
Event counts are lower bounds: the webhook rate-limits the Events it publishes (per source address), and \
the API server expires Events (after an hour by default).";

/// Arguments of `kube-fence status`.
#[derive(Debug, clap::Args)]
pub struct StatusArgs {
    /// Namespace to show (default: the kubeconfig context's namespace).
    #[arg(short = 'n', long, env = "KUBE_FENCE_NAMESPACE")]
    pub namespace: Option<String>,
    /// Show every namespace (overrides --namespace).
    #[arg(short = 'A', long)]
    pub all_namespaces: bool,
    /// Output format.
    #[arg(short = 'o', long, value_enum, default_value_t = Output::Table)]
    pub output: Output,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    /// One line per object, like `kubectl get`.
    Table,
    /// The table with a fence's ServiceAccounts and a Lease's expiry.
    Wide,
    /// A JSON array, one object per line of the table (with every column of `wide`).
    Json,
}

/// Which kind of object a row shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub enum Kind {
    FencedController,
    Lease,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::FencedController => "FencedController",
            Kind::Lease => "Lease",
        }
    }
}

/// A fence's `Ready` condition.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Ready {
    /// `True`, `False` or `Unknown`.
    pub status: String,
    pub reason: Option<String>,
}

/// One line of `kube-fence status`, and one element of its JSON (field names are the contract).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Row {
    /// `kubefence.io/v1alpha1`.
    pub api_version: String,
    pub kind: Kind,
    pub namespace: String,
    pub name: String,
    /// A fence's leader-election Lease (`coordination.k8s.io`); `null` for a Lease.
    pub lease: Option<String>,
    /// A fence's `Audit` or `Enforce`; a Lease's fencing enforcement, `Enforce` or `Warn`.
    pub mode: String,
    /// Who holds the (leader-election) Lease now.
    pub holder: Option<String>,
    /// A fence's `Ready` condition (`status: Unknown` before the controller wrote one); `null`
    /// for a Lease.
    pub ready: Option<Ready>,
    /// A Lease's phase, `Held` or `Unheld`; `null` for a fence.
    pub phase: Option<String>,
    /// A Lease's newest fencing token.
    pub token: Option<u64>,
    /// Warning Events about the object in the last hour for writes kube-fence refused (a lower
    /// bound: Events are rate limited).
    pub refused_last_hour: u64,
    /// Warning Events about the object in the last hour for writes an Audit fence admitted with a
    /// warning (a lower bound).
    pub warned_last_hour: u64,
    /// A fence's ServiceAccounts (empty for a Lease).
    pub service_accounts: Vec<String>,
    /// When a Lease's grant expires unless renewed (RFC 3339).
    pub expire_time: Option<String>,
}

/// What a Warning Event about a fence or a Lease says happened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Class {
    /// A write kube-fence refused.
    Refused,
    /// A write an Audit fence admitted that Enforce would refuse.
    Warned,
}

/// The Warning Events of one object in the window.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    pub refused: u64,
    pub warned: u64,
}

/// An object Events are about: kind, namespace, name.
pub type Key = (Kind, String, String);

/// What a Warning Event's reason says, if it is one `status` counts: the fence's
/// [`fence_events::WOULD_REFUSE`], or the reason of a denial (the fence's
/// [`fence_events::REFUSED`] is one). Admitting reasons and everything else (the lease
/// controller's Events) are not counted.
pub fn classify(reason: &str) -> Option<Class> {
    if reason == fence_events::WOULD_REFUSE {
        return Some(Class::Warned);
    }
    let refusal = match Reason::parse(reason)? {
        Reason::Fenced
        | Reason::Unguarded
        | Reason::Exempt
        | Reason::DeletePreconditioned
        | Reason::GuardUnchanged
        | Reason::FinalizersRemoved => false,
        Reason::StaleToken
        | Reason::TokenMissing
        | Reason::TokenMalformed
        | Reason::TokenNotIssued
        | Reason::LeaseNotFound
        | Reason::LeaseRebound
        | Reason::LeaseLabelInvalid
        | Reason::WriterLabelInvalid
        | Reason::DeletePreconditionRequired
        | Reason::NotHolder
        | Reason::MalformedRequest
        | Reason::LeaseReadFailed
        | Reason::ReadsThrottled => true,
    };
    refusal.then_some(Class::Refused)
}

/// When an Event last happened: its series' last observation, else its `eventTime`, else
/// `deprecatedLastTimestamp` (an Event written through core/v1), else when it was created.
pub fn occurred(event: &Event) -> Option<Timestamp> {
    event
        .series
        .as_ref()
        .map(|s| s.last_observed_time.0)
        .or(event.event_time.as_ref().map(|t| t.0))
        .or(event.deprecated_last_timestamp.as_ref().map(|t| t.0))
        .or(event.metadata.creation_timestamp.as_ref().map(|t| t.0))
}

/// Whether `at` falls in the `window` up to `now` (a time after `now`, another clock's, counts).
pub fn within(at: Timestamp, now: Timestamp, window: SignedDuration) -> bool {
    at >= now - window
}

/// The kind a kube-fence object's Event is about, from its `regarding`: a FencedController, or a
/// Lease of group `kubefence.io` (not a `coordination.k8s.io` one).
fn regarded(event: &Event) -> Option<Key> {
    let regarding = event.regarding.as_ref()?;
    let group = regarding.api_version.as_deref().map(|v| v.split_once('/').map_or("", |(g, _)| g));
    let kind = match (regarding.kind.as_deref()?, group) {
        ("FencedController", Some(kube_fence_api::GROUP) | None) => Kind::FencedController,
        ("Lease", Some(kube_fence_api::GROUP)) => Kind::Lease,
        _ => return None,
    };
    let namespace = regarding.namespace.clone().or_else(|| event.metadata.namespace.clone())?;
    Some((kind, namespace, regarding.name.clone()?))
}

/// The Warning Events of the last `window` before `now`, counted per object they are about; each
/// Event counts once.
pub fn count_events<'a>(events: impl IntoIterator<Item = &'a Event>, now: Timestamp, window: SignedDuration) -> BTreeMap<Key, Counts> {
    let mut counts: BTreeMap<Key, Counts> = BTreeMap::new();
    for event in events {
        if event.type_.as_deref() != Some("Warning") {
            continue;
        }
        let (Some(key), Some(class)) = (regarded(event), event.reason.as_deref().and_then(classify)) else { continue };
        if !occurred(event).is_some_and(|at| within(at, now, window)) {
            continue;
        }
        let entry = counts.entry(key).or_default();
        match class {
            Class::Refused => entry.refused += 1,
            Class::Warned => entry.warned += 1,
        }
    }
    counts
}

fn api_version<K: Resource<DynamicType = ()>>() -> String {
    K::api_version(&()).into_owned()
}

/// A fence's line.
pub fn fence_row(fence: &FencedController, counts: Counts) -> Row {
    let status = fence.status.clone().unwrap_or_default();
    let ready = status.conditions.iter().find(|c| c.type_ == "Ready");
    Row {
        api_version: api_version::<FencedController>(),
        kind: Kind::FencedController,
        namespace: fence.namespace().unwrap_or_default(),
        name: fence.name_any(),
        lease: Some(fence.spec.lease.clone()),
        mode: format!("{:?}", fence.spec.mode),
        holder: status.holder.clone().filter(|h| !h.is_empty()),
        ready: Some(match ready {
            Some(c) => Ready { status: c.status.clone(), reason: Some(c.reason.clone()).filter(|r| !r.is_empty()) },
            None => Ready { status: "Unknown".into(), reason: None },
        }),
        phase: None,
        token: None,
        refused_last_hour: counts.refused,
        warned_last_hour: counts.warned,
        service_accounts: fence.spec.service_accounts.clone(),
        expire_time: None,
    }
}

/// A Lease's line.
pub fn lease_row(lease: &Lease, counts: Counts) -> Row {
    let status = lease.status.clone().unwrap_or_default();
    let enforcement = lease.spec.fencing.as_ref().and_then(|f| f.enforcement).unwrap_or_default();
    Row {
        api_version: api_version::<Lease>(),
        kind: Kind::Lease,
        namespace: lease.namespace().unwrap_or_default(),
        name: lease.name_any(),
        lease: None,
        mode: format!("{enforcement:?}"),
        holder: status.holder.clone().filter(|h| !h.is_empty()),
        ready: None,
        phase: Some(format!("{:?}", status.phase)),
        token: status.token.map(|t| t.get()),
        refused_last_hour: counts.refused,
        warned_last_hour: counts.warned,
        service_accounts: Vec::new(),
        expire_time: status.expire_time.map(|t| t.0.to_string()),
    }
}

/// Every line, sorted by namespace, kind (fences first) and name, with the Events of the last
/// [`WINDOW`] before `now` counted in.
pub fn rows(fences: &[FencedController], leases: &[Lease], events: &[Event], now: Timestamp) -> Vec<Row> {
    let counts = count_events(events, now, WINDOW);
    let of = |kind: Kind, namespace: String, name: String| counts.get(&(kind, namespace, name)).copied().unwrap_or_default();
    let mut rows: Vec<Row> = fences
        .iter()
        .map(|f| fence_row(f, of(Kind::FencedController, f.namespace().unwrap_or_default(), f.name_any())))
        .chain(leases.iter().map(|l| lease_row(l, of(Kind::Lease, l.namespace().unwrap_or_default(), l.name_any()))))
        .collect();
    rows.sort_by(|a, b| (&a.namespace, a.kind, &a.name).cmp(&(&b.namespace, b.kind, &b.name)));
    rows
}

/// Not applicable to this kind of object.
const NOT_APPLICABLE: &str = "-";
/// Applicable, but not set.
const NONE: &str = "<none>";

/// The table, aligned like `kubectl get` (columns three spaces apart); `wide` adds a fence's
/// ServiceAccounts and a Lease's expiry.
pub fn table(rows: &[Row], wide: bool) -> String {
    let mut header = vec!["KIND", "NAMESPACE", "NAME", "LEASE", "MODE", "HOLDER", "READY", "PHASE", "TOKEN", "REFUSED-1H", "WARNED-1H"];
    if wide {
        header.extend(["SERVICEACCOUNTS", "EXPIRES"]);
    }
    let mut lines: Vec<Vec<String>> = vec![header.iter().map(|h| h.to_string()).collect()];
    for row in rows {
        let fence = row.kind == Kind::FencedController;
        let applies = |applies: bool, value: Option<String>| match (applies, value) {
            (false, _) => NOT_APPLICABLE.to_string(),
            (true, Some(v)) => v,
            (true, None) => NONE.to_string(),
        };
        let ready = row.ready.as_ref().map(|r| match &r.reason {
            Some(reason) => format!("{}/{reason}", r.status),
            None => r.status.clone(),
        });
        let mut line = vec![
            row.kind.as_str().to_string(),
            row.namespace.clone(),
            row.name.clone(),
            applies(fence, row.lease.clone()),
            row.mode.clone(),
            applies(true, row.holder.clone()),
            applies(fence, ready),
            applies(!fence, row.phase.clone()),
            applies(!fence, row.token.map(|t| t.to_string())),
            row.refused_last_hour.to_string(),
            row.warned_last_hour.to_string(),
        ];
        if wide {
            let accounts = Some(row.service_accounts.join(",")).filter(|a| !a.is_empty());
            line.extend([applies(fence, accounts), applies(!fence, row.expire_time.clone())]);
        }
        lines.push(line);
    }
    let widths: Vec<usize> = (0..lines[0].len()).map(|i| lines.iter().map(|l| l[i].chars().count()).max().unwrap_or_default()).collect();
    let mut out = String::new();
    for line in &lines {
        let last = line.len() - 1;
        for (i, cell) in line.iter().enumerate() {
            out.push_str(cell);
            if i < last {
                out.push_str(&" ".repeat(widths[i] - cell.chars().count() + 3));
            }
        }
        out.push('\n');
    }
    out
}

/// The field selector of the Warning Events about `kind` objects, and of `name` when the scope
/// holds that one alone.
pub fn event_selector(kind: Kind, names: &[String]) -> String {
    let mut selector = format!("type=Warning,regarding.kind={}", kind.as_str());
    if let [name] = names {
        selector.push_str(&format!(",regarding.name={name}"));
    }
    selector
}

/// Every page of `api`'s list with `params`.
async fn list_all<K>(api: &Api<K>, params: ListParams) -> Result<Vec<K>, kube::Error>
where
    K: Clone + serde::de::DeserializeOwned + std::fmt::Debug,
{
    let mut params = params.limit(500);
    let mut items = Vec::new();
    loop {
        let page = api.list(&params).await?;
        items.extend(page.items);
        match page.metadata.continue_.filter(|c| !c.is_empty()) {
            Some(token) => params = params.continue_token(&token),
            None => return Ok(items),
        }
    }
}

/// The Warning Events about `kind` objects named `names` in scope: with a field selector, or,
/// where the API server refuses the selector (400), all Events of the scope (counted alike).
async fn warnings(api: &Api<Event>, kind: Kind, names: &[String]) -> Result<Vec<Event>, kube::Error> {
    if names.is_empty() {
        return Ok(Vec::new());
    }
    match list_all(api, ListParams::default().fields(&event_selector(kind, names))).await {
        Err(kube::Error::Api(status)) if status.code == 400 => list_all(api, ListParams::default()).await,
        listed => listed,
    }
}

fn api_in<K>(client: &kube::Client, namespace: Option<&str>) -> Api<K>
where
    K: Resource<Scope = k8s_openapi::NamespaceResourceScope, DynamicType = ()>,
{
    match namespace {
        Some(ns) => Api::namespaced(client.clone(), ns),
        None => Api::all(client.clone()),
    }
}

pub async fn run(args: StatusArgs, at: &ClusterArgs) -> Result<(), Error> {
    let cluster = Cluster::connect(at).await?;
    let namespace = (!args.all_namespaces).then(|| args.namespace.clone().unwrap_or_else(|| cluster.namespace.clone()));
    let scope = namespace.as_deref();
    let failed = |listed: Listed| {
        let (server, namespace) = (cluster.server.clone(), namespace.clone());
        move |source: kube::Error| Error::ListStatus { listed, namespace, server, source }
    };
    let fences = list_all(&api_in::<FencedController>(&cluster.client, scope), ListParams::default())
        .await
        .map_err(failed(Listed::FencedControllers))?;
    let leases = list_all(&api_in::<Lease>(&cluster.client, scope), ListParams::default()).await.map_err(failed(Listed::Leases))?;
    let events_api = api_in::<Event>(&cluster.client, scope);
    let names = |objects: Vec<String>| {
        let mut names = objects;
        names.sort();
        names.dedup();
        names
    };
    let mut events = warnings(&events_api, Kind::FencedController, &names(fences.iter().map(|f| f.name_any()).collect()))
        .await
        .map_err(failed(Listed::Events))?;
    events.extend(
        warnings(&events_api, Kind::Lease, &names(leases.iter().map(|l| l.name_any()).collect())).await.map_err(failed(Listed::Events))?,
    );
    let rows = rows(&fences, &leases, &events, Timestamp::now());

    let mut out = std::io::stdout().lock();
    match args.output {
        Output::Json => {
            let json = serde_json::to_string_pretty(&rows).map_err(|e| Error::EncodeOutput { source: e.into() })?;
            writeln!(out, "{json}")?;
        }
        Output::Table | Output::Wide if rows.is_empty() => {
            let place = match scope {
                Some(ns) => format!("in namespace {ns:?}"),
                None => "in any namespace".to_string(),
            };
            eprintln!("No FencedControllers or kube-fence Leases found {place}.");
        }
        Output::Table | Output::Wide => out.write_all(table(&rows, args.output == Output::Wide).as_bytes())?,
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::ObjectReference;
    use k8s_openapi::api::events::v1::EventSeries;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta, Time};
    use rstest::rstest;

    fn now() -> Timestamp {
        "2030-01-01T12:00:00Z".parse().unwrap_or_else(|_| unreachable!())
    }

    fn ago(minutes: i64) -> Timestamp {
        now() - SignedDuration::from_mins(minutes)
    }

    fn event(kind: &str, api_version: &str, name: &str, type_: &str, reason: &str, at: Timestamp) -> Event {
        Event {
            metadata: ObjectMeta { namespace: Some("work".into()), ..Default::default() },
            regarding: Some(ObjectReference {
                api_version: Some(api_version.into()),
                kind: Some(kind.into()),
                namespace: Some("work".into()),
                name: Some(name.into()),
                ..Default::default()
            }),
            type_: Some(type_.into()),
            reason: Some(reason.into()),
            event_time: Some(MicroTime(at)),
            ..Default::default()
        }
    }

    fn on_fence(reason: &str, at: Timestamp) -> Event {
        event("FencedController", "kubefence.io/v1alpha1", "app", "Warning", reason, at)
    }

    #[rstest]
    #[case(fence_events::REFUSED, Some(Class::Refused))]
    #[case(fence_events::WOULD_REFUSE, Some(Class::Warned))]
    #[case("StaleToken", Some(Class::Refused))]
    #[case("LeaseRebound", Some(Class::Refused))]
    #[case("ReadsThrottled", Some(Class::Refused))]
    #[case("Fenced", None)]
    #[case("Exempt", None)]
    #[case("TokenUnavailable", None)]
    #[case("Granted", None)]
    #[case("notholder", None)]
    #[case("", None)]
    fn reasons_are_classified(#[case] reason: &str, #[case] class: Option<Class>) {
        assert_eq!(classify(reason), class);
    }

    #[rstest]
    #[case(0, true)]
    #[case(59, true)]
    #[case(60, true)]
    #[case(61, false)]
    #[case(24 * 60, false)]
    #[case(-5, true)] // another clock, a little ahead
    fn the_window_is_the_last_hour(#[case] minutes_ago: i64, #[case] counted: bool) {
        assert_eq!(within(ago(minutes_ago), now(), WINDOW), counted);
    }

    #[test]
    fn an_event_happened_at_its_newest_time() {
        let mut e = on_fence("NotHolder", ago(10));
        assert_eq!(occurred(&e), Some(ago(10)));
        e.series = Some(EventSeries { count: 3, last_observed_time: MicroTime(ago(2)) });
        assert_eq!(occurred(&e), Some(ago(2)), "a series' last observation");
        let mut old = on_fence("NotHolder", ago(0));
        old.event_time = None;
        old.metadata.creation_timestamp = Some(Time(ago(90)));
        assert_eq!(occurred(&old), Some(ago(90)), "the creation time");
        old.deprecated_last_timestamp = Some(Time(ago(30)));
        assert_eq!(occurred(&old), Some(ago(30)), "a core/v1 Event's last timestamp before its creation");
        old.metadata.creation_timestamp = None;
        old.deprecated_last_timestamp = None;
        assert_eq!(occurred(&old), None);
    }

    #[rstest]
    // (events, refused, warned) of fence work/app
    #[case::none(vec![], 0, 0)]
    #[case::both(vec![on_fence("NotHolder", ago(1)), on_fence("WouldRefuse", ago(5)), on_fence("WouldRefuse", ago(59))], 1, 2)]
    #[case::older_than_an_hour(vec![on_fence("NotHolder", ago(61)), on_fence("WouldRefuse", ago(120))], 0, 0)]
    #[case::normal_events(vec![event("FencedController", "kubefence.io/v1alpha1", "app", "Normal", "NotHolder", ago(1))], 0, 0)]
    #[case::other_reasons(vec![on_fence("Auditing", ago(1)), on_fence("Fenced", ago(1))], 0, 0)]
    #[case::another_fence(vec![event("FencedController", "kubefence.io/v1alpha1", "other", "Warning", "NotHolder", ago(1))], 0, 0)]
    #[case::another_group(vec![event("FencedController", "example.com/v1", "app", "Warning", "NotHolder", ago(1))], 0, 0)]
    fn events_are_counted_per_fence(#[case] events: Vec<Event>, #[case] refused: u64, #[case] warned: u64) {
        let counts = count_events(&events, now(), WINDOW);
        let key = (Kind::FencedController, "work".to_string(), "app".to_string());
        assert_eq!(counts.get(&key).copied().unwrap_or_default(), Counts { refused, warned });
    }

    #[test]
    fn a_kube_fence_leases_events_are_its_own_not_a_coordination_leases() {
        let events = [
            event("Lease", "kubefence.io/v1alpha1", "jobs", "Warning", "StaleToken", ago(3)),
            event("Lease", "coordination.k8s.io/v1", "jobs", "Warning", "NotHolder", ago(3)),
            event("Lease", "kubefence.io/v1alpha1", "jobs", "Warning", "TokenUnavailable", ago(3)),
        ];
        let counts = count_events(&events, now(), WINDOW);
        assert_eq!(counts.len(), 1, "{counts:?}");
        assert_eq!(counts.get(&(Kind::Lease, "work".into(), "jobs".into())), Some(&Counts { refused: 1, warned: 0 }));
    }

    fn fence(namespace: &str, name: &str, ready: Option<(&str, &str)>) -> FencedController {
        let mut fence: FencedController = serde_json::from_value(serde_json::json!({
            "apiVersion": "kubefence.io/v1alpha1", "kind": "FencedController",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"lease": "app-leader", "serviceAccounts": ["app", "app-2"], "mode": "Enforce"},
            "status": {"holder": "app-7d9f-x2"}
        }))
        .unwrap_or_else(|e| panic!("{e}"));
        if let (Some((status, reason)), Some(s)) = (ready, fence.status.as_mut()) {
            s.conditions = vec![
                serde_json::from_value(serde_json::json!({
                    "type": "Ready", "status": status, "reason": reason, "message": "", "lastTransitionTime": "2030-01-01T11:00:00Z"
                }))
                .unwrap_or_else(|e| panic!("{e}")),
            ];
        }
        fence
    }

    fn lease(namespace: &str, name: &str, held: bool) -> Lease {
        let status = if held {
            serde_json::json!({"phase": "Held", "holder": "worker-a", "token": 42, "expireTime": "2030-01-01T12:00:15Z"})
        } else {
            serde_json::json!({"phase": "Unheld", "token": 41})
        };
        serde_json::from_value(serde_json::json!({
            "apiVersion": "kubefence.io/v1alpha1", "kind": "Lease",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"fencing": {"enforcement": "Warn"}},
            "status": status
        }))
        .unwrap_or_else(|e| panic!("{e}"))
    }

    #[test]
    fn rows_are_sorted_and_carry_their_counts() {
        let fences = [fence("work", "app", Some(("True", "Enforcing"))), fence("a-first", "z", None)];
        let leases = [lease("work", "jobs", true), lease("work", "idle", false)];
        let events = [on_fence("NotHolder", ago(1)), on_fence("NotHolder", ago(2)), on_fence("WouldRefuse", ago(70))];
        let rows = rows(&fences, &leases, &events, now());
        let order: Vec<(&str, Kind, &str)> = rows.iter().map(|r| (r.namespace.as_str(), r.kind, r.name.as_str())).collect();
        assert_eq!(
            order,
            [
                ("a-first", Kind::FencedController, "z"),
                ("work", Kind::FencedController, "app"),
                ("work", Kind::Lease, "idle"),
                ("work", Kind::Lease, "jobs")
            ]
        );
        assert_eq!((rows[1].refused_last_hour, rows[1].warned_last_hour), (2, 0));
        assert_eq!(rows[0].ready, Some(Ready { status: "Unknown".into(), reason: None }));
        assert_eq!((rows[3].mode.as_str(), rows[3].token, rows[3].phase.as_deref()), ("Warn", Some(42), Some("Held")));
    }

    #[test]
    fn the_table_aligns_columns_and_marks_what_does_not_apply() {
        let rows = rows(
            &[fence("work", "app", Some(("True", "Enforcing")))],
            &[lease("work", "idle", false)],
            &[on_fence("NotHolder", ago(1))],
            now(),
        );
        let expected = "\
KIND               NAMESPACE   NAME   LEASE        MODE      HOLDER        READY            PHASE    TOKEN   REFUSED-1H   WARNED-1H
FencedController   work        app    app-leader   Enforce   app-7d9f-x2   True/Enforcing   -        -       1            0
Lease              work        idle   -            Warn      <none>        -                Unheld   41      0            0
";
        assert_eq!(table(&rows, false), expected);
        let wide = table(&rows, true);
        let lines: Vec<&str> = wide.lines().collect();
        assert!(lines[0].ends_with("WARNED-1H   SERVICEACCOUNTS   EXPIRES"), "{wide}");
        assert!(lines[1].ends_with("app,app-2         -"), "{wide}");
        assert!(lines[2].ends_with("-                 <none>"), "{wide}");
    }

    #[test]
    fn the_json_is_an_array_of_rows_with_every_field() {
        let rows = rows(&[fence("work", "app", Some(("False", "LeaseNotFound")))], &[lease("work", "jobs", true)], &[], now());
        let json = serde_json::to_value(&rows).unwrap_or_default();
        assert_eq!(
            json,
            serde_json::json!([
                {"apiVersion": "kubefence.io/v1alpha1", "kind": "FencedController", "namespace": "work", "name": "app",
                 "lease": "app-leader", "mode": "Enforce", "holder": "app-7d9f-x2",
                 "ready": {"status": "False", "reason": "LeaseNotFound"}, "phase": null, "token": null,
                 "refusedLastHour": 0, "warnedLastHour": 0, "serviceAccounts": ["app", "app-2"], "expireTime": null},
                {"apiVersion": "kubefence.io/v1alpha1", "kind": "Lease", "namespace": "work", "name": "jobs",
                 "lease": null, "mode": "Warn", "holder": "worker-a", "ready": null, "phase": "Held", "token": 42,
                 "refusedLastHour": 0, "warnedLastHour": 0, "serviceAccounts": [], "expireTime": "2030-01-01T12:00:15Z"}
            ])
        );
    }

    #[rstest]
    #[case(Kind::FencedController, &[], "type=Warning,regarding.kind=FencedController")]
    #[case(Kind::FencedController, &["app"], "type=Warning,regarding.kind=FencedController,regarding.name=app")]
    #[case(Kind::Lease, &["a", "b"], "type=Warning,regarding.kind=Lease")]
    fn the_event_selector_names_one_object_where_it_can(#[case] kind: Kind, #[case] names: &[&str], #[case] selector: &str) {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        assert_eq!(event_selector(kind, &names), selector);
    }
}
