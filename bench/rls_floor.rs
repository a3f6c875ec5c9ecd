//! The floor of an RLS call through tonic on this machine: a
//! `ShouldRateLimit` server that decides nothing (every descriptor OK),
//! served as tollgate serves gRPC (one current-thread runtime, tonic's
//! server, `TCP_NODELAY`). `bench/run` times it with `rls_load` beside
//! tollgate, so the share of an RLS call that is the gRPC leg itself, not
//! the decision, is measured rather than assumed.
//!
//! `cargo run --release --example rls_floor -- ADDR` (serves until killed)

use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::{
    RateLimitService, RateLimitServiceServer,
};
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use tokio_stream::StreamExt as _;
use tokio_stream::wrappers::TcpListenerStream;

/// Answers every call OK, one status per descriptor, deciding nothing.
struct Nothing;

#[tonic::async_trait]
impl RateLimitService for Nothing {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        let statuses = request
            .get_ref()
            .descriptors
            .iter()
            .map(|_| DescriptorStatus {
                code: Code::Ok as i32,
                ..Default::default()
            })
            .collect();
        Ok(tonic::Response::new(RateLimitResponse {
            overall_code: Code::Ok as i32,
            statuses,
            ..Default::default()
        }))
    }
}

fn main() {
    let addr = std::env::args().nth(1).expect("usage: rls_floor ADDR");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let listener = tokio::net::TcpListener::bind(&addr).await.expect("bind");
        let incoming = TcpListenerStream::new(listener).map(|s| {
            s.inspect(|s| {
                let _ = s.set_nodelay(true);
            })
        });
        tonic::transport::Server::builder()
            .add_service(RateLimitServiceServer::new(Nothing))
            .serve_with_incoming(incoming)
            .await
            .expect("serve");
    });
}
