//! What kube-fence registers on the API server (docs/design.md §5):
//!
//! - The ValidatingWebhookConfiguration that sends guarded writes to kube-fence: every group,
//!   version, resource and subresource, CREATE/UPDATE/DELETE, namespaced objects carrying the
//!   `kubefence.io/lease` label, never in system namespaces or kube-fence's own, failing closed.
//!   A subresource write is sent only when it moves the guard (the lease label or the token
//!   annotation differ between the stored and the incoming object), or when the object is
//!   holder-only (`kubefence.io/writer: holder`): a match condition the API server evaluates
//!   itself, so the status writes of Kubernetes' own controllers to other objects never wait
//!   for kube-fence.
//! - Seven ValidatingAdmissionPolicies (CEL, judged inside the API server), each with a binding to
//!   the fenced namespaces (the two of fenced controllers: to every namespace):
//!   - lease status (`status_policy`): only kube-fence's controller identity writes the status of
//!     kube-fence Leases: the status is where tokens are issued, so a worker with `leases/status`
//!     RBAC must not be able to forge one;
//!   - lease identity (`identity_policy`): a kube-fence Lease with `spec.identity` is claimed,
//!     renewed and released only by the identity it names;
//!   - leader holder (`holder_policy`): an opted-in `coordination.k8s.io` Lease names the
//!     requesting Pod as its holder;
//!   - fenced holder (`fenced_holder_policy`): the Lease a FencedController names (its params)
//!     names the requesting Pod, a Pod of the fence's ServiceAccounts, as its holder — no label;
//!   - fence owner (`fence_owner_policy`): the ServiceAccounts a FencedController names never
//!     write it (or its status);
//!   - with the policy path on, the policy path itself (`policy_path_policy`) and the guard of its
//!     parameters (`params_policy`).
//!
//! The same objects are the Helm chart's: [`chart`] renders them as the chart's templates, with
//! Helm expressions where the chart's values go (`kube-fence chart-templates`).

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    MatchCondition, MatchResources, NamedRuleWithOperations, ParamKind, ParamRef, RuleWithOperations, ServiceReference,
    ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding, ValidatingAdmissionPolicyBindingSpec, ValidatingAdmissionPolicySpec,
    ValidatingWebhook, ValidatingWebhookConfiguration, Validation, Variable, WebhookClientConfig,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams};

use kube_fence_api::names::HOLDER_IDENTITY_LABEL;

use kube_fence_api::names::HOLDER_IS_POD;

use crate::admission::judge::identity::IdentityRule;

use kube_fence_api::names::{LEADER_LEASE_LABEL, LEASE_LABEL, TOKEN_ANNOTATION, WRITER_LABEL};

pub mod chart;
pub mod policy_path;
pub mod routing;
pub mod scope;

/// Name of the webhook inside the configuration; the API server quotes it in every denial:
/// `admission webhook "fence.kubefence.io" denied the request: ...`.
pub const WEBHOOK_NAME: &str = "fence.kubefence.io";
/// Name of the webhook that judges objects bound to a leader-election Lease
/// (`kubefence.io/leader-lease`).
pub const LEADER_WEBHOOK_NAME: &str = "leader.kubefence.io";
/// Name of the ValidatingWebhookConfiguration (local mode may add a suffix).
pub const CONFIGURATION_NAME: &str = "kube-fence";
/// Name of the webhook's match condition that skips subresource writes leaving the guard alone.
pub const GUARD_CONDITION_NAME: &str = "object-or-guard-moves";
/// Name of the lease-status policy and its binding (local mode may add a suffix).
pub const STATUS_POLICY_NAME: &str = "kube-fence-lease-status";
/// Namespaces never fenced, so the cluster cannot lock itself out.
pub const SYSTEM_NAMESPACES: [&str; 3] = ["kube-system", "kube-public", "kube-node-lease"];
/// The label every namespace carries with its own name (set by the API server).
const NAMESPACE_NAME_LABEL: &str = "kubernetes.io/metadata.name";
const FIELD_MANAGER: &str = "kube-fence";

/// Where the API server sends admission reviews.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `https://127.0.0.1:<port>/validate` (local mode, tests).
    Url(String),
    /// The webhook Service in the cluster.
    Service { namespace: String, name: String, port: i32 },
}

/// What to register.
#[derive(Clone, Debug)]
pub struct Registration {
    pub name: String,
    pub endpoint: Endpoint,
    /// PEM of the CA that signed the serving certificate (empty: set later, e.g. by cert-manager's
    /// CA injector or the self-managed TLS loop).
    pub ca_bundle: Option<String>,
    /// Namespaces never fenced besides kube-fence's own: [`SYSTEM_NAMESPACES`] (the chart's
    /// `webhook.excludedNamespaces`).
    pub excluded_namespaces: Vec<String>,
    /// kube-fence's own namespace, excluded like the system namespaces.
    pub operator_namespace: Option<String>,
    /// Restrict fencing to these namespaces (tests; a cautious rollout).
    pub only_namespaces: Option<Vec<String>>,
    /// Extra labels a guarded object must carry for this registration (tests scope a
    /// registration to their own objects with it).
    pub extra_object_labels: BTreeMap<String, String>,
    /// Short: a guarded write waits at most this long for a verdict (then fails closed).
    pub timeout_seconds: i32,
    /// The policy path (`--policy-path`): the policy judges UPDATEs of already-guarded objects
    /// with a fresh token and the webhook skips them (`super::policy_path`).
    pub policy_path: bool,
    /// Names of `coordination.k8s.io` Leases whose holder is bound to the requesting Pod, besides
    /// those labelled `kubefence.io/holder-identity: Pod` (the holder policy).
    pub leader_leases: Vec<String>,
    /// How a holder identity names a Pod in the holder policy: the rule the webhook judges
    /// leader-guarded writes by (`--leader-identity-separator`).
    pub leader_identity: IdentityRule,
}

impl Registration {
    pub fn new(name: impl Into<String>, endpoint: Endpoint) -> Registration {
        Registration {
            name: name.into(),
            endpoint,
            ca_bundle: None,
            excluded_namespaces: SYSTEM_NAMESPACES.map(String::from).to_vec(),
            operator_namespace: None,
            only_namespaces: None,
            extra_object_labels: BTreeMap::new(),
            timeout_seconds: scope::DEFAULT_TIMEOUT_SECONDS,
            policy_path: false,
            leader_leases: Vec::new(),
            leader_identity: IdentityRule::default(),
        }
    }

    /// A registration under `scope`'s configuration name, with its timeout and namespaces: the
    /// same scope the writer routing (`routing::keep_in_step`) registers its webhooks with.
    pub fn scoped(scope: &scope::Scope, endpoint: Endpoint) -> Registration {
        let mut registration = Registration::new(scope.configuration_name.clone(), endpoint);
        registration.timeout_seconds = scope.timeout_seconds;
        registration.only_namespaces = scope.only_namespaces.clone();
        registration
    }

