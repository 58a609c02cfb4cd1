//! The client-go Lease paths of the HA driver (issue 36, item 3): besides kube-fence's own leases,
//! the same workers-nemesis-checker run exercises, under every fault kind,
//!
//! - [`Path::LeaderLease`]: a leader-election Lease (`coordination.k8s.io/v1`, opted into holder
//!   binding by `kubefence.io/holder-identity: Pod`) and ConfigMaps labelled
//!   `kubefence.io/leader-lease: <lease>`, judged by `admission::judge::leader` (§6a);
//! - [`Path::FencedController`]: a `FencedController` (Enforce) naming another such Lease (no
//!   kube-fence label) and its ServiceAccount `ctl`, whose Pods patch an unlabelled ConfigMap,
//!   create new ones and patch a cluster-scoped object (a Namespace's annotations), judged by the
//!   writer webhook at `/writer` (§6b).
//!
//! Each path's workers are Pods (never scheduled: each authenticates with a ServiceAccount token
//! bound to its Pod, as the kubelet would mount it) that campaign as client-go's `LeaseLock` does:
//! read the Lease, and when it is free or its holder's `renewTime + leaseDurationSeconds` has
//! passed, replace it (a compare-and-swap on its resourceVersion) naming `<pod>_<term>` as holder,
//! with `leaseTransitions` one up; renew while writing; release by clearing the holder. A worker
//! believes it leads while its last renewal was sent less than a lease duration ago — the honest
//! client. Some cycles stop the worker itself after it read (no renewal, no write) past its lease,
//! then send the delayed write: the threat case is the **honest but stale writer**, which learns
//! too late that it lost the Lease (the pause), or whose writes were held by the network (a cut
//! from its API server) while a successor took over.
//!
//! Records come from watches, through both API servers, and from the API server's answers to the
//! claims, renewals and writes it committed (a watch that lists again after a gap skips versions;
//! an answer is a committed version, not a belief — [`Answers`]): each Lease version naming a
//! holder is a grant of the Pod it names (`<pod>_…`, the identity rule the webhook applies), its token
//! the Lease's `leaseTransitions` + 1 (one per acquisition, the same across renewals); each
//! admitted version of a guarded object is a holder-only write by the Pod in its `data.writer`
//! (the Namespace's: in its annotation `ha.kubefence.io/writer`).
//! The created ConfigMaps are one logical object ([`MADE`]). The checker's holder-only rule
//! (`history::check`) then says: per object, no write is attributed to an older grant than one
//! already written under — no write of a Pod that lost the Lease is admitted after the
//! successor's (or anybody's newer holder's) write. Plus, per Lease: acquisitions strictly
//! increase and no acquisition went to two Pods (the Lease's own compare-and-swap, across two API
//! servers). What the guard does not promise, and the check does not ask: a Pod that re-acquired
//! owns its older writes again, and a CREATE judged before the takeover may commit after it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use k8s_openapi::api::coordination::v1::{Lease as LeaderLease, LeaseSpec as LeaderLeaseSpec};
use k8s_openapi::api::core::v1::{ConfigMap, Namespace, Pod, ServiceAccount};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams, PostParams};
use kube::config::KubeConfigOptions;
use kube::runtime::WatchStreamExt;
use kube::runtime::watcher::{self, Event};
use kube::{Client, ResourceExt};
use kube_fence_api::denial::Reason;
use kube_fence_api::names::{HOLDER_IDENTITY_LABEL, HOLDER_IS_POD, LEADER_LEASE_LABEL};
use kube_fence_api::token::Token;
use kube_fence_api::{FenceMode, FencedController, FencedControllerSpec};
use kube_fence_test_support::history::{Observation, Violation};
use serde_json::json;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::{Availability, HaFault, Plane, World, Wrote, bounded, short};
use crate::torture::{Recorder, Rng, version_of};

/// A path beside kube-fence's own leases (token-guarded and holder-only objects): the client-go
/// Lease paths (this module), delegated grants ([`super::delegated`]) and the PostgreSQL arbiter
/// ([`super::arbiter`]). Each is recorded, counted and checked on its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Path {
    /// Objects labelled `kubefence.io/leader-lease`, written by the Lease's holder Pod.
    LeaderLease,
    /// Every write of a fenced ServiceAccount's Pods (an unlabelled ConfigMap, created ConfigMaps,
    /// a cluster-scoped Namespace).
    FencedController,
    /// Token-guarded objects written by a consumer the holder handed its grant to (a Job's Pod).
    Delegated,
    /// Effects committed in PostgreSQL under a kube-fence token, fenced by the database.
    Arbiter,
}

impl Path {
    pub const ALL: [Path; 4] = [Path::LeaderLease, Path::FencedController, Path::Delegated, Path::Arbiter];
    /// The client-go Lease paths, whose Pods this module runs ([`super::World::elected`] order).
    pub const ELECTED: [Path; 2] = [Path::LeaderLease, Path::FencedController];
    pub fn describe(self) -> &'static str {
        match self {
            Path::LeaderLease => "client-go Lease, labelled objects",
            Path::FencedController => "fenced controller",
            Path::Delegated => "delegated grants",
            Path::Arbiter => "PostgreSQL arbiter",
        }
    }
    /// A short name (JSON results, column heads).
    pub fn slug(self) -> &'static str {
        match self {
            Path::LeaderLease => "leader_lease",
            Path::FencedController => "fenced_controller",
            Path::Delegated => "delegated",
            Path::Arbiter => "arbiter",
        }
    }
    /// The ServiceAccount its Pods run as (client-go Lease paths only).
    fn account(self) -> &'static str {
        match self {
            Path::LeaderLease => "elect",
            _ => "ctl",
        }
    }
    /// The `coordination.k8s.io` Lease its Pods campaign on (client-go Lease paths only).
    fn lease(self) -> &'static str {
        match self {
            Path::LeaderLease => "ha-elect",
            _ => "ha-ctl",
        }
    }
    /// The Lease's name in the recorded history (apart from kube-fence's leases).
    pub(super) fn key(self) -> String {
        format!("coordination/{}", self.lease())
    }
    /// Which path a recorded lease (a kube-fence Lease's name, or a client-go Lease's key) is on
    /// (`None`: kube-fence's own leases of the main workers).
    pub fn of_lease(lease: &str) -> Option<Path> {
        if lease.starts_with(super::delegated::PREFIX) {
            Some(Path::Delegated)
        } else if lease.starts_with(super::arbiter::PREFIX) {
            Some(Path::Arbiter)
        } else {
            Path::ELECTED.into_iter().find(|p| p.key() == lease)
        }
    }
    /// Which path a recorded object is on (`None`: the main workers').
    fn of_object(object: &str) -> Option<Path> {
        if object.starts_with(LED_PREFIX) {
            Some(Path::LeaderLease)
        } else if object == STATE || object == MADE || object == CLUSTER {
            Some(Path::FencedController)
        } else if object.starts_with(super::delegated::PREFIX) {
            Some(Path::Delegated)
        } else if object.starts_with(super::arbiter::OBJECT_PREFIX) {
            Some(Path::Arbiter)
        } else {
            None
        }
    }
    /// Which path a violation is on (`None`: kube-fence's own leases).
    pub fn of(v: &Violation) -> Option<Path> {
        let (object, lease) = match v {
            Violation::TokenNotIncreasing { lease, .. } | Violation::TokenGrantedTwice { lease, .. } => (None, Some(lease)),
            Violation::StaleWriteAccepted { object, .. } => (Some(object), None),
            Violation::TokenNeverGranted { object, lease, .. } | Violation::WriterNeverGranted { object, lease, .. } => {
                (Some(object), Some(lease))
            }
            Violation::StaleHolderWriteAccepted { object, .. } => (Some(object), None),
        };
        object.and_then(|o| Path::of_object(o)).or_else(|| lease.and_then(|l| Path::of_lease(l)))
    }
}

/// The leader-Lease path's labelled ConfigMaps are `ha-led-<j>`.
const LED_PREFIX: &str = "ha-led-";
/// The fenced controller's unlabelled ConfigMap (patched by the leader).
pub const STATE: &str = "ha-ctl-state";
/// The label of the ConfigMaps the fenced controller's leader creates (not a kube-fence label:
/// only the FencedController fences them).
const MADE_LABEL: &str = "ha-made";
/// The logical object the created ConfigMaps are, for the checker: a create of a Pod that lost
/// the Lease committed after one of its successor's is a stale write like any other.
pub const MADE: &str = "configmaps/ha-made";

/// The cluster-scoped object the fenced controller's leader patches (its annotations): the
/// Namespace `<the run's namespace>-ctl`, recorded as this object.
pub const CLUSTER: &str = "namespaces/ha-ctl";
/// The annotations the fenced controller writes on [`CLUSTER`] (what a ConfigMap keeps in `data`):
/// `<prefix>writer`, `<prefix>seq`, ….
const CLUSTER_ANNOTATIONS: &str = "ha.kubefence.io/";

