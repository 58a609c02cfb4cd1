//! Certificates and keys for a local control plane: a CA, the API server's serving certificate
//! (valid for 127.0.0.1 and localhost only) and the service-account signing key.

use anyhow::{Context, Result};
use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, KeyPair, KeyUsagePurpose, SanType};
use std::net::{IpAddr, Ipv4Addr};

pub struct Pki {
    /// Client certificate (O=system:masters) the API server shows the kubelet for logs/exec.
    pub kubelet_client_cert_pem: String,
    pub kubelet_client_key_pem: String,
    pub ca_cert_pem: String,
    pub ca_key_pem: String,
    pub serving_cert_pem: String,
    pub serving_key_pem: String,
    pub sa_key_pem: String,
    pub sa_pub_pem: String,
}

/// `extra_ips`/`extra_dns`: more names for the serving certificate (node mode adds the
/// `kubernetes` Service's ClusterIP and DNS names, which in-cluster clients verify against).
pub fn generate(extra_ips: &[Ipv4Addr], extra_dns: &[&str]) -> Result<Pki> {
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
    for ip in extra_ips {
        serving.subject_alt_names.push(SanType::IpAddress(IpAddr::V4(*ip)));
    }
    for dns in extra_dns {
        serving.subject_alt_names.push(SanType::DnsName((*dns).try_into()?));
    }
    serving.distinguished_name.push(DnType::CommonName, "kube-apiserver");
    let serving_cert = serving.signed_by(&serving_key, &issuer).context("signing the serving certificate")?;

    let client_key = KeyPair::generate().context("generating the kubelet client key")?;
    let mut client = CertificateParams::new(Vec::<String>::new())?;
    client.distinguished_name.push(DnType::CommonName, "kube-apiserver-kubelet-client");
    client.distinguished_name.push(DnType::OrganizationName, "system:masters");
    client.extended_key_usages = vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth];
    let client_cert = client.signed_by(&client_key, &issuer).context("signing the kubelet client certificate")?;

    let sa_key = KeyPair::generate().context("generating the service-account key")?;
    Ok(Pki {
        kubelet_client_cert_pem: client_cert.pem(),
        kubelet_client_key_pem: client_key.serialize_pem(),
        ca_cert_pem: ca_cert.pem(),
        ca_key_pem: ca_key.serialize_pem(),
        serving_cert_pem: serving_cert.pem(),
        serving_key_pem: serving_key.serialize_pem(),
        sa_pub_pem: sa_key.public_key_pem(),
        sa_key_pem: sa_key.serialize_pem(),
    })
}
