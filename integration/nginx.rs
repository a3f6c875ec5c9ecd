//! A real NGINX in front, configured with the snippets shipped in conf/nginx/.

use std::net::IpAddr;

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
    let snippet = repo_file("conf/nginx/tollgate_auth_request.conf");
    let nginx = Nginx::start(
        &format!(
            "upstream tollgate_check {{ server {}; keepalive 4; }}\nupstream app {{ server {}; }}",
            tg.check.unwrap(),
            app.addr
        ),
        &format!("    include {};", snippet.display()),
    );

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
