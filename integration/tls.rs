//! TLS on both sides (issue 17), with certificates `openssl` makes here (a
//! throwaway CA, server and client certificates), curl and a Rust client
//! as the TLS clients, and a real NGINX serving TLS as the upstream.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper_util::rt::TokioIo;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

use crate::common::*;

/// The names a server certificate holds unless a test says otherwise.
const LOCAL: &str = "DNS:localhost,IP:127.0.0.1";

const LIMITS: &str = "\
domain: tls
rules:
  - name: per_client
    match: { path: /limited }
    limits: [{ requests: 2, per: 60s }]
";

/// A throwaway certificate authority and the certificates it signs.
struct Pki {
    dir: tempfile::TempDir,
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("openssl must be installed (the test command installs it)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A self-signed certificate for `subject` with `extensions`, made in
/// `dir` as `<name>.pem` and `<name>.key` (EC P-256, two days).
fn self_signed(dir: &Path, name: &str, subject: &str, extensions: &[&str]) -> (PathBuf, PathBuf) {
    let (pem, key) = (format!("{name}.pem"), format!("{name}.key"));
    let mut args = vec![
        "req",
        "-x509",
        "-newkey",
        "ec",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-nodes",
        "-keyout",
        &key,
        "-out",
        &pem,
        "-days",
        "2",
        "-subj",
        subject,
    ];
    for extension in extensions {
        args.extend(["-addext", extension]);
    }
    openssl(dir, &args);
    (dir.join(pem), dir.join(key))
}

impl Pki {
    fn new() -> Pki {
        let dir = tempfile::tempdir().unwrap();
        self_signed(
            dir.path(),
            "ca",
            "/CN=tollgate test CA",
            &[
                "basicConstraints=critical,CA:TRUE",
                "keyUsage=critical,keyCertSign,cRLSign",
            ],
        );
        Pki { dir }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn ca(&self) -> PathBuf {
        self.path("ca.pem")
    }

    /// A certificate for `cn` signed by this CA, as `<name>.pem` and
    /// `<name>.key`: a server's for the names in `san`, else a client's.
    fn leaf(&self, name: &str, cn: &str, san: Option<&str>) -> (PathBuf, PathBuf) {
        let ext = match san {
            Some(san) => format!("subjectAltName={san}\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"),
            None => "basicConstraints=CA:FALSE\nextendedKeyUsage=clientAuth\n".to_string(),
        };
        std::fs::write(self.path(&format!("{name}.ext")), ext).unwrap();
        let (key, csr, pem, extfile) = (
            format!("{name}.key"),
            format!("{name}.csr"),
            format!("{name}.pem"),
            format!("{name}.ext"),
        );
        let subj = format!("/CN={cn}");
        openssl(
            self.dir.path(),
            &[
                "req",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:P-256",
                "-nodes",
                "-keyout",
                &key,
                "-out",
                &csr,
                "-subj",
                &subj,
            ],
        );
        openssl(
            self.dir.path(),
            &[
                "x509",
                "-req",
                "-in",
                &csr,
                "-CA",
                "ca.pem",
                "-CAkey",
                "ca.key",
                "-CAcreateserial",
                "-out",
                &pem,
                "-days",
                "2",
                "-extfile",
                &extfile,
            ],
        );
        (self.path(&pem), self.path(&key))
    }
}

/// What a TLS request got back.
struct TlsAnswer {
    status: u16,
    body: Bytes,
    /// The server's leaf certificate.
    peer: Vec<u8>,
    alpn: Option<Vec<u8>>,
}

/// One GET over a fresh TLS connection to `addr` (as `localhost`),
/// trusting `ca`, offering `alpn`, with a client certificate when given.
async fn tls_get(
    addr: std::net::SocketAddr,
    ca: &Path,
    path: &str,
    client_cert: Option<(&Path, &Path)>,
) -> Result<TlsAnswer, String> {
    tls_get_with(addr, ca, path, client_cert, &[]).await
}

/// As [`tls_get`], with request headers.
async fn tls_get_with(
    addr: std::net::SocketAddr,
    ca: &Path,
    path: &str,
    client_cert: Option<(&Path, &Path)>,
    headers: &[(&str, &str)],
) -> Result<TlsAnswer, String> {
    let session = connect_tls(addr, ca, client_cert).await?;
    let peer = session
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .map(|c| c.to_vec())
        .unwrap_or_default();
    let alpn = session.get_ref().1.alpn_protocol().map(|p| p.to_vec());
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(session))
        .await
        .map_err(|e| format!("http: {e}"))?;
    tokio::spawn(conn);
    let mut req = http::Request::get(path).header("host", "localhost");
    for (name, value) in headers {
        req = req.header(*name, *value);
    }
    let req = req.body(Empty::<Bytes>::new()).unwrap();
    let response = sender.send_request(req).await.map_err(|e| format!("request: {e}"))?;
    let status = response.status().as_u16();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|e| format!("body: {e}"))?
        .to_bytes();
    Ok(TlsAnswer {
        status,
        body,
        peer,
        alpn,
    })
}

/// A TLS session with `addr` (as `localhost`, ALPN `http/1.1`), trusting
/// `ca`, with a client certificate when given.
async fn connect_tls(
    addr: std::net::SocketAddr,
    ca: &Path,
    client_cert: Option<(&Path, &Path)>,
) -> Result<tokio_rustls::client::TlsStream<tokio::net::TcpStream>, String> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let mut config = match client_cert {
        Some((cert, key)) => {
            let chain: Vec<_> = CertificateDer::pem_file_iter(cert)
                .unwrap()
                .map(|c| c.unwrap())
                .collect();
            builder
                .with_client_auth_cert(chain, PrivateKeyDer::from_pem_file(key).unwrap())
                .unwrap()
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let connector = tokio_rustls::TlsConnector::from(Arc::new(config));
    let tcp = tokio::net::TcpStream::connect(addr).await.map_err(|e| e.to_string())?;
    connector
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await
        .map_err(|e| format!("handshake: {e}"))
}

#[tokio::test]
async fn sessions_silent_after_their_handshake_give_way_at_the_connection_bound() {
    let pki = Pki::new();
    let (cert, key) = pki.leaf("server", "localhost", Some(LOCAL));
    let up = TestUpstream::start().await;
    let mut args = tls_args(&cert, &key);
    args.extend(["--max-connections", "2", "--proxy-threads", "1"]);
    let tg = Tollgate::start(LIMITS, up.addr, &args);
    let ca = pki.ca();
    // A handshake finished, then nothing: as idle as a silent TCP socket.
    let mut silent = Vec::new();
    for _ in 0..2 {
        silent.push(connect_tls(tg.addr, &ca, None).await.unwrap());
    }
    let started = Instant::now();
    let answer = tls_get(tg.addr, &ca, "/echo", None).await.unwrap();
    assert_eq!(answer.status, 200);
    // Well inside the 10 s header read timeout that used to be the wait.
    assert!(started.elapsed() < Duration::from_secs(4), "{:?}", started.elapsed());
    assert!(metric(&tg, "tollgate_connections_reclaimed_total{listener=\"proxy\"}").await >= 1);
}

fn der_of(pem: &Path) -> Vec<u8> {
    CertificateDer::pem_file_iter(pem)
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .to_vec()
}

/// curl over TLS: `(http version, status, body)`. Run as a child the
/// test's runtime awaits, so the upstream it serves keeps answering.
async fn curl(addr: std::net::SocketAddr, ca: &Path, path: &str, extra: &[&str]) -> (String, String, String) {
    let url = format!("https://localhost:{}{path}", addr.port());
    let resolve = format!("localhost:{}:127.0.0.1", addr.port());
    let out = tokio::process::Command::new("curl")
        .args(["-sS", "--max-time", "5", "--cacert"])
        .arg(ca)
        .args(["--resolve", &resolve, "-w", "\n%{http_version} %{http_code}"])
        .args(extra)
        .arg(&url)
        .output()
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, last) = text.rsplit_once('\n').unwrap_or(("", &text));
    let (version, code) = last.split_once(' ').unwrap_or(("", ""));
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (version.to_string(), code.to_string(), format!("{body}{stderr}"))
}

/// A copy of a certificate and key in a directory of their own, as the
/// files tollgate serves and a test then changes: (dir, cert, key).
fn live_pair(cert: &Path, key: &Path) -> (tempfile::TempDir, PathBuf, PathBuf) {
    let live = tempfile::tempdir().unwrap();
    let (c, k) = (live.path().join("tls.crt"), live.path().join("tls.key"));
    std::fs::copy(cert, &c).unwrap();
    std::fs::copy(key, &k).unwrap();
    (live, c, k)
}

fn tls_args<'a>(cert: &'a Path, key: &'a Path) -> Vec<&'a str> {
    vec!["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()]
}

#[tokio::test]
async fn curl_reaches_the_upstream_over_https_with_http1_and_h2_and_the_limits_hold() {
    let pki = Pki::new();
    let (cert, key) = pki.leaf("server", "localhost", Some(LOCAL));
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(LIMITS, up.addr, &tls_args(&cert, &key));
    let ca = pki.ca();
    let (version, code, body) = curl(tg.addr, &ca, "/echo", &["--http1.1", "-D", "-"]).await;
    assert_eq!((version.as_str(), code.as_str()), ("1.1", "200"), "{body}");
    assert!(
        body.to_ascii_lowercase().contains("x-seen-x-forwarded-proto: https"),
        "the upstream is told the client came over TLS:\n{body}"
    );
    let (version, code, body) = curl(tg.addr, &ca, "/echo", &["--http2", "-D", "-"]).await;
    assert_eq!(
        (version.as_str(), code.as_str()),
        ("2", "200"),
        "ALPN picks h2:\n{body}"
    );
    assert!(
        body.to_ascii_lowercase().contains("x-seen-x-forwarded-proto: https"),
        "{body}"
    );
    // The limits are the same over TLS: two, then refused.
    for expected in ["200", "200", "429"] {
        let (_, code, body) = curl(tg.addr, &ca, "/limited", &["--http2"]).await;
        assert_eq!(code, expected, "{body}");
    }
    // TLS 1.2 is served; 1.1 and below are refused; plain HTTP on the TLS port gets no answer.
    let (_, code, body) = curl(tg.addr, &ca, "/echo", &["--tls-max", "1.2"]).await;
    assert_eq!(code, "200", "{body}");
    let (_, code, body) = curl(tg.addr, &ca, "/echo", &["--tls-max", "1.1", "--tlsv1"]).await;
    assert_eq!(code, "000", "TLS 1.1 must fail: {body}");
    let plain = raw(tg.addr, b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", Duration::from_secs(3)).await;
    assert!(!plain.starts_with("HTTP/1.1 200"), "{plain}");
    // Both failed handshakes are counted for the operator (the count may
    // come a moment after the client sees the socket closed).
    let mut failed = 0;
    for _ in 0..40 {
        failed = metric(&tg, "tollgate_tls_handshake_failures_total{listener=\"proxy\"}").await;
        if failed >= 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(failed, 2, "TLS 1.1 and plain HTTP");
    // A client-sent X-Forwarded-Proto is not believed from an untrusted peer.
    let (_, code, body) = curl(tg.addr, &ca, "/echo", &["-D", "-", "-H", "X-Forwarded-Proto: http"]).await;
    assert_eq!(code, "200");
    assert!(
        body.to_ascii_lowercase().contains("x-seen-x-forwarded-proto: https"),
        "{body}"
    );
}

#[tokio::test]
async fn a_plain_listener_tells_the_upstream_http() {
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(LIMITS, up.addr, &[]);
    let answer = get(&client(), &tg.url("/echo"), &[]).await;
    assert_eq!(answer.header("x-seen-x-forwarded-proto"), Some("http"));
}

#[tokio::test]
async fn a_certificate_swapped_on_disk_is_served_without_failing_a_request() {
    let pki = Pki::new();
    let (first, first_key) = pki.leaf("first", "localhost", Some(LOCAL));
    let (second, second_key) = pki.leaf("second", "localhost", Some(LOCAL));
    // The files tollgate reads, replaced as cert-manager's symlink swap does.
    let live = tempfile::tempdir().unwrap();
    let link = |target: &Path, name: &str| {
        let tmp = live.path().join(format!("{name}.tmp"));
        let _ = std::fs::remove_file(&tmp);
        std::os::unix::fs::symlink(target, &tmp).unwrap();
        std::fs::rename(&tmp, live.path().join(name)).unwrap();
    };
    link(&first, "tls.crt");
    link(&first_key, "tls.key");
    let (cert, key) = (live.path().join("tls.crt"), live.path().join("tls.key"));
    let up = TestUpstream::start().await;
    let tg = Tollgate::start("domain: tls\nrules: []\n", up.addr, &tls_args(&cert, &key));
    let ca = pki.ca();
    assert_eq!(tls_get(tg.addr, &ca, "/echo", None).await.unwrap().peer, der_of(&first));

    // Requests flow, each on a new connection, while the pair is swapped.
    let stop = Arc::new(AtomicBool::new(false));
    let (done, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let flow = {
        let (stop, done, failed, ca, addr) = (stop.clone(), done.clone(), failed.clone(), ca.clone(), tg.addr);
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                match tls_get(addr, &ca, "/echo", None).await {
                    Ok(a) if a.status == 200 => done.fetch_add(1, Ordering::Relaxed),
                    _ => failed.fetch_add(1, Ordering::Relaxed),
                };
            }
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    link(&second, "tls.crt");
    link(&second_key, "tls.key");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let served = tls_get(tg.addr, &ca, "/echo", None).await.unwrap().peer;
        if served == der_of(&second) {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the new certificate was never served"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    flow.await.unwrap();
    assert!(done.load(Ordering::Relaxed) > 10, "requests flowed");
    assert_eq!(failed.load(Ordering::Relaxed), 0, "no request failed during the swap");
    assert!(tg.logged("TLS certificate reloaded"));
}

#[tokio::test]
async fn a_bad_pair_keeps_the_last_good_one_and_says_why() {
    let pki = Pki::new();
    let (good, good_key) = pki.leaf("good", "localhost", Some(LOCAL));
    let (_, other_key) = pki.leaf("other", "localhost", Some(LOCAL));
    let (_live, cert, key) = live_pair(&good, &good_key);
    let up = TestUpstream::start().await;
    let tg = Tollgate::start("domain: tls\nrules: []\n", up.addr, &tls_args(&cert, &key));
    let ca = pki.ca();
    // A key that is not the certificate's.
    std::fs::copy(&other_key, &key).unwrap();
    assert!(tg.logged("TLS certificate not reloaded"), "{}", tg.log_text());
    let answer = tls_get(tg.addr, &ca, "/echo", None).await.unwrap();
    assert_eq!(answer.status, 200);
    assert_eq!(answer.peer, der_of(&good), "the last good certificate is still served");
    let config = get(&client(), &format!("http://{}/config", tg.admin), &[]).await.json();
    let error = config["tls"]["last_error"].as_str().unwrap_or_default().to_string();
    assert!(error.contains("tls.key"), "/config names the files: {config}");
    assert_eq!(
        config["tls"]["subject"], "CN=localhost",
        "the certificate in force: {config}"
    );
    assert!(
        config["tls"]["not_after"].as_str().is_some_and(|t| !t.is_empty()),
        "{config}"
    );
    assert_eq!(metric(&tg, "tollgate_tls_reloads_total{result=\"failed\"}").await, 1);
    // Not a PEM file at all, then the good key again: the error clears.
    std::fs::write(&key, "not a key").unwrap();
    tokio::time::sleep(Duration::from_millis(1600)).await;
    std::fs::copy(&good_key, &key).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let config = get(&client(), &format!("http://{}/config", tg.admin), &[]).await.json();
        if config["tls"]["last_error"].is_null() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the error stayed: {config}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(tls_get(tg.addr, &ca, "/echo", None).await.unwrap().status, 200);
}

#[tokio::test]
async fn a_bad_certificate_at_start_is_refused_with_the_file_named() {
    let dir = tempfile::tempdir().unwrap();
    let cert = dir.path().join("cert.pem");
    std::fs::write(&cert, "nonsense").unwrap();
    let out = Command::new(binary())
        .args(["--config", repo_file("conf/limits.yaml").to_str().unwrap()])
        .args([
            "--upstream",
            "http://127.0.0.1:9",
            "--listen",
            "127.0.0.1:0",
            "--admin-listen",
            "127.0.0.1:0",
        ])
        .args([
            "--grpc-listen",
            "off",
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
        ])
        .arg(&cert)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cert.pem") && stderr.contains("no CERTIFICATE block"),
        "{stderr}"
    );
}

#[tokio::test]
async fn client_certificates_required_or_optional() {
    let pki = Pki::new();
    let (cert, key) = pki.leaf("server", "localhost", Some(LOCAL));
    let (client_cert, client_key) = pki.leaf("client", "client-a", None);
    let other = Pki::new();
    let (stranger, stranger_key) = other.leaf("stranger", "client-b", None);
    let up = TestUpstream::start().await;
    let ca = pki.ca();
    let mut args = tls_args(&cert, &key);
    args.extend(["--tls-client-ca", ca.to_str().unwrap()]);
    let tg = Tollgate::start("domain: tls\nrules: []\n", up.addr, &args);
    let with = tls_get(tg.addr, &ca, "/echo", Some((&client_cert, &client_key))).await;
    assert_eq!(with.unwrap().status, 200);
    assert!(
        tls_get(tg.addr, &ca, "/echo", None).await.is_err(),
        "required: no certificate, no request"
    );
    let signed_elsewhere = tls_get(tg.addr, &ca, "/echo", Some((&stranger, &stranger_key))).await;
    assert!(signed_elsewhere.is_err(), "a certificate another CA signed is refused");

    args.extend(["--tls-client-auth", "optional"]);
    let tg = Tollgate::start("domain: tls\nrules: []\n", up.addr, &args);
    assert_eq!(tls_get(tg.addr, &ca, "/echo", None).await.unwrap().status, 200);
    let with = tls_get(tg.addr, &ca, "/echo", Some((&client_cert, &client_key))).await;
    assert_eq!(with.unwrap().status, 200);
    let signed_elsewhere = tls_get(tg.addr, &ca, "/echo", Some((&stranger, &stranger_key))).await;
    assert!(signed_elsewhere.is_err(), "optional still verifies what is presented");
}

#[tokio::test]
async fn the_check_listener_serves_tls_when_asked() {
    let pki = Pki::new();
    let (cert, key) = pki.leaf("server", "localhost", Some(LOCAL));
    let up = TestUpstream::start().await;
    let mut args = tls_args(&cert, &key);
    args.extend(["--check-tls", "true"]);
    let tg = Tollgate::start(LIMITS, up.addr, &args);
    let check = tg.check.unwrap();
    let answer = tls_get_with(
        check,
        &pki.ca(),
        "/auth_request",
        None,
        &[("x-original-uri", "/limited")],
    )
    .await
    .unwrap();
    assert_eq!(answer.status, 204, "auth_request allows: {:?}", answer.body);
    assert_eq!(answer.alpn.as_deref(), Some(&b"http/1.1"[..]));
}

/// A real NGINX serving TLS with a certificate `pki` signed for `san`.
fn tls_nginx(pki: &Pki, san: &str) -> (Nginx, u16) {
    let (cert, key) = pki.leaf("upstream", "localhost", Some(san));
    let port = free_port();
    let extra = format!(
        "server {{ listen 127.0.0.1:{port} ssl; ssl_certificate {}; ssl_certificate_key {}; \
         location / {{ return 200 \"from nginx over tls $ssl_protocol $ssl_server_name $server_protocol\\n\"; }} }}",
        cert.display(),
        key.display()
    );
    (Nginx::start(&extra, "location / { return 204; }"), port)
}

/// NGINX speaking h2 over TLS, certified for `localhost`, with `server`
/// inside its `server` block.
fn h2_nginx(pki: &Pki, server: &str) -> (Nginx, u16) {
    let (cert, key) = pki.leaf("upstream", "localhost", Some(LOCAL));
    let port = free_port();
    let extra = format!(
        "server {{ listen 127.0.0.1:{port} ssl http2; ssl_certificate {}; ssl_certificate_key {}; {server} }}",
        cert.display(),
        key.display()
    );
    (Nginx::start(&extra, "location / { return 204; }"), port)
}

/// tollgate with one proxy thread (so one HTTP/2 connection) in front of
/// `https://localhost:{port}`, trusting `pki`'s CA.
fn one_thread_to(pki: &Pki, port: u16) -> Tollgate {
    let ca = pki.ca();
    https_upstream(
        &format!("https://localhost:{port}"),
        &["--upstream-ca", ca.to_str().unwrap(), "--proxy-threads", "1"],
    )
}

fn https_upstream(upstream: &str, extra: &[&str]) -> Tollgate {
    Tollgate::start_upstream_url("domain: tls\nrules: []\n", upstream, extra)
}

#[tokio::test]
async fn an_https_upstream_is_verified_and_reused() {
    let pki = Pki::new();
    let (_nginx, port) = tls_nginx(&pki, LOCAL);
    let ca = pki.ca();
    let tg = https_upstream(
        &format!("https://localhost:{port}"),
        &["--upstream-ca", ca.to_str().unwrap()],
    );
    for _ in 0..10 {
        let answer = get(&client(), &tg.url("/"), &[]).await;
        assert_eq!(answer.status, 200);
        let body = String::from_utf8_lossy(&answer.body).into_owned();
        assert!(body.starts_with("from nginx over tls TLSv1."), "{body}");
        assert!(body.contains("localhost"), "SNI names the upstream's host: {body}");
        assert!(
            body.contains("HTTP/1.1"),
            "NGINX without http2 picks HTTP/1.1 by ALPN: {body}"
        );
    }
    // Kept alive and reused: ten requests, one after the other, over at
    // most two connections (seen: the second request opens a second TLS
    // connection, the first not being ready again yet; every later one
    // reuses). A plain upstream is reused from the second request on.
    let open = metric(&tg, "tollgate_upstream_connections").await;
    assert!((1..=2).contains(&open), "{open} upstream connections for 10 requests");
}

#[tokio::test]
async fn an_upstream_certificate_that_does_not_verify_is_a_502_never_a_fallback() {
    let pki = Pki::new();
    let (_nginx, port) = tls_nginx(&pki, LOCAL);
    // The system's roots do not know the throwaway CA.
    let tg = https_upstream(&format!("https://localhost:{port}"), &[]);
    let answer = get(&client(), &tg.url("/"), &[]).await;
    assert_eq!(answer.status, 502);
    assert!(tg.logged("TLS with the upstream localhost"), "{}", tg.log_text());
    // Another CA.
    let other = Pki::new();
    let tg = https_upstream(
        &format!("https://localhost:{port}"),
        &["--upstream-ca", other.ca().to_str().unwrap()],
    );
    assert_eq!(get(&client(), &tg.url("/"), &[]).await.status, 502);
    // The right CA, but a certificate for another name.
    let elsewhere = Pki::new();
    let (_other_nginx, other_port) = tls_nginx(&elsewhere, "DNS:api.example");
    let tg = https_upstream(
        &format!("https://localhost:{other_port}"),
        &["--upstream-ca", elsewhere.ca().to_str().unwrap()],
    );
    assert_eq!(get(&client(), &tg.url("/"), &[]).await.status, 502);
    assert!(tg.logged("certificate"), "{}", tg.log_text());
    // A plain HTTP server behind an https:// upstream.
    let up = TestUpstream::start().await;
    let tg = https_upstream(
        &format!("https://localhost:{}", up.addr.port()),
        &["--upstream-ca", pki.ca().to_str().unwrap()],
    );
    assert_eq!(get(&client(), &tg.url("/"), &[]).await.status, 502);
}

#[tokio::test]
async fn limits_follow_the_client_certificate() {
    let pki = Pki::new();
    let (cert, key) = pki.leaf("server", "localhost", Some(LOCAL));
    let (a, a_key) = pki.leaf("a", "client-a", None);
    let (b, b_key) = pki.leaf("b", "client-b", None);
    let up = TestUpstream::start().await;
    let ca = pki.ca();
    let limits = "\
domain: tls
rules:
  - name: per_identity
    by: [client_cert]
    limits: [{ requests: 2, per: 60s }]
";
    let mut args = tls_args(&cert, &key);
    args.extend(["--tls-client-ca", ca.to_str().unwrap(), "--tls-client-auth", "optional"]);
    let tg = Tollgate::start(limits, up.addr, &args);
    let status = |answer: Result<TlsAnswer, String>| answer.unwrap().status;
    for expected in [200, 200, 429] {
        assert_eq!(status(tls_get(tg.addr, &ca, "/x", Some((&a, &a_key))).await), expected);
    }
    // Another identity has its own counter, whatever address it comes from.
    assert_eq!(status(tls_get(tg.addr, &ca, "/x", Some((&b, &b_key))).await), 200);
    // No certificate: the rule has no value to count by (as a missing header).
    for _ in 0..3 {
        assert_eq!(status(tls_get(tg.addr, &ca, "/x", None).await), 200);
    }
    let refused = tls_get(tg.addr, &ca, "/x", Some((&a, &a_key))).await.unwrap();
    assert_eq!(refused.status, 429);
    let body = String::from_utf8_lossy(&refused.body).into_owned();
    assert!(body.contains("per_identity"), "{body}");
}

#[tokio::test]
async fn the_grpc_listener_serves_tls_when_asked() {
    let pki = Pki::new();
    let (cert, key) = pki.leaf("server", "localhost", Some(LOCAL));
    let up = TestUpstream::start().await;
    let mut args = tls_args(&cert, &key);
    args.extend(["--grpc-tls", "true"]);
    let tg = Tollgate::start(LIMITS, up.addr, &args);
    // grpc.health.v1.Health/Check with an empty request: one uncompressed
    // gRPC frame of zero bytes. The answer is status SERVING (field 1 = 1).
    let frame = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(frame.path(), [0u8, 0, 0, 0, 0]).unwrap();
    let data = format!("@{}", frame.path().display());
    let (version, code, body) = curl(
        tg.grpc.unwrap(),
        &pki.ca(),
        "/grpc.health.v1.Health/Check",
        &[
            "--http2",
            "-D",
            "-",
            "-H",
            "content-type: application/grpc",
            "-H",
            "te: trailers",
            "--data-binary",
            &data,
        ],
    )
    .await;
    assert_eq!((version.as_str(), code.as_str()), ("2", "200"), "{body}");
    assert!(body.contains("grpc-status: 0"), "{body}");
    assert!(
        body.contains("\u{0}\u{0}\u{0}\u{0}\u{2}\u{8}\u{1}"),
        "SERVING: {body:?}"
    );
    // A plaintext HTTP/2 client gets nothing from the TLS listener.
    assert_eq!(curl_plain_h2(tg.grpc.unwrap()).await, "000");
}

/// curl with HTTP/2 prior knowledge in cleartext: the status it got.
async fn curl_plain_h2(addr: std::net::SocketAddr) -> String {
    let out = tokio::process::Command::new("curl")
        .args([
            "-sS",
            "--max-time",
            "3",
            "--http2-prior-knowledge",
            "-o",
            "/dev/null",
            "-w",
            "%{http_code}",
        ])
        .arg(format!("http://{addr}/grpc.health.v1.Health/Check"))
        .output()
        .await
        .unwrap();
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test]
async fn an_upstream_that_picks_h2_gets_one_multiplexed_connection() {
    let pki = Pki::new();
    // NGINX speaking h2 over TLS, in front of the echoing test upstream, so
    // bodies and headers are seen to cross the HTTP/2 hop both ways.
    let echo = TestUpstream::start().await;
    let (_nginx, port) = h2_nginx(
        &pki,
        &format!(
            "location /proto {{ return 200 \"$server_protocol $http_host\"; }} \
             location / {{ proxy_pass http://{}; proxy_http_version 1.1; }}",
            echo.addr
        ),
    );
    let tg = one_thread_to(&pki, port);
    let answer = send(
        &client(),
        http::Method::GET,
        &tg.url("/proto"),
        &[("host", "api.test")],
        Vec::new(),
    )
    .await;
    assert_eq!(answer.status, 200);
    assert_eq!(
        String::from_utf8_lossy(&answer.body),
        "HTTP/2.0 api.test",
        "h2 to the upstream, the client's Host as :authority"
    );
    // Twenty at once, each with a body: one connection carries them all.
    let c = client();
    let calls = (0..20).map(|i| {
        let c = c.clone();
        let url = tg.url(&format!("/echo/{i}"));
        async move {
            send(
                &c,
                http::Method::POST,
                &url,
                &[("x-call", &i.to_string())],
                pattern(10_000 + i),
            )
            .await
        }
    });
    for (i, answer) in futures_join_all(calls).await.into_iter().enumerate() {
        assert_eq!(answer.status, 200);
        assert_eq!(answer.body, pattern(10_000 + i), "call {i}'s body came back whole");
        assert_eq!(answer.header("x-seen-x-call"), Some(i.to_string().as_str()));
    }
    assert_eq!(metric(&tg, "tollgate_upstream_connections").await, 1);
    // HTTP/2 has no Upgrade: a WebSocket handshake is answered 502 at once.
    let started = std::time::Instant::now();
    let answer = raw(
        tg.addr,
        // `close`: `raw` reads until the connection ends, and one that
        // carried Upgrade is otherwise kept alive.
        b"GET /ws HTTP/1.1\r\nHost: x\r\nConnection: Upgrade, close\r\nUpgrade: websocket\r\n\
          Sec-WebSocket-Version: 13\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n",
        Duration::from_secs(5),
    )
    .await;
    assert!(answer.starts_with("HTTP/1.1 502"), "{answer}");
    assert!(started.elapsed() < Duration::from_secs(3));
    assert!(tg.logged("a WebSocket upgrade needs an HTTP/1.1 upstream"));
}

/// Runs every future to its end, concurrently, in order of the input.
async fn futures_join_all<F>(futures: impl IntoIterator<Item = F>) -> Vec<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    let handles: Vec<_> = futures.into_iter().map(tokio::spawn).collect();
    let mut out = Vec::with_capacity(handles.len());
    for h in handles {
        out.push(h.await.unwrap());
    }
    out
}

#[tokio::test]
async fn an_h2_upstream_ending_its_connections_loses_no_request() {
    // NGINX sends GOAWAY after every third request on a connection
    // (keepalive_requests counts HTTP/2 streams too): a request racing it
    // goes out on a new connection instead of failing.
    let pki = Pki::new();
    let (_nginx, port) = h2_nginx(
        &pki,
        "keepalive_requests 3; location / { return 200 \"$server_protocol\"; }",
    );
    let tg = one_thread_to(&pki, port);
    let c = client();
    for round in 0..10 {
        let calls = (0..4).map(|_| {
            let (c, url) = (c.clone(), tg.url("/"));
            async move { get(&c, &url, &[]).await }
        });
        for answer in futures_join_all(calls).await {
            assert_eq!(
                answer.status,
                200,
                "round {round}: {:?}\n{}",
                answer.body,
                tg.log_text()
            );
            assert_eq!(answer.body, "HTTP/2.0");
        }
    }
    // Body-less POSTs (not idempotent) from an HTTP/2 client, many at once:
    // the ones NGINX's graceful GOAWAY left unprocessed go out again, and
    // none is answered 400 as if its (absent) body had failed.
    let h2 = h2_sender(tg.addr).await;
    for round in 0..10 {
        let calls = (0..8).map(|_| {
            let mut h2 = h2.clone();
            let url = tg.url("/");
            async move {
                let req = http::Request::post(url)
                    .body(http_body_util::Full::new(Bytes::new()))
                    .unwrap();
                let response = h2.send_request(req).await.unwrap();
                let status = response.status();
                let body = response.into_body().collect().await.unwrap().to_bytes();
                (status, body)
            }
        });
        for (status, body) in futures_join_all(calls).await {
            assert_eq!(status, 200, "round {round}: {body:?}\n{}", tg.log_text());
        }
    }
}

#[tokio::test]
async fn an_h2_upstream_ending_its_connections_loses_no_post_with_a_body() {
    // An HTTP/2 upstream taking two streams at a time and ending each
    // connection after three requests (NGINX's keepalive_requests): of many
    // POSTs at once, those still waiting for a stream, or above the last
    // one its GOAWAY says it processed, were never processed. They go out
    // again on a new connection, body and all, as NGINX proxying to an
    // HTTP/1.1 upstream loses none. Before, 25-45 % of them were 502s
    // and 1 % 400 "request body could not be read".
    let pki = Pki::new();
    let up = TestUpstream::start().await;
    let (_nginx, port) = h2_nginx(
        &pki,
        &format!(
            "keepalive_requests 3; http2_max_concurrent_streams 2; client_max_body_size 1m; \
             location / {{ proxy_pass http://{}; }}",
            up.addr
        ),
    );
    let tg = one_thread_to(&pki, port);
    let c = client();
    for round in 0..8 {
        let calls = (0..16).map(|i| {
            let (c, url) = (c.clone(), tg.url(&format!("/post?round={round}&i={i}")));
            // Up to the 64 KB read whole before it is sent.
            let body = pattern(1 + i * 4000 + round * 97);
            async move { (send(&c, http::Method::POST, &url, &[], body.clone()).await, body) }
        });
        for (answer, body) in futures_join_all(calls).await {
            assert_eq!(
                answer.status,
                200,
                "round {round}: {:?}\n{}",
                answer.body,
                tg.log_text()
            );
            assert!(
                answer.body.as_ref() == body.as_slice(),
                "round {round}: the body came back changed"
            );
        }
    }
    // A longer body streams, so one the upstream leaves unprocessed cannot
    // go again: a 502, as the upstream's fault, never a 400 blaming the
    // client's body.
    let calls = (0..32).map(|i| {
        let (c, url) = (c.clone(), tg.url(&format!("/long?i={i}")));
        async move { send(&c, http::Method::POST, &url, &[], pattern(200_000)).await }
    });
    let mut statuses = Vec::new();
    for answer in futures_join_all(calls).await {
        assert!(
            answer.status == 200 || answer.status == 502,
            "{} {:?}\n{}",
            answer.status,
            answer.body,
            tg.log_text()
        );
        statuses.push(answer.status.as_u16());
    }
    assert!(!tg.logged("request body failed"), "{statuses:?}\n{}", tg.log_text());
}

#[tokio::test]
async fn one_request_does_not_end_the_h2_upstream_connection_every_client_shares() {
    // Every client's requests share a thread's HTTP/2 connection to the
    // upstream: what one request brings must not end it for all. Request
    // trailers (NGINX drops the connection: "client sent HEADERS frame with
    // incorrect identifier") are not sent on; a response head over hyper's
    // 16 KB header list ended the connection (its HPACK state lost): heads
    // up to 64 KB pass, a larger one is a 502 for its own stream. Before,
    // each cost hundreds of other clients a 502, most of them for POSTs the
    // upstream had processed.
    let pki = Pki::new();
    let up = TestUpstream::start().await;
    let field = "a".repeat(4000);
    let fields = |n: usize| {
        (0..n)
            .map(|i| format!("add_header x-big-{i} {field};"))
            .collect::<String>()
    };
    let (nginx, port) = h2_nginx(
        &pki,
        &format!(
            "location /head20k {{ {} return 200 ok; }} location /head72k {{ {} return 200 ok; }} \
             location / {{ proxy_pass http://{}; }}",
            fields(5),
            fields(18),
            up.addr
        ),
    );
    let tg = one_thread_to(&pki, port);
    let c = client();
    let innocent: Vec<_> = (0..200)
        .map(|i| {
            let (c, url) = (c.clone(), tg.url(&format!("/echo?i={i}")));
            async move { send(&c, http::Method::POST, &url, &[], pattern(20_000)).await }
        })
        .collect();
    let innocent = tokio::spawn(futures_join_all(innocent));
    let with_trailers = (0..20).map(|_| {
        let addr = tg.addr;
        async move {
            raw(
                addr,
                b"POST /echo HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTrailer: x-trailer\r\n\
                  Connection: close\r\n\r\n5\r\nhello\r\n0\r\nx-trailer: 1\r\n\r\n",
                Duration::from_secs(10),
            )
            .await
        }
    });
    for answer in futures_join_all(with_trailers).await {
        assert!(
            answer.starts_with("HTTP/1.1 200") && answer.contains("hello"),
            "{answer}"
        );
    }
    for _ in 0..10 {
        let big = get(&c, &tg.url("/head20k"), &[]).await;
        assert_eq!(big.status, 200, "a 20 KB head passes: {:?}", big.body);
        assert!(big.header("x-big-4").is_some_and(|v| v.len() == 4000));
        let huge = get(&c, &tg.url("/head72k"), &[]).await;
        assert_eq!(huge.status, 502, "a 72 KB head is refused");
    }
    for answer in innocent.await.unwrap() {
        assert_eq!(answer.status, 200, "{:?}\n{}", answer.body, tg.log_text());
        assert!(answer.body.as_ref() == pattern(20_000).as_slice());
    }
    assert!(tg.logged("larger than 64 KB"), "{}", tg.log_text());
    let errors = nginx.error_log();
    assert!(!errors.contains("incorrect identifier"), "{errors}");
}

#[tokio::test]
async fn a_named_pipe_in_place_of_the_key_is_refused_and_neither_reloads_nor_shutdown_hang() {
    let pki = Pki::new();
    let (good, good_key) = pki.leaf("good", "localhost", Some(LOCAL));
    let (next, next_key) = pki.leaf("next", "localhost", Some(LOCAL));
    let (_live, cert, key) = live_pair(&good, &good_key);
    let up = TestUpstream::start().await;
    let mut tg = Tollgate::start("domain: tls\nrules: []\n", up.addr, &tls_args(&cert, &key));
    std::fs::remove_file(&key).unwrap();
    let made = Command::new("mkfifo").arg(&key).status().unwrap();
    assert!(made.success());
    assert!(tg.logged("not a regular file"), "{}", tg.log_text());
    let config = get(&client(), &format!("http://{}/config", tg.admin), &[]).await.json();
    assert!(
        config["tls"]["last_error"]
            .as_str()
            .unwrap_or_default()
            .contains("not a regular file"),
        "{config}"
    );
    // A good pair afterwards is read: the reload was not left waiting on the pipe.
    std::fs::remove_file(&key).unwrap();
    std::fs::copy(&next, &cert).unwrap();
    std::fs::copy(&next_key, &key).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while tls_get(tg.addr, &pki.ca(), "/", None).await.unwrap().peer != der_of(&next) {
        assert!(std::time::Instant::now() < deadline, "the good pair was never served");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tg.signal("TERM");
    assert_eq!(tg.wait_exit(Duration::from_secs(10)), Some(true), "exits on SIGTERM");
}

#[tokio::test]
async fn a_self_signed_upstream_named_in_upstream_ca_is_trusted_as_curl_would() {
    // `openssl req -x509` marks the certificate CA:TRUE; curl --cacert and
    // NGINX's proxy_ssl_trusted_certificate trust it as the server's own.
    let dir = tempfile::tempdir().unwrap();
    let san = |names: &str| format!("subjectAltName={names}");
    let (cert, key) = self_signed(dir.path(), "self", "/CN=localhost", &[&san(LOCAL)]);
    let (elsewhere, _) = self_signed(dir.path(), "elsewhere", "/CN=localhost", &[&san("DNS:api.example")]);
    let port = free_port();
    let extra = format!(
        "server {{ listen 127.0.0.1:{port} ssl; ssl_certificate {}; ssl_certificate_key {}; \
         location / {{ return 200 \"self-signed upstream\"; }} }}",
        cert.display(),
        key.display()
    );
    let _nginx = Nginx::start(&extra, "location / { return 204; }");
    let curl = Command::new("curl")
        .args(["-sS", "--cacert", cert.to_str().unwrap()])
        .arg(format!("https://localhost:{port}/"))
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&curl.stdout),
        "self-signed upstream",
        "curl trusts it"
    );
    let upstream = format!("https://localhost:{port}");
    let tg = https_upstream(&upstream, &["--upstream-ca", cert.to_str().unwrap()]);
    let answer = get(&client(), &tg.url("/"), &[]).await;
    assert_eq!(answer.status, 200, "{}", tg.log_text());
    assert_eq!(answer.body, "self-signed upstream");
    // Another self-signed certificate is no anchor for this one.
    let tg = https_upstream(&upstream, &["--upstream-ca", elsewhere.to_str().unwrap()]);
    assert_eq!(get(&client(), &tg.url("/"), &[]).await.status, 502);
}

#[tokio::test]
async fn an_untrusted_client_cannot_claim_https_in_another_header() {
    // Rack believes X-Forwarded-Ssl: on before X-Forwarded-Proto; PHP and
    // Rack read X-Forwarded_Proto as X-Forwarded-Proto.
    let up = TestUpstream::start().await;
    let tg = Tollgate::start(LIMITS, up.addr, &[]);
    let claims = [
        ("forwarded", "for=1.2.3.4;proto=https"),
        ("x-forwarded-ssl", "on"),
        ("x-forwarded-scheme", "https"),
        ("front-end-https", "on"),
        ("x-forwarded_proto", "https"),
        ("x-real-ip", "7.7.7.7"),
        ("x-forwarded-client-cert", "Subject=\"CN=admin\""),
        // Rails' remote_ip reads Client-IP; IIS-style frameworks take
        // X-Original-URL for the path (the 26th attack).
        ("client-ip", "7.7.7.7"),
        ("true-client-ip", "7.7.7.7"),
        ("x-original-url", "/admin"),
        ("x-api_key", "k1"),
    ];
    let answer = get(&client(), &tg.url("/echo"), &claims).await;
    assert_eq!(answer.status, 200);
    for (name, _) in &claims[..10] {
        assert_eq!(
            answer.header(&format!("x-seen-{name}")),
            None,
            "{name} reached the upstream"
        );
    }
    assert_eq!(answer.header("x-seen-x-forwarded-proto"), Some("http"));
    assert_eq!(
        answer.header("x-seen-x-api_key"),
        Some("k1"),
        "other underscore names pass"
    );
    // From a trusted proxy they are its to say.
    let tg = Tollgate::start(LIMITS, up.addr, &["--trusted-proxies", "127.0.0.1/32"]);
    let answer = get(&client(), &tg.url("/echo"), &claims).await;
    assert_eq!(answer.header("x-seen-x-forwarded-ssl"), Some("on"));
    assert_eq!(answer.header("x-seen-forwarded"), Some("for=1.2.3.4;proto=https"));
}

#[tokio::test]
async fn no_peer_names_the_upstream_a_host_or_path_the_rules_did_not_see() {
    // The 41st attack: NGINX and Envoy pass a client's own fields on by
    // default, so a trusted front's `Forwarded: host=` (Spring, Rack 3),
    // `X-Forwarded_Host` (PHP and Rack read it as X-Forwarded-Host) or
    // `X-Original-URL` may be the client's, naming a host or path no rule
    // matched. Whoever sends them, they go; the host the rules matched goes
    // as X-Forwarded-Host.
    let up = TestUpstream::start().await;
    let targets = [
        ("forwarded", "for=1.2.3.4;host=api.example.com"),
        ("x-forwarded_host", "api.example.com"),
        ("x-original-url", "/admin"),
        ("x-rewrite-url", "/admin"),
        ("x-host", "api.example.com"),
        ("x-original-host", "api.example.com"),
        ("x-forwarded-server", "api.example.com"),
        ("x-http-host-override", "api.example.com"),
    ];
    for trusted in [false, true] {
        let args: &[&str] = if trusted {
            &["--trusted-proxies", "127.0.0.1/32"]
        } else {
            &[]
        };
        let tg = Tollgate::start(LIMITS, up.addr, args);
        // A plain GET goes by tollgate's own server and client, a request
        // with a body by hyper's: both write the upstream's head.
        for body in [Vec::new(), b"x".to_vec()] {
            let method = if body.is_empty() {
                http::Method::GET
            } else {
                http::Method::POST
            };
            let answer = send(&client(), method.clone(), &tg.url("/echo"), &targets, body).await;
            assert_eq!(answer.status, 200, "{}", tg.log_text());
            for (name, _) in &targets {
                assert_eq!(
                    answer.header(&format!("x-seen-{name}")),
                    None,
                    "{name} reached the upstream ({method}, trusted: {trusted})"
                );
            }
            assert_eq!(
                answer.header("x-seen-x-forwarded-host"),
                Some(tg.addr.to_string().as_str())
            );
        }
    }
    // A trusted front's `Forwarded` that names no host is its to say.
    let tg = Tollgate::start(LIMITS, up.addr, &["--trusted-proxies", "127.0.0.1/32"]);
    let answer = get(&client(), &tg.url("/echo"), &[("forwarded", "for=1.2.3.4;proto=https")]).await;
    assert_eq!(answer.header("x-seen-forwarded"), Some("for=1.2.3.4;proto=https"));
}

#[tokio::test]
async fn a_subject_spelled_with_a_comma_is_not_another_identity() {
    // A CN of "client-a, O=Acme" must not read as the two RDNs
    // CN=client-a and O=Acme: one could spend the other's quota.
    let pki = Pki::new();
    let (cert, key) = pki.leaf("server", "localhost", Some(LOCAL));
    let (forged, forged_key) = pki.leaf("forged", "client-a, O=Acme", None);
    let (real, real_key) = pki.leaf("real", "client-a/O=Acme", None);
    let up = TestUpstream::start().await;
    let ca = pki.ca();
    let limits =
        "domain: tls\nrules:\n  - name: per_identity\n    by: [client_cert]\n    limits: [{ requests: 2, per: 60s }]\n";
    let mut args = tls_args(&cert, &key);
    args.extend(["--tls-client-ca", ca.to_str().unwrap()]);
    let tg = Tollgate::start(limits, up.addr, &args);
    for expected in [200, 200, 429] {
        let answer = tls_get(tg.addr, &ca, "/x", Some((&forged, &forged_key))).await.unwrap();
        assert_eq!(answer.status, expected);
    }
    let answer = tls_get(tg.addr, &ca, "/x", Some((&real, &real_key))).await.unwrap();
    assert_eq!(answer.status, 200, "the real identity has its own counter");
}

#[tokio::test]
async fn sighup_reads_the_certificate_again() {
    // README: the files are looked at every second "and on SIGHUP".
    let pki = Pki::new();
    let (good, good_key) = pki.leaf("good", "localhost", Some(LOCAL));
    let (_live, cert, key) = live_pair(&good, &good_key);
    let up = TestUpstream::start().await;
    let tg = Tollgate::start("domain: tls\nrules: []\n", up.addr, &tls_args(&cert, &key));
    let ok = "tollgate_tls_reloads_total{result=\"ok\"}";
    assert_eq!(metric(&tg, ok).await, 0, "nothing changed, nothing read");
    tg.signal("HUP");
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while metric(&tg, ok).await != 1 {
        assert!(
            std::time::Instant::now() < deadline,
            "SIGHUP did not read the pair: {}",
            tg.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// How an HTTPS upstream ends a kept connection it will not answer on.
#[derive(Clone, Copy, Debug)]
enum TlsClose {
    /// close_notify, then FIN: what NGINX sends at its keepalive_timeout.
    Notify,
    /// FIN with no close_notify: a server that drops the socket (Node's
    /// `socket.destroy()`, a killed worker).
    Drop,
    /// RST.
    Reset,
}

/// An HTTPS upstream (HTTP/1.1, certified by `pki` for localhost) that
/// answers a connection's first request, and ends the connection as
/// `close` says, with only `cut` of an answer sent (nothing, or its start),
/// at a later request that finds it idle `idle_for` or more: its idle
/// timeout crossing the request on the wire, or a failure mid-answer.
/// Returns its port and the methods of the requests it read.
async fn closing_tls_upstream(
    pki: &Pki,
    close: TlsClose,
    idle_for: Duration,
    cut: &'static [u8],
) -> (u16, Arc<std::sync::Mutex<Vec<String>>>) {
    use tokio::io::AsyncWriteExt;
    let (cert, key) = pki.leaf("closing", "localhost", Some(LOCAL));
    let certs = vec![CertificateDer::from_pem_file(&cert).unwrap()];
    let key = PrivateKeyDer::from_pem_file(&key).unwrap();
    let mut config = rustls::ServerConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(certs, key)
        .unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            let (log, acceptor) = (log.clone(), acceptor.clone());
            tokio::spawn(async move {
                let Ok(mut stream) = acceptor.accept(tcp).await else {
                    return;
                };
                if answer_until_idle(&mut stream, &log, idle_for, cut).await {
                    match close {
                        TlsClose::Notify => {
                            let _ = stream.shutdown().await;
                        }
                        TlsClose::Drop => {}
                        TlsClose::Reset => {
                            let _ = stream.get_ref().0.set_zero_linger();
                        }
                    }
                }
            });
        }
    });
    (port, seen)
}

#[tokio::test]
async fn a_get_to_an_https_upstream_closing_its_kept_connection_is_sent_again() {
    // An HTTPS upstream's idle timeout (or its reload, closing busy
    // connections too) crossing a GET: the GET went out on the kept
    // connection and nothing, or only part of a head, came back. NGINX's
    // proxy_next_upstream sends it again on a new connection; so does
    // tollgate, however briefly the connection was idle and however the
    // upstream ended it.
    let c = client();
    let cases = [Duration::ZERO, Duration::from_millis(150)]
        .into_iter()
        .flat_map(|idle| [(idle, &b""[..]), (idle, &b"HTTP/1.1 200 OK\r\ncontent-le"[..])])
        .chain([(Duration::ZERO, &b"HTTP/1.1 100 Continue\r\n\r\n"[..])]);
    for (idle_for, cut) in cases {
        for close in [TlsClose::Notify, TlsClose::Drop, TlsClose::Reset] {
            let case = format!("{close:?} after {idle_for:?} with {:?}", String::from_utf8_lossy(cut));
            let pki = Pki::new();
            let (port, seen) = closing_tls_upstream(&pki, close, idle_for, cut).await;
            let tg = one_thread_to(&pki, port);
            let pause = || async {
                if !idle_for.is_zero() {
                    tokio::time::sleep(idle_for * 2).await;
                }
            };
            for i in 0..4 {
                if i > 0 {
                    pause().await;
                }
                let a = get(&c, &tg.url("/any"), &[]).await;
                assert_eq!(
                    (&case, i, a.status, a.body.as_ref()),
                    (&case, i, http::StatusCode::OK, &b"ok"[..]),
                    "{}",
                    tg.log_text()
                );
            }
            // The first on a new connection; each later one on the kept
            // one, ended unanswered, then once more on a new one.
            let gets = seen.lock().unwrap().iter().filter(|m| *m == "GET").count();
            assert_eq!((&case, gets), (&case, 1 + 2 * 3));
            // A POST is not idempotent: sent once, whatever comes back.
            pause().await;
            let before = seen.lock().unwrap().len();
            let a = send(
                &c,
                http::Method::POST,
                &tg.url("/any"),
                &[("content-length", "2")],
                b"hi".to_vec(),
            )
            .await;
            let posts = seen.lock().unwrap()[before..].iter().filter(|m| *m == "POST").count();
            assert_eq!((&case, posts), (&case, 1));
            assert_eq!(a.status, http::StatusCode::BAD_GATEWAY, "{case}");
        }
    }
}

#[tokio::test]
async fn a_head_begun_on_a_tls_connection_when_the_server_stops_is_answered_with_connection_close() {
    // The 30th attack: over TLS (always hyper's connection) the next
    // request's head, begun when the server stopped, was closed unanswered,
    // where a plain connection's is read on and answered, as NGINX does.
    use tokio::io::AsyncWriteExt;
    let pki = Pki::new();
    let (cert, key) = pki.leaf("server", "localhost", Some(LOCAL));
    let up = TestUpstream::start().await;
    let get = b"GET /first HTTP/1.1\r\nHost: localhost\r\n\r\n".as_slice();
    let post = b"POST /first HTTP/1.1\r\nHost: localhost\r\nContent-Length: 2\r\n\r\nhi".as_slice();
    for first in [get, post] {
        let mut tg = Tollgate::start(LIMITS, up.addr, &tls_args(&cert, &key));
        let mut s = connect_tls(tg.addr, &pki.ca(), None).await.unwrap();
        let mut rest = Vec::new();
        s.write_all(first).await.unwrap();
        let answered = read_response(&mut s, &mut rest, Duration::from_secs(5), false).await;
        assert!(answered.is_some_and(|r| r.starts_with("HTTP/1.1 200")));
        s.write_all(b"GET /late HTTP/1.1\r\n").await.unwrap();
        tokio::time::sleep(Duration::from_millis(300)).await;
        tg.signal("TERM");
        tokio::time::sleep(Duration::from_millis(300)).await;
        s.write_all(b"Host: localhost\r\n\r\n").await.unwrap();
        let r = read_response(&mut s, &mut rest, Duration::from_secs(5), false)
            .await
            .unwrap_or_default();
        assert!(r.starts_with("HTTP/1.1 200"), "{r}");
        assert!(r.contains("x-seen-uri: /late\r\n"), "{r}");
        assert!(r.to_ascii_lowercase().contains("\r\nconnection: close\r\n"), "{r}");
        assert!(
            closes_after(&mut s, Duration::from_secs(3)).await.is_some(),
            "not closed"
        );
        assert_eq!(tg.wait_exit(Duration::from_secs(5)), Some(true), "clean exit");
    }
}
