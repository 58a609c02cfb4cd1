//! The denial contract between the webhook and the writers: a rejected write's facts travel in
//! the response's `status.details.causes`, typed, so no client ever parses a message.
//!
//! The API server hands the webhook's whole `Status` to the writer (prefixing only the
//! message), so a writer reads `reason` (a [`Reason`]) and the causes below from the error it
//! gets back. The webhook writes them with [`status`] and the client library reads them with
//! [`Denial::from_status`]: both sides use this one file, so they cannot disagree.

use kube::core::Status;
use kube::core::response::{StatusCause, StatusDetails};

use crate::names::TOKEN_ANNOTATION;
pub use crate::reason::Reason;
use crate::token::Token;

/// The facts of a denial, for the writer to read typed (they travel in the response's
/// `status.details`: [`status`] writes them, [`Denial::from_status`] reads them back).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Facts {
    /// `namespace/name` of the lease that judged the write.
    pub lease: Option<String>,
    /// The token the write presented.
    pub presented: Option<Token>,
    /// The token the write had to beat: the object's recorded token, or for a CREATE the
    /// lease's newest token.
    pub recorded: Option<Token>,
    /// The lease's current holder, when the write was judged by who holds the lease.
    pub holder: Option<String>,
    /// Who asked, as the lease names holders (a Pod name or a username).
    pub requester: Option<String>,
}

/// Cause type: `namespace/name` of the lease that judged the write.
pub const CAUSE_LEASE: &str = "kubefence.io/lease";
/// Cause type: the token the write presented.
pub const CAUSE_PRESENTED: &str = "kubefence.io/presented-token";
/// Cause type: the token the write had to beat (the object's recorded token, or for a create
/// the lease's newest token).
pub const CAUSE_RECORDED: &str = "kubefence.io/recorded-token";

/// Cause type: the current holder of the lease that judged the write.
pub const CAUSE_HOLDER: &str = "kubefence.io/holder";
/// Cause type: who asked, as the lease names holders.
pub const CAUSE_REQUESTER: &str = "kubefence.io/requester";

/// The `Status` of a denial: `code`, `reason`, `message`, and the facts as causes.
pub fn status(code: u16, reason: Reason, message: &str, facts: &Facts) -> Status {
    let field = format!("metadata.annotations[{TOKEN_ANNOTATION}]");
    let mut causes = Vec::new();
    if let Some(lease) = &facts.lease {
        causes.push(StatusCause { reason: CAUSE_LEASE.into(), message: lease.clone(), field: String::new() });
    }
    if let Some(presented) = facts.presented {
        causes.push(StatusCause { reason: CAUSE_PRESENTED.into(), message: presented.to_string(), field: field.clone() });
    }
    if let Some(recorded) = facts.recorded {
        causes.push(StatusCause { reason: CAUSE_RECORDED.into(), message: recorded.to_string(), field });
    }
    for (kind, value) in [(CAUSE_HOLDER, &facts.holder), (CAUSE_REQUESTER, &facts.requester)] {
        if let Some(value) = value {
            causes.push(StatusCause { reason: kind.into(), message: value.clone(), field: String::new() });
        }
    }
    let status = Status::failure(message, reason.as_str()).with_code(code);
    // The API server turns retryAfterSeconds into a Retry-After header, which client-go obeys.
    let retry_after_seconds = retry_after(reason);
    if causes.is_empty() && retry_after_seconds == 0 {
        status
    } else {
        status.with_details(StatusDetails {
            name: String::new(),
            group: String::new(),
            kind: String::new(),
            uid: String::new(),
            causes,
            retry_after_seconds,
        })
    }
}

/// Seconds after which a write denied for `reason` may be sent again unchanged (0: never, it
/// needs something else first, such as a newer token).
pub fn retry_after(reason: Reason) -> u32 {
    match reason {
        Reason::ReadsThrottled => 1,
        _ => 0,
    }
}

/// A kube-fence denial as a writer reads it back from the API server's error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Denial {
    pub code: u16,
    pub reason: Reason,
    /// The lease that judged the write (`namespace/name`).
    pub lease: Option<String>,
    pub presented: Option<Token>,
    pub recorded: Option<Token>,
    /// The lease's current holder (holder-bound denials).
    pub holder: Option<String>,
    /// Who asked, as the lease names holders (holder-bound denials).
    pub requester: Option<String>,
}

impl Denial {
    /// The kube-fence denial carried by `status`, or `None` when the status is not one (another
    /// webhook's denial, a failed precondition, any other API error).
    pub fn from_status(status: &Status) -> Option<Denial> {
        let reason = Reason::parse(&status.reason)?;
        if status.code < 400 {
            return None;
        }
        let causes = status.details.as_ref().map(|d| d.causes.as_slice()).unwrap_or_default();
        let cause = |kind: &str| causes.iter().find(|c| c.reason == kind).map(|c| c.message.as_str());
        Some(Denial {
            code: status.code,
            reason,
            lease: cause(CAUSE_LEASE).map(str::to_string),
            presented: cause(CAUSE_PRESENTED).and_then(|t| t.parse().ok()),
            recorded: cause(CAUSE_RECORDED).and_then(|t| t.parse().ok()),
            holder: cause(CAUSE_HOLDER).map(str::to_string),
            requester: cause(CAUSE_REQUESTER).map(str::to_string),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_denial_round_trips_through_the_api_servers_status() {
        let facts = Facts { lease: Some("team/orders".into()), presented: Token::new(41), recorded: Token::new(57), ..Facts::default() };
        let mut wire = status(409, Reason::StaleToken, "stale write", &facts);
        // The API server prefixes the message; the rest arrives as sent.
        wire.message = format!("admission webhook \"fence.kubefence.io\" denied the request: {}", wire.message);
        let json = serde_json::to_string(&wire).unwrap_or_default();
        let back: Status = serde_json::from_str(&json).unwrap_or_default();
        let denial = Denial::from_status(&back);
        assert_eq!(
            denial,
            Some(Denial {
                code: 409,
                reason: Reason::StaleToken,
                lease: Some("team/orders".into()),
                presented: Token::new(41),
                recorded: Token::new(57),
                holder: None,
                requester: None,
            })
        );
        let facts = Facts { lease: Some("team/orders".into()), holder: Some("b".into()), requester: Some("a".into()), ..Facts::default() };
        let denial = Denial::from_status(&status(409, Reason::NotHolder, "not the holder", &facts));
        assert_eq!(denial.map(|d| (d.reason, d.holder, d.requester)), Some((Reason::NotHolder, Some("b".into()), Some("a".into()))));
    }

    #[test]
    fn other_statuses_are_not_denials() {
        assert_eq!(Denial::from_status(&Status::failure("the object has been modified", "Conflict").with_code(409)), None);
        assert_eq!(Denial::from_status(&Status::failure("x", "Forbidden").with_code(403)), None);
        let without_facts = Denial::from_status(&status(403, Reason::TokenMissing, "no token", &Facts::default()));
        assert_eq!(without_facts.map(|d| (d.reason, d.presented)), Some((Reason::TokenMissing, None)));
        assert_eq!(status(403, Reason::TokenMissing, "no token", &Facts::default()).details, None);
        let throttled = status(429, Reason::ReadsThrottled, "too many", &Facts::default());
        assert_eq!(throttled.details.map(|d| d.retry_after_seconds), Some(1), "a throttled write says when to retry");
    }
}
