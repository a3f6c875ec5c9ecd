//! Keep-alive HTTP/1.1 connections from one proxy thread to the upstream,
//! or one multiplexed HTTP/2 connection when a TLS upstream picks h2 by ALPN.
//!
//! Each proxy thread runs its own single-threaded runtime and talks to one
//! upstream, so its connections need no sharing between threads and no map
//! keyed by host: a stack of idle connections is enough (as an NGINX worker's
//! `keepalive` cache). A connection goes back on the stack once the upstream's
//! response body has been read to the end, and is taken again only while
//! it is ready (hyper says so for its own; for ours, nothing has arrived on
//! it); the most recently used is taken first, so the connections a burst
//! opened age out once it is over.
//!
//! A body-less request to a plain `http://` upstream goes by our own
//! HTTP/1.1 client (`http1`), on the request's task: its connections wait
//! on a stack of their own as bare sockets. Requests with bodies, TLS and
//! protocol switches go by hyper's; each client takes the other's idle
//! connections when it has none of its own (hyper's by way of parking).
//!
//! A plain connection idle for a second is *parked*, as the client side's
//! are (`serve::parking`): hyper's side of it (its read and write buffers
//! and its task, ~19 KB) is let go and only the socket is kept, out of the
//! runtime's epoll set, until a request needs it. NGINX's `keepalive` cache
//! keeps little more than the socket too.

use std::collections::VecDeque;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::uri::Authority;
use http::{Request, Response, StatusCode};
use hyper::body::{Body, Frame, Incoming, SizeHint};

use super::body::{BodyError, Causes, ClientBody, IdleTimer, Stalled};
use super::fair::Fair;
use super::http1 as ours;
use http::Uri;
use hyper::client::conn::http1::{self, SendRequest};
use hyper::client::conn::http2;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpStream;

use super::{Upstream, UpstreamTls};
use crate::alarm::Alarm;

