//! tollgate: an HTTP rate-limit sidecar with exact sliding windows shared
//! through Redis streams.
//!
//! The binary (`main.rs`) only wires these together: `config` reads the
//! limits file, `reload` keeps it live, `descriptor` turns a request into counters, `limiter` decides
//! (with its memory and Redis stream stores), `headers` renders decisions,
//! `surfaces` speak each wire protocol, `serve` runs listeners and `admin`
//! reports health.

pub mod admin;
pub mod client_ip;
pub mod config;
pub mod descriptor;
pub mod headers;
pub mod limiter;
pub mod metrics;
pub mod path;
pub mod reload;
pub mod serve;
pub mod surfaces;
