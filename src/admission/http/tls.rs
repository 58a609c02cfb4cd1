//! Serving certificates for the webhook: HTTPS only.
//!
//! Two sources:
//! - files (`--tls-cert-file`, `--tls-key-file`), re-read on change and swapped in without a
//!   restart — what cert-manager or a chart-made Secret mounted as a volume gives. A
//!   half-written pair (new certificate, old key) fails to load and the old pair keeps serving
//!   until the next poll finds the pair consistent, so a rotation never fails a handshake.
//! - self-managed: a CA and a serving certificate made here ([`SelfSigned`]) and kept in a
//!   Secret that every replica shares (created if absent, so concurrent replicas agree on one
//!   CA), with the CA put into the webhook configuration's `caBundle`. The CA lasts ten years and
//!   is kept; the serving certificate is short-lived (`--self-managed-tls-lifetime`, 90 days) and
//!   reissued under the same CA when a third of its lifetime is left (whichever replica sees it
//!   first writes the Secret; the others load it), so the caBundle never changes for it.
//!
//! Either way the webhook can also authenticate its callers ([`ClientAuth`], `--client-ca-file`):
//! with the API server configured to present a client certificate to webhooks
//! (`--admission-control-config-file`, a kubeconfig per webhook), nobody else can even complete
//! a handshake with the webhook port.

use prometheus_client::metrics::counter::Counter;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum_server::tls_rustls::RustlsConfig;
use k8s_openapi::ByteString;
use k8s_openapi::api::admissionregistration::v1::ValidatingWebhookConfiguration;
use k8s_openapi::api::core::v1::Secret;
use k8s_openapi::jiff::{SignedDuration, Timestamp};
use kube::ResourceExt;
use kube::api::{Api, ObjectMeta, PostParams};
use rustls::ServerConfig;

use crate::telemetry::Chain;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

