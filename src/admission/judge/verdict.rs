//! The judgement on one request, as every guard gives it and the wire turns it into an
//! AdmissionResponse.

use kube_fence_api::denial::{Facts, Reason};

/// The judgement on one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Allow {
        reason: Reason,
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
            Verdict::Allow { reason } | Verdict::AllowWithWarning { reason, .. } | Verdict::Deny { reason, .. } => *reason,
        }
    }

    /// `allowed`, `warned` or `denied` (the metric label).
    pub fn kind(&self) -> &'static str {
        match self {
            Verdict::Allow { .. } => "allowed",
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
