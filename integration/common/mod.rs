//! Real processes and sockets for the end-to-end tests: `redis-server` on a
//! free loopback port, a small upstream HTTP server in this process, and the
//! real `tollgate` binary. Everything is killed when its handle drops.

#![allow(dead_code)]

pub mod browser;

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpListener as StdListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    StdListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A `redis-server` of our own, on loopback, with nothing persisted.
pub struct RedisServer {
    child: Child,
    pub port: u16,
    dir: tempfile::TempDir,
    extra: Vec<String>,
}

impl RedisServer {
    pub fn start() -> RedisServer {
        Self::start_with(&[])
    }

    pub fn start_with(extra: &[&str]) -> RedisServer {
        let extra: Vec<String> = extra.iter().map(|s| s.to_string()).collect();
        for _ in 0..5 {
            let port = free_port();
            let dir = tempfile::tempdir().unwrap();
            let child = spawn_redis(port, dir.path(), &extra);
            let mut server = RedisServer {
                child,
                port,
                dir,
                extra: extra.clone(),
            };
            if server.wait_ready() {
                return server;
            }
            let _ = server.child.kill();
        }
        panic!("could not start redis-server");
    }

    /// Kills the server outright (SIGKILL), as a crash would.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Starts it again on the same port, empty (nothing is persisted).
    pub fn restart(&mut self) {
        self.kill();
        self.child = spawn_redis(self.port, self.dir.path(), &self.extra);
        assert!(self.wait_ready(), "redis-server did not come back on {}", self.port);
    }

    /// Sends a signal (STOP, CONT) to the server.
    pub fn signal(&self, sig: &str) {
        Command::new("kill")
            .args([&format!("-{sig}"), &self.child.id().to_string()])
            .status()
            .unwrap();
    }