/// Why TLS material could not be loaded or made.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("reading {path}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("no PEM certificate found in the certificate file")]
    NoCertificate,
    #[error("parsing the PEM private key")]
    Key(#[source] rustls::pki_types::pem::Error),
    #[error("building the TLS configuration (does the key match the certificate?)")]
    Config(#[from] rustls::Error),
    #[error("making a certificate")]
    Generate(#[from] rcgen::Error),
    #[error("the Secret {0} lacks {1}")]
    SecretIncomplete(String, &'static str),
    #[error("calling the Kubernetes API")]
    Kube(#[from] kube::Error),
}

/// Which clients may connect: anyone (the default: the port is protected by the network, see
/// the chart's NetworkPolicy), or only those presenting a certificate signed by a given CA.
#[derive(Clone, Debug, Default)]
pub struct ClientAuth(Option<Arc<dyn rustls::server::danger::ClientCertVerifier>>);

impl ClientAuth {
    /// Anyone may connect.
    pub fn none() -> ClientAuth {
        ClientAuth(None)
    }

    /// Only clients with a certificate signed by one of the CAs in `ca_pem`.
    pub fn require(ca_pem: &[u8]) -> Result<ClientAuth, TlsError> {
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(ca_pem).filter_map(Result::ok) {
            roots.add(cert)?;
        }
        if roots.is_empty() {
            return Err(TlsError::NoCertificate);
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
            .build()
            .map_err(|e| TlsError::Config(rustls::Error::General(format!("client CA: {e}"))))?;
        Ok(ClientAuth(Some(verifier)))
    }

    /// Reads the client CA bundle from `path`.
    pub fn require_file(path: &std::path::Path) -> Result<ClientAuth, TlsError> {
        let pem = std::fs::read(path).map_err(|source| TlsError::Read { path: path.to_path_buf(), source })?;
        ClientAuth::require(&pem)
    }
}

/// A rustls server configuration from a PEM certificate chain and a PEM private key, for any
/// client.
pub fn server_config(cert_pem: &[u8], key_pem: &[u8]) -> Result<Arc<ServerConfig>, TlsError> {
    server_config_for(cert_pem, key_pem, &ClientAuth::none())
}

/// A rustls server configuration from a PEM certificate chain and a PEM private key, for the
/// clients `auth` admits.
pub fn server_config_for(cert_pem: &[u8], key_pem: &[u8], auth: &ClientAuth) -> Result<Arc<ServerConfig>, TlsError> {
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_pem).filter_map(Result::ok).collect();
    if certs.is_empty() {
        return Err(TlsError::NoCertificate);
    }
    let key = PrivateKeyDer::from_pem_slice(key_pem).map_err(TlsError::Key)?;
    let builder =
        ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider())).with_safe_default_protocol_versions()?;
    let builder = match &auth.0 {
        Some(verifier) => builder.with_client_cert_verifier(verifier.clone()),
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(certs, key)?;
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// A certificate and key pair in PEM.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PemPair {
    pub cert: Vec<u8>,
    pub key: Vec<u8>,
}

/// Certificate files, watched for change.
#[derive(Clone, Debug)]
pub struct CertFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub client_auth: ClientAuth,
}

impl CertFiles {
    pub async fn read(&self) -> Result<PemPair, TlsError> {
        let read = |path: PathBuf| async move { tokio::fs::read(&path).await.map_err(|source| TlsError::Read { path, source }) };
        Ok(PemPair { cert: read(self.cert.clone()).await?, key: read(self.key.clone()).await? })
    }

    /// Loads the files once, for serving.
    pub async fn load(&self) -> Result<(RustlsConfig, PemPair), TlsError> {
        let pair = self.read().await?;
        let config = server_config_for(&pair.cert, &pair.key, &self.client_auth)?;
        Ok((RustlsConfig::from_config(config), pair))
    }

    /// Re-reads the files every `interval` and swaps a changed, consistent pair into `tls`.
    /// Contents are compared rather than mtimes: Kubernetes updates a mounted Secret by
    /// swapping a symlink, and mtime granularity can hide a quick second write.
    pub async fn watch(self, tls: RustlsConfig, mut current: PemPair, interval: Duration, reloads: Counter) {
        let mut ticker = tokio::time::interval(interval);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticker.tick().await;
            let pair = match self.read().await {
                Ok(pair) => pair,
                Err(err) => {
                    tracing::warn!(error = %Chain(&err), "cannot read the TLS files; serving the previous certificate");
                    continue;
                }
            };
            if pair == current {
                continue;
            }
            match server_config_for(&pair.cert, &pair.key, &self.client_auth) {
                Ok(config) => {
                    tls.reload_from_config(config);
                    current = pair;
                    reloads.inc();
                    tracing::info!(cert = %self.cert.display(), "TLS certificate reloaded");
                }
                // Likely mid-rotation (certificate written, key not yet): try again next tick.
                Err(err) => tracing::warn!(error = %Chain(&err), "new TLS files do not load yet; serving the previous certificate"),
            }
        }
    }
}

/// A CA made by kube-fence and a serving certificate it signed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SelfSigned {
    pub ca_cert: String,
    /// Kept (in the Secret) so a serving certificate can be reissued under the same CA.
    pub ca_key: String,
    pub serving: PemPair,
    /// When the serving certificate expires (the Secret's [`SERVING_NOT_AFTER_ANNOTATION`]);
    /// `None` for a Secret written before rotation existed (a ten-year certificate): reissued.
    pub serving_not_after: Option<Timestamp>,
}

/// The Secret's annotation recording when its serving certificate expires (RFC 3339), so that
/// replicas know when to reissue it without parsing X.509.
pub const SERVING_NOT_AFTER_ANNOTATION: &str = "kubefence.io/serving-not-after";

/// How long a self-managed serving certificate lasts by default.
pub const DEFAULT_SERVING_LIFETIME: Duration = Duration::from_secs(90 * 24 * 3600);

