use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, MicroTime, Time};
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::token::Token;

/// Default lease duration when `spec.leaseDurationSeconds` is not given.
pub const DEFAULT_LEASE_DURATION_SECONDS: u32 = 15;

/// The clients' side of a lease: who wants it, for how long, and their heartbeat.
///
/// The kube-fence controller alone writes `status` (who holds it, the token of the grant, and
/// when it expires on the controller's own clock). A write to an object labelled
/// `kubefence.io/lease: <name>` is admitted only when its `kubefence.io/token` annotation is
/// newer than the one the object already records.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "kubefence.io",
    version = "v1alpha1",
    kind = "Lease",
    plural = "leases",
    singular = "lease",
    shortname = "flease",
    category = "kubefence",
    namespaced,
    status = "LeaseStatus",
    doc = "A lease that grants each holder a strictly increasing fencing token. Clients write spec (holder, duration, heartbeat); the kube-fence controller writes status (holder, token, phase, times on its own clock).",
    printcolumn = r#"{"name":"Holder","type":"string","jsonPath":".status.holder","description":"Who holds the lease now"}"#,
    printcolumn = r#"{"name":"Token","type":"integer","jsonPath":".status.token","description":"Fencing token of the newest grant"}"#,
    printcolumn = r#"{"name":"Phase","type":"string","jsonPath":".status.phase","description":"Held or Unheld"}"#,
    printcolumn = r#"{"name":"Identity","type":"string","jsonPath":".spec.identity","description":"Pod or User: the holder is bound to the requester's identity"}"#,
    printcolumn = r#"{"name":"Expires","type":"string","jsonPath":".status.expireTime","description":"When the holder's lease expires unless renewed (controller clock)"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#,
    validation = Rule::new("!has(oldSelf.status) || !has(oldSelf.status.phase) || oldSelf.status.phase != 'Held' || !has(oldSelf.status.holder) || !has(self.spec.holder) || self.spec.holder == oldSelf.status.holder").message("the lease is held by another holder: wait until it is released or expires").reason(Reason::FieldValueForbidden),
    validation = Rule::new("(has(oldSelf.spec.fencing) && has(oldSelf.spec.fencing.enforcement) && oldSelf.spec.fencing.enforcement == 'Warn') || !has(self.spec.fencing) || !has(self.spec.fencing.enforcement) || self.spec.fencing.enforcement == 'Enforce'").message("spec.fencing.enforcement of an existing lease can be tightened (Warn to Enforce) but never relaxed to Warn: a holder must not be able to switch fencing off. To use Warn, create a new Lease with it").reason(Reason::FieldValueForbidden),
    validation = Rule::new("(has(oldSelf.spec.fencing) && has(oldSelf.spec.fencing.comparison) && oldSelf.spec.fencing.comparison == 'AllowEqual') || !has(self.spec.fencing) || !has(self.spec.fencing.comparison) || self.spec.fencing.comparison == 'Strict'").message("spec.fencing.comparison of an existing lease can be tightened (AllowEqual to Strict) but never relaxed to AllowEqual. To use AllowEqual, create a new Lease with it").reason(Reason::FieldValueForbidden),
    validation = Rule::new("has(self.spec.identity) == has(oldSelf.spec.identity) && (!has(self.spec.identity) || self.spec.identity == oldSelf.spec.identity)").message("spec.identity is immutable: it is chosen when the lease is created").reason(Reason::FieldValueForbidden)
)]
#[serde(rename_all = "camelCase")]
pub struct LeaseSpec {
    /// Who claims the lease: a stable identity of the worker (for example its pod name). Set it
    /// to claim an unheld lease; clear it to release the lease. While the lease is held by
    /// someone else the API server rejects a change of holder.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 253))]
    pub holder: Option<String>,

    /// How long, in seconds, the holder keeps the lease after the controller last observed its
    /// heartbeat. Defaults to 15.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 86400), extend("format" = "int32"))]
    pub lease_duration_seconds: Option<u32>,

    /// The holder's heartbeat: it writes its own current time here to renew. Only the change
    /// matters: expiry is judged from when the controller observed the change, so a client
    /// whose clock is wrong can neither expire nor extend its lease.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heartbeat_time: Option<MicroTime>,

