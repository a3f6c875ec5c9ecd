//! One client connection, from accept to close.
//!
//! hyper serves the requests (HTTP/1.1 with upgrades, or h2c told apart by
//! its preface), and a watchdog around it closes a connection that sits
//! idle too long, before or between requests, and shuts it down gracefully
//! when the server stops. hyper's header read timeout covers HTTP/1 only, so
//! the watchdog also closes a connection that has not begun a request within
//! the header read timeout of opening (an HTTP/2 client sending its preface
//! and a HEADERS frame it never ends, say); one that has begun none for the
//! keep-alive timeout since is shut down gracefully (HTTP/2 GOAWAY;
//! responses still streaming finish first).
//!
//! An idle connection costs only its socket and a small task. hyper keeps
//! ~30 KB per HTTP/1 connection for as long as it serves one (read and
//! write buffers, the boxed request handler), so a connection holds no hyper
//! state until its first bytes arrive, and one idle for [`PARK_AFTER`]
//! between requests is *parked*: hyper is asked to close it as it would at
//! the end of keep-alive (it finishes writing and has no message in
//! progress), the socket is kept (shutting it down is skipped), and a new
//! hyper connection takes over when the client sends again, starting from
//! any bytes hyper had read and not yet used. NGINX frees a keep-alive
//! connection's buffers the same way.

use crate::fields::{Fields, Lines};
use std::convert::Infallible;
use std::error::Error as StdError;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{Either, Empty};
use hyper::body::{Body, Incoming};
use hyper::server::conn::{http1, http2};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use crate::metrics::Histogram;
use tokio::sync::{OwnedSemaphorePermit, watch};

use super::{CarriesFields, ConnLimits, Gate, IDLE_BEFORE_RECLAIM, Stop, stopped};
use crate::metrics::Held;
use super::parking::Lot;
use super::streams::{Progress, StreamExecutor};
use crate::tls::{ClientStream, ClientTls};

mod own;

/// How long an HTTP/1 connection sits idle before hyper's state for it is
/// dropped. Long enough that back-to-back keep-alive requests never pay
/// for rebuilding it, short enough that idle clients cost almost nothing.
pub(super) const PARK_AFTER: Duration = Duration::from_secs(1);

/// The first bytes of every HTTP/2 connection (RFC 9113 §3.4).
const H2_PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

/// The HTTP/1 and HTTP/2 settings every connection of a listener is served
/// with.
#[derive(Clone)]
pub(super) struct Protocols {
    pub http1: http1::Builder,
    pub http2: http2::Builder<StreamExecutor>,
    /// TLS on this listener: the handshake comes first and ALPN picks the protocol.
    pub tls: Option<TlsAcceptor>,
}

/// What one listener's connections report to `/metrics`.
#[derive(Clone)]
pub(super) struct ConnMetrics {
    /// Connections waiting for a request (NGINX's Waiting).
    pub waiting: Gauge,
    /// Time from a request's head to its response's last byte.
    pub response_seconds: Histogram,
    /// Time from accepting a connection to its first request's head.
    pub first_request_seconds: Histogram,
    /// TLS handshakes that failed or ran out of time.
    pub tls_failures: Counter,
}

/// An open connection's slot under its listener's bound and its place in
/// the gauge of open connections.
/// Both are only held: dropping them gives them back.
pub(super) struct Seat {
    /// None when the listener is unbounded.
    _slot: Option<OwnedSemaphorePermit>,
    _open: Held,
}

impl Seat {
    /// A seat of `slot`, counted in the `open` gauge.
    pub(super) fn new(slot: Option<OwnedSemaphorePermit>, open: &Gauge) -> Seat {
        Seat {
            _slot: slot,
            _open: Held::new(open.clone()),
        }
    }
}

/// When a connection last began or finished a request, for its watchdog.
struct Activity {
    opened: Instant,
    /// The listener it came in on.
    listener: Arc<Listener>,
    /// The client's address.
    peer: SocketAddr,
    /// Let go of when the last holder of the connection (its task, the
    /// lot, a tunnel over its socket) lets go of this.
    _seat: Seat,
    /// The client's TLS session, once its handshake is done.
    tls: std::sync::OnceLock<ClientTls>,
    /// Milliseconds after `opened` when a request last began or finished.
    last_ms: AtomicU64,
    served: AtomicBool,
    /// Requests begun on the connection.
    begun: AtomicU64,
    /// A request asked for the connection to close after its response
    /// (HTTP/1.0, `Connection: close`) or carried `Upgrade`: it is never
    /// parked, so hyper's close (which may be how the response ends) is not
    /// skipped (see [`never_parks`]).
    never_park: AtomicBool,
    /// Requests whose response has not been sent to the end yet.
    in_flight: AtomicU64,
    /// The watchdog asked hyper to let go of the connection while idle.
    parking: AtomicBool,
    /// hyper read from the socket after that: it was not idle after all
    /// (draining a request body, say), so the connection is not reused.
    read_while_parking: AtomicBool,
    /// Whether head starts are tracked (HTTP/1: hyper's own header read
    /// timer would run while a keep-alive connection idles, too).
    heads: AtomicBool,
    /// 1 + milliseconds after `opened` when the head of the next request
    /// began to arrive; 0 when none is arriving.
    head_ms: AtomicU64,
}

