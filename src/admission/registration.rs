//! The ValidatingWebhookConfiguration that sends guarded writes to kube-fence (DESIGN.md
//! section 4): every group, version and resource but no subresource (status writes by
//! Kubernetes' own controllers must keep working), CREATE/UPDATE/DELETE, namespaced objects
//! carrying the `kubefence.io/lease` label, never in system namespaces or kube-fence's own, and
//! failing closed.

use std::collections::BTreeMap;

use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::{
    RuleWithOperations, ServiceReference, ValidatingWebhook, ValidatingWebhookConfiguration, WebhookClientConfig,
};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, LabelSelectorRequirement};
use kube::api::{Api, DeleteParams, ObjectMeta, Patch, PatchParams};

use crate::token::LEASE_LABEL;

/// Name of the webhook inside the configuration; the API server quotes it in every denial:
/// `admission webhook "fence.kubefence.io" denied the request: ...`.
pub const WEBHOOK_NAME: &str = "fence.kubefence.io";
/// Name of the ValidatingWebhookConfiguration (local mode may add a suffix).
pub const CONFIGURATION_NAME: &str = "kube-fence";
/// Path the webhook serves.
pub const PATH: &str = "/validate";
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
    /// kube-fence's own namespace, excluded like the system namespaces.
    pub operator_namespace: Option<String>,
    /// Restrict fencing to these namespaces (tests; a cautious rollout).
    pub only_namespaces: Option<Vec<String>>,
    /// Extra labels a guarded object must carry for this registration (tests scope a
    /// registration to their own objects with it).
    pub extra_object_labels: BTreeMap<String, String>,
    /// Short: a guarded write waits at most this long for a verdict (then fails closed).
    pub timeout_seconds: i32,
}

impl Registration {
    pub fn new(name: impl Into<String>, endpoint: Endpoint) -> Registration {
        Registration {
            name: name.into(),
            endpoint,
            ca_bundle: None,
            operator_namespace: None,
            only_namespaces: None,
            extra_object_labels: BTreeMap::new(),
            timeout_seconds: 5,
        }
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
                Endpoint::Service { namespace, name, port } => {
                    Some(ServiceReference { namespace: namespace.clone(), name: name.clone(), path: Some(PATH.into()), port: Some(*port) })
                }
            },
        };
        let mut excluded: Vec<String> = SYSTEM_NAMESPACES.iter().map(|s| s.to_string()).collect();
        excluded.extend(self.operator_namespace.clone());
        let mut namespace_rules =
            vec![LabelSelectorRequirement { key: NAMESPACE_NAME_LABEL.into(), operator: "NotIn".into(), values: Some(excluded) }];
        if let Some(only) = &self.only_namespaces {
            namespace_rules.push(LabelSelectorRequirement {
                key: NAMESPACE_NAME_LABEL.into(),
                operator: "In".into(),
                values: Some(only.clone()),
            });
        }
        let webhook = ValidatingWebhook {
            name: WEBHOOK_NAME.into(),
            client_config,
            rules: Some(vec![RuleWithOperations {
                api_groups: Some(vec!["*".into()]),
                api_versions: Some(vec!["*".into()]),
                // `*` alone matches resources but not their subresources (`*/*` would).
                resources: Some(vec!["*".into()]),
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
            namespace_selector: Some(LabelSelector { match_expressions: Some(namespace_rules), match_labels: None }),
            failure_policy: Some("Fail".into()),
            side_effects: "None".into(),
            match_policy: Some("Equivalent".into()),
            timeout_seconds: Some(self.timeout_seconds),
            admission_review_versions: vec!["v1".into()],
            match_conditions: None,
        };
        ValidatingWebhookConfiguration {
            metadata: ObjectMeta {
                name: Some(self.name.clone()),
                labels: Some([("app.kubernetes.io/managed-by".to_string(), "kube-fence".to_string())].into()),
                ..Default::default()
            },
            webhooks: Some(vec![webhook]),
        }
    }

    /// Creates or updates the configuration (server-side apply, one field manager).
    pub async fn apply(&self, client: &kube::Client) -> Result<ValidatingWebhookConfiguration, kube::Error> {
        let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
        api.patch(&self.name, &PatchParams::apply(FIELD_MANAGER).force(), &Patch::Apply(&self.configuration())).await
    }

    /// Deletes the configuration; absent is fine.
    pub async fn remove(&self, client: &kube::Client) -> Result<(), kube::Error> {
        let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
        match api.delete(&self.name, &DeleteParams::default()).await {
            Ok(_) => Ok(()),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(()),
            Err(e) => Err(e),
        }
    }
}

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
        assert_eq!(w["rules"][0]["resources"], serde_json::json!(["*"]));
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