/// The name of [`CLUSTER`] for the run's namespace `ns`.
fn cluster_object(ns: &str) -> String {
    format!("{ns}-ctl")
}

/// What a version of [`CLUSTER`] says, as a ConfigMap's `data` would (its annotations with the
/// prefix taken off).
fn cluster_fields(object: &Namespace) -> BTreeMap<String, String> {
    object.annotations().iter().filter_map(|(k, v)| Some((k.strip_prefix(CLUSTER_ANNOTATIONS)?.to_string(), v.clone()))).collect()
}

/// Labelled ConfigMaps of the leader-Lease path.
const LED_OBJECTS: usize = 2;

/// What the watches saw besides the history itself, to tell §6b's CREATE window apart from a
/// create admitted from a Pod that did not lead ([`creates_in_window`]).
#[derive(Default)]
pub struct Side {
    /// Per created ConfigMap's resourceVersion: the create as its version says it.
    created: BTreeMap<u64, Created>,
    /// Per created ConfigMap's name: how the writer webhook judged its create, as the API servers'
    /// audit logs keep it ([`Side::judged_by_audit`]).
    judged: BTreeMap<String, Judged>,
    /// Per (Lease, token): the `acquireTime` of that acquisition, and the holder identity that wrote it.
    acquired: BTreeMap<(String, Token), (Timestamp, String)>,
    /// Holder identities whose Pod's clock was off ([`super::HaFault::ClientClockSkewed`]), by how
    /// much: their `acquireTime` is corrected by it (it was written by the Pod's clock).
    pub clocks: BTreeMap<String, SignedDuration>,
    /// Every version of the paths' Leases that named a holder, per (Lease key, resourceVersion):
    /// the holder identity, its token, and the API servers whose watch delivered it.
    grants_seen: BTreeMap<(String, u64), (String, Token, BTreeSet<char>)>,
    /// Every recorded version of the paths' objects, per (object, resourceVersion): what its
    /// writer wrote beside its name (the identity it held, through which API server, the fault in
    /// place when it sent it, and what the write was).
    writes_seen: BTreeMap<(String, u64), String>,
}

/// A created ConfigMap of the fenced controller, as its first version says.
#[derive(Clone, Debug)]
struct Created {
    /// Its `creationTimestamp` (set by the API server just before validating admission calls the
    /// webhook; whole seconds).
    at: Timestamp,
    name: String,
    /// The holder identity its writer held (`<pod>_<term>`: one per acquisition).
    identity: String,
    /// What its writer said (note, the fault in place when sent, through which API server).
    said: String,
}

/// How the writer webhook judged a create, as an API server's audit log keeps it: the holder
/// and the Lease version the quorum read returned (the webhook's audit annotations), and the
/// answer's code.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Judged {
    pub holder: String,
    pub lease_version: u64,
    pub code: u16,
}

/// The ConfigMap create one audit event records as judged by a kube-fence webhook for the
/// Lease's holder: its name, and how it was judged. `None` for any other event (another verb or
/// resource, no kube-fence annotations: not judged for a holder).
pub fn judged_of(event: &serde_json::Value) -> Option<(String, Judged)> {
    if event["verb"] != "create" || event["objectRef"]["resource"] != "configmaps" {
        return None;
    }
    let name = event["objectRef"]["name"].as_str()?;
    let annotation = |wanted: &str| crate::common::kube_fence_annotation(event, wanted);
    let judged = Judged {
        holder: annotation("holder")?.to_string(),
        lease_version: annotation("lease-resource-version")?.parse().ok()?,
        code: event["responseStatus"]["code"].as_u64().and_then(|c| u16::try_from(c).ok()).unwrap_or(0),
    };
    Some((name.to_string(), judged))
}

impl Side {
    /// Reads an API server's audit log (JSON lines; a line cut short by a kill is skipped) for
    /// how the writer webhook judged each create. Of several records of one name (a retried
    /// create) the committed one (201) is kept, else the one judged at the newest Lease version
    /// (the one least likely to be before a takeover).
    pub fn judged_by_audit(&mut self, log: &std::path::Path) {
        let Ok(text) = std::fs::read_to_string(log) else { return };
        for event in text.lines().filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok()) {
            let Some((name, judged)) = judged_of(&event) else { continue };
            let keep = |old: &Judged| (old.code == 201, old.lease_version) >= (judged.code == 201, judged.lease_version);
            if !self.judged.get(&name).is_some_and(keep) {
                self.judged.insert(name, judged);
            }
        }
    }

    /// Of the created ConfigMaps the watches saw, how many have an audit record of their
    /// judgement, and how many there are.
    pub fn audited_creates(&self) -> (usize, usize) {
        (self.created.len() - self.unaudited_creates().len(), self.created.len())
    }

    /// The created ConfigMaps the audit logs have no judgement for, each with what its writer
    /// said when it sent it (the fault in place, the API server): where a record is missing
    /// (an API server killed between the commit and its audit line, say), the run names it.
    pub fn unaudited_creates(&self) -> Vec<String> {
        let mut missing: Vec<String> =
            self.created.values().filter(|c| !self.judged.contains_key(&c.name)).map(|c| format!("{} ({})", c.name, c.said)).collect();
        missing.sort();
        missing
    }

    /// Per Lease, the acquisitions no watch delivered: tokens are consecutive (one more
    /// `leaseTransitions` per acquisition), so a token missing between the first and the last
    /// seen is one. A write attributed past such a gap may be attributed to an older grant of its
    /// Pod. Of those, the ones the API server's answers name ([`Answers`]) are known all the same.
    pub fn unseen_grants(&self) -> BTreeMap<String, Unseen> {
        let mut tokens: BTreeMap<&str, (BTreeSet<u64>, BTreeSet<u64>)> = BTreeMap::new();
        for ((lease, _), (_, token, by)) in &self.grants_seen {
            let (any, watched) = tokens.entry(lease).or_default();
            any.insert(token.get());
            if by.iter().any(|b| *b != 'r') {
                watched.insert(token.get());
            }
        }
        tokens
            .into_iter()
            .filter_map(|(lease, (any, watched))| {
                let (first, last) = (*any.first()?, *any.last()?);
                let unseen = Unseen {
                    first,
                    last,
                    by_no_watch: (first..=last).filter(|t| !watched.contains(t)).collect(),
                    by_nothing: (first..=last).filter(|t| !any.contains(t)).collect(),
                };
                Some((lease.to_string(), unseen))
            })
            .collect()
    }

    /// What the watches saw around a violation on a client-go Lease path, in words: the Lease's
    /// acquisitions from the one before the writer's grant to two after the newer one (each: the
    /// holder identity, the resourceVersions of its versions, which API servers' watches delivered
    /// them), and the object's last versions up to the violating one and the next (each with what
    /// its writer wrote beside its name). `None` for a violation of another kind or path.
    pub fn explain(&self, violation: &Violation) -> Option<String> {
        let Violation::StaleHolderWriteAccepted { object, grant, newer, resource_version, .. } = violation else { return None };
        let lease = Path::of_object(object).filter(|p| Path::ELECTED.contains(p))?.key();
        let (from, to) = (grant.get().saturating_sub(1), newer.get() + 2);
        let mut acquisitions: BTreeMap<u64, (String, u64, u64, usize, BTreeSet<char>)> = BTreeMap::new();
        for ((l, rv), (identity, token, by)) in &self.grants_seen {
            if l != &lease || !(from..=to).contains(&token.get()) {
                continue;
            }
            let a = acquisitions.entry(token.get()).or_insert_with(|| (identity.clone(), *rv, *rv, 0, BTreeSet::new()));
            a.2 = *rv;
            a.3 += 1;
            a.4.extend(by);
        }
        let mut text = format!("{violation}\n    Lease {lease}, tokens {from} to {to}:");
        for token in from..=to {
            match acquisitions.get(&token) {
                Some((identity, first, last, n, by)) => {
                    let by: String = by.iter().collect();
                    text += &format!("\n      {token}: {identity}, resourceVersion {first}..{last} ({n} versions, seen through {by})");
                }
                None => text += &format!("\n      {token}: never seen"),
            }
        }
        let versions: Vec<_> = self.writes_seen.range((object.clone(), 0)..=(object.clone(), u64::MAX)).collect();
        let at = versions.iter().position(|((_, rv), _)| rv == resource_version).unwrap_or(versions.len());
        text += &format!("\n    {object}, its versions up to the violating one and the next:");
        for ((_, rv), said) in &versions[at.saturating_sub(6)..(at + 2).min(versions.len())] {
            text += &format!("\n      {rv}: {said}");
        }
        if let Some(created) = self.created.get(resource_version) {
            text += &match self.judged.get(&created.name) {
                Some(j) => format!(
                    "\n    the audit log: its create was judged for holder {} at Lease version {} (answer {})",
                    j.holder, j.lease_version, j.code
                ),
                None => format!("\n    the audit logs keep no judgement of the create of {}", created.name),
            };
        }
        Some(text)
    }
}

