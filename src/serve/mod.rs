//! The accept loop every HTTP listener shares: HTTP/1.1 and h2c on one port,
//! each connection served by [`connection`] with its timeouts, and graceful
//! shutdown (stop accepting, let in-flight requests finish, bounded).
//!
//! A [`Gate`] bounds how many connections a listener (or the proxy's
//! listeners together) serves at once: at the bound, each listener holds the
//! one connection it accepted last until a slot frees, and the rest wait in
//! the kernel's listen backlog, instead of running the process out of file
//! descriptors (NGINX's `worker_connections`). Meanwhile connections idle
//! for [`IDLE_BEFORE_RECLAIM`] (silent since they opened, or between
//! requests) are closed to make room, as NGINX closes its reusable
//! connections when it runs out: a full listener is not held by sockets that
//! do nothing, and a health probe still gets through.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use hyper_util::rt::TokioTimer;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use tokio::task::JoinSet;

use crate::tls::TlsListener;

mod connection;

pub use connection::{App, ReadsLines, RequestBody, fields, into_map};
mod parking;
mod stop;
mod streams;

use stop::Stop;

/// How long a connection must have done nothing before a full listener
/// closes it to make room: a client that just connected has its request on
/// the way, and one that just got an answer may send the next at once.
const IDLE_BEFORE_RECLAIM: Duration = Duration::from_secs(1);
/// Most idle connections closed per turn while a listener waits for room:
/// an eighth of the bound, at least one and at most 32, as NGINX drains
/// its reusable connections when it runs out.
const RECLAIM_AT_ONCE: usize = 32;
/// How often a listener waiting for room closes idle connections again.
const RECLAIM_EVERY: Duration = Duration::from_millis(500);

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
    /// How long a connection that has served a request may sit without
    /// beginning another; zero turns HTTP/1 keep-alive off.
    pub keepalive_timeout: Duration,
    /// How long a write to the client may wait for it to read.
    pub send_timeout: Duration,
}

impl ConnLimits {
    /// How often a connection's watchdog looks again at the latest: a
    /// request beginning or ending does not wake it. Every keep-alive
    /// timeout, so that a connection is closed at most that late (a
    /// sub-second one too, as NGINX takes `keepalive_timeout 300ms`), but
    /// at least every 10 ms, and every second with keep-alive off, so
    /// that a tiny or zero timeout does not make it spin.
    fn recheck_every(&self) -> Duration {
        match self.keepalive_timeout {
            off if off.is_zero() => Duration::from_secs(1),
            timeout => timeout.max(Duration::from_millis(10)),
        }
    }

    /// Whether a request's header fields fit these bounds (their count, and
    /// their size as HTTP/1 writes them: `name: value\r\n`); past them a
    /// request is answered 431.
    pub fn admits(&self, fields: crate::fields::Fields<'_>) -> bool {
        fields.len() <= self.max_headers && fields.head_bytes() <= self.max_header_bytes
    }
}

/// Response header fields already written as HTTP/1 lines (`name:
/// value\r\n` each), carried by a response's body ([`CarriesFields`]):
/// our own HTTP/1.1 server writes them as they are, before the map's
/// fields; for hyper, which writes only from the map, they go back into it
/// first. The proxy relays an upstream's fields so, never building a map
/// of them (BENCHMARKS.md §63). They never hold a field the server frames
/// the message with (`Content-Length`, `Transfer-Encoding`, `Connection`,
/// `Trailer`): those stay in the map.
#[derive(Debug, Clone, Default)]
pub struct WrittenFields {
    /// The lines.
    pub lines: Vec<u8>,
    /// Whether they hold a `Date` (the server then adds none).
    pub has_date: bool,
}

impl WrittenFields {
    /// Appends `name: value\r\n`, the name in lower case (as hyper writes
    /// every name: a client cannot tell which server answered).
    pub fn push(&mut self, name: &[u8], value: &[u8]) {
        let at = self.lines.len();
        self.lines.extend_from_slice(name);
        if let Some(written) = self.lines.get_mut(at..) {
            written.make_ascii_lowercase();
        }
        self.lines.extend_from_slice(b": ");
        self.lines.extend_from_slice(value);
        self.lines.extend_from_slice(b"\r\n");
    }

