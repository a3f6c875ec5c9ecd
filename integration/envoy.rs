//! Envoy's two ways of asking: the RLS gRPC service (driven by a client
//! generated from Envoy's protos) and ext_authz in HTTP mode (requests shaped
//! as Envoy sends them). The RLS cases are the examples documented for
//! envoyproxy/ratelimit, each file loaded unchanged.

use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{Entry, RateLimitOverride};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::UInt64Value;
use http::{Method, StatusCode};
use tonic::transport::Channel;

use crate::common::*;

/// envoyproxy/ratelimit's documented examples, one domain per file.
const EXAMPLES: &[(&str, &str)] = &[
    (
        "messaging.yaml",
        "domain: messaging
descriptors:
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit:
          unit: day
          requests_per_unit: 5
  - key: to_number
    rate_limit:
      unit: day
      requests_per_unit: 100
",
    ),
    (
        "per_ip.yaml",
        "domain: edge_proxy_per_ip
descriptors:
  - key: remote_address
    rate_limit:
      unit: second
      requests_per_unit: 10
  - key: remote_address
    value: 50.0.0.5
    rate_limit:
      unit: second
      requests_per_unit: 0
",
    ),
    (
        "depth.yaml",
        "domain: example4
descriptors:
  - key: key
    value: value
    rate_limit:
      requests_per_unit: 300
      unit: second
",
    ),
    (
        "unlimited.yaml",
        "domain: internal
descriptors:
  - key: ldap
    rate_limit:
      unlimited: true
  - key: azure
    rate_limit:
      unit: minute
      requests_per_unit: 100
",
    ),
    (
        "shadow.yaml",
        "domain: example6
descriptors:
  - key: service
    descriptors:
      - key: user
        value: user-a
        rate_limit:
          requests_per_unit: 10
          unit: second
        shadow_mode: true
      - key: user
        value: user-b
        rate_limit:
          requests_per_unit: 20
          unit: second
",
    ),
    (
        "replaces.yaml",
        "domain: example7
descriptors:
  - key: key_1
    value: value_1
    descriptors:
      - key: user
        value: bkthomps
        rate_limit:
          name: specific_limit
          requests_per_unit: 5
          unit: second
  - key: key_2
    value: value_2
    descriptors:
      - key: user
        value: bkthomps
        rate_limit:
          replaces:
            - name: specific_limit
          requests_per_unit: 10
          unit: second
",
    ),
    (
        "detailed.json",
        r#"{"domain": "example8", "descriptors": [
  {"key": "key1", "detailed_metric": true, "rate_limit": {"unit": "minute", "requests_per_unit": 10}},
  {"key": "key1", "value": "value1", "rate_limit": {"unit": "minute", "requests_per_unit": 20}}
]}"#,
    ),
    (
        "wildcard.yaml",
        "domain: example9
descriptors:
  - key: key1
    value: value*
    rate_limit:
      unit: minute
      requests_per_unit: 20
",
    ),
    (
        "native.yaml",
        "domain: native
rules:
  - name: login
    descriptor: [{ key: remote_address }, { key: path, value: /login }]
    limits:
      - { requests: 2, per: 90s }
      - { requests: 5, per: 1h }
  - name: upload
    descriptor: [{ key: upload }]
    limits:
      - { requests: 4, per: 60s }
      - { requests: 6, per: 1h }
",
    ),
];

struct Rls {
    tg: Tollgate,
    client: RateLimitServiceClient<Channel>,
    _dir: tempfile::TempDir,
}

async fn start_rls(extra: &[&str]) -> Rls {
    let dir = tempfile::tempdir().unwrap();
    let mut args: Vec<String> = Vec::new();
    for (name, text) in EXAMPLES {
        let path = dir.path().join(name);
        std::fs::write(&path, text).unwrap();
        args.push("--config".into());
        args.push(path.display().to_string());
    }
    for a in [
        "--upstream",
        "http://127.0.0.1:9",
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
    ] {
        args.push(a.into());
    }
    args.extend(["--grpc-listen".into(), "127.0.0.1:0".into()]);
    args.extend(extra.iter().map(|s| s.to_string()));
    let tg = Tollgate::spawn(&args, dir.path().join("messaging.yaml"), tempfile::tempdir().unwrap());
    let client = RateLimitServiceClient::connect(format!("http://{}", tg.grpc.unwrap()))
        .await
        .unwrap();
    Rls { tg, client, _dir: dir }
}

pub(crate) fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(k, v)| Entry {
                key: k.to_string(),
                value: v.to_string(),
            })
            .collect(),
        ..Default::default()
    }
}

