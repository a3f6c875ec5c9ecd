//! tollgate: an HTTP rate-limit sidecar with exact sliding windows shared
//! through Redis streams.
//!
//! The binary (`main.rs`) only wires these together: `config` reads the
//! limits file, `reload` keeps it live, `limits` turns a request into counters, `limiter` decides
//! (with its memory and Redis stream stores), `headers` renders decisions,
//! `surfaces` speak each wire protocol, `serve` runs listeners and `admin`
//! reports health.

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
pub mod metrics;
pub mod ratelimit_env;
pub mod reload;
pub mod surfaces;

request_path! {
    pub mod client_ip;
    pub mod headers;
    pub mod limiter;
    pub mod limits;
    pub mod path;
    pub mod serve;
}
