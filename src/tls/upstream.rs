//! How an `https://` upstream is verified: its certificate must chain to the
//! system's roots, or to `--upstream-ca` when given, and name the host in
//! `--upstream` (sent as SNI). There is no way to turn verification off: a
//! failure answers 502 and logs why.

use std::path::Path;
use std::sync::Arc;

use rustls::{ClientConfig, RootCertStore};

use super::{TlsError, provider, read_certs};

/// The client configuration for an `https://` upstream: roots from `ca`
/// (a PEM bundle) or else the system's, TLS 1.2 and 1.3, h2 or HTTP/1.1 as
/// the upstream picks by ALPN.
pub fn upstream_config(ca: Option<&Path>) -> Result<Arc<ClientConfig>, TlsError> {
    let mut roots = RootCertStore::empty();
    match ca {
        Some(path) => {
            for cert in read_certs(path)? {
                roots.add(cert).map_err(|e| TlsError::Pem {
                    path: path.to_path_buf(),
                    reason: format!("not a usable CA certificate: {e}"),
                })?;
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
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}
