//! What the gRPC load generators share: their HTTP/2 connections (a few,
//! as Envoy and gRPC client pools keep) and the one JSON line they print
//! (calls per second and the p50/p99 of their latencies), and the RLS call
//! they make.

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;

/// An RLS call in `domain` for one descriptor, `remote_address` = `value`
/// (what Envoy's `remote_address` action sends).
pub fn remote_address(domain: &str, value: String) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.to_string(),
        descriptors: vec![RateLimitDescriptor {
            entries: vec![Entry {
                key: "remote_address".into(),
                value,
            }],
            ..Default::default()
        }],
        hits_addend: 0,
    }
}

/// Up to four connections to `url` (`http://host:port`) for `concurrency` callers.
pub async fn channels(url: &str, concurrency: usize) -> Vec<tonic::transport::Channel> {
    let mut channels = Vec::new();
    for _ in 0..concurrency.clamp(1, 4) {
        let endpoint = tonic::transport::Channel::from_shared(url.to_string()).expect("address");
        channels.push(endpoint.connect().await.expect("connect"));
    }
    channels
}

/// `"calls_per_sec": …, "p50_ms": …, "p99_ms": …` of `latencies` over `seconds`.
pub fn rates(latencies: &mut [u64], seconds: u64) -> String {
    latencies.sort_unstable();
    let pct = |p: f64| {
        latencies
            .get(((latencies.len() as f64 * p) as usize).min(latencies.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0)
    };
    format!(
        "\"calls_per_sec\": {:.0}, \"p50_ms\": {:.3}, \"p99_ms\": {:.3}",
        latencies.len() as f64 / seconds as f64,
        pct(0.50) as f64 / 1000.0,
        pct(0.99) as f64 / 1000.0,
    )
}