    fn wait_ready(&mut self) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if self.cli(&["PING"]).map(|o| o.trim() == "PONG").unwrap_or(false) {
                return true;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        false
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    /// Runs one command through `redis-cli` and returns its raw output.
    pub fn cli(&self, args: &[&str]) -> Option<String> {
        let mut cmd = Command::new("redis-cli");
        // A server started with --requirepass is asked with that password.
        if let Some(i) = self.extra.iter().position(|a| a == "--requirepass") {
            cmd.env("REDISCLI_AUTH", &self.extra[i + 1]);
        }
        let out = cmd
            .args(["-p", &self.port.to_string(), "--raw"])
            .args(args)
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn_redis(port: u16, dir: &Path, extra: &[String]) -> Child {
    Command::new("redis-server")
        .args([
            "--port",
            &port.to_string(),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
        ])
        .args(["--dir", dir.to_str().unwrap()])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("redis-server must be installed (the test command installs it)")
}

/// A running `tollgate` binary.
pub struct Tollgate {
    child: Child,
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub grpc: Option<SocketAddr>,
    pub check: Option<SocketAddr>,
    pub logs: Arc<Mutex<Vec<String>>>,
    pub config: PathBuf,
    _dir: tempfile::TempDir,
}

impl Tollgate {
    /// Starts tollgate with `limits` (YAML) in front of `upstream`.
    pub fn start(limits: &str, upstream: SocketAddr, extra: &[&str]) -> Tollgate {
        Self::start_with_env(limits, upstream, extra, &[])
    }

    /// As `start`, with extra environment variables for the process.
    pub fn start_with_env(limits: &str, upstream: SocketAddr, extra: &[&str], env: &[(&str, &str)]) -> Tollgate {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("limits.yaml");
        std::fs::write(&config, limits).unwrap();
        let mut args: Vec<String> = vec![
            "--config".into(),
            config.display().to_string(),
            "--upstream".into(),
            format!("http://{upstream}"),
            "--listen".into(),
            "127.0.0.1:0".into(),
            "--admin-listen".into(),
            "127.0.0.1:0".into(),
            "--grpc-listen".into(),
            "127.0.0.1:0".into(),
            "--check-listen".into(),
            "127.0.0.1:0".into(),
        ];
        args.extend(extra.iter().map(|s| s.to_string()));
        Self::spawn_with_env(&args, config, dir, env)
    }

    /// Starts tollgate with `limits` in front of `upstream` given as a URL
    /// (`https://…`, `h2c://…`), proxy and admin on free loopback ports.
    pub fn start_upstream_url(limits: &str, upstream: &str, extra: &[&str]) -> Tollgate {
        let dir = tempfile::tempdir().unwrap();
        let config = dir.path().join("limits.yaml");
        std::fs::write(&config, limits).unwrap();
        let mut args: Vec<String> = vec![
            "--config".into(),
            config.display().to_string(),
            "--upstream".into(),
            upstream.into(),
        ];
        for a in [
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
            "--grpc-listen",
            "off",
        ] {
            args.push(a.into());
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        Self::spawn(&args, config, dir)
    }

    /// Starts tollgate as a pure rate limit service (no `--upstream`) over
    /// these limits files, RLS and admin on free loopback ports.
    pub fn start_rls(files: &[PathBuf], extra: &[&str]) -> Tollgate {
        let mut args: Vec<String> = Vec::new();
        for f in files {
            args.push("--config".into());
            args.push(f.display().to_string());
        }
        for a in [
            "--admin-listen",
            "127.0.0.1:0",
            "--grpc-listen",
            "127.0.0.1:0",
            "--listen",
            "127.0.0.1:0",
        ] {
            args.push(a.into());
        }
        args.extend(extra.iter().map(|s| s.to_string()));
        let config = files.first().cloned().unwrap_or_default();
        Self::spawn(&args, config, tempfile::tempdir().unwrap())
    }

    /// Starts the binary with exactly these arguments.
    pub fn spawn(args: &[String], config: PathBuf, dir: tempfile::TempDir) -> Tollgate {
        Self::spawn_with_env(args, config, dir, &[])
    }

    pub fn spawn_with_env(args: &[String], config: PathBuf, dir: tempfile::TempDir, env: &[(&str, &str)]) -> Tollgate {
        let mut child = Command::new(binary())
            .args(args)
            .envs(env.iter().copied())
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let logs = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        let stderr = child.stderr.take().unwrap();
        let sink = logs.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if line.contains("listening") {
                    let _ = tx.send(line.clone());
                }
                sink.lock().unwrap().push(line);
            }
        });
        let line = match rx.recv_timeout(Duration::from_secs(10)) {
            Ok(line) => line,
            Err(_) => {
                let _ = child.kill();
                panic!("tollgate did not start: {:?}", logs.lock().unwrap());
            }
        };
        // A pure rate limit service (no --upstream) has no proxy listener.
        let addr = field(&line, "proxy=").unwrap_or_else(|| SocketAddr::from(([0, 0, 0, 0], 0)));
        let admin = field(&line, "admin=").unwrap();
        let grpc = field(&line, "grpc=");
        let check = field(&line, "check=");
        Tollgate {
            child,
            addr,
            admin,
            grpc,
            check,
            logs,
            config,
            _dir: dir,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn signal(&self, sig: &str) {
        Command::new("kill")
            .args([&format!("-{sig}"), &self.pid().to_string()])
            .status()
            .unwrap();
    }

    /// Waits for the process to exit and returns whether it exited cleanly.
    pub fn wait_exit(&mut self, limit: Duration) -> Option<bool> {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status.success());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn log_text(&self) -> String {
        self.logs.lock().unwrap().join("\n")
    }

    /// Whether a log line containing `needle` arrives within 5 s (stderr is
    /// read by another thread, so a line may land just after the response).
    pub fn logged(&self, needle: &str) -> bool {
        let until = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            if self.log_text().contains(needle) {
                return true;
            }
            if std::time::Instant::now() > until {
                return false;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

impl Drop for Tollgate {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An address from the "listening" line, human or JSON (`None` for a
/// listener that is off).
fn field(line: &str, name: &str) -> Option<SocketAddr> {
    if line.starts_with('{') {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        return v["fields"][name.trim_end_matches('=')].as_str()?.parse().ok();
    }
    let start = line.find(name).unwrap_or_else(|| panic!("no {name} in {line}")) + name.len();
    let rest = &line[start..];
    let end = rest.find(|c: char| c.is_whitespace()).unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// The tollgate the end-to-end tests run: this build's, or the one
/// `TOLLGATE_TEST_BINARY` names (`scripts/build`'s profile-guided release,
/// to hold the shipped binary to the same tests).
pub fn binary() -> &'static Path {
    static BINARY: std::sync::LazyLock<std::path::PathBuf> = std::sync::LazyLock::new(|| {
        std::env::var_os("TOLLGATE_TEST_BINARY")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| env!("CARGO_BIN_EXE_tollgate").into())
    });
    &BINARY
}

/// A small upstream in this process. Paths:
/// - `/echo...`: answers 200 with the request body, and the request's
///   method, path and headers as `x-seen-*` response headers
/// - `/bytes/N`: N bytes of a known pattern
/// - `/slow/MS`: answers after MS milliseconds
/// - `/status/N`: answers status N
/// - `/hop`: sets hop-by-hop headers and two Set-Cookie lines
/// - `/ws`: answers 101 and then echoes every byte
pub struct TestUpstream {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
    pub hits: Arc<std::sync::atomic::AtomicUsize>,
    /// Connections accepted.
    pub connections: Arc<std::sync::atomic::AtomicUsize>,
}

impl Drop for TestUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

pub fn pattern(n: usize) -> Vec<u8> {
    (0..n).map(|i| (i % 251) as u8).collect()
}

impl TestUpstream {
    pub async fn start() -> TestUpstream {
        Self::start_on("127.0.0.1:0").await
    }

    /// On a given address (an upstream coming back where one was down).
    pub async fn start_on(addr: &str) -> TestUpstream {
        let listener = TcpListener::bind(addr).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let hits = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let connections = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counter = hits.clone();
        let accepted = connections.clone();
        let task = tokio::spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                accepted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                let counter = counter.clone();
                tokio::spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        upstream_handle(req)
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .with_upgrades()
                        .await;
                });
            }
        });
        TestUpstream {
            addr,
            task,
            hits,
            connections,
        }
    }

    pub fn hits(&self) -> usize {
        self.hits.load(std::sync::atomic::Ordering::SeqCst)
    }
}

type UpBody = http_body_util::combinators::UnsyncBoxBody<Bytes, hyper::Error>;

async fn upstream_handle(mut req: Request<Incoming>) -> Result<Response<UpBody>, std::convert::Infallible> {
    let path = req.uri().path().to_string();
    let full = |b: Vec<u8>| Full::new(Bytes::from(b)).map_err(|never| match never {}).boxed_unsync();
    if let Some(n) = path.strip_prefix("/bytes/") {
        return Ok(Response::new(full(pattern(n.parse().unwrap()))));
    }
    // The same bytes with no length declared: hyper sends them chunked.
    if let Some(n) = path.strip_prefix("/chunked/") {
        let data = Bytes::from(pattern(n.parse().unwrap()));
        let pieces: Vec<Result<hyper::body::Frame<Bytes>, hyper::Error>> = data
            .chunks(1000)
            .map(|c| Ok(hyper::body::Frame::data(Bytes::copy_from_slice(c))))
            .collect();
        return Ok(Response::new(
            http_body_util::StreamBody::new(tokio_stream::iter(pieces)).boxed_unsync(),
        ));
    }
    if let Some(ms) = path.strip_prefix("/slow/") {
        tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
        return Ok(Response::new(full(b"slow".to_vec())));
    }
    if let Some(code) = path.strip_prefix("/status/") {
        let mut r = Response::new(full(format!("upstream says {code}").into_bytes()));
        *r.status_mut() = StatusCode::from_u16(code.parse().unwrap()).unwrap();
        return Ok(r);
    }
    if path == "/hop" {
        let r = Response::builder()
            .header("connection", "x-hop-secret")
            .header("x-hop-secret", "1")
            .header("keep-alive", "timeout=5")
            .header("set-cookie", "a=1")
            .header("set-cookie", "b=2")
            .body(full(b"hop".to_vec()))
            .unwrap();
        return Ok(r);
    }
    if path == "/ws" {
        let upgrade = hyper::upgrade::on(&mut req);
        tokio::spawn(async move {
            if let Ok(upgraded) = upgrade.await {
                let mut io = TokioIo::new(upgraded);
                let mut buf = [0u8; 1024];
                while let Ok(n) = io.read(&mut buf).await {
                    if n == 0 || io.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            }
        });
        let r = Response::builder()
            .status(StatusCode::SWITCHING_PROTOCOLS)
            .header("upgrade", "websocket")
            .header("connection", "upgrade")
            // The upstream's own, which tollgate's replace when it tells them.
            .header("ratelimit-policy", "\"upstream\";q=10;w=10")
            .header("ratelimit", "\"upstream\";r=9;t=10")
            .header("ratelimit", "\"upstream-2\";r=8;t=10")
            .body(full(Vec::new()))
            .unwrap();
        return Ok(r);
    }
    // Echo: stream the body straight back, describe the request in headers.
    let mut builder = Response::builder()
        .header("x-seen-method", req.method().as_str())
        .header("x-seen-uri", req.uri().to_string());
    for (name, value) in req.headers() {
        builder = builder.header(format!("x-seen-{name}"), value.clone());
    }
    Ok(builder.body(req.into_body().boxed_unsync()).unwrap())
}

/// An HTTP/1.1 client for tests.
/// The HTTP client the tests use.
pub type TestClient = Client<HttpConnector, Full<Bytes>>;

/// A runtime for a property test's cases to block on (proptest's body is
/// not async), with one worker beside the test's thread for the servers
/// it starts.
pub fn property_runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap()
}

pub fn client() -> TestClient {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

/// A finished response: status, headers, whole body.
#[derive(Debug)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|_| panic!("not JSON: {:?}", self.body))
    }
}

pub async fn send(
    client: &Client<HttpConnector, Full<Bytes>>,
    method: Method,
    url: &str,
    headers: &[(&str, &str)],
    body: Vec<u8>,
) -> Answer {
    let mut req = Request::builder().method(method).uri(url);
    for (k, v) in headers {
        // As bytes, so a value may carry UTF-8 as NGINX forwards it.
        req = req.header(*k, http::HeaderValue::from_bytes(v.as_bytes()).unwrap());
    }
    let resp = client
        .request(req.body(Full::new(Bytes::from(body))).unwrap())
        .await
        .expect("request failed");
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.expect("body failed").to_bytes();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

pub async fn get(client: &Client<HttpConnector, Full<Bytes>>, url: &str, headers: &[(&str, &str)]) -> Answer {
    send(client, Method::GET, url, headers, Vec::new()).await
}

/// `/metrics` as text, after checking that it holds each of `lines`.
pub async fn metrics_holding(tg: &Tollgate, lines: &[&str]) -> String {
    let body = get(&client(), &format!("http://{}/metrics", tg.admin), &[]).await.body;
    let text = String::from_utf8_lossy(&body).into_owned();
    for line in lines {
        assert!(text.contains(line), "missing {line}:\n{text}");
    }
    text
}

/// The decisions counted for ten requests to an `enforced` rule of 3 a
/// minute beside a `watching` shadow rule of 1: three admitted, one refused
/// by the store, six by the denial cache, and the shadow rule never refusing.
pub const SHADOW_BESIDE_A_CACHED_REFUSAL: &[&str] = &[
    "tollgate_decisions_total{rule=\"enforced\",outcome=\"allowed\"} 3",
    "tollgate_decisions_total{rule=\"enforced\",outcome=\"limited\"} 1",
    "tollgate_decisions_total{rule=\"enforced\",outcome=\"limited_cached\"} 6",
    "tollgate_decisions_total{rule=\"watching\",outcome=\"allowed\"} 1",
    "tollgate_decisions_total{rule=\"watching\",outcome=\"shadow_limited\"} 9",
];

/// The value of the first `/metrics` series starting with `name` (0 when absent).
pub async fn metric(tg: &Tollgate, name: &str) -> u64 {
    let body = get(&client(), &format!("http://{}/metrics", tg.admin), &[]).await.body;
    String::from_utf8_lossy(&body)
        .lines()
        .find(|l| l.starts_with(name))
        .and_then(|l| l.split_whitespace().last()?.parse::<f64>().ok())
        .map_or(0, |v| v as u64)
}

/// How long after now the server closes `s` (reading and dropping what
/// comes), or `None` within `limit`.
pub async fn closes_after<S: tokio::io::AsyncRead + Unpin>(s: &mut S, limit: Duration) -> Option<Duration> {
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        let left = limit.checked_sub(started.elapsed())?;
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return Some(started.elapsed()),
            Ok(Ok(_)) => continue,
            Err(_) => return None,
        }
    }
}

