//! The admin listener: liveness, readiness, the active limits, metrics, and
//! the operator page (`/`) with the JSON behind it (`api`).
//!
//! Bound to loopback by default. It answers only
//! requests addressed to an IP literal, `localhost` or a configured name (a
//! page a browser loaded from elsewhere cannot reach it through DNS
//! rebinding), can require a bearer token for everything but the probes, and
//! hides the values of header matches (they may be credentials).

mod api;
pub mod client;

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Body;

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
    changes: Arc<api::Changes>,
    rls: api::RlsModes,
    /// When the store was last probed for the page (Redis only).
    probed: std::sync::Mutex<Option<std::time::Instant>>,
}

/// How often the page's polls probe the store: an idle instance would
/// otherwise show the state of its last decision, however old.
const PROBE_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// Longest wait for an explain question's body.
const EXPLAIN_BODY_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// The operator page and its script, served from the binary (no external
/// assets). The script is its own file so the page's policy can forbid
/// inline scripts: even a value that did become markup could not run.
const PAGE: &str = include_str!("page.html");
const PAGE_SCRIPT: &str = include_str!("page.js");

/// Largest explain question read.
const MAX_EXPLAIN_BYTES: usize = 64 * 1024;

impl Admin {
    /// Admin endpoints for this limiter and these limits files.
    pub fn new(limiter: Arc<Limiter>, catalog: Arc<LiveFiles>, access: AdminAccess) -> Self {
        let changes = Arc::new(api::Changes::default());
        changes.observe(&catalog);
        // Every reload, whether or not the page is open, so a rule shows as
        // changed by the last reload of its file.
        let (watched, seen) = (Arc::downgrade(&catalog), changes.clone());
        catalog.on_change(move || {
            if let Some(files) = watched.upgrade() {
                seen.observe(&files);
            }
        });
        Admin {
            limiter,
            catalog,
            access,
            tls: None,
            changes,
            rls: api::RlsModes::default(),
            probed: std::sync::Mutex::new(None),
        }
    }

    /// Probes a shared store at most every [`PROBE_EVERY`], so the page says
    /// up or down as `/readyz` would even when no decision was made lately.
    async fn probe_store(&self) {
        if self.limiter.store_address().is_none() {
            return;
        }
        {
            let mut probed = self.probed.lock().unwrap_or_else(|e| e.into_inner());
            if probed.is_some_and(|at| at.elapsed() < PROBE_EVERY) {
                return;
            }
            *probed = Some(std::time::Instant::now());
        }
        match self.limiter.ready().await {
            Ok(()) => crate::activity::get().store_reachable(),
            Err(e) => crate::activity::get().store_failed(&e),
        }
    }

