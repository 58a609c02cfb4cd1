//! Fenced writes: create / replace / patch / update / delete any resource with the grant's token.
//!
//! Each helper stamps the object with the `kubefence.io/lease: <lease>` label and the
//! `kubefence.io/token: <token>` annotation and maps the fencing webhook's rejection to
//! [`Error::StaleToken`]. They are generic over every [`kube::Resource`], `DynamicObject`
//! included.

use std::fmt::Debug;

use kube::api::{Api, DeleteParams, Patch, PatchParams, PostParams, Preconditions};
use kube::{Resource, ResourceExt};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::{Error, Grant};
use kube_fence_api::denial::{Denial, Reason};
use kube_fence_api::names::{LEASE_LABEL, TOKEN_ANNOTATION, WRITE_ANNOTATION};
use kube_fence_api::policy_path::{PolicyDenial, params_kind_unresolved, params_missing};
use kube_fence_api::token::Token;

/// Stamps `obj` with the grant's lease label and token annotation.
pub fn stamp<K: Resource>(grant: &Grant, obj: &mut K) {
    grant.fence().stamp(obj);
}

/// What a fenced write needs: the lease and the token. [`Grant`] and [`super::Delegated`] write
/// through it, so a delegated write is the holder's write, byte for byte.
#[derive(Clone, Copy, Debug)]
pub(super) struct Fence<'a> {
    pub lease: &'a str,
    pub token: Token,
}

/// A value for the `kubefence.io/write` annotation no earlier write of this process (or, by
/// the clock and process id, of another) used: it marks the token as restated by this write.
pub fn write_id() -> String {
    static WRITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = WRITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
    format!("{nanos:x}-{:x}-{n:x}", std::process::id())
}

/// How long a write denied by the policy path (`kube_fence_api::policy_path`) for a token its
/// parameter cache has not seen is retried: a grant reaches the cache within milliseconds to
/// a second (the controller writes the parameters after the grant; the API server's informer
/// delivers them); a token still denied after this was never issued.
pub const UNSEEN_TOKEN_BUDGET: std::time::Duration = std::time::Duration::from_secs(5);

/// Runs `write` and, while the policy path denies it because the API server's parameter cache
/// has not seen its token yet — or has no parameters for the namespace yet (they are written
/// after the namespace's first Lease, and re-created at once when deleted), or the API server
/// cannot resolve the parameters' kind yet (`policy_path::params_kind_unresolved`: until its
/// discovery refresh, at most 30 s, after it started or after the policy came with its CRD) —
/// runs it again
/// (25 ms, doubling to 400 ms, for at most [`UNSEEN_TOKEN_BUDGET`]). The same request each time:
/// admitted later is what admitted now would have been. Any other outcome, and the last of
/// these once the budget is spent, is returned as it is.
pub async fn retry_unseen_token<T, F, Fut>(mut write: F) -> Result<T, kube::Error>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, kube::Error>>,
{
    let deadline = tokio::time::Instant::now() + UNSEEN_TOKEN_BUDGET;
    let mut pause = std::time::Duration::from_millis(25);
    loop {
        match write().await {
            Err(kube::Error::Api(status))
                if (PolicyDenial::from_status(&status).is_some() || params_missing(&status) || params_kind_unresolved(&status))
                    && tokio::time::Instant::now() + pause < deadline =>
            {
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(std::time::Duration::from_millis(400));
            }
            other => return other,
        }
    }
}

/// Maps an API error of a fenced write to the library's error, from the typed facts the
/// webhook puts in `status.details` ([`Denial`]): a `StaleToken` denial to
/// [`Error::StaleToken`], any other kube-fence denial to [`Error::Fenced`], the API server's own
/// 409 (a failed precondition) to [`Error::Conflict`].
fn classify(err: kube::Error) -> Error {
    let kube::Error::Api(status) = &err else { return Error::Kube(err) };
    if let Some(denied) = PolicyDenial::from_status(status) {
        // The policy path's denial, after [`retry_unseen_token`]: the token was never issued.
        return Error::Fenced(Denial {
            code: status.code,
            reason: Reason::TokenNotIssued,
            lease: Some(denied.lease),
            presented: denied.presented,
            recorded: denied.issued,
            holder: None,
            requester: None,
        });
    }
    if params_missing(status) {
        // The namespace has no parameters (no Lease has issued a token there), after
        // [`retry_unseen_token`].
        return Error::Fenced(Denial {
            code: status.code,
            reason: Reason::TokenNotIssued,
            lease: None,
            presented: None,
            recorded: None,
            holder: None,
            requester: None,
        });
    }
    match Denial::from_status(status) {
        Some(Denial { reason: Reason::StaleToken, presented: Some(presented), recorded: Some(recorded), .. }) => {
            Error::StaleToken { presented, recorded }
        }
        Some(Denial { reason: Reason::NotHolder, code: 409, lease: Some(lease), holder, requester, .. }) => {
            Error::NotHolder { lease, holder, requester }
        }
        Some(denial) => Error::Fenced(denial),
        None if status.code == 409 => Error::Conflict(status.message.clone()),
        None => Error::Kube(err),
    }
}