/// Why a request could not be sent upstream or its response not read.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    /// No connection to the upstream could be opened.
    #[error("cannot connect to the upstream {authority}: {source}")]
    Connect {
        /// Where we tried to connect.
        authority: Authority,
        /// What the operating system said.
        source: io::Error,
    },
    /// The TLS handshake with an `https://` upstream failed (its
    /// certificate did not verify, it does not speak TLS...).
    #[error("TLS with the upstream {authority} failed: {source}")]
    Tls {
        /// Where we connected.
        authority: Authority,
        /// What rustls said.
        source: io::Error,
    },
    /// No answer's head by the deadline the request was sent with (our
    /// own client's; hyper's is timed by the proxy).
    #[error("no answer from the upstream in time")]
    NoAnswer,
    /// The HTTP exchange failed (connection reset, malformed response...).
    #[error("upstream exchange failed: {0}{causes}", causes = Causes(.0))]
    Http(#[from] hyper::Error),
    /// A protocol switch (WebSocket) asked of an upstream speaking HTTP/2.
    #[error("the upstream speaks HTTP/2: a WebSocket upgrade needs an HTTP/1.1 upstream")]
    UpgradeOverH2,
    /// Our own HTTP/1.1 exchange failed before the response head was read.
    #[error("upstream exchange failed: {0}")]
    Http1(#[from] super::http1::Http1Error),
    /// A request left unprocessed on a new HTTP/2 connection too.
    #[error("the upstream left the request unprocessed on a new HTTP/2 connection too (closed it, refused the stream, or sent GOAWAY below it)")]
    Unprocessed,
    /// The client's body failed while it was read ahead (a stall, a reset).
    #[error("the client's request body failed: {0}")]
    ClientBody(BodyError),
    /// The request's target cannot be written as HTTP/2's `:authority` and `:path`.
    #[error("request target cannot be sent over HTTP/2: {0}")]
    Target(#[from] http::uri::InvalidUriParts),
    /// An HTTP/2 upstream failed the response's body as it sent the head
    /// (a reset stream or a GOAWAY in the same read): nothing has reached
    /// the client, which can still be told 502.
    #[error("the upstream's HTTP/2 response failed right after its head: {0}{causes}", causes = Causes(&**.0))]
    FailedAfterHead(BodyError),
}

impl SendError {
    /// The client's own request body failed while it was being sent on
    /// (a malformed chunk, a reset): the client's fault, not the upstream's.
    pub fn is_client_body(&self) -> bool {
        match self {
            SendError::Http(e) => body_failed(e),
            SendError::ClientBody(_) => true,
            _ => false,
        }
    }
}

/// Whether hyper's `e` is the client body's own failure: a "user" error
/// whose cause is what [`ClientBody`] fails with. hyper's other user
/// errors are not the body's, though one carries a cause too: its dispatch
/// task gone, when an HTTP/2 connection ended with requests still waiting
/// for a stream (NGINX's GOAWAY after `keepalive_requests`).
fn body_failed(e: &hyper::Error) -> bool {
    e.is_user() && std::error::Error::source(e).is_some_and(|c| c.is::<Stalled>() || c.is::<hyper::Error>())
}


/// A per-thread pool of connections to one upstream.
#[derive(Clone)]
pub struct UpstreamPool {
    inner: Arc<PoolInner>,
}

struct PoolInner {
    authority: Authority,
    port: u16,
    tls: Option<UpstreamTls>,
    /// HTTP/2 in cleartext from the start (`h2c://`).
    h2c: bool,
    /// Longest wait between two frames of a response body.
    body_timeout: Duration,
    idle: Mutex<Kept>,
    idle_timeout: Duration,
    max_idle: usize,
    /// Whether the task that closes idle connections without traffic runs.
    sweeping: AtomicBool,
    /// The thread's HTTP/2 connection, when the upstream chose h2 by ALPN:
    /// every request shares it (NGINX's `http2_max_concurrent_streams` and
    /// the like queue the excess on it).
    h2: Mutex<Option<http2::SendRequest<ClientBody>>>,
    /// Whether a request of this thread is opening that connection: the
    /// others wait for it rather than each opening one (a burst at start,
    /// or when the upstream ended the last, opened 90 for 90 requests).
    h2_opening: AtomicBool,
    /// Told when that opening ends, opened or not.
    h2_opened: tokio::sync::Notify,
    /// Whether the last TLS connection's ALPN chose h2: the next is
    /// expected to, so one opens it for all.
    tls_chose_h2: AtomicBool,
}

/// The turn of a request to open the thread's HTTP/2 connection; when it
/// ends (the connection stored, the attempt failed, or the request gone)
/// the requests waiting look again.
struct Opening(Arc<PoolInner>);

impl Drop for Opening {
    fn drop(&mut self) {
        self.0.h2_opening.store(false, Ordering::Release);
        self.0.h2_opened.notify_waiters();
    }
}

/// A new connection, as the upstream chose to speak on it.
enum Connected {
    Http1(Sender),
    Http2(http2::SendRequest<ClientBody>),
}

/// How often idle connections are looked at: past their time they are
/// closed, idle this long they are parked.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// How often at most, for the shortest `--upstream-keepalive-timeout`.
const SWEEP_MIN: Duration = Duration::from_millis(100);

/// Whether `e` says the connection closed (or was reset) before a whole
/// head came (hyper tells nothing from part of one): what an upstream
/// closing an idle connection looks like, and what NGINX's
/// `proxy_next_upstream error` sends a request on a kept connection
/// again after. Over TLS
/// a close without close_notify (a server that drops the socket, as Node
/// and many load balancers do at their idle timeout) is rustls's
/// `UnexpectedEof`; it is the same close.
fn closed_unanswered(e: &hyper::Error) -> bool {
    e.is_incomplete_message()
        || cause::<io::Error>(e).is_some_and(|io| {
            matches!(
                io.kind(),
                io::ErrorKind::ConnectionReset
                    | io::ErrorKind::BrokenPipe
                    | io::ErrorKind::ConnectionAborted
                    | io::ErrorKind::UnexpectedEof
            )
        })
}

/// The first error of type `T` among `e`'s causes.
fn cause<T: std::error::Error + 'static>(e: &hyper::Error) -> Option<&T> {
    let mut source = std::error::Error::source(e);
    while let Some(err) = source {
        if let Some(found) = err.downcast_ref::<T>() {
            return Some(found);
        }
        source = err.source();
    }
    None
}

/// Longest request body read whole before it is sent to an HTTP/2
/// upstream, so it can be sent again (NGINX reads every body first, into
/// 16 KB of memory and then a file; Envoy keeps up to 1 MB for retries).
/// A longer one, or one of unknown length (a gRPC stream), streams.
const HOLD_AT_MOST: u64 = 64 * 1024;

/// What an attempt on the shared HTTP/2 connection came to.
enum Attempt {
    Answered(Response<UpstreamBody>),
    /// Left unprocessed: to go out on a new connection.
    Again(Request<ClientBody>),
}

/// How long an upstream connection stays idle before it is parked.
const PARK_AFTER: Duration = Duration::from_secs(1);

/// How long one of several addresses of the upstream gets before the next
/// is tried (as hyper-util's connector falls back between address families).
const NEXT_ADDRESS_AFTER: Duration = Duration::from_millis(300);

/// The sending side of an HTTP/1.1 connection.
struct Sender {
    send: SendRequest<ClientBody>,
    /// Set, to when the connection went idle, just before the pool drops
    /// `send` to park it: its task then hands the socket back instead of
    /// closing it, and the parked socket keeps the idle clock. `None` for
    /// one that is never parked (TLS, or opened for a protocol switch).
    park: Option<Arc<OnceLock<Instant>>>,
}

/// A connection ready for the next request.
struct Idle {
    sender: Sender,
    since: Instant,
}

/// A parked connection: the bare socket, outside the runtime's epoll set.
struct Parked {
    stream: std::net::TcpStream,
    since: Instant,
    /// Counts it in the gauge of upstream connections while it waits.
    open: crate::metrics::Held,
}

impl Parked {
    /// Whether it can carry a request: not past its time, and the upstream
    /// has neither closed it nor sent anything unasked (a 408, say).
    fn usable(&self, idle_timeout: Duration) -> bool {
        if self.since.elapsed() >= idle_timeout {
            return false;
        }
        // The socket is non-blocking (tokio's `into_std` leaves it so).
        matches!(self.stream.peek(&mut [0u8; 1]), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }
}

/// A connection of our own HTTP/1.1 client, ready for the next request.
struct OwnIdle {
    io: TcpStream,
    /// The version its last answer came in.
    peer: http::Version,
    /// Counts it in the gauge of upstream connections.
    open: crate::metrics::Held,
    since: Instant,
    /// Times the wait for each answer on it.
    alarm: Alarm,
}

impl OwnIdle {
    /// Whether the upstream has neither closed it nor sent anything unasked.
    /// Costs no system call while the runtime has seen nothing arrive on it
    /// (`try_read` looks at the readiness it holds first). Not by
    /// `poll_read_ready`: once the task's cooperative budget is spent, that
    /// answers "not ready" without looking, and a closed connection (or one
    /// holding an unasked 408) would pass for a quiet one.
    fn quiet(&self) -> bool {
        matches!(self.io.try_read(&mut [0u8; 1]), Err(e) if e.kind() == io::ErrorKind::WouldBlock)
    }
}

/// The idle connections: most recently returned at the back of each.
#[derive(Default)]
struct Kept {
    live: VecDeque<Idle>,
    own: VecDeque<OwnIdle>,
    parked: VecDeque<Parked>,
}

impl Kept {
    fn len(&self) -> usize {
        self.live.len().saturating_add(self.own.len()).saturating_add(self.parked.len())
    }

    /// The newest of our own client's connections still fit for a request
    /// (not past `timeout`, nothing arrived on it); those passed over are
    /// closed. `now`: a moment just read.
    fn pop_own(&mut self, timeout: Duration, now: Instant) -> Option<OwnIdle> {
        while let Some(own) = self.own.pop_back() {
            if now.saturating_duration_since(own.since) < timeout && own.quiet() {
                return Some(own);
            }
        }
        None
    }

    /// The newest parked connection still fit for a request; those passed
    /// over are closed.
    fn pop_parked(&mut self, timeout: Duration) -> Option<Parked> {
        while let Some(parked) = self.parked.pop_back() {
            if parked.usable(timeout) {
                return Some(parked);
            }
        }
        None
    }

    /// Gives up the oldest idle connection, parked ones first.
    fn drop_oldest(&mut self) {
        if self.parked.pop_front().is_none() && self.live.pop_front().is_none() {
            self.own.pop_front();
        }
    }
}

/// What [`UpstreamPool::take`] found.
enum Taken {
    /// One of hyper's.
    Live(Sender),
    /// One of our own client's.
    Own(OwnIdle),
    Parked(Parked),
}

impl UpstreamPool {
    /// A pool for `upstream` keeping up to `max_idle` connections for at
    /// most `idle_timeout` each.
    pub fn new(upstream: &Upstream, idle_timeout: Duration, max_idle: usize, body_timeout: Duration) -> Self {
        UpstreamPool {
            inner: Arc::new(PoolInner {
                authority: upstream.authority().clone(),
                port: upstream.port(),
                tls: upstream.tls().cloned(),
                h2c: upstream.h2c(),
                body_timeout,
                idle: Mutex::new(Kept::default()),
                idle_timeout,
                max_idle,
                sweeping: AtomicBool::new(false),
                h2: Mutex::new(None),
                h2_opening: AtomicBool::new(false),
                h2_opened: tokio::sync::Notify::new(),
                tls_chose_h2: AtomicBool::new(false),
            }),
        }
    }

    /// Sends `req` (origin-form URI, `Host` set) and returns the response
    /// head; the body streams from the upstream as it is read. `needs_h2`
    /// (a gRPC call that came over HTTP/2) sends it over HTTP/2 even to a
    /// plain `http://` upstream, with prior knowledge (h2c), as gRPC
    /// servers speak no HTTP/1.1.
    pub async fn send(&self, mut req: Request<ClientBody>, needs_h2: bool) -> Result<Response<UpstreamBody>, SendError> {
        if self.sends_own(needs_h2) && ours::fits(&req) {
            return self.send_own(req, None, Instant::now(), None).await;
        }
        let h2c = self.inner.h2c || (needs_h2 && self.inner.tls.is_none());
        // A protocol switch gets a connection of its own, which hyper hands
        // to the tunnel on a 101: a parkable one would not be handed over.
        let switching = req.headers().contains_key(http::header::UPGRADE);
        let expect_h2 = !switching && (h2c || self.inner.tls_chose_h2.load(Ordering::Relaxed));
        let mut opening = None;
        let mut waited = false;
        loop {
            if let Some(h2) = self.shared_h2(h2c) {
                match Box::pin(self.send_shared_h2(h2, req)).await? {
                    Attempt::Answered(response) => return Ok(response),
                    Attempt::Again(unsent) => req = unsent,
                }
                break;
            }
            // Once waited for, a connection that did not open is this
            // request's to try: each in turn would wait out every failure.
            if !expect_h2 || waited {
                break;
            }
            match Box::pin(self.h2_turn()).await {
                Some(turn) => {
                    opening = Some(turn);
                    break;
                }
                None => waited = true,
            }
        }
        // Sent again once on a new connection: kept idle ones are not tried.
        let mut fresh_only = false;
        loop {
            // The HTTP/1.1 stack is never h2c's.
            let taken = if h2c || switching || fresh_only { None } else { self.take() };
            let (mut sender, reused) = match taken {
                Some(Taken::Live(sender)) => (sender, true),
                Some(Taken::Own(own)) => {
                    let OwnIdle { io, open, .. } = own;
                    match Box::pin(start_parkable(io, Arc::downgrade(&self.inner), open)).await {
                        Ok(sender) => (sender, true),
                        Err(_) => continue,
                    }
                }
                Some(Taken::Parked(parked)) => {
                    match Box::pin(self.unpark(parked)).await {
                        Some(sender) => (sender, true),
                        None => continue,
                    }
                }
                // Boxed, as the other rare steps: connecting (TCP, TLS,
                // the HTTP/2 handshake) is kilobytes of future, and the
                // send's future, sized for its largest step, was copied
                // whole into its box on every request (~8 KB).
                None => match Box::pin(self.connect(h2c, !switching)).await? {
                    Connected::Http1(sender) => {
                        drop(opening.take());
                        (sender, false)
                    }
                    Connected::Http2(h2) => {
                        *self.inner.h2.lock().unwrap_or_else(|p| p.into_inner()) = Some(h2.clone());
                        drop(opening.take());
                        // One left unprocessed on a fresh connection too
                        // (refused, or its GOAWAY at once) goes out once
                        // more, on another; failing there is final.
                        match Box::pin(self.send_shared_h2(h2, req)).await? {
                            Attempt::Answered(response) => return Ok(response),
                            Attempt::Again(_) if fresh_only => return Err(SendError::Unprocessed),
                            Attempt::Again(unsent) => {
                                req = unsent;
                                fresh_only = true;
                                continue;
                            }
                        }
                    }
                },
            };
            // A body of unknown length (a chunked upload; an HTTP/2
            // client's without content-length) is sent chunked. hyper's
            // client would send a GET's or a HEAD's as no body at all.
            if !req.body().is_end_stream()
                && req.body().size_hint().exact().is_none()
                && !req.headers().contains_key(http::header::CONTENT_LENGTH)
            {
                req.headers_mut()
                    .insert(http::header::TRANSFER_ENCODING, http::HeaderValue::from_static("chunked"));
            }
            // An upstream closes a connection idle past its own timeout
            // (Node after 5 s, gunicorn after 2 s), or a busy one as it
            // reloads (NGINX): when that crosses the request on the wire,
            // the request went out and no answer comes. A body-less request
            // of an idempotent method is then sent again on a new
            // connection, as NGINX's proxy_next_upstream does (RFC 9110
            // §9.2.2). hyper's client consumes the request, so its head is
            // copied first, on every reused connection: a busy one is closed
            // as often as an idle one.
            let again = (reused
                && req.method().is_idempotent()
                && req.body().is_end_stream())
            .then(|| Replay::of(&req, Bytes::new()));
            match sender.send.try_send_request(req).await {
                Ok(response) => return Ok(self.lease(sender, response)),
                Err(mut e) => match e.take_message() {
                    // The upstream closed a kept-alive connection before the
                    // request went out: nothing was sent, so another
                    // connection may carry it. A fresh one failing is final.
                    Some(unsent) if reused => req = unsent,
                    _ => {
                        let e = e.into_error();
                        match again {
                            Some(again) if closed_unanswered(&e) => {
                                tracing::debug!(error = %e, "an idle upstream connection closed as the request went out; sending it again on a new one");
                                req = again.request(self.inner.body_timeout);
                                fresh_only = true;
                            }
                            _ => return Err(SendError::Http(e)),
                        }
                    }
                },
            }
        }
    }

    /// Whether a body-less request (no protocol switch, not CONNECT) goes
    /// by our own HTTP/1.1 client: to a plain `http://` upstream, unless
    /// it must go over HTTP/2 (`h2c://`, or `needs_h2`, see [`Self::send`]).
    pub fn sends_own(&self, needs_h2: bool) -> bool {
        !self.inner.h2c && !needs_h2 && self.inner.tls.is_none()
    }

    /// Sends a body-less `req` whose header fields are `fields`, already
    /// written (`name: value\r\n` lines; `req`'s map is not read), by our
    /// own HTTP/1.1 client: for a request [`Self::sends_own`] says so of.
    /// Not an `async fn` of its own: a second state machine around
    /// `send_own`'s would be one more copy of it per request.
    /// `sent`: a moment just read. The answer's head must come within
    /// `timeout` of it ([`SendError::NoAnswer`] then), connecting included;
    /// with none, the caller times the wait.
    pub fn send_written(
        &self,
        req: Request<ClientBody>,
        fields: Vec<u8>,
        sent: Instant,
        timeout: Option<Duration>,
    ) -> impl Future<Output = Result<Response<UpstreamBody>, SendError>> + Send + '_ {
        self.send_own(req, Some(fields), sent, timeout)
    }

    /// Sends a body-less `req` by our own HTTP/1.1 client, on the most
    /// recently used idle connection or a new one. When a kept one ends
    /// before a whole head answers (as the request goes out, or with part
    /// of a head), an idempotent request goes again on a new connection, as
    /// NGINX's `proxy_next_upstream error` does on a kept connection, and
    /// as hyper's path does (see `send`). The request is only borrowed, so
    /// going again costs nothing until it is needed.
    ///
    /// The wait is timed by the connection's own [`Alarm`], kept with it
    /// from request to request, not by a timer per request.
    async fn send_own(
        &self,
        req: Request<ClientBody>,
        fields: Option<Vec<u8>>,
        sent: Instant,
        timeout: Option<Duration>,
    ) -> Result<Response<UpstreamBody>, SendError> {
        // Past any time an operator can write: no deadline.
        let due = timeout.and_then(|t| tokio::time::Instant::from_std(sent).checked_add(t));
        let mut fresh_only = false;
        loop {
            let taken = if fresh_only { None } else { self.take_own(sent) };
            let (io, open, peer, reused, mut alarm) = match taken {
                Some(own) => (own.io, own.open, own.peer, true, own.alarm),
                None => {
                    let mut alarm = Alarm::new();
                    let opened = tokio::select! {
                        biased;
                        opened = Box::pin(self.open_stream()) => opened?,
                        () = std::future::poll_fn(|cx| alarm.poll_at(cx, due)) => return Err(SendError::NoAnswer),
                    };
                    let open = crate::metrics::Held::new(crate::metrics::get().upstream_connections().clone());
                    (opened, open, http::Version::HTTP_11, false, alarm)
                }
            };
            let mut exchange = std::pin::pin!(ours::exchange(io, &req, fields.as_deref(), peer));
            let exchanged = std::future::poll_fn(|cx| match exchange.as_mut().poll(cx) {
                Poll::Ready(exchanged) => Poll::Ready(Some(exchanged)),
                Poll::Pending => alarm.poll_at(cx, due).map(|()| None),
            });
            let Some(exchanged) = exchanged.await else {
                return Err(SendError::NoAnswer);
            };
            match exchanged {
                Ok(response) => return Ok(self.own_lease(response, open, alarm)),
                Err(e) if e.head_lost() && reused && req.method().is_idempotent() => {
                    tracing::debug!(error = %e, "a kept upstream connection ended before the response head; sending the request again on a new one");
                    fresh_only = true;
                }
                Err(e) => return Err(SendError::Http1(e)),
            }
        }
    }

    /// The most recently returned idle connection our own client can use:
    /// one of its own, else a parked socket.
    fn take_own(&self, now: Instant) -> Option<OwnIdle> {
        let mut idle = self.inner.idle.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(own) = idle.pop_own(self.inner.idle_timeout, now) {
            return Some(own);
        }
        while let Some(parked) = idle.pop_parked(self.inner.idle_timeout) {
            let Parked { stream, open, since } = parked;
            match TcpStream::from_std(stream) {
                Ok(io) => {
                    let peer = http::Version::HTTP_11;
                    return Some(OwnIdle {
                        io,
                        peer,
                        open,
                        since,
                        alarm: Alarm::new(),
                    });
                }
                Err(e) => tracing::debug!(error = %e, "a parked upstream connection could not be used again"),
            }
        }
        None
    }

    /// Keeps a connection our own client has finished an exchange on.
    fn put_own(&self, io: TcpStream, peer: http::Version, open: crate::metrics::Held, alarm: Alarm) {
        let mut idle = self.inner.idle.lock().unwrap_or_else(|p| p.into_inner());
        idle.own.push_back(OwnIdle {
            io,
            peer,
            open,
            since: Instant::now(),
            alarm,
        });
        if idle.len() > self.inner.max_idle {
            idle.drop_oldest();
        }
    }

    /// Ties the connection to our own client's response body, to come back
    /// once the body has been read to its end.
    fn own_lease(
        &self,
        response: Response<ours::ResponseBody<TcpStream>>,
        open: crate::metrics::Held,
        alarm: Alarm,
    ) -> Response<UpstreamBody> {
        let timer = IdleTimer::new(self.inner.body_timeout);
        let lease = Lease::Own {
            pool: self.clone(),
            open,
            alarm,
        };
        response.map(|body| UpstreamBody::new(Received::Own(Box::new(body)), timer, Some(lease), Framing::Http1))
    }

    /// Sends `req` on the thread's HTTP/2 connection. A short body is read
    /// whole first, as NGINX reads every body before it connects upstream
    /// and Envoy keeps one for its retries: when the upstream ends the
    /// connection with the request unprocessed (GOAWAY above it, or
    /// REFUSED_STREAM: an upstream's `keepalive_requests` or max connection
    /// age), it goes out again on a new connection, body and all.
    async fn send_shared_h2(
        &self,
        h2: http2::SendRequest<ClientBody>,
        mut req: Request<ClientBody>,
    ) -> Result<Attempt, SendError> {
        let held = req.body_mut().hold(HOLD_AT_MOST).await.map_err(SendError::ClientBody)?;
        let again = held.map(|body| Replay::of(&req, body));
        let attempt = match self.send_h2(h2, req).await {
            Ok(Ok(response)) => return Ok(Attempt::Answered(response)),
            // The connection was going away: nothing went out.
            Ok(Err(unsent)) => Attempt::Again(unsent),
            // It went out, and the upstream says it did not process it
            // (RFC 9113 §8.7).
            Err(SendError::Http(e)) => match again {
                Some(again) if again.may_resend(&e) => {
                    tracing::debug!(error = %SendError::Http(e), "the upstream's HTTP/2 connection left a request unprocessed; sending it again on a new one");
                    Attempt::Again(again.request(self.inner.body_timeout))
                }
                _ => return Err(SendError::Http(e)),
            },
            Err(e) => return Err(e),
        };
        *self.inner.h2.lock().unwrap_or_else(|p| p.into_inner()) = None;
        Ok(attempt)
    }

    /// This request's turn to open the thread's HTTP/2 connection, or
    /// `None` once the request that had it is done (look again then).
    async fn h2_turn(&self) -> Option<Opening> {
        let opened = self.inner.h2_opened.notified();
        tokio::pin!(opened);
        // Told from here on, before the look: no end is missed.
        opened.as_mut().enable();
        if !self.inner.h2_opening.swap(true, Ordering::AcqRel) {
            return Some(Opening(self.inner.clone()));
        }
        opened.await;
        None
    }

    /// The thread's HTTP/2 connection, while it is open.
    fn shared_h2(&self, h2c: bool) -> Option<http2::SendRequest<ClientBody>> {
        // A plain http:// upstream has one only for gRPC: no lock on the
        // hot path of its other requests.
        if self.inner.tls.is_none() && !h2c {
            return None;
        }
        let mut h2 = self.inner.h2.lock().unwrap_or_else(|p| p.into_inner());
        if h2.as_ref().is_some_and(|s| s.is_closed()) {
            *h2 = None;
        }
        h2.clone()
    }

    /// Sends `req` as an HTTP/2 stream: the origin-form target becomes
    /// `:path`, the `Host` the client sent (or the upstream's) `:authority`.
    /// A request the connection did not send comes back as it was given.
    async fn send_h2(
        &self,
        mut h2: http2::SendRequest<ClientBody>,
        mut req: Request<ClientBody>,
    ) -> Result<Result<Response<UpstreamBody>, Request<ClientBody>>, SendError> {
        // HTTP/2 has no Upgrade: the request would go as a plain one and a
        // 101 back would leave the client waiting for the upstream timeout.
        if req.headers().contains_key(http::header::UPGRADE) {
            return Err(SendError::UpgradeOverH2);
        }
        let authority = req
            .headers_mut()
            .remove(http::header::HOST)
            .and_then(|h| Authority::try_from(h.as_bytes()).ok())
            .unwrap_or_else(|| self.inner.authority.clone());
        let mut parts = std::mem::take(req.uri_mut()).into_parts();
        parts.scheme = Some(match self.inner.tls {
            None => http::uri::Scheme::HTTP,
            Some(_) => http::uri::Scheme::HTTPS,
        });
        parts.authority = Some(authority);
        if parts.path_and_query.is_none() {
            parts.path_and_query = Some(http::uri::PathAndQuery::from_static("/"));
        }
        *req.uri_mut() = Uri::from_parts(parts)?;
        *req.version_mut() = http::Version::HTTP_2;
        // Never put in the shared HPACK table: a value one caller chose
        // could change how grpc-core reads the same header on everyone's
        // later calls on this connection.
        for (name, value) in req.headers_mut().iter_mut() {
            if name.as_str().starts_with("grpc-") {
                value.set_sensitive(true);
            }
        }
        let head_only = req.method() == http::Method::HEAD;
        let response = match h2.try_send_request(req).await {
            Ok(response) => response,
            Err(mut e) => match e.take_message() {
                Some(unsent) => return Ok(Err(as_http1(unsent))),
                None => return Err(SendError::Http(e.into_error())),
            },
        };
        let timer = IdleTimer::new(self.inner.body_timeout);
        // A HEAD's answer, a 204 or a 304 has no body, whatever DATA the
        // upstream sends (an HTTP/2 client would reset the stream for it:
        // RFC 9113 §8.1.1) or length it declares; any other answer's body
        // is checked against its length. hyper's HTTP/1 client does both.
        let framing = if head_only || matches!(response.status(), StatusCode::NO_CONTENT | StatusCode::NOT_MODIFIED) {
            Framing::Bodiless
        } else {
            Framing::Declared
        };
        let mut response = response.map(|body| UpstreamBody::new(Received::Hyper(body), timer, None, framing));
        if let Some(e) = response.body_mut().failed_at_once() {
            return Err(SendError::FailedAfterHead(e));
        }
        Ok(Ok(response))
    }

    /// The most recently returned connection that can take a request now:
    /// one of hyper's that is ready, else one of our own client's (hyper
    /// is started on it), else a parked one.
    fn take(&self) -> Option<Taken> {
        let mut idle = self.inner.idle.lock().unwrap_or_else(|p| p.into_inner());
        let live = &mut idle.live;
        // Newest first; `i` stays in bounds as entries behind it go.
        for i in (0..live.len()).rev() {
            let Some(entry) = live.get(i) else { continue };
            let idle = entry.since.elapsed();
            if entry.sender.send.is_closed() || idle >= self.inner.idle_timeout {
                // Dropping it closes it.
                live.remove(i);
            } else if entry.sender.send.is_ready() {
                return live.remove(i).map(|e| Taken::Live(e.sender));
            }
            // Otherwise its connection has not yet seen the end of the
            // response it was returned after; it will be ready soon.
        }
        if let Some(own) = idle.pop_own(self.inner.idle_timeout, Instant::now()) {
            return Some(Taken::Own(own));
        }
        idle.pop_parked(self.inner.idle_timeout).map(Taken::Parked)
    }

    /// Serves HTTP/1.1 on a parked connection again (`None`: its socket
    /// could not rejoin the runtime, and is closed).
    async fn unpark(&self, parked: Parked) -> Option<Sender> {
        let Parked { stream, open, .. } = parked;
        let stream = TcpStream::from_std(stream)
            .inspect_err(|e| tracing::debug!(error = %e, "a parked upstream connection could not be used again"))
            .ok()?;
        start_parkable(stream, Arc::downgrade(&self.inner), open).await.ok()
    }

    fn put(&self, sender: Sender) {
        if sender.send.is_closed() {
            return;
        }
        // Expired ones are the sweep's and `take`'s to drop; a full pool
        // gives up its oldest, parked ones first.
        let mut idle = self.inner.idle.lock().unwrap_or_else(|p| p.into_inner());
        idle.live.push_back(Idle {
            sender,
            since: Instant::now(),
        });
        if idle.len() > self.inner.max_idle {
            idle.drop_oldest();
        }
    }

    /// Closes idle connections past their time even when no request comes
    /// to notice; runs on the thread's runtime until the pool is dropped.
    fn start_sweeping(&self) {
        if self.inner.sweeping.swap(true, Ordering::Relaxed) {
            return;
        }
        let pool = Arc::downgrade(&self.inner);
        // Often enough that none outlives its time by more than a second;
        // never busily (a connection past its time is not reused anyway).
        let every = self.inner.idle_timeout.clamp(SWEEP_MIN, SWEEP_EVERY);
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval(every);
            ticks.tick().await;
            loop {
                ticks.tick().await;
                let Some(pool) = pool.upgrade() else { return };
                let mut idle = pool.idle.lock().unwrap_or_else(|p| p.into_inner());
                idle.live.retain(|e| {
                    if e.sender.send.is_closed() || e.since.elapsed() >= pool.idle_timeout {
                        return false;
                    }
                    // Idle a second and between responses: dropped here, its
                    // task hands the socket back to `park`.
                    match &e.sender.park {
                        Some(park) if e.since.elapsed() >= PARK_AFTER && e.sender.send.is_ready() => {
                            let _ = park.set(e.since);
                            false
                        }
                        _ => true,
                    }
                });
                // Our own client's: closed or past their time, let go; idle
                // a second, parked (the socket leaves the epoll set).
                for own in std::mem::take(&mut idle.own) {
                    let waited = own.since.elapsed();
                    if waited >= pool.idle_timeout || !own.quiet() {
                        continue;
                    }
                    if waited < PARK_AFTER {
                        idle.own.push_back(own);
                        continue;
                    }
                    // Idle since it was returned, not since it was parked:
                    // closed after `idle_timeout` either way.
                    let OwnIdle { io, open, since, .. } = own;
                    match io.into_std() {
                        Ok(stream) => idle.parked.push_back(Parked { stream, since, open }),
                        Err(e) => tracing::debug!(error = %e, "an idle upstream connection could not be parked"),
                    }
                }
                // One `peek` each: what the upstream closed is let go now,
                // not found when a request wants it.
                idle.parked.retain(|p| p.usable(pool.idle_timeout));
            }
        });
    }

    /// Opens a connection: TLS for an `https://` upstream (the protocol by
    /// ALPN), else HTTP/2 with prior knowledge when `h2c`, else HTTP/1.1,
    /// which may be parked when idle if `parkable`.
    async fn connect(&self, h2c: bool, parkable: bool) -> Result<Connected, SendError> {
        let authority = &self.inner.authority;
        let stream = self.open_stream().await?;
        match &self.inner.tls {
            None if h2c => start_h2(stream).await.map(Connected::Http2),
            None if parkable => {
                let open = crate::metrics::Held::new(crate::metrics::get().upstream_connections().clone());
                start_parkable(stream, Arc::downgrade(&self.inner), open)
                    .await
                    .map(Connected::Http1)
            }
            None => start_connection(stream).await.map(Connected::Http1),
            Some(tls) => {
                let stream = tls
                    .connector
                    .connect(tls.name.clone(), stream)
                    .await
                    .map_err(|source| SendError::Tls {
                        authority: authority.clone(),
                        source,
                    })?;
                let h2 = stream.get_ref().1.alpn_protocol() == Some(b"h2");
                self.inner.tls_chose_h2.store(h2, Ordering::Relaxed);
                if h2 {
                    start_h2(stream).await.map(Connected::Http2)
                } else {
                    start_connection(stream).await.map(Connected::Http1)
                }
            }
        }
    }

    /// Opens a TCP connection to the upstream, trying its addresses in turn.
    async fn open_stream(&self) -> Result<TcpStream, SendError> {
        let authority = &self.inner.authority;
        let connect_error = |source| SendError::Connect {
            authority: authority.clone(),
            source,
        };
        self.start_sweeping();
        let port = self.inner.port;
        // `[::1]` is how an authority writes an IPv6 address; a resolver
        // wants it bare.
        let host = authority.host().trim_start_matches('[').trim_end_matches(']');
        let addresses: Vec<SocketAddr> = tokio::net::lookup_host((host, port))
            .await
            .map_err(connect_error)?
            .collect();
        let mut last_error = io::Error::new(io::ErrorKind::NotFound, "the name has no address");
        let mut stream = None;
        for (i, address) in addresses.iter().enumerate() {
            let attempt = TcpStream::connect(address);
            // The last address may take as long as the caller allows.
            let result = if i.saturating_add(1) < addresses.len() {
                tokio::time::timeout(NEXT_ADDRESS_AFTER, attempt)
                    .await
                    .unwrap_or_else(|_| Err(io::Error::new(io::ErrorKind::TimedOut, "connect timed out")))
            } else {
                attempt.await
            };
            match result {
                Ok(s) => {
                    stream = Some(s);
                    break;
                }
                Err(e) => last_error = e,
            }
        }
        let stream = stream.ok_or_else(|| connect_error(last_error))?;
        stream.set_nodelay(true).map_err(connect_error)?;
        Ok(stream)
    }

    /// Ties `sender` to the response body so that it comes back once the body
    /// has been read; an upgraded connection belongs to the tunnel instead.
    fn lease(&self, sender: Sender, response: Response<Incoming>) -> Response<UpstreamBody> {
        let lease = (response.status() != StatusCode::SWITCHING_PROTOCOLS).then(|| Lease::Hyper {
            pool: self.clone(),
            sender,
        });
        let timer = IdleTimer::new(self.inner.body_timeout);
        response.map(|body| UpstreamBody::new(Received::Hyper(body), timer, lease, Framing::Http1))
    }
}

