//! One client connection, from accept to close: hyper serves its requests
//! (HTTP/1.1 with upgrades, or h2c) while a watchdog closes it when it sits
//! idle too long, before or between requests, and shuts it down gracefully
//! when the server stops.
//!
//! hyper's header read timeout covers HTTP/1 only. So the watchdog also
//! closes a connection that has not begun a request within the header read
//! timeout of opening (an HTTP/2 client sending its preface and a HEADERS
//! frame it never ends, say); one that has begun none for the keep-alive
//! timeout since is shut down gracefully (HTTP/2 GOAWAY; responses still
//! streaming finish first).

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
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use tokio::net::TcpStream;
use tokio::sync::watch;

use super::{ConnLimits, stopped};

/// When a connection last began or finished a request, for its watchdog.
struct Activity {
    opened: Instant,
    /// Milliseconds after `opened` when a request last began or finished.
    last_ms: AtomicU64,
    served: AtomicBool,
    /// Requests whose response has not been handed over yet.
    in_flight: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Activity {
            opened: Instant::now(),
            last_ms: AtomicU64::new(0),
            served: AtomicBool::new(false),
            in_flight: AtomicU64::new(0),
        }
    }

    fn touch(&self) {
        let ms = u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// A request began; the connection is busy until the result is dropped.
    fn began(self: &Arc<Self>) -> Busy {
        self.touch();
        self.served.store(true, Ordering::Relaxed);
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        Busy(self.clone())
    }

    /// How long until the connection counts as idle (zero: it is). Idle
    /// time counts from the last response handed over, as NGINX's
    /// `keepalive_timeout` does, never while a request is being handled.
    fn left(&self, limits: &ConnLimits) -> Duration {
        let limit = if self.served.load(Ordering::Relaxed) {
            if self.in_flight.load(Ordering::Relaxed) > 0 {
                return limits.recheck_every();
            }
            limits.keepalive_timeout
        } else {
            limits.header_read_timeout
        };
        let since = self
            .opened
            .elapsed()
            .saturating_sub(Duration::from_millis(self.last_ms.load(Ordering::Relaxed)));
        limit.saturating_sub(since)
    }
}

/// A request being handled on a connection; its end counts as activity.
struct Busy(Arc<Activity>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
        self.0.touch();
    }
}

/// Serves `handler` on one accepted connection until it closes.
pub(super) async fn serve<F, Fut, B>(
    stream: TcpStream,
    peer: SocketAddr,
    handler: F,
    builder: auto::Builder<TokioExecutor>,
    limits: ConnLimits,
    mut stop: watch::Receiver<bool>,
) where
    F: Fn(Request<Incoming>, SocketAddr) -> Fut + Clone + Send + Sync + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    let activity = Arc::new(Activity::new());
    let seen = activity.clone();
    let service = service_fn(move |req: Request<Incoming>| {
        let busy = seen.began();
        let head = req.method() == http::Method::HEAD;
        let response = handler(req, peer);
        async move {
            let response = response.await;
            drop(busy);
            Ok::<_, Infallible>(without_body_for_head(response, head))
        }
    });
    let conn = builder.serve_connection_with_upgrades(TokioIo::new(stream), service);
    let mut conn = std::pin::pin!(conn);
    let mut closing = false;
    loop {
        // A request beginning does not wake the watchdog, so
        // it looks again at least every keep-alive timeout.
        let left = activity.left(&limits).min(limits.recheck_every());
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
                if activity.left(&limits).is_zero() {
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
}

/// A response to HEAD has no body (RFC 9110 §9.3.2). hyper drops it on
/// HTTP/1; on HTTP/2 it would send it and the client resets the stream
/// (curl: PROTOCOL_ERROR; Envoy's ext_authz client: an error, which
/// `failure_mode_allow` turns into an admission). Headers stay as they are.
fn without_body_for_head<B: Body>(response: Response<B>, head: bool) -> Response<Either<B, Empty<B::Data>>> {
    response.map(|body| if head { Either::Right(Empty::new()) } else { Either::Left(body) })
}