impl Grant {
    /// Creates `obj` stamped with this grant's token. The webhook admits it only while this is
    /// the lease's newest token.
    ///
    /// ```no_run
    /// # async fn example(grant: kube_fence_client::Grant, client: kube::Client) -> Result<(), kube_fence_client::Error> {
    /// use k8s_openapi::api::core::v1::ConfigMap;
    /// let api: kube::Api<ConfigMap> = kube::Api::namespaced(client, &grant.namespace);
    /// let mut cm = ConfigMap::default();
    /// cm.metadata.name = Some("result".into());
    /// grant.create(&api, &cm).await?;
    /// # Ok(()) }
    /// ```
    pub async fn create<K>(&self, api: &Api<K>, obj: &K) -> Result<K, Error>
    where
        K: Resource + Clone + Serialize + DeserializeOwned + Debug,
    {
        self.fence().create(api, obj).await
    }

    /// Replaces `obj` (as read, with its resourceVersion) stamped with this grant's token.
    ///
    /// ```no_run
    /// # async fn example(grant: kube_fence_client::Grant, client: kube::Client) -> Result<(), kube_fence_client::Error> {
    /// use k8s_openapi::api::core::v1::ConfigMap;
    /// use kube_fence_client::Error;
    /// let api: kube::Api<ConfigMap> = kube::Api::namespaced(client, &grant.namespace);
    /// let mut cm = api.get("result").await?;
    /// cm.data.get_or_insert_with(Default::default).insert("k".into(), "v".into());
    /// match grant.replace(&api, &cm).await {
    ///     Err(Error::StaleToken { recorded, .. }) => println!("superseded by token {recorded}"),
    ///     other => { other?; }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn replace<K>(&self, api: &Api<K>, obj: &K) -> Result<K, Error>
    where
        K: Resource + Clone + Serialize + DeserializeOwned + Debug,
    {
        self.fence().replace(api, obj).await
    }

    /// Patches `name` with a merge, strategic-merge or apply patch, into whose `metadata` the
    /// token annotation and lease label are merged.
    ///
    /// ```no_run
    /// # async fn example(grant: kube_fence_client::Grant, client: kube::Client) -> Result<(), kube_fence_client::Error> {
    /// use k8s_openapi::api::core::v1::ConfigMap;
    /// use kube::api::{Patch, PatchParams};
    /// let api: kube::Api<ConfigMap> = kube::Api::namespaced(client, &grant.namespace);
    /// let patch = serde_json::json!({"data": {"phase": "done"}});
    /// grant.patch(&api, "result", &PatchParams::default(), Patch::Merge(patch)).await?;
    /// # Ok(()) }
    /// ```
    pub async fn patch<K>(&self, api: &Api<K>, name: &str, params: &PatchParams, patch: Patch<serde_json::Value>) -> Result<K, Error>
    where
        K: Resource + Clone + DeserializeOwned + Debug,
    {
        self.fence().patch(api, name, params, patch).await
    }

    /// Reads `name`, lets `edit` change it, and replaces it with this grant's token; when the
    /// object changed in between (the API server's own 409, [`Error::Conflict`]) it reads it
    /// again and edits again, up to 8 times. [`Error::StaleToken`] is returned as it is: a newer
    /// grant wrote the object, and retrying with this token cannot succeed — reread the state the
    /// newer holder left and decide from it.
    ///
    /// ```no_run
    /// # async fn example(grant: kube_fence_client::Grant, client: kube::Client) -> Result<(), kube_fence_client::Error> {
    /// use k8s_openapi::api::core::v1::ConfigMap;
    /// let api: kube::Api<ConfigMap> = kube::Api::namespaced(client, &grant.namespace);
    /// grant.update(&api, "result", |cm: &mut ConfigMap| {
    ///     cm.data.get_or_insert_with(Default::default).insert("phase".into(), "done".into());
    /// }).await?;
    /// # Ok(()) }
    /// ```
    pub async fn update<K>(&self, api: &Api<K>, name: &str, edit: impl FnMut(&mut K)) -> Result<K, Error>
    where
        K: Resource + Clone + Serialize + DeserializeOwned + Debug,
    {
        self.fence().update(api, name, edit).await
    }

