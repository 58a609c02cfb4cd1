//! The node's cgroups: every one the kubelet and runc create lives under [`CGROUP_ROOT`], in
//! every mounted hierarchy, so teardown finds the node's processes and removes what it made.

use std::collections::BTreeSet;
use std::fs;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use super::CGROUP_ROOT;

/// Creates [`CGROUP_ROOT`] in every hierarchy.
pub(super) fn create_root() -> Result<()> {
    for h in hierarchies() {
        let dir = h.join(CGROUP_ROOT);
        fs::create_dir_all(&dir).with_context(|| format!("creating cgroup {}", dir.display()))?;
        // A new cpuset cgroup starts with no CPUs and no memory nodes: copy the parent's.
        for f in ["cpuset.cpus", "cpuset.mems"] {
            if let Ok(v) = fs::read_to_string(h.join(f)) {
                fs::write(dir.join(f), v.trim()).with_context(|| format!("setting {}", dir.join(f).display()))?;
            }
        }
    }
    Ok(())
}

/// Mounted cgroup hierarchies: `/sys/fs/cgroup` itself on a pure cgroup v2 host, else each v1
/// hierarchy (and the hybrid `unified` one).
fn hierarchies() -> Vec<PathBuf> {
    let root = Path::new("/sys/fs/cgroup");
    if root.join("cgroup.controllers").exists() {
        return vec![root.to_path_buf()];
    }
    let mut v: Vec<PathBuf> = fs::read_dir(root)
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.path())
                .filter(|p| p.join("cgroup.procs").exists() && !fs::symlink_metadata(p).map(|m| m.file_type().is_symlink()).unwrap_or(true))
                .collect()
        })
        .unwrap_or_default();
    v.sort();
    v
}

fn dirs_depth_first(dir: &Path, out: &mut Vec<PathBuf>) {
    if let Ok(rd) = fs::read_dir(dir) {
        for e in rd.filter_map(|e| e.ok()) {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                dirs_depth_first(&e.path(), out);
            }
        }
    }
    if dir.is_dir() {
        out.push(dir.to_path_buf());
    }
}

/// PIDs of every process in a cgroup under [`CGROUP_ROOT`] (pods, runc).
pub fn cgroup_pids() -> BTreeSet<u32> {
    let mut pids = BTreeSet::new();
    for d in cgroup_leftovers() {
        if let Ok(s) = fs::read_to_string(d.join("cgroup.procs")) {
            pids.extend(s.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
        }
    }
    pids
}

/// Every cgroup directory under [`CGROUP_ROOT`], in all hierarchies, deepest first.
pub fn cgroup_leftovers() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for h in hierarchies() {
        dirs_depth_first(&h.join(CGROUP_ROOT), &mut dirs);
    }
    dirs
}
