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
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::admission::http::bounds::Bounds;
use crate::admission::http::server::PATH;
use crate::admission::http::server::{self, Metrics};
use crate::admission::http::tls::{SelfSigned, TlsError};
use crate::admission::judge::exemptions::Exemptions;
use crate::admission::judge::identity::IdentityRule;
use crate::admission::reads::directory::LeaseDirectory;
use crate::admission::registration::{Endpoint, Registration};

/// What to serve and register.
#[derive(Clone, Debug)]
pub struct LocalOptions {
    /// Port on 127.0.0.1; 0 picks a free one.
    pub port: u16,
    pub configuration_name: String,
    pub only_namespaces: Option<Vec<String>>,
    pub extra_object_labels: BTreeMap<String, String>,
    pub exempt: Exemptions,
    /// Register the policy path too (`super::policy_path`); its parameters are kept by a lease
    /// controller running with `ControllerOptions::policy_params`.
    pub policy_path: bool,
    /// How a leader-election Lease's holder names a Pod: the webhook judges guarded writes and
    /// the holder policy judges claims by this one rule.
    pub leader_identity: IdentityRule,
    /// What one client of the port can cost (connections, quorum reads).
    pub bounds: Bounds,
}

impl LocalOptions {
    pub fn new(configuration_name: impl Into<String>) -> LocalOptions {
        LocalOptions {
            port: 0,
            configuration_name: configuration_name.into(),
            only_namespaces: None,
            extra_object_labels: BTreeMap::new(),
            exempt: Exemptions::default(),
            policy_path: false,
            leader_identity: IdentityRule::default(),
            bounds: Bounds::default(),
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
    stop: CancellationToken,
    server: Option<JoinHandle<std::io::Result<()>>>,
    cache: JoinHandle<()>,
    routing: JoinHandle<()>,
}

impl LocalWebhook {
    /// Serves, waits for the lease cache, then registers.
    pub async fn start(
        client: kube::Client,
        options: LocalOptions,
        metrics: Metrics,
        registry: Arc<Registry>,
    ) -> Result<LocalWebhook, LocalError> {
        let listener =
            TcpListener::bind((Ipv4Addr::LOCALHOST, options.port)).map_err(|source| LocalError::Bind { port: options.port, source })?;
        let addr = listener.local_addr().map_err(|source| LocalError::Bind { port: options.port, source })?;
        let made = SelfSigned::generate(&["localhost".to_string()], &[IpAddr::V4(Ipv4Addr::LOCALHOST)])?;
        let tls = RustlsConfig::from_config(made.server_config()?);

        // Who runs local mode is its admin: it writes Lease status as the controller, is exempt
        // from the holder policies, and may opt objects into a leader Lease.
        let me = crate::admission::registration::whoami(&client).await.map_err(LocalError::Register)?;
        let exempt = options.exempt.clone().with_label_admins([me.clone()]);
        let (leases, cache) = LeaseDirectory::new(client.clone());
        let cache = tokio::spawn(cache);
        let stop = CancellationToken::new();
        let server = tokio::spawn(server::run(
            leases.clone(),
            listener,
            tls,
            exempt,
            options.leader_identity.clone(),
            options.bounds,
            metrics.clone(),
            registry,
            stop.clone().cancelled_owned(),
        ));
        let sync = Duration::from_secs(30);
        if !leases.wait_ready(sync).await {
            stop.cancel();
            cache.abort();
            return Err(LocalError::CacheNotReady(sync));
        }

        let mut registration = Registration::new(options.configuration_name, Endpoint::Url(format!("https://{addr}{PATH}")));
        registration.ca_bundle = Some(made.ca_cert.clone());
        registration.only_namespaces = options.only_namespaces;
        registration.extra_object_labels = options.extra_object_labels;
        registration.policy_path = options.policy_path;
        registration.leader_identity = options.leader_identity;
        // Lease status is written by this process's controller, under this process's identity.
        let registered = async {
            let me = [me];
            registration.apply_policies(&client, &me, &me).await?;
            let applied = registration.apply(&client).await?;
            if !registration.policy_path {
                // A process with the policy path that crashed left its policy behind: without its
                // parameters kept, it would deny the fast-path writes. Removed after the webhook
                // configuration without the skip condition is applied, so no write goes unjudged.
                registration.remove_policy_path(&client).await?;
            }
            Ok(applied)
        };
        if let Err(err) = registered.await {
            stop.cancel();
            cache.abort();
            return Err(LocalError::Register(err));
        }
        // The writer webhooks (opted-in ServiceAccounts) call the same address at their own paths.
        let scope = crate::admission::registration::scope::Scope {
            configuration_name: registration.name.clone(),
            timeout_seconds: registration.timeout_seconds,
            only_namespaces: registration.only_namespaces.clone(),
        };
        let routing =
            tokio::spawn(crate::admission::registration::routing::keep_in_step(client.clone(), scope, stop.clone().cancelled_owned()));
        tracing::info!(%addr, configuration = %registration.name, "webhook serving on loopback and registered by URL");
        Ok(LocalWebhook { addr, ca_pem: made.ca_cert, registration, metrics, stop, server: Some(server), cache, routing })
    }

    /// Stops serving but leaves the registration in place: guarded writes then fail closed.
    pub async fn stop_serving(&mut self) {
        self.stop.cancel();
        if let Some(server) = self.server.take() {
            let _ = server.await;
        }
    }

    /// Stops serving and drops the lease cache but leaves the registration in place, as a crashed
    /// process would: guarded writes fail closed until a webhook serves the registration again.
    pub async fn crash(mut self) {
        self.routing.abort();
        self.stop_serving().await;
        self.cache.abort();
    }

    /// Removes the registration, then stops serving (in that order, so no guarded write meets
    /// a registered webhook that no longer answers).
    pub async fn stop(mut self, client: &kube::Client) -> Result<(), kube::Error> {
        self.routing.abort();
        let _ = (&mut self.routing).await;
        let removed = self.registration.remove(client).await;
        self.stop_serving().await;
        self.cache.abort();
        removed
    }
}