/// Sends raw bytes and reads until the server closes or `limit` passes.
pub async fn raw(addr: SocketAddr, request: &[u8], limit: Duration) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(limit, stream.read_to_end(&mut out)).await;
    String::from_utf8_lossy(&out).into_owned()
}

/// One request from a chosen loopback source address (127.0.0.2 ...), so
/// tests can play several clients behind a proxy.
pub async fn get_from(source: std::net::IpAddr, addr: SocketAddr, path: &str, headers: &[(&str, &str)]) -> Answer {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(SocketAddr::new(source, 0)).unwrap();
    let stream = socket.connect(addr).await.unwrap();
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    let mut req = Request::builder().uri(path).header("host", "app.example");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let resp = sender
        .send_request(req.body(Full::new(Bytes::new())).unwrap())
        .await
        .unwrap();
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Answer {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

/// A real `nginx` on a free loopback port, configured with `server_body`
/// inside `server { listen ...; }` and `http_extra` beside it.
pub struct Nginx {
    child: Child,
    pub addr: SocketAddr,
    dir: tempfile::TempDir,
}

impl Nginx {
    pub fn start(http_extra: &str, server_body: &str) -> Nginx {
        let dir = tempfile::tempdir().unwrap();
        // Workers run as an unprivileged user and need the temp paths.
        let open = std::os::unix::fs::PermissionsExt::from_mode(0o777);
        std::fs::set_permissions(dir.path(), open).unwrap();
        let port = free_port();
        let d = dir.path().display();
        let conf = format!(
            "worker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\nevents {{ worker_connections 512; }}\n\
             http {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n\
             fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n\
             {http_extra}\n  server {{\n    listen 127.0.0.1:{port};\n{server_body}\n  }}\n}}\n"
        );
        let path = dir.path().join("nginx.conf");
        std::fs::write(&path, conf).unwrap();
        let bin = if Path::new("/usr/sbin/nginx").exists() {
            "/usr/sbin/nginx"
        } else {
            "nginx"
        };
        let child = Command::new(bin)
            .args([
                "-p",
                &d.to_string(),
                "-c",
                &path.display().to_string(),
                "-g",
                "daemon off;",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("nginx must be installed (the test command installs it)");
        let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
        let nginx = Nginx { child, addr, dir };
        let deadline = Instant::now() + Duration::from_secs(5);
        while std::net::TcpStream::connect(addr).is_err() {
            assert!(Instant::now() < deadline, "nginx did not start: {}", nginx.error_log());
            std::thread::sleep(Duration::from_millis(20));
        }
        nginx
    }

    pub fn error_log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("error.log")).unwrap_or_default()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // A killed master leaves its worker running (and listening): ask
        // the master to stop its workers first, and kill only if it hangs.
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + Duration::from_secs(3);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A file of this repository, by path from its root.
pub fn repo_file(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// An HTTP/2 cleartext (prior knowledge) connection to `addr`, driven in
/// the background.
pub async fn h2_sender(addr: SocketAddr) -> hyper::client::conn::http2::SendRequest<Full<Bytes>> {
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), TokioIo::new(stream))
        .await
        .unwrap();
    tokio::spawn(conn);
    sender
}

/// One upstream connection that answers `200 ok` to each request whose head
/// it reads (logging each request's method in `log`) until a request finds
/// it idle `idle_for` or more since its last answer: then it sends that
/// request only `cut` (nothing, or the start of an answer) and returns
/// `true`, for the caller to end the connection (an upstream's idle timeout
/// crossing the request on the wire, or one failing mid-answer). `false`:
/// the client went away first.
pub async fn answer_until_idle<S>(stream: &mut S, log: &Mutex<Vec<String>>, idle_for: Duration, cut: &[u8]) -> bool
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let mut buf = Vec::new();
    let mut answered: Option<Instant> = None;
    loop {
        let mut chunk = [0u8; 4096];
        let n = match stream.read(&mut chunk).await {
            Ok(n) if n > 0 => n,
            _ => return false,
        };
        buf.extend_from_slice(&chunk[..n]);
        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
            continue;
        };
        let head = String::from_utf8_lossy(&buf[..end]).to_string();
        buf.drain(..end + 4);
        log.lock()
            .unwrap()
            .push(head.split(' ').next().unwrap_or("").to_string());
        if answered.is_some_and(|at| at.elapsed() >= idle_for) {
            if !cut.is_empty() {
                let _ = stream.write_all(cut).await;
                let _ = stream.flush().await;
            }
            return true;
        }
        let ok = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
        if stream.write_all(ok).await.is_err() || stream.flush().await.is_err() {
            return false;
        }
        answered = Some(Instant::now());
    }
}

/// A tiny deterministic generator, so a failing random sequence can be
/// replayed from its seed.
pub struct Rng(pub u64);

impl Rng {
    /// The next number below `n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

/// Reads one whole response from `s` (its head and `content-length` body,
/// or chunked body; for an answer to HEAD, `head_only`, its head), keeping
/// what follows in `rest`. `None`: closed or timed out.
pub async fn read_response<S: tokio::io::AsyncRead + Unpin>(
    s: &mut S,
    rest: &mut Vec<u8>,
    limit: Duration,
    head_only: bool,
) -> Option<String> {
    let deadline = Instant::now() + limit;
    let mut buf = [0u8; 8192];
    loop {
        if let Some(end) = whole_response(rest, head_only) {
            let text = String::from_utf8_lossy(&rest[..end]).into_owned();
            rest.drain(..end);
            return Some(text);
        }
        let left = deadline.saturating_duration_since(Instant::now());
        match tokio::time::timeout(left, s.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => rest.extend_from_slice(&buf[..n]),
            _ => return None,
        }
    }
}

/// Where the first whole response in `bytes` ends.
fn whole_response(bytes: &[u8], head_only: bool) -> Option<usize> {
    let head_end = bytes.windows(4).position(|w| w == b"\r\n\r\n")? + 4;
    if head_only {
        return Some(head_end);
    }
    let head = String::from_utf8_lossy(&bytes[..head_end]).to_ascii_lowercase();
    if head.contains("transfer-encoding: chunked") {
        let end = bytes[head_end..].windows(5).position(|w| w == b"0\r\n\r\n")?;
        return Some(head_end + end + 5);
    }
    let length = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:"))
        .map_or(0, |v| v.trim().parse::<usize>().unwrap());
    (bytes.len() >= head_end + length).then_some(head_end + length)
}

/// One tollgate on the memory store and one on a Redis started here, with
/// the same `limits` in front of `upstream` (the Redis server is returned
/// to be kept alive as long as they are).
pub fn on_both_stores(limits: &str, upstream: SocketAddr) -> (RedisServer, [Tollgate; 2]) {
    let redis = RedisServer::start();
    let memory = Tollgate::start(limits, upstream, &[]);
    let shared = Tollgate::start(limits, upstream, &["--redis", &redis.url()]);
    (redis, [memory, shared])
}
