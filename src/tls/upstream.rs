//! How an `https://` upstream is verified: its certificate must chain to the
//! system's roots, or to `--upstream-ca` when given, and name the host in
//! `--upstream` (sent as SNI). There is no way to turn verification off: a
//! failure answers 502 and logs why.
//!
//! One exception to chaining, as curl and NGINX make it: a self-signed
//! certificate that `--upstream-ca` names itself is trusted as the
//! upstream's own even when it says it is a CA (`openssl req -x509` marks
//! every certificate so), once its name and dates check out.

use std::path::Path;
use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme};

use super::{TlsError, provider, read_certs};

/// webpki's verification, and the pinned self-signed certificates of
/// `--upstream-ca`.
#[derive(Debug)]
struct UpstreamVerifier {
    webpki: Arc<WebPkiServerVerifier>,
    pinned: Vec<CertificateDer<'static>>,
}

impl ServerCertVerifier for UpstreamVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .webpki
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(e) if ca_used_as_end_entity(&e) && self.pinned.iter().any(|p| p.as_ref() == end_entity.as_ref()) => {
                let parsed = rustls::server::ParsedCertificate::try_from(end_entity)?;
                rustls::client::verify_server_name(&parsed, server_name)?;
                within_dates(end_entity, now)?;
                Ok(ServerCertVerified::assertion())
            }
            // Self-signed and not named in --upstream-ca: say so plainly.
            Err(e) if ca_used_as_end_entity(&e) => Err(rustls::Error::InvalidCertificate(CertificateError::UnknownIssuer)),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

fn ca_used_as_end_entity(e: &rustls::Error) -> bool {
    matches!(e, rustls::Error::InvalidCertificate(CertificateError::Other(other))
        if other.0.downcast_ref::<webpki::Error>() == Some(&webpki::Error::CaUsedAsEndEntity))
}

/// Whether `now` is within the certificate's validity.
fn within_dates(cert: &CertificateDer<'_>, now: UnixTime) -> Result<(), rustls::Error> {
    let (_, parsed) =
        x509_parser::parse_x509_certificate(cert).map_err(|_| rustls::Error::InvalidCertificate(CertificateError::BadEncoding))?;
    let now = i64::try_from(now.as_secs())
        .ok()
        .and_then(|s| x509_parser::time::ASN1Time::from_timestamp(s).ok());
    match now {
        Some(now) if parsed.validity().is_valid_at(now) => Ok(()),
        _ => Err(rustls::Error::InvalidCertificate(CertificateError::Expired)),
    }
}

/// The client configuration for an `https://` upstream: roots from `ca`
/// (a PEM bundle) or else the system's, TLS 1.2 and 1.3, h2 or HTTP/1.1 as
/// the upstream picks by ALPN.
pub fn upstream_config(ca: Option<&Path>) -> Result<Arc<ClientConfig>, TlsError> {
    let mut roots = RootCertStore::empty();
    let mut pinned = Vec::new();
    match ca {
        Some(path) => {
            for cert in read_certs(path)? {
                roots.add(cert.clone()).map_err(|e| TlsError::Pem {
                    path: path.to_path_buf(),
                    reason: format!("not a usable CA certificate: {e}"),
                })?;
                pinned.push(cert);
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            for cert in found.certs {
                // One odd certificate in the system store is no reason to
                // trust none of the others.
                let _ = roots.add(cert);
            }
            if roots.is_empty() {
                return Err(TlsError::Pem {
                    path: "the system's certificate store".into(),
                    reason: "no root certificates found; give --upstream-ca".into(),
                });
            }
        }
    }
    let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider())
        .build()
        .map_err(|e| TlsError::Pem {
            path: ca.map_or_else(|| "the system's certificate store".into(), Path::to_path_buf),
            reason: e.to_string(),
        })?;
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(UpstreamVerifier { webpki, pinned }))
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
