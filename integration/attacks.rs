//! The hostile-request suite: each case is a way a caller tried to get
//! around a limit (or crash the process) against the real binary, and the
//! exact outcome tollgate must give. Found by testing as an attacker would;
//! kept so the same hole is never opened twice.

use std::time::Duration;

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use http::{Method, StatusCode};

use crate::common::*;
use crate::envoy::descriptor;

async fn ask(tg: &Tollgate, domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitResponse {
    let mut client = RateLimitServiceClient::connect(format!("http://{}", tg.grpc.unwrap()))
        .await
        .unwrap();
    client
        .should_rate_limit(RateLimitRequest {
            domain: domain.into(),
            descriptors,
            hits_addend: 0,
        })
        .await
        .expect("an RLS answer, never a reset stream")
        .into_inner()
}

fn shipped_rls_limits() -> String {
    std::fs::read_to_string(repo_file("conf/envoy/tollgate_rls.yaml")).unwrap()
}

/// Both stores: the embedded one and a real redis-server.
fn stores() -> Vec<(&'static str, Option<RedisServer>)> {
    vec![("memory", None), ("redis", Some(RedisServer::start()))]
}

fn store_args(redis: &Option<RedisServer>) -> Vec<String> {
    match redis {
        Some(r) => vec!["--redis".into(), r.url(), "--redis-timeout".into(), "1s".into()],
        None => Vec::new(),
    }
}

#[tokio::test]
async fn rls_cached_denial_keeps_one_status_per_descriptor_in_order() {
    // Envoy sends both descriptors of a /login request. Once the login
    // counter is refused (and cached), later calls must still be answered
    // OVER_LIMIT, one status per descriptor, in order: a panic here reset
    // the stream and Envoy (failure_mode_deny: false) let the request in.
    for (name, redis) in stores() {
        let args = store_args(&redis);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let up = TestUpstream::start().await;
        let tg = Tollgate::start(&shipped_rls_limits(), up.addr, &args);
        let ip = descriptor(&[("remote_address", "10.1.1.1")]);
        let login = descriptor(&[("remote_address", "10.1.1.1"), ("path", "/login")]);
        for call in 1..=12 {
            let r = ask(&tg, "edge_native", vec![ip.clone(), login.clone()]).await;
            assert_eq!(r.statuses.len(), 2, "{name} call {call}");
            if call <= 5 {
                assert_eq!(r.overall_code, Code::Ok as i32, "{name} call {call}");
                continue;
            }
            assert_eq!(r.overall_code, Code::OverLimit as i32, "{name} call {call}");
            assert_eq!(
                r.statuses[0].code,
                Code::Ok as i32,
                "{name} call {call}: per-ip has room"
            );
            assert_eq!(r.statuses[1].code, Code::OverLimit as i32, "{name} call {call}");
            let limit = r.statuses[1].current_limit.as_ref().unwrap();
            assert_eq!((limit.name.as_str(), limit.requests_per_unit), ("login", 5), "{name}");
            if let Some(other) = &r.statuses[0].current_limit {
                assert_eq!(other.name, "per-ip", "{name}: never another descriptor's limit");
            }
        }
        // The order of the descriptors is the order of the statuses.
        let r = ask(&tg, "edge_native", vec![login.clone(), ip.clone()]).await;
        assert_eq!(r.statuses[0].code, Code::OverLimit as i32, "{name}");
        assert_eq!(r.statuses[1].code, Code::Ok as i32, "{name}");
    }
}

#[tokio::test]
async fn rls_repeated_descriptor_is_charged_for_every_copy() {
    for (name, redis) in stores() {
        let args = store_args(&redis);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let up = TestUpstream::start().await;
        let limits = "domain: d\nrules:\n  - name: five\n    descriptor: [{ key: k }]\n    limits: [{ requests: 5, per: 60s }]\n";
        let tg = Tollgate::start(limits, up.addr, &args);
        let one = descriptor(&[("k", "v")]);
        let mut admitted = 0;
        for _ in 0..4 {
            let r = ask(&tg, "d", vec![one.clone(); 4]).await;
            if r.overall_code == Code::Ok as i32 {
                admitted += 4;
            }
        }
        assert_eq!(admitted, 4, "{name}: 4 + 4 > 5, so only the first request of four fits");
        let r = ask(&tg, "d", vec![one.clone()]).await;
        assert_eq!(r.overall_code, Code::Ok as i32, "{name}: the fifth unit");
        assert_eq!(r.statuses[0].limit_remaining, 0, "{name}");
        let r = ask(&tg, "d", vec![one.clone()]).await;
        assert_eq!(r.overall_code, Code::OverLimit as i32, "{name}: 5 admitted, never 8");
    }
}

#[tokio::test]
async fn rls_huge_hits_addend_never_fits_and_never_wraps() {
    for (name, redis) in stores() {
        let args = store_args(&redis);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let up = TestUpstream::start().await;
        let limits = "domain: d\nrules:\n  - name: ten\n    descriptor: [{ key: k }]\n    limits: [{ requests: 10, per: 60s }]\n";
        let tg = Tollgate::start(limits, up.addr, &args);
        for _ in 0..9 {
            let r = ask(&tg, "d", vec![descriptor(&[("k", "v")])]).await;
            assert_eq!(r.overall_code, Code::Ok as i32, "{name}");
        }
        let mut huge = descriptor(&[("k", "v")]);
        huge.hits_addend = Some(UInt64Value { value: u64::MAX - 8 });
        let r = ask(&tg, "d", vec![huge]).await;
        assert_eq!(r.overall_code, Code::OverLimit as i32, "{name}");
        assert!(
            r.statuses[0].duration_until_reset.is_none(),
            "{name}: a cost above the limit has no time at which it fits"
        );
        let r = ask(&tg, "d", vec![descriptor(&[("k", "v")])]).await;
        assert_eq!(r.overall_code, Code::Ok as i32, "{name}: the tenth unit");
        let r = ask(&tg, "d", vec![descriptor(&[("k", "v")])]).await;
        assert_eq!(r.overall_code, Code::OverLimit as i32, "{name}: full, not wrapped");
    }
}

#[tokio::test]
async fn cost_header_overflow_and_never_fitting_costs() {
    for (name, redis) in stores() {
        let args = store_args(&redis);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let up = TestUpstream::start().await;
        let limits =
            "domain: d\nrules:\n  - name: costly\n    limits: [{ requests: 10, per: 60s }]\n    cost: header:x-cost\n";
        let tg = Tollgate::start(limits, up.addr, &args);
        let c = client();
        for _ in 0..9 {
            assert_eq!(get(&c, &tg.url("/"), &[]).await.status, StatusCode::OK, "{name}");
        }
        let r = get(&c, &tg.url("/"), &[("x-cost", "18446744073709551607")]).await;
        assert_eq!(
            r.status,
            StatusCode::BAD_REQUEST,
            "{name}: a cost past the cap is refused"
        );
        let r = get(&c, &tg.url("/"), &[("x-cost", "11")]).await;
        assert_eq!(
            r.status,
            StatusCode::TOO_MANY_REQUESTS,
            "{name}: more than the whole limit"
        );
        assert_eq!(r.header("retry-after"), None, "{name}: waiting would not help");
        assert_eq!(r.json()["error"], "cost_exceeds_limit", "{name}");
        assert_eq!(get(&c, &tg.url("/"), &[]).await.status, StatusCode::OK, "{name}: tenth");
        for _ in 0..20 {
            assert_eq!(
                get(&c, &tg.url("/"), &[]).await.status,
                StatusCode::TOO_MANY_REQUESTS,
                "{name}: full"
            );
        }
        // The same header twice: which one would the upstream read? Neither.
        let r = send(
            &c,
            Method::GET,
            &tg.url("/"),
            &[("x-cost", "1"), ("x-cost", "1")],
            Vec::new(),
        )
        .await;
        assert_eq!(r.status, StatusCode::BAD_REQUEST, "{name}");
    }
}

#[tokio::test]
async fn a_refusal_is_not_cached_past_its_retry_time() {
    // 2 per 1s: the third request's retry time is measured from when the
    // store decided it; the cache must let the next request through on time.
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(
        "domain: d\nrules:\n  - name: r\n    limits: [{ requests: 2, per: 1s }]\n",
        up.addr,
        &[],
    );
    let c = client();
    let start = std::time::Instant::now();
    assert_eq!(get(&c, &tg.url("/"), &[]).await.status, StatusCode::OK);
    assert_eq!(get(&c, &tg.url("/"), &[]).await.status, StatusCode::OK);
    assert_eq!(get(&c, &tg.url("/"), &[]).await.status, StatusCode::TOO_MANY_REQUESTS);
    // Poll until admitted: it must happen within the window (plus scheduling).
    let admitted_after = loop {
        if get(&c, &tg.url("/"), &[]).await.status == StatusCode::OK {
            break start.elapsed();
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
        assert!(start.elapsed() < Duration::from_secs(3), "never admitted again");
    };
    assert!(admitted_after <= Duration::from_millis(1_300), "{admitted_after:?}");
}
