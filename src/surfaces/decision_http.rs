//! The HTTP decision service (`--check-listen`): Envoy `ext_authz` (HTTP
//! mode) under `/ext_authz/<original path>` and NGINX `auth_request` at
//! `/auth_request`.
//!
//! Both only translate: they rebuild the original request's method, path,
//! host and client from what the proxy in front sends, decide with the same
//! rules as tollgate's own proxy, and answer in the status codes each proxy
//! understands. Neither forwards anything anywhere.

use crate::fields::Fields;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri};
use http_body_util::Full;

use crate::client_ip::TrustedProxies;
use crate::limits::RequestInfo;
use crate::render;
use crate::limiter::{Decision, Limiter, Verdict};
use crate::metrics::{self, Surface};
use crate::limits::SharedCatalog;

/// Path prefix Envoy's ext_authz `path_prefix` should be set to.
pub const EXT_AUTHZ_PREFIX: &str = "/ext_authz";
/// Path NGINX's `auth_request` subrequest should be proxied to.
pub const AUTH_REQUEST_PATH: &str = "/auth_request";
/// On an auth_request refusal: the status NGINX should send the client.
pub const TOLLGATE_STATUS: HeaderName = HeaderName::from_static("x-tollgate-status");
/// On an auth_request refusal: the body NGINX should send the client.
pub const TOLLGATE_BODY: HeaderName = HeaderName::from_static("x-tollgate-body");
/// Where the shipped NGINX snippet asks for the refusal to send a client.
pub const AUTH_REQUEST_REFUSAL_PATH: &str = "/auth_request/refusal";

/// Both HTTP decision surfaces, on one listener.
pub struct DecisionHttp {
    limiter: Arc<Limiter>,
    catalog: SharedCatalog,
    trusted: TrustedProxies,
}

impl DecisionHttp {
    /// Decision endpoints for these limits, believing forwarding headers from `trusted`.
    pub fn new(limiter: Arc<Limiter>, catalog: SharedCatalog, trusted: TrustedProxies) -> Self {
        DecisionHttp {
            limiter,
            catalog,
            trusted,
        }
    }

    /// Handles one decision request (its body is never read).
    pub async fn handle<B>(&self, req: Request<B>, peer: SocketAddr) -> Response<Full<Bytes>> {
        let path = req.uri().path();
        if path == AUTH_REQUEST_PATH {
            return self.auth_request(&req, peer).await;
        }
        if path == AUTH_REQUEST_REFUSAL_PATH {
            return self.render_refusal(&req);
        }
        if let Some(rest) = path.strip_prefix(EXT_AUTHZ_PREFIX)
            && (rest.is_empty() || rest.starts_with('/'))
        {
            return self.ext_authz(&req, peer).await;
        }
        reply(
            StatusCode::NOT_FOUND,
            "use /ext_authz/<path> (Envoy) or /auth_request (NGINX)",
        )
    }

    async fn decide(&self, surface: Surface, info: &RequestInfo<'_>) -> Result<Decision, String> {
        // The catalog guard is let go before the decision awaits.
        let hits = self.catalog.load().http_hits(info);
        match hits {
            Ok(hits) => {
                let decision = self.limiter.decide(&hits).await;
                metrics::get().request(surface, decision.verdict.into());
                Ok(decision)
            }
            Err(e) => {
                metrics::get().request(surface, metrics::Answer::BadRequest);
                Err(e.to_string())
            }
        }
    }

    /// Envoy ext_authz: 200 allows; any other non-5xx status is relayed to
    /// the client with the headers listed in `allowed_client_headers`; a
    /// 5xx refusal is sent as 403 with `X-Tollgate-Status`.
    async fn ext_authz<B>(&self, req: &Request<B>, peer: SocketAddr) -> Response<Full<Bytes>> {
        let original = &req.uri().path()[EXT_AUTHZ_PREFIX.len()..];
        let path = if original.is_empty() { "/" } else { original };
        // Envoy over HTTP/2 sends the original host as :authority.
        let host = match crate::limits::request_host(req.version(), req.uri(), Fields::Map(req.headers())) {
            Ok(host) => host,
            Err(e) => {
                metrics::get().request(Surface::ExtAuthz, metrics::Answer::BadRequest);
                return reply(StatusCode::BAD_REQUEST, &e.to_string());
            }
        };
        let info = RequestInfo {
            method: req.method(),
            path,
            query: req.uri().query(),
            host,
            headers: Fields::Map(req.headers()),
            client_ip: self.trusted.client_ip(peer.ip(), Fields::Map(req.headers())),
            // The TLS client here is Envoy or NGINX, not the caller.
            client_cert: None,
        };
        let decision = match self.decide(Surface::ExtAuthz, &info).await {
            Ok(d) => d,
            Err(e) => return reply(StatusCode::BAD_REQUEST, &e),
        };
        if decision.verdict.admits() {
            let mut r = reply(StatusCode::OK, "");
            render::admission_headers(&decision, r.headers_mut());
            return r;
        }
        // Envoy counts a 5xx from the authorization service as its failure
        // and, with failure_mode_allow, lets the request through: a
        // refusal whose status is 5xx (failing closed, or a rule's own
        // 503) goes out as 403, the real status in X-Tollgate-Status.
        let status = decision.status();
        if status.is_server_error() {
            return refusal(&decision, StatusCode::FORBIDDEN, Some(status));
        }
        refusal(&decision, status, None)
    }

