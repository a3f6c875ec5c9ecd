//! TLS on both sides of the proxy, with rustls (the crypto provider the
//! project already ships for `rediss://`).
//!
//! [`listener`] holds the certificate a listener presents and swaps it when
//! its files change, as the limits file is; [`upstream`] verifies an
//! `https://` upstream. Both read PEM files here, with a size cap, so that a
//! path pointed at something huge (or at `/dev/zero`) is refused instead of
//! read whole.

pub mod listener;
pub mod stream;
pub mod upstream;

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

pub use listener::{ClientAuth, LiveCert, TlsListener};
pub use stream::ClientStream;
pub use upstream::upstream_config;

/// Marks a request that came over TLS (a request extension the proxy reads
/// for `X-Forwarded-Proto` and `by: [client_cert]`).
#[derive(Debug, Clone)]
pub struct ClientTls {
    /// The subject of the client's certificate, when it sent one and it
    /// verified, as RFC 4514 writes it (`CN=client-a,O=Acme`).
    pub subject: Option<Arc<str>>,
}

impl ClientTls {
    /// What a finished handshake tells of the client: the subject of the
    /// first certificate it presented (rustls hands out only verified ones).
    pub fn of(session: &rustls::ServerConnection) -> ClientTls {
        let subject = session
            .peer_certificates()
            .and_then(|chain| chain.first())
            .and_then(|leaf| x509_parser::parse_x509_certificate(leaf).ok())
            .map(|(_, cert)| Arc::from(distinguished_name(cert.subject())));
        ClientTls { subject }
    }
}

/// A name as RFC 4514 writes it (`CN=client-a,O=Acme`: the last RDN first,
/// `+` between the values of one RDN), every special character escaped, so
/// that two different names never read the same: a CN of `a, O=Acme` is
/// `CN=a\, O\=Acme`. A value that is no string is `#` and its hex.
pub fn distinguished_name(name: &x509_parser::x509::X509Name<'_>) -> String {
    let registry = x509_parser::objects::oid_registry();
    let mut out = String::new();
    let rdns: Vec<_> = name.iter_rdn().collect();
    for (i, rdn) in rdns.iter().rev().enumerate() {
        if i > 0 {
            out.push(',');
        }
        for (j, attr) in rdn.iter().enumerate() {
            if j > 0 {
                out.push('+');
            }
            match x509_parser::objects::oid2abbrev(attr.attr_type(), registry) {
                Ok(short) => out.push_str(short),
                Err(_) => out.push_str(&attr.attr_type().to_id_string()),
            }
            out.push('=');
            match attr.as_str() {
                Ok(value) => escape_value(value, &mut out),
                Err(_) => {
                    out.push('#');
                    for byte in attr.as_slice() {
                        out.push_str(&format!("{byte:02x}"));
                    }
                }
            }
        }
    }
    out
}

/// RFC 4514 section 2.4: `"+,;<>\` (and `=`) anywhere, `#` or a space
/// first, a space last, and NUL are escaped.
fn escape_value(value: &str, out: &mut String) {
    let last = value.chars().count().saturating_sub(1);
    for (i, c) in value.chars().enumerate() {
        match c {
            '"' | '+' | ',' | ';' | '<' | '>' | '\\' | '=' => {
                out.push('\\');
                out.push(c);
            }
            '#' if i == 0 => out.push_str("\\#"),
            ' ' if i == 0 || i == last => out.push_str("\\ "),
            '\0' => out.push_str("\\00"),
            _ => out.push(c),
        }
    }
}

/// Largest PEM file read: a chain of a dozen certificates is ~20 KB.
const MAX_PEM_BYTES: u64 = 1024 * 1024;

