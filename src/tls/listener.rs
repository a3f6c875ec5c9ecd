//! The certificate a listener presents, swapped in place when its files
//! change, and the acceptor that presents it.
//!
//! The certificate and key are looked at every second (their metadata, the
//! symlinks followed): cert-manager and Kubernetes Secret volumes replace
//! them by a symlink swap, editors and `cp` in place, and each is seen. A
//! change is read once it has held still for a moment (a `cp` of the
//! certificate before the key would otherwise pair the new certificate with
//! the old key). A pair that cannot be used (unreadable, not PEM, a key that
//! is not the certificate's) leaves the last good one in force, logged once
//! per change and shown in `/config` until a good pair arrives. Handshakes
//! already under way finish with the certificate they began with.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use rustls::RootCertStore;
use rustls::server::{ClientHello, ResolvesServerCert, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use tokio_rustls::TlsAcceptor;

use super::{TlsError, provider, read_certs, read_key};

/// How often the files are looked at.
const CHECK_EVERY: Duration = Duration::from_secs(1);
/// How long a change must hold still before it is read.
const SETTLE: Duration = Duration::from_millis(200);

/// Whether clients present certificates.
#[derive(Debug, Clone)]
pub enum ClientAuth {
    /// No client certificates asked for.
    Off,
    /// Asked for; a client without one is served, one with a certificate
    /// the CA did not sign is refused.
    Optional(PathBuf),
    /// Every client must present a certificate the CA signed.
    Required(PathBuf),
}

/// What identifies a file's content (and whether it can be read) without
/// reading it: the change time moves with a chmod or chown too, so a pair
/// refused as unreadable is read again once its mode is fixed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct FileStamp {
    dev: u64,
    ino: u64,
    len: u64,
    modified: Option<SystemTime>,
    changed: (i64, i64),
}

fn stamp(path: &Path) -> Option<FileStamp> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    Some(FileStamp {
        dev: meta.dev(),
        ino: meta.ino(),
        len: meta.len(),
        modified: meta.modified().ok(),
        changed: (meta.ctime(), meta.ctime_nsec()),
    })
}

/// The certificate and key a listener serves, reloaded when they change.
pub struct LiveCert {
    cert_path: PathBuf,
    key_path: PathBuf,
    current: ArcSwap<CertifiedKey>,
    state: Mutex<CertState>,
}

struct CertState {
    /// The files as last read (whether or not that read was usable).
    seen: (Option<FileStamp>, Option<FileStamp>),
    /// When the pair in force was read (RFC 3339).
    loaded_at: String,
    /// Why the files on disk are not in force, while they are not.
    last_error: Option<String>,
    /// The served certificate's subject and end of validity, for `/config`.
    served: Served,
}

/// What `/config` says of the certificate in force.
#[derive(Debug, Clone, Default)]
struct Served {
    subject: String,
    not_after: String,
}

impl Served {
    /// Reads the leaf of `pair`, warning when it is out of its dates (it is
    /// served all the same: refusing it would take the listener down).
    fn of(pair: &CertifiedKey, path: &Path) -> Served {
        let Some((_, leaf)) = pair
            .cert
            .first()
            .and_then(|der| x509_parser::parse_x509_certificate(der).ok())
        else {
            return Served::default();
        };
        let validity = leaf.validity();
        if !validity.is_valid() {
            tracing::warn!(cert = %path.display(), not_before = %validity.not_before, not_after = %validity.not_after, "the TLS certificate in force is outside its validity dates; clients will refuse it");
        }
        let not_after = u64::try_from(validity.not_after.timestamp())
            .ok()
            .and_then(|secs| SystemTime::UNIX_EPOCH.checked_add(Duration::from_secs(secs)))
            .map(|t| humantime::format_rfc3339_seconds(t).to_string())
            .unwrap_or_else(|| validity.not_after.to_string());
        Served {
            subject: crate::tls::distinguished_name(leaf.subject()),
            not_after,
        }
    }
}

impl std::fmt::Debug for LiveCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LiveCert")
            .field("cert", &self.cert_path)
            .field("key", &self.key_path)
            .finish_non_exhaustive()
    }
}

impl LiveCert {
    /// Reads the pair; tollgate does not start on a bad one.
    pub fn load(cert_path: &Path, key_path: &Path) -> Result<Arc<Self>, TlsError> {
        let seen = (stamp(cert_path), stamp(key_path));
        let pair = read_pair(cert_path, key_path)?;
        let served = Served::of(&pair, cert_path);
        Ok(Arc::new(LiveCert {
            cert_path: cert_path.to_path_buf(),
            key_path: key_path.to_path_buf(),
            current: ArcSwap::from_pointee(pair),
            state: Mutex::new(CertState {
                seen,
                loaded_at: now(),
                last_error: None,
                served,
            }),
        }))
    }

