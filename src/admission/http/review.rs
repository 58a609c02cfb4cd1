//! The wire: an AdmissionReview body in, the decision's [`Request`] out, and a [`Verdict`] back
//! into an AdmissionResponse. Pure and total on any bytes: the property tests
//! (`tests/admission_props.rs`) feed [`decode`] arbitrary and mutated bodies.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::apimachinery::pkg::apis::meta::v1::Time;
use kube::core::admission::Operation as KubeOperation;
use kube::core::{DynamicResourceScope, ObjectMeta, Resource, Status};
use serde::de::{Deserializer, IgnoredAny, MapAccess, Visitor};

use crate::admission::judge::facts::{Digest, GroupResource, ObjectFacts};

use crate::admission::judge::facts::Operation;

use crate::admission::judge::facts::PodIdentity;

use kube_fence_api::denial::Reason;

use crate::admission::judge::facts::Request;

use crate::admission::judge::verdict::Verdict;
use kube_fence_api::denial;
use kube_fence_api::names::{LEASE_LABEL, TOKEN_ANNOTATION, WRITE_ANNOTATION, WRITER_LABEL};

/// Why a body is not a review the webhook can judge.
#[derive(Debug)]
pub enum Unreadable {
    /// Not JSON, or no `request.uid`: answered with HTTP 400 (there is no uid to answer to).
    NotAReview(String),
    /// A review (its uid is known) whose request cannot be read: denied, code 400.
    Malformed { uid: String, message: String },
}

/// The request of an AdmissionReview as the webhook reads it: only what judging, logging and
/// Events need, its strings borrowed from the body (copied only when they hold JSON escapes),
/// and the objects reduced to [`Guardable`]. Every other field is skipped unread.
#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Admission<'a> {
    #[serde(borrow)]
    pub uid: Cow<'a, str>,
    #[serde(borrow)]
    pub kind: Kind<'a>,
    /// The resource written (absent in a malformed review: then nothing is exempt by resource).
    #[serde(default, borrow)]
    pub resource: ResourceName<'a>,
    #[serde(default, borrow)]
    pub sub_resource: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    pub name: Cow<'a, str>,
    #[serde(default, borrow)]
    pub namespace: Option<Cow<'a, str>>,
    pub operation: KubeOperation,
    #[serde(borrow)]
    pub user_info: User<'a>,
    #[serde(default)]
    pub object: Option<Guardable>,
    #[serde(default)]
    pub old_object: Option<Guardable>,
    #[serde(default, borrow)]
    options: Option<Options<'a>>,
}

/// The kind of the object under admission.
#[derive(Debug, serde::Deserialize)]
pub struct Kind<'a> {
    #[serde(default, borrow)]
    pub group: Cow<'a, str>,
    #[serde(default, borrow)]
    pub version: Cow<'a, str>,
    #[serde(default, borrow)]
    pub kind: Cow<'a, str>,
}

/// The resource under admission (`request.resource`; its version is not needed).
#[derive(Debug, Default, serde::Deserialize)]
pub struct ResourceName<'a> {
    #[serde(default, borrow)]
    pub group: Cow<'a, str>,
    #[serde(default, borrow)]
    pub resource: Cow<'a, str>,
}

/// Who asked: the username, and the Pod a ServiceAccount token was bound to.
#[derive(Debug, serde::Deserialize)]
pub struct User<'a> {
    #[serde(default, borrow)]
    pub username: Option<Cow<'a, str>>,
    #[serde(default, borrow)]
    extra: Extra<'a>,
}

/// `userInfo.extra`, of which only the bound Pod's name is kept.
#[derive(Debug, Default)]
struct Extra<'a> {
    pod: Option<Cow<'a, str>>,
}

impl<'de: 'a, 'a> serde::Deserialize<'de> for Extra<'a> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Extra<'a>, D::Error> {
        struct ExtraVisitor<'a>(std::marker::PhantomData<&'a ()>);
        impl<'de: 'a, 'a> Visitor<'de> for ExtraVisitor<'a> {
            type Value = Extra<'a>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a map of string lists")
            }
            fn visit_unit<E>(self) -> Result<Extra<'a>, E> {
                Ok(Extra::default())
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Extra<'a>, A::Error> {
                let mut extra = Extra::default();
                while let Some(Key(key)) = map.next_key::<Key<'de>>()? {
                    if key == crate::admission::judge::facts::POD_NAME_EXTRA {
                        let names: Vec<Key<'de>> = map.next_value()?;
                        extra.pod = names.into_iter().next().map(|Key(name)| name);
                    } else {
                        map.next_value::<IgnoredAny>()?;
                    }
                }
                Ok(extra)
            }
        }
        deserializer.deserialize_any(ExtraVisitor(std::marker::PhantomData))
    }
}

