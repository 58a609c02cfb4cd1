//! The names kube-fence's parts agree on: the labels and annotations that guard an object, bind
//! it to a lease, opt a leader-election Lease in, and carry a token or a delegated grant. The
//! webhook reads them, the client library and the chart write them; they are defined here once.

/// Annotation that carries the token authorising a write to a guarded object.
pub const TOKEN_ANNOTATION: &str = "kubefence.io/token";
/// Annotation the client library sets to a fresh value on every fenced write. Under a lease's
/// `AllowEqual` comparison an equal token is admitted only when this value changed: the write
/// restated its token rather than leaving the annotations as a newer holder wrote them.
pub const WRITE_ANNOTATION: &str = "kubefence.io/write";
/// Label that binds a guarded object to the lease (same namespace) whose tokens guard it.
pub const LEASE_LABEL: &str = "kubefence.io/lease";
/// Label that makes a guarded object holder-only: with value [`HOLDER_ONLY`], every write to it
/// and to its subresources (`/status`) is admitted only from the current holder of its lease,
/// which must bind its holder to the requester (`spec.identity`), read linearizably.
pub const WRITER_LABEL: &str = "kubefence.io/writer";
/// The value of [`WRITER_LABEL`] that makes an object holder-only.
pub const HOLDER_ONLY: &str = "holder";

/// The label that binds an object to the leader-election Lease of that name in its namespace.
pub const LEADER_LEASE_LABEL: &str = "kubefence.io/leader-lease";
/// The label that opts a `coordination.k8s.io/v1` Lease into holder binding: with value
/// [`HOLDER_IS_POD`], a write that sets its `holderIdentity` must name the requesting Pod
/// (the holder policy kube-fence registers).
pub const HOLDER_IDENTITY_LABEL: &str = "kubefence.io/holder-identity";
/// The value of [`HOLDER_IDENTITY_LABEL`] that binds the holder to the requesting Pod.
pub const HOLDER_IS_POD: &str = "Pod";

/// The annotation on a `coordination.k8s.io/v1` Lease that names the ServiceAccounts (of the
/// Lease's namespace, comma-separated) whose every write only the Lease's holder Pod may make.
pub const WRITERS_ANNOTATION: &str = "kubefence.io/writers";
/// The annotation that names resources (`<resource>` or `<resource>.<group>`, comma-separated,
/// as `kubectl` spells them: `configmaps`, `deployments.apps`) the opted-in writers write
/// whether they lead or not: never sent to kube-fence.
pub const WRITERS_EXEMPT_ANNOTATION: &str = "kubefence.io/writers-exempt";

/// Annotation that carries a delegated grant on what a holder started (a Job, a Pod, a work
/// item): `NAMESPACE/LEASE:TOKEN`. The delegate writes with it, fenced exactly like the holder.
pub const DELEGATED_GRANT_ANNOTATION: &str = "kubefence.io/delegated-grant";