    /// The configuration object (pure).
    pub fn configuration(&self) -> ValidatingWebhookConfiguration {
        let client_config = WebhookClientConfig {
            ca_bundle: self.ca_bundle.as_ref().map(|pem| ByteString(pem.as_bytes().to_vec())),
            url: match &self.endpoint {
                Endpoint::Url(url) => Some(url.clone()),
                Endpoint::Service { .. } => None,
            },
            service: match &self.endpoint {
                Endpoint::Url(_) => None,
                Endpoint::Service { namespace, name, port } => Some(ServiceReference {
                    namespace: namespace.clone(),
                    name: name.clone(),
                    path: Some(crate::admission::http::server::PATH.into()),
                    port: Some(*port),
                }),
            },
        };
        let webhook = ValidatingWebhook {
            name: WEBHOOK_NAME.into(),
            client_config,
            rules: Some(vec![RuleWithOperations {
                api_groups: Some(vec!["*".into()]),
                api_versions: Some(vec!["*".into()]),
                // `*/*`: every resource and every subresource (`/status`, `/scale`, ...).
                resources: Some(vec!["*/*".into()]),
                operations: Some(vec!["CREATE".into(), "UPDATE".into(), "DELETE".into()]),
                scope: Some("Namespaced".into()),
            }]),
            object_selector: Some(LabelSelector {
                match_expressions: Some(vec![LabelSelectorRequirement {
                    key: LEASE_LABEL.into(),
                    operator: "Exists".into(),
                    values: None,
                }]),
                match_labels: (!self.extra_object_labels.is_empty()).then(|| self.extra_object_labels.clone()),
            }),
            namespace_selector: Some(self.namespace_selector()),
            failure_policy: Some("Fail".into()),
            side_effects: "None".into(),
            match_policy: Some("Equivalent".into()),
            timeout_seconds: Some(self.timeout_seconds),
            admission_review_versions: vec!["v1".into()],
            match_conditions: Some(self.match_conditions()),
        };
        // Objects bound to a leader-election Lease: every write, status included (the label is
        // the opt-in, so no match condition skips any of them).
        let leader = ValidatingWebhook {
            name: LEADER_WEBHOOK_NAME.into(),
            object_selector: Some(LabelSelector {
                match_expressions: Some(vec![LabelSelectorRequirement {
                    key: LEADER_LEASE_LABEL.into(),
                    operator: "Exists".into(),
                    values: None,
                }]),
                match_labels: (!self.extra_object_labels.is_empty()).then(|| self.extra_object_labels.clone()),
            }),
            match_conditions: None,
            ..webhook.clone()
        };
        ValidatingWebhookConfiguration {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                labels: Some([("app.kubernetes.io/managed-by".to_string(), "kube-fence".to_string())].into()),
                ..Default::default()
            },
            webhooks: Some(vec![webhook, leader]),
        }
    }

    /// The webhook's match conditions: the guard condition, and with the policy path on, the
    /// writes the policy does not judge.
    fn match_conditions(&self) -> Vec<MatchCondition> {
        let mut conditions = vec![MatchCondition { name: GUARD_CONDITION_NAME.into(), expression: guard_condition() }];
        if self.policy_path {
            conditions.push(MatchCondition { name: policy_path::SKIP_CONDITION_NAME.into(), expression: policy_path::webhook_condition() });
        }
        conditions
    }

    /// Namespaces fenced: never the system namespaces or kube-fence's own; only the listed
    /// ones when a list is given.
    fn namespace_selector(&self) -> LabelSelector {
        let mut excluded = self.excluded_namespaces.clone();
        excluded.extend(self.operator_namespace.clone());
        let mut rules =
            vec![LabelSelectorRequirement { key: NAMESPACE_NAME_LABEL.into(), operator: "NotIn".into(), values: Some(excluded) }];
        if let Some(only) = &self.only_namespaces {
            rules.push(LabelSelectorRequirement { key: NAMESPACE_NAME_LABEL.into(), operator: "In".into(), values: Some(only.clone()) });
        }
        LabelSelector { match_expressions: Some(rules), match_labels: None }
    }

    /// A policy named `name` with `spec`, and its binding to the fenced namespaces (pure).
    fn policy(&self, name: &str, spec: ValidatingAdmissionPolicySpec) -> (ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding) {
        let metadata = ObjectMeta {
            name: Some(name.to_string()),
            labels: Some([("app.kubernetes.io/managed-by".to_string(), FIELD_MANAGER.to_string())].into()),
            ..Default::default()
        };
        let binding = ValidatingAdmissionPolicyBinding {
            metadata: metadata.clone(),
            spec: ValidatingAdmissionPolicyBindingSpec {
                policy_name: name.to_string(),
                validation_actions: vec!["Deny".into()],
                match_resources: Some(MatchResources { namespace_selector: Some(self.namespace_selector()), ..Default::default() }),
                param_ref: None,
            },
        };
        (ValidatingAdmissionPolicy { metadata, spec: Some(spec), status: None }, binding)
    }

    /// The policy that lets only `writers` (usernames) write the status of kube-fence Leases in
    /// the fenced namespaces, and its binding (pure).
    pub fn status_policy(&self, writers: &[String]) -> (ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding) {
        self.policy(
            &self.status_policy_name(),
            ValidatingAdmissionPolicySpec {
                failure_policy: Some("Fail".into()),
                match_constraints: Some(rules(&[kube_fence_api::GROUP], &["leases/status"], &["UPDATE"])),
                validations: Some(vec![forbidden(requester_in(writers), STATUS_WRITER_MESSAGE)]),
                ..Default::default()
            },
        )
    }

    fn status_policy_name(&self) -> String {
        if self.name == CONFIGURATION_NAME { STATUS_POLICY_NAME.to_string() } else { format!("{}-lease-status", self.name) }
    }

    fn policy_path_name(&self) -> String {
        format!("{}{}", self.name, kube_fence_api::policy_path::POLICY_SUFFIX)
    }

    fn params_policy_name(&self) -> String {
        format!("{}-policy-params", self.name)
    }

    /// The policy path's policy (`super::policy_path`): UPDATEs of guarded objects that present
    /// a token greater than the recorded one are judged `presented <= issued` against the
    /// namespace's `LeaseTokens`; its binding reads that object from the namespace of the object
    /// under admission (paramRef with a name and no namespace), and denies when it is absent
    /// (the client library retries that answer: `policy_path::params_missing`). Pure.
    pub fn policy_path_policy(&self) -> (ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding) {
        let variables = policy_path::variables().into_iter().map(|(name, expression)| Variable { name: name.into(), expression }).collect();
        let mut constraints = rules(&["*"], &["*"], &["UPDATE"]);
        if let Some(rules) = constraints.resource_rules.as_mut() {
            rules.iter_mut().for_each(|rule| rule.scope = Some("Namespaced".into()));
        }
        constraints.object_selector = Some(self.object_selector());
        constraints.match_policy = Some("Equivalent".into());
        let (policy, mut binding) = self.policy(
            &self.policy_path_name(),
            ValidatingAdmissionPolicySpec {
                failure_policy: Some("Fail".into()),
                param_kind: Some(ParamKind {
                    api_version: Some(format!("{}/v1alpha1", kube_fence_api::GROUP)),
                    kind: Some("LeaseTokens".into()),
                }),
                match_constraints: Some(constraints),
                match_conditions: Some(vec![condition("fresh-token-on-a-guarded-object", policy_path::fast_path())]),
                variables: Some(variables),
                validations: Some(vec![forbidden(policy_path::rule(), &policy_path::message())]),
                ..Default::default()
            },
        );
        binding.spec.param_ref = Some(ParamRef {
            name: Some(kube_fence_api::policy_path::PARAMS_NAME.into()),
            namespace: None,
            parameter_not_found_action: Some("Deny".into()),
            selector: None,
        });
        (policy, binding)
    }

    /// The policy that lets only `writers` (and the namespace controller and garbage collector,
    /// which delete what a namespace holds) write the policy path's parameters (`LeaseTokens`, a
    /// kind workers have no RBAC on; this guards it from anyone RBAC lets write it): a forged
    /// issued token would admit forged tokens. Every object of the kind, every write: a rule by
    /// name would miss the items of a `deletecollection`, which are admitted without one. Pure.
    pub fn params_policy(&self, writers: &[String]) -> (ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding) {
        let mut allowed = writers.to_vec();
        allowed.extend(crate::admission::judge::exemptions::DEFAULT_EXEMPT.map(String::from));
        self.policy(
            &self.params_policy_name(),
            ValidatingAdmissionPolicySpec {
                failure_policy: Some("Fail".into()),
                match_constraints: Some(rules(&[kube_fence_api::GROUP], &["leasetokens"], &["CREATE", "UPDATE", "DELETE"])),
                validations: Some(vec![forbidden(requester_in(&allowed), PARAMS_WRITER_MESSAGE)]),
                ..Default::default()
            },
        )
    }

    /// The object selector of guarded objects (plus the registration's extra labels).
    fn object_selector(&self) -> LabelSelector {
        LabelSelector {
            match_expressions: Some(vec![LabelSelectorRequirement { key: LEASE_LABEL.into(), operator: "Exists".into(), values: None }]),
            match_labels: (!self.extra_object_labels.is_empty()).then(|| self.extra_object_labels.clone()),
        }
    }

    fn identity_policy_name(&self) -> String {
        format!("{}-lease-identity", self.name)
    }

    /// The policy that binds the holder of a Lease with `spec.identity` to who asks: a claim or
    /// renewal names the requester itself, a release is made by the holder itself; `admins`
    /// (usernames) are exempt. Judged by the API server (CEL): no webhook call. Pure.
    pub fn identity_policy(&self, admins: &[String]) -> (ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding) {
        let variables = IDENTITY_VARIABLES
            .iter()
            .map(|(name, expression)| Variable { name: name.to_string(), expression: expression.to_string() })
            .collect();
        self.policy(
            &self.identity_policy_name(),
            ValidatingAdmissionPolicySpec {
                failure_policy: Some("Fail".into()),
                match_constraints: Some(rules(&[kube_fence_api::GROUP], &["leases"], &["CREATE", "UPDATE"])),
                match_conditions: Some(vec![
                    condition("identity-bound", "has(object.spec) && has(object.spec.identity)".into()),
                    condition("not-an-admin", format!("!({})", requester_in(admins))),
                ]),
                variables: Some(variables),
                validations: Some(vec![
                    forbidden(IDENTITY_CLAIM_RULE.into(), IDENTITY_CLAIM_MESSAGE),
                    forbidden(IDENTITY_RELEASE_RULE.into(), IDENTITY_RELEASE_MESSAGE),
                ]),
                ..Default::default()
            },
        )
    }

    fn holder_policy_name(&self) -> String {
        format!("{}-leader-holder", self.name)
    }

    /// The policy that binds the holder of an opted-in `coordination.k8s.io` Lease (labelled
    /// `kubefence.io/holder-identity: Pod`, or named in `leader_leases`) to the requesting Pod:
    /// a write that sets `holderIdentity` names the requester's own Pod (by `leader_identity`, the
    /// rule the webhook judges by), and only the holder clears it. client-go's acquire, renew,
    /// take-over and release all write the writer's own identity (or clear it as the holder), so
    /// they pass. `admins` (usernames) are exempt. Judged by the API server (CEL): no webhook
    /// call. Pure. (The Leases of fenced controllers are bound without any label, by
    /// [`Registration::fenced_holder_policy`].)
    pub fn holder_policy(&self, admins: &[String]) -> (ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding) {
        let variables = holder_variables(&self.leader_identity)
            .into_iter()
            .map(|(name, expression)| Variable { name: name.to_string(), expression })
            .collect();
        self.policy(
            &self.holder_policy_name(),
            ValidatingAdmissionPolicySpec {
                failure_policy: Some("Fail".into()),
                match_constraints: Some(rules(&["coordination.k8s.io"], &["leases"], &["CREATE", "UPDATE", "DELETE"])),
                match_conditions: Some(vec![
                    condition("holder-bound", holder_bound(&self.leader_leases)),
                    condition("not-an-admin", format!("!({})", requester_in(admins))),
                ]),
                variables: Some(variables),
                validations: Some(vec![
                    forbidden(HOLDER_CLAIM_RULE.into(), &holder_claim_message(&self.leader_identity)),
                    forbidden(HOLDER_RELEASE_RULE.into(), HOLDER_RELEASE_MESSAGE),
                    forbidden(holder_label_kept(), HOLDER_LABEL_MESSAGE),
                ]),
                ..Default::default()
            },
        )
    }

    fn fenced_holder_policy_name(&self) -> String {
        format!("{}-fenced-holder", self.name)
    }

    fn fence_owner_policy_name(&self) -> String {
        format!("{}-fence-owner", self.name)
    }

    /// A policy named `name` with `spec`, and its binding to every namespace (kube-system and
    /// kube-fence's own included), or to the registration's `only_namespaces` (pure). For the
    /// policies of fenced controllers: a FencedController is an admin's explicit decision about
    /// one Lease, wherever that Lease is, so no namespace is left out by default.
    fn policy_everywhere(&self, name: &str, spec: ValidatingAdmissionPolicySpec) -> PolicyPair {
        let (policy, mut binding) = self.policy(name, spec);
        binding.spec.match_resources = self.only_namespaces.as_ref().map(|only| MatchResources {
            namespace_selector: Some(LabelSelector {
                match_expressions: Some(vec![LabelSelectorRequirement {
                    key: NAMESPACE_NAME_LABEL.into(),
                    operator: "In".into(),
                    values: Some(only.clone()),
                }]),
                match_labels: None,
            }),
            ..Default::default()
        });
        (policy, binding)
    }

    /// The holder binding of fenced controllers' Leases, without any label on them: the
    /// FencedControllers (`kubefence.io/v1alpha1`) of a Lease's own namespace are the policy's
    /// parameters (paramRef by an empty selector, no namespace; none found: the write is not
    /// judged), and each judges only the Lease it names (`spec.lease`). On that Lease:
    /// - a write that sets `holderIdentity` names the requesting Pod (by `leader_identity`, as
    ///   the label-based [`Registration::holder_policy`]), and that Pod runs as one of the fence's
    ///   `spec.serviceAccounts`: another ServiceAccount's Pod, whatever its RBAC on Leases, never
    ///   takes the Lease (and so never locks the controller out) — unless the write leaves the
    ///   spec as it was (a metadata-only write);
    /// - only the holder clears `holderIdentity`, and only the holder deletes the Lease (or the
    ///   garbage collector and the namespace controller).
    ///
    /// Nobody is exempt (no admin list): an admin rolls back by deleting the FencedController.
    /// client-go's acquire, renew, take-over and release pass (each writes its own identity).
    /// Every namespace, kube-system included. Pure.
    pub fn fenced_holder_policy(&self) -> PolicyPair {
        let mut variables: Vec<Variable> = vec![
            Variable { name: "lease".into(), expression: FENCED_LEASE_NAME.into() },
            Variable { name: "fenced".into(), expression: FENCED_BY_PARAMS.into() },
            Variable { name: "fencedAccount".into(), expression: requester_among("params") },
        ];
        variables.extend(
            holder_variables(&self.leader_identity).into_iter().map(|(name, expression)| Variable { name: name.to_string(), expression }),
        );
        let (policy, mut binding) = self.policy_everywhere(
            &self.fenced_holder_policy_name(),
            ValidatingAdmissionPolicySpec {
                // Ignore, not Fail: with the CEL written so that it cannot error, the only error
                // left is a missing param kind — the FencedController CRD deleted, when no fence
                // exists anyway. With Fail, a deleted CRD would refuse every Lease write in the
                // cluster, kube-system's leader elections included: a cluster lock-out.
                failure_policy: Some("Ignore".into()),
                param_kind: Some(ParamKind {
                    api_version: Some(format!("{}/v1alpha1", kube_fence_api::GROUP)),
                    kind: Some("FencedController".into()),
                }),
                match_constraints: Some(rules(&["coordination.k8s.io"], &["leases"], &["CREATE", "UPDATE", "DELETE"])),
                variables: Some(variables),
                validations: Some(vec![
                    forbidden(format!("!variables.fenced || {FENCED_CLAIM_RULE}"), &fenced_claim_message(&self.leader_identity)),
                    forbidden(format!("!variables.fenced || {HOLDER_RELEASE_RULE}"), FENCED_RELEASE_MESSAGE),
                ]),
                ..Default::default()
            },
        );
        binding.spec.param_ref = Some(ParamRef {
            name: None,
            namespace: None,
            parameter_not_found_action: Some("Allow".into()),
            selector: Some(LabelSelector::default()),
        });
        (policy, binding)
    }

    /// The guard of the fences themselves: a write to a FencedController (or its status) by one
    /// of the ServiceAccounts it names, before or after the write, is refused — so a fenced
    /// controller, even bound to cluster-admin, never loosens (Audit, exemptions), changes or
    /// deletes its own fence. Every namespace. Fails closed: it judges only FencedController
    /// writes. Pure.
    pub fn fence_owner_policy(&self) -> PolicyPair {
        self.policy_everywhere(
            &self.fence_owner_policy_name(),
            ValidatingAdmissionPolicySpec {
                failure_policy: Some("Fail".into()),
                match_constraints: Some(rules(
                    &[kube_fence_api::GROUP],
                    &["fencedcontrollers", "fencedcontrollers/status"],
                    &["CREATE", "UPDATE", "DELETE"],
                )),
                variables: Some(vec![
                    Variable { name: "fence".into(), expression: FENCE_NAME.into() },
                    Variable { name: "accounts".into(), expression: FENCE_ACCOUNTS.into() },
                    Variable { name: "fenced".into(), expression: requester_among("variables.accounts") },
                ]),
                validations: Some(vec![forbidden("!variables.fenced".into(), FENCE_OWNER_MESSAGE)]),
                ..Default::default()
            },
        )
    }

    /// Creates or updates the lease-status policy (`writers` may write Lease status) and the
    /// identity policy (`admins` are exempt from it), with their bindings.
    pub async fn apply_policies(&self, client: &kube::Client, writers: &[String], admins: &[String]) -> Result<(), kube::Error> {
        let params = PatchParams::apply(FIELD_MANAGER).force();
        for (name, (policy, binding)) in [
            (self.status_policy_name(), self.status_policy(writers)),
            (self.identity_policy_name(), self.identity_policy(admins)),
            (self.holder_policy_name(), self.holder_policy(admins)),
            (self.fence_owner_policy_name(), self.fence_owner_policy()),
            (self.fenced_holder_policy_name(), self.fenced_holder_policy()),
        ] {
            Api::<ValidatingAdmissionPolicy>::all(client.clone()).patch(&name, &params, &Patch::Apply(&policy)).await?;
            Api::<ValidatingAdmissionPolicyBinding>::all(client.clone()).patch(&name, &params, &Patch::Apply(&binding)).await?;
        }
        if self.policy_path {
            // Before the webhook's skip condition is registered (`apply`), so no write is skipped
            // by the webhook before the policy judges it.
            self.apply_policy_path(client, writers).await?;
        }
        Ok(())
    }

    /// Creates or updates the policy path's parameter guard (`writers` may write the parameters)
    /// and its policy, in that order.
    pub async fn apply_policy_path(&self, client: &kube::Client, writers: &[String]) -> Result<(), kube::Error> {
        let params = PatchParams::apply(FIELD_MANAGER).force();
        for (name, (policy, binding)) in
            [(self.params_policy_name(), self.params_policy(writers)), (self.policy_path_name(), self.policy_path_policy())]
        {
            Api::<ValidatingAdmissionPolicy>::all(client.clone()).patch(&name, &params, &Patch::Apply(&policy)).await?;
            Api::<ValidatingAdmissionPolicyBinding>::all(client.clone()).patch(&name, &params, &Patch::Apply(&binding)).await?;
        }
        Ok(())
    }

    /// Removes the policy path's policy and its parameter guard, with their bindings (a process
    /// that runs without it, after one that ran with it and crashed); absent is fine. Call it
    /// after the webhook configuration without the skip condition is applied, so no write is
    /// skipped by the webhook once the policy is gone.
    pub async fn remove_policy_path(&self, client: &kube::Client) -> Result<(), kube::Error> {
        fn gone<T>(result: Result<T, kube::Error>) -> Result<(), kube::Error> {
            match result {
                Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
                other => other.map(|_| ()),
            }
        }
        for name in [self.policy_path_name(), self.params_policy_name()] {
            gone(Api::<ValidatingAdmissionPolicyBinding>::all(client.clone()).delete(&name, &DeleteParams::default()).await)?;
            gone(Api::<ValidatingAdmissionPolicy>::all(client.clone()).delete(&name, &DeleteParams::default()).await)?;
        }
        Ok(())
    }

    /// Creates or updates the webhook configuration (server-side apply, one field manager).
    pub async fn apply(&self, client: &kube::Client) -> Result<ValidatingWebhookConfiguration, kube::Error> {
        let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
        api.patch(&self.name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&self.configuration())).await
    }

    /// Deletes the webhook configuration and the lease-status policy; absent is fine.
    pub async fn remove(&self, client: &kube::Client) -> Result<(), kube::Error> {
        fn gone<T>(result: Result<T, kube::Error>) -> Result<(), kube::Error> {
            match result {
                Ok(_) => Ok(()),
                Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
                Err(e) => Err(e),
            }
        }
        gone(Api::<ValidatingWebhookConfiguration>::all(client.clone()).delete(&self.name, &DeleteParams::default()).await)?;
        let writers = crate::admission::registration::routing::configuration_name(&self.name);
        gone(Api::<ValidatingWebhookConfiguration>::all(client.clone()).delete(&writers, &DeleteParams::default()).await)?;
        for name in [
            self.status_policy_name(),
            self.identity_policy_name(),
            self.holder_policy_name(),
            self.fenced_holder_policy_name(),
            self.fence_owner_policy_name(),
            self.policy_path_name(),
            self.params_policy_name(),
        ] {
            gone(Api::<ValidatingAdmissionPolicyBinding>::all(client.clone()).delete(&name, &DeleteParams::default()).await)?;
            gone(Api::<ValidatingAdmissionPolicy>::all(client.clone()).delete(&name, &DeleteParams::default()).await)?;
        }
        Ok(())
    }
}