/// Largest response head (and trailers) an upstream may send: a larger one
/// fails the exchange, `502`, as NGINX answers one past `proxy_buffer_size`
/// ("upstream sent too big header") and Envoy one past
/// `max_response_headers_kb` (60). The bound of a client's head too.
pub const MAX_RESPONSE_HEAD: usize = 64 * 1024;

/// The HTTP/2 header block size advertised to the upstream: HTTP/2 counts
/// 32 bytes more per field than HTTP/1 writes, so a head the proxy takes
/// always fits, and one past it is refused by the proxy for its stream only.
const H2_HEADER_LIST: u32 = 256 * 1024;

/// How HTTP/1.1 is spoken to the upstream.
fn http1_client() -> http1::Builder {
    let mut builder = http1::Builder::new();
    builder.max_header_size(MAX_RESPONSE_HEAD);
    // hyper's reads grow to ~400 KB while an upstream keeps them full, and
    // what one read brings is decoded before the connection's task yields
    // (`fair`): a largest head and a little more is room enough.
    builder.max_buf_size(MAX_RESPONSE_HEAD + 16 * 1024);
    builder
}

/// Begins HTTP/1.1 on a new connection that is never parked; the
/// connection runs on its own task (counted in the gauge of upstream
/// connections) until it closes or a protocol switch takes it over.
async fn start_connection<T>(io: T) -> Result<Sender, SendError>
where
    T: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (send, conn) = http1_client().handshake(TokioIo::new(Fair::new(io))).await?;
    let open = crate::metrics::Held::new(crate::metrics::get().upstream_connections().clone());
    tokio::spawn(async move {
        // Counted until the task ends, however it ends.
        let _open = open;
        if let Err(e) = conn.with_upgrades().await {
            tracing::debug!(error = %e, "upstream connection ended with an error");
        }
    });
    Ok(Sender { send, park: None })
}

