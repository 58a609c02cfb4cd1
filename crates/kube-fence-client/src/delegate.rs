//! Delegated grants: the token travels with the work a holder starts.
//!
//! A holder that starts a Job, a Pod or a work item whose consumer writes guarded objects stamps
//! its grant onto it ([`Grant::delegate`]): the annotation [`DELEGATED_GRANT_ANNOTATION`] on the
//! object (and on its Pod template), and on every container of the Pod template the environment
//! variable [`GRANT_ENV`], filled by the kubelet from that annotation (downward API `fieldRef`).
//! The consumer picks it up with no argument — [`Delegated::from_env`] in a Pod,
//! [`Delegated::from_object`] from a work item — and writes with it exactly as the holder would:
//! the fencing webhook judges the token, so a write is admitted until a newer grant of the lease
//! has written the object and refused with [`Error::StaleToken`] after.
//!
//! A [`Delegated`] grant only writes. It has no holder, so it cannot renew or release the lease
//! (there is no such method, and [`super::Leases`] takes a [`Grant`]), and it needs no RBAC on
//! Leases. It does not outlive its parent: it *is* the parent's token, and a newer grant's write
//! fences both alike.
//!
//! ```no_run
//! # async fn example() -> Result<(), Box<dyn std::error::Error>> {
//! use k8s_openapi::api::core::v1::ConfigMap;
//! use kube_fence_client::{Delegated, Error};
//! let grant = Delegated::from_env()?; // KUBE_FENCE_GRANT, from the downward API
//! let api: kube::Api<ConfigMap> = kube::Api::namespaced(kube::Client::try_default().await?, &grant.namespace);
//! match grant.update(&api, "result", |cm: &mut ConfigMap| {
//!     cm.data.get_or_insert_with(Default::default).insert("rows".into(), "1200".into());
//! }).await {
//!     Err(Error::StaleToken { recorded, .. }) => eprintln!("superseded by token {recorded}: rereading, not retrying"),
//!     other => drop(other?),
//! }
//! # Ok(()) }
//! ```
//!
//! What a delegated grant cannot do does not compile:
//!
//! ```compile_fail,E0308
//! # async fn example(leases: kube_fence_client::Leases, grant: kube_fence_client::Delegated) {
//! leases.renew(&grant).await; // expected `&Grant`: a delegated grant is not renewed
//! # }
//! ```
//!
//! ```compile_fail,E0308
//! # async fn example(leases: kube_fence_client::Leases, grant: kube_fence_client::Delegated) {
//! leases.release(&grant).await; // expected `&Grant`: only the holder releases
//! # }
//! ```

use std::fmt::{self, Debug};

use kube::api::{Api, Patch, PatchParams};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::fenced::Fence;
use super::{Error, Grant};
use kube_fence_api::names::DELEGATED_GRANT_ANNOTATION;
use kube_fence_api::token::{Token, TokenError};

/// Environment variable a delegated Pod's containers get the grant in (`NAMESPACE/LEASE:TOKEN`),
/// from [`DELEGATED_GRANT_ANNOTATION`] through the downward API.
pub const GRANT_ENV: &str = "KUBE_FENCE_GRANT";

/// A grant handed down by its holder: the lease and the token, nothing to renew or release.
/// Writes with it are fenced exactly like the holder's own.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Delegated {
    /// Namespace of the lease (and of the guarded objects it fences).
    pub namespace: String,
    pub lease: String,
    pub token: Token,
}

/// Why a delegated grant could not be read. A message leaves its source out, so that a chain of
/// causes printed whole (`-v`, a log) says each cause once.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DelegationError {
    /// Nothing was delegated: the variable or annotation is absent.
    #[error("no delegated grant: {0} is not set")]
    Absent(&'static str),
    /// The value is not `NAMESPACE/LEASE:TOKEN`.
    #[error("the delegated grant {value:?} is not NAMESPACE/LEASE:TOKEN: {why}")]
    Malformed { value: String, why: &'static str },
    /// The token part does not parse.
    #[error("the delegated grant {value:?} has a bad token")]
    Token {
        value: String,
        #[source]
        source: TokenError,
    },
    /// The object cannot carry a delegation (it does not serialize to a JSON object).
    #[error("cannot stamp the delegated grant onto this object: {0}")]
    Unstampable(String),
}

impl fmt::Display for Delegated {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}:{}", self.namespace, self.lease, self.token)
    }
}

