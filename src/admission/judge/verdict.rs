//! The judgement on one request, as every guard gives it and the wire turns it into an
//! AdmissionResponse.

use kube_fence_api::denial::{Facts, Reason};

/// The judgement on one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Allow {
        reason: Reason,
    },
    /// Admitted because the requester's Pod holds a leader-election Lease (the writer fence, an
    /// object labelled `kubefence.io/leader-lease`): the answer names who held it, as the quorum
    /// read returned it.
    AllowHeld {
        reason: Reason,
        held: Held,
    },
    /// Would have been denied, but the lease's enforcement is `Warn`.
    AllowWithWarning {
        reason: Reason,
        message: String,
    },
    /// `code` is the HTTP status the API server returns to the writer: 409 for a stale token
    /// (normal recovery: reread and retry under a newer grant), 403 for a write fencing
    /// forbids, 400 for malformed input, 500 when the lease could not be read.
    Deny {
        code: u16,
        reason: Reason,
        message: String,
        facts: Facts,
    },
}

impl Verdict {
    pub fn reason(&self) -> Reason {
        match self {
            Verdict::Allow { reason }
            | Verdict::AllowHeld { reason, .. }
            | Verdict::AllowWithWarning { reason, .. }
            | Verdict::Deny { reason, .. } => *reason,
        }
    }

    /// `allowed`, `warned` or `denied` (the metric label).
    pub fn kind(&self) -> &'static str {
        match self {
            Verdict::Allow { .. } | Verdict::AllowHeld { .. } => "allowed",
            Verdict::AllowWithWarning { .. } => "warned",
            Verdict::Deny { .. } => "denied",
        }
    }

    pub fn is_allowed(&self) -> bool {
        !matches!(self, Verdict::Deny { .. })
    }

    /// A denial with no facts (judged before any lease was named or read).
    pub fn deny(code: u16, reason: Reason, message: String) -> Verdict {
        Verdict::Deny { code, reason, message, facts: Facts::default() }
    }
}

/// Who held the leader-election Lease a write was admitted for holding, as the quorum read the
/// judgement used returned it. The webhook's answer carries it as audit annotations
/// ([`Held::annotations`]), so the API server's audit log says, beside each admitted write,
/// which holder let it through and at which version of its Lease: a create that commits after a
/// successor took the Lease was judged before the takeover exactly when that version is older
/// than the successor's acquisition (docs/design.md §6b).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Held {
    /// The Lease, `namespace/name`.
    pub lease: String,
    /// Its `holderIdentity`.
    pub holder: String,
    /// The Lease's `resourceVersion` the read returned (`""` when the reader gave none).
    pub resource_version: String,
}

impl Held {
    /// The answer's `auditAnnotations`; the API server prefixes each key with the webhook's name
    /// (`writer.kubefence.io/holder`, …).
    pub fn annotations(&self) -> [(&'static str, &str); 3] {
        [("lease", &self.lease), ("holder", &self.holder), ("lease-resource-version", &self.resource_version)]
    }
}
