//! A partition between one client and its API server, without touching the host's network: a
//! TCP relay on loopback that the client talks through, and that can stop carrying bytes (both
//! ways, every connection, new ones too) without closing anything — what a client sees when a
//! network partition drops its packets. Healing delivers what was held.

use std::net::SocketAddr;
use std::path::Path;

use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A relay to an API server (see the module's documentation). Dropped, it accepts no more
/// connections, and those it holds in a cut end.
pub struct Relay {
    addr: SocketAddr,
    open: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

impl Relay {
    /// A relay to `upstream`, listening on a loopback port the kernel picks (bound here, before
    /// anyone is told its address).
    pub async fn to(upstream: SocketAddr) -> Relay {
        let listener = TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).await.expect("bind the relay on loopback");
        let addr = listener.local_addr().expect("the relay's address");
        let (open, gate) = watch::channel(true);
        let task = tokio::spawn(async move {
            while let Ok((down, _)) = listener.accept().await {
                let gate = gate.clone();
                tokio::spawn(async move {
                    // A connection opened during the cut reaches nothing until it heals.
                    if !wait_open(gate.clone()).await {
                        return;
                    }
                    let Ok(up) = TcpStream::connect(upstream).await else { return };
                    let (down_read, down_write) = down.into_split();
                    let (up_read, up_write) = up.into_split();
                    tokio::join!(pump(down_read, up_write, gate.clone()), pump(up_read, down_write, gate));
                });
            }
        });
        Relay { addr, open, task }
    }

    /// Where clients connect.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// From now on nothing passes, either way; connections stay open.
    pub fn cut(&self) {
        self.open.send_replace(false);
    }

    /// Everything held is delivered, and what follows passes again.
    pub fn heal(&self) {
        self.open.send_replace(true);
    }

    /// A client of the cluster of the kubeconfig at `path` (its current context) that reaches
    /// the API server through this relay. The server's certificate is checked as usual: the
    /// relay listens on 127.0.0.1, so the API server's certificate must name it (the project's
    /// control planes' do).
    pub async fn client(&self, path: &Path) -> Client {
        let kubeconfig = Kubeconfig::read_from(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let mut config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await.expect("kubeconfig is usable");
        config.cluster_url = format!("https://{}", self.addr).parse().expect("the relay's URL");
        Client::try_from(config).expect("client through the relay")
    }

    /// A relay to the API server of the kubeconfig at `path` (its current context).
    pub async fn to_api_server_of(path: &Path) -> Relay {
        Relay::to(Relay::upstream_of(path).await).await
    }

    /// The API server's address in the kubeconfig at `path` (its current context), to relay to.
    async fn upstream_of(path: &Path) -> SocketAddr {
        let kubeconfig = Kubeconfig::read_from(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        let config = Config::from_custom_kubeconfig(kubeconfig, &KubeConfigOptions::default()).await.expect("kubeconfig is usable");
        let host = config.cluster_url.host().expect("the API server's URL names a host");
        let port = config.cluster_url.port_u16().unwrap_or(443);
        tokio::net::lookup_host((host, port)).await.expect("the API server's address").next().expect("an address for the API server")
    }
}

impl Drop for Relay {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Waits while the relay is cut; false if the relay is gone.
async fn wait_open(mut gate: watch::Receiver<bool>) -> bool {
    gate.wait_for(|open| *open).await.is_ok()
}

/// Copies `from` to `to`; bytes read while cut are held until the relay heals.
async fn pump(mut from: tokio::net::tcp::OwnedReadHalf, mut to: tokio::net::tcp::OwnedWriteHalf, gate: watch::Receiver<bool>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if !wait_open(gate.clone()).await || to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