    /// Answers RLS dry runs as the RLS does with `--rls-quota-mode` and
    /// `--rls-shadow-mode`.
    #[must_use]
    pub fn with_rls_modes(mut self, quota: bool, shadow: bool) -> Self {
        self.rls = api::RlsModes { quota, shadow };
        self
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
    pub async fn handle<B>(&self, req: Request<B>, _peer: SocketAddr) -> Response<Full<Bytes>>
    where
        B: Body,
        B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        let explaining = req.uri().path() == "/api/explain";
        let allowed = match explaining {
            true => req.method() == Method::POST,
            false => req.method() == Method::GET || req.method() == Method::HEAD,
        };
        if !allowed {
            let mut r = text(
                StatusCode::METHOD_NOT_ALLOWED,
                if explaining { "use POST\n" } else { "use GET\n" },
            );
            let allow = if explaining { "POST" } else { "GET, HEAD" };
            r.headers_mut().insert(header::ALLOW, HeaderValue::from_static(allow));
            return r;
        }
        if !self.host_allowed(&req) {
            return text(
                StatusCode::MISDIRECTED_REQUEST,
                "unknown host; list it in --admin-hosts\n",
            );
        }
        // The probes, and the page and its script: they hold no data (the
        // page asks for the token and sends it with every API call), and a
        // browser cannot send a bearer token to load them.
        let open = matches!(
            req.uri().path(),
            "/healthz" | "/readyz" | "/healthcheck" | "/" | "/page.js"
        );
        if let Some(token) = &self.access.token
            && !open
        {
            // Two Authorization headers are none: which one a proxy in
            // front checked cannot be known.
            let mut all = req.headers().get_all(header::AUTHORIZATION).iter();
            // The scheme is case-insensitive (RFC 9110 §11.1).
            let given = match (all.next(), all.next()) {
                (Some(v), None) => v
                    .to_str()
                    .ok()
                    .and_then(|v| v.split_once(' '))
                    .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
                    .map(|(_, token)| token.trim()),
                _ => None,
            };
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
        let query = api::RuleQuery::parse(req.uri().query());
        match req.uri().path() {
            // Nothing from elsewhere, no framing: caller-controlled text on
            // the page can never run or be dressed up.
            "/" => asset(PAGE, "text/html; charset=utf-8", Some(PAGE_POLICY)),
            "/page.js" => asset(PAGE_SCRIPT, "text/javascript; charset=utf-8", None),
            "/api/state" => {
                self.probe_store().await;
                json(&api::state(&self.limiter, &self.catalog, &self.changes, &query))
            }
            "/api/status" => {
                self.probe_store().await;
                json(&api::status(&self.limiter, &self.catalog))
            }
            "/api/rules" => {
                self.changes.observe(&self.catalog);
                let (rules, total, matched) = api::rules(&self.catalog, &self.changes, &query);
                json(&serde_json::json!({ "rules": rules, "rules_total": total, "rules_matched": matched }))
            }
            "/api/top-limited" => json(&serde_json::json!({ "top_limited": api::top_limited(&self.catalog) })),
            "/api/explain" => {
                // JSON only: a form on another site can post text/plain or
                // form data without asking, never application/json.
                let typed = req
                    .headers()
                    .get(header::CONTENT_TYPE)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|v| v.split(';').next())
                    .is_some_and(|essence| essence.trim().eq_ignore_ascii_case("application/json"));
                if !typed {
                    return error_json(
                        StatusCode::UNSUPPORTED_MEDIA_TYPE,
                        "send Content-Type: application/json",
                    );
                }
                let read = Limited::new(req.into_body(), MAX_EXPLAIN_BYTES).collect();
                let body = match tokio::time::timeout(EXPLAIN_BODY_TIMEOUT, read).await {
                    Ok(Ok(b)) => b.to_bytes(),
                    Err(_) => {
                        return error_json(
                            StatusCode::REQUEST_TIMEOUT,
                            &format!("the question did not arrive within {EXPLAIN_BODY_TIMEOUT:?}"),
                        );
                    }
                    Ok(Err(e)) => {
                        return error_json(
                            StatusCode::BAD_REQUEST,
                            &format!("cannot read the question (at most {MAX_EXPLAIN_BYTES} bytes): {e}"),
                        );
                    }
                };
                match api::explain(&self.limiter, &self.catalog, self.rls, &body).await {
                    Ok(answer) => json(&answer),
                    Err(e) => error_json(StatusCode::BAD_REQUEST, &e.to_string()),
                }
            }
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
                "not found; try /, /healthz, /readyz, /metrics, /config or /api/state\n",
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

/// The page's policy: its own script only, nothing from elsewhere.
const PAGE_POLICY: &str = "default-src 'none'; script-src 'self'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// A file of the page, never cached (it changes with the binary) nor sniffed.
fn asset(body: &str, kind: &'static str, policy: Option<&'static str>) -> Response<Full<Bytes>> {
    let mut r = text(StatusCode::OK, body);
    let headers = r.headers_mut();
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(kind));
    if let Some(policy) = policy {
        headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(policy));
    }
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

fn json(body: &serde_json::Value) -> Response<Full<Bytes>> {
    let mut r = text(StatusCode::OK, &format!("{body}\n"));
    r.headers_mut()
        .insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
    r.headers_mut()
        .insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

fn error_json(status: StatusCode, error: &str) -> Response<Full<Bytes>> {
    let mut r = json(&serde_json::json!({ "error": error }));
    *r.status_mut() = status;
    r
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

/// The longest `--admin-token`: NGINX's default bound on one request
/// field (`large_client_header_buffers`); past 64 KB, the admin listener's
/// own bound on a request's fields answers 431.
const MAX_TOKEN_BYTES: usize = 8 * 1024;

/// Why `--admin-token` could never be matched, if it could not: the
/// listener compares the field's value as ASCII text with its edges
/// trimmed, as HTTP reads it. An unset variable in a deploy template
/// (`TOLLGATE_ADMIN_TOKEN=`) would otherwise lock every admin answer
/// behind a 401, `/metrics` included, with nothing saying why.
pub fn token_problem(token: &str) -> Option<&'static str> {
    if token.is_empty() {
        Some("is empty: no client could send it")
    } else if token.starts_with([' ', '\t']) || token.ends_with([' ', '\t']) {
        Some("begins or ends with a space or tab, which HTTP drops from a field's value: no client could send it")
    } else if !token.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        Some(
            "holds a character other than visible ASCII and spaces: clients send such characters in encodings the listener does not read",
        )
    } else if token.len() > MAX_TOKEN_BYTES {
        Some("is longer than 8 KB, NGINX's default bound on one request field: a client behind one could not send it")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::{MAX_TOKEN_BYTES, token_problem};

    #[test]
    fn a_token_no_client_could_send_is_refused() {
        for bad in ["", " ", "\t", " a", "a ", "a\t", "ünï©ødé", "a\u{7f}b", "a\nb"] {
            assert!(token_problem(bad).is_some(), "{bad:?}");
        }
        assert!(token_problem(&"z".repeat(MAX_TOKEN_BYTES + 1)).is_some());
        for good in ["a", "a b", "a\"b,c;d=e", "s3cr3t-~_.+/=", &"z".repeat(MAX_TOKEN_BYTES)] {
            assert_eq!(token_problem(good), None, "{good:?}");
        }
    }
}