/// The operation's options: only a DELETE's resourceVersion precondition is read.
#[derive(Debug, serde::Deserialize)]
struct Options<'a> {
    #[serde(default, borrow)]
    preconditions: Option<Preconditions<'a>>,
}

#[derive(Debug, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct Preconditions<'a> {
    #[serde(default, borrow)]
    resource_version: Option<Cow<'a, str>>,
}

/// A string borrowed from the body unless it holds escapes (a bare `Cow<str>` is always copied).
#[derive(serde::Deserialize)]
struct Key<'a>(#[serde(borrow)] Cow<'a, str>);

#[derive(serde::Deserialize)]
struct ReviewWire<'a> {
    #[serde(borrow)]
    request: Option<Admission<'a>>,
}

/// Reads an AdmissionReview body in one pass, borrowing from it. Only when that fails is the
/// body read again, loosely, to find the uid a denial must carry — the common path builds no
/// intermediate `serde_json::Value` (for a 1 MiB object that copy was a large part of the
/// decision's cost) and no owned copy of the request's strings.
pub fn decode(body: &[u8]) -> Result<Admission<'_>, Unreadable> {
    let error = match serde_json::from_slice::<ReviewWire<'_>>(body) {
        Ok(ReviewWire { request: Some(request) }) => return Ok(request),
        Ok(ReviewWire { request: None }) => "the review has no request".to_string(),
        Err(err) => err.to_string(),
    };
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|err| Unreadable::NotAReview(format!("the body is not JSON: {err}")))?;
    match value.pointer("/request/uid").and_then(|u| u.as_str()) {
        Some(uid) => {
            Err(Unreadable::Malformed { uid: uid.to_string(), message: format!("kube-fence cannot read this AdmissionReview: {error}") })
        }
        None => Err(Unreadable::NotAReview("not an AdmissionReview: request.uid is missing".into())),
    }
}

/// An AdmissionReview carrying a response, as the webhook writes it (admission.k8s.io/v1, the
/// only version it registers for).
#[derive(Debug, serde::Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Answer<'a> {
    api_version: &'static str,
    kind: &'static str,
    pub response: Response<'a>,
}

/// The response: the request's uid, the verdict, and for a denial its `Status`.
#[derive(Debug, serde::Serialize)]
pub struct Response<'a> {
    pub uid: &'a str,
    pub allowed: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub status: Option<Status>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    pub warnings: &'a [String],
    /// Kept by the API server in its audit log, each key prefixed with the webhook's name.
    #[serde(rename = "auditAnnotations", skip_serializing_if = "BTreeMap::is_empty")]
    pub audit_annotations: BTreeMap<&'static str, &'a str>,
}

impl<'a> Answer<'a> {
    fn new(uid: &'a str, allowed: bool, status: Option<Status>, warnings: &'a [String]) -> Answer<'a> {
        let response = Response { uid, allowed, status, warnings, audit_annotations: BTreeMap::new() };
        Answer { api_version: "admission.k8s.io/v1", kind: "AdmissionReview", response }
    }

    /// The JSON body.
    pub fn to_vec(&self) -> Vec<u8> {
        // Strings, a bool and a Status: serializing them cannot fail.
        serde_json::to_vec(self).unwrap_or_default()
    }
}

