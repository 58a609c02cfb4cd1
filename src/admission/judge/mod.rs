//! The judging core, pure: no client, no I/O. Layers, each importing only those below it:
//!
//! 1. The vocabulary: [`facts`] (a request reduced to what fencing depends on, who asks, the
//!    lease a request is judged by), [`verdict`], [`exemptions`], [`identity`] (how a Lease's
//!    holder names a Pod), [`fence`] (what a FencedController declares), and the read values with the one read interface ([`read`]).
//! 2. [`preamble`] (what every guard knows of a request before its own rules) and [`guard`] (what
//!    a guard is: how it judges outright, which read it needs, how it judges what came back).
//! 3. The guards, one file each: [`token`] (objects labelled `kubefence.io/lease`), [`leader`]
//!    (objects labelled `kubefence.io/leader-lease`), [`writer`] (every write of an opted-in
//!    ServiceAccount), and [`audit`] (any guard in audit mode: what it would deny is admitted
//!    with a warning).
//! 4. [`pipeline`]: which guards judge a review, and the one rule that combines them.
//!
//! A new guard kind is a file in layer 3 (its `impl Guard`, its tests) and its line in
//! [`pipeline`]; the webhook (`crate::admission::http`) and the reader (`crate::admission::reads`)
//! need no change unless it needs a new kind of read.

pub(crate) mod audit;
pub mod exemptions;
pub mod facts;
pub mod fence;
#[cfg(any(test, feature = "test-support"))]
pub mod fake;
pub(crate) mod guard;
pub mod identity;
pub(crate) mod leader;
pub mod pipeline;
pub mod preamble;
pub mod read;
pub(crate) mod token;
pub mod verdict;
pub mod writer;
