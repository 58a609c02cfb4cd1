//! The grant a fenced write from the shell uses: `--lease L --token T` as `kube-fence lease
//! acquire` printed it, or — given neither — the grant delegated to this process
//! (`$KUBE_FENCE_GRANT`, which a Pod started with a delegated grant has from the downward API).

use super::error::Error;
use crate::client::{Delegated, DelegationError};
use kube_fence_api::token::Token;

/// `--lease` and `--token`, both or neither.
#[derive(Debug, Clone, clap::Args)]
pub struct GrantArgs {
    /// The lease that guards the object (written as its kubefence.io/lease label). Without
    /// --lease and --token: the grant delegated to this process, $KUBE_FENCE_GRANT.
    #[arg(long, requires = "token")]
    pub lease: Option<String>,
    /// The fencing token `kube-fence lease acquire` printed (with --lease).
    #[arg(long, value_parser = parse_token, requires = "lease")]
    pub token: Option<Token>,
}

pub fn parse_token(s: &str) -> Result<Token, String> {
    s.parse::<Token>().map_err(|e| format!("not a fencing token ({e}); pass what `kube-fence lease acquire` printed"))
}

/// Where a grant came from, for messages.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    Flags,
    Delegated,
}

impl GrantArgs {
    /// The grant to write with, in namespace `namespace` when it is given (`-n`), else in
    /// `default_namespace` (the kubeconfig's) for `--lease`/`--token` and the delegated lease's
    /// own namespace for a delegated grant. `Ok(None)`: no grant at all.
    pub fn resolve(&self, namespace: Option<&str>, default_namespace: &str) -> Result<Option<(Delegated, Source)>, Error> {
        self.resolve_with(namespace, default_namespace, Delegated::from_env())
    }

    fn resolve_with(
        &self,
        namespace: Option<&str>,
        default_namespace: &str,
        delegated: Result<Delegated, DelegationError>,
    ) -> Result<Option<(Delegated, Source)>, Error> {
        if let (Some(lease), Some(token)) = (&self.lease, self.token) {
            let namespace = namespace.unwrap_or(default_namespace).to_string();
            return Ok(Some((Delegated { namespace, lease: lease.clone(), token }, Source::Flags)));
        }
        match delegated {
            Ok(grant) => match namespace {
                Some(ns) if ns != grant.namespace => Err(Error::DelegatedElsewhere { grant, namespace: ns.to_string() }),
                _ => Ok(Some((grant, Source::Delegated))),
            },
            Err(DelegationError::Absent(_)) => Ok(None),
            Err(source) => Err(Error::ReadDelegatedGrant { source }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(n: u64) -> Token {
        Token::new(n).unwrap_or(Token::MAX)
    }

    #[test]
    fn flags_win_then_the_delegated_grant_in_its_own_namespace() {
        let flags = GrantArgs { lease: Some("l".into()), token: Some(t(5)) };
        let none = GrantArgs { lease: None, token: None };
        let delegated = || "work/jobs:9".parse::<Delegated>();
        let absent = || Err(DelegationError::Absent("KUBE_FENCE_GRANT"));
        let got = flags.resolve_with(None, "ctx", delegated()).ok().flatten();
        assert_eq!(got, Some((Delegated { namespace: "ctx".into(), lease: "l".into(), token: t(5) }, Source::Flags)));
        let got = none.resolve_with(None, "ctx", delegated()).ok().flatten();
        assert_eq!(got, Some((Delegated { namespace: "work".into(), lease: "jobs".into(), token: t(9) }, Source::Delegated)));
        assert!(matches!(none.resolve_with(Some("work"), "ctx", delegated()), Ok(Some(_))));
        assert!(matches!(none.resolve_with(Some("other"), "ctx", delegated()), Err(Error::DelegatedElsewhere { .. })));
        assert!(matches!(none.resolve_with(None, "ctx", absent()), Ok(None)));
        let malformed = "work-jobs-9".parse::<Delegated>();
        assert!(matches!(none.resolve_with(None, "ctx", malformed), Err(Error::ReadDelegatedGrant { .. })));
    }
}