/// The AdmissionResponse that carries `verdict`; a denial's facts go to `status.details`
/// ([`denial::status`]); who held the Lease a write was admitted for goes to `auditAnnotations`
/// ([`Held::annotations`](crate::admission::judge::verdict::Held::annotations)), and so does
/// why a write admitted with a warning (Audit, `Warn`) would have been denied (`would-deny`,
/// the denial's reason), so the audit log keeps every one, however many Events were dropped.
pub fn response<'a>(request: &'a Admission<'_>, verdict: &'a Verdict) -> Answer<'a> {
    match verdict {
        Verdict::Allow { .. } => Answer::new(&request.uid, true, None, &[]),
        Verdict::AllowHeld { held, .. } => {
            let mut answer = Answer::new(&request.uid, true, None, &[]);
            answer.response.audit_annotations.extend(held.annotations());
            answer
        }
        Verdict::AllowWithWarning { reason, message } => {
            let mut answer = Answer::new(&request.uid, true, None, std::slice::from_ref(message));
            answer.response.audit_annotations.insert("would-deny", reason.as_str());
            answer
        }
        Verdict::Deny { code, reason, message, facts } => {
            Answer::new(&request.uid, false, Some(denial::status(*code, *reason, message, facts)), &[])
        }
    }
}

/// The response to a review whose request could not be read: denied (fail closed), code 400.
pub fn malformed<'a>(uid: &'a str, message: &str) -> Answer<'a> {
    let status = Status::failure(message, Reason::MalformedRequest.as_str()).with_code(400);
    Answer::new(uid, false, Some(status), &[])
}

/// An object under admission as fencing reads it: its metadata (name, namespace, uid, labels,
/// annotations, finalizers, deletion timestamp) and a digest of the rest.
///
/// Every other field (a ConfigMap's data, a Deployment's spec, managedFields) is skipped while
/// the review is parsed, never copied: the decision does not depend on it — except for an
/// object being deleted, whose other fields are hashed so that a write that only removes
/// finalizers can be told apart (see `decision`).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Guardable {
    pub metadata: ObjectMeta,
    /// Digest of every field outside `metadata`; computed only for an object being deleted.
    #[serde(skip)]
    pub content: Option<Digest>,
}

/// The metadata fields fencing and logging read; the rest is skipped unread.
#[derive(Default, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
struct MetadataWire {
    name: Option<String>,
    namespace: Option<String>,
    uid: Option<String>,
    labels: Option<BTreeMap<String, String>>,
    annotations: Option<BTreeMap<String, String>>,
    finalizers: Option<Vec<String>>,
    deletion_timestamp: Option<Time>,
    /// Kept as JSON text, for the digest only: a finalizer removal that also adds an owner is
    /// not a finalizer removal (the garbage collector, which is exempt, would then delete the
    /// object with its new owner).
    owner_references: Option<Box<serde_json::value::RawValue>>,
}

impl<'de> serde::Deserialize<'de> for Guardable {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Guardable, D::Error> {
        deserializer.deserialize_map(GuardableVisitor)
    }
}

struct GuardableVisitor;

