//! What the policy path (kube-fence's `--policy-path`: fresh-token writes judged inside the API
//! server by a ValidatingAdmissionPolicy) answers a writer, and the names both sides agree on.
//!
//! The policy cannot produce typed `status.details` (the API server puts only its message in a
//! cause), so its message starts with a fixed, machine-readable head, [`DENIAL_HEAD`]: kube-fence
//! writes it into the policy, and [`PolicyDenial::parse`] reads it back.

use crate::token::Token;

/// Name of the parameter object ([`crate::LeaseTokens`]) in every namespace with kube-fence
/// Leases: `spec.tokens` maps each lease name to its newest issued token.
pub const PARAMS_NAME: &str = "kube-fence-tokens";
/// What the API server says when the binding finds no parameter in the object's namespace
/// (`parameterNotFoundAction: Deny`, answered 422 Invalid).
pub const PARAMS_MISSING: &str = "no params found for policy binding";
/// Head of the policy's denial message: `kubefence.io/policy-path TokenNotIssued <ns>/<lease>
/// presented=<t> issued=<i|none>: ...`.
pub const DENIAL_HEAD: &str = "kubefence.io/policy-path TokenNotIssued";

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

/// What the API server says while it cannot map the policy's `paramKind` (`LeaseTokens`) to a
/// resource (answered 422 Invalid): it resolves a policy's `paramKind` through a discovery cache
/// it refreshes every 30 s, so a policy compiled before the CRD was discoverable — one created
/// with the CRD, or any, on an API server that has just started — fails every fast-path write
/// closed until that refresh (docs/design.md §10a).
pub const PARAMS_KIND_UNRESOLVED: &str = "failed to find resource referenced by paramKind";

/// Whether `status` is the API server's denial of a fast-path write because it cannot resolve the
/// policy path's `paramKind` yet ([`PARAMS_KIND_UNRESOLVED`]). A fixed message and no details,
/// as for [`params_missing`]; the policy's name tells it from another policy's.
pub fn params_kind_unresolved(status: &kube::core::Status) -> bool {
    status.code == 422
        && status.message.contains(PARAMS_KIND_UNRESOLVED)
        && status.message.contains(&format!("{POLICY_SUFFIX}' denied request"))
        && status.message.contains(&format!("Kind={}'", <crate::LeaseTokens as kube::Resource>::kind(&())))
}

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

    /// The API server's answers while the policy path cannot be judged, as kube-apiserver
    /// words them, told apart from each other and from another policy's.
    #[test]
    fn the_api_servers_answers_without_a_judgement() {
        let missing = "ValidatingAdmissionPolicy 'kf-policy-path' with binding 'kf-policy-path' denied request: failed to configure binding: no params found for policy binding with `Deny` parameterNotFoundAction";
        let unresolved = "configmaps \"c\" is forbidden: ValidatingAdmissionPolicy 'kf-policy-path' denied request: failed to configure policy: failed to find resource referenced by paramKind: 'kubefence.io/v1alpha1, Kind=LeaseTokens'";
        let table: [(&str, u16, String, (bool, bool)); 6] = [
            ("params missing", 422, missing.into(), (true, false)),
            ("kind unresolved", 422, unresolved.into(), (false, true)),
            (
                "another policy's kind",
                422,
                unresolved
                    .replace("'kf-policy-path'", "'probe'")
                    .replace("kubefence.io/v1alpha1, Kind=LeaseTokens", "probe.example.io/v1, Kind=Probe"),
                (false, false),
            ),
            ("another kind, a look-alike name", 422, unresolved.replace("Kind=LeaseTokens", "Kind=Probe"), (false, false)),
            ("another policy's params", 422, missing.replace("kf-policy-path", "probe"), (false, false)),
            ("not 422", 403, unresolved.into(), (false, false)),
        ];
        for (case, code, message, expected) in table {
            let status = kube::core::Status::failure(&message, "Invalid").with_code(code);
            assert_eq!((params_missing(&status), params_kind_unresolved(&status)), expected, "{case}");
        }
    }
}