/// The acquisitions of one Lease a run did not see ([`Side::unseen_grants`]).
#[derive(Clone, Debug, Default)]
pub struct Unseen {
    /// The first and last token seen.
    pub first: u64,
    pub last: u64,
    /// Tokens between them no watch delivered.
    pub by_no_watch: Vec<u64>,
    /// Of those, the ones no answer named either: nothing of them was seen.
    pub by_nothing: Vec<u64>,
}

/// A create by a Pod that led when it was judged, committed after a successor's write: the
/// CREATE window of docs/design.md §6b (not promised; reported, not a violation).
#[derive(Clone, Debug)]
pub struct InWindow {
    pub violation: Violation,
    /// The created object, and what its writer said.
    pub object: String,
    pub said: String,
    /// What shows it was judged before the takeover.
    pub shown_by: Shown,
}

/// What shows a create was judged before the next acquisition of its Lease: the API server's
/// audit log, in which the writer webhook admitted it reading a version of the Lease (`read`) held
/// by the create's own writer identity (one per acquisition), older than the first version seen
/// of any later acquisition (`takeover`; `None`: none was seen). Beside it, whether the timestamps
/// alone would have shown it (`creationTimestamp`, whole seconds, plus a second, no later than the
/// next acquisition's `acquireTime`), as the chunks before the audit record judged: how often
/// they could not, and so what those chunks could not place.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Shown {
    pub read: u64,
    pub takeover: Option<u64>,
    pub by_timestamps: bool,
}

impl std::fmt::Display for Shown {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the audit log: judged for its own holder at Lease version {}", self.read)?;
        if let Some(takeover) = self.takeover {
            write!(f, ", before the takeover at {takeover}")?;
        }
        let timestamps = if self.by_timestamps { "would have shown it too" } else { "could not have shown it" };
        write!(f, "; the timestamps alone {timestamps}")
    }
}

/// Splits the checker's findings: a [`Violation::StaleHolderWriteAccepted`] on [`MADE`] that
/// was judged while its writer still held the Lease — the webhook admitted it correctly and the
/// commit came after the takeover: §6b's window, which a create has because it has no stored
/// object to swap against. Only the create's audit record shows it ([`Side::judged_by_audit`],
/// [`Shown`]): the webhook's quorum read returned the Lease held by the create's own writer
/// identity (a fresh one per acquisition, so no successor had taken it yet), at a version older
/// than any later acquisition seen. Timestamps do not: the API server sets `creationTimestamp`
/// before it calls the webhook, and the call may come after the takeover. Anything else — no
/// record, or a record that says otherwise — stays a violation.
pub fn creates_in_window(violations: Vec<Violation>, side: &Mutex<Side>) -> (Vec<Violation>, Vec<InWindow>) {
    let Ok(side) = side.lock() else { return (violations, Vec::new()) };
    let key = Path::FencedController.key();
    let (mut kept, mut window) = (Vec::new(), Vec::new());
    for v in violations {
        let found = match &v {
            Violation::StaleHolderWriteAccepted { object, grant, resource_version, .. } if object == MADE => {
                side.created.get(resource_version).and_then(|created| Some((created, side.judged_before_takeover(&key, *grant, created)?)))
            }
            _ => None,
        };
        match found {
            Some((created, shown_by)) => {
                window.push(InWindow { violation: v, object: created.name.clone(), said: created.said.clone(), shown_by })
            }
            None => kept.push(v),
        }
    }
    (kept, window)
}

impl Side {
    /// What shows that `created`, written under `grant` of Lease `key`, was judged before the next
    /// acquisition ([`creates_in_window`]); `None` when nothing does.
    fn judged_before_takeover(&self, key: &str, grant: Token, created: &Created) -> Option<Shown> {
        let judged = self.judged.get(&created.name)?;
        let takeover = self.grants_seen.iter().filter(|((l, _), (_, t, _))| l == key && *t > grant).map(|((_, rv), _)| *rv).min();
        let before = judged.holder == created.identity && takeover.is_none_or(|t| judged.lease_version < t);
        before.then(|| Shown { read: judged.lease_version, takeover, by_timestamps: self.by_timestamps(key, grant, created) })
    }

    /// Whether `created`'s `creationTimestamp` (whole seconds, so rounded up by a second) is no
    /// later than the next acquisition's `acquireTime` (corrected for a skewed clock): the rule
    /// the chunks before the audit record placed a late create by.
    fn by_timestamps(&self, key: &str, grant: Token, created: &Created) -> bool {
        let next = self.acquired.range((key.to_string(), grant)..).find(|((l, t), _)| l == key && *t > grant).map(|(_, (at, who))| {
            let off = self.clocks.get(who).copied().unwrap_or(SignedDuration::ZERO);
            at.saturating_sub(off).unwrap_or(*at)
        });
        let taken_in_by = created.at.saturating_add(SignedDuration::from_secs(1)).unwrap_or(created.at);
        next.is_some_and(|next| taken_in_by <= next)
    }
}

/// What one write of a cycle does.
#[derive(Clone, Debug)]
enum Step {
    /// Read, then patch this object.
    Patch(String),
    /// Create a new ConfigMap (the fenced controller's made objects).
    Create,
    /// Read, then patch the annotations of [`CLUSTER`], a cluster-scoped object.
    PatchCluster,
}