impl Activity {
    fn new(listener: Arc<Listener>, peer: SocketAddr, seat: Seat) -> Self {
        Activity {
            opened: Instant::now(),
            listener,
            peer,
            _seat: seat,
            tls: std::sync::OnceLock::new(),
            last_ms: AtomicU64::new(0),
            served: AtomicBool::new(false),
            begun: AtomicU64::new(0),
            never_park: AtomicBool::new(false),
            in_flight: AtomicU64::new(0),
            parking: AtomicBool::new(false),
            read_while_parking: AtomicBool::new(false),
            heads: AtomicBool::new(false),
            head_ms: AtomicU64::new(0),
        }
    }

    /// Activity at `now` (a moment just read: the request's own timing
    /// reads the clock too, and one read serves both).
    fn touch(&self, now: Instant) {
        let since = now.saturating_duration_since(self.opened);
        let ms = u64::try_from(since.as_millis()).unwrap_or(u64::MAX);
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    /// A request began (`never_park`: it makes its connection one never to
    /// park, see [`never_parks`]); the connection is busy until the result
    /// is dropped.
    fn began(self: &Arc<Self>, never_park: bool) -> Busy {
        let now = Instant::now();
        self.touch(now);
        self.served.store(true, Ordering::Relaxed);
        self.head_ms.store(0, Ordering::Relaxed);
        if self.begun.fetch_add(1, Ordering::Relaxed) == 0 {
            let waited = now.saturating_duration_since(self.opened);
            self.listener.metrics.first_request_seconds.observe(waited);
        }
        if never_park {
            self.never_park.store(true, Ordering::Relaxed);
        }
        self.in_flight.fetch_add(1, Ordering::Relaxed);
        Busy(self.clone(), now)
    }

    /// How long until an idle connection should be parked (zero: now);
    /// `None` while a request is in flight or before the first.
    fn park_in(&self) -> Option<Duration> {
        self.park_in_at(Instant::now())
    }

    /// [`Self::park_in`] at `now`, a moment just read.
    fn park_in_at(&self, now: Instant) -> Option<Duration> {
        if !self.served.load(Ordering::Relaxed)
            || self.in_flight.load(Ordering::Relaxed) > 0
            || self.never_park.load(Ordering::Relaxed)
        {
            return None;
        }
        // Sooner under a shorter header read timeout: a head begun in the
        // packet of the request before is found only when the connection
        // parks, and its timeout must not run out first.
        let after = PARK_AFTER.min(self.listener.limits.header_read_timeout);
        Some(after.saturating_sub(self.since_last_at(now)))
    }

    fn since_last(&self) -> Duration {
        self.since_last_at(Instant::now())
    }

    fn since_last_at(&self, now: Instant) -> Duration {
        now.saturating_duration_since(self.opened)
            .saturating_sub(Duration::from_millis(self.last_ms.load(Ordering::Relaxed)))
    }

    /// How long until the connection counts as idle (zero: it is). Idle
    /// time counts from the last response handed over, as NGINX's
    /// `keepalive_timeout` does, never while a request is being handled.
    fn left(&self, limits: &ConnLimits) -> Duration {
        self.left_at(limits, Instant::now())
    }

    /// [`Self::left`] at `now`, a moment just read.
    fn left_at(&self, limits: &ConnLimits, now: Instant) -> Duration {
        let limit = if self.served.load(Ordering::Relaxed) {
            if self.in_flight.load(Ordering::Relaxed) > 0 {
                return limits.recheck_every();
            }
            if let Some(head) = self.head_begun() {
                // The next request's head has begun: it gets the header
                // read timeout from its first byte, as NGINX's
                // client_header_timeout.
                return limits.header_read_timeout.saturating_sub(head);
            }
            limits.keepalive_timeout
        } else {
            limits.header_read_timeout
        };
        limit.saturating_sub(self.since_last_at(now))
    }

    /// Whether the connection should close to make room for a new one: its
    /// listener is full and it has done nothing for [`IDLE_BEFORE_RECLAIM`]
    /// (no request in flight, no next head begun). `began_head`: bytes of
    /// a request have arrived that no request began with yet.
    fn gives_way(&self, began_head: bool) -> bool {
        if began_head
            || self.in_flight.load(Ordering::Relaxed) > 0
            || self.head_begun().is_some()
            || self.since_last() < IDLE_BEFORE_RECLAIM
            || !self.listener.gate.may_reclaim()
        {
            return false;
        }
        self.listener.gate.reclaimed.inc();
        tracing::debug!(peer = %self.peer, "idle connection closed to make room: the listener is full");
        true
    }

    /// How long ago the first byte of a request head not yet whole arrived,
    /// on a connection that served one before (HTTP/1 only).
    fn head_begun(&self) -> Option<Duration> {
        let at = self.head_ms.load(Ordering::Relaxed).checked_sub(1)?;
        Some(self.opened.elapsed().saturating_sub(Duration::from_millis(at)))
    }

    /// Bytes of the next request's head were found already read (with the
    /// request before, in one packet): unless its beginning was seen, it
    /// began by the time that request's response ended.
    fn head_read_with_last(&self) {
        let last = self.last_ms.load(Ordering::Relaxed);
        let _ = self
            .head_ms
            .compare_exchange(0, last.saturating_add(1), Ordering::Relaxed, Ordering::Relaxed);
    }

    /// Bytes came from the client: between requests of an HTTP/1
    /// connection, they begin the next request's head.
    fn bytes_read(&self) {
        if self.heads.load(Ordering::Relaxed)
            && self.in_flight.load(Ordering::Relaxed) == 0
            && self.served.load(Ordering::Relaxed)
            && self.head_ms.load(Ordering::Relaxed) == 0
        {
            let ms = u64::try_from(self.opened.elapsed().as_millis()).unwrap_or(u64::MAX - 1);
            self.head_ms.store(ms.saturating_add(1), Ordering::Relaxed);
        }
    }
}

/// A request being handled on a connection (since the instant it began),
/// until its response has been sent to the end; its end counts as activity.
struct Busy(Arc<Activity>, Instant);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
        let now = Instant::now();
        self.0.touch(now);
        let took = now.saturating_duration_since(self.1);
        self.0.listener.metrics.response_seconds.observe(took);
    }
}