/// Begins HTTP/1.1 on a plain connection (new, or parked until now) that
/// the pool may park: its task runs until the connection closes, or until
/// the pool lets go of its sender to park it and the socket goes back to
/// `pool`. `open` counts it in the gauge of upstream connections.
async fn start_parkable(
    stream: TcpStream,
    pool: Weak<PoolInner>,
    open: crate::metrics::Held,
) -> Result<Sender, SendError> {
    let (send, conn) = http1_client().handshake(TokioIo::new(Fair::new(stream))).await?;
    let park = Arc::new(OnceLock::new());
    let parking = park.clone();
    tokio::spawn(async move {
        // Without shutdown: hyper leaves the socket open when it is done,
        // so a parked one can be handed back. Done otherwise (closed by the
        // upstream, `Connection: close`, an error) it is dropped, closed.
        let parts = match conn.without_shutdown().await {
            Ok(parts) => parts,
            Err(e) => {
                tracing::debug!(error = %e, "upstream connection ended with an error");
                return;
            }
        };
        // Bytes the upstream sent unasked mean it is not idle: closed.
        let Some(&since) = parking.get() else { return };
        if !parts.read_buf.is_empty() {
            return;
        }
        let Some(pool) = pool.upgrade() else { return };
        match parts.io.into_inner().into_inner().into_std() {
            Ok(stream) => keep_parked(&pool, stream, open, since),
            Err(e) => tracing::debug!(error = %e, "an idle upstream connection could not be parked"),
        }
    });
    Ok(Sender { send, park: Some(park) })
}

