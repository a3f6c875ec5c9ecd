//! The operator page (`GET /` on the admin listener), the JSON behind it,
//! `tollgate explain` and the Grafana dashboard, used as an operator would:
//! the page in a real headless Chromium, traffic through the real proxy,
//! the limits file edited (and broken) on disk.

use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use http::{Method, StatusCode};
use serde_json::{Value as Json, json};

use crate::common::browser::Browser;
use crate::common::{RedisServer, TestUpstream, Tollgate, binary, client, get, repo_file, send};

const LIMITS: &str = r#"
domain: api
rules:
  - name: login
    match: { methods: [POST], path: /login }
    by: [client_ip]
    limits: [{ requests: 3, per: 60s }]
  - name: per-key
    match: { path: /api/* }
    by: ["header:x-api-key"]
    limits: [{ requests: 2, per: 60s }, { requests: 100, per: 1h }]
  - name: secret-tier
    match: { path: /api/*, headers: { authorization: "Bearer s3cr3t-token" } }
    limits: [{ requests: 1000, per: 1m }]
"#;

async fn post_json(url: &str, body: &Json) -> (StatusCode, Json) {
    let a = send(
        &client(),
        Method::POST,
        url,
        &[("content-type", "application/json")],
        serde_json::to_vec(body).unwrap(),
    )
    .await;
    (a.status, a.json())
}

async fn state(tg: &Tollgate) -> Json {
    get(&client(), &format!("http://{}/api/state", tg.admin), &[])
        .await
        .json()
}

fn rule<'a>(state: &'a Json, name: &str) -> &'a Json {
    state["rules"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == name)
        .unwrap_or_else(|| panic!("no rule {name} in {state}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn state_shows_rules_rates_and_the_most_refused_callers() {
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(LIMITS, up.addr, &[]);
    let c = client();
    for _ in 0..5 {
        send(&c, Method::POST, &tg.url("/login"), &[], Vec::new()).await;
    }
    for _ in 0..6 {
        get(&c, &tg.url("/api/x"), &[("x-api-key", "k-hot")]).await;
    }
    let s = state(&tg).await;
    assert_eq!(s["store"]["kind"], "memory");
    assert_eq!(s["store"]["up"], true);
    assert_eq!(s["files"][0]["domain"], "api");
    assert_eq!(s["files"][0]["last_error"], Json::Null);
    let login = rule(&s, "login");
    assert_eq!(login["windows"], json!(["3 per 1m"]));
    assert_eq!(login["match"], "POST /login");
    assert_eq!(login["by"], json!(["client_ip"]));
    let history = |r: &Json, k: &str| {
        r["history"][k]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .sum::<u64>()
    };
    assert_eq!(history(login, "allowed"), 3);
    assert_eq!(history(login, "limited"), 2);
    assert_eq!(history(rule(&s, "per-key"), "limited"), 4);
    // A header match's value may be a credential: never shown.
    let secret = rule(&s, "secret-tier");
    assert!(!secret.to_string().contains("s3cr3t"), "{secret}");
    assert_eq!(secret["match"], "/api/* header authorization=(hidden)");
    let top = s["top_limited"].as_array().unwrap();
    assert_eq!(top[0]["rule"], "per-key", "{top:?}");
    assert_eq!(top[0]["values"], json!(["k-hot"]));
    assert_eq!(top[0]["refusals"], 4);
    assert!(top[0]["retry_in_ms"].as_u64().unwrap() > 50_000);
    assert_eq!(top[1]["rule"], "login");
    assert_eq!(top[1]["values"], json!(["127.0.0.1"]));
    // A value kept as a hash comes as one; text that looks like a hash is text.
    let long = "L".repeat(100);
    let posing = "sha256:0011… (100 bytes)";
    for _ in 0..3 {
        get(&c, &tg.url("/api/x"), &[("x-api-key", long.as_str())]).await;
        get(&c, &tg.url("/api/x"), &[("x-api-key", posing)]).await;
    }
    let top = state(&tg).await["top_limited"].clone();
    let values_of = |needle: &dyn Fn(&Json) -> bool| {
        top.as_array()
            .unwrap()
            .iter()
            .find(|t| needle(&t["values"][0]))
            .map(|t| t["values"][0].clone())
    };
    let hashed = values_of(&|v| v.is_object()).expect("the long key");
    assert_eq!(
        (hashed["bytes"].as_u64(), hashed["text"].as_bool()),
        (Some(100), Some(true)),
        "{hashed}"
    );
    assert_eq!(values_of(&|v| v == posing), Some(json!(posing)));
    // A filter, and a limit that keeps the busiest (thousands of rules).
    let listed = |q: &'static str| {
        let url = format!("http://{}/api/rules{q}", tg.admin);
        async move { get(&client(), &url, &[]).await.json() }
    };
    let found = listed("?filter=LOGIN").await;
    assert_eq!(
        (found["rules_total"].as_u64(), found["rules_matched"].as_u64()),
        (Some(3), Some(1))
    );
    assert_eq!(found["rules"][0]["name"], "login");
    let busiest = listed("?limit=1").await;
    assert_eq!(busiest["rules"].as_array().unwrap().len(), 1);
    assert_eq!(busiest["rules"][0]["name"], "per-key", "6 decisions against login's 5");
    assert_eq!(listed("?filter=authorization").await["rules"][0]["name"], "secret-tier");
    assert_eq!(
        rule(&s, "secret-tier")["history"],
        Json::Null,
        "no decisions, no history"
    );
    // Changing only a hidden header value is a change (it is not shown).
    std::fs::write(&tg.config, LIMITS.replace("Bearer s3cr3t-token", "Bearer n3w-token")).unwrap();
    let mut changed = Json::Null;
    for _ in 0..50 {
        let s = get(&client(), &format!("http://{}/api/rules", tg.admin), &[])
            .await
            .json();
        changed = rule(&s, "secret-tier")["changed"].clone();
        if changed == true {
            assert_eq!(rule(&s, "login")["changed"], false);
            assert!(!s.to_string().contains("n3w-token"));
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(changed, true, "a new secret value is a changed rule");
    // After a second of life the rate is per second of it.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    let s = state(&tg).await;
    assert!(rule(&s, "per-key")["rate"]["limited"].as_f64().unwrap() > 0.0);
    assert_eq!(
        rule(&s, "per-key")["limited_share"].as_f64(),
        Some(0.5),
        "6 of 12 refused"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refusals_on_every_http_surface_reach_the_page() {
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(LIMITS, up.addr, &[]);
    let c = client();
    let check = tg.check.unwrap();
    // One key per surface, refused once each (per-key: 2 a minute).
    for _ in 0..3 {
        get(&c, &tg.url("/api/x"), &[("x-api-key", "via-proxy")]).await;
        get(
            &c,
            &format!("http://{check}/ext_authz/api/x"),
            &[("x-api-key", "via-ext-authz")],
        )
        .await;
        get(
            &c,
            &format!("http://{check}/auth_request"),
            &[
                ("x-original-uri", "/api/x"),
                ("x-original-method", "GET"),
                ("x-api-key", "via-auth-request"),
            ],
        )
        .await;
    }
    let s = state(&tg).await;
    let refused: Vec<String> = s["top_limited"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|t| t["refusals"] == 1)
        .map(|t| t["values"][0].as_str().unwrap_or_default().to_string())
        .collect();
    for key in ["via-proxy", "via-ext-authz", "via-auth-request"] {
        assert!(refused.iter().any(|r| r == key), "{key} missing from {refused:?}");
    }
    let history: u64 = rule(&s, "per-key")["history"]["limited"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert_eq!(history, 3, "one refusal per surface in the chart");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_is_a_dry_run_over_http_and_rls_forms() {
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(LIMITS, up.addr, &[]);
    let explain = format!("http://{}/api/explain", tg.admin);
    let q = json!({"method": "GET", "path": "/api/v1?x=1", "headers": [["x-api-key", "k1"]], "client": "203.0.113.9"});
    for _ in 0..10 {
        let (status, a) = post_json(&explain, &q).await;
        assert_eq!(status, StatusCode::OK, "{a}");
        assert_eq!(a["verdict"], "allowed");
        assert_eq!(a["rules"][0]["values"], json!(["k1"]));
        assert_eq!(a["rules"][0]["windows"][0]["used"], 0, "nothing charged");
    }
    let c = client();
    for _ in 0..2 {
        assert_eq!(
            get(&c, &tg.url("/api/v1"), &[("x-api-key", "k1")]).await.status,
            StatusCode::OK
        );
    }
    let (_, a) = post_json(&explain, &q).await;
    assert_eq!(a["verdict"], "limited");
    assert_eq!(a["status"], 429);
    assert_eq!(a["rules"][0]["would_refuse"], true);
    assert_eq!(a["rules"][0]["windows"][0]["used"], 2);
    assert_eq!(a["rules"][0]["windows"][0]["remaining"], 0);
    assert_eq!(a["rules"][0]["windows"][1]["remaining"], 98);
    assert!(a["retry_after_ms"].as_u64().unwrap() > 55_000);
    // No rule matches: said so, nothing else.
    let (_, a) = post_json(&explain, &json!({"path": "/elsewhere"})).await;
    assert_eq!(a["verdict"], "no_rule");
    // What tollgate would refuse with 400, the question is refused for.
    for (bad, says) in [
        (json!({"method": "post", "path": "/login"}), "upper case"),
        (json!({"path": "/api/a%2Fb"}), "path"),
        (
            json!({"path": "/api/x", "headers": [["x-api-key", "a"], ["x-api-key", "b"]]}),
            "more than once",
        ),
        (json!({"path": "/x", "client": "not-an-ip"}), "IP address"),
        (json!({"pathh": "/x"}), "unknown field"),
    ] {
        let (status, a) = post_json(&explain, &bad).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{bad}: {a}");
        assert!(a["error"].as_str().unwrap().contains(says), "{bad}: {a}");
    }
    let a = send(
        &c,
        Method::POST,
        &explain,
        &[("content-type", "text/plain")],
        b"{}".to_vec(),
    )
    .await;
    assert_eq!(
        a.status,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        "a cross-site form cannot post it"
    );
    let a = get(&c, &explain, &[]).await;
    assert_eq!(a.status, StatusCode::METHOD_NOT_ALLOWED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_answers_rls_descriptors_from_redis_and_the_state_shows_redis_going_away() {
    let mut redis = RedisServer::start();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("edge.yaml");
    std::fs::write(
        &file,
        "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit: { unit: minute, requests_per_unit: 2 }\n",
    )
    .unwrap();
    let tg = Tollgate::start_rls(&[file], &["--redis", &redis.url()]);
    let explain = format!("http://{}/api/explain", tg.admin);
    let ask = |ip: &str, hits: u64| json!({"domain": "edge", "descriptors": [{"entries": [["remote_address", ip]], "hits_addend": hits}]});
    let (status, a) = post_json(&explain, &ask("10.0.0.1", 2)).await;
    assert_eq!(status, StatusCode::OK, "{a}");
    assert_eq!(a["verdict"], "allowed");
    assert_eq!(a["rules"][0]["cost"], 2);
    assert_eq!(
        a["rules"][0]["values"],
        json!(["remote_address=10.0.0.1"]),
        "a descriptor's values as pairs"
    );
    let (_, a) = post_json(&explain, &ask("10.0.0.1", 3)).await;
    assert_eq!(a["verdict"], "limited");
    assert_eq!(a["rules"][0]["windows"][0]["never"], true, "3 can never fit in 2");
    let s = state(&tg).await;
    assert_eq!(s["store"]["kind"], "redis");
    assert!(s["store"]["address"].as_str().unwrap().contains("127.0.0.1"), "{s}");
    // A bare key counts each value apart: the page says so.
    assert_eq!(rule(&s, "remote_address")["by"], json!(["remote_address"]), "{s}");

    // What the RLS refuses, the question is refused for; hits_addend 0
    // checks without charging, as there.
    let rls = RateLimitServiceClient::connect(format!("http://{}", tg.grpc.unwrap()))
        .await
        .unwrap();
    let call = |ip: &'static str, hits: u32| {
        let req = RateLimitRequest {
            domain: "edge".into(),
            descriptors: vec![crate::envoy::descriptor(&[("remote_address", ip)])],
            hits_addend: hits,
        };
        let mut rls = rls.clone();
        async move { rls.should_rate_limit(req).await.map(|r| r.into_inner().overall_code) }
    };
    call("10.0.0.9", 2).await.unwrap();
    let (_, a) = post_json(&explain, &ask("10.0.0.9", 0)).await;
    assert_eq!(
        (a["verdict"].as_str(), a["rules"][0]["cost"].as_u64()),
        (Some("allowed"), Some(0)),
        "{a}"
    );
    // A descriptor's own hits_addend is a uint64 in the RLS API: past
    // uint32 it is a cost no window holds, answered, not refused.
    let mut huge = crate::envoy::descriptor(&[("remote_address", "10.0.0.8")]);
    huge.hits_addend = Some(envoy_types::pb::google::protobuf::UInt64Value { value: 1 << 40 });
    let mut rls_huge = rls.clone();
    let code = rls_huge
        .should_rate_limit(RateLimitRequest {
            domain: "edge".into(),
            descriptors: vec![huge],
            hits_addend: 0,
        })
        .await
        .unwrap()
        .into_inner()
        .overall_code;
    let (status, a) = post_json(&explain, &ask("10.0.0.8", 1 << 40)).await;
    assert_eq!(status, StatusCode::OK, "{a}");
    assert_eq!(
        (
            code,
            a["verdict"].as_str(),
            a["rules"][0]["windows"][0]["never"].as_bool()
        ),
        (2, Some("limited"), Some(true)),
        "the RLS says OVER_LIMIT (2), and explain as it: {a}"
    );
    for (bad, says) in [
        (
            json!({"domain": "", "descriptors": [{"entries": [["a", "b"]]}]}),
            "domain must not be empty",
        ),
        (json!({"domain": "edge", "descriptors": []}), "must not be empty"),
        (
            json!({"domain": "edge", "descriptors": vec![json!({"entries": [["a", "b"]]}); 65]}),
            "at most 64",
        ),
    ] {
        let (status, a) = post_json(&explain, &bad).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{a}");
        assert!(a["error"].as_str().unwrap().contains(says), "{a}");
    }

    // A refusal the denial cache holds: the RLS keeps answering it through
    // an outage, and so does explain.
    assert_eq!(call("10.0.0.9", 1).await.unwrap(), 2, "OVER_LIMIT");
    let top = state(&tg).await["top_limited"].clone();
    assert_eq!(
        top[0]["values"],
        json!(["remote_address=10.0.0.9"]),
        "an RLS refusal on the page: {top}"
    );
    redis.kill();
    let (_, a) = post_json(&explain, &ask("10.0.0.9", 1)).await;
    assert_eq!(
        (a["verdict"].as_str(), a["from_denial_cache"].as_bool()),
        (Some("limited"), Some(true)),
        "{a}"
    );
    assert_eq!(
        a["rules"][0]["windows"][0]["used"],
        Json::Null,
        "not known from the cache"
    );
    let (_, a) = post_json(&explain, &ask("10.0.0.1", 1)).await;
    assert_eq!(a["verdict"], "failed_open", "{a}");
    assert!(a["store_error"].as_str().is_some(), "{a}");
    // The page probes the store: down without any decision, up again when back.
    let s = state(&tg).await;
    assert_eq!(s["store"]["up"], false, "{s}");
    assert!(s["store"]["last_error"].as_str().is_some(), "{s}");
    redis.restart();
    let mut up = Json::Null;
    for _ in 0..40 {
        up = state(&tg).await["store"]["up"].clone();
        if up == true {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(up, true, "the store is shown up again once it answers");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_answers_as_the_rls_does_in_shadow_mode() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("edge.yaml");
    std::fs::write(
        &file,
        "domain: edge\ndescriptors:\n  - key: remote_address\n    rate_limit: { unit: minute, requests_per_unit: 1 }\n",
    )
    .unwrap();
    let tg = Tollgate::start_rls(&[file], &["--rls-shadow-mode", "true"]);
    let mut rls = RateLimitServiceClient::connect(format!("http://{}", tg.grpc.unwrap()))
        .await
        .unwrap();
    let req = || RateLimitRequest {
        domain: "edge".into(),
        descriptors: vec![crate::envoy::descriptor(&[("remote_address", "10.0.0.1")])],
        hits_addend: 1,
    };
    for _ in 0..2 {
        let code = rls.should_rate_limit(req()).await.unwrap().into_inner().overall_code;
        assert_eq!(code, 1, "OK in shadow mode");
    }
    let explain = format!("http://{}/api/explain", tg.admin);
    let ask = json!({"domain": "edge", "descriptors": [{"entries": [["remote_address", "10.0.0.1"]]}]});
    let (status, a) = post_json(&explain, &ask).await;
    assert_eq!(status, StatusCode::OK, "{a}");
    assert_eq!(
        (a["verdict"].as_str(), a["status"].as_u64()),
        (Some("allowed"), Some(200)),
        "{a}"
    );
    assert!(a["note"].as_str().unwrap().contains("would be limited"), "{a}");
    assert_eq!(a["rules"][0]["would_refuse"], true, "{a}");
}

/// Found by an independent tester: a Redis that answers reads but refuses
/// writes (out of memory under `noeviction`, a read-only replica) made the
/// proxy answer a fail-closed rule's 503 while explain, which only read,
/// answered "allowed". A caller already over the limit is refused either
/// way: the proxy's refusal writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_answers_as_the_proxy_while_redis_refuses_writes() {
    let redis = RedisServer::start();
    let up = TestUpstream::start().await;
    let limits = "domain: api\nrules:\n  - name: strict\n    by: [header:x-user]\n    failure_mode: closed\n    limits: [{ requests: 2, per: 1m }]\n";
    let tg = Tollgate::start(limits, up.addr, &["--redis", &redis.url()]);
    let explain = format!("http://{}/api/explain", tg.admin);
    let ask = |user: &str| json!({ "path": "/", "headers": [["x-user", user]] });
    let proxied = async |user: &str| get(&client(), &tg.url("/"), &[("x-user", user)]).await.status;
    assert_eq!(proxied("full").await, StatusCode::OK);
    assert_eq!(proxied("full").await, StatusCode::OK);
    let (_, a) = post_json(&explain, &ask("fresh")).await;
    assert_eq!(
        (a["verdict"].as_str(), a["status"].as_u64()),
        (Some("allowed"), Some(200)),
        "{a}"
    );
    let keys_before = redis.cli(&["DBSIZE"]);

    for (refuse, allow) in [
        (
            &["CONFIG", "SET", "maxmemory", "1"][..],
            &["CONFIG", "SET", "maxmemory", "0"][..],
        ),
        (&["REPLICAOF", "127.0.0.1", "1"][..], &["REPLICAOF", "NO", "ONE"][..]),
    ] {
        if refuse[0] == "CONFIG" {
            redis.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
        }
        redis.cli(refuse);
        assert_eq!(proxied("fresh").await, StatusCode::SERVICE_UNAVAILABLE, "{refuse:?}");
        let (_, a) = post_json(&explain, &ask("fresh")).await;
        assert_eq!(
            (a["verdict"].as_str(), a["status"].as_u64()),
            (Some("failed_closed"), Some(503)),
            "{refuse:?}: {a}"
        );
        assert!(a["store_error"].is_string(), "{a}");
        // Over its limit, the proxy refuses without a write, and so does explain.
        assert_eq!(proxied("full").await, StatusCode::TOO_MANY_REQUESTS, "{refuse:?}");
        let (_, a) = post_json(&explain, &ask("full")).await;
        assert_eq!(
            (a["verdict"].as_str(), a["status"].as_u64()),
            (Some("limited"), Some(429)),
            "{a}"
        );
        redis.cli(allow);
    }
    let (_, a) = post_json(&explain, &ask("fresh")).await;
    assert_eq!(
        (a["verdict"].as_str(), a["status"].as_u64()),
        (Some("allowed"), Some(200)),
        "{a}"
    );
    assert_eq!(
        redis.cli(&["DBSIZE"]),
        keys_before,
        "explain's dry runs left no key behind"
    );
}

/// Found by an independent tester: another program's string under a
/// counter's key was logged as Lua's "attempt to perform arithmetic on
/// local 't'". Each kind of foreign value is now said as what it is, and
/// the rule's failure mode answers, as for any store error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_value_under_a_counters_key_is_said_as_such() {
    let redis = RedisServer::start();
    let up = TestUpstream::start().await;
    let limits =
        "domain: api\nrules:\n  - name: open\n    by: [header:x-user]\n    limits: [{ requests: 5, per: 1m }]\n";
    let tg = Tollgate::start(limits, up.addr, &["--redis", &redis.url()]);
    let explain = format!("http://{}/api/explain", tg.admin);
    let (_, a) = post_json(&explain, &json!({ "path": "/", "headers": [["x-user", "u"]] })).await;
    let key = a["rules"][0]["counter"].as_str().unwrap().to_string();
    for (write, said) in [
        (
            vec!["SET", &key, "not-a-counter:zz"],
            "holds a string that is not a tollgate counter",
        ),
        (
            vec!["SET", &key, "17643*x"],
            "holds a string that is not a tollgate counter",
        ),
        // The 46th attack: numbers, but no counter of ours.
        (
            vec!["SET", &key, "12345"],
            "holds a string that is not a tollgate counter",
        ),
        (vec!["SET", &key, "-5"], "holds a string that is not a tollgate counter"),
        (
            vec!["SET", &key, "1764300000000*-5"],
            "holds a string that is not a tollgate counter",
        ),
        (vec!["RPUSH", &key, "a"], "holds a list"),
        (vec!["HSET", &key, "f", "v"], "holds a hash"),
        // The 45th attack: a stream not of tollgate's entries was counted
        // from, or failed as Lua's arithmetic on nil.
        (
            vec!["XADD", &key, "*", "a", "b"],
            "holds a stream that is not a tollgate counter",
        ),
        (
            vec!["XADD", &key, "*", "n", "x", "c", "1"],
            "holds a stream that is not a tollgate counter",
        ),
    ] {
        redis.cli(&["DEL", &key]);
        redis.cli(&write);
        let answer = get(&client(), &tg.url("/"), &[("x-user", "u")]).await;
        assert_eq!(answer.status, StatusCode::OK, "{write:?}: the rule fails open");
        assert!(tg.logged(said), "{write:?}: {}", tg.log_text());
        // The next line comes a second later.
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    assert!(!tg.log_text().contains("attempt to"), "{}", tg.log_text());
    // The 46th attack: a foreign value met less than a second after the
    // last line was told only as "answering again", naming nothing.
    let ask = async || get(&client(), &tg.url("/"), &[("x-user", "u")]).await.status;
    redis.cli(&["DEL", &key]);
    redis.cli(&["SADD", &key, "a"]);
    assert_eq!(ask().await, StatusCode::OK);
    assert!(tg.logged("holds a set"), "{}", tg.log_text());
    redis.cli(&["DEL", &key]);
    redis.cli(&["ZADD", &key, "1", "a"]);
    assert_eq!(ask().await, StatusCode::OK);
    redis.cli(&["DEL", &key]);
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(ask().await, StatusCode::OK);
    assert!(tg.logged("answering again"), "{}", tg.log_text());
    assert!(
        tg.logged("holds a zset"),
        "the line telling it names it: {}",
        tg.log_text()
    );
    redis.cli(&["DEL", &key]);
    assert_eq!(
        get(&client(), &tg.url("/"), &[("x-user", "u")]).await.status,
        StatusCode::OK
    );
}

/// The 44th attack: a bucketed window's ring overwritten with other bytes
/// was read as counts, and its newest bucket, millions of years ahead,
/// made a 429 with a retry time of as many years, cached past the key's
/// deletion. Now it is said as what it is and the failure mode answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_value_under_a_rings_key_is_said_as_such() {
    let redis = RedisServer::start();
    let up = TestUpstream::start().await;
    let limits = "domain: api\nrules:\n  - name: closed\n    by: [header:x-user]\n    failure_mode: closed\n    limits: [{ requests: 5, per: 1m, precision: 1s }]\n";
    let tg = Tollgate::start(limits, up.addr, &["--redis", &redis.url()]);
    let ask = async || get(&client(), &tg.url("/"), &[("x-user", "u")]).await;
    assert_eq!(ask().await.status, StatusCode::OK);
    let rings = redis.cli(&["--scan", "--pattern", "*60000/1000"]).unwrap_or_default();
    let ring = rings
        .lines()
        .next()
        .unwrap_or_else(|| panic!("no ring key: {rings:?}"))
        .to_string();
    let len: usize = redis.cli(&["STRLEN", &ring]).unwrap().trim().parse().unwrap();
    let garbage = format!("F{}", "~".repeat(len - 1));
    for (write, said) in [
        (vec!["SET", &ring, "garbage"], "is not a tollgate ring"),
        (vec!["SET", &ring, &garbage], "is not a tollgate ring"),
        // The 45th attack: these were Redis's bare WRONGTYPE, naming no key.
        (vec!["RPUSH", &ring, "a"], "holds a list"),
        (vec!["HSET", &ring, "f", "v"], "holds a hash"),
    ] {
        redis.cli(&["DEL", &ring]);
        redis.cli(&write);
        let answer = ask().await;
        assert_eq!(
            answer.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{write:?}: the rule fails closed"
        );
        assert_eq!(answer.header("retry-after"), Some("1"));
        assert!(tg.logged(said), "{write:?}: {}", tg.log_text());
        tokio::time::sleep(Duration::from_millis(1100)).await;
    }
    redis.cli(&["DEL", &ring]);
    assert_eq!(
        ask().await.status,
        StatusCode::OK,
        "the key gone, counting starts again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn explain_shows_a_store_outage_as_each_rules_failure_mode_decides() {
    let mut redis = RedisServer::start();
    let up = TestUpstream::start().await;
    let limits = "domain: api\nrules:\n  - name: strict\n    match: { path: /strict }\n    failure_mode: closed\n    limits: [{ requests: 5, per: 1m }]\n  - name: lenient\n    match: { path: /lenient }\n    limits: [{ requests: 5, per: 1m }]\n";
    let tg = Tollgate::start(limits, up.addr, &["--redis", &redis.url()]);
    redis.kill();
    let explain = format!("http://{}/api/explain", tg.admin);
    // What explain says of one path: its verdict and status, and its one
    // rule's failure mode and whether that refuses.
    let explained = async |path: &str| {
        let (_, a) = post_json(&explain, &json!({ "path": path })).await;
        let seen = (
            a["verdict"].as_str().map(str::to_owned),
            a["status"].as_u64(),
            a["rules"][0]["failure_mode"].as_str().map(str::to_owned),
            a["rules"][0]["would_refuse"].as_bool(),
        );
        (seen, a)
    };
    let (seen, a) = explained("/strict").await;
    assert_eq!(
        seen,
        (
            Some("failed_closed".into()),
            Some(503),
            Some("closed".into()),
            Some(true)
        ),
        "{a}"
    );
    let proxied = get(&client(), &tg.url("/strict"), &[]).await;
    assert_eq!(proxied.status, StatusCode::SERVICE_UNAVAILABLE, "as the proxy answers");
    assert_eq!(proxied.header("retry-after"), Some("1"));
    assert_eq!(a["retry_after_ms"], 1000, "the Retry-After the proxy sends: {a}");
    let (seen, a) = explained("/lenient").await;
    assert_eq!(
        seen,
        (Some("failed_open".into()), Some(200), Some("open".into()), Some(false)),
        "{a}"
    );
    assert_eq!(a["retry_after_ms"], Json::Null, "{a}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_admin_listener_serves_at_most_128_requests_at_once() {
    use tokio::io::AsyncWriteExt;
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(LIMITS, up.addr, &[]);
    // Requests whose heads never end: busy, not idle, so they hold their
    // slots (until the header read timeout).
    let mut held = Vec::new();
    for _ in 0..128 {
        let mut s = tokio::net::TcpStream::connect(tg.admin).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\n")
            .await
            .unwrap();
        held.push(s);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    let url = format!("http://{}/healthz", tg.admin);
    let waited = tokio::time::timeout(Duration::from_millis(1500), get(&client(), &url, &[])).await;
    assert!(waited.is_err(), "the 129th connection waits");
    held.pop();
    let answered = tokio::time::timeout(Duration::from_secs(5), get(&client(), &url, &[])).await;
    assert_eq!(answered.expect("served once one closes").status, StatusCode::OK);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_sockets_on_a_full_admin_listener_give_way_to_probes() {
    // From an attack: ~260 sockets held open against the admin listener's
    // 128 made /readyz and /metrics time out.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(LIMITS, up.addr, &[]);
    // Keep-alive connections that asked once and stay, then sockets that
    // never send a byte.
    let mut kept = Vec::new();
    for _ in 0..100 {
        let mut s = tokio::net::TcpStream::connect(tg.admin).await.unwrap();
        s.write_all(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\n\r\n")
            .await
            .unwrap();
        let mut buf = [0u8; 512];
        let n = s.read(&mut buf).await.unwrap();
        assert!(
            buf[..n].starts_with(b"HTTP/1.1 200"),
            "{}",
            String::from_utf8_lossy(&buf[..n])
        );
        kept.push(s);
    }
    let mut silent = Vec::new();
    for _ in 0..300 {
        silent.push(tokio::net::TcpStream::connect(tg.admin).await.unwrap());
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    for path in ["/readyz", "/metrics", "/healthz"] {
        let url = format!("http://{}{path}", tg.admin);
        let answered = tokio::time::timeout(Duration::from_secs(3), get(&client(), &url, &[])).await;
        let answered = answered.unwrap_or_else(|_| panic!("{path} waited behind idle sockets"));
        assert_eq!(answered.status, StatusCode::OK, "{path}");
    }
    let metrics = get(&client(), &format!("http://{}/metrics", tg.admin), &[]).await;
    let metrics = String::from_utf8_lossy(&metrics.body);
    let line = metrics
        .lines()
        .find(|l| l.starts_with("tollgate_connections_reclaimed_total{listener=\"admin\"}"))
        .unwrap_or_else(|| panic!("no reclaimed count: {metrics}"));
    let reclaimed: f64 = line.rsplit(' ').next().unwrap().parse().unwrap();
    assert!(reclaimed >= 100.0, "{line}");
    // What gave way was closed, not left hanging: its reader sees the end.
    let mut closed = 0;
    for s in kept.iter_mut().chain(silent.iter_mut()) {
        let mut buf = [0u8; 1];
        if let Ok(Ok(0)) = tokio::time::timeout(Duration::from_millis(20), s.read(&mut buf)).await {
            closed += 1;
        }
    }
    assert!(closed >= 100, "{closed} closed");
    assert!(
        tg.log_text().contains("closing idle connections to make room"),
        "{}",
        tg.log_text()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_callers_value_never_forges_a_log_line() {
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(
        "domain: api\nrules:\n  - name: q\n    by: [\"query:t\"]\n    limits: [{ requests: 1, per: 1m }]\n",
        up.addr,
        &[],
    );
    let c = client();
    for _ in 0..3 {
        get(
            &c,
            &tg.url("/h?t=%0A2026-11-24T22:40:00Z%20ERROR%20forged%1B%5B31m"),
            &[],
        )
        .await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let logs = tg.log_text();
    assert!(logs.contains("rate limited"), "{logs}");
    assert!(
        !logs.lines().any(|l| l.starts_with("2026-11-24T22:40:00Z")),
        "a forged line: {logs}"
    );
    assert!(!logs.contains('\u{1b}'), "a terminal escape reached the log: {logs}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tollgate_explain_asks_a_running_instance_from_a_terminal() {
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(LIMITS, up.addr, &[]);
    let c = client();
    for _ in 0..3 {
        send(&c, Method::POST, &tg.url("/login"), &[], Vec::new()).await;
    }
    let admin = format!("localhost:{}", tg.admin.port());
    let out = std::process::Command::new(binary())
        .args(["explain", "--admin", &admin, "-X", "POST", "/login"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text} {}", String::from_utf8_lossy(&out.stderr));
    assert!(text.contains("limited, status 429"), "{text}");
    assert!(text.contains("rule login (counter 127.0.0.1)"), "{text}");
    assert!(text.contains("3 per 1m: used 3/3, remaining 0"), "{text}");
    // A fourth is refused, and the denial cache answers the question: it
    // knows what is left, not the count.
    send(&c, Method::POST, &tg.url("/login"), &[], Vec::new()).await;
    let out = std::process::Command::new(binary())
        .args(["explain", "--admin", &admin, "-X", "POST", "/login"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("answered from the denial cache"), "{text}");
    assert!(text.contains("3 per 1m: used ?/3, remaining 0"), "{text}");
    let out = std::process::Command::new(binary())
        .args(["explain", "--admin", &admin, "--json", "-H", "x-api-key: k", "/api/x"])
        .output()
        .unwrap();
    let answer: Json = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(answer["verdict"], "allowed");
    let out = std::process::Command::new(binary())
        .args(["explain", "--admin", &admin, "-X", "post", "/login"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("the method must be upper case"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tollgate_explain_gives_up_after_30_seconds_on_a_listener_that_never_answers() {
    // Accepts and reads, never answers: a hung admin listener.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = silent.local_addr().unwrap();
    let held = tokio::spawn(async move {
        let mut conns = Vec::new();
        while let Ok((conn, _)) = silent.accept().await {
            conns.push(conn);
        }
    });
    let started = std::time::Instant::now();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(binary())
            .args(["explain", "--admin", &addr.to_string(), "/x"])
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let took = started.elapsed();
    held.abort();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("no answer within 30s"), "{stderr}");
    assert!(took >= Duration::from_secs(29), "gave up after {took:?}");
    assert!(took < Duration::from_secs(60), "gave up after {took:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_grafana_dashboard_queries_only_series_tollgate_exports() {
    let dashboard: Json =
        serde_json::from_slice(&std::fs::read(repo_file("conf/grafana/tollgate.json")).unwrap()).unwrap();
    let mut exprs = Vec::new();
    collect_exprs(&dashboard, &mut exprs);
    assert!(exprs.len() >= 10, "{exprs:?}");
    let mut names: Vec<String> = exprs.iter().flat_map(|e| metric_names(e)).collect();
    names.sort();
    names.dedup();
    // Every family shows once it has a series: the source's registrations
    // name them all (a family appears on /metrics with its first sample).
    let registered = std::fs::read_to_string(repo_file("src/metrics.rs")).unwrap();
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(LIMITS, up.addr, &[]);
    get(&client(), &tg.url("/api/x"), &[("x-api-key", "k")]).await;
    let exported = get(&client(), &format!("http://{}/metrics", tg.admin), &[]).await.body;
    let exported = String::from_utf8_lossy(&exported).into_owned();
    for name in &names {
        let family = ["_bucket", "_sum", "_count", "_total"]
            .iter()
            .find_map(|s| name.strip_suffix(s))
            .unwrap_or(name);
        assert!(
            registered.contains(&format!("\"{family}\"")),
            "the dashboard queries {name}, which tollgate does not register"
        );
        let kind_ok = match name {
            n if n.ends_with("_total") => {
                exported.contains(&format!("# TYPE {family} counter"))
                    || !exported.contains(&format!("# TYPE {family} "))
            }
            n if n.ends_with("_bucket") || n.ends_with("_sum") || n.ends_with("_count") => {
                exported.contains(&format!("# TYPE {family} histogram"))
                    || !exported.contains(&format!("# TYPE {family} "))
            }
            _ => {
                !exported.contains(&format!("# TYPE {family} counter"))
                    && !exported.contains(&format!("# TYPE {family} histogram"))
            }
        };
        assert!(kind_ok, "{name}: the suffix does not fit how tollgate exports {family}");
    }
    for busy in [
        "tollgate_requests_total",
        "tollgate_decisions_total",
        "tollgate_decision_seconds_bucket",
        "tollgate_client_connections",
    ] {
        assert!(exported.contains(busy), "{busy} after one request");
        assert!(names.iter().any(|n| n == busy), "the dashboard shows {busy}");
    }
}

fn collect_exprs(v: &Json, out: &mut Vec<String>) {
    match v {
        Json::Object(map) => {
            for (k, v) in map {
                match (k.as_str(), v) {
                    ("expr" | "query", Json::String(e)) => out.push(e.clone()),
                    (_, v) => collect_exprs(v, out),
                }
            }
        }
        Json::Array(items) => items.iter().for_each(|v| collect_exprs(v, out)),
        _ => {}
    }
}

fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while let Some(at) = expr[i..].find("tollgate_") {
        let start = i + at;
        let end = start
            + expr[start..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(expr.len() - start);
        let before = start.checked_sub(1).map(|b| bytes[b]);
        if !before.is_some_and(|b| b.is_ascii_alphanumeric() || b == b'_') {
            names.push(expr[start..end].to_string());
        }
        i = end;
    }
    names
}

/// The page as a person uses it: it loads, lists the rules, moves with
/// traffic, shows a broken limits file and its recovery, answers the
/// explain form, and shows a caller's `<script>` as text.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_page_in_a_browser() {
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(LIMITS, up.addr, &[]);
    let page = format!("http://{}/", tg.admin);
    let a = get(&client(), &page, &[]).await;
    assert!(
        a.header("content-security-policy")
            .unwrap()
            .contains("default-src 'none'")
    );
    let b = Browser::start(1280, 1000).await;
    b.open(&page).await;
    b.wait_for("the first update", "return Number(document.body.dataset.updates) >= 1")
        .await;
    let rows = b
        .run(
            "return [...document.querySelectorAll('#rules tbody tr')].map(r => r.getAttribute('data-rule'))",
            json!([]),
        )
        .await;
    assert_eq!(rows, json!(["login", "per-key", "secret-tier"]));
    assert!(b.text("#store").await.contains("memory"));

    // Traffic: the counts and the top-limited list move without a reload.
    let c = client();
    // Short enough (64 bytes at most) to be kept in the key as sent.
    let script = "<script>pwned=1</script><img src=x onerror=pwned=2>";
    for _ in 0..6 {
        get(&c, &tg.url("/api/x"), &[("x-api-key", script)]).await;
    }
    b.wait_for(
        "a limited rate on per-key",
        "const t = document.querySelector('#rules tr[data-rule=\"per-key\"] .rate-limited'); return t && Number(t.textContent) > 0",
    )
    .await;
    let top = b
        .wait_for(
            "the caller in the top list",
            "const r = document.querySelector('#top tr.top-row'); return r && r.textContent",
        )
        .await;
    let top = top.as_str().unwrap();
    assert!(top.contains("per-key"), "{top}");
    assert!(top.contains(script), "the caller's value shown as text: {top}");
    let pwned = b
        .run(
            "return [window.pwned, document.querySelectorAll('#top img, #top script').length]",
            json!([]),
        )
        .await;
    assert_eq!(pwned, json!([null, 0]), "nothing a caller sent ran or became markup");
    // A right-to-left override or a zero-width space cannot disguise a value.
    for _ in 0..3 {
        get(&c, &tg.url("/api/x"), &[("x-api-key", "\u{202e}gnp.exe\u{200b}")]).await;
        get(&c, &tg.url("/api/x"), &[("x-api-key", "k1\u{34f}")]).await;
    }
    let shown = b
        .wait_for(
            "the disguised key in the top list",
            "return [...document.querySelectorAll('#top tr.top-row')].map(r => r.textContent).find(t => t.includes('gnp.exe'))",
        )
        .await;
    assert!(
        shown
            .as_str()
            .unwrap()
            .contains("\u{27e8}U+202E\u{27e9}gnp.exe\u{27e8}U+200B\u{27e9}"),
        "{shown}"
    );

    // The filter narrows the table as one types.
    b.type_into("#rules-filter", "secret").await;
    b.wait_for(
        "the filtered table",
        "return [...document.querySelectorAll('#rules tbody tr')].map(r => r.getAttribute('data-rule')).join(',') === 'secret-tier'",
    )
    .await;
    assert!(b.text("#rules-note").await.contains("1 of 3 rules match"));
    b.type_into("#rules-filter", "").await;
    b.wait_for(
        "the whole table again",
        "return document.querySelectorAll('#rules tbody tr').length === 3",
    )
    .await;

    // The explain form, filled in and submitted as a person would.
    b.type_into("#x-method", "GET").await;
    b.type_into("#x-path", "/api/y").await;
    b.type_into("#x-headers", &format!("x-api-key: {script}")).await;
    b.click("#x-submit").await;
    let verdict = b
        .wait_for(
            "the explain answer",
            "const v = document.querySelector('#explain-verdict'); return v && v.textContent",
        )
        .await;
    assert!(verdict.as_str().unwrap().contains("limited"), "{verdict}");
    assert!(
        verdict.as_str().unwrap().contains("denial cache"),
        "refused before: {verdict}"
    );
    let row = b.text("#explain-result tr.explain-row").await;
    assert!(row.contains("2 per 1m: remaining 0"), "{row}");
    assert!(row.contains("<script>"), "{row}");
    let pwned = b
        .run(
            "return [window.pwned, document.querySelectorAll('#explain-result img, #explain-result script').length]",
            json!([]),
        )
        .await;
    assert_eq!(pwned, json!([null, 0]));

    // A broken edit shows, with file:line, until a good file arrives; the
    // rule the good file changes is marked.
    std::fs::write(
        &tg.config,
        LIMITS.replace("requests: 3, per: 60s", "requests: three, per: 60s"),
    )
    .unwrap();
    let error = b
        .wait_for(
            "the reload error",
            "const e = document.querySelector('.file-error'); return e && e.textContent",
        )
        .await;
    let error = error.as_str().unwrap();
    assert!(error.contains("limits.yaml:"), "{error}");
    std::fs::write(
        &tg.config,
        LIMITS.replace("requests: 3, per: 60s", "requests: 30, per: 60s"),
    )
    .unwrap();
    b.wait_for("the error to go", "return !document.querySelector('.file-error')")
        .await;
    let changed = b
        .wait_for(
            "the changed rule marked",
            "return [...document.querySelectorAll('#rules tr')].filter(r => r.querySelector('.changed')).map(r => r.getAttribute('data-rule')).join(',')",
        )
        .await;
    assert_eq!(changed, "login");
    let windows = b.text("#rules tr[data-rule=\"login\"]").await;
    assert!(windows.contains("30 per 1m"), "{windows}");

    // Usable on a phone: nothing wider than the screen but the tables,
    // which scroll inside their own boxes.
    let b2 = Browser::start(390, 844).await;
    b2.open(&page).await;
    b2.wait_for("the first update", "return Number(document.body.dataset.updates) >= 1")
        .await;
    let overflow = b2
        .run(
            "return document.documentElement.scrollWidth - window.innerWidth",
            json!([]),
        )
        .await;
    assert!(
        overflow.as_i64().unwrap() <= 0,
        "the page scrolls sideways on a phone by {overflow} px"
    );
    // With --admin-token the page loads, asks for the token, and works.
    let guarded = Tollgate::start(LIMITS, up.addr, &["--admin-token", "t0ken"]);
    let api = get(&client(), &format!("http://{}/api/state", guarded.admin), &[]).await;
    assert_eq!(api.status, StatusCode::UNAUTHORIZED, "the data needs the token");
    b.open(&format!("http://{}/", guarded.admin)).await;
    b.wait_for(
        "the token prompt",
        "const a = document.querySelector('#auth'); return a && !a.hidden",
    )
    .await;
    b.type_into("#token", "t0ken").await;
    b.click("#token-save").await;
    b.wait_for(
        "an update with the token",
        "return Number(document.body.dataset.updates) >= 1",
    )
    .await;
    assert!(b.text("#rules").await.contains("secret-tier"));

    if let Ok(dir) = std::env::var("TOLLGATE_SCREENSHOTS") {
        std::fs::write(format!("{dir}/operator-page.png"), b.screenshot().await).unwrap();
        std::fs::write(format!("{dir}/operator-page-phone.png"), b2.screenshot().await).unwrap();
    }
}
