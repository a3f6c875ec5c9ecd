//! Unary gRPC load for bench/grpc (issue 21): a tonic health server to put
//! behind tollgate, and N concurrent callers of `grpc.health.v1.Health/Check`
//! for a fixed time, one JSON line out (ghz's numbers, from our own client).
//!
//! `grpc_load serve PORT` | `grpc_load load ADDR CONCURRENCY SECONDS`

#[path = "load_common.rs"]
#[allow(dead_code)] // the RLS call is the RLS load generators'
mod load_common;

use std::time::{Duration, Instant};

use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_client::HealthClient;

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    match args.get(1).map(String::as_str) {
        Some("serve") if args.len() == 3 => serve(args[2].parse().expect("PORT")).await,
        Some("load") if args.len() == 5 => {
            load(
                &args[2],
                args[3].parse().expect("CONCURRENCY"),
                args[4].parse().expect("SECONDS"),
            )
            .await
        }
        _ => {
            eprintln!("usage: grpc_load serve PORT | grpc_load load ADDR CONCURRENCY SECONDS");
            std::process::exit(2);
        }
    }
}

async fn serve(port: u16) {
    let (reporter, service) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("api", tonic_health::ServingStatus::Serving)
        .await;
    tonic::transport::Server::builder()
        .add_service(service)
        .serve(([127, 0, 0, 1], port).into())
        .await
        .expect("serve");
}

async fn load(addr: &str, concurrency: usize, seconds: u64) {
    let channels = load_common::channels(&format!("http://{addr}"), concurrency).await;
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut tasks = Vec::new();
    for worker in 0..concurrency {
        let mut client = HealthClient::new(channels[worker % channels.len()].clone());
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::with_capacity(100_000);
            let mut errors = 0u64;
            while Instant::now() < deadline {
                let started = Instant::now();
                match client.check(HealthCheckRequest { service: "api".into() }).await {
                    Ok(_) => latencies.push(started.elapsed().as_micros() as u64),
                    Err(_) => errors += 1,
                }
            }
            (latencies, errors)
        }));
    }
    let (mut all, mut errors) = (Vec::new(), 0);
    for t in tasks {
        let (l, e) = t.await.unwrap();
        all.extend(l);
        errors += e;
    }
    println!("{{{}, \"errors\": {errors}}}", load_common::rates(&mut all, seconds));
}