fn request(domain: &str, descriptors: Vec<RateLimitDescriptor>) -> RateLimitRequest {
    RateLimitRequest {
        domain: domain.into(),
        descriptors,
        hits_addend: 0,
    }
}

impl Rls {
    async fn ask(&mut self, req: RateLimitRequest) -> RateLimitResponse {
        self.client.should_rate_limit(req).await.unwrap().into_inner()
    }

    /// How many identical requests pass before the first OVER_LIMIT (up to `max`).
    async fn admitted(&mut self, domain: &str, descriptors: &[&[(&str, &str)]], max: usize) -> usize {
        for n in 0..max {
            let r = self
                .ask(request(domain, descriptors.iter().map(|d| descriptor(d)).collect()))
                .await;
            if r.overall_code == Code::OverLimit as i32 {
                return n;
            }
            assert_eq!(r.overall_code, Code::Ok as i32, "never UNKNOWN");
        }
        max
    }
}

#[tokio::test]
async fn nested_descriptors_and_matching_order() {
    let mut rls = start_rls(&[]).await;
    let marketing: &[(&str, &str)] = &[("message_type", "marketing"), ("to_number", "2061111111")];
    assert_eq!(rls.admitted("messaging", &[marketing], 10).await, 5);
    // Another number has its own 5.
    assert_eq!(
        rls.admitted(
            "messaging",
            &[&[("message_type", "marketing"), ("to_number", "2062222222")]],
            10
        )
        .await,
        5
    );

    let r = rls.ask(request("messaging", vec![descriptor(marketing)])).await;
    let status = &r.statuses[0];
    assert_eq!(status.code, Code::OverLimit as i32);
    let limit = status.current_limit.as_ref().unwrap();
    assert_eq!((limit.requests_per_unit, limit.unit), (5, 4), "5 per DAY");
    // Unnamed in the file: no name, as envoyproxy/ratelimit answers.
    assert_eq!(limit.name, "");
    assert_eq!(status.limit_remaining, 0);
    let reset = status.duration_until_reset.as_ref().unwrap();
    // A whole day when the first request was in this very millisecond.
    assert!(reset.seconds > 86_300 && reset.seconds <= 86_400, "exact: {reset:?}");
    let headers: Vec<(String, String)> = r
        .response_headers_to_add
        .iter()
        .map(|h| (h.key.clone(), h.value.clone()))
        .collect();
    assert!(
        headers
            .iter()
            .any(|(k, v)| k == "retry-after" && v.parse::<u64>().unwrap() > 86_000),
        "{headers:?}"
    );
    assert!(
        headers
            .iter()
            .any(|(k, v)| k == "ratelimit-policy" && v.contains("q=5;w=86400")),
        "{headers:?}"
    );

    // Most specific match first: a blocked address gets 0, others 10 per second.
    assert_eq!(
        rls.admitted("edge_proxy_per_ip", &[&[("remote_address", "50.0.0.5")]], 5)
            .await,
        0
    );
    assert_eq!(
        rls.admitted("edge_proxy_per_ip", &[&[("remote_address", "50.0.0.1")]], 20)
            .await,
        10
    );
    // Depth must match the configuration exactly.
    let deep = rls
        .ask(request(
            "example4",
            vec![descriptor(&[("key", "value"), ("subkey", "subvalue")])],
        ))
        .await;
    assert_eq!(deep.overall_code, Code::Ok as i32);
    assert!(deep.statuses[0].current_limit.is_none());
    // Wildcards: each value counts apart.
    assert_eq!(rls.admitted("example9", &[&[("key1", "value1")]], 30).await, 20);
    assert_eq!(rls.admitted("example9", &[&[("key1", "value2")]], 30).await, 20);
    assert_eq!(
        rls.admitted("example9", &[&[("key1", "other")]], 30).await,
        30,
        "no match, no limit"
    );
    // detailed_metric only changes metrics: limits apply as usual.
    assert_eq!(rls.admitted("example8", &[&[("key1", "unspecified")]], 30).await, 10);
    assert_eq!(rls.admitted("example8", &[&[("key1", "value1")]], 30).await, 20);
}

