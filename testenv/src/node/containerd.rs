//! The container runtime: containerd (Debian's) with every path under the state directory, the
//! CNI bridge configuration, and images built from Go sources without Docker.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::{Context, Result, bail};

use super::{PAUSE_IMAGE, POD_CIDR, cgroups, hack, run, say};
use crate::template::{self, render};
use crate::{ControlPlane, Options};

impl ControlPlane {
    /// Writes containerd's and CNI's configuration, starts containerd and waits until it answers.
    pub(super) fn start_containerd(&mut self, opts: &Options) -> Result<()> {
        cgroups::create_root()?;
        let ctrd = self.dir.join("containerd");
        fs::create_dir_all(&ctrd)?;
        fs::create_dir_all(self.dir.join("cni/net.d"))?;
        fs::write(
            self.dir.join("cni/net.d/10-kfbr.conflist"),
            render(template::CNI_BRIDGE, &[("pod_cidr", POD_CIDR), ("ipam_dir", &self.state_path("cni/ipam"))])?,
        )?;
        let sock = ctrd.join("containerd.sock");
        let path = |p: &Path| p.display().to_string();
        fs::write(
            ctrd.join("config.toml"),
            render(
                template::CONTAINERD,
                &[
                    ("root", &path(&ctrd.join("root"))),
                    ("state", &path(&ctrd.join("state"))),
                    ("sock", &path(&sock)),
                    ("opt", &path(&ctrd.join("opt"))),
                    ("sandbox_image", PAUSE_IMAGE),
                    ("cni_conf_dir", &self.state_path("cni/net.d")),
                ],
            )?,
        )?;
        say(opts, "starting containerd");
        self.spawn_node(opts, "containerd", Command::new("containerd").arg("--config").arg(ctrd.join("config.toml")), true)?;
        let ctr_ok = || {
            Command::new("ctr")
                .arg("--address")
                .arg(&sock)
                .args(["version"])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .map(|s| s.success())
                .unwrap_or(false)
        };
        self.wait_until(opts, "containerd", Duration::from_secs(30), |_| ctr_ok())?;
        self.containerd_address = Some(sock);
        Ok(())
    }

    /// Imports a docker-archive or OCI tarball into the node's containerd (namespace `k8s.io`,
    /// where the kubelet looks). Pods then use the image with `imagePullPolicy: IfNotPresent`
    /// or `Never`; nothing is ever pulled.
    pub fn import_image(&self, tarball: &Path) -> Result<()> {
        let Some(sock) = &self.containerd_address else {
            bail!("images can only be imported into a node (start with Options {{ node: true, .. }})");
        };
        run(Command::new("ctr").arg("--address").arg(sock).args(["-n", "k8s.io", "images", "import"]).arg(tarball))
            .with_context(|| format!("importing {}", tarball.display()))
    }
}

fn cache_dir() -> PathBuf {
    if let Ok(c) = std::env::var("KUBE_FENCE_CACHE") {
        return PathBuf::from(c);
    }
    let base = std::env::var("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .unwrap_or_else(|_| PathBuf::from(std::env::var("HOME").unwrap_or_else(|_| "/root".into())).join(".cache"));
    base.join("kube-fence")
}

/// The pause image tarball (cached by its source's content): built with [`go_image`], a second
/// at most.
pub fn pause_image() -> Result<PathBuf> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("images/pause");
    let main = fs::read(src.join("main.go"))?;
    let key: u64 = main.iter().fold(0xcbf29ce484222325u64, |h, b| (h ^ *b as u64).wrapping_mul(0x100000001b3));
    let out = cache_dir().join("images").join(format!("pause-1.0-{key:016x}.tar"));
    if out.is_file() {
        return Ok(out);
    }
    fs::create_dir_all(out.parent().unwrap_or(Path::new("/")))?;
    let work = tempfile::tempdir()?;
    go_image(&src, work.path(), PAUSE_IMAGE, &["--path", "/pause", "--user", "65535:65535"], &out)?;
    Ok(out)
}

/// An image holding one static Go binary, without Docker: builds the Go program in `src` (in
/// `work`), then writes it as image `reference` to the docker-archive tarball `out` with
/// `hack/make-image.sh` (`image_args`: its other options, e.g. `--path`, `--user`).
pub fn go_image(src: &Path, work: &Path, reference: &str, image_args: &[&str], out: &Path) -> Result<()> {
    let name = src.file_name().map(|n| n.to_os_string()).unwrap_or_else(|| "main".into());
    let bin = work.join(name);
    run(Command::new("go")
        .args(["build", "-trimpath", "-ldflags", "-s -w", "-o"])
        .arg(&bin)
        .arg(".")
        .current_dir(src)
        .env("CGO_ENABLED", "0")
        .env("GOFLAGS", "-mod=mod")
        .env("GOTOOLCHAIN", "local"))
    .with_context(|| format!("building {} (needs Go)", src.display()))?;
    run(Command::new("bash")
        .arg(hack("make-image.sh"))
        .arg("--binary")
        .arg(&bin)
        .args(image_args)
        .args(["--ref", reference, "--out"])
        .arg(out))
}
