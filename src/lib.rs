//! tollgate: an HTTP rate-limit sidecar with exact sliding windows shared
//! through Redis streams.
//!
//! The binary (`main.rs`) only wires these together: `config` reads the
//! limits file, `reload` keeps it live, `descriptor` turns a request into counters, `limiter` decides
//! (with its memory and Redis stream stores), `headers` renders decisions,
//! `surfaces` speak each wire protocol, `serve` runs listeners and `admin`
//! reports health.

// The modules a request passes through never panic: clippy denies indexing
// that can fail, unwrap/expect and unchecked arithmetic in them (outside
// tests). `config` opts in for its request-time matching only.
pub mod admin;
#[cfg_attr(
    not(test),
    deny(
        clippy::indexing_slicing,
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::arithmetic_side_effects
    )
)]
pub mod client_ip;
pub mod config;
#[cfg_attr(
    not(test),
    deny(
        clippy::indexing_slicing,
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::arithmetic_side_effects
    )
)]
pub mod descriptor;
#[cfg_attr(
    not(test),
    deny(
        clippy::indexing_slicing,
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::arithmetic_side_effects
    )
)]
pub mod headers;
#[cfg_attr(
    not(test),
    deny(
        clippy::indexing_slicing,
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::arithmetic_side_effects
    )
)]
pub mod limiter;
pub mod metrics;
#[cfg_attr(
    not(test),
    deny(
        clippy::indexing_slicing,
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::arithmetic_side_effects
    )
)]
pub mod path;
pub mod reload;
#[cfg_attr(
    not(test),
    deny(
        clippy::indexing_slicing,
        clippy::unwrap_used,
        clippy::expect_used,
        clippy::arithmetic_side_effects
    )
)]
pub mod serve;
pub mod surfaces;
