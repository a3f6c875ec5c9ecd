//! Many clients, bounded cost (issue 19): the connection bound an operator
//! sets and what a client sees at it, the keep-alive timeout, running out
//! of file descriptors, and the connection gauges in `/metrics`.

use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::common::*;

const NO_RULES: &str = "domain: d\nrules: []\n";

/// A keep-alive connection that has had one request answered.
async fn served(tg: &Tollgate) -> TcpStream {
    let mut s = TcpStream::connect(tg.addr).await.unwrap();
    assert!(
        answer(&mut s, Duration::from_secs(5)).await.is_some(),
        "a first request is answered"
    );
    s
}

/// Sends one GET on `s`; its status line, or `None` when nothing comes
/// within `limit`.
async fn answer(s: &mut TcpStream, limit: Duration) -> Option<String> {
    s.write_all(b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n").await.ok()?;
    // The test upstream answers an empty body; the head is enough.
    let got = read_until(s, limit, has_head).await?;
    let text = String::from_utf8_lossy(&got).into_owned();
    text.lines()
        .next()
        .filter(|l| l.starts_with("HTTP/1.1"))
        .map(str::to_string)
}

/// What `s` sends until `done` holds of it all, or `None` when the peer
/// closes first or `limit` passes.
async fn read_until(s: &mut TcpStream, limit: Duration, done: impl Fn(&[u8]) -> bool) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let read = async {
        while !done(&got) {
            match s.read(&mut buf).await {
                Ok(0) | Err(_) => return None,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
        Some(())
    };
    tokio::time::timeout(limit, read).await.ok()??;
    Some(got)
}

/// Whether `bytes` hold a whole message head.
fn has_head(bytes: &[u8]) -> bool {
    bytes.windows(4).any(|w| w == b"\r\n\r\n")
}

/// Whether the server closes `s` within `limit`.
async fn closed_within(s: &mut TcpStream, limit: Duration) -> bool {
    closes_after(s, limit).await.is_some()
}

/// A connection whose request head has begun and not ended: busy.
async fn midway(tg: &Tollgate) -> TcpStream {
    let mut s = TcpStream::connect(tg.addr).await.unwrap();
    s.write_all(b"GET /x HTTP/1.1\r\nHost: t\r\n").await.unwrap();
    s
}

#[tokio::test]
async fn at_the_connection_bound_new_clients_wait_and_are_served_when_one_closes() {
    let up = TestUpstream::start().await;
    // Several proxy threads: the bound is the process's, not each thread's.
    let tg = Tollgate::start(NO_RULES, up.addr, &["--max-connections", "3", "--proxy-threads", "2"]);
    // Busy connections hold their slots: two with a head on its way, one
    // with its request in flight (the upstream answers it in 6 s).
    let mut held = Vec::new();
    for _ in 0..2 {
        held.push(midway(&tg).await);
    }
    let mut in_flight = TcpStream::connect(tg.addr).await.unwrap();
    in_flight
        .write_all(b"GET /slow/6000 HTTP/1.1\r\nHost: t\r\n\r\n")
        .await
        .unwrap();
    let gauge = "tollgate_client_connections{listener=\"proxy\"}";
    let until = Instant::now() + Duration::from_secs(5);
    while metric(&tg, gauge).await != 3 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(metric(&tg, gauge).await, 3);
    // The fourth is accepted by the kernel but not served while three are open.
    let mut waiting = TcpStream::connect(tg.addr).await.unwrap();
    let early = tokio::spawn(async move {
        let status = answer(&mut waiting, Duration::from_secs(10)).await;
        (status, Instant::now(), waiting)
    });
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    assert!(!early.is_finished(), "a connection over the bound was served");
    assert!(tg.logged("connection limit reached"), "{}", tg.log_text());
    assert!(metric(&tg, "tollgate_connections_deferred_total{listener=\"proxy\"}").await >= 1);
    assert_eq!(
        metric(&tg, "tollgate_connections_reclaimed_total{listener=\"proxy\"}").await,
        0,
        "a busy connection is never closed to make room"
    );
    // One closes: the waiting client is served.
    let closed_at = Instant::now();
    drop(held.pop());
    let (status, at, _waiting) = early.await.unwrap();
    assert_eq!(status.as_deref(), Some("HTTP/1.1 200 OK"));
    assert!(at.duration_since(closed_at) < Duration::from_secs(2));
    // The warning is not repeated for every connection that waits.
    let lines = tg.log_text().matches("connection limit reached").count();
    assert_eq!(lines, 1, "{}", tg.log_text());
    // The request in flight was never closed to make room: it is answered.
    let slow = read_until(&mut in_flight, Duration::from_secs(10), has_head).await;
    let slow = String::from_utf8_lossy(&slow.expect("answered, not closed")).into_owned();
    assert!(slow.starts_with("HTTP/1.1 200"), "{slow}");
}

#[tokio::test]
async fn at_the_connection_bound_idle_connections_make_room() {
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(NO_RULES, up.addr, &["--max-connections", "4", "--proxy-threads", "2"]);
    // Two keep-alive connections idle after a request, and two that never
    // sent anything.
    let mut idle = vec![served(&tg).await, served(&tg).await];
    for _ in 0..2 {
        idle.push(TcpStream::connect(tg.addr).await.unwrap());
    }
    // A connection idle for less than a second is not closed: its next
    // request may be on its way.
    let mut fresh = TcpStream::connect(tg.addr).await.unwrap();
    let started = Instant::now();
    assert_eq!(
        answer(&mut fresh, Duration::from_secs(5)).await.as_deref(),
        Some("HTTP/1.1 200 OK"),
        "served once an idle one gave way"
    );
    let took = started.elapsed();
    assert!(took < Duration::from_secs(3), "{took:?}");
    let mut closed = 0;
    for s in &mut idle {
        if closed_within(s, Duration::from_millis(1_500)).await {
            closed += 1;
        }
    }
    assert!(closed >= 1, "an idle connection was closed for the new one");
    assert!(metric(&tg, "tollgate_connections_reclaimed_total{listener=\"proxy\"}").await >= 1);
    assert!(tg.logged("closing idle connections to make room"), "{}", tg.log_text());
    // Another new client is served too: what gave way made room for more.
    let mut next = TcpStream::connect(tg.addr).await.unwrap();
    assert_eq!(
        answer(&mut next, Duration::from_secs(5)).await.as_deref(),
        Some("HTTP/1.1 200 OK")
    );
}

/// An h2c connection that has had one request answered and then neither
/// reads nor writes: it never answers the PING of a graceful close.
async fn h2c_gone_silent(tg: &Tollgate) -> TcpStream {
    let mut s = TcpStream::connect(tg.addr).await.unwrap();
    let mut hello = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    hello.extend_from_slice(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00");
    // GET / on stream 1 (HPACK: :method GET, :scheme http, :path /,
    // :authority "t"), its only frame.
    hello.extend_from_slice(b"\x00\x00\x06\x01\x05\x00\x00\x00\x01\x82\x86\x84\x41\x01t");
    s.write_all(&hello).await.unwrap();
    // The server's SETTINGS and the response; acknowledge its SETTINGS.
    let mut got = Vec::new();
    let until = Instant::now() + Duration::from_millis(500);
    let mut buf = [0u8; 4096];
    while let Ok(read) = tokio::time::timeout(until.saturating_duration_since(Instant::now()), s.read(&mut buf)).await {
        match read {
            Ok(n) if n > 0 => got.extend_from_slice(&buf[..n]),
            _ => panic!("closed after {} bytes", got.len()),
        }
    }
    // SETTINGS, then the response's HEADERS and DATA: three frames at least.
    assert!(got.len() > 27, "{got:?}");
    s.write_all(b"\x00\x00\x00\x04\x01\x00\x00\x00\x00").await.unwrap();
    s
}

#[tokio::test]
async fn http2_connections_that_never_answer_the_closing_ping_do_not_keep_their_slot() {
    let up = TestUpstream::start().await;
    // At the bound: each is told to go away, does not answer, and is
    // dropped a few seconds later; the new client is served.
    let tg = Tollgate::start(NO_RULES, up.addr, &["--max-connections", "3", "--proxy-threads", "1"]);
    let mut silent = Vec::new();
    for _ in 0..3 {
        silent.push(h2c_gone_silent(&tg).await);
    }
    let mut fresh = TcpStream::connect(tg.addr).await.unwrap();
    let started = Instant::now();
    assert_eq!(
        answer(&mut fresh, Duration::from_secs(10)).await.as_deref(),
        Some("HTTP/1.1 200 OK"),
        "served once a silent one was dropped"
    );
    assert!(started.elapsed() < Duration::from_secs(6), "{:?}", started.elapsed());
    // Not at the bound: the keep-alive timeout closes one all the same.
    let tg = Tollgate::start(NO_RULES, up.addr, &["--keepalive-timeout", "1s"]);
    let mut s = h2c_gone_silent(&tg).await;
    assert!(
        closed_within(&mut s, Duration::from_secs(6)).await,
        "closed after the keep-alive timeout"
    );
    let open = "tollgate_client_connections{listener=\"proxy\"}";
    assert_eq!(settles_at_most(&tg, open, 0).await, 0);
}

#[tokio::test]
async fn at_the_connection_bound_an_eighth_of_the_idle_connections_give_way_at_a_time() {
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(NO_RULES, up.addr, &["--max-connections", "16", "--proxy-threads", "1"]);
    let mut idle = Vec::new();
    for _ in 0..16 {
        idle.push(served(&tg).await);
    }
    // Parked after a second idle.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let mut fresh = TcpStream::connect(tg.addr).await.unwrap();
    assert_eq!(
        answer(&mut fresh, Duration::from_secs(5)).await.as_deref(),
        Some("HTTP/1.1 200 OK")
    );
    // One new client needs one slot: NGINX closes an eighth of its
    // reusable connections when it runs out, not all of them.
    let mut closed = 0;
    for s in &mut idle {
        if closed_within(s, Duration::from_millis(100)).await {
            closed += 1;
        }
    }
    assert!((1..=4).contains(&closed), "{closed} of 16 closed for one new client");
}

#[tokio::test]
async fn idle_keep_alive_connections_are_closed_after_the_keepalive_timeout() {
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(NO_RULES, up.addr, &["--keepalive-timeout", "1s"]);
    let mut s = served(&tg).await;
    let started = Instant::now();
    assert!(closed_within(&mut s, Duration::from_secs(5)).await, "closed when idle");
    let took = started.elapsed();
    assert!(took >= Duration::from_millis(800), "not before the timeout: {took:?}");
    // A connection in use is not cut: requests one after another keep it.
    let mut busy = served(&tg).await;
    for _ in 0..4 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(answer(&mut busy, Duration::from_secs(2)).await.is_some());
    }
    let gauge = "tollgate_client_connections{listener=\"proxy\"}";
    let until = Instant::now() + Duration::from_secs(5);
    while metric(&tg, gauge).await != 0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(metric(&tg, gauge).await, 0, "every connection counted out when closed");
}

/// With `--keepalive-timeout` at `timeout`, idle connections (one after
/// another, `pauses` apart) are closed within `within` of their response.
async fn closed_idle_within(timeout: &str, within: std::ops::Range<Duration>, pauses: &[u64]) {
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(NO_RULES, up.addr, &["--keepalive-timeout", timeout]);
    for pause in pauses {
        tokio::time::sleep(Duration::from_millis(*pause)).await;
        let mut s = served(&tg).await;
        let started = Instant::now();
        assert!(closed_within(&mut s, Duration::from_secs(4)).await, "closed when idle");
        let took = started.elapsed();
        assert!(
            within.contains(&took),
            "closed {took:?} after its response, for {timeout}"
        );
    }
}

#[tokio::test]
async fn a_sub_second_keepalive_timeout_closes_idle_connections_in_time() {
    // From the 23rd attack: the watchdog looked again only every second,
    // so `300ms` closed an idle connection after a second, and a request
    // sent 0.7 s after the last response was still served.
    closed_idle_within(
        "300ms",
        Duration::from_millis(250)..Duration::from_millis(800),
        &[0, 0, 0],
    )
    .await;
}

#[tokio::test]
async fn idle_connections_are_closed_at_their_keepalive_timeout_not_a_sweep_later() {
    // From the 23rd attack: parked connections were looked at every half
    // second, so 1.5 s closed them after 1.5 to 2 s.
    closed_idle_within(
        "1500ms",
        Duration::from_millis(1_450)..Duration::from_millis(1_650),
        &[0, 170, 330],
    )
    .await;
}

#[tokio::test]
async fn a_head_begun_in_the_packet_of_the_request_before_gets_its_header_read_timeout_from_then() {
    // From the 23rd attack: the rest of the request before's packet (`G`)
    // got its header read timeout from the park a second later, not from
    // when it came (2 s acted as 3 s, and 500 ms as 2 s).
    let up = TestUpstream::start().await;
    for (timeout, ms) in [("2s", 2_000), ("500ms", 500)] {
        let tg = Tollgate::start(
            NO_RULES,
            up.addr,
            &["--header-read-timeout", timeout, "--keepalive-timeout", "30s"],
        );
        let mut s = TcpStream::connect(tg.addr).await.unwrap();
        s.write_all(b"GET /x HTTP/1.1\r\nHost: t\r\n\r\nG").await.unwrap();
        let answered = read_until(&mut s, Duration::from_secs(5), has_head).await;
        assert!(answered.is_some(), "the first is answered");
        let started = Instant::now();
        assert!(
            closed_within(&mut s, Duration::from_secs(5)).await,
            "the head that never ends is cut"
        );
        let took = started.elapsed();
        let within = Duration::from_millis(ms - 100)..Duration::from_millis(ms + 400);
        assert!(within.contains(&took), "cut {took:?} after the response, for {timeout}");
    }
}

#[tokio::test]
async fn at_the_connection_bound_the_longest_idle_give_way_first_on_every_thread() {
    // From the 23rd attack: each proxy thread parks its own connections,
    // and making room closed the first thread's longest idle before
    // another thread's that had been idle longer.
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(NO_RULES, up.addr, &["--max-connections", "8", "--proxy-threads", "2"]);
    let mut idle = Vec::new();
    for _ in 0..8 {
        idle.push(served(&tg).await);
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    // All parked (idle past a second); an eighth of the bound gives way at
    // a time: one per new client.
    tokio::time::sleep(Duration::from_millis(1_300)).await;
    let mut fresh = Vec::new();
    for n in 0..3 {
        let mut s = TcpStream::connect(tg.addr).await.unwrap();
        assert_eq!(
            answer(&mut s, Duration::from_secs(5)).await.as_deref(),
            Some("HTTP/1.1 200 OK"),
            "new client {n} served"
        );
        fresh.push(s);
        let mut gone = Vec::new();
        for (i, s) in idle.iter_mut().enumerate() {
            if closed_within(s, Duration::from_millis(50)).await {
                gone.push(i);
            }
        }
        assert_eq!(
            gone,
            (0..=n).collect::<Vec<_>>(),
            "closed, longest idle first, after new client {n}"
        );
    }
}

#[tokio::test]
async fn keepalive_timeout_zero_closes_after_each_response() {
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(NO_RULES, up.addr, &["--keepalive-timeout", "0"]);
    let answer = raw(tg.addr, b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n", Duration::from_secs(5)).await;
    // `raw` reads until the server closes, so the answer came whole.
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.to_ascii_lowercase().contains("connection: close"), "{answer}");
}

#[tokio::test]
async fn out_of_file_descriptors_the_proxy_keeps_serving_and_says_so_once() {
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(
        NO_RULES,
        up.addr,
        &["--max-connections", "100000", "--proxy-threads", "1"],
    );
    // Lower the running process's file limit to what it holds plus a few,
    // once each listener has served (and so opened what it keeps open).
    assert_eq!(get(&client(), &tg.url("/x"), &[]).await.status, 200);
    metric(&tg, "tollgate_client_connections{listener=\"proxy\"}").await;
    if let Some(check) = tg.check {
        get(&client(), &format!("http://{check}/"), &[]).await;
    }
    let open = std::fs::read_dir(format!("/proc/{}/fd", tg.pid())).unwrap().count();
    let limit = open + 8;
    let status = std::process::Command::new("prlimit")
        .args(["--pid", &tg.pid().to_string(), &format!("--nofile={limit}:{limit}")])
        .status()
        .unwrap();
    assert!(status.success());
    let mut flood = Vec::new();
    for _ in 0..40 {
        flood.push(TcpStream::connect(tg.addr).await.unwrap());
    }
    // Retried every 50 ms for two seconds, logged once.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let log = tg.log_text();
    let lines = log
        .lines()
        .filter(|l| l.contains("accept failed") && l.contains("proxy"))
        .count();
    assert_eq!(lines, 1, "one line, not one per retry: {log}");
    assert!(log.contains("file descriptors"), "{log}");
    // Once the flood goes, everyone is served again.
    drop(flood);
    let until = Instant::now() + Duration::from_secs(10);
    loop {
        let r = tokio::time::timeout(Duration::from_secs(1), get(&client(), &tg.url("/x"), &[])).await;
        if let Ok(a) = r
            && a.status == http::StatusCode::OK
        {
            break;
        }
        assert!(Instant::now() < until, "not served after the flood: {}", tg.log_text());
    }
    assert!(metric(&tg, "tollgate_accept_errors_total{listener=\"proxy\"}").await > 0);
}

/// An upstream that answers each request with `status_line` and closes its
/// connection.
async fn closing_upstream(status_line: &'static str) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                if read_until(&mut s, Duration::from_secs(30), has_head).await.is_none() {
                    return;
                }
                let answer = format!("{status_line}\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok");
                let _ = s.write_all(answer.as_bytes()).await;
            });
        }
    });
    addr
}