/// Seconds since the epoch of `at` (0 before it), for rcgen's times: `date_time_ymd(1970, 1, 1)`
/// plus these.
fn epoch_seconds(at: Timestamp) -> Duration {
    Duration::from_secs(u64::try_from(at.as_second()).unwrap_or(0))
}

/// Valid from yesterday (tolerates a little clock skew with the API server) for ten years.
fn set_validity(params: &mut rcgen::CertificateParams) {
    // The calendar date in UTC (jiff: the time crate k8s-openapi already uses).
    let today = k8s_openapi::jiff::Timestamp::now().to_zoned(k8s_openapi::jiff::tz::TimeZone::UTC).date();
    let start = today.yesterday().unwrap_or(today);
    let month = start.month().unsigned_abs();
    params.not_before = rcgen::date_time_ymd(i32::from(start.year()), month, start.day().unsigned_abs());
    params.not_after = rcgen::date_time_ymd(i32::from(start.year()) + 10, month, start.day().unsigned_abs().min(28));
}

/// The CA's parameters. An issuer rebuilt from these and the CA key signs certificates that
/// chain to the stored CA certificate (same subject, same key identifier).
fn ca_params() -> Result<rcgen::CertificateParams, TlsError> {
    let mut ca = rcgen::CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name.push(rcgen::DnType::CommonName, "kube-fence webhook CA");
    ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
    ca.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign, rcgen::KeyUsagePurpose::DigitalSignature];
    set_validity(&mut ca);
    Ok(ca)
}

/// A serving certificate for `dns_names` and `ips`, signed by the kube-fence CA whose key is
/// given in PEM, valid ten years.
pub fn issue_serving(ca_key_pem: &str, dns_names: &[String], ips: &[IpAddr]) -> Result<PemPair, TlsError> {
    issue_serving_with(ca_key_pem, dns_names, ips, None).map(|(pair, _)| pair)
}

/// [`issue_serving`], valid from an hour ago (clock skew) for `lifetime` from now when given;
/// returns when it expires too.
pub fn issue_serving_for(
    ca_key_pem: &str,
    dns_names: &[String],
    ips: &[IpAddr],
    lifetime: Duration,
) -> Result<(PemPair, Timestamp), TlsError> {
    issue_serving_with(ca_key_pem, dns_names, ips, Some(lifetime)).map(|(pair, not_after)| (pair, not_after.unwrap_or(Timestamp::MAX)))
}

fn issue_serving_with(
    ca_key_pem: &str,
    dns_names: &[String],
    ips: &[IpAddr],
    lifetime: Option<Duration>,
) -> Result<(PemPair, Option<Timestamp>), TlsError> {
    let issuer = rcgen::Issuer::new(ca_params()?, rcgen::KeyPair::from_pem(ca_key_pem)?);
    let key = rcgen::KeyPair::generate()?;
    let mut leaf = rcgen::CertificateParams::new(dns_names.to_vec())?;
    leaf.subject_alt_names.extend(ips.iter().map(|ip| rcgen::SanType::IpAddress(*ip)));
    leaf.distinguished_name.push(rcgen::DnType::CommonName, dns_names.first().cloned().unwrap_or_else(|| "kube-fence".into()));
    leaf.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature, rcgen::KeyUsagePurpose::KeyEncipherment];
    leaf.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth];
    set_validity(&mut leaf);
    let mut not_after = None;
    if let Some(lifetime) = lifetime {
        let now = Timestamp::now();
        let until = now.saturating_add(SignedDuration::try_from(lifetime).unwrap_or(SignedDuration::MAX)).unwrap_or(Timestamp::MAX);
        let since = now.saturating_sub(SignedDuration::from_hours(1)).unwrap_or(now);
        leaf.not_before = rcgen::date_time_ymd(1970, 1, 1) + epoch_seconds(since);
        leaf.not_after = rcgen::date_time_ymd(1970, 1, 1) + epoch_seconds(until);
        // X.509 keeps whole seconds.
        not_after = Some(Timestamp::from_second(until.as_second()).unwrap_or(until));
    }
    let cert = leaf.signed_by(&key, &issuer)?;
    Ok((PemPair { cert: cert.pem().into_bytes(), key: key.serialize_pem().into_bytes() }, not_after))
}