#[tokio::test]
async fn all_descriptors_of_a_request_are_decided_together() {
    let mut rls = start_rls(&[]).await;
    let marketing = descriptor(&[("message_type", "marketing"), ("to_number", "2069999999")]);
    let number = descriptor(&[("to_number", "2069999999")]);
    for _ in 0..5 {
        let r = rls
            .ask(request("messaging", vec![marketing.clone(), number.clone()]))
            .await;
        assert_eq!(r.overall_code, Code::Ok as i32);
    }
    let r = rls
        .ask(request("messaging", vec![marketing.clone(), number.clone()]))
        .await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(r.statuses[0].code, Code::OverLimit as i32);
    assert_eq!(r.statuses[1].code, Code::Ok as i32);
    assert_eq!(
        r.statuses[1].limit_remaining, 95,
        "the number's own limit was not charged by the refusal"
    );
    let r = rls.ask(request("messaging", vec![number.clone()])).await;
    assert_eq!(r.statuses[0].limit_remaining, 94);
}

#[tokio::test]
async fn unlimited_shadow_and_replaces() {
    let mut rls = start_rls(&[]).await;
    let ldap = rls.ask(request("internal", vec![descriptor(&[("ldap", "x")])])).await;
    assert_eq!(ldap.statuses[0].code, Code::Ok as i32);
    assert_eq!(ldap.statuses[0].limit_remaining, u32::MAX);
    assert_eq!(rls.admitted("internal", &[&[("azure", "x")]], 120).await, 100);

    // Shadow mode: user-a is never limited, user-b is.
    assert_eq!(
        rls.admitted("example6", &[&[("service", "s"), ("user", "user-a")]], 15)
            .await,
        15
    );
    let r = rls
        .ask(request(
            "example6",
            vec![descriptor(&[("service", "s"), ("user", "user-a")])],
        ))
        .await;
    assert_eq!(r.statuses[0].code, Code::Ok as i32, "shadow never refuses");
    assert_eq!(
        r.statuses[0].limit_remaining, 0,
        "but reports the limit it would enforce"
    );
    assert_eq!(
        rls.admitted("example6", &[&[("service", "s"), ("user", "user-b")]], 25)
            .await,
        20
    );

    // Replaces: with both descriptors only the replacing 10/s applies, and
    // the replaced 5/s limit is not touched.
    let both: &[&[(&str, &str)]] = &[
        &[("key_1", "value_1"), ("user", "bkthomps")],
        &[("key_2", "value_2"), ("user", "bkthomps")],
    ];
    assert_eq!(rls.admitted("example7", both, 15).await, 10);
    assert_eq!(
        rls.admitted("example7", &[&[("key_1", "value_1"), ("user", "bkthomps")]], 15)
            .await,
        5
    );
}

#[tokio::test]
async fn hits_addend_overrides_unknown_domains_and_native_rules() {
    let mut rls = start_rls(&[]).await;
    let mut req = request("edge_proxy_per_ip", vec![descriptor(&[("remote_address", "10.1.1.1")])]);
    req.hits_addend = 4;
    assert_eq!(rls.ask(req.clone()).await.statuses[0].limit_remaining, 6);
    // A descriptor's own hits_addend wins; 0 there checks without charging.
    req.descriptors[0].hits_addend = Some(UInt64Value { value: 0 });
    assert_eq!(rls.ask(req.clone()).await.statuses[0].limit_remaining, 6);
    req.descriptors[0].hits_addend = Some(UInt64Value { value: 7 });
    assert_eq!(
        rls.ask(req.clone()).await.overall_code,
        Code::OverLimit as i32,
        "6 left, 7 asked"
    );

    // A descriptor's limit override replaces the configured limit.
    let mut custom = descriptor(&[("anything", "x")]);
    custom.limit = Some(RateLimitOverride {
        requests_per_unit: 3,
        unit: 2,
    });
    let custom_req = request("edge_proxy_per_ip", vec![custom]);
    for _ in 0..3 {
        assert_eq!(rls.ask(custom_req.clone()).await.overall_code, Code::Ok as i32);
    }
    let r = rls.ask(custom_req).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    assert_eq!(r.statuses[0].current_limit.as_ref().unwrap().unit, 2, "MINUTE");

    // Unknown domains answer OK, one status per descriptor.
    let r = rls
        .ask(request(
            "nobody",
            vec![descriptor(&[("a", "b")]), descriptor(&[("c", "d")])],
        ))
        .await;
    assert_eq!(r.overall_code, Code::Ok as i32);
    assert_eq!(r.statuses.len(), 2);

    // tollgate's own format: two windows on one descriptor, one of them 90s.
    let login: &[(&str, &str)] = &[("remote_address", "10.2.2.2"), ("path", "/login")];
    assert_eq!(rls.admitted("native", &[login], 5).await, 2);
    let r = rls.ask(request("native", vec![descriptor(login)])).await;
    let s = &r.statuses[0];
    assert_eq!(s.current_limit.as_ref().unwrap().requests_per_unit, 2);
    assert_eq!(s.current_limit.as_ref().unwrap().unit, 0, "90s is no Envoy unit");
    assert!(s.duration_until_reset.as_ref().unwrap().seconds >= 89);

    // Both windows refuse a cost of 3 after four of 1: the minute's frees
    // in a minute, but the request fits only once the hour's has room, and
    // that is the window and the time the status gives.
    let upload = || request("native", vec![descriptor(&[("upload", "u")])]);
    for _ in 0..4 {
        assert_eq!(rls.ask(upload()).await.overall_code, Code::Ok as i32);
    }
    let mut three = upload();
    three.hits_addend = 3;
    let r = rls.ask(three).await;
    assert_eq!(r.overall_code, Code::OverLimit as i32);
    let s = &r.statuses[0];
    let limit = s.current_limit.as_ref().unwrap();
    assert_eq!((limit.requests_per_unit, limit.unit), (6, 3), "6 per HOUR");
    let wait = s.duration_until_reset.as_ref().unwrap().seconds;
    assert!((3590..=3600).contains(&wait), "{wait}");
    let retry_after = r
        .response_headers_to_add
        .iter()
        .find(|h| h.key.eq_ignore_ascii_case("retry-after"));
    let retry_after = retry_after.map(|h| h.value.parse::<i64>().unwrap()).unwrap();
    assert!(
        retry_after == wait || retry_after == wait + 1,
        "{retry_after} against {wait}"
    );
}