    /// Binds the holder to who asks. `Pod`: `holder` must be the name of the Pod whose
    /// ServiceAccount token makes the claim, renewal or release; `User`: the requester's
    /// username. Judged by the API server (a ValidatingAdmissionPolicy kube-fence installs), so
    /// no other identity can claim, renew or release the lease under that holder's name.
    /// Unset: any client RBAC lets update the Lease may use any holder name. Immutable.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<HolderIdentity>,

    /// How writes to the objects this lease guards are judged. Fencing can be tightened on an
    /// existing lease, never relaxed: the API server rejects a change of `enforcement` from
    /// `Enforce` to `Warn`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fencing: Option<FencingPolicy>,
}

/// How the webhook judges writes to the objects bound to this lease.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FencingPolicy {
    /// `Strict` (default) admits a write only when its token is greater than the recorded one:
    /// one write per grant. `AllowEqual` also admits an equal token when the write restates it
    /// (a new `kubefence.io/write` annotation, which the client library sets on every write), so
    /// a holder may write the same object several times under one grant. Set it when the lease
    /// is created; it can later be tightened to `Strict`, never relaxed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub comparison: Option<Comparison>,

    /// `Enforce` (default) denies stale writes. `Warn` admits them with an admission warning,
    /// counts and logs them: for rolling fencing out onto a running system. Set it when the
    /// lease is created; it can later be changed to `Enforce`, never back.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enforcement: Option<Enforcement>,
}

/// Who a holder name stands for: `Pod` — the Pod (by name) whose ServiceAccount token makes the
/// request; `User` — the requester's username. Immutable. Objects this lease guards that also
/// carry the label `kubefence.io/writer: holder` are written (status and deletes included) only
/// by the lease's current holder.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum HolderIdentity {
    /// `holder` is the requesting Pod's name (from its bound ServiceAccount token).
    Pod,
    /// `holder` is the requester's username.
    User,
}

/// Token comparison for writes to guarded objects: `Strict` — a write must present a token
/// greater than the one the object records; `AllowEqual` — or an equal one it restates with a
/// new `kubefence.io/write` annotation. Chosen when the lease is created; `AllowEqual` can be
/// tightened to `Strict`, never back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Comparison {
    /// Admit only `presented > recorded`.
    #[default]
    Strict,
    /// Admit `presented > recorded`, or `presented == recorded` restated by this write.
    AllowEqual,
}

/// What happens to a write the fencing rules reject: `Enforce` denies it, `Warn` admits it with a
/// warning (for rollouts). Chosen when the lease is created; `Warn` can be tightened to `Enforce`,
/// never back.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Enforcement {
    /// Deny it (HTTP 409).
    #[default]
    Enforce,
    /// Admit it with a warning, and count it.
    Warn,
}

/// The lease as the controller sees it. Written only by the kube-fence controller.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct LeaseStatus {
    /// `Held` while a holder has the lease, `Unheld` otherwise.
    #[serde(default)]
    pub phase: Phase,

    /// The holder of the current grant (empty while unheld).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,

    /// The fencing token of the newest grant. Strictly greater than every token this lease
    /// name ever had in this namespace; kept while unheld so writers can compare against it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub token: Option<Token>,

    /// When the current grant was made (controller clock).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub acquire_time: Option<Time>,

    /// When the controller last observed the holder's heartbeat (controller clock).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub renew_time: Option<Time>,

    /// When the grant expires unless renewed: renewTime + leaseDurationSeconds (controller clock).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expire_time: Option<Time>,

    /// How many grants this lease object has made.
    #[serde(default)]
    #[schemars(extend("format" = "int64"))]
    pub lease_transitions: u64,

    /// The spec generation the controller last acted on. A claim is new when
    /// metadata.generation is greater.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,

    /// Standard conditions: `Held` (a holder has the lease) with reasons Granted, Renewed,
    /// Released, Expired.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
}

/// Whether the lease has a holder.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub enum Phase {
    /// Nobody holds the lease; the next claim gets a new, greater token.
    #[default]
    Unheld,
    /// `status.holder` holds the lease with `status.token` until `status.expireTime`.
    Held,
}