/// The client's socket as hyper reads and writes it: bytes already read
/// (the protocol sniff, or what hyper had buffered when it was parked) are
/// read again first, and while parking, shutting down is skipped so the
/// socket outlives the hyper connection that lets go of it.
struct ClientIo {
    stream: ClientStream,
    replay: Bytes,
    activity: Arc<Activity>,
    /// Runs while a write waits for the client to read (made on first need).
    send_wait: SendWait,
}

/// The wait of a write for its client to read: past the send timeout with
/// nothing taken the write fails and hyper closes the connection, as NGINX's
/// `send_timeout` does. A client that never reads its response would
/// otherwise hold its connection, and the upstream connection streaming to
/// it, for good.
#[derive(Default)]
struct SendWait {
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Whether the last write waited (the timer runs from its start).
    waiting: bool,
    /// Bytes the client had not taken when the wait began (or was last
    /// found moving).
    unsent: Option<u32>,
}

impl SendWait {
    /// Passes on a write's (or flush's) outcome: a wait past `limit` in
    /// which the client took nothing becomes a `TimedOut` error; anything
    /// written ends the wait.
    fn check<T>(
        &mut self,
        outcome: Poll<io::Result<T>>,
        cx: &mut Context<'_>,
        stream: &ClientStream,
        limit: Duration,
        peer: SocketAddr,
    ) -> Poll<io::Result<T>> {
        if outcome.is_ready() {
            self.waiting = false;
            return outcome;
        }
        let now = tokio::time::Instant::now();
        // Past any time an operator can write: no deadline.
        let Some(deadline) = now.checked_add(limit) else { return Poll::Pending };
        let sleep = self.sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        if !self.waiting {
            self.waiting = true;
            self.unsent = stream.unsent();
            sleep.as_mut().reset(deadline);
        }
        while sleep.as_mut().poll(cx).is_ready() {
            // The kernel says a socket is writable again only once a third
            // of its buffer is free: a client reading slower than that (a
            // few MB per send timeout) would be cut mid-read. One that took
            // bytes since the wait began gets the timeout again.
            let unsent = stream.unsent();
            if unsent.zip(self.unsent).is_some_and(|(now, before)| now < before) {
                self.unsent = unsent;
                sleep.as_mut().reset(deadline);
                continue;
            }
            tracing::info!(%peer, timeout = ?limit, "client connection closed: the client took none of its response for --send-timeout");
            return Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client took nothing within --send-timeout",
            )));
        }
        Poll::Pending
    }
}

impl AsyncRead for ClientIo {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if !self.replay.is_empty() {
            let n = self.replay.len().min(buf.remaining());
            let replayed = self.replay.split_to(n);
            buf.put_slice(&replayed);
            self.activity.bytes_read();
            return Poll::Ready(Ok(()));
        }
        if self.activity.parking.load(Ordering::Relaxed) {
            self.activity.read_while_parking.store(true, Ordering::Relaxed);
        }
        let before = buf.filled().len();
        let read = Pin::new(&mut self.stream).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.activity.bytes_read();
        }
        read
    }
}

