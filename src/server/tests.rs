//! A server started in-process, as `main` starts it: what tests of the
//! library's entry point look like.

use super::*;
use clap::Parser;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// One HTTP/1.1 request on a fresh connection; the response's status.
async fn status_of(addr: SocketAddr, path: &str) -> u16 {
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    let request = format!("GET {path} HTTP/1.1\r\nhost: {addr}\r\nconnection: close\r\n\r\n");
    conn.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    conn.read_to_string(&mut response).await.unwrap();
    response.get(9..12).and_then(|s| s.parse().ok()).unwrap_or(0)
}

/// An upstream answering every request 200, until dropped.
async fn upstream() -> (SocketAddr, tokio::task::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        while let Ok((mut conn, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                let _ = conn.read(&mut buf).await;
                let _ = conn
                    .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\nconnection: close\r\n\r\nok")
                    .await;
            });
        }
    });
    (addr, task)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_started_in_process_limits_and_stops() {
    let dir = tempfile::tempdir().unwrap();
    let limits = dir.path().join("limits.yaml");
    std::fs::write(
        &limits,
        "domain: d\nrules:\n  - name: all\n    limits: [{requests: 1, per: 1h}]\n",
    )
    .unwrap();
    let (up, _upstream) = upstream().await;
    let settings = Settings::try_parse_from([
        "tollgate",
        "--config",
        limits.to_str().unwrap(),
        "--upstream",
        &format!("http://{up}"),
        "--listen",
        "127.0.0.1:0",
        "--admin-listen",
        "127.0.0.1:0",
        "--grpc-listen",
        "off",
        "--proxy-threads",
        "2",
        "--shutdown-timeout",
        "1s",
    ])
    .unwrap();
    let server = Server::start(settings).await.unwrap();
    let addresses = server.addresses();
    let proxy = addresses.proxy.unwrap();
    assert_ne!(proxy.port(), 0, "port 0 is resolved to the bound port");
    assert!(addresses.grpc.is_none() && addresses.check.is_none() && addresses.health.is_none());
    assert_eq!(status_of(proxy, "/a").await, 200);
    assert_eq!(status_of(proxy, "/a").await, 429, "one request an hour");
    assert_eq!(status_of(addresses.admin, "/healthz").await, 200);
    server.stop().await;
    assert!(
        tokio::net::TcpStream::connect(proxy).await.is_err(),
        "a stopped server no longer listens"
    );
}

#[tokio::test]
async fn settings_that_serve_nothing_are_refused() {
    let settings = Settings::try_parse_from(["tollgate", "--config", "x.yaml", "--grpc-listen", "off"]).unwrap();
    let err = Server::start(settings).await.err().unwrap();
    assert!(matches!(err, StartError::NothingToServe), "{err}");
}