/// Why a certificate, key or CA file cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The file cannot be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },
    /// The file is larger than any PEM file tollgate expects.
    #[error("{path}: larger than {MAX_PEM_BYTES} bytes, not a PEM file")]
    TooLarge {
        /// The file.
        path: PathBuf,
    },
    /// The file holds no usable PEM of the kind wanted.
    #[error("{path}: {reason}")]
    Pem {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The certificate and key do not make a pair rustls can serve.
    #[error("{cert} and {key}: {reason}")]
    Pair {
        /// The certificate file.
        cert: PathBuf,
        /// The key file.
        key: PathBuf,
        /// What rustls said.
        reason: String,
    },
    /// rustls refused the configuration.
    #[error("TLS configuration: {0}")]
    Config(#[from] rustls::Error),
}

/// The crypto provider every TLS configuration of the process uses.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads at most [`MAX_PEM_BYTES`] of `path`, which must be a regular file:
/// opened without waiting (a named pipe would block the open until a writer
/// came, holding the reload and the shutdown), then refused unless regular.
fn read_capped(path: &Path) -> Result<Vec<u8>, TlsError> {
    use std::os::unix::fs::OpenOptionsExt;
    let read_error = |source| TlsError::Read {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(read_error)?;
    if !file.metadata().map_err(read_error)?.is_file() {
        return Err(read_error(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        )));
    }
    let mut bytes = Vec::new();
    file.take(MAX_PEM_BYTES.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(read_error)?;
    if u64::try_from(bytes.len()).unwrap_or(u64::MAX) > MAX_PEM_BYTES {
        return Err(TlsError::TooLarge {
            path: path.to_path_buf(),
        });
    }
    Ok(bytes)
}

/// Every certificate in a PEM file, in order (a chain: leaf first).
pub fn read_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read_capped(path)?;
    let pem_error = |reason: String| TlsError::Pem {
        path: path.to_path_buf(),
        reason,
    };
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem_error(format!("not a PEM certificate file: {e}")))?;
    if certs.is_empty() {
        return Err(pem_error("no CERTIFICATE block".into()));
    }
    Ok(certs)
}

/// The private key in a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = read_capped(path)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| TlsError::Pem {
        path: path.to_path_buf(),
        reason: format!("no usable private key: {e}"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_that_differ_never_read_the_same() {
        let mut out = String::new();
        escape_value("client-a, O=Acme", &mut out);
        assert_eq!(out, "client-a\\, O\\=Acme");
        let mut out = String::new();
        escape_value(" #a+b;c<d>e\"f\\ ", &mut out);
        assert_eq!(out, "\\ #a\\+b\\;c\\<d\\>e\\\"f\\\\\\ ");
        let mut out = String::new();
        escape_value("#x", &mut out);
        assert_eq!(out, "\\#x");
    }

    #[test]
    fn a_file_that_is_not_pem_says_so_and_a_huge_one_is_not_read_whole() {
        let dir = tempfile::tempdir().unwrap();
        let text = dir.path().join("notes.txt");
        std::fs::write(&text, "hello").unwrap();
        let e = read_certs(&text).unwrap_err().to_string();
        assert!(e.contains("no CERTIFICATE block"), "{e}");
        let e = read_key(&text).unwrap_err().to_string();
        assert!(e.contains("no usable private key"), "{e}");
        let e = read_certs(Path::new("/dev/zero")).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        let big = dir.path().join("big.pem");
        std::fs::File::create(&big).unwrap().set_len(2 * MAX_PEM_BYTES).unwrap();
        let e = read_certs(&big).unwrap_err().to_string();
        assert!(e.contains("larger than"), "{e}");
        let e = read_certs(&dir.path().join("missing.pem")).unwrap_err().to_string();
        assert!(e.contains("missing.pem"), "{e}");
        // A named pipe nobody writes to is refused at once, not waited on.
        let fifo = dir.path().join("fifo.pem");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = read_certs(&fifo).unwrap_err().to_string();
        assert!(e.contains("not a regular file"), "{e}");
        assert!(read_certs(dir.path()).unwrap_err().to_string().contains("not a regular file"));
    }
}