impl AsyncWrite for ClientIo {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let outcome = Pin::new(&mut this.stream).poll_write(cx, buf);
        this.send_wait
            .check(outcome, cx, &this.stream, this.activity.listener.limits.send_timeout, this.activity.peer)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let this = &mut *self;
        let outcome = Pin::new(&mut this.stream).poll_write_vectored(cx, bufs);
        this.send_wait
            .check(outcome, cx, &this.stream, this.activity.listener.limits.send_timeout, this.activity.peer)
    }

    fn is_write_vectored(&self) -> bool {
        self.stream.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = &mut *self;
        let outcome = Pin::new(&mut this.stream).poll_flush(cx);
        this.send_wait
            .check(outcome, cx, &this.stream, this.activity.listener.limits.send_timeout, this.activity.peer)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        if self.activity.parking.load(Ordering::Relaxed) {
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

/// Which protocol a connection's first bytes speak.
enum Protocol {
    Http1,
    Http2,
}

impl ClientIo {
    /// Waits for the first bytes, keeping them to be read again; `false`:
    /// the client closed first.
    async fn first_bytes(&mut self) -> io::Result<bool> {
        let mut first = [0u8; 64];
        let n = tokio::io::AsyncReadExt::read(&mut self.stream, &mut first).await?;
        self.replay = Bytes::copy_from_slice(first.get(..n).unwrap_or_default());
        Ok(n > 0)
    }

    /// Reads until the first bytes tell HTTP/2's preface from anything else
    /// (HTTP/1), keeping them to be read again. `None`: the client closed.
    async fn sniff(&mut self) -> io::Result<Option<Protocol>> {
        let stream = match &self.stream {
            ClientStream::Plain(stream) => stream,
            // Told by ALPN instead.
            ClientStream::Tls(_) => return Ok(Some(Protocol::Http1)),
        };
        let mut first = [0u8; H2_PREFACE.len()];
        let mut len = 0;
        loop {
            stream.readable().await?;
            let Some(free) = first.get_mut(len..) else {
                return Ok(Some(Protocol::Http2));
            };
            match stream.try_read(free) {
                Ok(0) => return Ok(None),
                Ok(n) => len = len.saturating_add(n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
                Err(e) => return Err(e),
            }
            let read = first.get(..len).unwrap_or_default();
            self.replay = Bytes::copy_from_slice(read);
            if !H2_PREFACE.starts_with(read) {
                return Ok(Some(Protocol::Http1));
            }
            if len == H2_PREFACE.len() {
                return Ok(Some(Protocol::Http2));
            }
        }
    }
}

/// A request's body as a listener hands it to its handler: hyper's, or
/// none at all.
pub enum RequestBody {
    /// The body hyper reads from the connection.
    Hyper(Incoming),
    /// No body: the request said it has none.
    Empty,
    /// No body, and the request's header fields are these lines of its
    /// head, its map left empty: a GET our own server read for an app
    /// that reads fields through [`fields`] ([`App::READS_LINES`]).
    Lines(Lines),
}

/// The header fields of a request a listener handed over: its head's
/// lines, or its map.
pub fn fields(req: &Request<RequestBody>) -> Fields<'_> {
    match req.body() {
        RequestBody::Lines(lines) => Fields::Lines(lines),
        _ => Fields::Map(req.headers()),
    }
}

/// Puts a request's lines (if it came with them) into its map, for a way
/// that changes or reads the map.
pub fn into_map(req: &mut Request<RequestBody>) {
    if let RequestBody::Lines(lines) = req.body() {
        *req.headers_mut() = lines.to_map();
        *req.body_mut() = RequestBody::Empty;
    }
}

impl RequestBody {
    /// hyper's body, if the request has one to read.
    pub fn into_incoming(self) -> Option<Incoming> {
        match self {
            RequestBody::Hyper(body) => Some(body),
            RequestBody::Empty | RequestBody::Lines(_) => None,
        }
    }
}

impl Body for RequestBody {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Bytes>, hyper::Error>>> {
        match self.get_mut() {
            RequestBody::Hyper(body) => Pin::new(body).poll_frame(cx),
            RequestBody::Empty | RequestBody::Lines(_) => Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            RequestBody::Hyper(body) => body.is_end_stream(),
            RequestBody::Empty | RequestBody::Lines(_) => true,
        }
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        match self {
            RequestBody::Hyper(body) => body.size_hint(),
            RequestBody::Empty | RequestBody::Lines(_) => hyper::body::SizeHint::with_exact(0),
        }
    }
}

/// What a listener serves: a function from a request and its client's
/// address to a response, with the bounds hyper's connections need, named
/// once.
pub trait App: Clone + Send + Sync + Unpin + 'static {
    /// The responses' body.
    type Body: Body<Data: Send, Error: Into<Box<dyn StdError + Send + Sync>>> + CarriesFields + Send + Unpin + 'static;
    /// The future of a response.
    type Future: Future<Output = Response<Self::Body>> + Send + 'static;
    /// Whether it reads a request's fields through [`fields`], so that our
    /// own server may hand a GET over with its head's lines
    /// ([`RequestBody::Lines`]) rather than build a map of them.
    const READS_LINES: bool = false;
    /// The response to `req` from `peer`.
    fn call(&self, req: Request<RequestBody>, peer: SocketAddr) -> Self::Future;
}

/// An app that reads every request's fields through [`fields`]: our own
/// server hands it GETs with their head's lines, no map built.
#[derive(Clone)]
pub struct ReadsLines<A>(pub A);

impl<A: App> App for ReadsLines<A> {
    type Body = A::Body;
    type Future = A::Future;
    const READS_LINES: bool = true;
    fn call(&self, req: Request<RequestBody>, peer: SocketAddr) -> A::Future {
        self.0.call(req, peer)
    }
}

impl<F, Fut, B> App for F
where
    F: Fn(Request<RequestBody>, SocketAddr) -> Fut + Clone + Send + Sync + Unpin + 'static,
    Fut: Future<Output = Response<B>> + Send + 'static,
    B: Body + CarriesFields + Send + Unpin + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    type Body = B;
    type Future = Fut;
    fn call(&self, req: Request<RequestBody>, peer: SocketAddr) -> Fut {
        self(req, peer)
    }
}