/// A policy and its binding.
pub type PolicyPair = (ValidatingAdmissionPolicy, ValidatingAdmissionPolicyBinding);

/// CEL: the name of the object under admission (a DELETE has only the old object, and the items
/// of a deletecollection come without `request.name`).
const OBJECT_NAME: &str = "object != null && has(object.metadata.name) && object.metadata.name != '' ? object.metadata.name : (oldObject != null && has(oldObject.metadata.name) ? oldObject.metadata.name : request.name)";
/// The fenced-holder policy's `lease`: the Lease under admission.
const FENCED_LEASE_NAME: &str = OBJECT_NAME;
/// The fenced-holder policy's `fenced`: this parameter (a FencedController) fences this Lease.
const FENCED_BY_PARAMS: &str = "has(params.spec) && has(params.spec.lease) && params.spec.lease == variables.lease";
/// A claim (a write that names a holder) names the requesting Pod, a Pod of the fenced
/// ServiceAccounts, unless it leaves the spec as it was.
pub const FENCED_CLAIM_RULE: &str = "variables.newHolder == '' || (variables.newIsMe && variables.fencedAccount) || (oldObject != null && object != null && has(oldObject.spec) && has(object.spec) && object.spec == oldObject.spec)";
/// The fenced claim rule's message: the fence, who asks, and what it may hold the Lease as.
pub fn fenced_claim_message(identity: &IdentityRule) -> String {
    let forms = match identity.separator() {
        None => "variables.me".to_string(),
        Some(separator) => format!("variables.me + ' or ' + variables.me + {}", cel_string(&format!("{separator}<suffix>"))),
    };
    format!(
        "'Lease ' + variables.lease + ' is fenced by FencedController ' + params.metadata.name + ': its holderIdentity names the requesting Pod, a Pod of ServiceAccount ' + params.spec.serviceAccounts.join(', ') + '; ' + (variables.me == '' ? request.userInfo.username + ' is no Pod of namespace ' + request.namespace + ' (a Pod of another namespace is none; use the Pod\\'s own ServiceAccount token)' : (!variables.fencedAccount ? 'Pod ' + variables.me + ' runs as ' + request.userInfo.username + ', which the fence does not name' : 'Pod ' + variables.me + ' may hold it only as ' + {forms} + ', not as ' + variables.newHolder))"
    )
}
/// The fenced release rule's message.
pub const FENCED_RELEASE_MESSAGE: &str = "'Lease ' + variables.lease + ' is fenced by FencedController ' + params.metadata.name + ': it is ' + (request.operation == 'DELETE' ? 'deleted' : 'released') + ' only by its holder ' + variables.oldHolder + ', not by ' + (variables.me == '' ? request.userInfo.username : 'Pod ' + variables.me)";
/// The fence-owner policy's `fence`: the FencedController under admission.
const FENCE_NAME: &str = OBJECT_NAME;
/// The fence-owner policy's `accounts`: the ServiceAccounts the old and the new object name.
const FENCE_ACCOUNTS: &str = "(oldObject != null && has(oldObject.spec) && has(oldObject.spec.serviceAccounts) ? oldObject.spec.serviceAccounts : []) + (object != null && has(object.spec) && has(object.spec.serviceAccounts) ? object.spec.serviceAccounts : [])";
/// The fence-owner policy's message: who asks, which fence, and who may.
pub const FENCE_OWNER_MESSAGE: &str = "'ServiceAccount ' + request.userInfo.username + ' is fenced by FencedController ' + request.namespace + '/' + variables.fence + ' and may not ' + (request.operation == 'CREATE' ? 'create' : (request.operation == 'DELETE' ? 'delete' : 'change')) + ' it' + (has(request.subResource) && request.subResource != '' ? ' (' + request.subResource + ')' : '') + ': a fence is written by an admin, never by the controller it fences'";