/// Whether a serving certificate that expires at `not_after` (`None`: unknown) and was issued
/// for `lifetime` is due for reissue: a third of its lifetime or less is left.
pub fn reissue_due(not_after: Option<Timestamp>, lifetime: Duration, now: Timestamp) -> bool {
    let Some(not_after) = not_after else { return true };
    let left = now.duration_until(not_after);
    left <= SignedDuration::try_from(lifetime / 3).unwrap_or(SignedDuration::MAX)
}

impl SelfSigned {
    /// A fresh CA and a serving certificate for `dns_names` and `ips`, valid ten years (the
    /// CA lives in a Secret and the caBundle, both of which kube-fence keeps; replace the
    /// Secret to rotate).
    pub fn generate(dns_names: &[String], ips: &[IpAddr]) -> Result<SelfSigned, TlsError> {
        let ca_key = rcgen::KeyPair::generate()?;
        let ca = ca_params()?;
        let ca_cert = ca.self_signed(&ca_key)?.pem();
        let ca_key = ca_key.serialize_pem();
        let serving = issue_serving(&ca_key, dns_names, ips)?;
        Ok(SelfSigned { ca_cert, ca_key, serving, serving_not_after: None })
    }

    /// A fresh CA (ten years) and a serving certificate for `lifetime`.
    pub fn generate_for(dns_names: &[String], ips: &[IpAddr], lifetime: Duration) -> Result<SelfSigned, TlsError> {
        let made = SelfSigned::generate(dns_names, ips)?;
        made.reissued(dns_names, ips, lifetime)
    }

    /// The same CA with a new serving certificate for `lifetime`.
    pub fn reissued(&self, dns_names: &[String], ips: &[IpAddr], lifetime: Duration) -> Result<SelfSigned, TlsError> {
        let (serving, not_after) = issue_serving_for(&self.ca_key, dns_names, ips, lifetime)?;
        Ok(SelfSigned { serving, serving_not_after: Some(not_after), ..self.clone() })
    }

    pub fn server_config(&self) -> Result<Arc<ServerConfig>, TlsError> {
        server_config(&self.serving.cert, &self.serving.key)
    }

    /// The server configuration for the clients `auth` admits.
    pub fn server_config_for(&self, auth: &ClientAuth) -> Result<Arc<ServerConfig>, TlsError> {
        server_config_for(&self.serving.cert, &self.serving.key, auth)
    }

    fn to_secret(&self, name: &str, namespace: &str) -> Secret {
        let data = [
            ("ca.crt", self.ca_cert.as_bytes().to_vec()),
            ("ca.key", self.ca_key.as_bytes().to_vec()),
            ("tls.crt", self.serving.cert.clone()),
            ("tls.key", self.serving.key.clone()),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_string(), ByteString(v)))
        .collect();
        Secret {
            metadata: ObjectMeta {
                name: Some(name.into()),
                namespace: Some(namespace.into()),
                labels: Some([("app.kubernetes.io/managed-by".to_string(), "kube-fence".to_string())].into()),
                annotations: self.serving_not_after.map(|t| [(SERVING_NOT_AFTER_ANNOTATION.to_string(), t.to_string())].into()),
                ..Default::default()
            },
            type_: Some("kubernetes.io/tls".into()),
            data: Some(data),
            ..Default::default()
        }
    }

    fn from_secret(secret: &Secret) -> Result<SelfSigned, TlsError> {
        let name = secret.metadata.name.clone().unwrap_or_default();
        let get = |key: &'static str| {
            secret.data.as_ref().and_then(|d| d.get(key)).map(|b| b.0.clone()).ok_or_else(|| TlsError::SecretIncomplete(name.clone(), key))
        };
        Ok(SelfSigned {
            ca_cert: String::from_utf8_lossy(&get("ca.crt")?).into_owned(),
            ca_key: String::from_utf8_lossy(&get("ca.key")?).into_owned(),
            serving: PemPair { cert: get("tls.crt")?, key: get("tls.key")? },
            serving_not_after: secret.annotations().get(SERVING_NOT_AFTER_ANNOTATION).and_then(|t| t.parse().ok()),
        })
    }
}

