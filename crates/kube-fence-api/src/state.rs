//! A Lease's state as the controller writes it, read the same way by the controller, the
//! webhook and the workers: who holds it with which token, for how long, and the names of its
//! `Held` condition.

use k8s_openapi::jiff::SignedDuration;

use crate::token::Token;
use crate::{DEFAULT_LEASE_DURATION_SECONDS, LeaseSpec, LeaseStatus, Phase};

/// The condition type the controller maintains on every Lease it acted on.
pub const HELD_CONDITION: &str = "Held";
/// Reasons of the `Held` condition (and of the lease's Events).
pub const REASON_GRANTED: &str = "Granted";
pub const REASON_RENEWED: &str = "Renewed";
pub const REASON_RELEASED: &str = "Released";
pub const REASON_EXPIRED: &str = "Expired";

/// The lease duration the spec asks for.
pub fn lease_duration(spec: &LeaseSpec) -> SignedDuration {
    SignedDuration::from_secs(i64::from(spec.lease_duration_seconds.unwrap_or(DEFAULT_LEASE_DURATION_SECONDS)))
}

/// The holder and token of a lease that is held, if it is (a `Held` phase without a holder or a
/// token is treated as unheld).
pub fn held(status: Option<&LeaseStatus>) -> Option<(&str, Token)> {
    let status = status?;
    match (status.phase, status.holder.as_deref(), status.token) {
        (Phase::Held, Some(holder), Some(token)) => Some((holder, token)),
        _ => None,
    }
}
