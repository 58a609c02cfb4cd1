//! The node itself: the kubelet (registers Node `kfnode`), kube-proxy (iptables rules inside the
//! namespace), and the wait until Pods can be created and reach the API in-cluster.

use std::fs;
use std::process::{Command, Stdio};
use std::time::Duration;

use anyhow::Result;

use super::{CGROUP_ROOT, KUBERNETES_SERVICE_IP, NODE_IP, NODE_NAME, POD_CIDR, say};
use crate::template::{self, render};
use crate::{ControlPlane, Options};

impl ControlPlane {
    /// Writes the kubelet's configuration, starts it and waits until the Node object exists.
    pub(super) fn start_kubelet(&mut self, opts: &Options) -> Result<()> {
        let kubelet_dir = self.dir.join("kubelet");
        fs::create_dir_all(&kubelet_dir)?;
        let sock = self.containerd_address.clone().unwrap_or_default().display().to_string();
        fs::write(
            self.dir.join("kubelet-config.yaml"),
            render(
                template::KUBELET,
                &[
                    ("cgroup_root", CGROUP_ROOT),
                    ("node_ip", &NODE_IP.to_string()),
                    ("sock", &sock),
                    ("pod_logs", &self.state_path("pod-logs")),
                    ("client_ca", &self.state_path("ca.crt")),
                ],
            )?,
        )?;
        say(opts, "starting kubelet");
        let args = [
            "--config",
            &self.state_path("kubelet-config.yaml"),
            "--kubeconfig",
            &self.state_path("node.kubeconfig"),
            "--root-dir",
            &kubelet_dir.to_string_lossy(),
            "--hostname-override",
            NODE_NAME,
            "--node-ip",
            &NODE_IP.to_string(),
            "--v",
            "1",
        ]
        .map(String::from);
        self.spawn_node(opts, "kubelet", Command::new(self.bin_dir.join("kubelet")).args(args), true)?;
        self.wait_until(opts, "node registration", Duration::from_secs(90), |cp| cp.node_ready().is_some())
    }

    /// Starts kube-proxy and waits for its first rule sync.
    pub(super) fn start_kube_proxy(&mut self, opts: &Options) -> Result<()> {
        say(opts, "starting kube-proxy (iptables mode, rules inside the namespace)");
        let args = [
            "--kubeconfig",
            &self.state_path("node.kubeconfig"),
            "--hostname-override",
            NODE_NAME,
            "--proxy-mode",
            "iptables",
            "--cluster-cidr",
            POD_CIDR,
            // 0 = leave as is: nf_conntrack_max is read-only in a non-init netns and the hashsize
            // module parameter is host-global.
            "--conntrack-max-per-core",
            "0",
            "--conntrack-tcp-timeout-established",
            "0",
            "--conntrack-tcp-timeout-close-wait",
            "0",
            "--healthz-bind-address",
            "127.0.0.1:10256",
            "--metrics-bind-address",
            "127.0.0.1:10249",
            "--v",
            "2",
        ]
        .map(String::from);
        self.spawn_node(opts, "kube-proxy", Command::new(self.bin_dir.join("kube-proxy")).args(args), true)?;
        self.wait_until(opts, "kube-proxy's first rule sync", Duration::from_secs(60), |cp| {
            cp.in_netns(Command::new("curl").args(["-sf", "-o", "/dev/null", "--max-time", "2", "http://127.0.0.1:10256/healthz"]))
        })
    }

    /// Waits until the node is Ready, the `kubernetes` Service answers from inside the namespace,
    /// and namespace `default` has what Pods need (its service account and CA bundle), so Pods
    /// can be created as soon as start returns.
    pub(super) fn wait_node_usable(&mut self, opts: &Options) -> Result<()> {
        self.wait_until(opts, "node Ready", Duration::from_secs(120), |cp| cp.node_ready() == Some(true))?;
        let tokens = fs::read_to_string(self.dir.join("tokens.csv"))?;
        let admin = tokens.split(',').next().unwrap_or_default().to_string();
        let ca = self.state_path("ca.crt");
        self.wait_until(opts, "the kubernetes Service (10.96.0.1:443, TLS-verified) from the namespace", Duration::from_secs(60), |cp| {
            cp.in_netns(Command::new("curl").args([
                "-sf",
                "-o",
                "/dev/null",
                "--max-time",
                "3",
                "--cacert",
                &ca,
                "-H",
                &format!("Authorization: Bearer {admin}"),
                &format!("https://{KUBERNETES_SERVICE_IP}:443/readyz"),
            ]))
        })?;
        let sa = format!("{}/api/v1/namespaces/default/serviceaccounts/default", self.server);
        let root_ca = format!("{}/api/v1/namespaces/default/configmaps/kube-root-ca.crt", self.server);
        self.wait_until(opts, "service account default/default", Duration::from_secs(60), |cp| {
            cp.curl_ok(&sa, true) && cp.curl_ok(&root_ca, true)
        })
    }

    /// `Some(true)` when the Node object exists and is Ready, `Some(false)` when it exists.
    fn node_ready(&self) -> Option<bool> {
        let out = Command::new(self.bin_dir.join("kubectl"))
            .arg("--kubeconfig")
            .arg(&self.kubeconfig)
            .args(["get", "node", NODE_NAME, "--request-timeout=3s", "-o", "jsonpath={.status.conditions[?(@.type==\"Ready\")].status}"])
            .stderr(Stdio::null())
            .output()
            .ok()?;
        out.status.success().then(|| String::from_utf8_lossy(&out.stdout).trim() == "True")
    }
}