/// Self-managed TLS: where the shared Secret lives and which webhook configuration trusts it.
#[derive(Clone, Debug)]
pub struct SelfManaged {
    pub namespace: String,
    pub secret: String,
    /// DNS names of the webhook Service (`<svc>.<ns>.svc`, ...).
    pub dns_names: Vec<String>,
    pub webhook_configuration: String,
    pub client_auth: ClientAuth,
    /// How long a serving certificate lasts; reissued with a third of it left.
    pub serving_lifetime: Duration,
}

impl SelfManaged {
    /// The shared CA and serving certificate: read from the Secret, or made and stored in it
    /// when absent. Create-if-absent means that replicas racing at first start all end up
    /// with the one pair that won the create.
    pub async fn ensure_secret(&self, client: &kube::Client) -> Result<SelfSigned, TlsError> {
        let secrets: Api<Secret> = Api::namespaced(client.clone(), &self.namespace);
        if let Some(secret) = secrets.get_opt(&self.secret).await? {
            return SelfSigned::from_secret(&secret);
        }
        let made = SelfSigned::generate_for(&self.dns_names, &[], self.serving_lifetime)?;
        match secrets.create(&PostParams::default(), &made.to_secret(&self.secret, &self.namespace)).await {
            Ok(_) => Ok(made),
            Err(kube::Error::Api(e)) if e.code == 409 => SelfSigned::from_secret(&secrets.get(&self.secret).await?),
            Err(e) => Err(e.into()),
        }
    }

    /// The Secret's pair, with its serving certificate reissued under the same CA first when it
    /// is due ([`reissue_due`]). The write carries the resourceVersion read: of replicas racing
    /// to reissue, one wins and the others read its certificate next time.
    pub async fn rotate_if_due(&self, client: &kube::Client) -> Result<SelfSigned, TlsError> {
        let current = self.ensure_secret(client).await?;
        if !reissue_due(current.serving_not_after, self.serving_lifetime, Timestamp::now()) {
            return Ok(current);
        }
        let secrets: Api<Secret> = Api::namespaced(client.clone(), &self.namespace);
        let Some(stored) = secrets.get_opt(&self.secret).await? else { return Ok(current) };
        let read = SelfSigned::from_secret(&stored)?;
        if read != current {
            return Ok(read); // changed since: judged next round
        }
        let next = read.reissued(&self.dns_names, &[], self.serving_lifetime)?;
        let mut secret = next.to_secret(&self.secret, &self.namespace);
        secret.metadata.resource_version = stored.metadata.resource_version.clone();
        secret.metadata.labels = stored.metadata.labels.clone().or(secret.metadata.labels);
        match secrets.replace(&self.secret, &PostParams::default(), &secret).await {
            Ok(_) => {
                tracing::info!(secret = %self.secret, not_after = ?next.serving_not_after, "self-managed serving certificate reissued under the same CA");
                Ok(next)
            }
            Err(kube::Error::Api(e)) if e.code == 409 => Ok(read),
            Err(e) => Err(e.into()),
        }
    }

    /// How often [`SelfManaged::maintain`] looks: every 30 s, or a sixth of a short lifetime.
    pub fn maintain_interval(&self) -> Duration {
        (self.serving_lifetime / 6).clamp(Duration::from_secs(1), Duration::from_secs(30))
    }

