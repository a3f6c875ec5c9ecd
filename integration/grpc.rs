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

/// An h2c upstream that answers every call OK (`grpc-status: 0`, no
/// messages) after `delay`.
async fn slow_h2c_upstream(delay: Duration) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = hyper::service::service_fn(move |_req| async move {
                    tokio::time::sleep(delay).await;
                    let mut answer = http::Response::new(http_body_util::Empty::<bytes::Bytes>::new());
                    answer.headers_mut().insert("grpc-status", "0".parse().unwrap());
                    Ok::<_, std::convert::Infallible>(answer)
                });
                let _ = hyper::server::conn::http2::Builder::new(hyper_util::rt::TokioExecutor::new())
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn the_callers_deadline_and_a_dead_upstream_are_grpc_statuses() {
    let slow = slow_h2c_upstream(Duration::from_secs(3)).await;
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
    // The upstream's timeout as --upstream-timeout's is (from the 40th
    // attack: a call cut by its own deadline was neither counted nor
    // logged).
    assert!(
        tg.logged("upstream timed out (the call's grpc-timeout passed)"),
        "{}",
        tg.log_text()
    );
    assert_eq!(
        metric(&tg, "tollgate_upstream_responses_total{class=\"timeout\"}").await,
        1
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

/// A gRPC service of our own, for the streaming shapes the health service
/// lacks: messages are raw bytes (no protobuf), framed and ended by tonic
/// itself on both sides, so what crosses tollgate is real gRPC.
mod echo {
    use std::convert::Infallible;
    use std::net::SocketAddr;

    use bytes::{Buf, BufMut, Bytes};
    use tokio_stream::StreamExt;
    use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

    /// Messages as the bytes they are.
    #[derive(Clone, Copy, Default)]
    pub struct Raw;

    impl Codec for Raw {
        type Encode = Bytes;
        type Decode = Bytes;
        type Encoder = Raw;
        type Decoder = Raw;
        fn encoder(&mut self) -> Raw {
            Raw
        }
        fn decoder(&mut self) -> Raw {
            Raw
        }
    }

    impl Encoder for Raw {
        type Item = Bytes;
        type Error = tonic::Status;
        fn encode(&mut self, item: Bytes, dst: &mut EncodeBuf<'_>) -> Result<(), tonic::Status> {
            dst.put_slice(&item);
            Ok(())
        }
    }

    impl Decoder for Raw {
        type Item = Bytes;
        type Error = tonic::Status;
        fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Bytes>, tonic::Status> {
            Ok(Some(src.copy_to_bytes(src.remaining())))
        }
    }

    /// `/test.Echo/Many` answers the number it is sent with that many
    /// numbered messages; `/test.Echo/Sum` adds up the sizes of the messages
    /// it is sent; `/test.Echo/Chat` answers each message as it comes, then
    /// ends ABORTED with trailer metadata (a status after messages travels
    /// in the trailers). Anything else, over HTTP/1.1 or not gRPC, is
    /// answered with the HTTP version it came in.
    pub async fn start() -> SocketAddr {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(|req| async { Ok::<_, Infallible>(route(req).await) });
                    let _ = hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new())
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        addr
    }

    async fn route(req: http::Request<hyper::body::Incoming>) -> http::Response<tonic::body::Body> {
        let mut grpc = tonic::server::Grpc::new(Raw);
        match req.uri().path() {
            "/test.Echo/Many" => {
                let many = tower::service_fn(|req: tonic::Request<Bytes>| async move {
                    let n: usize = std::str::from_utf8(req.get_ref()).unwrap().parse().unwrap();
                    let messages = (0..n).map(|i| Ok(Bytes::from(format!("{i:06}:{}", "x".repeat(1000)))));
                    let mut answer = tonic::Response::new(tokio_stream::iter(messages));
                    answer.metadata_mut().insert("x-served-by", "echo".parse().unwrap());
                    Ok::<_, tonic::Status>(answer)
                });
                grpc.server_streaming(many, req).await
            }
            "/test.Echo/Sum" => {
                let sum = tower::service_fn(|req: tonic::Request<tonic::Streaming<Bytes>>| async move {
                    let mut messages = req.into_inner();
                    let (mut count, mut bytes) = (0usize, 0usize);
                    while let Some(m) = messages.next().await {
                        count += 1;
                        bytes += m?.len();
                    }
                    Ok::<_, tonic::Status>(tonic::Response::new(Bytes::from(format!("{count} {bytes}"))))
                });
                grpc.client_streaming(sum, req).await
            }
            "/test.Echo/Chat" => {
                let chat = tower::service_fn(|req: tonic::Request<tonic::Streaming<Bytes>>| async move {
                    let tag = req.metadata().get("x-tag").cloned();
                    let replies = req
                        .into_inner()
                        .map(|m| m.map(|m| [b"echo:".as_slice(), &m].concat().into()));
                    let mut end = tonic::Status::aborted("chat over");
                    end.metadata_mut().insert("x-final", "42".parse().unwrap());
                    let replies = replies.chain(tokio_stream::once(Err(end)));
                    let mut answer = tonic::Response::new(replies);
                    if let Some(tag) = tag {
                        answer.metadata_mut().insert("x-tag", tag);
                    }
                    Ok::<_, tonic::Status>(answer)
                });
                grpc.streaming(chat, req).await
            }
            _ => http::Response::new(tonic::body::Body::new(http_body_util::Full::new(Bytes::from(format!(
                "{:?}",
                req.version()
            ))))),
        }
    }

    /// A tonic client for the service at `addr` (tollgate's proxy).
    pub async fn client(addr: SocketAddr) -> tonic::client::Grpc<tonic::transport::Channel> {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        tonic::client::Grpc::new(channel)
    }

    /// A call to `/test.Echo/Sum` streaming `request`'s messages: "COUNT BYTES".
    pub async fn sum<S>(
        client: &mut tonic::client::Grpc<tonic::transport::Channel>,
        request: tonic::Request<S>,
    ) -> Result<Bytes, tonic::Status>
    where
        S: tokio_stream::Stream<Item = Bytes> + Send + 'static,
    {
        client.ready().await.unwrap();
        let path = http::uri::PathAndQuery::from_static("/test.Echo/Sum");
        client
            .client_streaming(request, path, Raw)
            .await
            .map(|r| r.into_inner())
    }
}

#[tokio::test]
async fn a_server_stream_of_many_messages_arrives_whole_with_its_metadata() {
    let server = echo::start().await;
    let tg = h2c_upstream(server, "domain: grpc\nrules: []\n");
    let mut client = echo::client(tg.addr).await;
    client.ready().await.unwrap();
    let answer = client
        .server_streaming(
            tonic::Request::new(bytes::Bytes::from_static(b"2000")),
            http::uri::PathAndQuery::from_static("/test.Echo/Many"),
            echo::Raw,
        )
        .await
        .unwrap();
    assert_eq!(answer.metadata().get("x-served-by").unwrap(), "echo");
    let mut stream = answer.into_inner();
    let mut i = 0;
    while let Some(message) = stream.message().await.unwrap() {
        assert!(
            message.starts_with(format!("{i:06}:").as_bytes()),
            "message {i} in order"
        );
        assert_eq!(message.len(), 1007);
        i += 1;
    }
    assert_eq!(i, 2000, "every message of the 2 MB stream");
    // OK arrived as a trailer after the messages.
    assert!(stream.trailers().await.unwrap().is_some());
}

#[tokio::test]
async fn a_client_stream_and_a_bidirectional_one_flow_message_by_message() {
    let server = echo::start().await;
    let tg = h2c_upstream(server, "domain: grpc\nrules: []\n");
    let mut client = echo::client(tg.addr).await;
    let uploads = tokio_stream::iter((0..300).map(|i| bytes::Bytes::from(vec![b'u'; 100 + i])));
    let sum = echo::sum(&mut client, tonic::Request::new(uploads)).await.unwrap();
    let bytes: usize = (0..300).map(|i| 100 + i).sum();
    assert_eq!(sum, format!("300 {bytes}").as_bytes());

    // Lockstep: each message is sent only once the previous one's echo is
    // back, so a proxy that held either direction's stream would stall here.
    let (tx, rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(1);
    client.ready().await.unwrap();
    let mut request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    request.metadata_mut().insert("x-tag", "round-trip".parse().unwrap());
    tx.send(bytes::Bytes::from_static(b"0")).await.unwrap();
    let answer = tokio::time::timeout(
        Duration::from_secs(5),
        client.streaming(
            request,
            http::uri::PathAndQuery::from_static("/test.Echo/Chat"),
            echo::Raw,
        ),
    )
    .await
    .expect("the first echo came before the request stream ended")
    .unwrap();
    assert_eq!(
        answer.metadata().get("x-tag").unwrap(),
        "round-trip",
        "request metadata reached the server"
    );
    let mut replies = answer.into_inner();
    for i in 0..50 {
        if i > 0 {
            tx.send(bytes::Bytes::from(i.to_string())).await.unwrap();
        }
        let reply = tokio::time::timeout(Duration::from_secs(5), replies.message())
            .await
            .unwrap_or_else(|_| panic!("echo {i} did not come while the stream was open"))
            .unwrap()
            .unwrap();
        assert_eq!(reply, format!("echo:{i}").as_bytes());
    }
    drop(tx);
    let end = replies.message().await.unwrap_err();
    assert_eq!(
        end.code(),
        tonic::Code::Aborted,
        "the status after the messages: {end:?}"
    );
    assert_eq!(end.message(), "chat over");
    assert_eq!(
        end.metadata().get("x-final").unwrap(),
        "42",
        "trailer metadata preserved"
    );
}

#[tokio::test]
async fn grpc_calls_go_over_http2_to_a_plain_http_upstream_and_other_requests_over_1_1() {
    // As NGINX's grpc_pass beside proxy_pass: one upstream address, gRPC
    // over h2c, the rest over HTTP/1.1.
    let server = echo::start().await;
    let tg = Tollgate::start_upstream_url("domain: grpc\nrules: []\n", &format!("http://{server}"), &[]);
    let mut grpc = echo::client(tg.addr).await;
    let one = tokio_stream::iter([bytes::Bytes::from_static(b"abc")]);
    let sum = echo::sum(&mut grpc, tonic::Request::new(one)).await.unwrap();
    assert_eq!(sum, "1 3".as_bytes());
    let plain = get(&client(), &tg.url("/version"), &[]).await;
    assert_eq!(plain.status, 200);
    assert_eq!(&plain.body[..], b"HTTP/1.1", "non-gRPC requests stay on HTTP/1.1");
    // The health service over the same plain upstream URL.
    let health = health_server().await;
    let tg = Tollgate::start_upstream_url(LIMITS, &format!("http://{health}"), &[]);
    let mut client = connect(&tg).await;
    assert_eq!(check(&mut client).await.unwrap().status, ServingStatus::Serving as i32);
}

#[tokio::test]
async fn a_refused_call_carries_retry_info_a_grpc_client_decodes() {
    use tonic_types::StatusExt;
    let server = health_server().await;
    let tg = h2c_upstream(server, LIMITS);
    let mut client = connect(&tg).await;
    for _ in 0..2 {
        check(&mut client).await.unwrap();
    }
    let refused = check(&mut client).await.unwrap_err();
    let retry = refused
        .get_details_retry_info()
        .expect("google.rpc.RetryInfo in grpc-status-details-bin");
    let delay = retry.retry_delay.expect("a retry delay");
    assert!(
        delay > Duration::from_secs(50) && delay <= Duration::from_secs(60),
        "the wait until the 60 s window frees a call: {delay:?}"
    );
}

#[tokio::test]
async fn a_service_wildcard_and_metadata_pick_the_counter() {
    let server = echo::start().await;
    let limits = "\
domain: grpc
rules:
  - name: echo_per_tenant
    match: { path: /test.Echo/* }
    by: [header:x-tenant]
    limits: [{ requests: 1, per: 60s }]
";
    let tg = h2c_upstream(server, limits);
    let mut client = echo::client(tg.addr).await;
    let mut sum = async |tenant: &str, method: &'static str| {
        client.ready().await.unwrap();
        let mut request = tonic::Request::new(tokio_stream::iter([bytes::Bytes::from_static(b"x")]));
        request.metadata_mut().insert("x-tenant", tenant.parse().unwrap());
        client
            .client_streaming(request, http::uri::PathAndQuery::from_static(method), echo::Raw)
            .await
            .map(|_| ())
            .map_err(|e| e.code())
    };
    assert_eq!(sum("a", "/test.Echo/Sum").await, Ok(()));
    // Another method of the same service shares the tenant's counter.
    assert_eq!(sum("a", "/test.Echo/Chat").await, Err(tonic::Code::ResourceExhausted));
    assert_eq!(
        sum("b", "/test.Echo/Sum").await,
        Ok(()),
        "another tenant, another counter"
    );
    // A service whose name merely starts the same is not matched.
    assert_ne!(
        sum("a", "/test.EchoMore/Sum").await,
        Err(tonic::Code::ResourceExhausted)
    );
}

#[tokio::test]
async fn callers_that_stop_reading_do_not_stall_everyone_elses_calls() {
    // All callers share the one upstream HTTP/2 connection of the one
    // worker thread; each staller leaves a 5 MB response unread.
    let server = echo::start().await;
    let tg = Tollgate::start_upstream_url(
        "domain: grpc\nrules: []\n",
        &format!("h2c://{server}"),
        &["--proxy-threads", "1"],
    );
    let mut stalled = Vec::new();
    for _ in 0..6 {
        let mut client = echo::client(tg.addr).await;
        client.ready().await.unwrap();
        let answer = client
            .server_streaming(
                tonic::Request::new(bytes::Bytes::from_static(b"5000")),
                http::uri::PathAndQuery::from_static("/test.Echo/Many"),
                echo::Raw,
            )
            .await
            .unwrap();
        stalled.push((client, answer.into_inner()));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let mut victim = echo::client(tg.addr).await;
    let one = tokio_stream::iter([bytes::Bytes::from_static(b"abc")]);
    let call = echo::sum(&mut victim, tonic::Request::new(one));
    let sum = tokio::time::timeout(Duration::from_secs(5), call)
        .await
        .expect("another caller's call went through while six stalled")
        .unwrap();
    assert_eq!(sum, "1 3".as_bytes());
    // The stalled ones still get every message once they read.
    let (_, mut first) = stalled.remove(0);
    let mut n = 0;
    while first.message().await.unwrap().is_some() {
        n += 1;
    }
    assert_eq!(n, 5000);
}

#[tokio::test]
async fn a_malformed_grpc_timeout_is_answered_here_and_never_reaches_the_upstream() {
    let server = echo::start().await;
    let tg = h2c_upstream(server, "domain: grpc\nrules: []\n");
    let answer = raw_call(tg.addr, Some("abc")).await;
    assert_eq!(answer.status(), 200);
    assert_eq!(
        answer.headers().get("grpc-status").unwrap(),
        "13",
        "INTERNAL, as a gRPC server answers it"
    );
    let message = answer.headers().get("grpc-message").unwrap().to_str().unwrap();
    assert!(message.contains("grpc-timeout"), "{message}");
}

#[tokio::test]
async fn the_callers_deadline_replaces_the_upstream_timeout_both_ways() {
    // --upstream-timeout is 1 s.
    let slow = slow_h2c_upstream(Duration::from_secs(2)).await;
    let tg = Tollgate::start_upstream_url(
        "domain: grpc\nrules: []\n",
        &format!("h2c://{slow}"),
        &["--upstream-timeout", "1s"],
    );
    let answer = raw_call(tg.addr, Some("10S")).await;
    assert_eq!(
        answer.headers().get("grpc-status").unwrap(),
        "0",
        "a 10 s deadline waits for the 2 s upstream"
    );
    let answer = raw_call(tg.addr, None).await;
    assert_eq!(
        answer.headers().get("grpc-status").unwrap(),
        "4",
        "without a deadline --upstream-timeout applies"
    );
}

#[tokio::test]
async fn tollgates_own_answers_are_grpc_statuses_whatever_the_content_types_case() {
    let server = echo::start().await;
    let limits = "\
domain: grpc
rules:
  - name: weighted
    match: { path: /test.Echo/* }
    cost: header:x-cost
    limits: [{ requests: 5, per: 60s }]
";
    let tg = h2c_upstream(server, limits);
    let mut client = echo::client(tg.addr).await;
    let mut request = tonic::Request::new(tokio_stream::iter([bytes::Bytes::from_static(b"x")]));
    request.metadata_mut().insert("x-cost", "abc".parse().unwrap());
    let bad = echo::sum(&mut client, request).await.unwrap_err();
    assert_eq!(bad.code(), tonic::Code::InvalidArgument, "{bad:?}");
    assert!(bad.message().contains("x-cost"), "{bad:?}");
    // Media types are case-insensitive: a refusal is still a gRPC one.
    let mut h2 = h2_sender(tg.addr).await;
    let call = |cost: &'static str| {
        http::Request::post(format!("http://{}/test.Echo/Sum", tg.addr))
            .header("content-type", "APPLICATION/GRPC")
            .header("te", "trailers")
            .header("x-cost", cost)
            .body(http_body_util::Full::new(bytes::Bytes::from_static(&[0, 0, 0, 0, 0])))
            .unwrap()
    };
    let refused = h2.send_request(call("6")).await.unwrap();
    assert_eq!(refused.status(), 200);
    assert_eq!(refused.headers().get("grpc-status").unwrap(), "8");
}

#[tokio::test]
async fn a_caller_that_pauses_its_upload_is_told_so_not_that_the_upstream_failed() {
    let server = echo::start().await;
    let tg = Tollgate::start_upstream_url(
        "domain: grpc\nrules: []\n",
        &format!("h2c://{server}"),
        &["--upstream-body-timeout", "1s"],
    );
    let mut client = echo::client(tg.addr).await;
    let (tx, rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(1);
    tx.send(bytes::Bytes::from_static(b"first")).await.unwrap();
    let pausing = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let _ = tx.send(bytes::Bytes::from_static(b"late")).await;
    });
    let uploads = tokio_stream::wrappers::ReceiverStream::new(rx);
    let failed = echo::sum(&mut client, tonic::Request::new(uploads)).await.unwrap_err();
    assert_ne!(
        failed.code(),
        tonic::Code::Unavailable,
        "not a retry-elsewhere: {failed:?}"
    );
    assert_eq!(failed.code(), tonic::Code::InvalidArgument, "{failed:?}");
    assert!(tg.logged("client request body failed"), "{}", tg.log_text());
    assert!(!tg.logged("upstream failed"), "{}", tg.log_text());
    pausing.abort();
}

#[tokio::test]
async fn two_grpc_timeouts_are_answered_here_like_a_malformed_one() {
    // tollgate would keep one deadline and the upstream the other.
    let tg = h2c_upstream(echo::start().await, "domain: grpc\nrules: []\n");
    let mut h2 = h2_sender(tg.addr).await;
    let req = http::Request::post(format!("http://{}/test.Echo/Sum", tg.addr))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .header("grpc-timeout", "100S")
        .header("grpc-timeout", "500m")
        .body(http_body_util::Full::new(bytes::Bytes::from_static(&[0, 0, 0, 0, 0])))
        .unwrap();
    let answer = h2.send_request(req).await.unwrap();
    assert_eq!(answer.headers().get("grpc-status").unwrap(), "13");
}