/// The request handler as one connection serves it: the bounds hyper's
/// connections need, named once.
trait Handler:
    hyper::service::HttpService<
        Incoming,
        ResBody: Body<Data: Send, Error: Into<Box<dyn StdError + Send + Sync>>> + Send + 'static,
        Future: Send + 'static,
        Error: Into<Box<dyn StdError + Send + Sync>>,
    > + Unpin
    + Send
    + 'static
{
}

impl<S> Handler for S where
    S: hyper::service::HttpService<
            Incoming,
            ResBody: Body<Data: Send, Error: Into<Box<dyn StdError + Send + Sync>>> + Send + 'static,
            Future: Send + 'static,
            Error: Into<Box<dyn StdError + Send + Sync>>,
        > + Unpin
        + Send
        + 'static
{
}

/// An HTTP/1 connection between requests with no hyper state: the
/// socket, the request handler, and where parking last left off.
struct Parked<A> {
    io: ClientIo,
    handler: A,
    /// Requests begun when hyper was last rebuilt after a park.
    rebuilt_at: u64,
}

/// What every connection of one listener shares.
pub(super) struct Listener {
    /// How requests are read and answered.
    pub protocols: Protocols,
    /// Timeouts and sizes.
    pub limits: ConnLimits,
    /// Where the connections report.
    pub metrics: ConnMetrics,
    /// Where its idle connections wait (none if it could not be made:
    /// they are closed instead).
    pub lot: Option<Arc<Lot<Idle>>>,
    /// Its bound, which says when idle connections should make room.
    pub gate: Gate,
}

/// Serves `handler` on one accepted connection until it closes or parks;
/// its `seat` goes with its [`Activity`]: into the lot while it is parked, and into a
/// tunnel (WebSocket) its socket is handed to, for as long as that runs.
pub(super) async fn serve<A: App>(
    stream: TcpStream,
    peer: SocketAddr,
    handler: A,
    listener: Arc<Listener>,
    stop: Stop,
    seat: Seat,
) {
    let activity = Arc::new(Activity::new(listener, peer, seat));
    if let Some(idle) = Box::pin(open(stream, handler, stop.clone(), &activity)).await {
        park(idle);
    }
}

/// `handler` as hyper serves it on the connection of `activity`: each
/// request counted there, and held to the listener's header bounds.
fn service<A: App>(activity: &Arc<Activity>, handler: A) -> impl Handler {
    let seen = activity.clone();
    service_fn(move |mut req: Request<Incoming>| {
        if let Some(tls) = seen.tls.get() {
            req.extensions_mut().insert(tls.clone());
        }
        let busy = seen.began(never_parks(&req));
        let head = req.method() == http::Method::HEAD;
        // hyper bounds the header fields of HTTP/1 requests only, and their
        // bytes only on a connection's first request; every request gets
        // both bounds here (431, as hyper answers).
        let fits = seen.listener.limits.admits(Fields::Map(req.headers()));
        // Boxed: the handler's future is kilobytes, and hyper moves the
        // service's future into place; a pointer moves instead.
        let response = fits.then(|| Box::pin(handler.call(req.map(RequestBody::Hyper), seen.peer)));
        async move {
            let response = match response {
                Some(response) => {
                    let mut response = response.await;
                    // hyper writes only the map.
                    crate::serve::WrittenFields::into_map(&mut response);
                    Some(response)
                }
                None => None,
            };
            Ok::<_, Infallible>(until_sent(response, head, busy))
        }
    })
}

/// What a parked connection keeps besides its socket: its [`Activity`] and
/// where parking last left off. The request handler is not kept: it is
/// the listener's, made again for the connection when it comes back.
pub(super) struct Idle {
    activity: Arc<Activity>,
    /// Requests begun when hyper was last rebuilt after a park.
    rebuilt_at: u64,
}

/// Hands an idle connection to its listener's lot, to be served again by
/// [`resume`] when its client sends; this task ends. A connection that
/// cannot be parked is closed, as a keep-alive connection may be at any
/// time between requests.
fn park<A: App>(idle: Parked<A>) {
    let Parked { io, handler, rebuilt_at } = idle;
    // The lot makes the handler again when the connection comes back.
    drop(handler);
    let ClientIo { stream, activity, .. } = io;
    let peer = activity.peer;
    // TLS connections are never parked (see `serve_http1`).
    let ClientStream::Plain(stream) = stream else { return };
    let shared = &activity.listener;
    let Some(lot) = shared.lot.clone() else {
        tracing::debug!(%peer, "idle connection closed: no parking lot");
        return;
    };
    let keepalive = activity.left(&shared.limits);
    tracing::trace!(%peer, "idle connection parked");
    if let Err(e) = lot.park(stream, keepalive, Idle { activity, rebuilt_at }) {
        tracing::debug!(%peer, error = %e, "idle connection closed");
    }
}

/// Serves a connection its lot handed back (`stream`, and what it kept),
/// with `handler`, until it closes or parks again.
pub(super) async fn resume<A: App>(stream: TcpStream, idle: Idle, handler: A, stop: Stop) {
    let Idle { activity, rebuilt_at } = idle;
    let io = ClientIo {
        stream: ClientStream::Plain(stream),
        replay: Bytes::new(),
        activity,
        send_wait: SendWait::default(),
    };
    let parked = Parked { io, handler, rebuilt_at };
    if let Some(idle) = serve_http1(parked, stop).await {
        park(idle);
    }
}