impl<'de> Visitor<'de> for GuardableVisitor {
    type Value = Guardable;

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a Kubernetes object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Guardable, A::Error> {
        let mut metadata: Option<MetadataWire> = None;
        let mut hasher = Hasher::new();
        // Fields before metadata are kept, not hashed, until it says whether the object is being
        // deleted (they are apiVersion and kind from the API server, but any field may come
        // first, e.g. `data` in a client's sorted JSON); after it, they are hashed only when it is.
        let mut before_metadata: Vec<(Cow<'de, str>, Box<serde_json::value::RawValue>)> = Vec::new();
        while let Some(Key(key)) = map.next_key::<Key<'de>>()? {
            if key == "metadata" {
                let meta: MetadataWire = map.next_value()?;
                if meta.deletion_timestamp.is_some() {
                    for (key, raw) in &before_metadata {
                        hasher.field(key.as_bytes());
                        hasher.field(raw.get());
                    }
                }
                before_metadata = Vec::new();
                metadata = Some(meta);
                continue;
            }
            match &metadata {
                None => before_metadata.push((key, map.next_value()?)),
                Some(meta) if meta.deletion_timestamp.is_some() => {
                    let raw: Box<serde_json::value::RawValue> = map.next_value()?;
                    hasher.field(key.as_bytes());
                    hasher.field(raw.get());
                }
                Some(_) => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        let MetadataWire { name, namespace, uid, labels, annotations, finalizers, deletion_timestamp, owner_references } =
            metadata.unwrap_or_default();
        let content = deletion_timestamp.is_some().then(|| {
            hasher.optional(owner_references.as_ref().map(|raw| raw.get()));
            hasher.finish()
        });
        let metadata = ObjectMeta { name, namespace, uid, labels, annotations, finalizers, deletion_timestamp, ..ObjectMeta::default() };
        Ok(Guardable { metadata, content })
    }
}

/// Any kind: the webhook is registered for every resource, and judges them alike.
impl Resource for Guardable {
    type DynamicType = ();
    type Scope = DynamicResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }
    fn group(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }
    fn version(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }
    fn plural(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("")
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// SHA-256 over a sequence of fields, each length-prefixed (so `("ab", "c")` and `("a", "bc")`
/// differ): a digest that is the same in every build and release (std's `DefaultHasher` promises
/// neither) and that a writer cannot steer into a collision (it sees and chooses the content).
struct Hasher(ring::digest::Context);

impl Hasher {
    fn new() -> Hasher {
        Hasher(ring::digest::Context::new(&ring::digest::SHA256))
    }

    fn field(&mut self, bytes: impl AsRef<[u8]>) {
        let bytes = bytes.as_ref();
        self.0.update(&(bytes.len() as u64).to_le_bytes());
        self.0.update(bytes);
    }

    /// `None` and `Some("")` differ.
    fn optional(&mut self, value: Option<&str>) {
        match value {
            None => self.0.update(&[0]),
            Some(value) => {
                self.0.update(&[1]);
                self.field(value);
            }
        }
    }

    /// A map's entries in key order (a `BTreeMap`'s), after its size; `None` and empty differ.
    fn map(&mut self, map: Option<&BTreeMap<String, String>>) {
        match map {
            None => self.0.update(&[0]),
            Some(map) => {
                self.0.update(&[1]);
                self.0.update(&(map.len() as u64).to_le_bytes());
                for (key, value) in map {
                    self.field(key);
                    self.field(value);
                }
            }
        }
    }

    fn finish(self) -> Digest {
        let mut digest = [0; 32];
        digest.copy_from_slice(self.0.finish().as_ref());
        Digest(digest)
    }
}

/// What fencing reads of one object.
pub fn object_facts(obj: &Guardable) -> ObjectFacts {
    let meta = &obj.metadata;
    // Labels and annotations belong to what a finalizer removal must leave alone.
    let content = obj.content.map(|rest| {
        let mut hasher = Hasher::new();
        hasher.field(rest.0);
        hasher.map(meta.labels.as_ref());
        hasher.map(meta.annotations.as_ref());
        hasher.finish()
    });
    ObjectFacts {
        lease: meta.labels.as_ref().and_then(|l| l.get(LEASE_LABEL)).cloned(),
        token: meta.annotations.as_ref().and_then(|a| a.get(TOKEN_ANNOTATION)).cloned(),
        write: meta.annotations.as_ref().and_then(|a| a.get(WRITE_ANNOTATION)).cloned(),
        deleting: meta.deletion_timestamp.is_some(),
        finalizers: meta.finalizers.clone().unwrap_or_default(),
        writer: meta.labels.as_ref().and_then(|l| l.get(WRITER_LABEL)).cloned(),
        content,
        leader_lease: meta.labels.as_ref().and_then(|l| l.get(kube_fence_api::names::LEADER_LEASE_LABEL)).cloned(),
    }
}

/// Reduces a review to the facts the decision needs.
pub fn request_facts(request: &Admission<'_>) -> Request {
    let delete_precondition = request
        .options
        .as_ref()
        .and_then(|o| o.preconditions.as_ref())
        .and_then(|p| p.resource_version.as_deref())
        .is_some_and(|rv| !rv.is_empty());
    Request {
        operation: match request.operation {
            KubeOperation::Create => Operation::Create,
            KubeOperation::Update => Operation::Update,
            KubeOperation::Delete => Operation::Delete,
            KubeOperation::Connect => Operation::Connect,
        },
        namespace: request.namespace.as_deref().unwrap_or_default().to_string(),
        subresource: request.sub_resource.as_deref().filter(|s| !s.is_empty()).map(str::to_string),
        old: request.old_object.as_ref().map(object_facts),
        new: request.object.as_ref().map(object_facts),
        user: request.user_info.username.as_deref().unwrap_or_default().to_string(),
        pod: PodIdentity::of(request.user_info.username.as_deref().unwrap_or_default(), request.user_info.extra.pod.as_deref()),
        delete_precondition,
        resource: GroupResource { group: request.resource.group.to_string(), resource: request.resource.resource.to_string() },
        name: request.name.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn review(operation: &str, object: serde_json::Value, old: serde_json::Value) -> Vec<u8> {
        serde_json::to_vec(&serde_json::json!({
            "apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u-1", "kind": {"group": "", "version": "v1", "kind": "ConfigMap"},
                        "resource": {"group": "", "version": "v1", "resource": "configmaps"},
                        "name": "x", "namespace": "ns", "operation": operation, "userInfo": {"username": "alice"},
                        "object": object, "oldObject": old}
        }))
        .unwrap_or_default()
    }

    #[test]
    fn decode_reads_a_review_in_one_pass() {
        let body = review(
            "CREATE",
            serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "labels": {LEASE_LABEL: "work"}, "annotations": {TOKEN_ANNOTATION: "7"}}}),
            serde_json::Value::Null,
        );
        let request = decode(&body).map_err(|e| format!("{e:?}")).unwrap();
        assert_eq!(request.uid, "u-1");
        let facts = request_facts(&request);
        assert_eq!(facts.new, Some(ObjectFacts::guarded("work", Some("7"))));
        assert_eq!(facts.subresource, None);
        let verdict = Verdict::Allow { reason: Reason::Fenced };
        let answer = response(&request, &verdict);
        assert!(answer.response.allowed);
        assert_eq!(answer.response.uid, "u-1");
        let json: serde_json::Value = serde_json::from_slice(&answer.to_vec()).unwrap_or_default();
        assert_eq!(
            json,
            serde_json::json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": {"uid": "u-1", "allowed": true}})
        );
    }