#[tokio::test]
async fn rls_on_redis_and_grpc_health() {
    let redis = RedisServer::start();
    let mut rls = start_rls(&["--redis", &redis.url()]).await;
    assert_eq!(
        rls.admitted("edge_proxy_per_ip", &[&[("remote_address", "50.0.0.1")]], 20)
            .await,
        10
    );
    let keys = redis.cli(&["--scan", "--pattern", "tg:*"]).unwrap();
    assert!(
        keys.contains("edge_proxy_per_ip") && keys.contains("50.0.0.1"),
        "{keys}"
    );

    let channel = Channel::from_shared(format!("http://{}", rls.tg.grpc.unwrap()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    // "ratelimit" is the name envoyproxy/ratelimit's probes ask for.
    for service in ["", "envoy.service.ratelimit.v3.RateLimitService", "ratelimit"] {
        let r = health
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            r.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
            "{service:?}"
        );
    }
}

#[tokio::test]
async fn ext_authz_requests_shaped_as_envoy_sends_them() {
    let limits = "\
domain: it
rules:
  - name: login
    match: { methods: [POST], path: /login }
    by: [client_ip]
    limits: [{ requests: 2, per: 20s }]
";
    let app = TestUpstream::start().await;
    let tg = Tollgate::start(limits, app.addr, &["--trusted-proxies", "127.0.0.1/32"]);
    let url = format!("http://{}/ext_authz/login", tg.check.unwrap());
    let c = client();
    // Envoy: original method and path behind the prefix, Content-Length: 0,
    // only Host, Authorization and the allowed headers.
    let envoy_headers = |client_ip: &'static str| {
        vec![
            ("host", "api.example.com"),
            ("content-length", "0"),
            ("x-forwarded-for", client_ip),
        ]
    };
    for i in 0..2 {
        let a = send(&c, Method::POST, &url, &envoy_headers("203.0.113.5"), Vec::new()).await;
        assert_eq!(a.status, StatusCode::OK, "#{i}");
        assert_eq!(
            a.header("ratelimit"),
            Some(format!("\"login\";r={};t=20", 1 - i).as_str())
        );
    }
    let refused = send(&c, Method::POST, &url, &envoy_headers("203.0.113.5"), Vec::new()).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
    assert!(refused.header("retry-after").is_some());
    assert_eq!(refused.header("ratelimit-policy"), Some("\"login\";q=2;w=20"));
    assert_eq!(refused.json()["rule"], "login");
    // Per client, and only POST /login is counted.
    assert_eq!(
        send(&c, Method::POST, &url, &envoy_headers("203.0.113.6"), Vec::new())
            .await
            .status,
        StatusCode::OK
    );
    let plain_get = send(&c, Method::GET, &url, &envoy_headers("203.0.113.5"), Vec::new()).await;
    assert_eq!(plain_get.status, StatusCode::OK);
    assert!(plain_get.header("ratelimit").is_none(), "no rule matched");
    // The prefix alone is the root path; other paths are not ours.
    let root = format!("http://{}/ext_authz", tg.check.unwrap());
    assert_eq!(get(&c, &root, &[]).await.status, StatusCode::OK);
    let elsewhere = format!("http://{}/other", tg.check.unwrap());
    assert_eq!(get(&c, &elsewhere, &[]).await.status, StatusCode::NOT_FOUND);
}

