//! Who may write guarded objects without a token, and who may move an object's leader-lease
//! label (`--exempt`, `--lease-admin`).

/// Identities that may write guarded objects without a token by default: the garbage collector
/// (cascading deletion of dependents whose owner is gone) and the namespace controller
/// (deleting a namespace deletes everything in it). Without them a guarded object could pin a
/// namespace or an orphaned dependent forever.
pub const DEFAULT_EXEMPT: [&str; 2] =
    ["system:serviceaccount:kube-system:generic-garbage-collector", "system:serviceaccount:kube-system:namespace-controller"];

/// Who may write guarded objects without a token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Exemptions {
    exempt: Vec<String>,
    /// kube-fence's admins (`--lease-admin`, chart value `leaseAdmins`): besides the holder, they
    /// may add or remove the `kubefence.io/leader-lease` label (opt existing objects in, as Helm
    /// or an operator would); every other write of a leader-bound object stays the holder's.
    label_admins: Vec<String>,
}

impl Exemptions {
    pub fn new<I: IntoIterator<Item = S>, S: Into<String>>(users: I) -> Exemptions {
        Exemptions { exempt: users.into_iter().map(Into::into).collect(), label_admins: Vec::new() }
    }

    /// The same, with `admins` allowed to move the leader-lease label.
    pub fn with_label_admins<I: IntoIterator<Item = S>, S: Into<String>>(mut self, admins: I) -> Exemptions {
        self.label_admins.extend(admins.into_iter().map(Into::into));
        self
    }

    pub fn contains(&self, user: &str) -> bool {
        self.exempt.iter().any(|u| u == user)
    }

    /// Whether `user` may add or remove the `kubefence.io/leader-lease` label.
    pub fn may_move_leader_label(&self, user: &str) -> bool {
        self.label_admins.iter().any(|u| u == user)
    }
}

impl Default for Exemptions {
    fn default() -> Self {
        Exemptions::new(DEFAULT_EXEMPT)
    }
}