    /// Moves a response's written fields, if it has any, into its map,
    /// before the fields already there: hyper then writes them in the
    /// order our own server does.
    pub fn into_map<B: CarriesFields>(response: &mut http::Response<B>) {
        if let Some(written) = response.body_mut().take_written() {
            written.before(response.headers_mut());
        }
    }

    /// Puts the fields into `headers`, before the fields already there.
    pub fn before(self, headers: &mut http::HeaderMap) {
        let beside = std::mem::take(headers);
        headers.reserve(beside.len().saturating_add(self.lines.len() / 16));
        for line in self.lines.split(|b| *b == b'\n') {
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            let Some(colon) = line.iter().position(|b| *b == b':') else { continue };
            let (name, value) = line.split_at(colon);
            let value = value.get(1..).unwrap_or_default().trim_ascii();
            // Written from fields a parser took: none is refused here.
            if let (Ok(name), Ok(value)) = (http::HeaderName::from_bytes(name), http::HeaderValue::from_bytes(value)) {
                headers.append(name, value);
            }
        }
        let mut last = None;
        for (name, value) in beside {
            // A name comes once, then `None` for each more of its values.
            if let Some(name) = name {
                last = Some(name);
            }
            if let Some(name) = &last {
                headers.append(name.clone(), value);
            }
        }
    }
}

/// A response body that may carry its response's [`WrittenFields`]: there
/// rather than in the response's extensions, whose map and boxes were
/// three allocations on every proxied answer (BENCHMARKS.md §64).
pub trait CarriesFields {
    /// The written fields, taken (`None` for most bodies, and once taken).
    fn take_written(&mut self) -> Option<WrittenFields> {
        None
    }
}

impl CarriesFields for http_body_util::Full<bytes::Bytes> {}

impl<D> CarriesFields for http_body_util::Empty<D> {}

impl<L: CarriesFields, R: CarriesFields> CarriesFields for http_body_util::Either<L, R> {
    fn take_written(&mut self) -> Option<WrittenFields> {
        match self {
            http_body_util::Either::Left(body) => body.take_written(),
            http_body_util::Either::Right(body) => body.take_written(),
        }
    }
}

/// A whole body whose response's fields come written out
/// ([`CarriesFields`]): an answer tollgate makes itself needs no map of
/// them.
pub struct WholeBody {
    body: http_body_util::Full<bytes::Bytes>,
    fields: Option<WrittenFields>,
}

impl WholeBody {
    /// `bytes`, its response's fields in its map.
    pub fn new(bytes: bytes::Bytes) -> WholeBody {
        WholeBody {
            body: http_body_util::Full::new(bytes),
            fields: None,
        }
    }

    /// `bytes`, its response's fields written out in `fields`.
    pub fn with_fields(bytes: bytes::Bytes, fields: WrittenFields) -> WholeBody {
        WholeBody {
            body: http_body_util::Full::new(bytes),
            fields: Some(fields),
        }
    }
}

impl CarriesFields for WholeBody {
    fn take_written(&mut self) -> Option<WrittenFields> {
        self.fields.take()
    }
}

