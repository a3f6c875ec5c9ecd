//! The admin listener: liveness, readiness and the active limits.
//!
//! Bound to loopback by default; it answers small documents about tollgate's
//! own state and never echoes anything a caller sent. It answers only
//! requests addressed to an IP literal, `localhost` or a configured name (a
//! page a browser loaded from elsewhere cannot reach it through DNS
//! rebinding), can require a bearer token for everything but the probes, and
//! hides the values of header matches (they may be credentials).

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::Full;

use crate::limiter::Limiter;
use crate::reload::LiveFiles;

/// Who may ask the admin listener.
#[derive(Debug, Clone, Default)]
pub struct AdminAccess {
    /// Required as `Authorization: Bearer <token>` except on /healthz and /readyz.
    pub token: Option<String>,
    /// Host names accepted besides IP literals and `localhost`.
    pub hosts: Vec<String>,
}

/// State the admin endpoints report on.
pub struct Admin {
    limiter: Arc<Limiter>,
    catalog: Arc<LiveFiles>,
    access: AdminAccess,
    tls: Option<Arc<crate::tls::LiveCert>>,
}

impl Admin {
    /// Admin endpoints for this limiter and these limits files.
    pub fn new(limiter: Arc<Limiter>, catalog: Arc<LiveFiles>, access: AdminAccess) -> Self {
        Admin {
            limiter,
            catalog,
            access,
            tls: None,
        }
    }

    /// Shows the listeners' certificate (and its last reload error) in `/config`.
    #[must_use]
    pub fn with_tls(mut self, cert: Option<Arc<crate::tls::LiveCert>>) -> Self {
        self.tls = cert;
        self
    }

    /// Whether the request names a host this listener answers for.
    fn host_allowed<B>(&self, req: &Request<B>) -> bool {
        let host = req.uri().authority().map(|a| a.host().to_string()).or_else(|| {
            let h = req.headers().get(header::HOST)?.to_str().ok()?;
            Some(h.parse::<http::uri::Authority>().ok()?.host().to_string())
        });
        let Some(host) = host else {
            return true; // HTTP/1.0 without Host: a local tool, not a browser.
        };
        let bare = host.trim_start_matches('[').trim_end_matches(']');
        bare.parse::<std::net::IpAddr>().is_ok()
            || host.eq_ignore_ascii_case("localhost")
            || self.access.hosts.iter().any(|h| h.eq_ignore_ascii_case(&host))
    }

    /// Handles a request to the health listener of a pure rate limit
    /// service (the port envoyproxy/ratelimit's probes use): only
    /// `/healthcheck` and `/healthz`.
    pub async fn health_only<B>(req: Request<B>, _peer: SocketAddr) -> Response<Full<Bytes>> {
        match req.uri().path() {
            "/healthcheck" => healthcheck(),
            "/healthz" => text(StatusCode::OK, "ok\n"),
            _ => text(StatusCode::NOT_FOUND, "this port serves /healthcheck only\n"),
        }
    }

    /// Handles one admin request.
    pub async fn handle<B>(&self, req: Request<B>, _peer: SocketAddr) -> Response<Full<Bytes>> {
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n");
        }
        if !self.host_allowed(&req) {
            return text(
                StatusCode::MISDIRECTED_REQUEST,
                "unknown host; list it in --admin-hosts\n",
            );
        }
        let probe = matches!(req.uri().path(), "/healthz" | "/readyz" | "/healthcheck");
        if let Some(token) = &self.access.token
            && !probe
        {
            let given = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            if !given.is_some_and(|g| same_secret(g.as_bytes(), token.as_bytes())) {
                let mut r = text(
                    StatusCode::UNAUTHORIZED,
                    "Authorization: Bearer <--admin-token> required\n",
                );
                r.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                return r;
            }
        }
        match req.uri().path() {
            "/healthz" => text(StatusCode::OK, "ok\n"),
            "/healthcheck" => healthcheck(),
            "/readyz" => match self.limiter.ready().await {
                Ok(()) => text(StatusCode::OK, "ready\n"),
                Err(e) => text(
                    StatusCode::SERVICE_UNAVAILABLE,
                    &format!("counter store unavailable: {e}\n"),
                ),
            },
            "/metrics" => {
                let mut r = text(StatusCode::OK, &crate::metrics::get().render());
                r.headers_mut().insert(
                    header::CONTENT_TYPE,
                    HeaderValue::from_static("application/openmetrics-text; version=1.0.0; charset=utf-8"),
                );
                r
            }
            "/config" => {
                let files: Vec<serde_json::Value> = self
                    .catalog
                    .files()
                    .iter()
                    .map(|f| serde_json::json!({ "status": &*f.status(), "limits": &**f.active().load() }))
                    .collect();
                let refused: Vec<serde_json::Value> = self
                    .catalog
                    .refused()
                    .into_iter()
                    .map(|(file, error)| serde_json::json!({ "file": file, "last_error": error }))
                    .collect();
                let mut body = serde_json::json!({ "files": files, "refused": refused });
                if let (Some(cert), Some(map)) = (&self.tls, body.as_object_mut()) {
                    map.insert("tls".into(), cert.status());
                }
                let mut r = text(StatusCode::OK, &format!("{body:#}\n"));
                r.headers_mut()
                    .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
                r
            }
            _ => text(
                StatusCode::NOT_FOUND,
                "not found; try /healthz, /readyz, /metrics or /config\n",
            ),
        }
    }
}

/// Compares without stopping at the first differing byte, so the time taken
/// does not tell a caller how much of a guess was right.
fn same_secret(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// envoyproxy/ratelimit's liveness answer: the process serves. Counter
/// store trouble is `/readyz`'s business, so a Redis outage never gets the
/// pod restarted.
fn healthcheck() -> Response<Full<Bytes>> {
    text(StatusCode::OK, "OK")
}

fn text(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_owned())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}