    /// Deletes `obj` with a resourceVersion (and uid) precondition, so it deletes exactly the
    /// version read — a newer holder's write in between makes it fail with [`Error::Conflict`].
    /// Refused locally with [`Error::StaleToken`] if `obj` already records a newer token.
    ///
    /// ```no_run
    /// # async fn example(grant: kube_fence_client::Grant, client: kube::Client) -> Result<(), kube_fence_client::Error> {
    /// use k8s_openapi::api::core::v1::ConfigMap;
    /// let api: kube::Api<ConfigMap> = kube::Api::namespaced(client, &grant.namespace);
    /// let cm = api.get("result").await?;
    /// grant.delete(&api, &cm).await?;
    /// # Ok(()) }
    /// ```
    pub async fn delete<K>(&self, api: &Api<K>, obj: &K) -> Result<(), Error>
    where
        K: Resource + Clone + DeserializeOwned + Debug,
    {
        self.fence().delete(api, obj).await
    }

    /// Patches the `/status` of `name`, a holder-only object (`kubefence.io/writer: holder`) of
    /// this grant's identity-bound lease. A status write cannot carry a token (the API server
    /// keeps the stored metadata on `/status`), so no token is stamped: the webhook admits it
    /// only while the requester holds the lease, and a write after another holder took over
    /// fails with [`Error::NotHolder`].
    ///
    /// ```no_run
    /// # async fn example(grant: kube_fence_client::Grant, client: kube::Client) -> Result<(), kube_fence_client::Error> {
    /// use k8s_openapi::api::apps::v1::Deployment;
    /// use kube::api::{Patch, PatchParams};
    /// let api: kube::Api<Deployment> = kube::Api::namespaced(client, &grant.namespace);
    /// let status = serde_json::json!({"status": {"observedGeneration": 3}});
    /// grant.patch_status(&api, "web", &PatchParams::default(), Patch::Merge(status)).await?;
    /// # Ok(()) }
    /// ```
    pub async fn patch_status<K>(&self, api: &Api<K>, name: &str, params: &PatchParams, patch: Patch<serde_json::Value>) -> Result<K, Error>
    where
        K: Resource + Clone + DeserializeOwned + Debug,
    {
        api.patch_status(name, params, &patch).await.map_err(classify)
    }

    pub(super) fn fence(&self) -> Fence<'_> {
        Fence { lease: &self.lease, token: self.token }
    }
}

/// How many times [`Fence::update`] reads again after the object changed under it.
const UPDATE_ATTEMPTS: usize = 8;