    /// Reads the files again if they changed since last read (or, with
    /// `always`, as SIGHUP asks). Blocking (file reads): called on a
    /// blocking thread.
    pub fn check(&self, always: bool) {
        let now_seen = (stamp(&self.cert_path), stamp(&self.key_path));
        {
            let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
            if state.seen == now_seen && !always {
                return;
            }
        }
        // Let a change in progress finish (the certificate copied, the key not yet).
        std::thread::sleep(SETTLE);
        let settled = (stamp(&self.cert_path), stamp(&self.key_path));
        if settled != now_seen {
            return; // Still moving: the next look reads it.
        }
        let result = read_pair(&self.cert_path, &self.key_path);
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.seen = settled;
        match result {
            Ok(pair) => {
                state.served = Served::of(&pair, &self.cert_path);
                self.current.store(Arc::new(pair));
                state.loaded_at = now();
                state.last_error = None;
                crate::metrics::get().tls_reload(true);
                tracing::info!(cert = %self.cert_path.display(), key = %self.key_path.display(), "TLS certificate reloaded");
            }
            Err(e) => {
                let message = e.to_string();
                crate::metrics::get().tls_reload(false);
                tracing::error!(error = %message, "TLS certificate not reloaded; the last good one stays in force");
                state.last_error = Some(message);
            }
        }
    }

    /// Looks at the files every second until the last `Arc` of `self` is
    /// gone. Must be called inside a tokio runtime.
    pub fn watch(self: &Arc<Self>) {
        let weak: Weak<Self> = Arc::downgrade(self);
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(CHECK_EVERY);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tick.tick().await;
                let Some(live) = weak.upgrade() else { return };
                let _ = tokio::task::spawn_blocking(move || live.check(false)).await;
            }
        });
    }

    /// What `/config` shows of it.
    pub fn status(&self) -> serde_json::Value {
        let state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        serde_json::json!({
            "cert": self.cert_path.display().to_string(),
            "key": self.key_path.display().to_string(),
            "loaded_at": state.loaded_at,
            "subject": state.served.subject,
            "not_after": state.served.not_after,
            "last_error": state.last_error,
        })
    }
}

impl ResolvesServerCert for LiveCert {
    fn resolve(&self, _hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        Some(self.current.load_full())
    }
}

fn read_pair(cert_path: &Path, key_path: &Path) -> Result<CertifiedKey, TlsError> {
    let chain = read_certs(cert_path)?;
    let key = read_key(key_path)?;
    CertifiedKey::from_der(chain, key, &provider()).map_err(|e| TlsError::Pair {
        cert: cert_path.to_path_buf(),
        key: key_path.to_path_buf(),
        reason: e.to_string(),
    })
}

fn now() -> String {
    humantime::format_rfc3339_seconds(SystemTime::now()).to_string()
}

/// A listener's TLS: its certificate, client authentication and ALPN.
#[derive(Clone)]
pub struct TlsListener {
    acceptor: TlsAcceptor,
}

impl TlsListener {
    /// TLS 1.2 and 1.3 with `cert`, offering `alpn` in order of preference.
    pub fn new(cert: Arc<LiveCert>, client_auth: &ClientAuth, alpn: &[&[u8]]) -> Result<Self, TlsError> {
        let provider = provider();
        let builder = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13, &rustls::version::TLS12])?;
        let builder = match client_auth {
            ClientAuth::Off => builder.with_no_client_auth(),
            ClientAuth::Optional(ca) | ClientAuth::Required(ca) => {
                let mut roots = RootCertStore::empty();
                for cert in read_certs(ca)? {
                    roots.add(cert).map_err(|e| TlsError::Pem {
                        path: ca.clone(),
                        reason: format!("not a usable CA certificate: {e}"),
                    })?;
                }
                let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
                let verifier = match client_auth {
                    ClientAuth::Optional(_) => verifier.allow_unauthenticated(),
                    _ => verifier,
                };
                let verifier = verifier.build().map_err(|e| TlsError::Pem {
                    path: ca.clone(),
                    reason: e.to_string(),
                })?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder.with_cert_resolver(cert);
        config.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        Ok(TlsListener {
            acceptor: TlsAcceptor::from(Arc::new(config)),
        })
    }

    /// The acceptor for this listener's connections.
    pub fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_of_mode_alone_changes_the_stamp() {
        // A pair refused as unreadable must be read again once its mode is
        // fixed, though neither its content nor its mtime changed.
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let key = dir.path().join("k.pem");
        std::fs::write(&key, "x").unwrap();
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o000)).unwrap();
        let before = stamp(&key);
        std::thread::sleep(Duration::from_millis(20));
        std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o644)).unwrap();
        assert_ne!(stamp(&key), before);
    }
}
