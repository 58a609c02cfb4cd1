//! Certificates and keys for a local control plane: a CA, the API server's serving certificate
//! (valid for 127.0.0.1 and localhost only) and the service-account signing key.

use anyhow::{Context, Result};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose, SanType};
use std::net::{IpAddr, Ipv4Addr};

pub struct Pki {
    pub ca_cert_pem: String,
    pub ca_key_pem: String,
    pub serving_cert_pem: String,
    pub serving_key_pem: String,
    pub sa_key_pem: String,
    pub sa_pub_pem: String,
}

pub fn generate() -> Result<Pki> {
    let ca_key = KeyPair::generate().context("generating the CA key")?;
    let mut ca = CertificateParams::new(Vec::<String>::new())?;
    ca.distinguished_name.push(DnType::CommonName, "kube-fence local control plane CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let ca_cert = ca.self_signed(&ca_key).context("self-signing the CA")?;
    let issuer = rcgen::Issuer::new(ca, &ca_key);

    let serving_key = KeyPair::generate().context("generating the serving key")?;
    let mut serving = CertificateParams::new(vec!["localhost".to_string()])?;
    serving.subject_alt_names.push(SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)));
    serving.distinguished_name.push(DnType::CommonName, "kube-apiserver");
    let serving_cert = serving.signed_by(&serving_key, &issuer).context("signing the serving certificate")?;

    let sa_key = KeyPair::generate().context("generating the service-account key")?;
    Ok(Pki {
        ca_cert_pem: ca_cert.pem(),
        ca_key_pem: ca_key.serialize_pem(),
        serving_cert_pem: serving_cert.pem(),
        serving_key_pem: serving_key.serialize_pem(),
        sa_pub_pem: sa_key.public_key_pem(),
        sa_key_pem: sa_key.serialize_pem(),
    })
}