    /// Keeps TLS and the caBundle right: every `interval`, re-reads the Secret (re-creating it
    /// if deleted — a new CA; reissuing the serving certificate when due), swaps a changed pair
    /// into `tls`, and sets the caBundle of every webhook in the configuration to the Secret's CA.
    pub async fn maintain(self, client: kube::Client, tls: RustlsConfig, mut current: SelfSigned, interval: Duration, reloads: Counter) {
        loop {
            if let Err(err) = ensure_ca_bundle(&client, &self.webhook_configuration, &current.ca_cert).await {
                tracing::warn!(error = %Chain(&err), configuration = %self.webhook_configuration, "cannot set the webhook caBundle; retrying");
            }
            tokio::time::sleep(interval).await;
            match self.rotate_if_due(&client).await.and_then(|pair| Ok((pair.server_config_for(&self.client_auth)?, pair))) {
                Ok((config, pair)) if pair != current => {
                    tls.reload_from_config(config);
                    current = pair;
                    reloads.inc();
                    tracing::info!(secret = %self.secret, "TLS certificate reloaded from the Secret");
                }
                Ok(_) => {}
                Err(err) => {
                    tracing::warn!(error = %Chain(&err), secret = %self.secret, "cannot read the TLS Secret; serving the previous certificate")
                }
            }
        }
    }
}