#[tokio::test]
async fn upstream_connections_are_counted_open_and_closed() {
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(NO_RULES, up.addr, &[]);
    let c = client();
    for _ in 0..3 {
        assert_eq!(get(&c, &tg.url("/x"), &[]).await.status, http::StatusCode::OK);
    }
    let gauge = "tollgate_upstream_connections ";
    assert!(metric(&tg, gauge).await >= 1, "a pooled upstream connection is open");
    // An upstream that closes after each answer leaves nothing open.
    let tg = Tollgate::start(NO_RULES, closing_upstream("HTTP/1.1 200 OK").await, &[]);
    for _ in 0..3 {
        assert_eq!(get(&c, &tg.url("/x"), &[]).await.status, http::StatusCode::OK);
    }
    let until = Instant::now() + Duration::from_secs(5);
    while metric(&tg, gauge).await != 0 && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(metric(&tg, gauge).await, 0, "closed by the upstream, counted out");
}

/// Waits up to 5 s for `gauge` to be at most `most`; its last value.
async fn settles_at_most(tg: &Tollgate, gauge: &str, most: u64) -> u64 {
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let now = metric(tg, gauge).await;
        if now <= most || Instant::now() > until {
            return now;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_burst_leaves_at_most_upstream_keepalive_idle_upstream_connections() {
    let up = TestUpstream::start().await;
    let gauge = "tollgate_upstream_connections ";
    let c = client();
    let burst = |tg: &Tollgate| {
        let url = tg.url("/slow/300");
        let calls: Vec<_> = (0..12)
            .map(|_| {
                let (c, url) = (c.clone(), url.clone());
                tokio::spawn(async move { get(&c, &url, &[]).await.status })
            })
            .collect();
        async move {
            for call in calls {
                assert_eq!(call.await.unwrap(), http::StatusCode::OK);
            }
        }
    };
    // As NGINX's `keepalive 3`: twelve at once need twelve connections,
    // three stay for what comes next.
    let tg = Tollgate::start(
        NO_RULES,
        up.addr,
        &["--proxy-threads", "1", "--upstream-keepalive", "3"],
    );
    burst(&tg).await;
    assert_eq!(
        settles_at_most(&tg, gauge, 3).await,
        3,
        "the surplus closed, three kept"
    );
    for _ in 0..5 {
        assert_eq!(get(&c, &tg.url("/x"), &[]).await.status, http::StatusCode::OK);
    }
    assert_eq!(
        metric(&tg, gauge).await,
        3,
        "requests after the burst reuse the kept ones"
    );
    // 0: none kept.
    let tg = Tollgate::start(
        NO_RULES,
        up.addr,
        &["--proxy-threads", "1", "--upstream-keepalive", "0"],
    );
    burst(&tg).await;
    assert_eq!(get(&c, &tg.url("/x"), &[]).await.status, http::StatusCode::OK);
    assert_eq!(
        settles_at_most(&tg, gauge, 0).await,
        0,
        "each closed after its response"
    );
}

#[tokio::test]
async fn an_http_1_0_upstream_does_not_end_the_clients_keep_alive() {
    let tg = Tollgate::start(NO_RULES, closing_upstream("HTTP/1.0 200 OK").await, &[]);
    let mut s = TcpStream::connect(tg.addr).await.unwrap();
    for i in 0..3 {
        s.write_all(b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n").await.unwrap();
        // The whole response: its head and the two-byte body.
        let got = read_until(&mut s, Duration::from_secs(5), |b| b.ends_with(b"\r\n\r\nok")).await;
        let text = String::from_utf8_lossy(got.as_deref().unwrap_or_default());
        assert!(
            text.starts_with("HTTP/1.1 200 OK\r\n"),
            "request {i} on one connection: {text:?}"
        );
        assert!(text.ends_with("ok"), "request {i}: {text:?}");
    }
}

#[tokio::test]
async fn the_default_bound_is_half_the_raised_file_limit_left_after_a_reserve() {
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(NO_RULES, up.addr, &["--keepalive-timeout", "500000000y"]);
    assert!(tg.logged("client connections bounded"), "{}", tg.log_text());
    // The soft limit was raised to the hard one.
    let limits = std::fs::read_to_string(format!("/proc/{}/limits", tg.pid())).unwrap();
    let files: Vec<u64> = limits
        .lines()
        .find(|l| l.starts_with("Max open files"))
        .unwrap()
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    assert_eq!(files.first(), files.get(1), "{limits}");
    let want = (files[0] - 256) / 2;
    assert!(
        tg.log_text().contains(&format!("max_connections={want} ")),
        "{}",
        tg.log_text()
    );
    // A keep-alive timeout far past any clock still serves.
    assert!(answer(&mut served(&tg).await, Duration::from_secs(5)).await.is_some());
}

#[tokio::test]
async fn an_idle_keep_alive_connection_gets_the_keepalive_timeout_and_a_begun_head_the_header_one() {
    // HTTP/1.0 keep-alive connections are never parked: an independent
    // tester found them (and TLS ones) closed at --header-read-timeout
    // while idle, not --keepalive-timeout.
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(
        NO_RULES,
        up.addr,
        &["--keepalive-timeout", "5s", "--header-read-timeout", "1500ms"],
    );
    let request = b"GET /x HTTP/1.0\r\nHost: t\r\nConnection: keep-alive\r\n\r\n";
    let mut s = TcpStream::connect(tg.addr).await.unwrap();
    let mut buf = vec![0u8; 4096];
    for round in 0..2 {
        s.write_all(request).await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .unwrap()
            .unwrap();
        let head = String::from_utf8_lossy(&buf[..n]).to_ascii_lowercase();
        assert!(head.starts_with("http/1.0 200"), "round {round}: {head}");
        assert!(head.contains("connection: keep-alive"), "round {round}: {head}");
        // Idle past the header read timeout, within the keep-alive one.
        tokio::time::sleep(Duration::from_secs(3)).await;
    }
    // A head begun and never finished has the header read timeout.
    s.write_all(b"GET /slow HTTP/1.0\r\nHost: t\r\n").await.unwrap();
    let started = Instant::now();
    let closed = tokio::time::timeout(Duration::from_secs(4), s.read(&mut buf)).await;
    assert!(matches!(closed, Ok(Ok(0)) | Ok(Err(_))), "closed: {closed:?}");
    let took = started.elapsed();
    assert!(
        took >= Duration::from_millis(1200) && took < Duration::from_millis(3500),
        "closed {took:?} after the head began"
    );
}

#[tokio::test]
async fn every_request_on_a_connection_is_held_to_the_header_byte_bound() {
    // README: 64 KiB of headers. An independent tester got 131 KB through
    // on a connection's second request (hyper bounds only the first).
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(NO_RULES, up.addr, &[]);
    let big = format!(
        "GET /x HTTP/1.1\r\nHost: t\r\n{}\r\n",
        (0..40)
            .map(|i| format!("x-big-{i}: {}\r\n", "v".repeat(2500)))
            .collect::<String>()
    );
    let mut s = TcpStream::connect(tg.addr).await.unwrap();
    s.write_all(b"GET /x HTTP/1.1\r\nHost: t\r\n\r\n").await.unwrap();
    let mut buf = vec![0u8; 8192];
    let n = s.read(&mut buf).await.unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));
    s.write_all(big.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), async {
        while let Ok(n) = s.read(&mut buf).await {
            if n == 0 {
                break;
            }
            answer.extend_from_slice(&buf[..n]);
            if answer.windows(4).any(|w| w == b"\r\n\r\n") {
                break;
            }
        }
    })
    .await;
    assert!(
        String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 431"),
        "a 100 KB head on the second request: {}",
        String::from_utf8_lossy(&answer)
    );
}