/// CEL: the requester is a ServiceAccount of the request's namespace named in `accounts`
/// (`params` for a FencedController's `spec.serviceAccounts`, or a list expression).
fn requester_among(accounts: &str) -> String {
    let list = if accounts == "params" {
        "(has(params.spec) && has(params.spec.serviceAccounts) ? params.spec.serviceAccounts : [])".to_string()
    } else {
        accounts.to_string()
    };
    format!("{list}.exists(sa, request.userInfo.username == 'system:serviceaccount:' + request.namespace + ':' + sa)")
}

/// A policy's match constraints: `operations` on `resources` of `groups`, every version.
fn rules(groups: &[&str], resources: &[&str], operations: &[&str]) -> MatchResources {
    let strings = |items: &[&str]| Some(items.iter().map(|s| s.to_string()).collect());
    MatchResources {
        resource_rules: Some(vec![NamedRuleWithOperations {
            api_groups: strings(groups),
            api_versions: strings(&["*"]),
            resources: strings(resources),
            operations: strings(operations),
            ..Default::default()
        }]),
        ..Default::default()
    }
}

/// A policy's match condition.
fn condition(name: &str, expression: String) -> MatchCondition {
    MatchCondition { name: name.into(), expression }
}

/// A policy's validation: `expression` must hold, else the write is forbidden with `message`
/// (a CEL message expression).
fn forbidden(expression: String, message: &str) -> Validation {
    Validation { expression, message_expression: Some(message.into()), reason: Some("Forbidden".into()), message: None }
}