/// Keeps an idle connection's bare socket in `pool`, unless it is full;
/// idle `since` then, it is closed `idle_timeout` after.
fn keep_parked(pool: &PoolInner, stream: std::net::TcpStream, open: crate::metrics::Held, since: Instant) {
    let mut idle = pool.idle.lock().unwrap_or_else(|p| p.into_inner());
    if idle.len() < pool.max_idle {
        idle.parked.push_back(Parked { stream, since, open });
    }
}

/// The head of a body-less request, to send it again.
struct Replay {
    method: http::Method,
    uri: Uri,
    headers: http::HeaderMap,
    body: Bytes,
}

impl Replay {
    fn of(req: &Request<ClientBody>, body: Bytes) -> Replay {
        Replay {
            method: req.method().clone(),
            uri: req.uri().clone(),
            headers: req.headers().clone(),
            body,
        }
    }

    /// Whether the failure `e` lets it go out again: it never left (the
    /// connection's task was gone, or it was canceled before dispatch); the
    /// upstream reset it with REFUSED_STREAM, or a graceful GOAWAY left it
    /// above the last stream the upstream would process (both unprocessed,
    /// RFC 9113 §8.7); or the connection went away with an error (a GOAWAY
    /// with one, a reset, a close, a PING gone unanswered) and the method
    /// is idempotent, so sending it twice is allowed (RFC 9110 §9.2.2).
    fn may_resend(&self, e: &hyper::Error) -> bool {
        if e.is_canceled() || (e.is_user() && !body_failed(e)) {
            return true;
        }
        let idempotent = self.method.is_idempotent();
        if idempotent && (closed_unanswered(e) || e.is_timeout()) {
            return true;
        }
        cause::<h2::Error>(e).is_some_and(|h2| {
            let gone = (h2.is_go_away() && h2.is_remote()) || h2.is_io();
            h2.reason() == Some(h2::Reason::REFUSED_STREAM)
                || (gone && h2.reason() == Some(h2::Reason::NO_ERROR))
                || (gone && idempotent)
        })
    }

