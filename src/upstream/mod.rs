//! The proxy's way out: where admitted requests go (`--upstream`), the
//! keep-alive connections each worker thread holds to it ([`pool`]), the
//! bodies in flight between client and upstream ([`body`]), the HTTP/1.1
//! client of our own that carries body-less requests (`http1`), how
//! hyper's connections are kept from holding their thread (`fair`), and
//! how an HTTP/2 upstream's stream resets are read (`resets`).

/// Implements `AsyncWrite` for a reader's wrapper `$name<T>` (a field
/// `io: T`) by writing straight through: the wrappers here only watch or
/// pace what is read.
macro_rules! writes_through {
    ($name:ident) => {
        impl<T: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for $name<T> {
            fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, data: &[u8]) -> Poll<io::Result<usize>> {
                Pin::new(&mut self.io).poll_write(cx, data)
            }

            fn poll_write_vectored(
                mut self: Pin<&mut Self>,
                cx: &mut Context<'_>,
                bufs: &[io::IoSlice<'_>],
            ) -> Poll<io::Result<usize>> {
                Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
            }

            fn is_write_vectored(&self) -> bool {
                self.io.is_write_vectored()
            }

            fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                Pin::new(&mut self.io).poll_flush(cx)
            }

            fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
                Pin::new(&mut self.io).poll_shutdown(cx)
            }
        }
    };
}

request_path! {
    pub mod body;
    mod fair;
    mod http1;
    pub mod pool;
    mod resets;
}

pub use body::{BodyProgress, ClientBody};
pub(crate) use http1::has_token;
pub use http1::{Length, UpstreamFields};
pub use pool::{MAX_RESPONSE_HEAD, SendError, UpstreamBody, UpstreamPool};

use std::path::Path;

use http::HeaderValue;
use http::uri::{Authority, Scheme, Uri};
use rustls::pki_types::ServerName;
use tokio_rustls::TlsConnector;

use crate::tls::TlsError;

/// Where requests go once admitted.
#[derive(Debug, Clone)]
pub struct Upstream {
    authority: Authority,
    /// The port connections go to (the scheme's when the URL names none).
    port: u16,
    /// `Host` for requests that came without one (HTTP/1.0).
    host: HeaderValue,
    /// For an `https://` upstream: how its connections are made and verified.
    tls: Option<UpstreamTls>,
    /// `h2c://`: HTTP/2 with prior knowledge, in cleartext (gRPC servers).
    h2c: bool,
}

/// TLS to the upstream: the verifying connector and the name it checks.
#[derive(Clone)]
pub struct UpstreamTls {
    /// Verifies the upstream against the roots it was made with.
    pub connector: TlsConnector,
    /// The host of `--upstream`: sent as SNI, and what the certificate must name.
    pub name: ServerName<'static>,
}

impl std::fmt::Debug for UpstreamTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UpstreamTls")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// An `--upstream` that tollgate cannot forward to.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// Not an absolute `http://host:port` (or `https://`, `h2c://`) URL:
    /// the URL (quoted, a stray newline shown escaped) and why not.
    #[error("upstream {0:?}: {1}; it must look like http://host:port, https://host:port or h2c://host:port")]
    Malformed(String, &'static str),
    /// Neither `http`, `https` nor `h2c`.
    #[error("upstream \"{0}\": only http://, https:// and h2c:// upstreams are supported")]
    Scheme(String),
    /// The roots to verify an `https://` upstream with cannot be read.
    #[error("--upstream-ca: {0}")]
    Tls(#[from] TlsError),
}

impl Upstream {
    /// Where connections go.
    pub fn authority(&self) -> &Authority {
        &self.authority
    }

    /// `Host` for requests that came without one.
    pub fn host(&self) -> &HeaderValue {
        &self.host
    }

    /// The port connections go to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Whether connections speak HTTP/2 in cleartext from the start (`h2c://`).
    pub fn h2c(&self) -> bool {
        self.h2c
    }

    /// How connections are made and verified, for an `https://` upstream.
    pub fn tls(&self) -> Option<&UpstreamTls> {
        self.tls.as_ref()
    }

    /// Parses `http://host:port` or `https://host:port` (a trailing `/` is
    /// allowed, a path is not). An `https://` upstream is verified against
    /// `ca` (a PEM bundle), or the system's roots without it.
    pub fn parse(url: &str, ca: Option<&Path>) -> Result<Self, UpstreamError> {
        let malformed = |why| UpstreamError::Malformed(url.into(), why);
        // A fragment the URI parser would drop unsaid.
        if url.contains('#') {
            return Err(malformed("a fragment (#) is no part of an upstream"));
        }
        let uri: Uri = url.parse().map_err(|_| malformed("not a URL"))?;
        let (Some(scheme), Some(authority)) = (uri.scheme(), uri.authority()) else {
            return Err(malformed("no scheme or no host"));
        };
        let (https, h2c) = if scheme == &Scheme::HTTP {
            (false, false)
        } else if scheme == &Scheme::HTTPS {
            (true, false)
        } else if scheme.as_str().eq_ignore_ascii_case("h2c") {
            (false, true)
        } else {
            return Err(UpstreamError::Scheme(url.into()));
        };
        if uri.path() != "/" && !uri.path().is_empty() || uri.query().is_some() {
            return Err(malformed("a path or query is no part of an upstream"));
        }
        // A host as a request may name one: no userinfo (NGINX's proxy_pass
        // refuses it too), no list, nothing a resolver would read apart.
        if authority.as_str().contains('@') {
            return Err(malformed("userinfo (user@) is not sent upstream"));
        }
        if !crate::limits::http::valid_host(authority.as_str().as_bytes()) {
            return Err(malformed("not a host name or address and port"));
        }
        // `host:` and a port past 65535 would go to port 80 unsaid: past
        // the host, a port that reads as none.
        if authority.as_str().len() > authority.host().len() && authority.port_u16().is_none_or(|p| p == 0) {
            return Err(malformed("not a port from 1 to 65535"));
        }
        let host =
            HeaderValue::from_str(authority.as_str()).map_err(|_| malformed("not a host name or address and port"))?;
        let tls = match https {
            false => None,
            true => {
                // `[::1]` is how an authority writes an IPv6 address.
                let bare = authority.host().trim_start_matches('[').trim_end_matches(']');
                let name =
                    ServerName::try_from(bare.to_string()).map_err(|_| malformed("not a name TLS can verify"))?;
                Some(UpstreamTls {
                    connector: TlsConnector::from(crate::tls::upstream_config(ca)?),
                    name,
                })
            }
        };
        Ok(Upstream {
            port: authority.port_u16().unwrap_or(if https { 443 } else { 80 }),
            authority: authority.clone(),
            host,
            tls,
            h2c,
        })
    }
}
