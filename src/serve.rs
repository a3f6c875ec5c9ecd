//! The accept loop every HTTP listener shares: HTTP/1.1 and h2c on one port,
//! upgrades, a header read timeout against slow clients, and graceful
//! shutdown (stop accepting, let in-flight requests finish, bounded).

use std::convert::Infallible;
use std::error::Error as StdError;
use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use http::{Request, Response};
use hyper::body::{Body, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use tokio::net::TcpListener;
use tokio::sync::watch;

/// Limits applied to client connections.
#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    /// How long a client may take to send a request's headers.
    pub header_read_timeout: Duration,
    /// How long in-flight requests may run after shutdown starts.
    pub shutdown_grace: Duration,
    /// Most header fields in one request.
    pub max_headers: usize,
    /// Largest header block in bytes (HTTP/1 read buffer, HTTP/2 header list).
    pub max_header_bytes: usize,
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            header_read_timeout: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(10),
            max_headers: 100,
            max_header_bytes: 64 * 1024,
        }
    }
}

/// Serves `handler` on `listener` until `shutdown` turns true, then drains.
pub async fn serve<F, Fut, B>(
    listener: TcpListener,
    limits: ConnLimits,
    mut shutdown: watch::Receiver<bool>,
    handler: F,
) where
    F: Fn(Request<Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    let mut builder = auto::Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_headers(limits.max_headers)
        .max_buf_size(limits.max_header_bytes.max(8192));
    builder
        .http2()
        .timer(TokioTimer::new())
        .max_header_list_size(limits.max_header_bytes as u32);
    let graceful = GracefulShutdown::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let (stream, peer) = match accepted {
                    Ok(a) => a,
                    Err(e) => {
                        // Out of descriptors and the like: back off instead of spinning.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                };
                let _ = stream.set_nodelay(true);
                let handler = handler.clone();
                let service = service_fn(move |req| {
                    let response = handler(req, peer);
                    async move { Ok::<_, Infallible>(response.await) }
                });
                let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service).into_owned();
                let conn = graceful.watch(conn);
                tokio::spawn(async move {
                    if let Err(e) = conn.await {
                        tracing::debug!(%peer, error = %e, "connection ended with an error");
                    }
                });
            }
            _ = stopped(&mut shutdown) => break,
        }
    }
    drop(listener);
    if tokio::time::timeout(limits.shutdown_grace, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(grace = ?limits.shutdown_grace, "connections still open after the shutdown grace period");
    }
}

/// Resolves once the shutdown flag is set (or its sender is gone).
async fn stopped(shutdown: &mut watch::Receiver<bool>) {
    while !*shutdown.borrow_and_update() {
        if shutdown.changed().await.is_err() {
            return;
        }
    }
}
