//! gRPC APIs behind the proxy (issue 21, first part): a real tonic server
//! as the upstream over `h2c://`, a real tonic client through tollgate.
//! Calls and their trailers pass; a refused call is answered as gRPC
//! clients read a refusal, not as a bare 429 they would report as
//! `UNAVAILABLE` and retry.

use std::time::Duration;

use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::{HealthCheckRequest, HealthCheckResponse};

use crate::common::*;

/// A tonic health server on a free loopback port, serving "" and "api".
async fn health_server() -> std::net::SocketAddr {
    let addr: std::net::SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
    let (reporter, service) = tonic_health::server::health_reporter();
    reporter
        .set_service_status("api", tonic_health::ServingStatus::Serving)
        .await;
    tokio::spawn(async move {
        let _keep = reporter;
        tonic::transport::Server::builder()
            .add_service(service)
            .serve(addr)
            .await
            .unwrap();
    });
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(addr).await.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    addr
}

fn h2c_upstream(upstream: std::net::SocketAddr, limits: &str) -> Tollgate {
    Tollgate::start_upstream_url(limits, &format!("h2c://{upstream}"), &[])
}

/// A tonic client through tollgate's proxy (HTTP/2 prior knowledge).
async fn connect(tg: &Tollgate) -> HealthClient<tonic::transport::Channel> {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", tg.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    HealthClient::new(channel)
}

const LIMITS: &str = "\
domain: grpc
rules:
  - name: health_checks
    match: { path: /grpc.health.v1.Health/Check }
    limits: [{ requests: 2, per: 60s }]
";

async fn check(client: &mut HealthClient<tonic::transport::Channel>) -> Result<HealthCheckResponse, tonic::Status> {
    client
        .check(HealthCheckRequest { service: "api".into() })
        .await
        .map(|r| r.into_inner())
}

#[tokio::test]
async fn grpc_calls_pass_and_a_refused_one_is_resource_exhausted() {
    let server = health_server().await;
    let tg = h2c_upstream(server, LIMITS);
    let mut client = connect(&tg).await;
    for _ in 0..2 {
        // An OK call needs the upstream's grpc-status trailer to arrive.
        let answer = check(&mut client).await.unwrap();
        assert_eq!(answer.status, ServingStatus::Serving as i32);
    }
    let refused = check(&mut client).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::ResourceExhausted, "{refused:?}");
    assert!(refused.message().contains("health_checks"), "{refused:?}");
    assert!(refused.message().contains("retry after"), "{refused:?}");
    let retry_after = refused.metadata().get("retry-after").and_then(|v| v.to_str().ok());
    assert!(
        retry_after.is_some_and(|s| s.parse::<u64>().is_ok_and(|n| (1..=60).contains(&n))),
        "{refused:?}"
    );
    let mut watch = client
        .watch(HealthCheckRequest { service: "api".into() })
        .await
        .unwrap()
        .into_inner();
    // A server-streaming call: its first message arrives while the stream stays open.
    let first = tokio::time::timeout(Duration::from_secs(5), watch.message())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(first.unwrap().status, ServingStatus::Serving as i32);
}

#[tokio::test]
async fn an_upstream_grpc_error_passes_through_with_its_status() {
    let server = health_server().await;
    let tg = h2c_upstream(server, "domain: grpc\nrules: []\n");
    let mut client = connect(&tg).await;
    let unknown = client
        .check(HealthCheckRequest { service: "nope".into() })
        .await
        .unwrap_err();
    assert_eq!(
        unknown.code(),
        tonic::Code::NotFound,
        "the upstream's trailers reach the client: {unknown:?}"
    );
}

/// A gRPC call over h2c straight to `addr`: the response's head.
async fn raw_call(addr: std::net::SocketAddr, timeout: Option<&str>) -> http::Response<hyper::body::Incoming> {
    let mut h2 = h2_sender(addr).await;
    let mut req = http::Request::post(format!("http://{addr}/slow.Service/Call"))
        .header("content-type", "application/grpc")
        .header("te", "trailers");
    if let Some(t) = timeout {
        req = req.header("grpc-timeout", t);
    }
    let req = req
        .body(http_body_util::Full::new(bytes::Bytes::from_static(&[0, 0, 0, 0, 0])))
        .unwrap();
    h2.send_request(req).await.unwrap()
}

#[tokio::test]
async fn the_callers_deadline_and_a_dead_upstream_are_grpc_statuses() {
    // An h2c upstream that takes 3 s to answer anything.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let slow = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = hyper::service::service_fn(|_req| async {
                    tokio::time::sleep(Duration::from_secs(3)).await;
                    Ok::<_, std::convert::Infallible>(http::Response::new(http_body_util::Empty::<bytes::Bytes>::new()))
                });
                let _ = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    let tg = h2c_upstream(slow, "domain: grpc\nrules: []\n");
    let started = std::time::Instant::now();
    let answer = raw_call(tg.addr, Some("300m")).await;
    let took = started.elapsed();
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.headers().get("grpc-status").unwrap(), "4", "DEADLINE_EXCEEDED");
    assert!(
        took < Duration::from_millis(1500),
        "answered at the caller's deadline, not the upstream's pace: {took:?}"
    );
    // Nothing listens: UNAVAILABLE, which a gRPC client may retry elsewhere.
    let tg = h2c_upstream(
        format!("127.0.0.1:{}", free_port()).parse().unwrap(),
        "domain: grpc\nrules: []\n",
    );
    let answer = raw_call(tg.addr, None).await;
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.headers().get("grpc-status").unwrap(), "14", "UNAVAILABLE");
}

#[tokio::test]
async fn a_rule_can_answer_refused_calls_unavailable_as_envoy_does() {
    let server = health_server().await;
    let limits = "\
domain: grpc
rules:
  - name: envoy_like
    match: { path: /grpc.health.v1.Health/Check }
    grpc_status: 14
    limits: [{ requests: 1, per: 60s }]
";
    let tg = h2c_upstream(server, limits);
    let mut client = connect(&tg).await;
    check(&mut client).await.unwrap();
    let refused = check(&mut client).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    assert!(refused.message().contains("envoy_like"), "{refused:?}");
}
