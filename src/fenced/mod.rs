//! The FencedController status: what each fence's status says ([`status`], pure: whether the
//! fence works — the `Ready` condition — and who holds its Lease), and the controller that keeps
//! it ([`controller`], thin glue: watch caches in, a server-side-apply of the status and an Event
//! on each transition of Ready out).

pub mod controller;
pub mod status;