#[tokio::test]
async fn auth_request_answers_need_the_original_uri() {
    let app = TestUpstream::start().await;
    let tg = Tollgate::start("domain: it\nrules: []\n", app.addr, &[]);
    let c = client();
    let url = format!("http://{}/auth_request", tg.check.unwrap());
    // A 403 NGINX accepts (anything else it turns into a 500 and the snippet
    // would fail open), carrying a 500 for the client: the NGINX setup is
    // wrong, and that must show.
    let a = get(&c, &url, &[]).await;
    assert_eq!(a.status, StatusCode::FORBIDDEN);
    assert_eq!(a.header("x-tollgate-status"), Some("500"));
    assert!(String::from_utf8_lossy(&a.body).contains("X-Original-URI"));
    let ok = get(&c, &url, &[("x-original-uri", "/x?y=1"), ("x-original-method", "POST")]).await;
    assert_eq!(ok.status, StatusCode::NO_CONTENT);
}

/// A descriptor entry whose value may be any bytes, as Envoy may send a
/// header value (prost's own types hold only UTF-8).
#[derive(Clone, PartialEq, prost::Message)]
struct RawEntry {
    #[prost(string, tag = "1")]
    key: String,
    #[prost(bytes = "vec", tag = "2")]
    value: Vec<u8>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RawDescriptor {
    #[prost(message, repeated, tag = "1")]
    entries: Vec<RawEntry>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct RawRequest {
    #[prost(string, tag = "1")]
    domain: String,
    #[prost(message, repeated, tag = "2")]
    descriptors: Vec<RawDescriptor>,
}

#[tokio::test]
async fn a_value_that_is_not_utf8_is_limited_and_leaves_nothing_unchecked() {
    let rls = start_rls(&[]).await;
    let channel = Channel::from_shared(format!("http://{}", rls.tg.grpc.unwrap()))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    let mut ask = async |descriptors: &[&[(&str, &[u8])]]| {
        let req = RawRequest {
            domain: "messaging".into(),
            descriptors: descriptors
                .iter()
                .map(|d| RawDescriptor {
                    entries: d
                        .iter()
                        .map(|(k, v)| RawEntry {
                            key: k.to_string(),
                            value: v.to_vec(),
                        })
                        .collect(),
                })
                .collect(),
        };
        grpc.ready().await.unwrap();
        let path = http::uri::PathAndQuery::from_static("/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit");
        let codec = tonic_prost::ProstCodec::<RawRequest, RateLimitResponse>::default();
        let answer = grpc.unary(tonic::Request::new(req), path, codec).await;
        answer.map(|r| r.into_inner().overall_code)
    };
    let marketing = |to: &'static [u8]| -> [(&'static str, &'static [u8]); 2] {
        [("message_type", b"marketing"), ("to_number", to)]
    };
    // A caller over its limit (5 a day)...
    for _ in 0..5 {
        assert_eq!(ask(&[&marketing(b"+15550001")]).await.unwrap(), Code::Ok as i32);
    }
    assert_eq!(ask(&[&marketing(b"+15550001")]).await.unwrap(), Code::OverLimit as i32);
    // ...stays over it with a descriptor beside whose value is not UTF-8.
    // (Before, prost refused the whole call, INTERNAL, and Envoy, failing
    // open by default, let the request through unchecked.)
    let with_bytes = ask(&[&marketing(b"+15550001"), &[("to_number", b"caf\x80")]]).await;
    assert_eq!(with_bytes.unwrap(), Code::OverLimit as i32);
    // Such a value has a counter of its own, as any value has.
    for _ in 0..5 {
        assert_eq!(ask(&[&marketing(b"\x80\x81")]).await.unwrap(), Code::Ok as i32);
    }
    assert_eq!(ask(&[&marketing(b"\x80\x81")]).await.unwrap(), Code::OverLimit as i32);
    assert_eq!(ask(&[&marketing(b"\x80\x82")]).await.unwrap(), Code::Ok as i32);
}

/// The remaining count a `RateLimit` field tells (`"rule";r=N;t=T`).
fn told_remaining(field: &str) -> u64 {
    field
        .split(";r=")
        .nth(1)
        .and_then(|r| r.split(';').next())
        .and_then(|r| r.parse().ok())
        .unwrap_or_else(|| panic!("{field}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_hot_keys_requests_at_once_are_each_told_their_own_remaining_on_every_surface() {
    // Requests for one counter that wait together go to Redis as one run,
    // and each answer is spelled out from the run's: exactly the limit is
    // admitted, and each admitted request is told a remaining count of its
    // own (a run told as its first decision would repeat one), on every
    // surface.
    let redis = RedisServer::start();
    let rls = start_rls(&["--redis", &redis.url()]).await;
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..150 {
        let mut client = rls.client.clone();
        let req = request("messaging", vec![descriptor(&[("to_number", "555")])]);
        calls.spawn(async move { client.should_rate_limit(req).await.unwrap().into_inner() });
    }
    let (mut remaining, mut over) = (Vec::new(), 0);
    for r in calls.join_all().await {
        if r.overall_code == Code::Ok as i32 {
            remaining.push(u64::from(r.statuses[0].limit_remaining));
        } else {
            assert_eq!(r.overall_code, Code::OverLimit as i32);
            over += 1;
        }
    }
    remaining.sort_unstable();
    assert_eq!(remaining, (0..100).collect::<Vec<u64>>(), "RLS");
    assert_eq!(over, 50, "RLS");

    let app = TestUpstream::start().await;
    let limits =
        "domain: it\nrules:\n  - name: hot\n    by: [header:x-key]\n    limits: [{ requests: 40, per: 60s }]\n";
    let tg = Tollgate::start(limits, app.addr, &["--redis", &redis.url()]);
    let check = tg.check.unwrap();
    let surfaces = [
        ("proxy", tg.url("/"), None),
        ("ext_authz", format!("http://{check}/ext_authz/x"), None),
        ("auth_request", format!("http://{check}/auth_request"), Some("/x")),
    ];
    let c = client();
    for (surface, url, original_uri) in surfaces {
        let mut waiting = tokio::task::JoinSet::new();
        for _ in 0..100 {
            let (c, url) = (c.clone(), url.clone());
            waiting.spawn(async move {
                let mut headers = vec![("x-key", surface)];
                if let Some(uri) = original_uri {
                    headers.push(("x-original-uri", uri));
                }
                let a = get(&c, &url, &headers).await;
                (a.status, a.header("ratelimit").map(told_remaining))
            });
        }
        let (mut remaining, mut refused) = (Vec::new(), 0);
        for (status, told) in waiting.join_all().await {
            match status.is_success() {
                true => remaining.push(told.unwrap_or_else(|| panic!("{surface}: no RateLimit field"))),
                false => refused += 1,
            }
        }
        remaining.sort_unstable();
        assert_eq!(remaining, (0..40).collect::<Vec<u64>>(), "{surface}");
        assert_eq!(refused, 60, "{surface}");
    }
}

/// The three ways of asking that forward nothing.
#[derive(Clone, Copy, Debug)]
enum Asking {
    ExtAuthz,
    AuthRequest,
    Rls,
}

/// A rules file `surface` reaches with what `passes` asks: HTTP rules on
/// `/p` for ext_authz and auth_request; for RLS, where one descriptor meets
/// one rule, descriptor rules on `p0` and `p1`.
fn rules_for(surface: Asking, rules: &[(&str, &str)]) -> String {
    let mut text = String::from("domain: it\nrules:\n");
    for (i, (name, body)) in rules.iter().enumerate() {
        let reach = match surface {
            Asking::Rls => format!("descriptor: [{{ key: p{i} }}]"),
            Asking::ExtAuthz | Asking::AuthRequest => "match: { path: /p }".into(),
        };
        text += &format!("  - name: {name}\n    {reach}\n{body}");
    }
    text
}

/// Asks once on `surface` for `/p` (or descriptors `p0` and `p1`): whether
/// the request may pass.
async fn passes(surface: Asking, tg: &Tollgate, c: &TestClient) -> bool {
    let check = tg.check.unwrap();
    match surface {
        Asking::ExtAuthz => {
            let a = get(c, &format!("http://{check}/ext_authz/p"), &[]).await;
            // A 5xx refusal goes out as 403 (Envoy would take a 5xx for the
            // service failing, and could let the request through).
            match a.status {
                StatusCode::OK => true,
                StatusCode::TOO_MANY_REQUESTS => false,
                StatusCode::FORBIDDEN => {
                    assert_eq!(a.header("x-tollgate-status"), Some("503"));
                    false
                }
                other => panic!("ext_authz answered {other}"),
            }
        }
        Asking::AuthRequest => {
            let a = get(c, &format!("http://{check}/auth_request"), &[("x-original-uri", "/p")]).await;
            match a.status {
                StatusCode::NO_CONTENT => true,
                StatusCode::FORBIDDEN => {
                    assert!(matches!(a.header("x-tollgate-status"), Some("429" | "503")));
                    false
                }
                other => panic!("auth_request answered {other}"),
            }
        }
        Asking::Rls => {
            let mut rls = RateLimitServiceClient::connect(format!("http://{}", tg.grpc.unwrap()))
                .await
                .unwrap();
            let r = rls
                .should_rate_limit(request(
                    "it",
                    vec![descriptor(&[("p0", "")]), descriptor(&[("p1", "")])],
                ))
                .await
                .unwrap()
                .into_inner();
            assert_ne!(r.overall_code, Code::Unknown as i32);
            r.overall_code == Code::Ok as i32
        }
    }
}

/// A shadow rule never refuses, so it is never counted as refusing, also
/// when the enforced rule beside it refuses from the denial cache: on the
/// surfaces that only answer, as on the proxy.
#[tokio::test]
async fn a_shadow_rule_beside_a_cached_refusal_is_counted_shadow_limited_on_every_asking_surface() {
    let rules = [
        ("enforced", "    limits: [{ requests: 3, per: 60s }]\n"),
        (
            "watching",
            "    shadow: true\n    limits: [{ requests: 1, per: 60s }]\n",
        ),
    ];
    let app = TestUpstream::start().await;
    let redis = RedisServer::start();
    let redis_url = redis.url();
    let c = client();
    for store in [&[][..], &["--redis", redis_url.as_str()][..]] {
        for surface in [Asking::ExtAuthz, Asking::AuthRequest, Asking::Rls] {
            redis.cli(&["flushall"]);
            let tg = Tollgate::start(&rules_for(surface, &rules), app.addr, store);
            let mut passed = Vec::new();
            for _ in 0..10 {
                passed.push(passes(surface, &tg, &c).await);
            }
            let expected: Vec<bool> = (0..10).map(|i| i < 3).collect();
            assert_eq!(passed, expected, "{surface:?} {store:?}");
            let m = metrics_holding(&tg, SHADOW_BESIDE_A_CACHED_REFUSAL).await;
            assert!(
                !m.contains("rule=\"watching\",outcome=\"limited"),
                "{surface:?} {store:?}\n{m}"
            );
        }
    }
}

/// Asks three times on each asking surface over `rules` with Redis
/// unreachable: each ask `passes` or not, `counted` is on `/metrics` and
/// `never` is not.
async fn with_redis_down(rules: &[(&str, &str)], passes_each: bool, counted: &[&str], never: &str) -> TestUpstream {
    let app = TestUpstream::start().await;
    let nowhere = format!("redis://127.0.0.1:{}/", free_port());
    let c = client();
    for surface in [Asking::ExtAuthz, Asking::AuthRequest, Asking::Rls] {
        let tg = Tollgate::start(&rules_for(surface, rules), app.addr, &["--redis", &nowhere]);
        for _ in 0..3 {
            assert_eq!(passes(surface, &tg, &c).await, passes_each, "{surface:?}");
        }
        let m = metrics_holding(&tg, counted).await;
        assert!(!m.contains(never), "{surface:?}\n{m}");
    }
    app
}

/// With Redis unreachable each rule fails as it says and is counted by what
/// it said, also in a request another rule refuses: on every asking surface.
#[tokio::test]
async fn redis_down_each_rule_fails_and_is_counted_by_its_own_mode_on_every_asking_surface() {
    let rules = [
        ("open", "    limits: [{ requests: 100, per: 30s }]\n"),
        (
            "closed",
            "    limits: [{ requests: 100, per: 30s }]\n    failure_mode: closed\n",
        ),
    ];
    // `closed` refuses every ask.
    let counted = [
        "tollgate_decisions_total{rule=\"open\",outcome=\"failed_open\"} 3",
        "tollgate_decisions_total{rule=\"closed\",outcome=\"failed_closed\"} 3",
    ];
    with_redis_down(&rules, false, &counted, "rule=\"open\",outcome=\"failed_closed\"").await;
}

/// README: a shadow rule never refuses, so it fails open whatever its
/// `failure_mode` says, and is counted `failed_open`: on every surface.
#[tokio::test]
async fn redis_down_a_shadow_rule_that_says_closed_fails_open_on_every_surface() {
    let rules = [(
        "watching",
        "    shadow: true\n    limits: [{ requests: 1, per: 30s }]\n    failure_mode: closed\n",
    )];
    let counted = ["tollgate_decisions_total{rule=\"watching\",outcome=\"failed_open\"} 3"];
    let app = with_redis_down(&rules, true, &counted, "outcome=\"failed_closed\"").await;
    let nowhere = format!("redis://127.0.0.1:{}/", free_port());
    let c = client();
    // And through the proxy.
    let tg = Tollgate::start(&rules_for(Asking::ExtAuthz, &rules), app.addr, &["--redis", &nowhere]);
    for _ in 0..3 {
        assert_eq!(get(&c, &tg.url("/p"), &[]).await.status, StatusCode::OK);
    }
    let m = metrics_holding(&tg, &counted).await;
    assert!(!m.contains("outcome=\"failed_closed\""), "proxy\n{m}");
}

/// A descriptor sent twice in one RLS request is two hits on one counter,
/// as envoyproxy/ratelimit charges each: the metrics count every copy that
/// decided, and a refusal from the denial cache answers and counts as the
/// store's did, on memory and on Redis; with Redis down every copy is
/// counted by its rule's failure mode.
#[tokio::test]
async fn rls_a_repeated_descriptor_is_counted_for_every_copy_in_the_metrics() {
    let rules = [
        ("enforced", "    limits: [{ requests: 3, per: 60s }]\n"),
        (
            "watching",
            "    shadow: true\n    limits: [{ requests: 1, per: 60s }]\n",
        ),
    ];
    // `enforced` (p0) twice, `watching` (p1) once.
    let ask = |tg: &Tollgate| {
        let grpc = tg.grpc.unwrap();
        async move {
            let mut rls = RateLimitServiceClient::connect(format!("http://{grpc}")).await.unwrap();
            let r = rls
                .should_rate_limit(request(
                    "it",
                    vec![
                        descriptor(&[("p0", "")]),
                        descriptor(&[("p1", "")]),
                        descriptor(&[("p0", "")]),
                    ],
                ))
                .await
                .unwrap()
                .into_inner();
            let statuses: Vec<(i32, u32)> = r.statuses.iter().map(|s| (s.code, s.limit_remaining)).collect();
            (r.overall_code, statuses)
        }
    };
    let (ok, over) = (Code::Ok as i32, Code::OverLimit as i32);
    let app = TestUpstream::start().await;
    let redis = RedisServer::start();
    let redis_url = redis.url();
    for store in [&[][..], &["--redis", redis_url.as_str()][..]] {
        redis.cli(&["flushall"]);
        let tg = Tollgate::start(&rules_for(Asking::Rls, &rules), app.addr, store);
        // Both copies fit (3 - 2 = 1 left after them), and the shadow rule's one.
        assert_eq!(ask(&tg).await, (ok, vec![(ok, 2), (ok, 0), (ok, 1)]), "{store:?}");
        // Then the first copy would fit and the second not: refused by the
        // store once, then by the cache, alike.
        for i in 0..5 {
            assert_eq!(
                ask(&tg).await,
                (over, vec![(ok, 1), (ok, 0), (over, 0)]),
                "{store:?} {i}"
            );
        }
        let m = metrics_holding(
            &tg,
            &[
                "tollgate_decisions_total{rule=\"enforced\",outcome=\"allowed\"} 2",
                "tollgate_decisions_total{rule=\"enforced\",outcome=\"limited\"} 1",
                "tollgate_decisions_total{rule=\"enforced\",outcome=\"limited_cached\"} 4",
                "tollgate_decisions_total{rule=\"watching\",outcome=\"allowed\"} 1",
                "tollgate_decisions_total{rule=\"watching\",outcome=\"shadow_limited\"} 5",
            ],
        )
        .await;
        assert!(!m.contains("rule=\"watching\",outcome=\"limited"), "{store:?}\n{m}");
    }
    // Redis down: every copy fails open, and is counted so.
    let nowhere = format!("redis://127.0.0.1:{}/", free_port());
    let tg = Tollgate::start(&rules_for(Asking::Rls, &rules), app.addr, &["--redis", &nowhere]);
    for _ in 0..3 {
        assert_eq!(ask(&tg).await.0, ok);
    }
    let m = metrics_holding(
        &tg,
        &[
            "tollgate_decisions_total{rule=\"enforced\",outcome=\"failed_open\"} 6",
            "tollgate_decisions_total{rule=\"watching\",outcome=\"failed_open\"} 3",
        ],
    )
    .await;
    assert!(!m.contains("outcome=\"failed_closed\""), "{m}");
}