/// The username the API server knows `client` by (a SelfSubjectReview).
pub async fn whoami(client: &kube::Client) -> Result<String, kube::Error> {
    use k8s_openapi::api::authentication::v1::SelfSubjectReview;
    let review =
        Api::<SelfSubjectReview>::all(client.clone()).create(&kube::api::PostParams::default(), &SelfSubjectReview::default()).await?;
    Ok(review.status.and_then(|s| s.user_info).and_then(|u| u.username).unwrap_or_default())
}

/// The webhook's match condition (CEL, evaluated by the API server): the object itself, a
/// subresource write whose stored and incoming objects differ in the lease label or the token
/// annotation, or any subresource write to a holder-only object (`kubefence.io/writer`: its
/// status is written only by the lease's holder, which the webhook checks). Written so that it cannot fail to evaluate (an error would fail the request
/// closed): every map lookup is guarded by `has` and `in`.
pub fn guard_condition() -> String {
    let moved = |field: &str, key: &str| {
        let present = |obj: &str| format!("(has({obj}.metadata.{field}) && '{key}' in {obj}.metadata.{field})");
        format!(
            "{new} != {old} || ({new} && object.metadata.{field}['{key}'] != oldObject.metadata.{field}['{key}'])",
            new = present("object"),
            old = present("oldObject"),
        )
    };
    let holder_only = |obj: &str| format!("(has({obj}.metadata.labels) && '{WRITER_LABEL}' in {obj}.metadata.labels)");
    format!(
        "!has(request.subResource) || request.subResource == '' || object == null || oldObject == null || {} || {} || {} || {}",
        moved("labels", LEASE_LABEL),
        moved("annotations", TOKEN_ANNOTATION),
        holder_only("oldObject"),
        holder_only("object"),
    )
}

