//! The proxy's way out: where admitted requests go (`--upstream`), the
//! keep-alive connections each worker thread holds to it ([`pool`]), and the
//! bodies in flight between client and upstream ([`body`]).

request_path! {
    pub mod body;
    pub mod pool;
}

pub use body::ClientBody;
pub use pool::{UpstreamBody, UpstreamPool};

use http::HeaderValue;
use http::uri::{Authority, Scheme, Uri};

/// Where requests go once admitted.
#[derive(Debug, Clone)]
pub struct Upstream {
    authority: Authority,
    /// `Host` for requests that came without one (HTTP/1.0).
    host: HeaderValue,
}

/// An `--upstream` that tollgate cannot forward to.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// Not an absolute `http://host:port` URL.
    #[error("upstream \"{0}\" must look like http://host:port")]
    Malformed(String),
    /// TLS to the upstream is not built in.
    #[error("upstream \"{0}\": only http:// upstreams are supported (terminate TLS beside tollgate)")]
    Scheme(String),
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

    /// Parses `http://host:port` (a trailing `/` is allowed, a path is not).
    pub fn parse(url: &str) -> Result<Self, UpstreamError> {
        let uri: Uri = url.parse().map_err(|_| UpstreamError::Malformed(url.into()))?;
        let (Some(scheme), Some(authority)) = (uri.scheme(), uri.authority()) else {
            return Err(UpstreamError::Malformed(url.into()));
        };
        if scheme != &Scheme::HTTP {
            return Err(UpstreamError::Scheme(url.into()));
        }
        if uri.path() != "/" && !uri.path().is_empty() {
            return Err(UpstreamError::Malformed(url.into()));
        }
        let host = HeaderValue::from_str(authority.as_str()).map_err(|_| UpstreamError::Malformed(url.into()))?;
        Ok(Upstream {
            authority: authority.clone(),
            host,
        })
    }
}