/// Opens a connection (the TLS handshake, the protocol sniff) and serves
/// it until it closes, or parks (HTTP/1 only).
async fn open<A: App>(
    stream: TcpStream,
    handler: A,
    mut stop: Stop,
    activity: &Arc<Activity>,
) -> Option<Parked<A>> {
    let (peer, shared) = (activity.peer, &*activity.listener);
    let (metrics, protocols, limits) = (&shared.metrics, &shared.protocols, &shared.limits);
    let tls_listener = protocols.tls.is_some();
    let held = Held::new(metrics.waiting.clone());
    // The handshake and the first bytes share the header read timeout: a
    // client that opens a connection and says nothing is closed either way.
    let opened = async {
        let stream = match &protocols.tls {
            None => ClientStream::Plain(stream),
            Some(acceptor) => match acceptor.accept(stream).await {
                Ok(session) => ClientStream::Tls(Box::new(session)),
                Err(e) => {
                    tracing::debug!(%peer, error = %e, "TLS handshake failed");
                    metrics.tls_failures.inc();
                    return None;
                }
            },
        };
        let alpn_h2 = match &stream {
            ClientStream::Tls(session) => Some(session.get_ref().1.alpn_protocol() == Some(b"h2")),
            ClientStream::Plain(_) => None,
        };
        let mut io = ClientIo {
            stream,
            replay: Bytes::new(),
            activity: activity.clone(),
            send_wait: SendWait::default(),
        };
        // ALPN named the protocol, but the connection is silent until its
        // first bytes come, as a plain one is until the sniff has them: a
        // session that finished its handshake and says nothing gives way
        // when the listener is full.
        let protocol = match alpn_h2 {
            Some(h2) => io
                .first_bytes()
                .await
                .map(|came| came.then_some(if h2 { Protocol::Http2 } else { Protocol::Http1 })),
            None => io.sniff().await,
        };
        Some((io, protocol))
    };
    let mut opened = std::pin::pin!(opened);
    let now = tokio::time::Instant::now();
    // Past any timeout an operator can write: no deadline.
    let deadline = now.checked_add(limits.header_read_timeout);
    let (io, protocol) = loop {
        // Waking every IDLE_BEFORE_RECLAIM as well, to give way when the
        // listener is full: only a connection that stays silent does so.
        let now = tokio::time::Instant::now();
        let check = now.checked_add(IDLE_BEFORE_RECLAIM).unwrap_or(now);
        let wake = deadline.map_or(check, |d| d.min(check));
        tokio::select! {
            opened = &mut opened => break opened?,
            _ = tokio::time::sleep_until(wake) => {
                if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) {
                    tracing::debug!(%peer, "connection closed: nothing sent within the header read timeout");
                    if tls_listener {
                        // With TLS, ALPN names the protocol as the handshake
                        // ends: what ran out of time was the handshake.
                        metrics.tls_failures.inc();
                    }
                    return None;
                }
                if activity.gives_way(false) {
                    return None;
                }
            }
            _ = stopped(&mut stop.rx) => return None,
        }
    };
    drop(held);
    if let ClientStream::Tls(session) = &io.stream {
        let _ = activity.tls.set(ClientTls::of(session.get_ref().1));
    }
    match protocol {
        Ok(Some(Protocol::Http1)) => {
            let parked = Parked {
                io,
                handler,
                rebuilt_at: u64::MAX,
            };
            serve_http1(parked, stop).await
        }
        Ok(Some(Protocol::Http2)) => {
            let conn = protocols.http2.serve_connection(TokioIo::new(io), service(activity, handler));
            watch_http2(conn, activity, peer, limits, stop.rx).await;
            None
        }
        Ok(None) => None,
        Err(e) => {
            tracing::debug!(%peer, error = %e, "connection failed before its first request");
            None
        }
    }
}