/// A Kubernetes object name part: non-empty, lower-case alphanumerics, `-` and `.`.
fn is_name(s: &str) -> bool {
    !s.is_empty() && s.len() <= 253 && s.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.')
}

impl std::str::FromStr for Delegated {
    type Err = DelegationError;

    fn from_str(value: &str) -> Result<Delegated, DelegationError> {
        let malformed = |why| DelegationError::Malformed { value: value.to_string(), why };
        let (scope, token) = value.rsplit_once(':').ok_or_else(|| malformed("no ':' before the token"))?;
        let (namespace, lease) = scope.split_once('/').ok_or_else(|| malformed("no '/' between namespace and lease"))?;
        if !is_name(namespace) || namespace.contains('.') {
            return Err(malformed("the namespace is not a namespace name"));
        }
        if !is_name(lease) {
            return Err(malformed("the lease is not a lease name"));
        }
        let token = token.parse::<Token>().map_err(|source| DelegationError::Token { value: value.to_string(), source })?;
        Ok(Delegated { namespace: namespace.to_string(), lease: lease.to_string(), token })
    }
}

impl Delegated {
    /// The grant delegated to this process: the environment variable [`GRANT_ENV`] (a Pod started
    /// with [`Grant::delegate`] has it).
    pub fn from_env() -> Result<Delegated, DelegationError> {
        match std::env::var(GRANT_ENV) {
            Ok(value) if !value.trim().is_empty() => value.trim().parse(),
            _ => Err(DelegationError::Absent(GRANT_ENV)),
        }
    }

    /// The grant delegated on `obj` (a work item a consumer picked up): its
    /// [`DELEGATED_GRANT_ANNOTATION`].
    pub fn from_object<K: Resource>(obj: &K) -> Result<Delegated, DelegationError> {
        match obj.annotations().get(DELEGATED_GRANT_ANNOTATION) {
            Some(value) => value.parse(),
            None => Err(DelegationError::Absent(DELEGATED_GRANT_ANNOTATION)),
        }
    }

    /// `obj` with this grant stamped onto it, for what a delegated worker starts in turn; see
    /// [`Grant::delegate`].
    pub fn delegate<K>(&self, obj: &K) -> Result<K, DelegationError>
    where
        K: Serialize + DeserializeOwned,
    {
        let mut value = serde_json::to_value(obj).map_err(|e| DelegationError::Unstampable(e.to_string()))?;
        stamp_delegation(&mut value, &self.to_string())?;
        serde_json::from_value(value).map_err(|e| DelegationError::Unstampable(e.to_string()))
    }

    fn fence(&self) -> Fence<'_> {
        Fence { lease: &self.lease, token: self.token }
    }

    /// Creates `obj` stamped with the delegated token (see [`Grant::create`]).
    pub async fn create<K>(&self, api: &Api<K>, obj: &K) -> Result<K, Error>
    where
        K: Resource + Clone + Serialize + DeserializeOwned + Debug,
    {
        self.fence().create(api, obj).await
    }

    /// Replaces `obj` stamped with the delegated token (see [`Grant::replace`]).
    pub async fn replace<K>(&self, api: &Api<K>, obj: &K) -> Result<K, Error>
    where
        K: Resource + Clone + Serialize + DeserializeOwned + Debug,
    {
        self.fence().replace(api, obj).await
    }

    /// Patches `name` stamped with the delegated token (see [`Grant::patch`]).
    pub async fn patch<K>(&self, api: &Api<K>, name: &str, params: &PatchParams, patch: Patch<serde_json::Value>) -> Result<K, Error>
    where
        K: Resource + Clone + DeserializeOwned + Debug,
    {
        self.fence().patch(api, name, params, patch).await
    }

    /// Reads `name`, edits it and replaces it, reading again when it changed in between (see
    /// [`Grant::update`]).
    pub async fn update<K>(&self, api: &Api<K>, name: &str, edit: impl FnMut(&mut K)) -> Result<K, Error>
    where
        K: Resource + Clone + Serialize + DeserializeOwned + Debug,
    {
        self.fence().update(api, name, edit).await
    }

    /// Deletes exactly the version of `obj` read (see [`Grant::delete`]).
    pub async fn delete<K>(&self, api: &Api<K>, obj: &K) -> Result<(), Error>
    where
        K: Resource + Clone + DeserializeOwned + Debug,
    {
        self.fence().delete(api, obj).await
    }
}