/// Sets `caBundle` of every webhook of a configuration to `ca_pem`, when it differs.
pub async fn ensure_ca_bundle(client: &kube::Client, configuration: &str, ca_pem: &str) -> Result<(), kube::Error> {
    let api: Api<ValidatingWebhookConfiguration> = Api::all(client.clone());
    let Some(vwc) = api.get_opt(configuration).await? else { return Ok(()) };
    let want = ByteString(ca_pem.as_bytes().to_vec());
    let mut webhooks = vwc.webhooks.clone().unwrap_or_default();
    if webhooks.iter().all(|w| w.client_config.ca_bundle.as_ref() == Some(&want)) {
        return Ok(());
    }
    for w in &mut webhooks {
        w.client_config.ca_bundle = Some(want.clone());
    }
    // Replace with the resourceVersion we read: a concurrent edit makes this fail and the next
    // round retries on fresh data.
    let mut updated = vwc;
    updated.webhooks = Some(webhooks);
    api.replace(configuration, &PostParams::default(), &updated).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_serving_certificate_is_reissued_with_a_third_of_its_lifetime_left() {
        let lifetime = Duration::from_secs(90);
        let now = Timestamp::now();
        let at = |secs: i64| now.checked_add(SignedDuration::from_secs(secs)).ok();
        assert!(!reissue_due(at(31), lifetime, now), "more than a third left");
        assert!(reissue_due(at(30), lifetime, now), "a third left");
        assert!(reissue_due(at(-1), lifetime, now), "expired");
        assert!(reissue_due(None, lifetime, now), "unknown (a Secret from before rotation): reissued");
    }

    #[test]
    fn a_reissued_serving_certificate_keeps_the_ca_and_records_its_expiry() {
        let names = ["fence.ns.svc".to_string()];
        let first = SelfSigned::generate_for(&names, &[], Duration::from_secs(60)).unwrap();
        let before = Timestamp::now();
        let next = first.reissued(&names, &[], Duration::from_secs(3600)).unwrap();
        assert_eq!((&next.ca_cert, &next.ca_key), (&first.ca_cert, &first.ca_key));
        assert_ne!(next.serving, first.serving);
        let not_after = next.serving_not_after.unwrap();
        let expected = before.checked_add(SignedDuration::from_secs(3600)).unwrap();
        assert!(not_after.duration_until(expected).abs() <= SignedDuration::from_secs(2), "{not_after} ~ {expected}");
        let secret = next.to_secret("s", "ns");
        assert_eq!(SelfSigned::from_secret(&secret).unwrap(), next, "the expiry survives the Secret");
        // The reissued certificate loads with its key.
        next.server_config().unwrap();
    }

    /// A CA and a client certificate (EKU clientAuth) it signed: (CA PEM, client cert PEM, key PEM).
    fn client_identity() -> (String, String, String) {
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let mut ca = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        ca.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca.distinguished_name.push(rcgen::DnType::CommonName, "api server client CA");
        let ca_pem = ca.self_signed(&ca_key).unwrap().pem();
        let issuer = rcgen::Issuer::new(ca, ca_key);
        let key = rcgen::KeyPair::generate().unwrap();
        let mut leaf = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        leaf.distinguished_name.push(rcgen::DnType::CommonName, "kube-apiserver");
        leaf.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
        let cert = leaf.signed_by(&key, &issuer).unwrap();
        (ca_pem, cert.pem(), key.serialize_pem())
    }

    async fn handshake(
        addr: std::net::SocketAddr,
        server_ca: &str,
        client: Option<(&str, &str)>,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let mut roots = rustls::RootCertStore::empty();
        for cert in CertificateDer::pem_slice_iter(server_ca.as_bytes()) {
            roots.add(cert?)?;
        }
        let builder = rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
            .with_safe_default_protocol_versions()?
            .with_root_certificates(roots);
        let config = match client {
            Some((cert, key)) => builder.with_client_auth_cert(
                CertificateDer::pem_slice_iter(cert.as_bytes()).collect::<Result<Vec<_>, _>>()?,
                PrivateKeyDer::from_pem_slice(key.as_bytes())?,
            )?,
            None => builder.with_no_client_auth(),
        };
        let tcp = tokio::net::TcpStream::connect(addr).await?;
        let name = rustls::pki_types::ServerName::IpAddress(addr.ip().into());
        let mut tls = tokio_rustls::TlsConnector::from(Arc::new(config)).connect(name, tcp).await?;
        tls.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").await?;
        let mut out = Vec::new();
        tls.read_to_end(&mut out).await?;
        if String::from_utf8_lossy(&out).starts_with("HTTP/1.1 200") { Ok(()) } else { Err("no 200".into()) }
    }

    /// Finding 5's second half: with `--client-ca-file`, only a client presenting a certificate
    /// of that CA (the API server, configured to) completes a request; anyone else is refused in
    /// the handshake.
    #[tokio::test]
    async fn a_webhook_that_authenticates_its_callers_refuses_everyone_else() {
        let serving = SelfSigned::generate(&["localhost".into()], &[IpAddr::V4(std::net::Ipv4Addr::LOCALHOST)]).unwrap();
        let (client_ca, client_cert, client_key) = client_identity();
        let auth = ClientAuth::require(client_ca.as_bytes()).unwrap();
        let tls = RustlsConfig::from_config(serving.server_config_for(&auth).unwrap());
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let router = axum::Router::new().route("/healthz", axum::routing::get(|| async { "ok" }));
        let stop = tokio_util::sync::CancellationToken::new();
        let gate = crate::admission::http::bounds::ConnectionGate::new(Default::default(), Default::default());
        tokio::spawn(crate::admission::http::server::serve(listener, tls, router, gate, stop.clone().cancelled_owned()));
        assert!(handshake(addr, &serving.ca_cert, None).await.is_err(), "no client certificate: refused");
        let (other_ca, other_cert, other_key) = client_identity();
        drop(other_ca);
        assert!(handshake(addr, &serving.ca_cert, Some((&other_cert, &other_key))).await.is_err(), "another CA's certificate: refused");
        handshake(addr, &serving.ca_cert, Some((&client_cert, &client_key))).await.expect("the authenticated caller is served");
        assert!(ClientAuth::require(b"not a certificate").is_err());
        stop.cancel();
    }
}