    fn request(self, body_timeout: Duration) -> Request<ClientBody> {
        let mut req = Request::new(ClientBody::again(self.body, body_timeout));
        *req.method_mut() = self.method;
        *req.uri_mut() = self.uri;
        *req.headers_mut() = self.headers;
        req
    }
}

/// A request made ready for HTTP/2 as it was before: origin-form target,
/// `:authority` back in `Host`.
fn as_http1(mut req: Request<ClientBody>) -> Request<ClientBody> {
    let parts = std::mem::take(req.uri_mut()).into_parts();
    if let Some(host) = parts
        .authority
        .as_ref()
        .and_then(|a| http::HeaderValue::from_str(a.as_str()).ok())
    {
        req.headers_mut().insert(http::header::HOST, host);
    }
    if let Some(pq) = parts.path_and_query {
        *req.uri_mut() = Uri::from(pq);
    }
    *req.version_mut() = http::Version::HTTP_11;
    req
}

/// How often an HTTP/2 upstream connection with streams open is sent a
/// PING when nothing else comes from it.
const H2_PING_EVERY: Duration = Duration::from_secs(5);

/// How long a PING's answer may take before the connection is given up: an
/// upstream alive but busy answers PINGs in its HTTP/2 layer, long before
/// this (hyper's own default is 20 s).
const H2_PING_WAIT: Duration = Duration::from_secs(10);

