//! The admin listener: liveness, readiness and the active limits.
//!
//! Bound to loopback by default; it answers small documents about tollgate's
//! own state and never echoes anything a caller sent.

use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::Full;
use hyper::body::Incoming;

use crate::limiter::Limiter;
use crate::reload::Catalog;

/// State the admin endpoints report on.
pub struct Admin {
    limiter: Arc<Limiter>,
    catalog: Arc<Catalog>,
}

impl Admin {
    /// Admin endpoints for this limiter and these limits files.
    pub fn new(limiter: Arc<Limiter>, catalog: Arc<Catalog>) -> Self {
        Admin { limiter, catalog }
    }

    /// Handles one admin request.
    pub async fn handle(&self, req: Request<Incoming>, _peer: SocketAddr) -> Response<Full<Bytes>> {
        if req.method() != Method::GET && req.method() != Method::HEAD {
            return text(StatusCode::METHOD_NOT_ALLOWED, "use GET\n");
        }
        match req.uri().path() {
            "/healthz" => text(StatusCode::OK, "ok\n"),
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
                let body = serde_json::json!({ "files": files });
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

fn text(status: StatusCode, body: &str) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body.to_owned())));
    *r.status_mut() = status;
    r.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    r
}