impl Fence<'_> {
    fn stamp<K: Resource>(&self, obj: &mut K) {
        obj.labels_mut().insert(LEASE_LABEL.to_string(), self.lease.to_string());
        obj.annotations_mut().insert(TOKEN_ANNOTATION.to_string(), self.token.to_string());
        obj.annotations_mut().insert(WRITE_ANNOTATION.to_string(), write_id());
    }

    pub(super) async fn create<K>(&self, api: &Api<K>, obj: &K) -> Result<K, Error>
    where
        K: Resource + Clone + Serialize + DeserializeOwned + Debug,
    {
        let mut obj = obj.clone();
        self.stamp(&mut obj);
        api.create(&PostParams::default(), &obj).await.map_err(classify)
    }

    pub(super) async fn replace<K>(&self, api: &Api<K>, obj: &K) -> Result<K, Error>
    where
        K: Resource + Clone + Serialize + DeserializeOwned + Debug,
    {
        let mut obj = obj.clone();
        self.stamp(&mut obj);
        let name = obj.meta().name.clone().ok_or(Error::Missing("name"))?;
        let params = PostParams::default();
        retry_unseen_token(|| api.replace(&name, &params, &obj)).await.map_err(classify)
    }

    pub(super) async fn patch<K>(&self, api: &Api<K>, name: &str, params: &PatchParams, patch: Patch<serde_json::Value>) -> Result<K, Error>
    where
        K: Resource + Clone + DeserializeOwned + Debug,
    {
        #[allow(unreachable_patterns)]
        let patch = match patch {
            Patch::Merge(v) => Patch::Merge(self.stamp_patch(v)?),
            Patch::Strategic(v) => Patch::Strategic(self.stamp_patch(v)?),
            Patch::Apply(v) => Patch::Apply(self.stamp_patch(v)?),
            _ => return Err(Error::UnsupportedPatch("JSON patches cannot be stamped; use a merge or apply patch")),
        };
        retry_unseen_token(|| api.patch(name, params, &patch)).await.map_err(classify)
    }

    pub(super) async fn update<K>(&self, api: &Api<K>, name: &str, mut edit: impl FnMut(&mut K)) -> Result<K, Error>
    where
        K: Resource + Clone + Serialize + DeserializeOwned + Debug,
    {
        let mut last = String::new();
        for _ in 0..UPDATE_ATTEMPTS {
            let mut obj = api.get(name).await.map_err(classify)?;
            edit(&mut obj);
            match self.replace(api, &obj).await {
                Err(Error::Conflict(message)) => last = message,
                other => return other,
            }
        }
        Err(Error::Conflict(last))
    }

    pub(super) async fn delete<K>(&self, api: &Api<K>, obj: &K) -> Result<(), Error>
    where
        K: Resource + Clone + DeserializeOwned + Debug,
    {
        let meta = obj.meta();
        let name = meta.name.clone().ok_or(Error::Missing("name"))?;
        let resource_version = meta.resource_version.clone().ok_or(Error::Missing("resourceVersion"))?;
        if let Some(recorded) = obj.annotations().get(TOKEN_ANNOTATION).and_then(|t| t.parse::<Token>().ok())
            && recorded > self.token
        {
            return Err(Error::StaleToken { presented: self.token, recorded });
        }
        delete_read_version(api, &name, &resource_version, meta.uid.clone()).await
    }

    fn stamp_patch(&self, mut patch: serde_json::Value) -> Result<serde_json::Value, Error> {
        let root = patch.as_object_mut().ok_or(Error::UnsupportedPatch("the patch is not a JSON object"))?;
        let metadata = root.entry("metadata").or_insert_with(|| serde_json::json!({}));
        let metadata = metadata.as_object_mut().ok_or(Error::UnsupportedPatch("metadata is not an object"))?;
        for (field, key, value) in [
            ("labels", LEASE_LABEL, self.lease.to_string()),
            ("annotations", TOKEN_ANNOTATION, self.token.to_string()),
            ("annotations", WRITE_ANNOTATION, write_id()),
        ] {
            let map = metadata.entry(field).or_insert_with(|| serde_json::json!({}));
            let map = map.as_object_mut().ok_or(Error::UnsupportedPatch("metadata labels/annotations are not an object"))?;
            map.insert(key.to_string(), serde_json::Value::String(value));
        }
        Ok(patch)
    }
}