    /// What the answer tells the API server's audit log: a write admitted for a Lease's holder
    /// names the Lease, the holder and the Lease's version read; one admitted with a warning (an
    /// Audit fence, a `Warn` lease) says why Enforce would deny it, beside the warning; a plain
    /// admission says nothing.
    #[rstest::rstest]
    #[case::held(
        Verdict::AllowHeld {
            reason: Reason::Fenced,
            held: crate::admission::judge::verdict::Held {
                lease: "team/ctl".into(),
                holder: "ctl-0_1a2b".into(),
                resource_version: "3100".into(),
            },
        },
        serde_json::json!({"uid": "u-1", "allowed": true, "auditAnnotations": {"lease": "team/ctl", "holder": "ctl-0_1a2b", "lease-resource-version": "3100"}})
    )]
    #[case::warned(
        Verdict::AllowWithWarning { reason: Reason::NotHolder, message: "would deny".into() },
        serde_json::json!({"uid": "u-1", "allowed": true, "warnings": ["would deny"], "auditAnnotations": {"would-deny": "NotHolder"}})
    )]
    #[case::plain(Verdict::Allow { reason: Reason::Exempt }, serde_json::json!({"uid": "u-1", "allowed": true}))]
    fn an_admission_tells_the_audit_log_who_or_what_would_deny(#[case] verdict: Verdict, #[case] expect: serde_json::Value) {
        let object = serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}});
        let body = review("CREATE", object, serde_json::Value::Null);
        let request = decode(&body).map_err(|e| format!("{e:?}")).unwrap();
        let json: serde_json::Value = serde_json::from_slice(&response(&request, &verdict).to_vec()).unwrap_or_default();
        assert_eq!(json["response"], expect);
    }

    /// The borrowed request reads what the API server sends for a Pod's ServiceAccount: the
    /// bound Pod among the other `extra` keys, a DELETE's precondition, and strings with escapes.
    #[test]
    fn decode_reads_the_pod_the_precondition_and_escaped_strings() {
        let body = br#"{"kind":"AdmissionReview","apiVersion":"admission.k8s.io/v1","request":{"uid":"u-\u0031","kind":{"group":"apps","version":"v1","kind":"Deployment"},"resource":{"group":"apps","version":"v1","resource":"deployments"},"name":"we\"b","namespace":"ns","operation":"DELETE","userInfo":{"username":"system:serviceaccount:ns:worker","groups":["system:serviceaccounts"],"extra":{"authentication.kubernetes.io/credential-id":["JTI=1"],"authentication.kubernetes.io/pod-name":["worker-0"],"authentication.kubernetes.io/pod-uid":["9"]}},"oldObject":{"kind":"Deployment","metadata":{"name":"we\"b"}},"options":{"kind":"DeleteOptions","apiVersion":"meta.k8s.io/v1","preconditions":{"resourceVersion":"42"}}}}"#;
        let request = decode(body).map_err(|e| format!("{e:?}")).unwrap();
        assert_eq!(request.uid, "u-1");
        assert_eq!(request.name, "we\"b");
        assert_eq!(request.kind.group, "apps");
        let facts = request_facts(&request);
        assert_eq!(facts.pod, Some(PodIdentity { namespace: "ns".into(), name: "worker-0".into() }));
        assert!(facts.delete_precondition);
        assert_eq!(facts.operation, Operation::Delete);
        assert_eq!(facts.user, "system:serviceaccount:ns:worker");
        // A user without extra, and an extra without the Pod.
        let plain = String::from_utf8_lossy(body).replace(r#","extra":{"authentication.kubernetes.io/credential-id":["JTI=1"],"authentication.kubernetes.io/pod-name":["worker-0"],"authentication.kubernetes.io/pod-uid":["9"]}"#, "");
        assert_eq!(request_facts(&decode(plain.as_bytes()).map_err(|e| format!("{e:?}")).unwrap()).pod, None);
        let null = String::from_utf8_lossy(body).replace(r#"["worker-0"]"#, "[]");
        assert_eq!(request_facts(&decode(null.as_bytes()).map_err(|e| format!("{e:?}")).unwrap()).pod, None);
    }

    #[test]
    fn decode_tells_unreadable_requests_from_non_reviews() {
        assert!(matches!(decode(b"not json"), Err(Unreadable::NotAReview(m)) if m.contains("not JSON")));
        assert!(
            matches!(decode(br#"{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}"#), Err(Unreadable::NotAReview(m)) if m.contains("uid"))
        );
        // Annotations that are not strings: the review is known (uid), its object unreadable.
        let bad = review(
            "CREATE",
            serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "annotations": {TOKEN_ANNOTATION: 5}}}),
            serde_json::Value::Null,
        );
        assert!(matches!(decode(&bad), Err(Unreadable::Malformed { uid, .. }) if uid == "u-1"));
    }

    fn deleting(data: &str, finalizers: &[&str], extra_label: Option<&str>) -> serde_json::Value {
        let mut labels = serde_json::json!({LEASE_LABEL: "work"});
        if let Some(v) = extra_label {
            labels["extra"] = v.into();
        }
        serde_json::json!({"apiVersion": "v1", "kind": "ConfigMap",
            "metadata": {"name": "x", "labels": labels, "annotations": {TOKEN_ANNOTATION: "7"},
                         "deletionTimestamp": "2026-12-03T08:00:00Z", "finalizers": finalizers, "resourceVersion": "12"},
            "data": {"k": data}})
    }

    #[test]
    fn an_object_being_deleted_carries_a_digest_of_what_a_finalizer_removal_leaves_alone() {
        let facts = |new: serde_json::Value| {
            let body = review("UPDATE", new, deleting("v", &["a", "b"], None));
            let request = decode(&body).map_err(|e| format!("{e:?}")).unwrap();
            request_facts(&request)
        };
        let same = facts(deleting("v", &["a"], None));
        let (old, new) = (same.old.unwrap_or_default(), same.new.unwrap_or_default());
        assert!(old.deleting && new.deleting);
        assert_eq!(old.finalizers, ["a", "b"]);
        assert!(old.content.is_some());
        assert_eq!(old.content, new.content, "resourceVersion and finalizers are not content");
        let data = facts(deleting("changed", &["a"], None)).new.unwrap_or_default();
        assert_ne!(old.content, data.content, "data is content");
        let label = facts(deleting("v", &["a"], Some("x"))).new.unwrap_or_default();
        assert_ne!(old.content, label.content, "labels are content");
        // Threat: a worker with ordinary RBAC hands the object to the garbage collector (exempt)
        // by giving it an owner it may delete, in a write that also removes a finalizer.
        let mut owned = deleting("v", &["a"], None);
        owned["metadata"]["ownerReferences"] = serde_json::json!([{"apiVersion": "v1", "kind": "ConfigMap", "name": "o", "uid": "1"}]);
        assert_ne!(old.content, facts(owned).new.unwrap_or_default().content, "owner references are content");
        // Not being deleted: no digest is computed.
        let body = review("CREATE", serde_json::json!({"metadata": {"name": "x"}, "data": {"k": "v"}}), serde_json::Value::Null);
        let request = decode(&body).map_err(|e| format!("{e:?}")).unwrap();
        assert_eq!(request_facts(&request).new.and_then(|n| n.content), None);
    }

    /// Threat case: a stale-but-honest writer removing a finalizer from an object being deleted
    /// while also changing its data is judged on the data wherever it comes in the object:
    /// before `metadata` (a client's sorted JSON) or after it (the API server's field order).
    #[test]
    fn the_digest_covers_fields_on_both_sides_of_metadata() {
        let object = |first: &str, last: &str| {
            format!(
                r#"{{{first}"metadata":{{"name":"x","labels":{{"{LEASE_LABEL}":"work"}},"deletionTimestamp":"2026-12-03T08:00:00Z","finalizers":["a"]}}{last}}}"#
            )
        };
        let digest = |object: String| {
            let body = format!(
                r#"{{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{{"uid":"u-1","kind":{{"group":"","version":"v1","kind":"ConfigMap"}},"resource":{{"group":"","version":"v1","resource":"configmaps"}},"name":"x","namespace":"ns","operation":"UPDATE","userInfo":{{"username":"alice"}},"object":{object},"oldObject":{object}}}}}"#
            );
            let request = decode(body.as_bytes()).map_err(|e| format!("{e:?}")).unwrap();
            request_facts(&request).new.and_then(|n| n.content)
        };
        let before = digest(object(r#""data":{"k":"v"},"#, ""));
        assert!(before.is_some());
        assert_ne!(before, digest(object(r#""data":{"k":"changed"},"#, "")), "data before metadata is content");
        let after = digest(object("", r#","data":{"k":"v"}"#));
        assert!(after.is_some());
        assert_ne!(after, digest(object("", r#","data":{"k":"changed"}"#)), "data after metadata is content");
    }

    /// The digest is SHA-256 over length-prefixed fields: the same in every build and release
    /// (two webhook versions during an upgrade judge alike), pinned here by value. The value was
    /// checked outside Rust: Python's hashlib over the same bytes (field = u64 LE length + bytes;
    /// an absent owner list, labels or annotations = one 0 byte; present = 1, u64 LE count, fields).
    #[test]
    fn the_digest_is_pinned() {
        let object = r#"{"metadata":{"name":"x","deletionTimestamp":"2026-12-03T08:00:00Z","finalizers":["a"]},"data":{"k":"v"}}"#;
        let body = format!(
            r#"{{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview","request":{{"uid":"u-1","kind":{{"group":"","version":"v1","kind":"ConfigMap"}},"resource":{{"group":"","version":"v1","resource":"configmaps"}},"name":"x","namespace":"ns","operation":"UPDATE","userInfo":{{"username":"alice"}},"object":{object},"oldObject":{object}}}}}"#
        );
        let request = decode(body.as_bytes()).map_err(|e| format!("{e:?}")).unwrap();
        let digest = request_facts(&request).new.and_then(|n| n.content).map(|d| d.to_string());
        assert_eq!(digest.as_deref(), Some(PINNED_DIGEST));
    }

    const PINNED_DIGEST: &str = "c8e0783adf939bc606eb60da23401016a7002854dec438a9f74deb852c5d5b7d";

    #[test]
    fn a_subresource_is_named() {
        let mut value: serde_json::Value =
            serde_json::from_slice(&review("UPDATE", serde_json::json!({"metadata": {}}), serde_json::json!({"metadata": {}})))
                .unwrap_or_default();
        value["request"]["subResource"] = "status".into();
        let body = serde_json::to_vec(&value).unwrap_or_default();
        let request = decode(&body).map_err(|e| format!("{e:?}")).unwrap();
        assert_eq!(request_facts(&request).subresource.as_deref(), Some("status"));
    }
}