/// Most response bytes one HTTP/2 stream may have in flight to tollgate.
const STREAM_WINDOW: u32 = 1 << 20;

/// The whole HTTP/2 connection's receive window: the most HTTP/2 allows.
const CONNECTION_WINDOW: u32 = (1 << 31) - 1;

/// Begins HTTP/2 on a new connection the upstream chose h2 for; the
/// connection runs on its own task until it closes.
async fn start_h2<T>(io: T) -> Result<http2::SendRequest<ClientBody>, SendError>
where
    T: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (sender, conn) = http2::Builder::new(TokioExecutor::new())
        .timer(TokioTimer::new())
        // Every client's streams share this connection: a response its
        // client does not read holds its stream's window, never the whole
        // connection's (with hyper's 5 MB, three stalled readers stalled
        // every call). Each stalled stream holds at most 1 MB here.
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        // A header block past this ends the whole connection (its HPACK
        // state is lost): hyper's 16 KB failed every stream on it for one
        // 17 KB head. Past MAX_RESPONSE_HEAD the proxy answers 502 itself.
        .max_header_list_size(H2_HEADER_LIST)
        // Every request of the thread shares this connection: one whose
        // upstream stopped answering with the TCP connection still open (a
        // handshake never answered, a NAT or balancer that dropped it
        // without a FIN) would take every request to a 504 for good. While
        // streams are open, a PING unanswered ends it, and the next
        // request opens another (as NGINX drops an upstream connection
        // past its read timeout).
        .keep_alive_interval(H2_PING_EVERY)
        .keep_alive_timeout(H2_PING_WAIT)
        .handshake(TokioIo::new(super::resets::ResetsAsErrors::new(io)))
        .await?;
    let open = crate::metrics::Held::new(crate::metrics::get().upstream_connections().clone());
    tokio::spawn(async move {
        let _open = open;
        if let Err(e) = conn.await {
            tracing::debug!(error = %e, "upstream HTTP/2 connection ended with an error");
        }
    });
    Ok(sender)
}

/// What brings a response's connection back to the pool.
enum Lease {
    /// One of hyper's: its sender, once the body was read to the end.
    Hyper { pool: UpstreamPool, sender: Sender },
    /// One of our own client's: the body hands back the socket when it
    /// can carry another request.
    Own {
        pool: UpstreamPool,
        open: crate::metrics::Held,
        alarm: Alarm,
    },
}

/// A response body as one of the two clients reads it.
enum Received {
    Hyper(Incoming),
    /// Boxed: every response the proxy makes, a refusal too, is moved
    /// about at the size of the largest body it can carry (BENCHMARKS.md §48).
    Own(Box<ours::ResponseBody<TcpStream>>),
}

impl Body for Received {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        match self.get_mut() {
            Received::Hyper(body) => Pin::new(body).poll_frame(cx).map(|f| f.map(|f| f.map_err(Into::into))),
            Received::Own(body) => Pin::new(body).poll_frame(cx).map(|f| f.map(|f| f.map_err(Into::into))),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Received::Hyper(body) => body.is_end_stream(),
            Received::Own(body) => body.is_end_stream(),
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Received::Hyper(body) => body.size_hint(),
            Received::Own(body) => body.size_hint(),
        }
    }
}

/// The upstream's response body; returns its connection to the pool when
/// dropped after the last byte (a body abandoned half way closes it).
pub struct UpstreamBody {
    body: Received,
    timer: IdleTimer,
    lease: Option<Lease>,
    ended: bool,
    /// Largest piece handed on at a time (0: as the upstream's frames come).
    piece: usize,
    /// What is left of a frame cut into pieces, or of one read ahead.
    rest: Bytes,
    /// Trailers read ahead (by [`UpstreamBody::failed_at_once`]).
    trailers: Option<Box<http::HeaderMap>>,
    /// The body's failure, told on the poll after the one that found it.
    failed: Option<BodyError>,
    framing: Framing,
}

/// How much of an upstream body's framing is left to check here.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Framing {
    /// The HTTP/1 client (hyper's or our own) checks all of it.
    Http1,
    /// An HTTP/2 body ending short of its declared `Content-Length` is an
    /// error: hyper reads a GOAWAY with NO_ERROR above the stream as the
    /// body's end, and the client would take the truncated body for the
    /// whole one.
    Declared,
    /// The answer to a HEAD, a 204 or a 304 over HTTP/2: no body is passed
    /// on, whatever the upstream sends.
    Bodiless,
}

/// An upstream body's failure as the client's side is given it: its
/// message, causes and all, not the error, so that hyper's HTTP/2 server
/// resets the client's stream with INTERNAL_ERROR (as NGINX does) rather
/// than with the code the upstream reset its own with: REFUSED_STREAM
/// would tell a client its processed POST may be sent again.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UpstreamFailed(String);

/// An HTTP/2 upstream's trailers were larger than [`MAX_RESPONSE_HEAD`]:
/// the response is cut, as one whose head is that large is answered 502.
#[derive(Debug, thiserror::Error)]
#[error("the upstream sent trailers larger than 64 KB")]
pub struct TrailersTooLarge;

/// An HTTP/2 upstream ended a body before its declared length.
#[derive(Debug, thiserror::Error)]
#[error("the upstream ended the response body {0} bytes short of its Content-Length (its HTTP/2 stream ended early)")]
pub struct Truncated(u64);

impl UpstreamBody {
    /// Lets the body go with its connection closed, never reused, however
    /// complete it is: for an answer the proxy refused to pass on (an
    /// answer without a body that said it had one is not trusted to have
    /// left the connection where the next answer begins).
    pub fn discard(mut self) {
        self.forbid_reuse();
    }