/// Serves HTTP/1 requests on a connection until it closes (`None`) or sits
/// idle long enough to be parked.
async fn serve_http1<A: App>(parked: Parked<A>, stop: Stop) -> Option<Parked<A>> {
    let Parked {
        mut io,
        handler,
        rebuilt_at,
    } = parked;
    let activity = io.activity.clone();
    let (peer, shared) = (activity.peer, &*activity.listener);
    let (http1, limits) = (&shared.protocols.http1, &shared.limits);
    // Without keep-alive hyper closes after every response: nothing to park.
    // A TLS session is not parked (hyper's successor could not see what
    // the session had decrypted and not handed over).
    let keep_alive = !limits.keepalive_timeout.is_zero() && matches!(io.stream, ClientStream::Plain(_));
    activity.heads.store(true, Ordering::Relaxed);
    // Until one more request begins than when hyper was last rebuilt after
    // a park, it is not parked again: a new hyper connection counts as
    // busy until its first message is done, and asked to close then, it
    // would answer that message with `Connection: close`; and parking one
    // handed part of a request would spin until the rest came.
    let mut rebuilt_at = rebuilt_at;
    // The one stop this connection watches, whichever server holds it.
    let mut seat = stop.seat();
    loop {
        // Plain GETs are served by our own HTTP/1.1 server; hyper takes
        // the first request that is not one, until the connection parks.
        if keep_alive {
            match own::serve(&mut io, &handler, &mut seat, rebuilt_at).await {
                own::Served::Closed => return None,
                own::Served::Park => {
                    let rebuilt_at = activity.begun.load(Ordering::Relaxed);
                    return Some(Parked { io, handler, rebuilt_at });
                }
                own::Served::Hyper => rebuilt_at = activity.begun.load(Ordering::Relaxed),
            }
        }
        let service = service(&activity, handler.clone());
        // Stopping already: a head handed over at the stop (over TLS, which
        // our own server does not serve, or one it passed on) is read on
        // and answered with `Connection: close`, and the connection closes.
        // Left to the stop below, it would be handed over again, and again,
        // until the head was whole.
        let stopping = seat.is_set();
        let mut conn = if stopping {
            let mut last = http1.clone();
            last.keep_alive(false);
            last.serve_connection(TokioIo::new(io), service).with_upgrades()
        } else {
            http1.serve_connection(TokioIo::new(io), service).with_upgrades()
        };
        activity.parking.store(false, Ordering::Relaxed);
        activity.read_while_parking.store(false, Ordering::Relaxed);
        let mut closing = stopping;
        let mut parking = false;
        let ended = loop {
            // A request beginning or ending does not wake the watchdog, so
            // it looks again at least every keep-alive timeout, and while
            // the connection is busy, every PARK_AFTER (parking it at most
            // twice that after it fell idle).
            let fresh = rebuilt_at == activity.begun.load(Ordering::Relaxed);
            let may_park = keep_alive && !closing && !fresh;
            // Every PARK_AFTER at least (and every header read timeout, if
            // shorter): a request head that begins is not announced
            // either, and has the header read timeout from then.
            let mut wake = activity
                .left(limits)
                .min(limits.recheck_every())
                .min(PARK_AFTER)
                .min(limits.header_read_timeout.max(Duration::from_millis(10)));
            if keep_alive && !closing {
                // A rebuilt connection looks again every PARK_AFTER until
                // its next request has begun, or it would sleep through it
                // and never park again.
                let park_in = if fresh { None } else { activity.park_in() };
                wake = wake.min(park_in.unwrap_or(PARK_AFTER));
            }
            // The connection first: a request it was handed (a head read by
            // our own server, or left over from a park) is begun before a
            // stop can find it idle and close it unanswered.
            tokio::select! {
                biased;
                result = Pin::new(&mut conn) => break result,
                _ = seat.stopped(), if !closing => {
                    // A head begun between requests would be closed
                    // unanswered by hyper; NGINX reads it on. It is handed
                    // over as at a park, to be read on and answered with
                    // `Connection: close`.
                    // Over TLS too: the session goes with the socket, and
                    // what hyper had decrypted with the bytes it hands back.
                    let kept_alive = !limits.keepalive_timeout.is_zero();
                    if kept_alive && activity.head_begun().is_some() && activity.park_in().is_some() {
                        activity.parking.store(true, Ordering::Relaxed);
                        parking = true;
                    }
                    Pin::new(&mut conn).graceful_shutdown();
                    closing = true;
                }
                _ = tokio::time::sleep(wake), if !closing => {
                    let head_due = !activity.served.load(Ordering::Relaxed) || activity.head_begun().is_some();
                    if activity.gives_way(!activity.served.load(Ordering::Relaxed)) {
                        // Idle between requests: hyper closes at once.
                        Pin::new(&mut conn).graceful_shutdown();
                        closing = true;
                    } else if activity.left(limits).is_zero() && head_due {
                        // hyper would wait for the rest of the head.
                        tracing::debug!(%peer, "connection closed: request head not received within the header read timeout");
                        return None;
                    } else if activity.left(limits).is_zero() {
                        tracing::debug!(%peer, "idle connection closed");
                        Pin::new(&mut conn).graceful_shutdown();
                        closing = true;
                    } else if may_park && activity.park_in().is_some_and(|p| p.is_zero()) {
                        // hyper has no message in progress: it closes at
                        // once, having flushed what it wrote.
                        activity.parking.store(true, Ordering::Relaxed);
                        Pin::new(&mut conn).graceful_shutdown();
                        closing = true;
                        parking = true;
                    }
                }
            }
        };
        if let Err(e) = ended {
            tracing::debug!(%peer, error = %e, "connection ended with an error");
            return None;
        }
        let clean = parking && !activity.read_while_parking.load(Ordering::Relaxed) && activity.park_in().is_some();
        // Closed for good, or upgraded (the upgrade owns the socket now).
        let parts = conn.into_parts().filter(|_| clean)?;
        // A copy: what hyper hands back shares its whole read buffer, which
        // is let go of here, not held while parked.
        let replay = Bytes::copy_from_slice(&parts.read_buf);
        drop(parts.read_buf);
        io = parts.io.into_inner();
        io.replay = replay;
        rebuilt_at = activity.begun.load(Ordering::Relaxed);
        if io.replay.is_empty() {
            return Some(Parked { io, handler, rebuilt_at });
        }
        // The client has begun its next request: serve it at once, its
        // header read timeout running since it began.
        activity.head_read_with_last();
    }
}

/// How long an HTTP/2 client told to go away, with nothing in flight, has
/// to answer the closing PING before its connection is dropped.
const GOAWAY_ANSWER_WITHIN: Duration = Duration::from_secs(2);