impl hyper::body::Body for WholeBody {
    type Data = bytes::Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<bytes::Bytes>, Self::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// The size of header fields as HTTP/1 writes them (`name: value\r\n`).
pub fn head_bytes(headers: &http::HeaderMap) -> usize {
    crate::fields::Fields::Map(headers).head_bytes()
}

impl Default for ConnLimits {
    fn default() -> Self {
        ConnLimits {
            header_read_timeout: Duration::from_secs(10),
            shutdown_grace: Duration::from_secs(10),
            max_headers: 100,
            max_header_bytes: 64 * 1024,
            // NGINX's `keepalive_timeout` default.
            keepalive_timeout: Duration::from_secs(75),
            // NGINX's `send_timeout` default.
            send_timeout: Duration::from_secs(60),
        }
    }
}

/// Which listener a connection came in on, and the bound on how many it
/// may hold open (shared by the listeners of one surface).
#[derive(Clone)]
pub struct Gate {
    name: &'static str,
    slots: Option<Arc<Semaphore>>,
    max: usize,
    /// Accept loops waiting for a slot: while any does, idle connections
    /// close to make room.
    wanting: Arc<AtomicUsize>,
    /// How many more idle connections may close this turn.
    tickets: Arc<AtomicUsize>,
    /// The lots of the gate's listeners, whose parked connections go first.
    lots: Arc<Mutex<Vec<Weak<parking::Lot<connection::Idle>>>>>,
    /// Idle connections closed to make room (`tollgate_connections_reclaimed`).
    reclaimed: prometheus_client::metrics::counter::Counter,
    /// When a full gate was last logged, in ms since `epoch`, so a flood
    /// gives one line every few seconds rather than one per connection.
    last_warned: Arc<AtomicU64>,
    epoch: Instant,
}

/// How often a full gate, or a failing accept, is logged at most.
const WARN_EVERY: Duration = Duration::from_secs(10);

impl Gate {
    /// A gate for `name` holding at most `max` connections (none: unbounded).
    pub fn new(name: &'static str, max: Option<usize>) -> Gate {
        Gate {
            name,
            slots: max.map(|m| Arc::new(Semaphore::new(m.min(Semaphore::MAX_PERMITS)))),
            max: max.unwrap_or(usize::MAX),
            wanting: Arc::new(AtomicUsize::new(0)),
            tickets: Arc::new(AtomicUsize::new(0)),
            lots: Arc::new(Mutex::new(Vec::new())),
            reclaimed: crate::metrics::get().connections_reclaimed(name),
            last_warned: Arc::new(AtomicU64::new(u64::MAX)),
            epoch: Instant::now(),
        }
    }

    /// Whether a listener of this gate waits for room: idle connections
    /// should close.
    fn room_wanted(&self) -> bool {
        self.wanting.load(Ordering::Relaxed) > 0
    }

    /// Whether an idle connection may close to make room now (it takes one
    /// of the turn's tickets).
    fn may_reclaim(&self) -> bool {
        self.room_wanted()
            && self
                .tickets
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |t| t.checked_sub(1))
                .is_ok()
    }

    /// Counts `lot`'s parked connections among those that make room.
    fn add_lot(&self, lot: &Arc<parking::Lot<connection::Idle>>) {
        let mut lots = self.lots.lock().unwrap_or_else(|p| p.into_inner());
        lots.retain(|l| l.strong_count() > 0);
        lots.push(Arc::downgrade(lot));
    }

    /// Begins a turn of making room: closes parked connections (each idle
    /// for [`connection::PARK_AFTER`] at least), longest idle first, and
    /// leaves what is left of the turn's number to connections held by a
    /// task, which look on their watchdog's next turn; how many it closed.
    fn reclaim_turn(&self) -> usize {
        let at_once = (self.max / 8).clamp(1, RECLAIM_AT_ONCE);
        let lots: Vec<Arc<parking::Lot<connection::Idle>>> = {
            let lots = self.lots.lock().unwrap_or_else(|p| p.into_inner());
            lots.iter().filter_map(Weak::upgrade).collect()
        };
        // Longest idle first across the lots (one per proxy thread): the
        // turn's number of earliest keep-alive deadlines among all of them
        // (a connection's is its last response plus the same timeout),
        // then each lot closes its own among those.
        let mut deadlines: Vec<Instant> = lots.iter().flat_map(|lot| lot.earliest(at_once)).collect();
        deadlines.sort_unstable();
        let Some(&until) = deadlines.get(at_once.saturating_sub(1)).or(deadlines.last()) else {
            self.tickets.store(at_once, Ordering::Relaxed);
            return 0;
        };
        let mut closed = 0usize;
        for lot in lots {
            closed = closed.saturating_add(lot.reclaim(at_once.saturating_sub(closed), until));
        }
        self.tickets.store(at_once.saturating_sub(closed), Ordering::Relaxed);
        closed
    }

    /// Whether enough time passed since the last warning to write another.
    fn may_warn(&self) -> bool {
        let now = u64::try_from(self.epoch.elapsed().as_millis()).unwrap_or(u64::MAX);
        let last = self.last_warned.load(Ordering::Relaxed);
        let due = last == u64::MAX || now.saturating_sub(last) >= WARN_EVERY.as_millis() as u64;
        due && self
            .last_warned
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
    }
}

