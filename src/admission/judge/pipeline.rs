//! Where a write is judged, end to end: the [`Preamble`] every guard kind shares, then the guards
//! that judge the webhook the review was sent to, each run to its verdict ([`super::guard::run`]:
//! plan, the reads it asks for, verdict), combined by one rule ([`then`]). The server, the unit
//! tables, the property tests and the benchmark all judge through [`judge`]; only the reader
//! differs (the webhook's `crate::admission::reads::SourceReads`, or `super::fake::FakeLeases`, built for tests).
//!
//! Which guards judge what (the registration of guard kinds):
//! - `/validate` (objects labelled by kube-fence): a malformed request is denied first; then the
//!   leader-election guard (`super::leader`), then the token guard (`super::token`, holder-only
//!   objects included).
//! - `/writer` (every write of a fenced ServiceAccount): the writer fence (`super::writer`) of
//!   each FencedController that names the requester, each in its own mode; a requester the fence
//!   cache does not know yet is denied (fail closed, retried by the writer).
//!
//! The leader-election guard runs in audit mode (`super::audit`) when `Judging::holder_fences`
//! says so, and so does every writer fence (whatever its own mode); the token guard has its own
//! per-lease `Warn`.

use kube_fence_api::denial::Reason;

use super::audit::{Audited, Mode};
use super::facts::Request;
use super::guard::{Guard, run};
use super::leader::ByLeader;
use super::preamble::Preamble;
pub use super::preamble::{Judging, Sent};
use super::read::LeaseReads;
use super::token::ByToken;
use super::verdict::Verdict;
use super::writer::ByWriter;

/// The verdict before any guard judged: nothing guards the request.
const UNGUARDED: Verdict = Verdict::Allow { reason: Reason::Unguarded };

/// How the guards of one request combine, in order: a denial stands (the guards after it are not
/// run, so their leases are not read); otherwise the next guard decides, unless it does not guard
/// the request (`Unguarded`), when the verdict so far stands. A warning so far is kept: joined to
/// the next guard's, or standing for its plain admission; so is an admission for a Lease's
/// holder (which names the holder) when the next guard only lets the write pass.
async fn then<'r, G: Guard, R: LeaseReads + Sync>(
    so_far: Verdict,
    guard: &'r G,
    req: &'r Request,
    preamble: &Preamble<'r>,
    reads: &R,
) -> Verdict {
    if !so_far.is_allowed() {
        return so_far;
    }
    match (so_far, run(guard, req, preamble, reads).await) {
        (so_far, next) if next.reason() == Reason::Unguarded => so_far,
        (_, next @ Verdict::Deny { .. }) => next,
        (Verdict::AllowWithWarning { reason, message }, Verdict::Allow { .. } | Verdict::AllowHeld { .. }) => {
            Verdict::AllowWithWarning { reason, message }
        }
        // A write one fence admitted for its holder and the next lets pass: say who held it.
        (held @ Verdict::AllowHeld { .. }, Verdict::Allow { .. }) => held,
        (Verdict::AllowWithWarning { message: first, .. }, Verdict::AllowWithWarning { reason, message }) => {
            Verdict::AllowWithWarning { reason, message: format!("{first}; {message}") }
        }
        (_, next) => next,
    }
}

/// Judges `req`, sent to the webhook `sent`, reading leases through `reads`.
pub async fn judge<R: LeaseReads + Sync>(req: &Request, judging: &Judging, sent: Sent, reads: &R) -> Verdict {
    let preamble = Preamble::of(req, judging, sent);
    match sent {
        Sent::Writer => {
            let Some(fences) = reads.fences(&req.user) else {
                return Verdict::deny(
                    503,
                    Reason::LeaseReadFailed,
                    "kube-fence has not read the FencedControllers yet (failing closed); retry in a second".to_string(),
                );
            };
            let mut verdict = UNGUARDED;
            for fence in fences {
                let mode = if judging.holder_fences == Mode::Audit { Mode::Audit } else { fence.mode };
                let guard = ByWriter(fence);
                verdict = match mode {
                    Mode::Enforce => then(verdict, &guard, req, &preamble, reads).await,
                    Mode::Audit => then(verdict, &Audited(guard), req, &preamble, reads).await,
                };
            }
            verdict
        }
        Sent::Objects => {
            if let Some(malformed) = preamble.malformed() {
                return malformed;
            }
            let by_leader = match judging.holder_fences {
                Mode::Enforce => then(UNGUARDED, &ByLeader, req, &preamble, reads).await,
                Mode::Audit => then(UNGUARDED, &Audited(ByLeader), req, &preamble, reads).await,
            };
            then(by_leader, &ByToken, req, &preamble, reads).await
        }
    }
}

#[cfg(test)]
mod tests;
