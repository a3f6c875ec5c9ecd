//! The training load of tollgate's profile-guided build (`scripts/build`):
//! runs an instrumented tollgate in front of an upstream of its own and
//! sends it the traffic a deployment sees, on the memory store and, given a
//! Redis, on Redis, so the compiler learns which branches are hot from
//! real requests rather than guesses.
//!
//! `pgo_train TOLLGATE_BINARY [REDIS_URL]`
//!
//! Every surface takes part, each with what makes most of its traffic:
//! - the proxy: plain and browser-sized GETs on keep-alive connections (as
//!   wrk and browsers send), queries, POSTs with bodies, HEADs, a refused
//!   caller answered from the denial cache, a few HTTP/2 requests, in a
//!   file of 1,500 rules (services and tenants with rules of their own);
//! - Envoy's RLS (gRPC), on a hot descriptor and on many;
//! - NGINX `auth_request` and Envoy `ext_authz` on the check listener;
//! - `/metrics`.
//!
//! Each tollgate is stopped with SIGINT, so it exits the way a deployment's
//! does and writes its profile. Exits non-zero if any part fails: a build
//! trained on nothing would be slower than one not trained at all.

#[path = "load_common.rs"]
#[allow(dead_code)] // its latency summary is the load generators'
mod load_common;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use http::{Method, Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// How long each store is trained.
const SECONDS: u64 = 4;
/// Keep-alive connections the proxy's load keeps (wrk's `-c` in bench/run is 64).
const CONNECTIONS: usize = 32;
/// Concurrent RLS callers.
const RLS_CALLERS: usize = 8;

const LIMITS: &str = "domain: train
rules:
  - name: per-ip
    by: [client_ip]
    limits: [{ requests: 1000000000, per: 1m }]
  - name: login
    match: { path: /login }
    by: [client_ip]
    limits: [{ requests: 1, per: 1h }]
  - name: api-key
    match: { path: /api/* }
    by: [\"header:x-api-key\"]
    limits:
      - { requests: 1000000000, per: 1s }
      - { requests: 1000000000, per: 1d, precision: 1m }
  - name: rls-address
    descriptor: [{ key: remote_address }]
    limits: [{ requests: 1000000000, per: 1m }]
";

/// Services and tenants given rules of their own besides [`LIMITS`]'s, as
/// a deployment in front of many has (bench/rules measures 10,000): the
/// rule index is trained on a large file, not only on a handful.
const SERVICES: usize = 1000;
const TENANTS: usize = 500;

/// The training's limits file.
fn limits_file() -> String {
    let mut file = LIMITS.to_string();
    for i in 0..SERVICES {
        file.push_str(&format!(
            "  - name: svc{i}\n    match: {{ path: '/svc{i}/*' }}\n    by: [client_ip]\n    limits: [{{ requests: 1000000000, per: 1m }}]\n"
        ));
    }
    for i in 0..TENANTS {
        file.push_str(&format!(
            "  - name: tenant{i}\n    match: {{ path: '/tenant/*', headers: {{ x-tenant: t{i} }} }}\n    by: [client_ip]\n    limits: [{{ requests: 1000000000, per: 1m }}]\n"
        ));
    }
    file
}

#[tokio::main]
async fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(binary) = args.get(1) else {
        eprintln!("usage: pgo_train TOLLGATE_BINARY [REDIS_URL]");
        std::process::exit(2);
    };
    let dir = std::env::temp_dir().join(format!("tollgate-pgo-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temporary directory");
    let limits = dir.join("limits.yaml");
    std::fs::write(&limits, limits_file()).expect("limits file");
    let upstream = upstream().await;

    let mut stores = vec![None];
    if let Some(redis) = args.get(2) {
        stores.push(Some(redis.clone()));
    }
    let mut failed = false;
    for redis in stores {
        let store = if redis.is_some() { "redis" } else { "memory" };
        match train(binary, &limits, upstream, redis.as_deref()).await {
            Ok(counts) => eprintln!("pgo_train: {store}: {counts}"),
            Err(e) => {
                eprintln!("pgo_train: {store}: {e}");
                failed = true;
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
    if failed {
        std::process::exit(1);
    }
}

/// An upstream answering every request `200` with a small body (its own
/// body read first), as the benchmarks' NGINX `return 200` does.
async fn upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("upstream listener");
    let addr = listener.local_addr().expect("upstream address");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let service = hyper::service::service_fn(|req: Request<Incoming>| async move {
                    let _ = req.into_body().collect().await;
                    Ok::<_, std::convert::Infallible>(
                        Response::builder()
                            .header("content-type", "text/plain")
                            .body(Full::new(Bytes::from_static(b"ok")))
                            .expect("response"),
                    )
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

/// A free loopback port.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// One store's training: tollgate started, loaded, stopped.
async fn train(
    binary: &str,
    limits: &std::path::Path,
    upstream: SocketAddr,
    redis: Option<&str>,
) -> Result<String, String> {
    let (proxy, grpc, check, admin) = (free_port(), free_port(), free_port(), free_port());
    let mut command = Command::new(binary);
    command
        .arg("--config")
        .arg(limits)
        .args(["--upstream", &format!("http://{upstream}")])
        .args(["--listen", &format!("127.0.0.1:{proxy}")])
        .args(["--grpc-listen", &format!("127.0.0.1:{grpc}")])
        .args(["--check-listen", &format!("127.0.0.1:{check}")])
        .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        // Only the flags above: a `TOLLGATE_REDIS` or `REDIS_URL` of the
        // shell that builds would put the memory store's training on it.
        .env_clear();
    if let Some(file) = std::env::var_os("LLVM_PROFILE_FILE") {
        command.env("LLVM_PROFILE_FILE", file);
    }
    if let Some(url) = redis {
        command.args(["--redis", url]);
    }
    let mut child = command.spawn().map_err(|e| format!("cannot start {binary}: {e}"))?;
    let result = load(proxy, grpc, check, admin).await;
    stop(&mut child)?;
    result
}

/// Stops tollgate as a deployment does (SIGINT: it drains and exits, writing
/// its profile) and waits for it.
fn stop(child: &mut Child) -> Result<(), String> {
    let pid = libc::pid_t::try_from(child.id()).map_err(|_| "pid out of range".to_string())?;
    // SAFETY: kill(2) on the child this process started and has not reaped.
    unsafe { libc::kill(pid, libc::SIGINT) };
    let status = child.wait().map_err(|e| format!("waiting for tollgate: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("tollgate exited with {status}"))
    }
}

/// The traffic, all surfaces at once, for [`SECONDS`].
async fn load(proxy: u16, grpc: u16, check: u16, admin: u16) -> Result<String, String> {
    let started = Instant::now();
    while TcpStream::connect(("127.0.0.1", proxy)).await.is_err() {
        if started.elapsed() > Duration::from_secs(30) {
            return Err("tollgate did not listen within 30 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(SECONDS);
    let mut tasks = Vec::new();
    for worker in 0..CONNECTIONS {
        tasks.push(tokio::spawn(proxy_client(proxy, worker, deadline)));
    }
    tasks.push(tokio::spawn(h2_client(proxy, deadline)));
    tasks.push(tokio::spawn(check_client(check, deadline)));
    tasks.push(tokio::spawn(metrics_client(admin, deadline)));
    let channels = load_common::channels(&format!("http://127.0.0.1:{grpc}"), RLS_CALLERS).await;
    for worker in 0..RLS_CALLERS {
        let channel = channels
            .get(worker % channels.len())
            .cloned()
            .ok_or("no gRPC channel")?;
        tasks.push(tokio::spawn(rls_client(channel, worker, deadline)));
    }
    let mut answers = 0u64;
    for task in tasks {
        answers += task.await.map_err(|e| format!("a client panicked: {e}"))??;
    }
    // Failing open, tollgate answers without its store: every request
    // would count as trained while the store's paths ran none.
    let failures = store_failures(admin).await?;
    if failures > 0 {
        return Err(format!("the store failed {failures} times: its paths went untrained"));
    }
    Ok(format!("{answers} answers in {SECONDS} s"))
}

/// The admin listener's `/metrics`, on a connection of its own (as a scraper).
async fn scrape(admin: u16) -> Result<String, String> {
    let mut sender = http1(admin).await?;
    let req = Request::get("/metrics")
        .header("host", "127.0.0.1")
        .body(Full::default())
        .map_err(|e| format!("request: {e}"))?;
    let response = sender.send_request(req).await.map_err(|e| format!("/metrics: {e}"))?;
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("/metrics body: {e}"))?
        .to_bytes();
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// `tollgate_store_errors_total`, summed over its kinds, from `/metrics`.
async fn store_failures(admin: u16) -> Result<u64, String> {
    Ok(scrape(admin)
        .await?
        .lines()
        .filter(|l| l.starts_with("tollgate_store_errors_total"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum())
}

/// Sends `req` on an HTTP/1.1 connection, reading the whole answer.
async fn send(
    sender: &mut hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    req: Request<Full<Bytes>>,
) -> Result<u16, String> {
    let response = sender
        .send_request(req)
        .await
        .map_err(|e| format!("proxy request: {e}"))?;
    let status = response.status().as_u16();
    response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("proxy body: {e}"))?;
    Ok(status)
}

/// The requests of a mixed API's traffic, in their proportions (of 20):
/// mostly GETs, some with a browser's head, some to a refused caller, some
/// to the services and tenants with rules of their own.
fn proxy_requests(host: &str) -> Vec<(Vec<u8>, bool)> {
    const BROWSER: &str = "user-agent: Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/130.0 Safari/537.36\r\n\
        accept: text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8\r\naccept-language: en-US,en;q=0.9\r\n\
        accept-encoding: gzip, deflate, br\r\ncookie: session=3f2a9c; theme=dark\r\nreferer: http://example.com/\r\n\
        cache-control: max-age=0\r\nupgrade-insecure-requests: 1\r\nsec-fetch-mode: navigate\r\n";
    let body = r#"{"item":42,"quantity":1}"#;
    (0..20u32)
        .map(|n| {
            let head = match n {
                0 => format!(
                    "POST /api/orders HTTP/1.1\r\nhost: {host}\r\nx-api-key: key-{n}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
                    body.len()
                ),
                1 => format!("GET /login HTTP/1.1\r\nhost: {host}\r\n\r\n"),
                2 => format!("HEAD / HTTP/1.1\r\nhost: {host}\r\n\r\n"),
                3..=6 => format!("GET /products/{n}?page={n}&sort=price HTTP/1.1\r\nhost: {host}\r\n{BROWSER}\r\n"),
                7 | 8 => format!("GET /api/items/{n} HTTP/1.1\r\nhost: {host}\r\nx-api-key: key-{n}\r\naccept: application/json\r\n\r\n"),
                9 | 10 => format!("GET /svc{}/items HTTP/1.1\r\nhost: {host}\r\n\r\n", n as usize * 53 % SERVICES),
                11 => format!("GET /tenant/items HTTP/1.1\r\nhost: {host}\r\nx-tenant: t{}\r\n\r\n", n as usize * 29 % TENANTS),
                _ => format!("GET / HTTP/1.1\r\nhost: {host}\r\n\r\n"),
            };
            (head.into_bytes(), n == 2)
        })
        .collect()
}

/// One keep-alive connection to the proxy, written to and read as wrk
/// does (bytes made once, the answer's length read from its head): cheap
/// enough, even built without optimisation, to load tollgate as a busy
/// deployment does, batching its Redis calls.
async fn proxy_client(port: u16, worker: usize, deadline: Instant) -> Result<u64, String> {
    let requests = proxy_requests(&format!("127.0.0.1:{port}"));
    let mut stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let mut buf = vec![0u8; 64 * 1024];
    let mut answers = 0u64;
    let mut n = worker;
    while Instant::now() < deadline {
        n = n.wrapping_add(1);
        let (request, head_only) = requests.get(n % requests.len()).ok_or("no request")?;
        stream
            .write_all(request)
            .await
            .map_err(|e| format!("proxy write: {e}"))?;
        let mut have = 0;
        let (head_end, length) = loop {
            let read = stream
                .read(&mut buf[have..])
                .await
                .map_err(|e| format!("proxy read: {e}"))?;
            if read == 0 {
                return Err("proxy closed the connection".into());
            }
            have += read;
            if let Some(end) = buf[..have].windows(4).position(|w| w == b"\r\n\r\n") {
                break (
                    end + 4,
                    content_length(&buf[..end]).ok_or("an answer without content-length")?,
                );
            }
            if have == buf.len() {
                return Err("an answer head over 64 KB".into());
            }
        };
        let mut body = have - head_end;
        let want = if *head_only { 0 } else { length };
        while body < want {
            let read = stream.read(&mut buf).await.map_err(|e| format!("proxy read: {e}"))?;
            if read == 0 {
                return Err("proxy closed the connection".into());
            }
            body += read;
        }
        answers += 1;
    }
    Ok(answers)
}

/// The `content-length` of an answer's head.
fn content_length(head: &[u8]) -> Option<usize> {
    let text = std::str::from_utf8(head).ok()?;
    text.split("\r\n").find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.eq_ignore_ascii_case("content-length")
            .then(|| value.trim().parse().ok())?
    })
}

/// HTTP/2 with prior knowledge to the proxy (gRPC-web fronts, h2c clients).
async fn h2_client(port: u16, deadline: Instant) -> Result<u64, String> {
    let stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let (mut sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
        .await
        .map_err(|e| format!("h2 handshake: {e}"))?;
    tokio::spawn(conn);
    let mut answers = 0u64;
    while Instant::now() < deadline {
        let req = Request::get(format!("http://127.0.0.1:{port}/h2/{answers}"))
            .body(Full::<Bytes>::default())
            .map_err(|e| format!("request: {e}"))?;
        let response = sender.send_request(req).await.map_err(|e| format!("h2 request: {e}"))?;
        response
            .into_body()
            .collect()
            .await
            .map_err(|e| format!("h2 body: {e}"))?;
        answers += 1;
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    Ok(answers)
}

/// An HTTP/1.1 connection to `port`, driven in the background.
async fn http1(port: u16) -> Result<hyper::client::conn::http1::SendRequest<Full<Bytes>>, String> {
    let stream = TcpStream::connect(("127.0.0.1", port))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| format!("handshake: {e}"))?;
    tokio::spawn(conn);
    Ok(sender)
}

/// NGINX `auth_request` and Envoy `ext_authz` subrequests on the check listener.
async fn check_client(port: u16, deadline: Instant) -> Result<u64, String> {
    let mut sender = http1(port).await?;
    let mut answers = 0u64;
    while Instant::now() < deadline {
        let req = if answers.is_multiple_of(2) {
            Request::get("/auth_request")
                .header("host", "127.0.0.1")
                .header("x-original-uri", format!("/api/items/{answers}"))
                .header("x-original-method", "GET")
                .header("x-api-key", "key-1")
        } else {
            Request::builder()
                .method(Method::POST)
                .uri(format!("/ext_authz/api/items/{answers}"))
                .header("host", "api.example")
                .header("x-api-key", "key-2")
        }
        .body(Full::default())
        .map_err(|e| format!("request: {e}"))?;
        send(&mut sender, req).await?;
        answers += 1;
    }
    Ok(answers)
}

/// A Prometheus scrape a second.
async fn metrics_client(port: u16, deadline: Instant) -> Result<u64, String> {
    let mut answers = 0u64;
    while Instant::now() < deadline {
        scrape(port).await?;
        answers += 1;
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    Ok(answers)
}

/// Envoy's RLS calls: one hot descriptor for half the callers, many for the rest.
async fn rls_client(channel: tonic::transport::Channel, worker: usize, deadline: Instant) -> Result<u64, String> {
    let mut client = RateLimitServiceClient::new(channel);
    let mut answers = 0u64;
    while Instant::now() < deadline {
        let value = if worker.is_multiple_of(2) {
            "hot".to_string()
        } else {
            format!("10.0.{}.{}", worker, answers % 250)
        };
        client
            .should_rate_limit(load_common::remote_address("train", value))
            .await
            .map_err(|e| format!("RLS call: {e}"))?;
        answers += 1;
    }
    Ok(answers)
}