impl Grant {
    /// This grant as a [`Delegated`] one: its lease and token, for a writer that must not renew
    /// or release it.
    pub fn delegated(&self) -> Delegated {
        Delegated { namespace: self.namespace.clone(), lease: self.lease.clone(), token: self.token }
    }

    /// `obj` with this grant stamped onto it, to create it: the annotation
    /// [`DELEGATED_GRANT_ANNOTATION`] on the object and, when it runs Pods (a Pod, a Job, a
    /// CronJob, a Deployment, ...), on its Pod template, whose containers also get the
    /// environment variable [`GRANT_ENV`] from that annotation (downward API). A Pod so started
    /// writes with [`Delegated::from_env`]; a consumer of a work item with
    /// [`Delegated::from_object`]. The object itself is not guarded by this (no lease label):
    /// create it with [`Grant::create`] for that.
    ///
    /// ```no_run
    /// # async fn example(grant: kube_fence_client::Grant, client: kube::Client) -> Result<(), Box<dyn std::error::Error>> {
    /// use k8s_openapi::api::batch::v1::Job;
    /// let jobs: kube::Api<Job> = kube::Api::namespaced(client, &grant.namespace);
    /// let job: Job = serde_json::from_value(serde_json::json!({
    ///     "metadata": {"name": "report"},
    ///     "spec": {"template": {"spec": {"restartPolicy": "Never",
    ///         "containers": [{"name": "report", "image": "example/report"}]}}}}))?;
    /// jobs.create(&Default::default(), &grant.delegate(&job)?).await?;
    /// # Ok(()) }
    /// ```
    pub fn delegate<K>(&self, obj: &K) -> Result<K, DelegationError>
    where
        K: Serialize + DeserializeOwned,
    {
        self.delegated().delegate(obj)
    }
}

/// Stamps a delegation `grant` (`NAMESPACE/LEASE:TOKEN`) onto an object as JSON: its annotation,
/// and on each Pod template found (`spec` of a Pod, `spec.template` of a workload,
/// `spec.jobTemplate.spec.template` of a CronJob) the annotation and, on every container and
/// init container, the [`GRANT_ENV`] variable from it. Pure.
pub fn stamp_delegation(obj: &mut serde_json::Value, grant: &str) -> Result<(), DelegationError> {
    let root = obj.as_object_mut().ok_or_else(|| DelegationError::Unstampable("it is not a JSON object".into()))?;
    annotate(root, grant)?;
    let is_pod = root.get("kind").and_then(|k| k.as_str()) == Some("Pod");
    let Some(spec) = root.get_mut("spec").and_then(|s| s.as_object_mut()) else { return Ok(()) };
    if is_pod {
        return inject_env(spec);
    }
    let template = if spec.contains_key("jobTemplate") {
        spec.get_mut("jobTemplate").and_then(|t| t.get_mut("spec")).and_then(|s| s.get_mut("template"))
    } else {
        spec.get_mut("template")
    };
    let Some(template) = template.and_then(|t| t.as_object_mut()) else { return Ok(()) };
    annotate(template, grant)?;
    if let Some(pod_spec) = template.get_mut("spec").and_then(|s| s.as_object_mut()) {
        inject_env(pod_spec)?;
    }
    Ok(())
}

fn annotate(object: &mut serde_json::Map<String, serde_json::Value>, grant: &str) -> Result<(), DelegationError> {
    let metadata = object.entry("metadata").or_insert_with(|| serde_json::json!({}));
    let metadata = metadata.as_object_mut().ok_or_else(|| DelegationError::Unstampable("metadata is not an object".into()))?;
    let annotations = metadata.entry("annotations").or_insert_with(|| serde_json::json!({}));
    if annotations.is_null() {
        *annotations = serde_json::json!({});
    }
    let annotations =
        annotations.as_object_mut().ok_or_else(|| DelegationError::Unstampable("metadata.annotations is not an object".into()))?;
    annotations.insert(DELEGATED_GRANT_ANNOTATION.to_string(), serde_json::Value::String(grant.to_string()));
    Ok(())
}

