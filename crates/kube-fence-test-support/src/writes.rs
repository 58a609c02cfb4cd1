//! How the API server answered a write, read from its typed Status (code and reason), never its
//! message text; and the guarded object most tests write.

use std::fmt::Debug;

use k8s_openapi::api::core::v1::ConfigMap;
use kube::api::ObjectMeta;
use kube::core::Status;
use kube_fence_api::denial::Reason;
use kube_fence_api::names::LEASE_LABEL;

/// A ConfigMap guarded by `lease` (bound by its label), without a token.
pub fn guarded_configmap(name: &str, lease: &str) -> ConfigMap {
    ConfigMap {
        metadata: ObjectMeta {
            name: Some(name.into()),
            labels: Some([(LEASE_LABEL.to_string(), lease.to_string())].into()),
            ..Default::default()
        },
        ..Default::default()
    }
}

/// What the API server answered a write: the write must have been refused (panics if it was
/// admitted or failed some other way, e.g. a transport error).
pub fn rejected<T: Debug>(result: Result<T, kube::Error>) -> Status {
    match result {
        Err(kube::Error::Api(e)) => *e,
        Ok(obj) => panic!("the write was admitted: {obj:?}"),
        Err(e) => panic!("the write failed without an answer from the API server: {e}"),
    }
}

/// What the API server stored: the write must have been admitted.
pub fn accepted<T>(result: Result<T, kube::Error>) -> T {
    result.unwrap_or_else(|e| panic!("the write was refused: {e}"))
}

/// Whether the API server refused a write because kube-fence judged and denied it: the Status
/// the webhook answered with travels to the writer unchanged, with kube-fence's `reason`.
pub fn denied_by_kube_fence(e: &Status, reason: Reason) -> bool {
    e.reason == reason.as_str()
}

/// Whether the API server refused a guarded write because it could not call the webhook
/// (`failurePolicy: Fail`): an internal error, 500, instead of the write.
pub fn failed_closed(e: &Status) -> bool {
    e.code == 500 && e.reason == "InternalError"
}