    /// The answer's header fields as they came, when our own client read
    /// it (its response's map is then empty); `None` for hyper's answers,
    /// whose fields are in their map, and once taken.
    pub fn take_fields(&mut self) -> Option<super::UpstreamFields> {
        match &mut self.body {
            Received::Own(body) => body.take_fields(),
            Received::Hyper(_) => None,
        }
    }

    /// Lets the body's connection close when the body ends, never reused
    /// (see [`UpstreamBody::discard`]).
    pub fn forbid_reuse(&mut self) {
        self.lease = None;
    }

    /// A body as it begins: nothing read ahead, handed on as it comes.
    fn new(body: Received, timer: IdleTimer, lease: Option<Lease>, framing: Framing) -> Self {
        UpstreamBody {
            body,
            timer,
            lease,
            ended: false,
            piece: 0,
            rest: Bytes::new(),
            trailers: None,
            failed: None,
            framing,
        }
    }

    /// Gives the body its answer's header fields as relayed, for the
    /// server to write ([`crate::serve::CarriesFields`]); handed back by a
    /// body hyper's client read (whose fields never come relayed so).
    pub fn carry(&mut self, written: crate::serve::WrittenFields) -> Result<(), crate::serve::WrittenFields> {
        match &mut self.body {
            // Behind the own body's box: in the body itself they would
            // make every response, a refusal too, larger to move.
            Received::Own(body) => {
                body.carry(written);
                Ok(())
            }
            Received::Hyper(_) => Err(written),
        }
    }

    /// Hands the body on in pieces of at most `at_most` bytes: an HTTP/2
    /// client's stream takes a piece per window it opens, and how often it
    /// asks for the next is how its progress shows (`serve::streams`); a
    /// 256 KB frame would take a client reading 4 KB/s a minute.
    pub fn in_pieces(&mut self, at_most: usize) {
        self.piece = at_most;
    }

    fn next_piece(&mut self) -> Bytes {
        let n = match self.piece {
            0 => self.rest.len(),
            piece => piece.min(self.rest.len()),
        };
        self.rest.split_to(n)
    }

    /// How many bytes of its declared length the body lacks, if it is
    /// checked and does.
    fn short(&self) -> Option<u64> {
        (self.framing == Framing::Declared)
            .then(|| self.body.size_hint().exact())
            .flatten()
            .filter(|n| *n > 0)
    }

    /// A frame of the upstream's body (or its end) checked for what hyper
    /// leaves unchecked over HTTP/2: an end short of the declared length,
    /// trailers past the bound on a response head.
    fn check(&mut self, frame: Option<Result<Frame<Bytes>, BodyError>>) -> Option<Result<Frame<Bytes>, BodyError>> {
        match frame {
            None => match self.short() {
                Some(missing) => Some(Err(Truncated(missing).into())),
                None => {
                    self.ended = true;
                    None
                }
            },
            Some(Ok(frame))
                if self.framing != Framing::Http1
                    && frame
                        .trailers_ref()
                        .is_some_and(|t| crate::serve::head_bytes(t) > MAX_RESPONSE_HEAD) =>
            {
                Some(Err(TrailersTooLarge.into()))
            }
            frame => frame,
        }
    }

    /// The error the body has already failed with, looked at once without
    /// waiting; a frame found instead is kept for the client.
    fn failed_at_once(&mut self) -> Option<BodyError> {
        if self.body.is_end_stream() || self.framing == Framing::Bodiless {
            return None;
        }
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let Poll::Ready(frame) = Pin::new(&mut self.body).poll_frame(&mut cx) else {
            return None;
        };
        match self.check(frame)? {
            Err(e) => Some(e),
            Ok(frame) => {
                match frame.into_data() {
                    Ok(data) => self.rest = data,
                    Err(frame) => self.trailers = frame.into_trailers().ok().map(Box::new),
                }
                None
            }
        }
    }
}

impl crate::serve::CarriesFields for UpstreamBody {
    fn take_written(&mut self) -> Option<crate::serve::WrittenFields> {
        match &mut self.body {
            Received::Own(body) => body.take_written(),
            Received::Hyper(_) => None,
        }
    }
}

impl Body for UpstreamBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        if !this.rest.is_empty() {
            return Poll::Ready(Some(Ok(Frame::data(this.next_piece()))));
        }
        if let Some(trailers) = this.trailers.take() {
            return Poll::Ready(Some(Ok(Frame::trailers(*trailers))));
        }
        if let Some(e) = this.failed.take() {
            return Poll::Ready(Some(Err(e)));
        }
        if this.framing == Framing::Bodiless {
            this.ended = true;
            return Poll::Ready(None);
        }
        let frame = this.timer.poll(Pin::new(&mut this.body), cx).map(|f| this.check(f));
        match frame {
            Poll::Ready(Some(Err(e))) => {
                if e.is::<Stalled>() {
                    crate::metrics::get().body_stalled(true);
                    tracing::warn!(error = %e, "upstream response body stalled; ending the response");
                } else {
                    tracing::warn!(error = %format_args!("{e}{}", Causes(&*e)), "upstream response body failed midway; ending the response");
                }
                // hyper's HTTP/1 writer gives up on a body's error at once,
                // before flushing what it holds of the response (the head,
                // the body so far): the client would get nothing, an empty
                // reply, which clients send again, a POST too (curl). A
                // turn later that has gone out, and the response reads as
                // cut.
                this.failed = Some(Box::new(UpstreamFailed(format!("{e}{}", Causes(&*e)))));
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            Poll::Ready(Some(Ok(frame))) if this.piece > 0 => {
                return match frame.into_data() {
                    Ok(data) if data.len() > this.piece => {
                        this.rest = data;
                        Poll::Ready(Some(Ok(Frame::data(this.next_piece()))))
                    }
                    Ok(data) => Poll::Ready(Some(Ok(Frame::data(data)))),
                    Err(frame) => Poll::Ready(Some(Ok(frame))),
                };
            }
            _ => {}
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        // A body cut short must still be polled, for its error: told it
        // was at its end, hyper would end the client's stream cleanly.
        self.rest.is_empty()
            && self.trailers.is_none()
            && self.failed.is_none()
            && (self.ended || self.framing == Framing::Bodiless || (self.body.is_end_stream() && self.short().is_none()))
    }

    fn size_hint(&self) -> SizeHint {
        if self.framing == Framing::Bodiless {
            return SizeHint::with_exact(0);
        }
        let inner = self.body.size_hint();
        let rest = self.rest.len() as u64;
        // Built anew: raising an exact hint's lower bound first would
        // pass its upper one, which `SizeHint` asserts against.
        let mut hint = SizeHint::new();
        hint.set_lower(inner.lower().saturating_add(rest));
        if let Some(upper) = inner.upper() {
            hint.set_upper(upper.saturating_add(rest));
        }
        hint
    }
}

impl Drop for UpstreamBody {
    fn drop(&mut self) {
        match self.lease.take() {
            Some(Lease::Hyper { pool, sender }) if self.is_end_stream() => pool.put(sender),
            Some(Lease::Own { pool, open, alarm }) => {
                if let Received::Own(body) = &mut self.body
                    && let Some((io, peer)) = body.reusable()
                {
                    pool.put_own(io, peer, open, alarm);
                }
            }
            _ => {}
        }
    }
}
