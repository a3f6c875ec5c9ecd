//! The accept loop every HTTP listener shares: HTTP/1.1 and h2c on one port,
//! upgrades, a header read timeout against slow clients, and graceful
//! shutdown (stop accepting, let in-flight requests finish, bounded).
//!
//! hyper's header read timeout covers HTTP/1 only. So every connection also
//! has a watchdog: one that has not begun a request within the header read
//! timeout of opening (an HTTP/2 client sending its preface and a HEADERS
//! frame it never ends, say) is closed; one that has begun none for
//! [`IDLE_TIMEOUT`] since is shut down gracefully (HTTP/2 GOAWAY; responses
//! still streaming finish first).

use std::convert::Infallible;
use std::error::Error as StdError;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use http::{Request, Response};
use http_body_util::{Either, Empty};
use hyper::body::{Body, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// How long a connection that has served a request may sit without
/// beginning another (NGINX's `keepalive_timeout` default is 75 s).
pub const IDLE_TIMEOUT: Duration = Duration::from_secs(75);

/// When a connection last began a request, for its watchdog.
struct Activity {
    opened: Instant,
    /// Milliseconds after `opened` when the last request began.
    last_ms: AtomicU64,
    served: AtomicBool,
}

impl Activity {
    fn new() -> Self {
        Activity {
            opened: Instant::now(),
            last_ms: AtomicU64::new(0),
            served: AtomicBool::new(false),
        }
    }

    fn began(&self) {
        let ms = u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
        self.served.store(true, Ordering::Relaxed);
    }

    /// How long until the connection counts as idle (zero: it is).
    fn left(&self, first_request: Duration) -> Duration {
        let limit = if self.served.load(Ordering::Relaxed) {
            IDLE_TIMEOUT
        } else {
            first_request
        };
        let since = self
            .opened
            .elapsed()
            .saturating_sub(Duration::from_millis(self.last_ms.load(Ordering::Relaxed)));
        limit.saturating_sub(since)
    }
}

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
    let mut connections = JoinSet::new();
    loop {
        // Finished connections are reaped as they finish, not at the next
        // accept: each holds its task's memory until joined, and after a
        // burst closes there may be no next accept for a long time.
        let accepted = tokio::select! {
            accepted = accept(&listener, &mut shutdown) => accepted,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
        };
        let Some((stream, peer)) = accepted else { break };
                let handler = handler.clone();
                let activity = Arc::new(Activity::new());
                let seen = activity.clone();
                let service = service_fn(move |req: Request<Incoming>| {
                    seen.began();
                    let head = req.method() == http::Method::HEAD;
                    let response = handler(req, peer);
                    async move { Ok::<_, Infallible>(without_body_for_head(response.await, head)) }
                });
                let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service).into_owned();
                let mut stop = shutdown.clone();
                let first_request = limits.header_read_timeout;
                connections.spawn(async move {
                    let mut conn = std::pin::pin!(conn);
                    let mut closing = false;
                    loop {
                        let left = activity.left(first_request);
                        tokio::select! {
                            result = conn.as_mut() => {
                                if let Err(e) = result {
                                    tracing::debug!(%peer, error = %e, "connection ended with an error");
                                }
                                return;
                            }
                            _ = stopped(&mut stop), if !closing => {
                                conn.as_mut().graceful_shutdown();
                                closing = true;
                            }
                            _ = tokio::time::sleep(left), if !closing => {
                                if activity.left(first_request).is_zero() {
                                    tracing::debug!(%peer, "idle connection closed");
                                    if !activity.served.load(Ordering::Relaxed) {
                                        // Nothing was ever in flight: close at once (an
                                        // HTTP/2 GOAWAY would wait for a PING the
                                        // client may never answer).
                                        return;
                                    }
                                    conn.as_mut().graceful_shutdown();
                                    closing = true;
                                }
                            }
                        }
                    }
                });
    }
    drop(listener);
    let drained = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(limits.shutdown_grace, drained).await.is_err() {
        tracing::warn!(grace = ?limits.shutdown_grace, "connections still open after the shutdown grace period");
    }
}

/// A response to HEAD has no body (RFC 9110 §9.3.2). hyper drops it on
/// HTTP/1; on HTTP/2 it would send it and the client resets the stream
/// (curl: PROTOCOL_ERROR; Envoy's ext_authz client: an error, which
/// `failure_mode_allow` turns into an admission). Headers stay as they are.
fn without_body_for_head<B: Body>(response: Response<B>, head: bool) -> Response<Either<B, Empty<B::Data>>> {
    response.map(|body| if head { Either::Right(Empty::new()) } else { Either::Left(body) })
}

/// The next connection on `listener`, ready to serve (Nagle off), or
/// `None` once `shutdown` turns true. Accept errors (out of file
/// descriptors, mostly) back off instead of spinning.
pub async fn accept(listener: &TcpListener, shutdown: &mut watch::Receiver<bool>) -> Option<(TcpStream, SocketAddr)> {
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stopped(shutdown) => return None,
        };
        match accepted {
            Ok((stream, peer)) => {
                // Nagle's algorithm would hold small replies back until a
                // delayed ACK (~40 ms tails under load).
                let _ = stream.set_nodelay(true);
                return Some((stream, peer));
            }
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
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
