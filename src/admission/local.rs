//! Local mode (`kube-fence run --local`): the webhook served on loopback — on a free port unless
//! one is asked for — with a CA made in-process, registered on the cluster by
//! `clientConfig.url`, and the registration removed again on a clean stop. For an API server on
//! this machine (a development control plane); the tests use the same code.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::sync::Arc;
use std::time::Duration;

use axum_server::tls_rustls::RustlsConfig;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

use crate::admission::http::server::{Metrics, PATH};
use crate::admission::http::tls::{SelfSigned, TlsError};
use crate::admission::reads::directory::LeaseDirectory;
use crate::admission::registration::{Endpoint, Registration};
use crate::admission::start::{self, Port, Running, WebhookConfig};

/// What to serve and register.
#[derive(Clone, Debug)]
pub struct LocalOptions {
    /// Port on 127.0.0.1; 0 picks a free one.
    pub port: u16,
    /// What is judged and what one client may cost, and the scope of what is registered (the
    /// configuration's name, the timeout, the namespaces): the in-cluster binary's
    /// configuration, served and routed by the same code (`super::start`).
    pub webhook: WebhookConfig,
    pub extra_object_labels: BTreeMap<String, String>,
    /// Register the policy path too (`super::policy_path`); its parameters are kept by a lease
    /// controller running with `ControllerOptions::policy_params`.
    pub policy_path: bool,
    /// The CA and serving certificate to serve with (default: made here, for 127.0.0.1). Replicas
    /// that share one registration share it: the API server trusts one CA bundle per webhook.
    pub tls: Option<SelfSigned>,
    /// The address registered in `clientConfig.url` (default: where this process listens). An API
    /// server that reaches this replica through a relay (another network namespace, a proxy)
    /// calls the relay's address; the serving certificate must name its IP.
    pub advertise: Option<SocketAddr>,
}

impl LocalOptions {
    pub fn new(configuration_name: impl Into<String>) -> LocalOptions {
        LocalOptions {
            port: 0,
            webhook: WebhookConfig::new(configuration_name),
            extra_object_labels: BTreeMap::new(),
            policy_path: false,
            tls: None,
            advertise: None,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("binding 127.0.0.1:{port}: {source}")]
    Bind { port: u16, source: std::io::Error },
    #[error(transparent)]
    Tls(#[from] TlsError),
    #[error("the lease cache did not sync within {0:?}")]
    CacheNotReady(Duration),
    #[error("registering the webhook: {0}")]
    Register(#[source] kube::Error),
}

/// A webhook serving on loopback and registered by URL.
pub struct LocalWebhook {
    pub addr: SocketAddr,
    /// PEM of the CA the API server trusts for this webhook.
    pub ca_pem: String,
    pub registration: Registration,
    pub metrics: Metrics,
    running: Running,
}

impl LocalWebhook {
    /// Serves, waits for the lease cache, registers, then keeps the writer webhooks in step.
    pub async fn start(
        client: kube::Client,
        options: LocalOptions,
        metrics: Metrics,
        registry: Arc<Registry>,
    ) -> Result<LocalWebhook, LocalError> {
        let listener =
            TcpListener::bind((Ipv4Addr::LOCALHOST, options.port)).map_err(|source| LocalError::Bind { port: options.port, source })?;
        let addr = listener.local_addr().map_err(|source| LocalError::Bind { port: options.port, source })?;
        let made = match options.tls {
            Some(tls) => tls,
            None => SelfSigned::generate(&["localhost".to_string()], &[IpAddr::V4(Ipv4Addr::LOCALHOST)])?,
        };
        let tls = RustlsConfig::from_config(made.server_config()?);

        // Who runs local mode is its admin: it writes Lease status as the controller, is exempt
        // from the holder policies, and may opt objects into a leader Lease.
        let me = crate::admission::registration::whoami(&client).await.map_err(LocalError::Register)?;
        let mut config = options.webhook;
        config.exempt = config.exempt.with_label_admins([me.clone()]);

        // The configuration is registered by URL, with the scope's name, timeout and namespaces
        // (the writer webhooks `start` keeps in step carry the same).
        let mut registration =
            Registration::scoped(&config.scope, Endpoint::Url(format!("https://{}{PATH}", options.advertise.unwrap_or(addr))));
        registration.ca_bundle = Some(made.ca_cert.clone());
        registration.extra_object_labels = options.extra_object_labels;
        registration.policy_path = options.policy_path;
        registration.leader_identity = config.leader_identity.clone();
        let register = {
            let client = client.clone();
            move |leases: LeaseDirectory| async move {
                let sync = Duration::from_secs(30);
                if !leases.wait_ready(sync).await {
                    return Err(LocalError::CacheNotReady(sync));
                }
                // Lease status is written by this process's controller, under this process's identity.
                let me = [me];
                registration.apply_policies(&client, &me, &me).await.map_err(LocalError::Register)?;
                registration.apply(&client).await.map_err(LocalError::Register)?;
                if !registration.policy_path {
                    // A process with the policy path that crashed left its policy behind: without
                    // its parameters kept, it would deny the fast-path writes. Removed after the
                    // webhook configuration without the skip condition is applied, so no write
                    // goes unjudged.
                    registration.remove_policy_path(&client).await.map_err(LocalError::Register)?;
                }
                Ok(registration)
            }
        };
        let port = Port { listener, tls, metrics: metrics.clone(), registry };
        let (running, registration) = start::start(client, &config, port, CancellationToken::new(), register).await?;
        tracing::info!(%addr, configuration = %registration.name, "webhook serving on loopback and registered by URL");
        Ok(LocalWebhook { addr, ca_pem: made.ca_cert, registration, metrics, running })
    }

    /// Stops serving but leaves the registration in place: guarded writes then fail closed.
    pub async fn stop_serving(&mut self) {
        self.running.stop_serving().await;
    }

    /// Stops serving and drops the lease cache but leaves the registration in place, as a crashed
    /// process would: guarded writes fail closed until a webhook serves the registration again.
    pub async fn crash(self) {
        self.running.stop().await;
    }

    /// Removes the registration, then stops serving (in that order, so no guarded write meets
    /// a registered webhook that no longer answers).
    pub async fn stop(mut self, client: &kube::Client) -> Result<(), kube::Error> {
        self.running.stop_routing().await;
        let removed = self.registration.remove(client).await;
        self.running.stop().await;
        removed
    }
}
