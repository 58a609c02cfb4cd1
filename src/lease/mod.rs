//! Where a token is issued: the lease state machine ([`state`], pure) and the controller that
//! applies it to the cluster ([`controller`], thin glue: read, decide, compare-and-swap).

pub mod controller;
pub mod leader;
pub mod params;
pub mod state;
