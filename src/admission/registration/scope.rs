//! The scope of what kube-fence registers: the name of its webhook configuration, how long the
//! API server waits for a verdict, and which namespaces are fenced. Every webhook kube-fence
//! registers — its own configuration (`super::Registration`) and the writer webhooks kept in step
//! with it (`super::routing`) — takes these from one value, so they cannot disagree (the chart
//! passes its `webhook.timeoutSeconds` and `webhook.onlyNamespaces` to the binary as flags, and
//! renders the same values into its own configuration).

/// How long the API server waits for a verdict when nothing else is said (the chart's default
/// `webhook.timeoutSeconds`): short, since a guarded write waits that long before failing closed.
pub const DEFAULT_TIMEOUT_SECONDS: i32 = 5;
/// The longest webhook timeout Kubernetes accepts.
pub const MAX_TIMEOUT_SECONDS: i32 = 30;

/// Which configuration kube-fence's webhooks are registered under, their timeout, and the
/// namespaces they fence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scope {
    /// kube-fence's ValidatingWebhookConfiguration; the writer webhooks are registered in
    /// `<name>-writers` and call kube-fence as this one's first webhook does.
    pub configuration_name: String,
    /// Seconds the API server waits for a verdict (1 to [`MAX_TIMEOUT_SECONDS`]), then fails the
    /// write closed.
    pub timeout_seconds: i32,
    /// Fence only these namespaces (`None`: all but the excluded ones). The writer webhooks are
    /// registered only for opted-in Leases of these namespaces.
    pub only_namespaces: Option<Vec<String>>,
}

impl Scope {
    /// Configuration `configuration_name`, the default timeout, every namespace.
    pub fn new(configuration_name: impl Into<String>) -> Scope {
        Scope { configuration_name: configuration_name.into(), timeout_seconds: DEFAULT_TIMEOUT_SECONDS, only_namespaces: None }
    }

    /// Whether objects of `namespace` are fenced by this scope's namespace list (the excluded
    /// namespaces aside: the writer routing does not exclude them).
    pub fn includes(&self, namespace: &str) -> bool {
        self.only_namespaces.as_ref().is_none_or(|only| only.iter().any(|ns| ns == namespace))
    }
}