/// CEL: the requester's username is one of `names` (the lease-status policy's writers, the
/// identity policy's admins).
pub fn requester_in(names: &[String]) -> String {
    let quoted: Vec<String> = names.iter().map(|w| format!("'{}'", w.replace('\\', "\\\\").replace('\'', "\\'"))).collect();
    format!("request.userInfo.username in [{}]", quoted.join(", "))
}

/// The identity policy's variables: who asks, as the lease names holders (`me`), and the holder
/// and heartbeat before and after the write.
pub const IDENTITY_VARIABLES: [(&str, &str); 5] = [
    (
        "me",
        "object.spec.identity == 'Pod' ? ((request.userInfo.username.startsWith('system:serviceaccount:' + request.namespace + ':') && has(request.userInfo.extra) && 'authentication.kubernetes.io/pod-name' in request.userInfo.extra && size(request.userInfo.extra['authentication.kubernetes.io/pod-name']) > 0) ? request.userInfo.extra['authentication.kubernetes.io/pod-name'][0] : '') : request.userInfo.username",
    ),
    ("newHolder", "has(object.spec.holder) ? object.spec.holder : ''"),
    ("oldHolder", "oldObject != null && has(oldObject.spec) && has(oldObject.spec.holder) ? oldObject.spec.holder : ''"),
    ("newBeat", "has(object.spec.heartbeatTime) ? string(object.spec.heartbeatTime) : ''"),
    (
        "oldBeat",
        "oldObject != null && has(oldObject.spec) && has(oldObject.spec.heartbeatTime) ? string(oldObject.spec.heartbeatTime) : ''",
    ),
];
/// A claim or a renewal (holder set, and holder or heartbeat changed) names the requester.
pub const IDENTITY_CLAIM_RULE: &str = "variables.newHolder == '' || (variables.newHolder == variables.oldHolder && variables.newBeat == variables.oldBeat) || variables.newHolder == variables.me";
pub const IDENTITY_CLAIM_MESSAGE: &str = "'lease ' + object.metadata.name + ' binds its holder to the requester (spec.identity ' + object.spec.identity + '): ' + (variables.me == '' ? 'the request carries no Pod identity of namespace ' + request.namespace + ' (a Pod of another namespace is none; use the Pod\\'s own ServiceAccount token)' : variables.me + ' may claim or renew it only as ' + variables.me + ', not as ' + variables.newHolder)";
/// A release (holder cleared) is made by the holder itself.
pub const IDENTITY_RELEASE_RULE: &str = "variables.oldHolder == '' || variables.newHolder != '' || variables.oldHolder == variables.me";
pub const IDENTITY_RELEASE_MESSAGE: &str = "'lease ' + object.metadata.name + ' is released only by its holder ' + variables.oldHolder + ' (spec.identity ' + object.spec.identity + '), not by ' + (variables.me == '' ? request.userInfo.username : variables.me)";

/// CEL: whether `obj` (`object` or `oldObject`) carries the holder-identity opt-in label.
fn holder_labelled(obj: &str) -> String {
    format!(
        "({obj} != null && has({obj}.metadata.labels) && '{HOLDER_IDENTITY_LABEL}' in {obj}.metadata.labels && {obj}.metadata.labels['{HOLDER_IDENTITY_LABEL}'] == '{HOLDER_IS_POD}')"
    )
}

/// The holder policy's match condition: the Lease is opted in, by its label (before or after
/// the write) or by name.
pub fn holder_bound(names: &[String]) -> String {
    let quoted: Vec<String> = names.iter().map(|n| format!("'{}'", n.replace('\\', "\\\\").replace('\'', "\\'"))).collect();
    format!("{} || {} || request.name in [{}]", holder_labelled("object"), holder_labelled("oldObject"), quoted.join(", "))
}

/// The opt-in label is removed only by an admin (else a worker could drop the binding first).
/// Deleting the Lease is judged like a release ([`HOLDER_RELEASE_RULE`]).
pub fn holder_label_kept() -> String {
    format!("request.operation == 'DELETE' || !{} || {}", holder_labelled("oldObject"), holder_labelled("object"))
}

