//! Where a token is issued: the lease state machine ([`state`], pure) and the controller that
//! applies it to the cluster ([`controller`], thin glue: read, decide, compare-and-swap; its
//! Events are bounded by [`events`]).

pub mod controller;
pub(crate) mod events;
pub(crate) mod leader;
pub mod params;
pub(crate) mod state;
