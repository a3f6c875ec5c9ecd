//! A real NGINX in front, configured with the snippets shipped in conf/nginx/.

use std::net::IpAddr;
use std::time::Duration;

use http::StatusCode;

use crate::common::*;

const PER_CLIENT: &str = "\
domain: it
rules:
  - name: login
    match: { path: /login }
    by: [client_ip]
    limits: [{ requests: 3, per: 30s }]
";

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[tokio::test]
async fn auth_request_snippet_turns_refusals_into_429() {
    let app = TestUpstream::start().await;
    let tg = Tollgate::start(PER_CLIENT, app.addr, &["--trusted-proxies", "127.0.0.1/32"]);
    let nginx = nginx_with_snippet(&tg, &app);

    let alice = ip("127.0.0.2");
    for i in 0..3 {
        let a = get_from(alice, nginx.addr, "/login?user=a", &[]).await;
        assert_eq!(a.status, StatusCode::OK, "request {i}: {}", nginx.error_log());
        assert_eq!(a.header("x-seen-uri"), Some("/login?user=a"), "reached the app");
        assert_eq!(
            a.header("ratelimit"),
            Some(format!("\"login\";r={};t=30", 2 - i).as_str())
        );
    }
    let refused = get_from(alice, nginx.addr, "/login?user=a", &[]).await;
    assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS, "{}", nginx.error_log());
    let retry: u64 = refused.header("retry-after").unwrap().parse().unwrap();
    assert!((1..=30).contains(&retry), "{retry}");
    assert_eq!(refused.header("ratelimit-policy"), Some("\"login\";q=3;w=30"));
    assert!(refused.header("ratelimit").unwrap().starts_with("\"login\";r=0;t="));
    assert_eq!(app.hits(), 3, "the refused request never reached the app");

    // Another client behind the same NGINX has its own counter, even if it
    // claims to be alice in its own X-Forwarded-For.
    let bob = get_from(
        ip("127.0.0.3"),
        nginx.addr,
        "/login",
        &[("x-forwarded-for", "127.0.0.2")],
    )
    .await;
    assert_eq!(bob.status, StatusCode::OK);

    // A 403 from the application itself stays a 403, body and all.
    let own = get_from(alice, nginx.addr, "/status/403", &[]).await;
    assert_eq!(own.status, StatusCode::FORBIDDEN);
    assert_eq!(own.body, "upstream says 403");
    assert!(own.header("retry-after").is_none());
}

#[tokio::test]
async fn nginx_in_front_of_the_proxy_keys_on_the_real_client() {
    let app = TestUpstream::start().await;
    let tg = Tollgate::start(PER_CLIENT, app.addr, &["--trusted-proxies", "127.0.0.1/32"]);
    let snippet = repo_file("conf/nginx/tollgate_proxy.conf");
    let nginx = Nginx::start(
        &format!("upstream tollgate {{ server {}; keepalive 4; }}", tg.addr),
        &format!("    include {};", snippet.display()),
    );
    for client in ["127.0.0.2", "127.0.0.3"] {
        for i in 0..3 {
            // Spoofed addresses in the client's own header change nothing.
            let spoof = format!("10.9.9.{i}");
            let a = get_from(ip(client), nginx.addr, "/login", &[("x-forwarded-for", &spoof)]).await;
            assert_eq!(a.status, StatusCode::OK, "{client} #{i}: {}", nginx.error_log());
            assert_eq!(
                a.header("x-seen-x-forwarded-for"),
                Some(format!("{spoof}, {client}, 127.0.0.1").as_str())
            );
        }
        let refused = get_from(ip(client), nginx.addr, "/login", &[]).await;
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS, "{client}");
        assert!(refused.header("retry-after").is_some());
    }
}

/// tollgate behind a real NGINX with the shipped auth_request snippet.
fn nginx_with_snippet(tg: &Tollgate, app: &TestUpstream) -> Nginx {
    let snippet = repo_file("conf/nginx/tollgate_auth_request.conf");
    Nginx::start(
        &format!(
            "upstream tollgate_check {{ server {}; keepalive 4; }}\nupstream app {{ server {}; }}",
            tg.check.unwrap(),
            app.addr
        ),
        &format!("    include {};", snippet.display()),
    )
}

#[tokio::test]
async fn the_snippet_carries_the_rules_status_and_body_through() {
    let app = TestUpstream::start().await;
    let limits = "\
domain: it
rules:
  - name: teapot
    match: { path: /tea }
    status: 418
    limits: [{ requests: 1, per: 30s }]
  - name: busy
    match: { path: /busy }
    status: 503
    limits: [{ requests: 1, per: 30s }]
  - name: costly
    match: { path: /status/* }
    cost: header:x-cost
    limits: [{ requests: 10, per: 30s }]
";
    let tg = Tollgate::start(limits, app.addr, &["--trusted-proxies", "127.0.0.1/32"]);
    let nginx = nginx_with_snippet(&tg, &app);
    let me = ip("127.0.0.2");
    assert_eq!(get_from(me, nginx.addr, "/tea", &[]).await.status, StatusCode::OK);
    let tea = get_from(me, nginx.addr, "/tea", &[]).await;
    assert_eq!(tea.status.as_u16(), 418, "{}", nginx.error_log());
    assert_eq!(tea.json()["rule"], "teapot");
    assert!(tea.header("retry-after").is_some());
    assert!(tea.header("ratelimit-policy").is_some());

    assert_eq!(get_from(me, nginx.addr, "/busy", &[]).await.status, StatusCode::OK);
    let busy = get_from(me, nginx.addr, "/busy", &[]).await;
    assert_eq!(busy.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(busy.json()["error"], "rate_limited", "a limit, not an outage");

    // tollgate's own 400 is the client's 400, not NGINX's 500.
    let bad = get_from(me, nginx.addr, "/status/200", &[("x-cost", "-3")]).await;
    assert_eq!(bad.status, StatusCode::BAD_REQUEST, "{}", nginx.error_log());
    assert!(String::from_utf8_lossy(&bad.body).contains("x-cost"));

    // As many headers as NGINX itself passes on reach tollgate whole and
    // are counted (a 431 there would have failed open, uncounted).
    let many: Vec<(String, String)> = (0..96).map(|i| (format!("x-h{i}"), "v".to_string())).collect();
    let mut many: Vec<(&str, &str)> = many.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    many.push(("x-cost", "10"));
    let r = get_from(me, nginx.addr, "/status/200", &many).await;
    assert_eq!(r.status, StatusCode::OK, "{}", nginx.error_log());
    let r = get_from(me, nginx.addr, "/status/200", &[]).await;
    assert_eq!(r.status, StatusCode::TOO_MANY_REQUESTS, "the 10 units were counted");
    assert_eq!(
        app.hits(),
        3,
        "tea, busy and the costly one reached the app; nothing else"
    );
}

#[tokio::test]
async fn the_snippet_fails_open_when_tollgate_is_unreachable() {
    let app = TestUpstream::start().await;
    let mut tg = Tollgate::start(PER_CLIENT, app.addr, &["--trusted-proxies", "127.0.0.1/32"]);
    let nginx = nginx_with_snippet(&tg, &app);
    tg.signal("KILL");
    tg.wait_exit(Duration::from_secs(5));
    let r = get_from(ip("127.0.0.2"), nginx.addr, "/login", &[]).await;
    assert_eq!(
        r.status,
        StatusCode::OK,
        "an explicit fail-open, not a 500: {}",
        nginx.error_log()
    );
    assert_eq!(r.header("x-seen-uri"), Some("/login"));
}
