//! tollgate: an HTTP rate-limit sidecar with exact sliding windows shared
//! through Redis.
//!
//! A request's way, the same for every surface:
//!
//! 1. `surfaces` translate the wire format (the reverse proxy, ext_authz and
//!    auth_request in `surfaces::decision_http`, Envoy's RLS in
//!    `surfaces::envoy_rls`) into facts;
//! 2. `limits` resolves the facts against the catalog in force
//!    (`limits::Catalog`) into hits, one rule and one counter key each:
//!    `limits::http` for HTTP rules, `limits::descriptors` for Envoy
//!    descriptors, `limits::keys` for keys;
//! 3. `limiter` decides all hits together (denial cache first), through a
//!    `limiter::CounterStore`: `limiter::memory` in process, or
//!    `limiter::redis` (the `decide.lua` script, per-thread lanes, Cluster,
//!    Sentinel);
//! 4. the surface renders the decision through `render` (RateLimit headers,
//!    `Retry-After`, refusal bodies and tollgate's own error answers); the
//!    proxy forwards an admitted request through `upstream`.
//!
//! So a proxied request reads in `surfaces/proxy.rs`, `limits/http.rs` and
//! `limiter/mod.rs`; an RLS call in `surfaces/envoy_rls.rs`,
//! `limits/descriptors.rs` and `limiter/mod.rs`.
//!
//! Around it: `config` parses and validates limits files; `reload` keeps
//! them live (`reload::watch` decides when) and publishes a new
//! `limits::Catalog` on every change; `client_ip` and `path` normalise what
//! callers send; `alarm` is the timer a connection keeps; `fields` is a request's header fields as every reader
//! sees them (hyper's map, or the lines of a head our own server read); `serve` is the accept loop every listener shares and
//! `serve::connection` one client connection's life; `admin` and `metrics`
//! report (`activity` keeps the recent past the admin page shows); `heap` gives freed memory back. `settings` holds every flag; `server` starts what
//! they describe (worker threads in `server::workers`, listeners, the
//! store) and stops it; `main.rs` parses the flags and waits for signals.

// Only the proxy is held to reading fields through `serve::fields`
// (clippy.toml); it denies this again.
#![allow(clippy::disallowed_methods)]

/// Marks items (modules, impl blocks) a request passes through. They never
/// panic: clippy denies indexing that can fail, unwrap/expect and unchecked
/// arithmetic in them (outside tests). `config` marks its request-time
/// matching only.
macro_rules! request_path {
    ($($item:item)*) => {
        $(
            #[cfg_attr(
                not(test),
                deny(
                    clippy::indexing_slicing,
                    clippy::unwrap_used,
                    clippy::expect_used,
                    clippy::arithmetic_side_effects
                )
            )]
            $item
        )*
    };
}

pub mod admin;
pub mod config;
pub mod heap;
pub mod metrics;
pub mod ratelimit_env;
pub mod reload;
pub mod server;
pub mod settings;
pub mod surfaces;
pub mod upstream;

request_path! {
    pub mod activity;
    pub mod alarm;
    pub mod client_ip;
    pub mod fields;
    pub mod render;
    pub mod limiter;
    pub mod limits;
    pub mod log_every;
    pub mod path;
    pub mod serve;
    pub mod tls;
}