/// The holder policy's variables: the requesting Pod (`''` without a Pod-bound token), the
/// holder before and after the write, and whether each names the requesting Pod by `identity`.
pub fn holder_variables(identity: &IdentityRule) -> [(&'static str, String); 5] {
    [
        (
            "me",
            "(request.userInfo.username.startsWith('system:serviceaccount:' + request.namespace + ':') && has(request.userInfo.extra) && 'authentication.kubernetes.io/pod-name' in request.userInfo.extra && size(request.userInfo.extra['authentication.kubernetes.io/pod-name']) > 0) ? request.userInfo.extra['authentication.kubernetes.io/pod-name'][0] : ''".into(),
        ),
        ("newHolder", "object != null && has(object.spec) && has(object.spec.holderIdentity) ? object.spec.holderIdentity : ''".into()),
        ("oldHolder", "oldObject != null && has(oldObject.spec) && has(oldObject.spec.holderIdentity) ? oldObject.spec.holderIdentity : ''".into()),
        ("newIsMe", names_me(identity, "variables.newHolder")),
        ("oldIsMe", names_me(identity, "variables.oldHolder")),
    ]
}

/// CEL: whether `holder` names the requesting Pod by `identity` ([`IdentityRule::holds`]).
/// The chart's leader-holder policy renders the same text from `leaderIdentity.separator`.
fn names_me(identity: &IdentityRule, holder: &str) -> String {
    match identity.separator() {
        None => format!("variables.me != '' && {holder} == variables.me"),
        Some(separator) => {
            format!("variables.me != '' && ({holder} == variables.me || {holder}.startsWith(variables.me + {}))", cel_string(separator))
        }
    }
}

/// A CEL string literal. (A parsed separator has neither `'` nor `\`, so the chart, which
/// does not escape, writes the same text.)
fn cel_string(text: &str) -> String {
    format!("'{}'", text.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// A write that names a holder names the requesting Pod, unless it leaves the spec as it was
/// (a label or annotation change). A renewal of another's Lease is refused too.
pub const HOLDER_CLAIM_RULE: &str = "variables.newHolder == '' || variables.newIsMe || (oldObject != null && has(oldObject.spec) && has(object.spec) && object.spec == oldObject.spec)";
/// The claim rule's message: who asks, and the identities the rule lets it hold under.
pub fn holder_claim_message(identity: &IdentityRule) -> String {
    let forms = match identity.separator() {
        None => "variables.me".to_string(),
        Some(separator) => format!("variables.me + ' or ' + variables.me + {}", cel_string(&format!("{separator}<suffix>"))),
    };
    format!(
        "'Lease ' + request.name + ' binds its holderIdentity to the requesting Pod: ' + (variables.me == '' ? 'the request carries no Pod identity of namespace ' + request.namespace + ' (a Pod of another namespace is none; use the Pod\\'s own ServiceAccount token)' : 'Pod ' + variables.me + ' may hold it only as ' + {forms} + ', not as ' + variables.newHolder)"
    )
}
/// Clearing the holder (client-go's ReleaseOnCancel) is done by the holder itself.
/// Deleting the Lease is a release too (else a non-holder could delete it and create it again
/// without the opt-in label), except by the namespace controller and the garbage collector,
/// which delete what a deleted namespace or owner leaves.
pub const HOLDER_RELEASE_RULE: &str = "variables.oldHolder == '' || variables.newHolder != '' || variables.oldIsMe || (request.operation == 'DELETE' && request.userInfo.username in ['system:serviceaccount:kube-system:generic-garbage-collector', 'system:serviceaccount:kube-system:namespace-controller'])";
pub const HOLDER_RELEASE_MESSAGE: &str = "'Lease ' + request.name + ' is ' + (request.operation == 'DELETE' ? 'deleted' : 'released') + ' only by its holder ' + variables.oldHolder + ', not by ' + (variables.me == '' ? request.userInfo.username : 'Pod ' + variables.me)";
pub const HOLDER_LABEL_MESSAGE: &str = "'the kubefence.io/holder-identity label of Lease ' + request.name + ' is removed only by an admin'";

/// The parameter guard's message.
pub const PARAMS_WRITER_MESSAGE: &str = "'LeaseTokens hold the issued fencing tokens the API server judges writes by: only the kube-fence controller writes them; ' + request.userInfo.username + ' may not'";

/// The lease-status policy's message.
pub const STATUS_WRITER_MESSAGE: &str = "'the status of a kube-fence Lease (where fencing tokens are issued) is written only by the kube-fence controller; ' + request.userInfo.username + ' may not write it'";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn configuration_matches_the_design() {
        let mut reg = Registration::new("kube-fence", Endpoint::Url("https://127.0.0.1:9443/validate".into()));
        reg.ca_bundle = Some("PEM".into());
        reg.operator_namespace = Some("kube-fence-system".into());
        let vwc = reg.configuration();
        let json = serde_json::to_value(&vwc).unwrap();
        let w = &json["webhooks"][0];
        assert_eq!(w["name"], "fence.kubefence.io");
        assert_eq!(w["failurePolicy"], "Fail");
        assert_eq!(w["sideEffects"], "None");
        assert_eq!(w["matchPolicy"], "Equivalent");
        assert_eq!(w["admissionReviewVersions"], serde_json::json!(["v1"]));
        assert_eq!(w["rules"][0]["resources"], serde_json::json!(["*/*"]));
        assert_eq!(w["matchConditions"][0]["name"], GUARD_CONDITION_NAME);
        assert_eq!(w["matchConditions"][0]["expression"], guard_condition());
        assert_eq!(w["rules"][0]["apiGroups"], serde_json::json!(["*"]));
        assert_eq!(w["rules"][0]["apiVersions"], serde_json::json!(["*"]));
        assert_eq!(w["rules"][0]["operations"], serde_json::json!(["CREATE", "UPDATE", "DELETE"]));
        assert_eq!(w["rules"][0]["scope"], "Namespaced");
        assert_eq!(w["objectSelector"]["matchExpressions"][0], serde_json::json!({"key": "kubefence.io/lease", "operator": "Exists"}));
        assert_eq!(
            w["namespaceSelector"]["matchExpressions"],
            serde_json::json!([{"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["kube-system", "kube-public", "kube-node-lease", "kube-fence-system"]}])
        );
        assert_eq!(w["clientConfig"]["url"], "https://127.0.0.1:9443/validate");
        assert!(w["timeoutSeconds"].as_i64().unwrap() <= 10);
    }

    #[test]
    fn leader_bound_objects_have_a_webhook_of_their_own_that_sees_every_write() {
        let mut reg = Registration::new("kube-fence", Endpoint::Url("https://127.0.0.1:9443/validate".into()));
        reg.extra_object_labels = [("test".to_string(), "t1".to_string())].into();
        let json = serde_json::to_value(reg.configuration()).unwrap();
        let (fence, leader) = (&json["webhooks"][0], &json["webhooks"][1]);
        assert_eq!(leader["name"], LEADER_WEBHOOK_NAME);
        assert_eq!(
            leader["objectSelector"],
            serde_json::json!({"matchExpressions": [{"key": "kubefence.io/leader-lease", "operator": "Exists"}], "matchLabels": {"test": "t1"}})
        );
        // The label is the opt-in: status writes are not skipped.
        assert!(leader.get("matchConditions").is_none());
        for same in ["rules", "namespaceSelector", "failurePolicy", "clientConfig", "timeoutSeconds", "sideEffects"] {
            assert_eq!(leader[same], fence[same], "{same}");
        }
    }

    #[test]
    fn the_holder_policy_matches_opted_in_coordination_leases() {
        let mut reg = Registration::new("kf", Endpoint::Url("https://127.0.0.1:9443/validate".into()));
        reg.leader_leases = vec!["my-operator".into()];
        let (policy, binding) = reg.holder_policy(&["admin".into()]);
        let policy = serde_json::to_value(&policy).unwrap();
        assert_eq!(policy["metadata"]["name"], "kf-leader-holder");
        assert_eq!(binding.spec.policy_name, "kf-leader-holder");
        let rule = &policy["spec"]["matchConstraints"]["resourceRules"][0];
        assert_eq!(rule["apiGroups"], serde_json::json!(["coordination.k8s.io"]));
        assert_eq!(rule["resources"], serde_json::json!(["leases"]));
        let bound = policy["spec"]["matchConditions"][0]["expression"].as_str().unwrap_or_default();
        assert!(bound.ends_with("request.name in ['my-operator']"), "{bound} (a DELETE has no object)");
        assert!(bound.contains("'kubefence.io/holder-identity' in object.metadata.labels"), "{bound}");
        assert_eq!(policy["spec"]["matchConditions"][1]["expression"], "!(request.userInfo.username in ['admin'])");
        assert_eq!(rule["operations"], serde_json::json!(["CREATE", "UPDATE", "DELETE"]), "deleting is judged like releasing");
        assert_eq!(policy["spec"]["validations"].as_array().map(Vec::len), Some(3));
    }

    /// The holder policy and the webhook name a Pod by one rule: the CEL for each rule, and its
    /// message.
    #[test]
    fn the_holder_policy_names_the_pod_by_the_configured_rule() {
        let spec = |rule: &str| {
            let mut reg = Registration::new("kf", Endpoint::Url("https://127.0.0.1:9443/validate".into()));
            reg.leader_identity = rule.parse().unwrap_or_else(|e| panic!("{rule}: {e}"));
            serde_json::to_value(reg.holder_policy(&[]).0).unwrap()["spec"].clone()
        };
        let variable = |spec: &serde_json::Value, name: &str| {
            let variables = spec["variables"].as_array().cloned().unwrap_or_default();
            variables.iter().find(|v| v["name"] == name).map(|v| v["expression"].clone()).unwrap_or_default()
        };
        let default = spec("_");
        assert_eq!(
            variable(&default, "newIsMe"),
            "variables.me != '' && (variables.newHolder == variables.me || variables.newHolder.startsWith(variables.me + '_'))"
        );
        assert_eq!(
            variable(&spec(":uid="), "oldIsMe"),
            "variables.me != '' && (variables.oldHolder == variables.me || variables.oldHolder.startsWith(variables.me + ':uid='))"
        );
        let exact = spec("none");
        assert_eq!(variable(&exact, "newIsMe"), "variables.me != '' && variables.newHolder == variables.me");
        assert_eq!(variable(&exact, "oldIsMe"), "variables.me != '' && variables.oldHolder == variables.me");
        let message = |spec: &serde_json::Value| spec["validations"][0]["messageExpression"].as_str().unwrap_or_default().to_string();
        assert!(message(&default).contains("' may hold it only as ' + variables.me + ' or ' + variables.me + '_<suffix>' + ', not as '"));
        assert!(message(&exact).contains("' may hold it only as ' + variables.me + ', not as '"), "{}", message(&exact));
    }

    /// The fenced-holder policy: FencedControllers of the Lease's namespace are its params,
    /// every validation judges only the Lease a fence names, nobody is exempt, a missing CRD
    /// fails open (no cluster lock-out), and no namespace is left out unless the scope lists some.
    #[test]
    fn the_fenced_holder_policy_takes_fenced_controllers_as_params_in_every_namespace() {
        let mut reg = Registration::new("kf", Endpoint::Url("https://127.0.0.1:9443/validate".into()));
        reg.operator_namespace = Some("kube-fence".into());
        let (policy, binding) = reg.fenced_holder_policy();
        let (policy, binding) = (serde_json::to_value(&policy).unwrap(), serde_json::to_value(&binding).unwrap());
        assert_eq!(policy["metadata"]["name"], "kf-fenced-holder");
        assert_eq!(policy["spec"]["failurePolicy"], "Ignore");
        assert_eq!(policy["spec"]["paramKind"], serde_json::json!({"apiVersion": "kubefence.io/v1alpha1", "kind": "FencedController"}));
        let rule = &policy["spec"]["matchConstraints"]["resourceRules"][0];
        assert_eq!(rule["apiGroups"], serde_json::json!(["coordination.k8s.io"]));
        assert_eq!(rule["operations"], serde_json::json!(["CREATE", "UPDATE", "DELETE"]));
        assert!(policy["spec"].get("matchConditions").is_none(), "no admin is exempt: {policy}");
        let text = policy.to_string();
        assert!(!text.contains("kubefence.io/holder-identity") && !text.contains("kubefence.io/writers"), "no label, no annotation");
        let validations = policy["spec"]["validations"].as_array().unwrap();
        assert_eq!(validations.len(), 2);
        for v in validations {
            assert!(v["expression"].as_str().unwrap().starts_with("!variables.fenced || "), "{v}");
        }
        assert!(validations[0]["expression"].as_str().unwrap().contains("variables.newIsMe && variables.fencedAccount"));
        assert_eq!(
            binding["spec"]["paramRef"],
            serde_json::json!({"selector": {}, "parameterNotFoundAction": "Allow"}),
            "the Lease's own namespace's FencedControllers"
        );
        assert!(binding["spec"].get("matchResources").is_none(), "every namespace, kube-system and kube-fence's own included");
        reg.only_namespaces = Some(vec!["a".into()]);
        let binding = serde_json::to_value(reg.fenced_holder_policy().1).unwrap();
        assert_eq!(
            binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"],
            serde_json::json!([{"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["a"]}])
        );
    }

    #[test]
    fn the_fence_owner_policy_refuses_the_fenced_service_accounts_on_fences_and_their_status() {
        let reg = Registration::new("kf", Endpoint::Url("https://127.0.0.1:9443/validate".into()));
        let (policy, binding) = reg.fence_owner_policy();
        let (policy, binding) = (serde_json::to_value(&policy).unwrap(), serde_json::to_value(&binding).unwrap());
        assert_eq!(policy["metadata"]["name"], "kf-fence-owner");
        assert_eq!(policy["spec"]["failurePolicy"], "Fail");
        let rule = &policy["spec"]["matchConstraints"]["resourceRules"][0];
        assert_eq!(rule["resources"], serde_json::json!(["fencedcontrollers", "fencedcontrollers/status"]));
        assert_eq!(rule["operations"], serde_json::json!(["CREATE", "UPDATE", "DELETE"]));
        let variables = policy["spec"]["variables"].as_array().unwrap();
        let accounts = variables.iter().find(|v| v["name"] == "accounts").unwrap()["expression"].as_str().unwrap();
        assert!(accounts.contains("oldObject.spec.serviceAccounts") && accounts.contains("object.spec.serviceAccounts"), "old and new");
        assert!(binding["spec"].get("paramRef").is_none() && binding["spec"].get("matchResources").is_none());
    }

    #[test]
    fn a_cel_string_escapes_quotes_and_backslashes() {
        assert_eq!(cel_string(r"a'b\c"), r"'a\'b\\c'");
    }

    #[test]
    fn the_status_policy_names_its_writers_and_follows_the_namespace_scope() {
        let mut reg = Registration::new("kube-fence", Endpoint::Url("https://127.0.0.1:9443/validate".into()));
        reg.only_namespaces = Some(vec!["mine".into()]);
        let (policy, binding) = reg.status_policy(&["system:serviceaccount:kf:kube-fence".into(), "o'brien".into()]);
        let policy = serde_json::to_value(&policy).unwrap();
        let binding = serde_json::to_value(&binding).unwrap();
        assert_eq!(policy["metadata"]["name"], STATUS_POLICY_NAME);
        assert_eq!(policy["spec"]["matchConstraints"]["resourceRules"][0]["resources"], serde_json::json!(["leases/status"]));
        assert_eq!(
            policy["spec"]["validations"][0]["expression"],
            r"request.userInfo.username in ['system:serviceaccount:kf:kube-fence', 'o\'brien']"
        );
        assert_eq!(binding["spec"]["policyName"], STATUS_POLICY_NAME);
        assert_eq!(binding["spec"]["validationActions"], serde_json::json!(["Deny"]));
        assert_eq!(binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"][1]["values"], serde_json::json!(["mine"]));
    }

    #[test]
    fn a_scoped_registration_carries_the_scope() {
        let scope = scope::Scope { configuration_name: "kf".into(), timeout_seconds: 9, only_namespaces: Some(vec!["mine".into()]) };
        let reg = Registration::scoped(&scope, Endpoint::Url("https://127.0.0.1:9443/validate".into()));
        let json = serde_json::to_value(reg.configuration()).unwrap();
        assert_eq!(json["metadata"]["name"], "kf");
        for hook in json["webhooks"].as_array().unwrap() {
            assert_eq!(hook["timeoutSeconds"], 9);
            assert_eq!(hook["namespaceSelector"]["matchExpressions"][1]["values"], serde_json::json!(["mine"]));
        }
    }

    #[test]
    fn tests_can_restrict_to_their_namespace() {
        let mut reg = Registration::new("t", Endpoint::Service { namespace: "kf".into(), name: "kube-fence".into(), port: 443 });
        reg.only_namespaces = Some(vec!["mine".into()]);
        let json = serde_json::to_value(reg.configuration()).unwrap();
        let w = &json["webhooks"][0];
        assert_eq!(
            w["namespaceSelector"]["matchExpressions"][1],
            serde_json::json!({"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["mine"]})
        );
        assert_eq!(w["clientConfig"]["service"]["path"], "/validate");
        assert!(w["clientConfig"].get("url").is_none());
    }
}