/// Serves `handler` on `listener` (over `tls` when given), holding no more
/// connections than `gate` allows, until `shutdown` turns true, then drains.
pub async fn serve<A: App>(
    listener: TcpListener,
    limits: ConnLimits,
    gate: Gate,
    tls: Option<TlsListener>,
    mut shutdown: watch::Receiver<bool>,
    handler: A,
) {
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        .timer(TokioTimer::new())
        // The connection's watchdog times heads from their first byte:
        // hyper's timer also runs while a keep-alive connection idles, and
        // closed idle TLS and HTTP/1.0 ones at this timeout, not
        // --keepalive-timeout.
        .header_read_timeout(None)
        .keep_alive(!limits.keepalive_timeout.is_zero())
        .max_headers(limits.max_headers)
        .max_buf_size(limits.max_header_bytes.max(8192));
    let mut http2 = hyper::server::conn::http2::Builder::new(streams::StreamExecutor {
        limit: limits.send_timeout,
    });
    http2
        .timer(TokioTimer::new())
        .max_header_list_size(u32::try_from(limits.max_header_bytes).unwrap_or(u32::MAX));
    let protocols = connection::Protocols {
        http1,
        http2,
        tls: tls.map(|t| t.acceptor().clone()),
    };
    let mut connections = JoinSet::new();
    // What this listener's connections watch for the stop: a copy of the
    // flag on this thread. Each connection waiting for its next request
    // watches it, and the server-wide channel is a lock and a waiter list
    // that every thread's connections would write on every request.
    let stop = Stop::relay(&shutdown);
    let open = crate::metrics::get().client_connections(gate.name);
    let metrics = connection::ConnMetrics {
        waiting: crate::metrics::get().waiting_connections(gate.name),
        response_seconds: crate::metrics::get().response_seconds(gate.name),
        first_request_seconds: crate::metrics::get().first_request_seconds(gate.name),
        tls_failures: crate::metrics::get().tls_handshake_failures(gate.name),
    };
    // Parked connections come back through `resumed` to be spawned here.
    let (resumed_tx, mut resumed) = tokio::sync::mpsc::unbounded_channel();
    let resume: parking::Resume<connection::Idle> = {
        let (handler, stop) = (handler.clone(), stop.clone());
        Box::new(move |stream, idle| Box::pin(connection::resume(stream, idle, handler.clone(), stop.clone())))
    };
    let lot = parking::Lot::start(resumed_tx, resume, metrics.waiting.clone(), stop.rx.clone())
        .inspect_err(|e| tracing::warn!(listener = gate.name, error = %e, "idle connections will be closed, not parked"))
        .ok();
    if let Some(lot) = &lot {
        gate.add_lot(lot);
    }
    // Shared: each connection's task holds only a pointer to it.
    let shared = Arc::new(connection::Listener {
        protocols,
        limits,
        metrics,
        lot,
        gate: gate.clone(),
    });
    loop {
        // Finished connections are reaped as they finish, not at the next
        // accept: each holds its task's memory until joined, and after a
        // burst closes there may be no next accept for a long time.
        let accepted = tokio::select! {
            accepted = accept(&listener, &gate, &mut shutdown) => accepted,
            Some(_) = connections.join_next(), if !connections.is_empty() => continue,
            Some(task) = resumed.recv() => {
                connections.spawn(task);
                continue;
            }
        };
        let Some((stream, peer)) = accepted else { break };
        // At the bound, this connection waits for a slot and nothing more is
        // accepted here meanwhile: the rest wait in the backlog. (Taking the
        // slot before accepting would strand it on one thread's listener
        // while SO_REUSEPORT hands the next connection to another.)
        let slot = {
            let waiting = free_slot(&gate);
            let mut waiting = std::pin::pin!(waiting);
            loop {
                tokio::select! {
                    slot = &mut waiting => break Some(slot),
                    Some(_) = connections.join_next(), if !connections.is_empty() => {}
                    // A parked connection already holds its slot.
                    Some(task) = resumed.recv() => {
                        connections.spawn(task);
                    }
                    _ = stopped(&mut shutdown) => break None,
                }
            }
        };
        let Some(slot) = slot else { break };
        let seat = connection::Seat::new(slot, &open);
        // The slot and the gauge are given back when the connection closes.
        let fut = connection::serve(stream, peer, handler.clone(), shared.clone(), stop.clone(), seat);
        connections.spawn(fut);
    }
    drop(listener);
    let drained = async { while connections.join_next().await.is_some() {} };
    if tokio::time::timeout(limits.shutdown_grace, drained).await.is_err() {
        tracing::warn!(grace = ?limits.shutdown_grace, "connections still open after the shutdown grace period");
    }
}