/// Watches an HTTP/2 connection until it closes.
async fn watch_http2<S: Handler>(
    conn: http2::Connection<TokioIo<ClientIo>, S, StreamExecutor>,
    activity: &Activity,
    peer: SocketAddr,
    limits: &ConnLimits,
    mut stop: watch::Receiver<bool>,
) {
    // Boxed, or every connection's task would be as large as an HTTP/2
    // connection's state, HTTP/1 or not.
    let mut conn = Box::pin(conn);
    let mut closing = false;
    loop {
        // A request beginning does not wake the watchdog, so it looks
        // again at least every keep-alive timeout, and every
        // IDLE_BEFORE_RECLAIM in case the listener is full.
        let left = activity.left(limits).min(limits.recheck_every()).min(IDLE_BEFORE_RECLAIM);
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
            // hyper's graceful close sends GOAWAY and a PING, and waits for
            // the PING's answer before it ends: a client that never answers
            // would hold its slot (and its keep-alive) for good. Once nothing
            // is in flight, it gets GOAWAY_ANSWER_WITHIN to answer.
            _ = tokio::time::sleep(GOAWAY_ANSWER_WITHIN), if closing => {
                if activity.in_flight.load(Ordering::Relaxed) == 0 {
                    tracing::debug!(%peer, "HTTP/2 connection closed: the client did not answer the closing PING");
                    return;
                }
            }
            _ = tokio::time::sleep(left), if !closing => {
                if activity.gives_way(false) {
                    if !activity.served.load(Ordering::Relaxed) {
                        return;
                    }
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                } else if activity.left(limits).is_zero() {
                    tracing::debug!(%peer, "idle connection closed");
                    if !activity.served.load(Ordering::Relaxed) {
                        // Nothing was ever in flight: close at once (a
                        // GOAWAY would wait for a PING the client may
                        // never answer).
                        return;
                    }
                    conn.as_mut().graceful_shutdown();
                    closing = true;
                }
            }
        }
    }
}

/// Whether a request makes its connection one never to park: it asks to
/// close after the response (HTTP/1.0 and older, which hyper keeps alive
/// only when asked, so never parking them is the safe side; or
/// `Connection: close`), or it carried `Upgrade` (`h2c`, a WebSocket
/// refused...): hyper hands such a connection to the upgrade when asked to
/// let go of it, even when none happened, and it would be closed instead.
fn never_parks(req: &Request<Incoming>) -> bool {
    req.version() < http::Version::HTTP_11
        || req.headers().contains_key(http::header::UPGRADE)
        || req.headers().get_all(http::header::CONNECTION).iter().any(|v| {
            v.as_bytes()
                .split(|&b| b == b',')
                .any(|t| t.trim_ascii().eq_ignore_ascii_case(b"close"))
        })
}

/// The response as hyper sends it: the request stays in flight until the
/// body has been sent to the end (or given up), and a response to HEAD has
/// no body (RFC 9110 §9.3.2). hyper drops the body on HTTP/1; on HTTP/2 it
/// would send it and the client resets the stream (curl: PROTOCOL_ERROR;
/// Envoy's ext_authz client: an error, which `failure_mode_allow` turns
/// into an admission). Headers stay as they are. No response: the request
/// had too many header fields (431, no body).
fn until_sent<B: Body>(response: Option<Response<B>>, head: bool, busy: Busy) -> Response<Either<UntilSent<B>, Empty<B::Data>>> {
    let Some(response) = response else {
        let mut refused = Response::new(Either::Right(Empty::new()));
        *refused.status_mut() = http::StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE;
        // Over HTTP/1 the connection closes after it, as after hyper's own
        // 431 for a head past its buffer (this one is a head past the byte
        // bound by less than a read), and NGINX's 400 for a head too large.
        if Progress::current().is_none() {
            refused
                .headers_mut()
                .insert(http::header::CONNECTION, http::HeaderValue::from_static("close"));
        }
        return refused;
    };
    response.map(|body| {
        if head {
            Either::Right(Empty::new())
        } else {
            let stream = Progress::current();
            if let Some(stream) = &stream {
                stream.handed();
            }
            Either::Left(UntilSent {
                body,
                _busy: busy,
                stream,
            })
        }
    })
}

/// A response body on its way to the client.
struct UntilSent<B> {
    body: B,
    /// Ends with the body.
    _busy: Busy,
    /// On HTTP/2, how its stream takes it (see `streams`).
    stream: Option<Arc<Progress>>,
}

impl<B: CarriesFields> CarriesFields for UntilSent<B> {
    fn take_written(&mut self) -> Option<crate::serve::WrittenFields> {
        self.body.take_written()
    }
}

impl<B: Body + Unpin> Body for UntilSent<B> {
    type Data = B::Data;
    type Error = B::Error;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<hyper::body::Frame<B::Data>, B::Error>>> {
        let this = &mut *self;
        let frame = Pin::new(&mut this.body).poll_frame(cx);
        if let Some(stream) = &this.stream {
            // A frame, or the end: hyper has what it must send before the
            // stream is done, and waits for the client's window for it.
            stream.asked(matches!(frame, Poll::Ready(Some(Ok(_)) | None)));
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}
