//! Where a write is judged, end to end: the [`Preamble`] every guard kind shares, then the guards
//! that judge the webhook the review was sent to, each run to its verdict ([`super::guard::run`]:
//! plan, the reads it asks for, verdict), combined by one rule ([`then`]). The server, the unit
//! tables, the property tests and the benchmark all judge through [`judge`]; only the reader
//! differs (the webhook's `crate::admission::reads::SourceReads`, or [`super::fake::FakeLeases`]).
//!
//! Which guards judge what (the registration of guard kinds):
//! - `/validate` (objects labelled by kube-fence): a malformed request is denied first; then the
//!   leader-election guard (`super::leader`), then the token guard (`super::token`, holder-only
//!   objects included).
//! - `/writer/<namespace>/<name>` (an opted-in writer's every write): the writer fence
//!   (`super::writer`).
//!
//! The holder fences (leader-election guard, writer fence) run in audit mode (`super::audit`)
//! when `Judging::holder_fences` says so; the token guard has its own per-lease `Warn`.

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
/// the next guard's, or standing for its plain admission.
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
        (Verdict::AllowWithWarning { reason, message }, Verdict::Allow { .. }) => Verdict::AllowWithWarning { reason, message },
        (Verdict::AllowWithWarning { message: first, .. }, Verdict::AllowWithWarning { reason, message }) => {
            Verdict::AllowWithWarning { reason, message: format!("{first}; {message}") }
        }
        (_, next) => next,
    }
}

/// Judges `req`, sent to the webhook `sent`, reading leases through `reads`.
pub async fn judge<R: LeaseReads + Sync>(req: &Request, judging: &Judging, sent: Sent<'_>, reads: &R) -> Verdict {
    let preamble = Preamble::of(req, judging, sent);
    match sent {
        Sent::Writer(_) => match judging.holder_fences {
            Mode::Enforce => then(UNGUARDED, &ByWriter, req, &preamble, reads).await,
            Mode::Audit => then(UNGUARDED, &Audited(ByWriter), req, &preamble, reads).await,
        },
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
