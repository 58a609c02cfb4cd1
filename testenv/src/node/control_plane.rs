//! The node's control plane, inside the namespace: etcd, kube-apiserver (reachable from the host
//! through a socat relay), kube-controller-manager and kube-scheduler.

use std::process::Command;
use std::time::Duration;

use anyhow::Result;

use super::{API_PORT, KUBERNETES_SERVICE_IP, NODE_IP, SERVICE_CIDR, say};
use crate::{ApiServerFlags, ControlPlane, Options, listen_port, pki};

impl ControlPlane {
    /// Credentials, the API relay, etcd and kube-apiserver (waited for), then
    /// kube-controller-manager and kube-scheduler.
    pub(super) fn start_node_control_plane(&mut self, opts: &Options) -> Result<()> {
        // PKI: the serving certificate also names what in-cluster clients dial.
        let pki = pki::generate(
            &[KUBERNETES_SERVICE_IP, NODE_IP],
            &["kubernetes", "kubernetes.default", "kubernetes.default.svc", "kubernetes.default.svc.cluster.local"],
        )?;
        let (token, kcm_token) = self.write_credentials(&pki)?;
        let in_ns = format!("https://127.0.0.1:{API_PORT}");
        self.write_kubeconfig_to(&self.dir.join("node.kubeconfig"), &in_ns, "admin", &token)?;
        self.write_kubeconfig_to(&self.dir.join("kcm.kubeconfig"), &in_ns, "system:kube-controller-manager", &kcm_token)?;

        self.start_netns_relay(opts)?;
        self.start_node_etcd(opts)?;
        self.start_node_apiserver(opts)?;
        // The host's end of the relay on a port outside the ephemeral range (no client takes it
        // in between); should another program bind it first all the same, the relay is started
        // again on another. The API server is waited for through it.
        for attempt in 1.. {
            let host_port = listen_port()?;
            self.server = format!("https://127.0.0.1:{host_port}");
            self.write_kubeconfig_to(&self.kubeconfig, &self.server, "admin", &token)?;
            self.start_host_relay(opts, host_port)?;
            match self.wait_node_apiserver(opts) {
                Ok(()) => break,
                Err(err) if attempt < 5 && self.lost_its_port("socat-host") => {
                    say(opts, &format!("port {host_port} was taken before the API relay bound it; another port ({err:#})"));
                }
                Err(err) => return Err(err),
            }
        }

        let args = self.controller_manager_args("*,-node-ipam-controller,-persistentvolume-binder-controller");
        self.spawn_node(opts, "kube-controller-manager", Command::new(self.bin_dir.join("kube-controller-manager")).args(args), true)?;
        let nkc = self.state_path("node.kubeconfig");
        self.spawn_node(
            opts,
            "kube-scheduler",
            Command::new(self.bin_dir.join("kube-scheduler")).args([
                "--kubeconfig",
                &nkc,
                "--authentication-kubeconfig",
                &nkc,
                "--authorization-kubeconfig",
                &nkc,
                "--bind-address",
                "127.0.0.1",
                "--secure-port",
                "0",
                "--leader-elect=false",
                "--v",
                "0",
            ]),
            true,
        )
    }

    /// The API from the host, the namespace's end: unix socket -> netns 127.0.0.1:6443.
    fn start_netns_relay(&mut self, opts: &Options) -> Result<()> {
        let sock = self.state_path("kas.sock");
        self.spawn_node(
            opts,
            "socat-netns",
            Command::new("socat").args([&format!("UNIX-LISTEN:{sock},fork,unlink-early,mode=600"), &format!("TCP:127.0.0.1:{API_PORT}")]),
            true,
        )
    }

    /// The API from the host, the host's end: host `127.0.0.1:<port>` -> unix socket.
    fn start_host_relay(&mut self, opts: &Options, host_port: u16) -> Result<()> {
        let sock = self.state_path("kas.sock");
        self.spawn_node(
            opts,
            "socat-host",
            Command::new("socat").args([&format!("TCP-LISTEN:{host_port},bind=127.0.0.1,fork,reuseaddr"), &format!("UNIX-CONNECT:{sock}")]),
            false,
        )
    }

    fn start_node_etcd(&mut self, opts: &Options) -> Result<()> {
        say(opts, &format!("starting etcd (state in {})", self.dir.display()));
        let (client, peer) = ("http://127.0.0.1:2379", "http://127.0.0.1:2380");
        let args = self.etcd_args(client, peer, &["--listen-metrics-urls", ""]);
        self.spawn_node(opts, "etcd", Command::new(self.bin_dir.join("etcd")).args(args), true)
    }

    fn start_node_apiserver(&mut self, opts: &Options) -> Result<()> {
        say(opts, &format!("starting kube-apiserver (in the namespace on {NODE_IP}:{API_PORT})"));
        let (kubelet_cert, kubelet_key) = (self.state_path("kubelet-client.crt"), self.state_path("kubelet-client.key"));
        let audit_log = self.audit_log().display().to_string();
        let flags = ApiServerFlags {
            etcd: "http://127.0.0.1:2379",
            // 0.0.0.0 of the node's namespace: loopback, the node IP and the CNI gateway only.
            bind: "0.0.0.0",
            advertise: &NODE_IP.to_string(),
            port: API_PORT,
            issuer: "https://kubernetes.default.svc",
            service_cidr: SERVICE_CIDR,
            // The apiserver itself keeps default/kubernetes -> 10.99.0.1:6443.
            endpoint_reconciler: "lease",
            audit_log: &audit_log,
        };
        let args = self.apiserver_args(
            &flags,
            &[
                "--enable-aggregator-routing=true",
                "--kubelet-preferred-address-types",
                "InternalIP",
                "--kubelet-client-certificate",
                &kubelet_cert,
                "--kubelet-client-key",
                &kubelet_key,
            ],
        );
        self.spawn_node(opts, "kube-apiserver", Command::new(self.bin_dir.join("kube-apiserver")).args(args), true)
    }

    /// Waits until kube-apiserver answers from the host, through the relay.
    fn wait_node_apiserver(&mut self, opts: &Options) -> Result<()> {
        say(opts, &format!("waiting for kube-apiserver from the host at {}", self.server));
        let readyz = format!("{}/readyz", self.server);
        let default_ns = format!("{}/api/v1/namespaces/default", self.server);
        self.wait_until(opts, "kube-apiserver", Duration::from_secs(90), |cp| cp.curl_ok(&readyz, true) && cp.curl_ok(&default_ns, true))
    }
}
