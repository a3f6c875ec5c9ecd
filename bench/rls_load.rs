//! A small load generator for Envoy's RLS `ShouldRateLimit`, built on Envoy's
//! own protos: N concurrent callers for a fixed time, one JSON line out.
//!
//! `cargo run --release --example rls_load -- ADDR DOMAIN CONCURRENCY SECONDS KEYS`
//! KEYS = 1 sends one hot descriptor value; more spreads calls over that many.

#[path = "load_common.rs"]
mod load_common;

use std::time::{Duration, Instant};

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() != 6 {
        eprintln!("usage: rls_load ADDR DOMAIN CONCURRENCY SECONDS KEYS");
        std::process::exit(2);
    }
    let addr = format!("http://{}", args[1]);
    let domain = args[2].clone();
    let concurrency: usize = args[3].parse().expect("CONCURRENCY");
    let seconds: u64 = args[4].parse().expect("SECONDS");
    let keys: usize = args[5].parse().expect("KEYS");

    let channels = load_common::channels(&addr, concurrency).await;
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for worker in 0..concurrency {
        let mut client = RateLimitServiceClient::new(channels[worker % channels.len()].clone());
        let domain = domain.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(100_000);
            let (mut over, mut errors) = (0u64, 0u64);
            let mut n = worker;
            while Instant::now() < deadline {
                n = n.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let value = if keys <= 1 {
                    "hot".to_string()
                } else {
                    format!("k{}", (n >> 33) % keys)
                };
                let req = load_common::remote_address(&domain, value);
                let started = Instant::now();
                match client.should_rate_limit(req).await {
                    Ok(r) => {
                        latencies.push(started.elapsed().as_micros() as u64);
                        if r.into_inner().overall_code == 2 {
                            over += 1;
                        }
                    }
                    Err(_) => errors += 1,
                }
            }
            (latencies, over, errors)
        }));
    }
    let (mut all, mut over, mut errors) = (Vec::new(), 0, 0);
    for t in tasks {
        let (l, o, e) = t.await.unwrap();
        all.extend(l);
        over += o;
        errors += e;
    }
    println!(
        "{{{}, \"over_limit\": {over}, \"errors\": {errors}}}",
        load_common::rates(&mut all, seconds)
    );
}
