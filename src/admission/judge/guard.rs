//! What a guard is: one implementation of [`Guard`] — how it judges a request outright, or which
//! read it needs ([`Plan`]) — and of [`Pending`] for its waiting state: the read it makes and how
//! it judges what came back. Nothing here does I/O: a pending read is handed a [`LeaseReads`]
//! (the webhook's real reads, or the fake), and the read values it judges are made only by a
//! reader (`super::read`), so judging a quorum plan with a cached value does not compile.
//!
//! The pipeline (`super::pipeline`) runs each guard with [`run`] and combines their verdicts by
//! one rule. A new guard kind is a file of its own with one `impl Guard` and one `impl Pending`,
//! plus the line in the pipeline that says which requests it judges.

use std::future::Future;

use super::facts::Request;
use super::preamble::Preamble;
use super::read::LeaseReads;
use super::verdict::Verdict;

/// Where one guard stands on a request: judged, or waiting for a read.
#[derive(Debug)]
pub(crate) enum Plan<P> {
    Done(Verdict),
    Read(P),
}

/// A guard: judges a request (whose preamble the pipeline worked out) outright, or names the
/// read it needs.
pub(crate) trait Guard {
    /// The guard waiting for a read.
    type Pending<'r>: Pending
    where
        Self: 'r;

    /// The guard's first step on `req`.
    fn plan<'r>(&'r self, req: &'r Request, preamble: &Preamble<'r>) -> Plan<Self::Pending<'r>>;
}

/// A guard waiting for a read: makes it through `reads` and judges what came back (a verdict, or
/// one more read).
pub(crate) trait Pending: Sized + Send {
    fn read<R: LeaseReads + Sync>(self, reads: &R) -> impl Future<Output = Plan<Self>> + Send;
}

/// Runs `guard` on `req` to its verdict, making the reads it asks for through `reads`, in order.
pub(crate) async fn run<'r, G: Guard, R: LeaseReads + Sync>(guard: &'r G, req: &'r Request, preamble: &Preamble<'r>, reads: &R) -> Verdict {
    let mut plan = guard.plan(req, preamble);
    loop {
        plan = match plan {
            Plan::Done(verdict) => return verdict,
            Plan::Read(pending) => pending.read(reads).await,
        }
    }
}
