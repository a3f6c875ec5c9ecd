//! End-to-end tests: the real binary over real sockets, against real
//! `redis-server` processes started here (see `common`).

// clippy.toml holds only tollgate's proxy to `serve::fields`.
#![allow(clippy::disallowed_methods)]

mod attacks;
mod build_script;
mod cli;
mod common;
mod connections;
mod envoy;
mod envoy_ratelimit;
mod grpc;
mod limiter;
mod model;
mod nginx;
mod operations;
mod operator_page;
mod parking;
mod plain_gets;
mod production;
mod proxy;
mod reload;
mod stores;
mod tls;
mod topologies;