/// A slot for one more connection through `gate` (none when it is
/// unbounded), waiting while it is full, and closing idle connections
/// meanwhile to make room.
async fn free_slot(gate: &Gate) -> Option<OwnedSemaphorePermit> {
    let slots = gate.slots.as_ref()?;
    if let Ok(slot) = slots.clone().try_acquire_owned() {
        return Some(slot);
    }
    crate::metrics::get().connection_deferred(gate.name);
    if gate.may_warn() {
        tracing::warn!(
            listener = gate.name,
            max_connections = gate.max,
            "connection limit reached; closing idle connections to make room, new connections wait in the listen backlog meanwhile (raise --max-connections to hold more)"
        );
    }
    // Connections held by a task look at this on their watchdog's next
    // turn (within a second); parked ones are closed from here.
    let _wanting = Wanting::new(&gate.wanting);
    let acquire = slots.clone().acquire_owned();
    let mut acquire = std::pin::pin!(acquire);
    loop {
        let reclaimed = gate.reclaim_turn();
        gate.reclaimed.inc_by(reclaimed as u64);
        tokio::select! {
            // The semaphore is never closed, so this only waits.
            slot = &mut acquire => return slot.ok(),
            _ = tokio::time::sleep(RECLAIM_EVERY) => {}
        }
    }
}

/// An accept loop counted as waiting for room, until dropped.
struct Wanting<'a>(&'a AtomicUsize);

impl<'a> Wanting<'a> {
    fn new(count: &'a AtomicUsize) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Wanting(count)
    }
}

impl Drop for Wanting<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// The next connection on `listener`, ready to serve (Nagle off), or
/// `None` once `shutdown` turns true. Accept errors (out of file
/// descriptors, mostly) back off instead of spinning, counted and logged at
/// most every few seconds.
pub async fn accept(
    listener: &TcpListener,
    gate: &Gate,
    shutdown: &mut watch::Receiver<bool>,
) -> Option<(TcpStream, SocketAddr)> {
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
                crate::metrics::get().accept_error(gate.name);
                if gate.may_warn() {
                    tracing::warn!(listener = gate.name, error = %e, "accept failed; retrying every 50 ms (out of file descriptors? lower --max-connections or raise the file limit)");
                }
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

/// File descriptors kept back from client connections for the listeners,
/// Redis, the limits files and the log.
const RESERVED_FILES: u64 = 256;

/// The proxy's connection bound for `--max-connections` (`configured`, or
/// for 0 half of what the file-descriptor limit leaves, so that each client
/// connection can have an upstream one), raising the soft file limit to
/// the hard one first as Go's runtime does. `None`: no bound.
pub fn max_connections(configured: usize) -> Option<usize> {
    let files = raise_file_limit();
    let max = match (configured, files) {
        (0, Some(files)) => usize::try_from(files.saturating_sub(RESERVED_FILES) / 2).unwrap_or(usize::MAX).max(16),
        (0, None) => return None,
        (n, _) => n,
    };
    match files {
        Some(files) if (max as u64).saturating_mul(2).saturating_add(RESERVED_FILES) > files => tracing::warn!(
            max_connections = max,
            file_limit = files,
            "--max-connections and their upstream connections may need more file descriptors than the limit allows; accepts will fail (and be retried) when they run out"
        ),
        _ => tracing::info!(max_connections = max, file_limit = ?files, "client connections bounded"),
    }
    Some(max)
}

/// Raises the soft limit on open files to the hard limit; the limit now in
/// force (`None`: unlimited).
fn raise_file_limit() -> Option<u64> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit only read and write the struct passed.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) != 0 {
            return None;
        }
        if limit.rlim_cur < limit.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: limit.rlim_max,
                rlim_max: limit.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                limit = raised;
            }
        }
    }
    (limit.rlim_cur != libc::RLIM_INFINITY).then_some(limit.rlim_cur)
}
