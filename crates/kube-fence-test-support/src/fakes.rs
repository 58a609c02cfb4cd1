//! In-process fakes for pure tests (no API server): what a test needs in place of one of
//! kube-fence's reads.
//!
//! Empty for now. This is where a fake lease reader for the admission code goes (a reader of the
//! bound lease that answers from a map, for the webhook's tests that need no cluster). A fake of
//! a trait that only the operator crate defines must live in that crate (this one depends on the
//! contract and the client, never on the operator).
