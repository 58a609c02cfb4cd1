//! The policy path (`--policy-path`, docs/design.md §9): the common guarded write judged inside
//! the API server by a ValidatingAdmissionPolicy (CEL), with no webhook call.
//!
//! Which writes take it — [`fast_path`], evaluated by the API server from the request alone:
//! an UPDATE of the object itself (no subresource) whose stored object is guarded (lease label,
//! a valid recorded token `r`), whose incoming object keeps the same lease label and presents a
//! valid token `t > r`, and neither of which is holder-only (`kubefence.io/writer`). For those
//! the policy checks the one thing the objects cannot say: `t <= issued`, the lease's newest
//! token, from one parameter object per namespace (the `LeaseTokens` [`PARAMS_NAME`], a kind only
//! kube-fence writes, kept equal to the Leases by the lease controller: `crate::lease::params`). The webhook's second match condition skips exactly
//! these writes ([`webhook_condition`]); everything else — CREATE, DELETE, newly guarded objects,
//! stale (`t <= r`), equal (AllowEqual restatements), tokenless or malformed tokens, holder-only
//! objects, subresources — still goes to the webhook, which answers with its typed denials.
//!
//! Why it is safe: `t > r` is read from `object`/`oldObject`, which for an UPDATE are the exact
//! stored version the write replaces (the policy runs in the same admission chain, inside the
//! storage compare-and-swap, like the webhook: §6). The parameter comes from the API server's
//! informer cache and may lag, but the issued token only grows, so a lagging cache only denies
//! more: a token granted a moment ago may be denied (`PolicyDenial`; the client library retries
//! it briefly), a token never issued is always denied. A namespace whose parameters are missing
//! (it has no Leases, or they were deleted a moment ago and the controller is re-creating them)
//! denies every fast-path write (`params_missing`; retried like an unseen token).
//!
//! The policy cannot produce typed `status.details` (the API server puts only its message in a
//! cause), so its message starts with a fixed, machine-readable head (`PolicyDenial::parse`
//! reads it); both sides take it from the contract crate (`kube_fence_api::policy_path`).

use kube_fence_api::policy_path::{DENIAL_HEAD, PARAMS_NAME};

use kube_fence_api::names::{LEASE_LABEL, TOKEN_ANNOTATION, WRITER_LABEL};

/// Name of the webhook's second match condition (present only with the policy path on).
pub const SKIP_CONDITION_NAME: &str = "not-judged-by-policy";

/// CEL: `x` (a string) is a token — decimal, no padding, at most 2^63-1 — so `int(x)` cannot fail.
fn valid_token(x: &str) -> String {
    format!("({x}.matches('^(0|[1-9][0-9]{{0,18}})$') && (size({x}) < 19 || {x} <= '9223372036854775807'))")
}

/// CEL (request, object and oldObject only; cannot fail to evaluate: every lookup is guarded):
/// the write the policy judges and the webhook skips.
pub fn fast_path() -> String {
    let has = |obj: &str, field: &str, key: &str| format!("(has({obj}.metadata.{field}) && '{key}' in {obj}.metadata.{field})");
    let token = |obj: &str| format!("{obj}.metadata.annotations['{TOKEN_ANNOTATION}']");
    let lease = |obj: &str| format!("{obj}.metadata.labels['{LEASE_LABEL}']");
    [
        "request.operation == 'UPDATE'".to_string(),
        "(!has(request.subResource) || request.subResource == '')".to_string(),
        "object != null && oldObject != null".to_string(),
        has("oldObject", "labels", LEASE_LABEL),
        has("object", "labels", LEASE_LABEL),
        format!("{} == {}", lease("object"), lease("oldObject")),
        format!("!{}", has("oldObject", "labels", WRITER_LABEL)),
        format!("!{}", has("object", "labels", WRITER_LABEL)),
        has("oldObject", "annotations", TOKEN_ANNOTATION),
        has("object", "annotations", TOKEN_ANNOTATION),
        valid_token(&token("oldObject")),
        valid_token(&token("object")),
        format!("int({}) > int({})", token("object"), token("oldObject")),
    ]
    .join(" && ")
}

/// CEL: the webhook's second match condition — every write the policy does not judge.
pub fn webhook_condition() -> String {
    format!("!({})", fast_path())
}

/// The policy's variables: the lease, the presented token, and the issued token as the
/// parameter says (an integer, validated by the CRD's schema; `-1` when the lease is not in it).
pub fn variables() -> Vec<(&'static str, String)> {
    vec![
        ("lease", format!("object.metadata.labels['{LEASE_LABEL}']")),
        ("presented", format!("object.metadata.annotations['{TOKEN_ANNOTATION}']")),
        (
            "issued",
            "has(params.spec) && has(params.spec.tokens) && variables.lease in params.spec.tokens ? params.spec.tokens[variables.lease] : -1"
                .to_string(),
        ),
    ]
}

/// CEL: the presented token is not newer than the lease's newest issued token.
pub fn rule() -> String {
    "variables.issued >= 0 && int(variables.presented) <= variables.issued".to_string()
}

/// CEL: the denial message, starting with [`DENIAL_HEAD`].
pub fn message() -> String {
    format!(
        "'{DENIAL_HEAD} ' + object.metadata.namespace + '/' + variables.lease + ' presented=' + variables.presented + ' issued=' + (variables.issued < 0 ? 'none' : string(variables.issued)) + ': token ' + variables.presented + ' is newer than the newest token of lease ' + object.metadata.namespace + '/' + variables.lease + ' the API server has seen issued (LeaseTokens {PARAMS_NAME}): it was never issued, or it was granted a moment ago and the cache has not seen it yet (retry)'"
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_expressions_name_the_guard() {
        let path = fast_path();
        for needle in [LEASE_LABEL, TOKEN_ANNOTATION, WRITER_LABEL, "request.operation == 'UPDATE'", "int(object.metadata.annotations"] {
            assert!(path.contains(needle), "{needle}");
        }
        assert_eq!(webhook_condition(), format!("!({path})"));
    }
}
