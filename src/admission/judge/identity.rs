//! How a leader-election Lease's `holderIdentity` names a Pod (`--leader-identity-separator`,
//! chart value `leaderIdentity.separator`): shared by the leader-election guard, the writer fence
//! and the holder policy's CEL.

/// How a leader-election Lease's `holderIdentity` names a Pod: the Pod's name exactly, or the
/// Pod's name followed by a separator and anything (client-go's `<hostname>_<uuid>`). Parsed
/// from `--leader-identity-separator`: a separator, or [`IdentityRule::EXACT`] for the Pod's
/// name alone.
///
/// A separator never starts with a character a Pod name can contain (Pod names are DNS
/// subdomains: `a-z`, `0-9`, `-`, `.`), so each identity names at most one Pod: with `-`, Pod
/// `web` would also hold what Pod `web-1` holds. It is visible ASCII without `'` or `\`, so it
/// is written into CEL (and the chart's YAML) as it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum IdentityRule {
    /// The identity is the Pod's name.
    Exact,
    /// The identity is the Pod's name, or the Pod's name, this separator and anything.
    Separated(String),
}

impl IdentityRule {
    /// The flag value (and chart value) that means "the Pod's name exactly".
    pub const EXACT: &str = "none";
    /// client-go's usual separator: `<hostname>_<uuid>`.
    pub const DEFAULT_SEPARATOR: &str = "_";

    /// Whether `holder` (a Lease's `holderIdentity`) names Pod `pod`.
    pub fn holds(&self, holder: &str, pod: &str) -> bool {
        let Some(rest) = holder.strip_prefix(pod).filter(|_| !pod.is_empty()) else { return false };
        match self {
            IdentityRule::Exact => rest.is_empty(),
            IdentityRule::Separated(separator) => rest.is_empty() || rest.starts_with(separator.as_str()),
        }
    }

    /// The separator, `None` for [`IdentityRule::Exact`].
    pub fn separator(&self) -> Option<&str> {
        match self {
            IdentityRule::Exact => None,
            IdentityRule::Separated(separator) => Some(separator),
        }
    }

    /// The identities Pod `pod` holds under, for messages: `web-0 or web-0_<suffix>`.
    pub fn forms(&self, pod: &str) -> String {
        match self {
            IdentityRule::Exact => pod.to_string(),
            IdentityRule::Separated(separator) => format!("{pod} or {pod}{separator}<suffix>"),
        }
    }
}

impl Default for IdentityRule {
    fn default() -> IdentityRule {
        IdentityRule::Separated(IdentityRule::DEFAULT_SEPARATOR.to_string())
    }
}

/// Why a leader identity separator was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum IdentityRuleError {
    #[error("the separator is empty: give one (client-go uses `_`), or `{}` for the Pod name exactly", IdentityRule::EXACT)]
    Empty,
    #[error(
        "the separator {0:?} starts with {1:?}, which a Pod name can contain (a-z, 0-9, `-`, `.`): Pod `p1` would also match the identities of Pod `p1{1}…`; use a character Pod names never contain, such as `_`"
    )]
    StartsLikePodName(String, char),
    #[error("the separator {0:?} contains {1:?}: use visible ASCII characters other than `'` and `\\`")]
    Unsupported(String, char),
}

impl std::str::FromStr for IdentityRule {
    type Err = IdentityRuleError;

    fn from_str(value: &str) -> Result<IdentityRule, IdentityRuleError> {
        if value == IdentityRule::EXACT {
            return Ok(IdentityRule::Exact);
        }
        let Some(first) = value.chars().next() else { return Err(IdentityRuleError::Empty) };
        if let Some(bad) = value.chars().find(|c| !c.is_ascii_graphic() || matches!(c, '\'' | '\\')) {
            return Err(IdentityRuleError::Unsupported(value.to_string(), bad));
        }
        if first.is_ascii_lowercase() || first.is_ascii_digit() || matches!(first, '-' | '.') {
            return Err(IdentityRuleError::StartsLikePodName(value.to_string(), first));
        }
        Ok(IdentityRule::Separated(value.to_string()))
    }
}

impl std::fmt::Display for IdentityRule {
    /// The flag value it parses from.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.separator().unwrap_or(IdentityRule::EXACT))
    }
}
