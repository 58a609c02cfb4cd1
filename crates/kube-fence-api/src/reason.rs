//! Why the webhook admitted or denied a write: the `reason` of its answer, its metric label, and
//! what a writer reads back ([`crate::denial::Denial`]).

use std::fmt;

/// Defines [`Reason`] from one list: the enum, [`Reason::ALL`], [`Reason::as_str`] (the
/// variant's name) and [`Reason::parse`], so a new reason cannot be missing from any of them.
macro_rules! reasons {
    ($($(#[$doc:meta])* $variant:ident,)+) => {
        /// Stable reasons, used in the AdmissionResponse status and as the metric label.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum Reason {
            $($(#[$doc])* $variant,)+
        }

        impl Reason {
            /// Every reason, in declaration order, for tests and documentation.
            pub const ALL: [Reason; [$(stringify!($variant)),+].len()] = [$(Reason::$variant,)+];

            /// The reason's name, as it travels in a `Status` and as the metric label.
            pub fn as_str(self) -> &'static str {
                match self {
                    $(Reason::$variant => stringify!($variant),)+
                }
            }
        }
    };
}

reasons! {
    /// Admitted: the write carries a valid, fresh token (or needs none).
    Fenced,
    /// Admitted: the object is not guarded (or the operation is not fenced).
    Unguarded,
    /// Admitted: the requester is an exempt identity.
    Exempt,
    /// Admitted: the DELETE names the version it deletes.
    DeletePreconditioned,
    /// Admitted: a subresource write (`/status`, ...) that leaves the guard (lease label, token
    /// annotation) as it was.
    GuardUnchanged,
    /// Admitted: the write only removes finalizers from an object being deleted.
    FinalizersRemoved,
    StaleToken,
    TokenMissing,
    TokenMalformed,
    TokenNotIssued,
    LeaseNotFound,
    LeaseRebound,
    LeaseLabelInvalid,
    /// The `kubefence.io/writer` label has a value other than `holder`.
    WriterLabelInvalid,
    DeletePreconditionRequired,
    /// The requester is not the current holder of the identity-bound lease (or leader-election
    /// Lease) that guards the object.
    NotHolder,
    /// The request lacks what a well-formed AdmissionReview of this operation carries.
    MalformedRequest,
    /// The lease could not be read (API server unreachable): failed closed.
    LeaseReadFailed,
    /// The review needed a quorum read, and its source address has used up its read budget
    /// (HTTP 429; retry after a second).
    ReadsThrottled,
}

impl Reason {
    /// The reason named `s` (as [`Reason::as_str`] spells it).
    pub fn parse(s: &str) -> Option<Reason> {
        Reason::ALL.into_iter().find(|r| r.as_str() == s)
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_is_listed_once_and_parses_back() {
        let mut names: Vec<&str> = Reason::ALL.iter().map(|r| r.as_str()).collect();
        for reason in Reason::ALL {
            assert_eq!(Reason::parse(reason.as_str()), Some(reason));
            assert_eq!(reason.to_string(), reason.as_str());
        }
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Reason::ALL.len(), "no two reasons share a name");
        assert_eq!(Reason::parse("Conflict"), None);
    }
}
