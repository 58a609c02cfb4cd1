use k8s_openapi::apimachinery::pkg::apis::meta::v1::Condition;
use kube::CustomResource;
use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// At most this many ServiceAccounts in one FencedController.
pub const MAX_FENCED_ACCOUNTS: usize = 8;
/// At most this many exempt resources in one FencedController.
pub const MAX_EXEMPT_RESOURCES: usize = 32;

/// An admin's decision that every write of a running controller's ServiceAccounts is admitted
/// only from the Pod holding its leader-election Lease: the writer fence.
///
/// Who may create, change or delete one is decided by RBAC (the chart aggregates the verbs into
/// `admin`, and reading into `view`); the fenced ServiceAccounts themselves never may, whatever
/// their RBAC (a ValidatingAdmissionPolicy refuses them). The controller's Lease is never labelled
/// or annotated: while this object exists, the API server binds the Lease's `holderIdentity` to
/// the Pod that writes it, and only a Pod of the named ServiceAccounts may claim it.
#[derive(CustomResource, Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[kube(
    group = "kubefence.io",
    version = "v1alpha1",
    kind = "FencedController",
    plural = "fencedcontrollers",
    singular = "fencedcontroller",
    shortname = "fence",
    category = "kubefence",
    namespaced,
    status = "FencedControllerStatus",
    doc = "Fences every write of a controller's ServiceAccounts to the Pod that holds its leader-election Lease (coordination.k8s.io), in this namespace. Audit admits a follower's write with a warning; Enforce refuses it (409 NotHolder).",
    printcolumn = r#"{"name":"Lease","type":"string","jsonPath":".spec.lease","description":"The controller's leader-election Lease"}"#,
    printcolumn = r#"{"name":"Mode","type":"string","jsonPath":".spec.mode","description":"Audit or Enforce"}"#,
    printcolumn = r#"{"name":"Holder","type":"string","jsonPath":".status.holder","description":"The Pod holding the Lease now"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Reason","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].reason","priority":1}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
pub struct FencedControllerSpec {
    /// The controller's leader-election Lease (`coordination.k8s.io/v1`), in this namespace, as
    /// client-go's leader election writes it: `holderIdentity` starts with the holder Pod's name.
    #[schemars(length(min = 1, max = 253), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"))]
    pub lease: String,

    /// The ServiceAccounts of this namespace the controller runs as: their every write (any
    /// kind, any namespace, cluster-scoped included, every subresource) is judged.
    #[schemars(length(min = 1, max = 8), extend("x-kubernetes-list-type" = "set"), inner(length(min = 1, max = 253), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")))]
    pub service_accounts: Vec<String>,

    /// Resources the controller writes whether it leads or not (a cert rotator, a runnable every
    /// replica runs), as kubectl spells them: `<resource>` for the core group, or
    /// `<resource>.<group>` (`configmaps`, `leases.coordination.k8s.io`). Their writes pass.
    /// Events, the controller's own Lease and reviews that store nothing always pass.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(length(max = 32), extend("x-kubernetes-list-type" = "set"), inner(length(min = 1, max = 253), regex(pattern = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")))]
    pub exempt: Vec<String>,

    /// `Audit` (the default): a write the fence would refuse is admitted with a warning (what
    /// kubectl prints as `Warning:`), an Event on this object and a metric. `Enforce`: it is
    /// refused with 409 `NotHolder`. Switching is this one field.
    #[serde(default)]
    pub mode: FenceMode,
}

/// Whether a fence refuses a follower's write or only warns of it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema)]
pub enum FenceMode {
    /// Admit with a warning, an Event and a metric.
    #[default]
    Audit,
    /// Refuse with 409 `NotHolder`.
    Enforce,
}

/// What the kube-fence controller found: whether the fence works, and who holds the Lease.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "camelCase")]
pub struct FencedControllerStatus {
    /// The `metadata.generation` this status describes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// The Pod holding the Lease now (from its `holderIdentity`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    /// `Ready`: `True` when the fence judges the ServiceAccounts' writes (reason `Enforcing` or
    /// `Auditing`), else `False` with why (`LeaseNotFound`, `HolderNotFenced`, `HostNetwork`,
    /// `NotRouted`, ...).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(extend("x-kubernetes-list-type" = "map", "x-kubernetes-list-map-keys" = ["type"]))]
    pub conditions: Vec<Condition>,
}

/// The reasons of a FencedController's `Ready` condition (the contract between the controller
/// that writes them and `kube-fence status` and users' alerts that read them).
pub mod ready {
    /// Ready: an Enforce fence judges the writes.
    pub const ENFORCING: &str = "Enforcing";
    /// Ready: an Audit fence judges the writes, warning instead of refusing.
    pub const AUDITING: &str = "Auditing";
    /// Not ready: the Lease does not exist (yet).
    pub const LEASE_NOT_FOUND: &str = "LeaseNotFound";
    /// Not ready: the Lease's holder is not a Pod of the named ServiceAccounts.
    pub const HOLDER_NOT_FENCED: &str = "HolderNotFenced";
    /// Not ready: the holder Pod uses the node's network, so its name is the node's.
    pub const HOST_NETWORK: &str = "HostNetwork";
    /// Not ready: the writer webhook does not route the ServiceAccounts' writes yet.
    pub const NOT_ROUTED: &str = "NotRouted";
    /// Not ready: the spec cannot be judged by (written before a schema change, or past it).
    pub const INVALID_SPEC: &str = "InvalidSpec";
}

/// The Events the webhook publishes on a FencedController (`regarding` it: `kubefence.io/v1alpha1`
/// `FencedController`), type Warning, one per judged write (within the webhook's Event budget, so
/// counts read from them are lower bounds): what `kube-fence status` counts.
pub mod fence_events {
    /// A write the fence refused (Enforce): the denial reason `NotHolder`.
    pub const REFUSED: &str = "NotHolder";
    /// A write an Audit fence admitted that Enforce would refuse.
    pub const WOULD_REFUSE: &str = "WouldRefuse";
}
