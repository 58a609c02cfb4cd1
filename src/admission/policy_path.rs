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
//! more: a token granted a moment ago may be denied ([`PolicyDenial`]; the client library retries
//! it briefly), a token never issued is always denied. A namespace whose parameters are missing
//! (it has no Leases, or they were deleted a moment ago and the controller is re-creating them)
//! denies every fast-path write ([`params_missing`]; retried like an unseen token).
//!
//! The policy cannot produce typed `status.details` (the API server puts only its message in a
//! cause), so its message starts with a fixed, machine-readable head ([`PolicyDenial::parse`]
//! reads it); both sides use this one file.

use crate::token::{LEASE_LABEL, TOKEN_ANNOTATION, Token, WRITER_LABEL};

/// Name of the parameter object (`crate::api::LeaseTokens`) in every namespace with kube-fence
/// Leases: `spec.tokens` maps each lease name to its newest issued token.
pub const PARAMS_NAME: &str = "kube-fence-tokens";
/// What the API server says when the binding finds no parameter in the object's namespace
/// (`parameterNotFoundAction: Deny`, answered 422 Invalid).
pub const PARAMS_MISSING: &str = "no params found for policy binding";
/// Name of the webhook's second match condition (present only with the policy path on).
pub const SKIP_CONDITION_NAME: &str = "not-judged-by-policy";
/// Head of the policy's denial message: `kubefence.io/policy-path TokenNotIssued <ns>/<lease>
/// presented=<t> issued=<i|none>: ...`.
pub const DENIAL_HEAD: &str = "kubefence.io/policy-path TokenNotIssued";

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

/// A denial by the policy, read back from the API server's error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyDenial {
    /// `namespace/name` of the lease.
    pub lease: String,
    pub presented: Option<Token>,
    /// The issued token the API server's parameter cache held (`None`: the lease was not in it).
    pub issued: Option<Token>,
}

/// Whether `status` is the API server's denial of a fast-path write for want of the namespace's
/// parameters (the policy path's binding, `parameterNotFoundAction: Deny`). The API server
/// answers it with a fixed message and no details, so that message is what identifies it.
pub fn params_missing(status: &kube::core::Status) -> bool {
    status.code == 422 && status.message.contains(PARAMS_MISSING) && status.message.contains(&format!("{POLICY_SUFFIX}' with binding"))
}

/// How the names of the policy path's policy and binding end (`<registration>-policy-path`).
pub const POLICY_SUFFIX: &str = "-policy-path";

impl PolicyDenial {
    /// The policy's denial in `status`, or `None` when it is something else.
    pub fn from_status(status: &kube::core::Status) -> Option<PolicyDenial> {
        if status.code != 403 {
            return None;
        }
        PolicyDenial::parse(&status.message)
    }

    /// Reads the head of the policy's message (the API server prefixes it with the policy's and
    /// binding's names).
    pub fn parse(message: &str) -> Option<PolicyDenial> {
        let (_, rest) = message.split_once(DENIAL_HEAD)?;
        let head = rest.split(':').next()?.trim();
        let mut words = head.split_whitespace();
        let lease = words.next()?.to_string();
        let (mut presented, mut issued) = (None, None);
        for word in words {
            match word.split_once('=') {
                Some(("presented", t)) => presented = t.parse().ok(),
                Some(("issued", t)) => issued = t.parse().ok(),
                _ => {}
            }
        }
        Some(PolicyDenial { lease, presented, issued })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_denial_head_is_read_back() {
        let message = format!(
            "ValidatingAdmissionPolicy 'kube-fence-policy-path' with binding 'kube-fence-policy-path' denied request: {DENIAL_HEAD} team/orders presented=57 issued=41: token 57 is newer"
        );
        assert_eq!(
            PolicyDenial::parse(&message),
            Some(PolicyDenial { lease: "team/orders".into(), presented: Token::new(57), issued: Token::new(41) })
        );
        let none = format!("{DENIAL_HEAD} team/orders presented=57 issued=none: x");
        assert_eq!(PolicyDenial::parse(&none).and_then(|d| d.issued), None);
        assert_eq!(PolicyDenial::parse("admission webhook \"fence.kubefence.io\" denied the request: stale"), None);
    }

    #[test]
    fn the_expressions_name_the_guard() {
        let path = fast_path();
        for needle in [LEASE_LABEL, TOKEN_ANNOTATION, WRITER_LABEL, "request.operation == 'UPDATE'", "int(object.metadata.annotations"] {
            assert!(path.contains(needle), "{needle}");
        }
        assert_eq!(webhook_condition(), format!("!({path})"));
    }
}