fn inject_env(pod_spec: &mut serde_json::Map<String, serde_json::Value>) -> Result<(), DelegationError> {
    let variable = serde_json::json!({
        "name": GRANT_ENV,
        "valueFrom": {"fieldRef": {"fieldPath": format!("metadata.annotations['{DELEGATED_GRANT_ANNOTATION}']")}},
    });
    for list in ["initContainers", "containers"] {
        let Some(containers) = pod_spec.get_mut(list).and_then(|c| c.as_array_mut()) else { continue };
        for container in containers {
            let container =
                container.as_object_mut().ok_or_else(|| DelegationError::Unstampable(format!("an entry of {list} is not an object")))?;
            let env = container.entry("env").or_insert_with(|| serde_json::json!([]));
            if env.is_null() {
                *env = serde_json::json!([]);
            }
            let env = env.as_array_mut().ok_or_else(|| DelegationError::Unstampable("a container's env is not a list".into()))?;
            env.retain(|e| e.get("name").and_then(|n| n.as_str()) != Some(GRANT_ENV));
            env.push(variable.clone());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::batch::v1::{CronJob, Job};
    use k8s_openapi::api::core::v1::{ConfigMap, Pod};
    use rstest::rstest;

    fn grant(token: u64) -> Grant {
        Grant {
            namespace: "work".into(),
            lease: "jobs".into(),
            holder: "a".into(),
            token: Token::new(token).unwrap_or(Token::MAX),
            duration: std::time::Duration::from_secs(1),
            valid_until: tokio::time::Instant::now(),
            uid: None,
        }
    }

    #[rstest]
    #[case("work/jobs:42", Ok(("work", "jobs", 42)))]
    #[case("work/jobs.v2:0", Ok(("work", "jobs.v2", 0)))]
    #[case("work/jobs", Err("no ':'"))]
    #[case("jobs:42", Err("no '/'"))]
    #[case("/jobs:42", Err("namespace"))]
    #[case("wo.rk/jobs:42", Err("namespace"))]
    #[case("work/:42", Err("lease"))]
    #[case("work/a/b:42", Err("lease"))]
    #[case("work/Jobs:42", Err("lease"))]
    #[case("work/jobs:042", Err("leading zero"))]
    #[case("work/jobs:-1", Err("sign"))]
    #[case("work/jobs:", Err("empty"))]
    fn delegated_grants_parse_strictly(#[case] value: &str, #[case] expected: Result<(&str, &str, u64), &str>) {
        match (value.parse::<Delegated>(), expected) {
            (Ok(d), Ok((ns, lease, token))) => {
                assert_eq!((d.namespace.as_str(), d.lease.as_str(), d.token.get()), (ns, lease, token));
                assert_eq!(d.to_string(), value, "Display is what FromStr reads");
            }
            (Err(e), Err(why)) => {
                // The token's own error is the source, not part of the message.
                let chain: Vec<String> =
                    std::iter::successors(Some(&e as &dyn std::error::Error), |e| e.source()).map(|e| e.to_string()).collect();
                assert!(chain.iter().any(|said| said.contains(why)), "{value}: {chain:?}");
                assert!(chain.windows(2).all(|pair| !pair[0].contains(&pair[1])), "a message leaves its source out: {chain:?}");
            }
            (got, want) => panic!("{value}: got {got:?}, want {want:?}"),
        }
    }

    fn env_of(containers: &serde_json::Value) -> Vec<serde_json::Value> {
        containers.as_array().into_iter().flatten().flat_map(|c| c["env"].as_array().cloned().unwrap_or_default()).collect()
    }

    fn grant_variable() -> serde_json::Value {
        serde_json::json!({"name": GRANT_ENV, "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['kubefence.io/delegated-grant']"}}})
    }

    #[test]
    fn a_job_carries_the_grant_on_itself_its_pod_template_and_every_container() {
        let job: Job = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "report", "annotations": {"keep": "me"}},
            "spec": {"template": {"metadata": {"labels": {"app": "r"}}, "spec": {"restartPolicy": "Never",
                "initContainers": [{"name": "init", "image": "i"}],
                "containers": [
                    {"name": "a", "image": "a", "env": [{"name": "KUBE_FENCE_GRANT", "value": "old/stale:1"}, {"name": "X", "value": "1"}]},
                    {"name": "b", "image": "b"}]}}}
        }))
        .unwrap_or_default();
        let stamped = serde_json::to_value(grant(42).delegate(&job).unwrap_or_default()).unwrap_or_default();
        assert_eq!(stamped["metadata"]["annotations"][DELEGATED_GRANT_ANNOTATION], "work/jobs:42");
        assert_eq!(stamped["metadata"]["annotations"]["keep"], "me");
        let template = &stamped["spec"]["template"];
        assert_eq!(template["metadata"]["annotations"][DELEGATED_GRANT_ANNOTATION], "work/jobs:42");
        assert_eq!(template["metadata"]["labels"]["app"], "r");
        let spec = &template["spec"];
        for containers in [&spec["containers"], &spec["initContainers"]] {
            for container in containers.as_array().into_iter().flatten() {
                let env = container["env"].as_array().cloned().unwrap_or_default();
                assert_eq!(env.iter().filter(|e| e["name"] == GRANT_ENV).count(), 1, "one grant variable: {container}");
                assert!(env.contains(&grant_variable()), "{container}");
            }
        }
        assert!(env_of(&spec["containers"]).contains(&serde_json::json!({"name": "X", "value": "1"})), "other variables are kept");
        assert!(!stamped.to_string().contains("old/stale"), "a previous delegation is replaced");
    }

    #[test]
    fn pods_cronjobs_and_work_items_are_stamped_where_they_run_or_are_read() {
        let pod: Pod =
            serde_json::from_value(serde_json::json!({"metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "c"}]}}))
                .unwrap_or_default();
        let pod = serde_json::to_value(grant(7).delegate(&pod).unwrap_or_default()).unwrap_or_default();
        assert_eq!(pod["metadata"]["annotations"][DELEGATED_GRANT_ANNOTATION], "work/jobs:7");
        assert_eq!(env_of(&pod["spec"]["containers"]), vec![grant_variable()]);

        let cron: CronJob = serde_json::from_value(serde_json::json!({"metadata": {"name": "c"}, "spec": {"schedule": "* * * * *",
            "jobTemplate": {"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "c"}]}}}}}}))
        .unwrap_or_default();
        let cron = serde_json::to_value(grant(7).delegate(&cron).unwrap_or_default()).unwrap_or_default();
        let template = &cron["spec"]["jobTemplate"]["spec"]["template"];
        assert_eq!(template["metadata"]["annotations"][DELEGATED_GRANT_ANNOTATION], "work/jobs:7");
        assert_eq!(env_of(&template["spec"]["containers"]), vec![grant_variable()]);

        let item =
            ConfigMap { metadata: kube::api::ObjectMeta { name: Some("item-1".into()), ..Default::default() }, ..Default::default() };
        let item = grant(9).delegate(&item).unwrap_or_default();
        assert_eq!(Delegated::from_object(&item), Ok(grant(9).delegated()));
        let delegated_again = grant(9).delegated().delegate(&item).unwrap_or_default();
        assert_eq!(Delegated::from_object(&delegated_again), Ok(grant(9).delegated()), "a delegated grant delegates itself");
        assert_eq!(Delegated::from_object(&ConfigMap::default()), Err(DelegationError::Absent(DELEGATED_GRANT_ANNOTATION)));
    }

    #[test]
    fn stamping_refuses_what_is_not_an_object() {
        for bad in [serde_json::json!([1]), serde_json::json!({"metadata": []}), serde_json::json!({"metadata": {"annotations": 3}})] {
            let mut bad = bad;
            assert!(matches!(stamp_delegation(&mut bad, "work/jobs:1"), Err(DelegationError::Unstampable(_))), "{bad}");
        }
        let mut bad_env = serde_json::json!({"kind": "Pod", "spec": {"containers": [{"name": "c", "env": {}}]}});
        assert!(stamp_delegation(&mut bad_env, "work/jobs:1").is_err());
    }
}