/// Deletes `name` only in the version `resource_version` (and `uid`) that was read: a DELETE
/// carries no token, so "delete what you saw" is what the webhook asks of a guarded object. A
/// write in between fails it with [`Error::Conflict`]; a holder-only object's webhook refusal
/// with [`Error::NotHolder`].
pub async fn delete_read_version<K>(api: &Api<K>, name: &str, resource_version: &str, uid: Option<String>) -> Result<(), Error>
where
    K: Resource + Clone + DeserializeOwned + Debug,
{
    let params = DeleteParams {
        preconditions: Some(Preconditions { resource_version: Some(resource_version.to_string()), uid }),
        ..DeleteParams::default()
    };
    api.delete(name, &params).await.map(|_| ()).map_err(classify)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube_fence_api::denial;

    fn t(n: u64) -> Token {
        Token::new(n).unwrap_or(Token::MAX)
    }

    fn status(code: u16, reason: &str, message: &str) -> kube::Error {
        kube::Error::Api(Box::new(kube::core::Status { code, reason: reason.into(), message: message.into(), ..Default::default() }))
    }

    #[test]
    fn a_webhook_rejection_is_a_typed_stale_token() {
        let facts =
            kube_fence_api::denial::Facts { lease: Some("ns/l".into()), presented: Some(t(4)), recorded: Some(t(5)), ..Default::default() };
        // The message says nothing the client reads: only the typed facts count.
        let wire = denial::status(409, Reason::StaleToken, "denied", &facts);
        let err = classify(kube::Error::Api(Box::new(wire)));
        assert!(matches!(err, Error::StaleToken { presented, recorded } if presented == t(4) && recorded == t(5)), "{err:?}");
        let missing = denial::status(403, Reason::TokenMissing, "no token", &facts);
        assert!(matches!(classify(kube::Error::Api(Box::new(missing))), Error::Fenced(Denial { reason: Reason::TokenMissing, .. })));
        let facts = kube_fence_api::denial::Facts {
            lease: Some("ns/l".into()),
            holder: Some("b".into()),
            requester: Some("a".into()),
            ..Default::default()
        };
        let not_holder = denial::status(409, Reason::NotHolder, "denied", &facts);
        assert!(
            matches!(classify(kube::Error::Api(Box::new(not_holder))), Error::NotHolder { lease, holder: Some(h), requester: Some(r) } if lease == "ns/l" && h == "b" && r == "a")
        );
    }

    #[test]
    fn a_policy_path_denial_is_a_typed_token_not_issued() {
        let message = format!(
            "ValidatingAdmissionPolicy 'kf-policy-path' with binding 'kf-policy-path' denied request: {} ns/l presented=9 issued=7: newer",
            kube_fence_api::policy_path::DENIAL_HEAD
        );
        let err = classify(status(403, "Forbidden", &message));
        assert!(
            matches!(&err, Error::Fenced(Denial { reason: Reason::TokenNotIssued, lease: Some(l), presented: Some(p), recorded: Some(r), .. })
                if l == "ns/l" && *p == t(9) && *r == t(7)),
            "{err:?}"
        );
    }

    /// The API server's answer when the namespace has no parameters (its message, as
    /// kube-apiserver words it).
    const PARAMS_MISSING_MESSAGE: &str = "ValidatingAdmissionPolicy 'kf-policy-path' with binding 'kf-policy-path' denied request: failed to configure binding: no params found for policy binding with `Deny` parameterNotFoundAction";

    #[test]
    fn missing_parameters_are_a_typed_token_not_issued() {
        let err = classify(status(422, "Invalid", PARAMS_MISSING_MESSAGE));
        assert!(matches!(&err, Error::Fenced(Denial { reason: Reason::TokenNotIssued, code: 422, lease: None, .. })), "{err:?}");
        // Another policy's missing parameters are not the policy path's.
        let other = PARAMS_MISSING_MESSAGE.replace("kf-policy-path", "someone-else");
        assert!(matches!(classify(status(422, "Invalid", &other)), Error::Kube(_)));
    }

    #[tokio::test]
    async fn missing_parameters_are_retried() {
        let calls = std::sync::atomic::AtomicU32::new(0);
        let admitted = retry_unseen_token(|| {
            let n = calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            async move { if n < 2 { Err(status(422, "Invalid", PARAMS_MISSING_MESSAGE)) } else { Ok(n) } }
        })
        .await;
        assert_eq!(admitted.ok(), Some(2));
    }

    #[tokio::test]
    async fn an_unseen_token_is_retried_and_other_answers_are_not() {
        let message = format!("{} ns/l presented=9 issued=7: newer", kube_fence_api::policy_path::DENIAL_HEAD);
        let calls = std::sync::atomic::AtomicU32::new(0);
        let admitted = retry_unseen_token(|| {
            let n = calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let message = message.clone();
            async move { if n < 3 { Err(status(403, "Forbidden", &message)) } else { Ok(n) } }
        })
        .await;
        assert_eq!(admitted.ok(), Some(3));
        let calls = std::sync::atomic::AtomicU32::new(0);
        let stale = retry_unseen_token(|| {
            calls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            async { Err::<(), _>(status(409, "StaleToken", "stale")) }
        })
        .await;
        assert!(stale.is_err());
        assert_eq!(calls.load(std::sync::atomic::Ordering::Relaxed), 1);
    }

    #[test]
    fn a_failed_precondition_is_a_conflict_and_others_stay_api_errors() {
        assert!(matches!(classify(status(409, "Conflict", "the object has been modified")), Error::Conflict(_)));
        assert!(matches!(classify(status(403, "Forbidden", "RBAC says no")), Error::Kube(_)));
    }

    #[test]
    fn patches_are_stamped_into_metadata() {
        let grant = Grant {
            namespace: "ns".into(),
            lease: "l".into(),
            holder: "h".into(),
            token: t(77),
            duration: std::time::Duration::from_secs(1),
            valid_until: tokio::time::Instant::now(),
            uid: None,
        };
        let stamped =
            grant.fence().stamp_patch(serde_json::json!({"metadata": {"labels": {"a": "b"}}, "data": {"x": "1"}})).unwrap_or_default();
        assert_eq!(stamped["metadata"]["labels"]["a"], "b");
        assert_eq!(stamped["metadata"]["labels"][LEASE_LABEL], "l");
        assert_eq!(stamped["metadata"]["annotations"][TOKEN_ANNOTATION], "77");
        assert!(grant.fence().stamp_patch(serde_json::json!([1])).is_err());
    }
}