    /// NGINX auth_request: 2xx allows; only 401 and 403 deny (anything else
    /// becomes a 500), so every refusal, tollgate's own 400s included, is a
    /// 403 carrying what the client should get: the status in
    /// `X-Tollgate-Status` and the body in `X-Tollgate-Body`, which the
    /// shipped snippet hands back to [`AUTH_REQUEST_REFUSAL_PATH`].
    async fn auth_request<B>(&self, req: &Request<B>, peer: SocketAddr) -> Response<Full<Bytes>> {
        let headers = req.headers();
        // Every request counts once (README's metrics table), refused here too.
        let bad = || metrics::get().request(Surface::AuthRequest, metrics::Answer::BadRequest);
        let uri: Uri = match headers.get("x-original-uri").map(|v| Uri::try_from(v.as_bytes())) {
            Some(Ok(uri)) => uri,
            Some(Err(_)) => {
                bad();
                return denied(StatusCode::BAD_REQUEST, "X-Original-URI is not a request target");
            }
            // The NGINX configuration is wrong: make that visible, not open.
            None => {
                bad();
                return denied(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "auth_request needs X-Original-URI (see conf/nginx/)",
                );
            }
        };
        let method = match headers
            .get("x-original-method")
            .map(|m| Method::from_bytes(m.as_bytes()))
        {
            Some(Ok(m)) => m,
            Some(Err(_)) => {
                bad();
                return denied(StatusCode::BAD_REQUEST, "X-Original-Method is not a method");
            }
            None => Method::GET,
        };
        let host = match crate::limits::request_host(req.version(), req.uri(), Fields::Map(headers)) {
            Ok(host) => host,
            Err(e) => {
                bad();
                return denied(StatusCode::BAD_REQUEST, &e.to_string());
            }
        };
        let info = RequestInfo {
            method: &method,
            path: uri.path(),
            query: uri.query(),
            host,
            headers: Fields::Map(headers),
            client_ip: self.trusted.client_ip(peer.ip(), Fields::Map(headers)),
            // The TLS client here is Envoy or NGINX, not the caller.
            client_cert: None,
        };
        let decision = match self.decide(Surface::AuthRequest, &info).await {
            Ok(d) => d,
            Err(e) => return denied(StatusCode::BAD_REQUEST, &e),
        };
        if decision.verdict.admits() {
            let mut r = reply(StatusCode::NO_CONTENT, "");
            render::admission_headers(&decision, r.headers_mut());
            return r;
        }
        let mut r = refusal(&decision, StatusCode::FORBIDDEN, Some(decision.status()));
        let body = render::refusal_body(&decision);
        if let Ok(v) = HeaderValue::from_bytes(&body) {
            r.headers_mut().insert(TOLLGATE_BODY, v);
        }
        r
    }

    /// The refusal an auth_request answer described, as the client gets it:
    /// the status and body from `X-Tollgate-Status` / `X-Tollgate-Body`, and
    /// `Retry-After` and the RateLimit headers from their `X-Tollgate-`
    /// copies (NGINX's `return` cannot take a status from a variable).
    fn render_refusal<B>(&self, req: &Request<B>) -> Response<Full<Bytes>> {
        let h = req.headers();
        let status = h
            .get(TOLLGATE_STATUS)
            .and_then(|v| v.to_str().ok())
            .and_then(|s| s.parse::<u16>().ok())
            .filter(|s| (400..=599).contains(s))
            .and_then(|s| StatusCode::from_u16(s).ok())
            .unwrap_or(StatusCode::TOO_MANY_REQUESTS);
        let body = h
            .get(TOLLGATE_BODY)
            .map(|v| Bytes::copy_from_slice(v.as_bytes()))
            .unwrap_or_else(|| Bytes::from_static(b"{\"error\":\"rate_limited\"}"));
        let mut r = Response::new(Full::new(body));
        *r.status_mut() = status;
        let out = r.headers_mut();
        out.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        for (from, to) in [
            ("x-tollgate-retry-after", header::RETRY_AFTER),
            ("x-tollgate-ratelimit", render::RATELIMIT),
            ("x-tollgate-ratelimit-policy", render::RATELIMIT_POLICY),
        ] {
            if let Some(v) = h.get(from).filter(|v| !v.is_empty()) {
                out.insert(to, v.clone());
            }
        }
        r
    }
}

/// An auth_request refusal of tollgate's own (a request it cannot decide):
/// a 403 NGINX accepts, with the status and body the client should get.
fn denied(status: StatusCode, message: &str) -> Response<Full<Bytes>> {
    let mut r = reply(StatusCode::FORBIDDEN, message);
    // The body the client should get is the one tollgate would send it.
    let body = render::error(status, message).into_body();
    let h = r.headers_mut();
    h.insert(TOLLGATE_STATUS, HeaderValue::from(status.as_u16()));
    if let Some(v) = std::str::from_utf8(&body).ok().and_then(|b| HeaderValue::from_str(b).ok()) {
        h.insert(TOLLGATE_BODY, v);
    }
    r
}

fn refusal(decision: &Decision, status: StatusCode, intended: Option<StatusCode>) -> Response<Full<Bytes>> {
    let mut r = render::refusal(decision, status).map(Full::new);
    if let Some(intended) = intended {
        r.headers_mut().insert(TOLLGATE_STATUS, HeaderValue::from(intended.as_u16()));
    }
    if decision.verdict == Verdict::FailedClosed {
        tracing::debug!("refused: counter store unavailable and a rule fails closed");
    }
    r
}

fn reply(status: StatusCode, message: &str) -> Response<Full<Bytes>> {
    render::error(status, message).map(Full::new)
}