/// Genuine writes, delayed writes and acquisitions on the client-go Lease paths.
#[derive(Default)]
pub struct PathStats {
    availability: Mutex<BTreeMap<(Path, Option<HaFault>), Availability>>,
    /// (path, "refused" / "accepted" / "failed") → delayed writes after a pause.
    delayed: Mutex<BTreeMap<(Path, &'static str), u64>>,
    /// Campaigns whose read or claim failed (a compare-and-swap lost to another Pod included).
    campaigns_failed: AtomicU64,
}

impl PathStats {
    pub(super) fn count(&self, path: Path, during: Option<(HaFault, Option<usize>)>, f: impl Fn(&mut Availability) -> &mut u64) {
        if let Ok(mut a) = self.availability.lock() {
            *f(a.entry((path, during.map(|d| d.0))).or_default()) += 1;
        }
    }
    pub(super) fn via(&self, path: Path, during: Option<(HaFault, Option<usize>)>, via: usize, failed: bool) {
        if during.is_some_and(|d| d.1 == Some(via))
            && let Ok(mut a) = self.availability.lock()
        {
            let entry = a.entry((path, during.map(|d| d.0))).or_default();
            entry.via_target += 1;
            entry.via_target_failed += u64::from(failed);
        }
    }
    pub(super) fn slowest(&self, path: Path, during: Option<(HaFault, Option<usize>)>, millis: u64) {
        if let Ok(mut a) = self.availability.lock() {
            let entry = a.entry((path, during.map(|d| d.0))).or_default();
            entry.slowest_admitted_ms = entry.slowest_admitted_ms.max(millis);
        }
    }
    pub(super) fn delayed(&self, path: Path, outcome: &'static str) {
        if let Ok(mut d) = self.delayed.lock() {
            *d.entry((path, outcome)).or_default() += 1;
        }
    }
    pub fn availability(&self) -> BTreeMap<(Path, Option<HaFault>), Availability> {
        self.availability.lock().map(|a| a.clone()).unwrap_or_default()
    }
    pub fn delayed_counts(&self) -> BTreeMap<(Path, &'static str), u64> {
        self.delayed.lock().map(|d| d.clone()).unwrap_or_default()
    }
    pub fn campaigns_failed(&self) -> u64 {
        self.campaigns_failed.load(Ordering::Relaxed)
    }
}

/// The Pods of one path, each with a client through API server A and one through B.
pub struct Pods {
    pub path: Path,
    names: Vec<String>,
    clients: Vec<[Client; 2]>,
    ns: String,
    /// Created ConfigMaps so far (their names).
    made: AtomicU64,
    /// Per Pod: the Lease record it last saw (holder, renewTime, transitions) and when it first saw
    /// it, by its own monotonic clock — client-go's `observedTime`.
    observed: Mutex<BTreeMap<usize, (String, Instant)>>,
    /// What the API server answered to the Pods' claims, renewals and writes that it committed.
    answers: Mutex<Answers>,
}

/// Versions the API server committed and returned to a Pod, recorded beside what the watches
/// deliver: a watch that lists again after a gap delivers only the newest version, so an
/// acquisition can reach no watch at all; the answer to the claim names it. An answer is the
/// server's (a committed version with its resourceVersion), not what a client believed; a
/// version committed whose answer was lost is left to the watches.
#[derive(Default)]
struct Answers {
    /// (Lease key, resourceVersion, holder identity, token).
    grants: Vec<(String, u64, String, Token)>,
    /// (object, resourceVersion, writer Pod, what it wrote beside its name).
    writes: Vec<(String, u64, String, String)>,
}

/// A ServiceAccount token bound to Pod `pod`, valid for a day (a long run outlasts the tests'
/// usual hour).
async fn pod_token(admin: &Client, ns: &str, account: &str, pod: &Pod) -> String {
    use k8s_openapi::api::authentication::v1::{BoundObjectReference, TokenRequest, TokenRequestSpec};
    let request = TokenRequest {
        spec: Some(TokenRequestSpec {
            bound_object_ref: Some(BoundObjectReference {
                api_version: Some("v1".into()),
                kind: Some("Pod".into()),
                name: pod.metadata.name.clone(),
                uid: pod.metadata.uid.clone(),
            }),
            expiration_seconds: Some(24 * 3600),
            ..Default::default()
        }),
        ..Default::default()
    };
    let issued = Api::<ServiceAccount>::namespaced(admin.clone(), ns)
        .create_token_request(account, &PostParams::default(), &request)
        .await
        .expect("a Pod-bound token");
    issued.status.and_then(|s| s.token).expect("token in the TokenRequest status")
}

async fn client_with_token(kubeconfig: &std::path::Path, token: &str) -> Client {
    let kubeconfig = kube_fence_test_support::identity::kubeconfig_with_token(kubeconfig, token);
    let config = kube::Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await.expect("kubeconfig is usable");
    Client::try_from(config).expect("client from kubeconfig")
}

/// ServiceAccount `account` of `ns` may campaign on Leases and write ConfigMaps there, as a
/// controller's Role lets it.
async fn controller_rbac(admin: &Client, ns: &str, account: &str) {
    use k8s_openapi::api::rbac::v1::{Role, RoleBinding};
    let sa: ServiceAccount = serde_json::from_value(json!({"metadata": {"name": account}})).expect("a literal");
    Api::<ServiceAccount>::namespaced(admin.clone(), ns).create(&PostParams::default(), &sa).await.expect("create the ServiceAccount");
    let pp = PatchParams::apply("kube-fence-tests").force();
    let role: Role = serde_json::from_value(json!({"metadata": {"name": account, "namespace": ns},
        "rules": [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["*"]},
                  {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["*"]}]}))
    .expect("a literal");
    Api::<Role>::namespaced(admin.clone(), ns).patch(account, &pp, &Patch::Apply(&role)).await.expect("role");
    let binding: RoleBinding = serde_json::from_value(json!({"metadata": {"name": account, "namespace": ns},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": ns}]}))
    .expect("a literal");
    Api::<RoleBinding>::namespaced(admin.clone(), ns).patch(account, &pp, &Patch::Apply(&binding)).await.expect("role binding");
}

/// The cluster-scoped object of the fenced controller ([`CLUSTER`], a Namespace of its own made
/// by the admin), which ServiceAccount `account` of `ns` may read and patch, and nothing else
/// cluster-wide.
async fn cluster_object_rbac(admin: &Client, ns: &str, account: &str) {
    let name = cluster_object(ns);
    let object: Namespace = serde_json::from_value(json!({"metadata": {"name": name}})).expect("a literal");
    Api::<Namespace>::all(admin.clone()).create(&PostParams::default(), &object).await.expect("create the cluster-scoped object");
    crate::common::leader::may_patch_a_namespace(admin, ns, account, &name).await;
}

/// Sets both paths up (before the watches start, so the probes below leave nothing in the
/// recorded history): ServiceAccounts, Pods, their clients, the Leases and the objects, the
/// FencedController; with `fenced`, waits until both API servers send each path's writes to
/// kube-fence and judge its Lease claims by the holder policies.
pub async fn setup(admin: &[Client; 2], kubeconfigs: &[PathBuf; 2], ns: &str, pods_per_path: usize, fenced: bool) -> Vec<Pods> {
    let mut paths = Vec::new();
    for path in Path::ELECTED {
        let account = path.account();
        controller_rbac(&admin[0], ns, account).await;
        let names: Vec<String> = (0..pods_per_path).map(|i| format!("{account}-{i}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let made = kube_fence_test_support::identity::pods_of(&admin[0], ns, account, &refs).await;
        let mut clients = Vec::new();
        for pod in &made {
            let token = pod_token(&admin[0], ns, account, pod).await;
            clients.push([client_with_token(&kubeconfigs[0], &token).await, client_with_token(&kubeconfigs[1], &token).await]);
        }
        paths.push(Pods {
            path,
            names,
            clients,
            ns: ns.to_string(),
            made: AtomicU64::new(0),
            observed: Mutex::default(),
            answers: Mutex::default(),
        });
    }
    for pods in &paths {
        kube_fence_test_support::identity::wait_authorized(&pods.clients[0][0], ns, "coordination.k8s.io", "leases", "update").await;
        kube_fence_test_support::identity::wait_authorized(&pods.clients[0][1], ns, "", "configmaps", "create").await;
    }
    let cms: Api<ConfigMap> = Api::namespaced(admin[0].clone(), ns);
    let configmap = |name: &str, labels: BTreeMap<String, String>| ConfigMap {
        metadata: ObjectMeta { name: Some(name.to_string()), labels: Some(labels), ..Default::default() },
        data: Some([("seq".to_string(), "0".to_string())].into()),
        ..Default::default()
    };

    // The leader-Lease path: the Lease opted into holder binding (no holder yet), and its objects
    // labelled by the admin (who may opt objects in).
    let leader = Path::LeaderLease;
    let lease: LeaderLease = serde_json::from_value(json!({"metadata": {"name": leader.lease(),
        "labels": {HOLDER_IDENTITY_LABEL: HOLDER_IS_POD}}, "spec": {}}))
    .expect("a literal");
    Api::<LeaderLease>::namespaced(admin[0].clone(), ns).create(&PostParams::default(), &lease).await.expect("create the leader Lease");
    for j in 0..LED_OBJECTS {
        let labels = [(LEADER_LEASE_LABEL.to_string(), leader.lease().to_string())].into();
        cms.create(&PostParams::default(), &configmap(&format!("{LED_PREFIX}{j}"), labels)).await.expect("create a leader-bound object");
    }

    // The fenced controller: its Lease created by one of its Pods as client-go would (no
    // kube-fence label), its unlabelled ConfigMap, then the admin's FencedController.
    let ctl = Path::FencedController;
    let lease: LeaderLease = serde_json::from_value(json!({"metadata": {"name": ctl.lease()}, "spec": {}})).expect("a literal");
    Api::<LeaderLease>::namespaced(paths[1].clients[0][0].clone(), ns)
        .create(&PostParams::default(), &lease)
        .await
        .expect("a controller Pod creates its Lease");
    cms.create(&PostParams::default(), &configmap(STATE, BTreeMap::new())).await.expect("create the controller's ConfigMap");
    cluster_object_rbac(&admin[0], ns, ctl.account()).await;
    for api in 0..2 {
        let namespaces = paths[1].namespaces(0, api);
        let deadline = Instant::now() + Duration::from_secs(30);
        while !matches!(bounded(namespaces.get(&cluster_object(ns))).await, Some(Ok(_))) {
            assert!(Instant::now() < deadline, "the controller may read its cluster-scoped object through API server {api} within 30 s");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let mut fence = FencedController::new(
        ctl.lease(),
        FencedControllerSpec {
            lease: ctl.lease().into(),
            service_accounts: vec![ctl.account().into()],
            exempt: Vec::new(),
            mode: FenceMode::Enforce,
        },
    );
    fence.metadata.namespace = Some(ns.to_string());
    Api::<FencedController>::namespaced(admin[0].clone(), ns)
        .create(&PostParams::default(), &fence)
        .await
        .expect("the admin fences the controller");

    if fenced {
        for (api, admin) in admin.iter().enumerate() {
            for pods in &paths {
                pods.wait_judged(admin, api).await;
            }
        }
    }
    paths
}

/// Whether an API error is kube-fence's 409 NotHolder.
fn not_holder(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(s) if s.code == 409 && s.reason == Reason::NotHolder.as_str())
}

fn wrote<K>(r: Option<Result<K, kube::Error>>) -> Wrote {
    match r {
        Some(Ok(_)) => Wrote::Accepted,
        Some(Err(e)) if not_holder(&e) => Wrote::Stale,
        Some(Err(kube::Error::Api(s))) => Wrote::Failed(format!("HTTP {} {}: {}", s.code, s.reason, short(&s.message))),
        Some(Err(_)) => Wrote::Failed("transport error".into()),
        None => Wrote::Failed("client timeout (8 s)".into()),
    }
}

/// How a campaign went.
enum Campaign {
    /// This Pod holds the Lease now; the claim was sent at this instant.
    Acquired(Instant),
    /// Another holds it and its lease has not run out.
    Held,
    /// The read or the claim failed (a lost compare-and-swap included).
    Failed,
}

impl Pods {
    fn leases(&self, me: usize, api: usize) -> Api<LeaderLease> {
        Api::namespaced(self.clients[me][api].clone(), &self.ns)
    }
    fn cms(&self, me: usize, api: usize) -> Api<ConfigMap> {
        Api::namespaced(self.clients[me][api].clone(), &self.ns)
    }
    fn namespaces(&self, me: usize, api: usize) -> Api<Namespace> {
        Api::all(self.clients[me][api].clone())
    }
    /// The objects a leader writes in a cycle.
    fn steps(&self) -> Vec<Step> {
        match self.path {
            Path::LeaderLease => (0..LED_OBJECTS).map(|j| Step::Patch(format!("{LED_PREFIX}{j}"))).collect(),
            _ => vec![Step::Patch(STATE.to_string()), Step::Create, Step::PatchCluster],
        }
    }

    /// Waits (at most 60 s) until API server `api` sends this path's writes by a Pod that does not
    /// hold the Lease to kube-fence (refused, 409 NotHolder) and refuses a claim of the Lease in
    /// another Pod's name (the holder policies). An admitted probe is undone by the admin.
    async fn wait_judged(&self, admin: &Client, api: usize) {
        let (ns, lease) = (self.ns.as_str(), self.path.lease());
        let admin_cms: Api<ConfigMap> = Api::namespaced(admin.clone(), ns);
        let admin_leases: Api<LeaderLease> = Api::namespaced(admin.clone(), ns);
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let write = match self.path {
                Path::LeaderLease => {
                    let probe = Patch::Merge(json!({"data": {"probe": "a write by no holder"}}));
                    bounded(self.cms(1, api).patch(&format!("{LED_PREFIX}0"), &PatchParams::default(), &probe)).await
                }
                _ => {
                    let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": "ha-ctl-probe"}})).expect("a literal");
                    let made = bounded(self.cms(1, api).create(&PostParams::default(), &cm)).await;
                    if let Some(Ok(_)) = made {
                        let _ = admin_cms.delete("ha-ctl-probe", &DeleteParams::default()).await;
                    }
                    made
                }
            };
            let claim = Patch::Merge(json!({"spec": {"holderIdentity": format!("{}_probe", self.names[0])}}));
            let spoofed = bounded(self.leases(1, api).patch(lease, &PatchParams::default(), &claim)).await;
            if let Some(Ok(_)) = spoofed {
                let _ = admin_leases.patch(lease, &PatchParams::default(), &Patch::Merge(json!({"spec": {"holderIdentity": null}}))).await;
            }
            let write_refused = matches!(&write, Some(Err(e)) if not_holder(e));
            let claim_refused = matches!(&spoofed, Some(Err(kube::Error::Api(s))) if s.code == 403 || s.code == 422);
            if write_refused && claim_refused {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{} through API server {api}: not judged within 60 s (write: {:?}; spoofed claim: {:?})",
                self.path.describe(),
                write.map(|r| r.map(|_| "admitted")),
                spoofed.map(|r| r.map(|_| "admitted"))
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// One campaign, as client-go's LeaseLock makes it: read the Lease; if it is free, or its
    /// record (holder, `renewTime`, transitions) has not changed for `leaseDurationSeconds` since
    /// this Pod first saw it (client-go's `observedTime`, a local monotonic clock: the times in
    /// the record are the holder's, never compared with this Pod's clock), claim it by a
    /// compare-and-swap.
    /// `clock`: how far this Pod's clock is off ([`HaFault::ClientClockSkewed`]); it judges and
    /// writes times by it, as a Pod on a skewed node does.
    async fn campaign(&self, me: usize, api: usize, identity: &str, lease_seconds: u32, clock: SignedDuration) -> Campaign {
        let leases = self.leases(me, api);
        let Some(Ok(current)) = bounded(leases.get(self.path.lease())).await else { return Campaign::Failed };
        let spec = current.spec.clone().unwrap_or_default();
        let now = skewed(clock);
        let record = format!("{:?} {:?} {:?}", spec.holder_identity, spec.renew_time, spec.lease_transitions);
        let observed_at = match self.observed.lock() {
            Ok(mut observed) => match observed.get(&me) {
                Some((seen, at)) if *seen == record => *at,
                _ => {
                    observed.insert(me, (record, Instant::now()));
                    Instant::now()
                }
            },
            Err(_) => Instant::now(),
        };
        let duration = Duration::from_secs(u64::try_from(spec.lease_duration_seconds.unwrap_or(0)).unwrap_or(0));
        let free = spec.holder_identity.as_deref().unwrap_or_default().is_empty();
        if !free && observed_at.elapsed() < duration {
            return Campaign::Held;
        }
        let mut claim = current;
        claim.spec = Some(LeaderLeaseSpec {
            holder_identity: Some(identity.to_string()),
            lease_duration_seconds: Some(lease_seconds as i32),
            acquire_time: Some(MicroTime(now)),
            renew_time: Some(MicroTime(now)),
            lease_transitions: Some(spec.lease_transitions.unwrap_or(0) + 1),
            ..Default::default()
        });
        let sent = Instant::now();
        match bounded(leases.replace(self.path.lease(), &PostParams::default(), &claim)).await {
            Some(Ok(lease)) => {
                self.answered_lease(&lease);
                Campaign::Acquired(sent)
            }
            _ => Campaign::Failed,
        }
    }

    /// Renews `identity`'s hold: `Some(true)` renewed, `Some(false)` another holds it now,
    /// `None` the renewal did not get through.
    async fn renew(&self, me: usize, api: usize, identity: &str, clock: SignedDuration) -> Option<bool> {
        let leases = self.leases(me, api);
        let mut current = bounded(leases.get(self.path.lease())).await?.ok()?;
        let spec = current.spec.get_or_insert_default();
        if spec.holder_identity.as_deref() != Some(identity) {
            return Some(false);
        }
        spec.renew_time = Some(MicroTime(skewed(clock)));
        let renewed = bounded(leases.replace(self.path.lease(), &PostParams::default(), &current)).await?.ok()?;
        self.answered_lease(&renewed);
        Some(true)
    }

    /// Notes a version of the Lease the API server committed and answered with.
    fn answered_lease(&self, lease: &LeaderLease) {
        if let (Some((holder, token, rv)), Ok(mut answers)) = (held_by(lease), self.answers.lock()) {
            answers.grants.push((self.path.key(), rv, holder, token));
        }
    }

    /// Notes a version of an object the API server committed and answered with (`logical`: the
    /// object it is recorded as, for the created ConfigMaps).
    fn answered_write(&self, written: &Option<Result<ConfigMap, kube::Error>>, pod: &str, logical: Option<&str>) {
        let Some(Ok(cm)) = written else { return };
        let object = logical.map_or_else(|| cm.name_any(), str::to_string);
        self.answered(object, version_of(cm), pod, said_of(pod, &cm.data.clone().unwrap_or_default(), &cm.name_any()));
    }

    /// Notes a version of [`CLUSTER`] the API server committed and answered with.
    fn answered_cluster(&self, written: &Option<Result<Namespace, kube::Error>>, pod: &str) {
        let Some(Ok(object)) = written else { return };
        self.answered(CLUSTER.to_string(), version_of(object), pod, said_of(pod, &cluster_fields(object), &object.name_any()));
    }

    fn answered(&self, object: String, rv: Option<u64>, pod: &str, said: String) {
        if let (Some(rv), Ok(mut answers)) = (rv, self.answers.lock()) {
            answers.writes.push((object, rv, pod.to_string(), said));
        }
    }

    /// Releases as client-go does (`ReleaseOnCancel`): the holder cleared, if it is still this one.
    async fn release(&self, me: usize, api: usize, identity: &str, clock: SignedDuration) {
        let leases = self.leases(me, api);
        let Some(Ok(mut current)) = bounded(leases.get(self.path.lease())).await else { return };
        let spec = current.spec.get_or_insert_default();
        if spec.holder_identity.as_deref() != Some(identity) {
            return;
        }
        spec.holder_identity = Some(String::new());
        spec.lease_duration_seconds = Some(1);
        spec.renew_time = Some(MicroTime(skewed(clock)));
        let _ = bounded(leases.replace(self.path.lease(), &PostParams::default(), &current)).await;
    }

    /// One write of `step` by Pod `me` through API server `api`, naming itself as the writer
    /// (what the checker attributes the version to). A patch has no resourceVersion
    /// precondition: kube-fence alone decides. `(note, during)`: what the write is, and the fault in place.
    async fn write(&self, me: usize, api: usize, step: &Step, read: Option<u64>, identity: &str, (note, during): (&str, &str)) -> Wrote {
        let pod = &self.names[me];
        let via = super::api_letter(api).to_string();
        let seq = read.unwrap_or(0) + 1;
        match step {
            Step::Patch(object) => {
                let patch = json!({"data": {"seq": seq.to_string(), "writer": pod, "identity": identity, "note": note, "via": via, "during": during}});
                let written = bounded(self.cms(me, api).patch(object, &PatchParams::default(), &Patch::Merge(patch))).await;
                self.answered_write(&written, pod, None);
                wrote(written)
            }
            Step::Create => {
                let n = self.made.fetch_add(1, Ordering::Relaxed);
                let cm: ConfigMap = serde_json::from_value(json!({"metadata": {"name": format!("ha-made-{pod}-{n}"),
                    "labels": {MADE_LABEL: "true"}}, "data": {"writer": pod, "identity": identity, "note": note, "via": via, "during": during}}))
                .expect("a literal");
                let written = bounded(self.cms(me, api).create(&PostParams::default(), &cm)).await;
                self.answered_write(&written, pod, Some(MADE));
                wrote(written)
            }
            Step::PatchCluster => {
                let fields = [
                    ("seq", seq.to_string().as_str()),
                    ("writer", pod),
                    ("identity", identity),
                    ("note", note),
                    ("via", &via),
                    ("during", during),
                ]
                .map(|(k, v)| (format!("{CLUSTER_ANNOTATIONS}{k}"), v.to_string()));
                let patch = json!({"metadata": {"annotations": BTreeMap::from(fields)}});
                let written =
                    bounded(self.namespaces(me, api).patch(&cluster_object(&self.ns), &PatchParams::default(), &Patch::Merge(patch))).await;
                self.answered_cluster(&written, pod);
                wrote(written)
            }
        }
    }

    /// A read before a patch: the sequence number the object's last write left (`Ok(None)` for a
    /// create, which reads nothing).
    async fn read(&self, me: usize, api: usize, step: &Step) -> Result<Option<u64>, String> {
        let seq = |fields: Option<&BTreeMap<String, String>>| fields.and_then(|f| f.get("seq")).and_then(|s| s.parse::<u64>().ok());
        match step {
            Step::Create => Ok(None),
            Step::Patch(object) => match bounded(self.cms(me, api).get(object)).await {
                Some(Ok(cm)) => Ok(Some(seq(cm.data.as_ref()).unwrap_or(0))),
                other => Err(super::read_cause(other)),
            },
            Step::PatchCluster => match bounded(self.namespaces(me, api).get(&cluster_object(&self.ns))).await {
                Some(Ok(object)) => Ok(Some(seq(Some(&cluster_fields(&object))).unwrap_or(0))),
                other => Err(super::read_cause(other)),
            },
        }
    }
}

/// Renews a hold in the background while the leader writes, as client-go's renew loop does, and
/// says whether the leader may still believe it leads: its last renewal that got through was sent
/// less than a lease duration ago, and no renewal found another holder.
struct KeepAlive {
    stop: CancellationToken,
    task: JoinHandle<()>,
    state: Arc<Mutex<(Instant, bool)>>,
    lease: Duration,
}

impl KeepAlive {
    fn start(world: Arc<World>, path: usize, me: usize, api: usize, identity: String, since: Instant, clock: SignedDuration) -> KeepAlive {
        let lease = Duration::from_secs(u64::from(world.config.lease_seconds));
        let state = Arc::new(Mutex::new((since, false)));
        let stop = CancellationToken::new();
        let (s, st) = (state.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let pods = &world.elected[path];
            loop {
                tokio::select! { _ = st.cancelled() => return, _ = tokio::time::sleep(lease / 4) => {} }
                let sent = Instant::now();
                match pods.renew(me, api, &identity, clock).await {
                    Some(true) => {
                        if let Ok(mut s) = s.lock() {
                            s.0 = sent;
                        }
                    }
                    Some(false) => {
                        if let Ok(mut s) = s.lock() {
                            s.1 = true;
                        }
                        return;
                    }
                    None => {}
                }
            }
        });
        KeepAlive { stop, task, state, lease }
    }
    fn holding(&self) -> bool {
        self.state.lock().map(|s| !s.1 && s.0.elapsed() < self.lease).unwrap_or(false)
    }
    async fn stop(self) {
        self.stop.cancel();
        let _ = self.task.await;
    }
}

/// Worker `me` of path `path`: campaign, then a normal cycle (renewing, each step read then
/// written while it believes it leads) or a pause cycle (read, stop past the lease, the delayed
/// write), then release.
pub async fn worker(world: Arc<World>, path: usize, me: usize) {
    let pods = &world.elected[path];
    let p = pods.path;
    let stats = &world.stats.paths;
    let mut rng = Rng(world.config.seed ^ 0x000C_00D1_7A7E ^ ((path as u64) << 32 | me as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let lease_seconds = world.config.lease_seconds;
    let mut term = 0u64;
    while !world.stop.is_cancelled() {
        let (via_lease, via_write) = (rng.below(2) as usize, rng.below(2) as usize);
        term += 1;
        // client-go's identity: the Pod's hostname (its name), `_`, and a fresh suffix per run.
        let identity = format!("{}_{term}", pods.names[me]);
        let clock = world.skew(&mut rng).unwrap_or(SignedDuration::ZERO);
        if !clock.is_zero()
            && let Ok(mut side) = world.side.lock()
        {
            side.clocks.insert(identity.clone(), clock);
        }
        let since = match pods.campaign(me, via_lease, &identity, lease_seconds, clock).await {
            Campaign::Acquired(at) => at,
            Campaign::Held => {
                tokio::time::sleep(rng.millis(100, 400)).await;
                continue;
            }
            Campaign::Failed => {
                stats.campaigns_failed.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(rng.millis(100, 400)).await;
                continue;
            }
        };
        let steps = pods.steps();
        if rng.percent(world.config.pause_percent) {
            // Honest but stale: the Pod reads, then stops itself (what SIGSTOP or a long GC pause
            // does) past its lease without renewing, then sends the write it had prepared. Another
            // Pod may have taken the Lease meanwhile: kube-fence must refuse the write then.
            let step = &steps[rng.below(steps.len() as u64) as usize];
            if let Ok(read) = pods.read(me, via_write, step).await {
                tokio::time::sleep(Duration::from_secs(u64::from(lease_seconds)) + rng.millis(300, 1_500)).await;
                let during = during_of(&world);
                let outcome = match pods.write(me, via_write, step, read, &identity, ("delayed", &during)).await {
                    Wrote::Accepted => "accepted",
                    Wrote::Stale => "refused",
                    Wrote::Failed(_) => "failed",
                };
                stats.delayed(p, outcome);
            }
        } else {
            // A leader writes for a while: its steps, one to three times.
            let keep_alive = KeepAlive::start(world.clone(), path, me, via_lease, identity.clone(), since, clock);
            let rounds = 1 + rng.below(3) as usize;
            for step in steps.iter().cycle().take(rounds * steps.len()) {
                if !keep_alive.holding() {
                    break;
                }
                let during = world.stats.current();
                let sent = Instant::now();
                stats.count(p, during, |a| &mut a.attempted);
                let read = match pods.read(me, via_write, step).await {
                    Ok(read) => read,
                    Err(why) => {
                        stats.count(p, during, |a| &mut a.failed);
                        stats.via(p, during, via_write, true);
                        world.stats.cause(during, via_write, format!("[{}] {why}", p.describe()));
                        break;
                    }
                };
                let wrote = pods.write(me, via_write, step, read, &identity, ("normal", &during_of(&world))).await;
                stats.via(p, during, via_write, matches!(wrote, Wrote::Failed(_)));
                match wrote {
                    Wrote::Accepted => {
                        stats.count(p, during, |a| &mut a.admitted);
                        stats.slowest(p, during, sent.elapsed().as_millis() as u64);
                    }
                    // Its renewals did not get through in time and another Pod took over: the
                    // honest writer learns it from the refusal.
                    Wrote::Stale => {
                        stats.count(p, during, |a| &mut a.refused);
                        break;
                    }
                    Wrote::Failed(why) => {
                        stats.count(p, during, |a| &mut a.failed);
                        world.stats.cause(during, via_write, format!("[{}] {why}", p.describe()));
                        break;
                    }
                }
            }
            keep_alive.stop().await;
        }
        pods.release(me, via_lease, &identity, clock).await;
        // Let the other Pods campaign before this one does again.
        tokio::time::sleep(rng.millis(100, 500)).await;
    }
}

/// The scripted stale write on path `pods` (its Pods 0 and 1), as [`super::planted`] does for
/// kube-fence's leases: Pod 0 acquires through A and reads, is cut from A past its lease (no
/// renewal gets through), Pod 1 acquires through B once the lease ran out and writes every step
/// through B, and keeps the Lease; the cut heals and Pod 0's delayed writes go to A. `Some(true)`: one was admitted (a
/// violation the checker must report), `Some(false)`: all were refused (409 NotHolder).
pub async fn planted(plane: &Plane, world: &World, path: usize) -> Option<bool> {
    use kube_fence_testenv::ha::{Partition, Source};
    let pods = &world.elected[path];
    let lease_seconds = world.config.lease_seconds;
    let (old, new) = ("planted-old", "planted-new");
    let (old, new) = (format!("{}_{old}", pods.names[0]), format!("{}_{new}", pods.names[1]));
    let deadline = Instant::now() + Duration::from_secs(60);
    while !matches!(pods.campaign(0, 0, &old, lease_seconds, SignedDuration::ZERO).await, Campaign::Acquired(_)) {
        if Instant::now() > deadline {
            return None;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let steps = pods.steps();
    let mut reads = Vec::new();
    for step in &steps {
        reads.push(pods.read(0, 0, step).await.ok()?);
    }
    plane.call(|ha| ha.partition(Partition::ClientFromApi { api: 0, source: Source::Workers }).map_err(|e| format!("{e:#}"))).await.ok()?;
    let successor = async {
        // Pod 1 takes over once Pod 0's lease ran out (it cannot renew through the cut).
        loop {
            if let Campaign::Acquired(_) = pods.campaign(1, 1, &new, lease_seconds, SignedDuration::ZERO).await {
                break;
            }
            if Instant::now() > deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        for step in &steps {
            let read = pods.read(1, 1, step).await.ok()?;
            if !matches!(pods.write(1, 1, step, read, &new, ("planted-successor", "the scripted cut")).await, Wrote::Accepted) {
                return None;
            }
        }
        // Pod 1 keeps the Lease (it lets it run out): another holds it when Pod 0's writes arrive.
        Some(())
    }
    .await;
    plane.call(|ha| ha.heal().map_err(|e| format!("{e:#}"))).await.ok()?;
    plane.whole(Duration::from_secs(60)).await.ok()?;
    successor?;
    let mut accepted = false;
    for (step, read) in steps.iter().zip(&reads) {
        match pods.write(0, 0, step, *read, &old, ("planted-stale", "after the scripted cut")).await {
            Wrote::Accepted => accepted = true,
            Wrote::Stale => {}
            Wrote::Failed(_) => return None,
        }
    }
    Some(accepted)
}

/// The fault in place now, in words (for the written objects' `data.during`).
fn during_of(world: &World) -> String {
    match world.stats.current() {
        Some((fault, Some(api))) => format!("{} ({})", fault.describe(), super::api_letter(api)),
        Some((fault, None)) => fault.describe().to_string(),
        None => "no fault".into(),
    }
}

/// Now by a clock `clock` off.
fn skewed(clock: SignedDuration) -> Timestamp {
    Timestamp::now().saturating_add(clock).unwrap_or(Timestamp::now())
}

/// What a version of a path's object says of its write, beside its writer's name: the identity
/// it held, the API server it went through, the fault in place and the kind of write.
fn said_of(holder: &str, data: &BTreeMap<String, String>, name: &str) -> String {
    let field = |k: &str| data.get(k).cloned().unwrap_or_default();
    format!("{holder} as {}, sent through {} during {} ({}), {name}", field("identity"), field("via"), field("during"), field("note"))
}

/// Every answer the Pods of `paths` got (see [`Answers`]), as observations, noted in `side` as
/// seen through `r` (the response).
pub fn answered(paths: &[Pods], side: &Mutex<Side>) -> Vec<Observation> {
    let mut out = Vec::new();
    let Ok(mut side) = side.lock() else { return out };
    for pods in paths {
        let Ok(answers) = pods.answers.lock() else { continue };
        for (lease, rv, identity, token) in &answers.grants {
            side.grants_seen.entry((lease.clone(), *rv)).or_insert_with(|| (identity.clone(), *token, BTreeSet::new())).2.insert('r');
            out.push(Observation::Grant {
                lease: lease.clone(),
                holder: pod_of(identity).to_string(),
                token: *token,
                resource_version: *rv,
            });
        }
        for (object, rv, holder, said) in &answers.writes {
            side.writes_seen.entry((object.clone(), *rv)).or_insert_with(|| format!("{said} [answer]"));
            out.push(Observation::HolderWrite {
                object: object.clone(),
                lease: pods.path.key(),
                holder: holder.clone(),
                resource_version: *rv,
            });
        }
    }
    out
}

/// A version of a client-go Lease that names a holder, as the record keeps it: the holder
/// identity, the acquisition's token (`leaseTransitions` + 1, the same across renewals) and the
/// version's resourceVersion. `None` for a free Lease.
fn held_by(lease: &LeaderLease) -> Option<(String, Token, u64)> {
    let spec = lease.spec.as_ref()?;
    let holder = spec.holder_identity.clone().filter(|h| !h.is_empty())?;
    let token = Token::new(spec.lease_transitions.unwrap_or(0).max(0) as u64 + 1)?;
    let rv = version_of(lease)?;
    Some((holder, token, rv))
}

/// The Pod a holder identity names (`<pod>_<anything>`: the webhook's default identity rule).
fn pod_of(identity: &str) -> &str {
    identity.split('_').next().unwrap_or_default()
}

/// Records, through `client`, every version of both paths' Leases that names a holder (a grant
/// of the Pod it names, token `leaseTransitions + 1`) and every version of their objects that a
/// Pod wrote (a holder-only write by its `data.writer`).
/// `api`: the letter of the API server `client` talks to.
pub fn record(
    client: &Client,
    api: char,
    ns: &str,
    recorder: &Recorder,
    side: &Arc<Mutex<Side>>,
    stop: &CancellationToken,
) -> Vec<JoinHandle<()>> {
    let mut tasks = Vec::new();
    let leases: Api<LeaderLease> = Api::namespaced(client.clone(), ns);
    let (r, s, seen) = (recorder.clone(), stop.clone(), side.clone());
    tasks.push(tokio::spawn(async move {
        let mut events = watcher::watcher(leases, watcher::Config::default()).backoff(super::Steady).boxed();
        loop {
            let event = tokio::select! { _ = s.cancelled() => return, e = events.next() => e };
            let Some(event) = event else { return };
            let Ok(Event::Apply(lease) | Event::InitApply(lease)) = event else { continue };
            let Some(path) = Path::ELECTED.into_iter().find(|p| lease.name_any() == p.lease()) else { continue };
            if let Some((holder, token, resource_version)) = held_by(&lease) {
                if let Ok(mut seen) = seen.lock() {
                    if let Some(MicroTime(at)) = lease.spec.as_ref().and_then(|s| s.acquire_time.clone()) {
                        seen.acquired.entry((path.key(), token)).or_insert((at, holder.clone()));
                    }
                    let entry =
                        seen.grants_seen.entry((path.key(), resource_version)).or_insert_with(|| (holder.clone(), token, BTreeSet::new()));
                    entry.2.insert(api);
                }
                r.push(Observation::Grant { lease: path.key(), holder: pod_of(&holder).to_string(), token, resource_version });
            }
        }
    }));
    // (watch selector, the path, the recorded object's name: `None` its own).
    let streams: [(watcher::Config, Path, Option<&'static str>); 3] = [
        (watcher::Config::default().labels(&format!("{LEADER_LEASE_LABEL}={}", Path::LeaderLease.lease())), Path::LeaderLease, None),
        (watcher::Config::default().fields(&format!("metadata.name={STATE}")), Path::FencedController, None),
        (watcher::Config::default().labels(&format!("{MADE_LABEL}=true")), Path::FencedController, Some(MADE)),
    ];
    for (selector, path, logical) in streams {
        let cms: Api<ConfigMap> = Api::namespaced(client.clone(), ns);
        let (r, s, seen) = (recorder.clone(), stop.clone(), side.clone());
        tasks.push(tokio::spawn(async move {
            let mut events = watcher::watcher(cms, selector).backoff(super::Steady).boxed();
            loop {
                let event = tokio::select! { _ = s.cancelled() => return, e = events.next() => e };
                let Some(event) = event else { return };
                let Ok(Event::Apply(cm) | Event::InitApply(cm)) = event else { continue };
                let writer = cm.data.as_ref().and_then(|d| d.get("writer")).cloned();
                if let (Some(holder), Some(resource_version)) = (writer, version_of(&cm)) {
                    if let (Some(_), Some(created), Ok(mut seen)) = (logical, cm.metadata.creation_timestamp.as_ref(), seen.lock()) {
                        let data = cm.data.clone().unwrap_or_default();
                        let field = |k: &str| data.get(k).cloned().unwrap_or_default();
                        let said = format!("{}, sent through {} during {}", field("note"), field("via"), field("during"));
                        let created = Created { at: created.0, name: cm.name_any(), identity: field("identity"), said };
                        seen.created.insert(resource_version, created);
                    }
                    let object = logical.map(str::to_string).unwrap_or_else(|| cm.name_any());
                    if let Ok(mut seen) = seen.lock() {
                        seen.writes_seen.insert(
                            (object.clone(), resource_version),
                            said_of(&holder, &cm.data.clone().unwrap_or_default(), &cm.name_any()),
                        );
                    }
                    r.push(Observation::HolderWrite { object, lease: path.key(), holder, resource_version });
                    r.watched.fetch_max(resource_version, Ordering::Relaxed);
                }
            }
        }));
    }
    let namespaces: Api<Namespace> = Api::all(client.clone());
    let (r, s, seen) = (recorder.clone(), stop.clone(), side.clone());
    let selector = watcher::Config::default().fields(&format!("metadata.name={}", cluster_object(ns)));
    tasks.push(tokio::spawn(async move {
        let mut events = watcher::watcher(namespaces, selector).backoff(super::Steady).boxed();
        loop {
            let event = tokio::select! { _ = s.cancelled() => return, e = events.next() => e };
            let Some(event) = event else { return };
            let Ok(Event::Apply(object) | Event::InitApply(object)) = event else { continue };
            let fields = cluster_fields(&object);
            if let (Some(holder), Some(resource_version)) = (fields.get("writer").cloned(), version_of(&object)) {
                if let Ok(mut seen) = seen.lock() {
                    seen.writes_seen.insert((CLUSTER.to_string(), resource_version), said_of(&holder, &fields, &object.name_any()));
                }
                let path = Path::FencedController;
                r.push(Observation::HolderWrite { object: CLUSTER.to_string(), lease: path.key(), holder, resource_version });
                r.watched.fetch_max(resource_version, Ordering::Relaxed);
            }
        }
    }));
    tasks
}

/// The record's gaps, as the report shows them: a token no watch delivered is counted, apart
/// from one no answer named either, and a violation is shown with the Lease's acquisitions around
/// it ("never seen" where nothing saw one) and the object's versions up to it.
#[test]
fn acquisitions_the_watches_missed_are_counted_and_shown_around_a_violation() {
    let lease = Path::FencedController.key();
    let t = |n: u64| Token::new(n).expect("a token");
    let mut side = Side::default();
    for (rv, identity, token, by) in [(10, "ctl-0_1", 1, "ab"), (20, "ctl-1_1", 2, "a"), (30, "ctl-2_1", 3, "r"), (50, "ctl-0_2", 5, "b")] {
        side.grants_seen.insert((lease.clone(), rv), (identity.into(), t(token), by.chars().collect()));
    }
    side.writes_seen.insert((STATE.into(), 21), "ctl-1 as ctl-1_1".into());
    side.writes_seen.insert((STATE.into(), 31), "ctl-2 as ctl-2_1".into());
    let unseen = &side.unseen_grants()[&lease];
    assert_eq!((unseen.first, unseen.last), (1, 5));
    assert_eq!(unseen.by_no_watch, vec![3, 4], "3 only an answer named, 4 nothing");
    assert_eq!(unseen.by_nothing, vec![4]);
    let v = Violation::StaleHolderWriteAccepted {
        object: STATE.into(),
        holder: "ctl-0".into(),
        grant: t(1),
        newer: t(2),
        resource_version: 31,
    };
    let text = side.explain(&v).expect("a violation on the fenced controller's object is explained");
    for line in [
        "2: ctl-1_1, resourceVersion 20..20 (1 versions, seen through a)",
        "3: ctl-2_1",
        "seen through r",
        "4: never seen",
        "21: ctl-1 as ctl-1_1",
        "31: ctl-2 as ctl-2_1",
    ] {
        assert!(text.contains(line), "{line:?} missing in:\n{text}");
    }
    let other =
        Violation::StaleHolderWriteAccepted { object: "ha-0-0".into(), holder: "w".into(), grant: t(1), newer: t(2), resource_version: 1 };
    assert!(side.explain(&other).is_none(), "kube-fence's own leases' objects are not this path's");
}

/// An audit event of a create the writer webhook admitted for the holder, as kube-apiserver
/// writes it (JSON lines, `Metadata` level; the webhook's keys prefixed by its name).
#[cfg(test)]
fn audit_event(name: &str, holder: &str, version: &str, code: u16) -> String {
    serde_json::json!({
        "kind": "Event", "apiVersion": "audit.k8s.io/v1", "level": "Metadata", "stage": "ResponseComplete",
        "verb": "create", "user": {"username": "system:serviceaccount:t:ctl"},
        "objectRef": {"resource": "configmaps", "namespace": "t", "name": name, "apiVersion": "v1"},
        "responseStatus": {"metadata": {}, "code": code},
        "annotations": {
            "authorization.k8s.io/decision": "allow",
            "writers.kubefence.io/lease": "t/ctl",
            "writers.kubefence.io/holder": holder,
            "writers.kubefence.io/lease-resource-version": version,
        }
    })
    .to_string()
}

/// The audit log is read as the API server writes it: a line cut short, another verb, an event
/// without kube-fence's annotations and a look-alike annotation are skipped; of a retried create
/// the committed record is kept.
#[test]
fn the_audit_log_says_how_each_create_was_judged() {
    let dir = tempfile::tempdir().expect("a directory");
    let log = dir.path().join("audit.log");
    let unjudged = serde_json::json!({"verb": "create", "objectRef": {"resource": "configmaps", "name": "plain"}, "annotations": {}});
    let look_alike = audit_event("other", "ctl-0_1", "5", 201).replace("writers.kubefence.io/", "writers.example.io/");
    let lines = [
        audit_event("made-1", "ctl-1_7", "40", 201),
        audit_event("made-2", "ctl-2_8", "61", 201),
        audit_event("made-2", "ctl-2_8", "70", 409),
        audit_event("made-3", "ctl-0_9", "80", 504).replace("\"create\"", "\"update\""),
        unjudged.to_string(),
        look_alike,
        audit_event("made-4", "ctl-0_9", "90", 201)[..40].to_string(),
    ];
    std::fs::write(&log, lines.join("\n")).expect("write the log");
    let mut side = Side::default();
    side.judged_by_audit(&log);
    let judged = |holder: &str, lease_version, code| Judged { holder: holder.into(), lease_version, code };
    assert_eq!(
        side.judged,
        BTreeMap::from([("made-1".to_string(), judged("ctl-1_7", 40, 201)), ("made-2".to_string(), judged("ctl-2_8", 61, 201))])
    );
    // A create the watches saw with no record (its API server killed before the audit line,
    // say) is counted and named with what its writer said.
    let made =
        |name: &str, said: &str| Created { at: Timestamp::UNIX_EPOCH, name: name.into(), identity: String::new(), said: said.into() };
    side.created.insert(41, made("made-1", ""));
    side.created.insert(62, made("made-2", ""));
    side.created.insert(91, made("made-4", "sent through b during an API server killed"));
    assert_eq!(side.audited_creates(), (2, 3));
    assert_eq!(side.unaudited_creates(), ["made-4 (sent through b during an API server killed)"]);
}

/// A create committed after a successor's acquisition is §6b's window only when something shows
/// it was judged before that acquisition: the audit record (its own holder identity, a version
/// before the takeover), or, with no record, the timestamps. Threat case: the honest but stale
/// writer (a create held in flight past a takeover); a row judged after the takeover is what a
/// fence failure would look like, and stays a violation.
#[rstest::rstest]
#[case::audit_before_takeover(Some(("ctl-1_7", 95)), 0, Some(Shown { read: 95, takeover: Some(100), by_timestamps: false }))]
#[case::audit_and_timestamps(Some(("ctl-1_7", 95)), 10, Some(Shown { read: 95, takeover: Some(100), by_timestamps: true }))]
#[case::audit_names_the_successor(Some(("ctl-2_8", 101)), 0, None)]
#[case::audit_names_another_term_of_its_pod(Some(("ctl-1_6", 45)), 0, None)]
#[case::audit_own_holder_at_the_takeover(Some(("ctl-1_7", 100)), 0, None)]
#[case::audit_outweighs_timestamps(Some(("ctl-2_8", 101)), 10, None)]
#[case::no_record_timestamps_well_before(None, 10, None)]
#[case::no_record_timestamps_too_close(None, 0, None)]
fn a_late_create_is_in_the_window_only_when_shown(
    #[case] judged: Option<(&str, u64)>,
    #[case] seconds_before: i64,
    #[case] expect: Option<Shown>,
) {
    let key = Path::FencedController.key();
    let t = |n: u64| Token::new(n).expect("a token");
    let takeover_at: Timestamp = "2026-12-07T01:00:00Z".parse().expect("a time");
    let mut side = Side::default();
    side.grants_seen.insert((key.clone(), 50), ("ctl-1_7".into(), t(1), BTreeSet::from(['a'])));
    side.grants_seen.insert((key.clone(), 100), ("ctl-2_8".into(), t(2), BTreeSet::from(['a'])));
    side.acquired.insert((key.clone(), t(2)), (takeover_at, "ctl-2_8".into()));
    let at = takeover_at.checked_sub(SignedDuration::from_secs(seconds_before)).expect("a time");
    let created = Created { at, name: "made-1".into(), identity: "ctl-1_7".into(), said: String::new() };
    if let Some((holder, lease_version)) = judged {
        side.judged.insert("made-1".into(), Judged { holder: holder.into(), lease_version, code: 201 });
    }
    assert_eq!(side.judged_before_takeover(&key, t(1), &created), expect);
}

/// Every object a path's Pods write is counted on that path (a violation on the cluster-scoped
/// object is the fenced controller's, not kube-fence's own leases').
#[test]
fn each_recorded_object_is_on_the_path_that_writes_it() {
    for object in [STATE, MADE, CLUSTER] {
        assert_eq!(Path::of_object(object), Some(Path::FencedController), "{object}");
    }
    assert_eq!(Path::of_object(&format!("{LED_PREFIX}0")), Some(Path::LeaderLease));
    assert_eq!(Path::of_object("ha-state-0-1"), None, "kube-fence's own leases' objects");
    let ns = Namespace {
        metadata: ObjectMeta {
            annotations: Some([("ha.kubefence.io/writer".to_string(), "ctl-0".to_string()), ("other".to_string(), "x".to_string())].into()),
            ..Default::default()
        },
        ..Default::default()
    };
    assert_eq!(cluster_fields(&ns), [("writer".to_string(), "ctl-0".to_string())].into());
}
