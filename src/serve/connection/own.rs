//! tollgate's own HTTP/1.1 server for the requests that make most traffic: a
//! GET with no body on a plain keep-alive connection.
//!
//! hyper's server holds ~30 KB of buffers per connection while it serves one
//! and spends ~6,000 instructions a request in its dispatcher (BENCHMARKS.md
//! §56). Here a head is read into one buffer, freed once the response is
//! sent, the request goes to the same handler through the same bookkeeping
//! ([`Activity::began`], [`until_sent`]), and the response is written as
//! hyper writes it (its framing rules, its `date`).
//!
//! Anything else (a body or a word of one, an upgrade, `Expect`,
//! `Connection` other than `keep-alive`, HTTP/1.0, a head that does not
//! parse or is too large) goes to hyper with the bytes read so far, and hyper
//! serves the connection until it parks: every answer to an odd or malformed
//! request is hyper's own.

use std::future::Future;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Uri, Version};
use hyper::body::Body;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::alarm::Alarm;
use crate::fields::Lines;
use crate::upstream::has_token;

use super::super::stop::StopSeat;
use super::{Activity, App, ClientIo, PARK_AFTER, RequestBody, until_sent};

/// Most header fields a head may have here (browsers send 10-20); more go
/// to hyper, which holds them to the listener's bound.
const MAX_FIELDS: usize = 32;
/// hyper answers a request target this long or longer 414.
const MAX_TARGET: usize = 65_534;
/// What a read asks for at least.
const READ_AT_LEAST: usize = 4096;
/// A body piece at most this long is copied beside what waits to be
/// written, so a small response goes out in one write.
const COPY_UP_TO: usize = 16 * 1024;
/// Most bytes of a response held unsent while its body keeps coming
/// (hyper's write buffer bound): a body that fails before then sends
/// nothing of what was held, as with hyper.
const HOLD_UP_TO: usize = 8192 + 4096 * 100;

/// How serving a connection here ended.
pub(super) enum Served {
    /// The connection is done (the client left, a timeout, a stop).
    Closed,
    /// Idle with nothing read: to be parked.
    Park,
    /// A request for hyper: what was read of it is in the connection's
    /// replay.
    Hyper,
}

/// Serves GETs on `io` with `handler` until one is not for here, the
/// connection closes, or it is idle long enough to park. `rebuilt_at`:
/// requests begun when the connection was last served again after a park;
/// until one more begins, it is not parked again.
pub(super) async fn serve<A: App>(
    io: &mut ClientIo,
    handler: &A,
    stop: &mut StopSeat,
    rebuilt_at: u64,
) -> Served {
    let activity = io.activity.clone();
    let limits = activity.listener.limits;
    let max_head = limits.max_header_bytes.max(8192);
    let fields = limits.max_headers.min(MAX_FIELDS);
    // What was read before (the protocol sniff, or a head hyper had begun
    // when it parked) is taken whole: handed back to hyper, none of it may
    // be left behind.
    let mut buf = BytesMut::from(&std::mem::take(&mut io.replay)[..]);
    // Left set by hyper's last park: this is not one.
    activity.parking.store(false, Ordering::Relaxed);
    activity.read_while_parking.store(false, Ordering::Relaxed);
    let mut alarm = Alarm::new();
    // The client shut its side while requests it sent were still held here
    // unserved: the one being handled is answered, none after it is.
    let mut shut = false;
    loop {
        let req = loop {
            if !buf.is_empty() {
                match parse(&mut buf, fields, A::READS_LINES) {
                    Head::Get(req) => break req,
                    Head::Partial if buf.len() < max_head => {}
                    Head::Partial | Head::Other => {
                        io.replay = buf.freeze();
                        return Served::Hyper;
                    }
                }
            }
            let fresh = rebuilt_at == activity.begun.load(Ordering::Relaxed);
            match wait_for_bytes(io, &mut buf, &activity, stop, &mut alarm, fresh).await {
                Waited::Bytes => {}
                Waited::Park => return Served::Park,
                Waited::Closed => return Served::Closed,
            }
        };
        let busy = activity.began(false);
        // Past the header bounds: 431 (no handler), as hyper's path answers.
        // Pinned in this connection's state rather than boxed: a box was
        // one allocation and a copy of the whole future (KBs) per request.
        let mut answer = std::pin::pin!(limits.admits(super::fields(&req)).then(|| handler.call(req, activity.peer)));
        let response = {
            // hyper ends a connection whose client leaves while its request
            // is handled (its handler dropped: an upstream request it
            // started is cancelled); bytes that come meanwhile wait. It
            // looks before the handler first runs: a client that sent its
            // request and at once shut its side (`nc -N`) has its request
            // neither decided nor forwarded, as NGINX's 499. With requests
            // pipelined behind it, it is answered, and those are not served:
            // they are read on meanwhile (to the head bound), so a client
            // that left during a slow answer is seen to have, and NGINX
            // forwards none of them either.
            loop {
                if buf.capacity() == buf.len() {
                    buf.reserve(READ_AT_LEAST);
                }
                tokio::select! {
                    biased;
                    read = io.read_buf(&mut buf), if !shut && buf.len() < max_head => match read {
                        Ok(0) | Err(_) if buf.is_empty() => {
                            tracing::debug!(peer = %activity.peer, "client left while its request was handled");
                            return Served::Closed;
                        }
                        Ok(0) | Err(_) => {
                            tracing::debug!(peer = %activity.peer, "client left with requests pipelined: the one handled is answered, the rest not served");
                            shut = true;
                        }
                        Ok(_) => {}
                    },
                    response = std::future::poll_fn(|cx| match answer.as_mut().as_pin_mut() {
                        Some(answer) => answer.poll(cx).map(Some),
                        None => Poll::Ready(None),
                    }) => break response,
                }
            }
        };
        let response = until_sent(response, false, busy);
        let stopping = stop.is_set();
        let last = match write_response(io, response, stopping, &mut buf).await {
            Ok(last) => last,
            Err(e) => {
                tracing::debug!(peer = %activity.peer, error = %e, "connection ended with an error");
                return Served::Closed;
            }
        };
        if last || shut || stop.is_set() {
            let _ = io.shutdown().await;
            return Served::Closed;
        }
        if !buf.is_empty() {
            // The next head began before this response ended.
            activity.head_read_with_last();
        }
    }
}

/// What the wait for a client's next bytes came to.
enum Waited {
    Bytes,
    Park,
    Closed,
}

/// Reads more of a request head into `buf`, watching the connection's
/// timeouts, the listener's bound and the server's stop as hyper's path
/// does (see `serve_http1`); with nothing in flight, each ends it at once.
async fn wait_for_bytes(
    io: &mut ClientIo,
    buf: &mut BytesMut,
    activity: &Activity,
    stop: &mut StopSeat,
    alarm: &mut Alarm,
    fresh: bool,
) -> Waited {
    let limits = &activity.listener.limits;
    let peer = activity.peer;
    if buf.capacity().saturating_sub(buf.len()) < READ_AT_LEAST / 4 {
        buf.reserve(READ_AT_LEAST);
    }
    loop {
        // One read of the time for all three (each read is a system clock
        // read, several per request add up).
        let now = std::time::Instant::now();
        let park_in = if fresh || !buf.is_empty() { None } else { activity.park_in_at(now) };
        let wake = activity
            .left_at(limits, now)
            .min(limits.recheck_every())
            .min(limits.header_read_timeout.max(Duration::from_millis(10)))
            .min(park_in.unwrap_or(PARK_AFTER));
        alarm.within(tokio::time::Instant::from_std(now), wake);
        tokio::select! {
            biased;
            read = io.read_buf(buf) => {
                return match read {
                    Ok(0) => Waited::Closed,
                    Ok(_) => Waited::Bytes,
                    Err(e) => {
                        tracing::debug!(%peer, error = %e, "connection ended with an error");
                        Waited::Closed
                    }
                };
            }
            // Idle: closed at once. A head begun is read on and answered
            // (with `Connection: close`), as hyper and NGINX do.
            _ = stop.stopped(), if buf.is_empty() => return Waited::Closed,
            _ = alarm.rung() => {
                let served = activity.served.load(Ordering::Relaxed);
                let head_due = !served || activity.head_begun().is_some();
                if activity.gives_way(!served) {
                    return Waited::Closed;
                }
                if activity.left(limits).is_zero() {
                    if head_due {
                        tracing::debug!(%peer, "connection closed: request head not received within the header read timeout");
                    } else {
                        tracing::debug!(%peer, "idle connection closed");
                    }
                    return Waited::Closed;
                }
                if park_in.is_some() && activity.park_in().is_some_and(|p| p.is_zero()) {
                    return Waited::Park;
                }
            }
        }
    }
}

/// A request head read from the connection.
// Returned once per request and matched at once: a box would be one more
// allocation for each.
#[allow(clippy::large_enum_variant)]
enum Head {
    /// A GET for here.
    Get(Request<RequestBody>),
    /// Not whole yet.
    Partial,
    /// For hyper (`buf` as it was).
    Other,
}

/// Parses the head at the start of `buf`, taking it off when it is a GET
/// for here; with `lines`, its fields are handed over as the head's lines
/// where they can be ([`RequestBody::Lines`]).
fn parse(buf: &mut BytesMut, fields: usize, lines: bool) -> Head {
    let mut storage = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_FIELDS];
    let Some(slots) = storage.get_mut(..fields) else { return Head::Other };
    // Where the target and each field's name and value lie, to share the
    // head's bytes rather than copy them.
    let mut spans = [[0u32; 4]; MAX_FIELDS];
    let mut req = httparse::Request::new(&mut []);
    let len = match httparse::ParserConfig::default().parse_request_with_uninit_headers(&mut req, buf, slots) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Head::Partial,
        Err(_) => return Head::Other,
    };
    let (Some("GET"), Some(1), Some(path)) = (req.method, req.version, req.path) else {
        return Head::Other;
    };
    if !path.starts_with('/') || path.len() >= MAX_TARGET {
        return Head::Other;
    }
    let base = buf.as_ptr() as usize;
    // Offsets into the head (shorter than 4 GB: the read buffer's bound).
    let at = |s: &[u8]| u32::try_from((s.as_ptr() as usize).wrapping_sub(base)).unwrap_or(u32::MAX);
    let size = |s: &[u8]| u32::try_from(s.len()).unwrap_or(u32::MAX);
    let target = at(path.as_bytes());
    let target = [target, target.saturating_add(size(path.as_bytes()))];
    let count = req.headers.len();
    for (span, field) in spans.iter_mut().zip(req.headers.iter()) {
        if !for_here(field) {
            return Head::Other;
        }
        let (name, value) = (at(field.name.as_bytes()), at(field.value));
        *span = [
            name,
            name.saturating_add(size(field.name.as_bytes())),
            value,
            value.saturating_add(size(field.value)),
        ];
    }
    let head = buf.split_to(len);
    let spans = spans.get(..count).unwrap_or_default();
    let req = match lines {
        true => with_lines(head, target, spans),
        false => {
            let head = head.freeze();
            request(&head, target, spans).ok_or(head)
        }
    };
    match req {
        Ok(req) => Head::Get(req),
        Err(head) => {
            // A field hyper reads another way (a name `http` does not
            // take): put the head back, for hyper's answer.
            let mut whole = BytesMut::with_capacity(head.len().saturating_add(buf.len()));
            whole.extend_from_slice(&head);
            whole.extend_from_slice(buf);
            *buf = whole;
            Head::Other
        }
    }
}

/// Whether a request with this field is served here: none that frames a
/// body or changes the connection (hyper's rules for those are long and
/// rare), `Connection: keep-alive` alone excepted (what HTTP/1.1 says
/// without it).
fn for_here(field: &httparse::Header<'_>) -> bool {
    let name = field.name.as_bytes();
    if name.eq_ignore_ascii_case(b"connection") {
        return field.value.trim_ascii().eq_ignore_ascii_case(b"keep-alive");
    }
    ![&b"content-length"[..], b"transfer-encoding", b"upgrade", b"expect"]
        .iter()
        .any(|n| name.eq_ignore_ascii_case(n))
}

/// The request `head` holds, its fields left as its lines; in a map when
/// they cannot be (see [`Lines::new`]).
fn with_lines(head: BytesMut, target: [u32; 2], spans: &[[u32; 4]]) -> Result<Request<RequestBody>, Bytes> {
    match Lines::new(head, spans.to_vec()) {
        Ok(lines) => match target_of(lines.head(), target) {
            Some(uri) => Ok(get(uri, HeaderMap::new(), RequestBody::Lines(lines))),
            None => Err(lines.into_head()),
        },
        Err(head) => {
            let head = head.freeze();
            request(&head, target, spans).ok_or(head)
        }
    }
}

/// The request target at `target` in `head`, sharing its bytes.
fn target_of(head: &Bytes, target: [u32; 2]) -> Option<Uri> {
    let [start, end] = target.map(|n| n as usize);
    Uri::from_maybe_shared(head.slice_ref(head.get(start..end)?)).ok()
}

/// A GET for `uri` with `headers` and `body` (no body: perhaps its lines).
fn get(uri: Uri, headers: HeaderMap, body: RequestBody) -> Request<RequestBody> {
    let mut req = Request::new(body);
    *req.method_mut() = Method::GET;
    *req.uri_mut() = uri;
    *req.version_mut() = Version::HTTP_11;
    *req.headers_mut() = headers;
    req
}

/// The request `head` holds, its target and fields views of its bytes.
fn request(head: &Bytes, target: [u32; 2], spans: &[[u32; 4]]) -> Option<Request<RequestBody>> {
    let uri = target_of(head, target)?;
    Some(get(uri, crate::fields::map_of(head, spans)?, RequestBody::Empty))
}

/// How a response body is framed on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Framing {
    /// This many bytes (none for a 204, a 304).
    Length(u64),
    Chunked,
    /// Read to the connection's close (an HTTP/1.0 response of unknown
    /// length).
    UntilClose,
}

/// What a response body says of its length before it is read.
#[derive(Debug, Clone, Copy)]
enum BodyLength {
    /// Over already.
    Empty,
    Known(u64),
    Unknown,
}

/// Writes `response` to a GET's client as hyper writes it; `stopping`: the
/// server is stopping, so the connection closes after it (`Connection:
/// close`, as hyper says then). Returns whether the connection must close
/// after it. Bytes of the next request that come while a body waits for
/// the handler are kept in `buf`; a client that leaves then ends it.
async fn write_response<B>(
    io: &mut ClientIo,
    response: Response<B>,
    stopping: bool,
    buf: &mut BytesMut,
) -> std::io::Result<bool>
where
    B: Body + crate::serve::CarriesFields + Unpin,
    B::Error: std::fmt::Display,
{
    let (parts, mut body) = response.into_parts();
    let written = body.take_written();
    let length = match body.is_end_stream() {
        true => BodyLength::Empty,
        false => body.size_hint().exact().map_or(BodyLength::Unknown, BodyLength::Known),
    };
    let mut out = Vec::with_capacity(256);
    let Some((framing, last)) = encode_head(&parts, written.as_ref(), length, stopping, &mut out) else {
        // hyper sends nothing for a response it cannot frame, and closes.
        return Err(std::io::Error::other("the response's framing fields contradict each other"));
    };
    let mut unsent = Unsent {
        queue: Vec::new(),
        tail: out,
        len: 0,
    };
    // Bytes still owed, for a body of known length.
    let (mut left, chunked) = match framing {
        Framing::Length(0) => {
            drop(body);
            unsent.write_to(io).await?;
            return Ok(last);
        }
        Framing::Length(n) => (Some(n), false),
        Framing::Chunked => (None, true),
        Framing::UntilClose => (None, false),
    };
    loop {
        let frame = match std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut body).poll_frame(cx))).await {
            Poll::Ready(frame) => frame,
            Poll::Pending => {
                // Out with what is held, then wait for more, watching for
                // the client leaving (as hyper does mid-message).
                unsent.write_to(io).await?;
                wait_for_frame(io, &mut body, buf).await?
            }
        };
        let mut data = match frame {
            None => break,
            // What is held is not sent: hyper's connection ends with the
            // body's error, its write buffer unsent.
            Some(Err(e)) => return Err(std::io::Error::other(format!("response body failed: {e}"))),
            // Trailers: an HTTP/1.1 client gets none (hyper sends only
            // those a `Trailer` field names, which the proxy removes as
            // hop-by-hop).
            Some(Ok(frame)) => match frame.into_data() {
                Ok(mut data) => data.copy_to_bytes(data.remaining()),
                Err(_) => continue,
            },
        };
        if data.is_empty() {
            continue;
        }
        if let Some(n) = &mut left {
            // hyper cuts a body longer than its length at the length.
            data.truncate(usize::try_from(*n).unwrap_or(usize::MAX));
            *n = n.saturating_sub(data.len() as u64);
        }
        if chunked {
            chunk_size(&mut unsent.tail, data.len());
        }
        unsent.push(data);
        if chunked {
            unsent.tail.extend_from_slice(b"\r\n");
        }
        if left == Some(0) {
            // Whole: the rest of the body is neither sent nor waited for.
            break;
        }
        if unsent.len >= HOLD_UP_TO {
            unsent.write_to(io).await?;
        }
    }
    match left {
        None if chunked => unsent.tail.extend_from_slice(b"0\r\n\r\n"),
        None | Some(0) => {}
        // Short of its length: hyper ends the connection, what it held
        // unsent.
        Some(_) => return Err(std::io::Error::other("the response body ended before its length")),
    }
    // The response is done once it is all handed over, as hyper lets go of
    // a body once its end is buffered.
    drop(body);
    unsent.write_to(io).await?;
    Ok(last)
}

/// A response's bytes not written yet, in order: pieces too long to copy,
/// then what was copied after them.
struct Unsent {
    queue: Vec<Bytes>,
    tail: Vec<u8>,
    /// Body bytes held (for the hold bound).
    len: usize,
}

impl Unsent {
    fn push(&mut self, data: Bytes) {
        self.len = self.len.saturating_add(data.len());
        if data.len() <= COPY_UP_TO {
            self.tail.extend_from_slice(&data);
            return;
        }
        if !self.tail.is_empty() {
            self.queue.push(Bytes::from(std::mem::take(&mut self.tail)));
        }
        self.queue.push(data);
    }

    async fn write_to(&mut self, io: &mut ClientIo) -> std::io::Result<()> {
        for piece in self.queue.drain(..) {
            io.write_all(&piece).await?;
        }
        if !self.tail.is_empty() {
            io.write_all(&self.tail).await?;
            self.tail.clear();
        }
        self.len = 0;
        Ok(())
    }
}

/// Waits for a response body's next frame; the client leaving meanwhile
/// ends the connection (bytes it sends are kept in `buf`).
async fn wait_for_frame<B>(
    io: &mut ClientIo,
    body: &mut B,
    buf: &mut BytesMut,
) -> std::io::Result<Option<Result<hyper::body::Frame<B::Data>, B::Error>>>
where
    B: Body + Unpin,
{
    loop {
        if buf.capacity() == buf.len() {
            buf.reserve(READ_AT_LEAST);
        }
        tokio::select! {
            biased;
            frame = std::future::poll_fn(|cx| Pin::new(&mut *body).poll_frame(cx)) => return Ok(frame),
            read = io.read_buf(buf), if buf.is_empty() => match read {
                Ok(0) => return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "the client left mid-response")),
                Ok(_) => {}
                Err(e) => return Err(e),
            },
        }
    }
}

/// Writes a response head for a GET over HTTP/1.1 as hyper's server does:
/// its framing for each status and body, the `Connection` lines joined,
/// `date` when the response has none. `None`: the framing fields contradict
/// each other, which hyper refuses to send. Also returns whether the
/// connection closes after the response.
fn encode_head(
    parts: &http::response::Parts,
    written: Option<&crate::serve::WrittenFields>,
    length: BodyLength,
    stopping: bool,
    out: &mut Vec<u8>,
) -> Option<(Framing, bool)> {
    let status = parts.status;
    // A 1xx other than 101 is not a response hyper sends: a 500 instead,
    // and the connection ends.
    if status.is_informational() && status != StatusCode::SWITCHING_PROTOCOLS {
        out.extend_from_slice(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 0\r\n");
        date_line(out);
        out.extend_from_slice(b"\r\n");
        return Some((Framing::Length(0), true));
    }
    // No body, and neither length nor coding said (RFC 9110 §6.4.1); after
    // a 101 the connection is the upgrade's, so hyper closes it here.
    let switching = status == StatusCode::SWITCHING_PROTOCOLS;
    let bodiless = switching || matches!(status, StatusCode::NO_CONTENT | StatusCode::NOT_MODIFIED);
    let reason = parts.extensions.get::<hyper::ext::ReasonPhrase>();
    let old = parts.version == Version::HTTP_10;
    if !old && status == StatusCode::OK && reason.is_none() {
        out.extend_from_slice(b"HTTP/1.1 200 OK\r\n");
    } else {
        out.extend_from_slice(if old { b"HTTP/1.0 " } else { b"HTTP/1.1 " });
        out.extend_from_slice(status.as_str().as_bytes());
        out.push(b' ');
        match reason {
            Some(reason) => out.extend_from_slice(reason.as_bytes()),
            None => out.extend_from_slice(status.canonical_reason().unwrap_or("<none>").as_bytes()),
        }
        out.extend_from_slice(b"\r\n");
    }
    let mut framing = None;
    let mut last = stopping || switching;
    let mut wrote_date = false;
    if let Some(written) = written {
        out.extend_from_slice(&written.lines);
        wrote_date = written.has_date;
    }
    let mut wrote_connection = false;
    let headers = &parts.headers;
    // The framing and connection fields are written once, with all their
    // values (which come one after another): the name last written so.
    let mut joined_last: Option<&HeaderName> = None;
    for (name, value) in headers.iter() {
        let special = matches!(
            *name,
            header::CONTENT_LENGTH | header::TRANSFER_ENCODING | header::CONNECTION | header::TRAILER
        );
        if !special {
            wrote_date |= *name == header::DATE;
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
            continue;
        }
        if joined_last == Some(name) {
            continue;
        }
        joined_last = Some(name);
        let values = headers.get_all(name);
        match *name {
            header::CONTENT_LENGTH => {
                if framing.is_some() {
                    return None;
                }
                let first = values.iter().next()?;
                framing = Some(match length {
                    // hyper leaves it out for a body that is over, and
                    // says 0 itself where a length may be said.
                    BodyLength::Empty => continue,
                    BodyLength::Known(len) => Framing::Length(len),
                    BodyLength::Unknown => {
                        let len = content_length(first)?;
                        if values.iter().any(|v| content_length(v) != Some(len)) {
                            return None;
                        }
                        Framing::Length(len)
                    }
                });
                out.extend_from_slice(b"content-length: ");
                out.extend_from_slice(first.as_bytes());
                out.extend_from_slice(b"\r\n");
            }
            header::TRANSFER_ENCODING => {
                if framing.is_some() {
                    return None;
                }
                if bodiless || old {
                    continue;
                }
                framing = Some(Framing::Chunked);
                let chunked_last = values.iter().next_back().is_some_and(|v| last_token_is(v, "chunked"));
                joined(out, "transfer-encoding: ", values.iter(), (!chunked_last).then_some("chunked"));
            }
            header::CONNECTION => {
                wrote_connection = true;
                let close = values.iter().any(|v| has_token(v, "close"));
                last |= close;
                joined(out, "connection: ", values.iter(), (stopping && !close).then_some("close"));
            }
            _ => {
                if !bodiless && !old {
                    joined(out, "trailer: ", values.iter(), None);
                }
            }
        }
    }
    if stopping && !wrote_connection {
        out.extend_from_slice(b"connection: close\r\n");
    }
    let framing = match (framing, length) {
        _ if bodiless => Framing::Length(0),
        (Some(framing), _) => framing,
        (None, BodyLength::Unknown) if old => {
            last = true;
            Framing::UntilClose
        }
        (None, BodyLength::Unknown) => {
            out.extend_from_slice(b"transfer-encoding: chunked\r\n");
            Framing::Chunked
        }
        (None, BodyLength::Empty) => {
            out.extend_from_slice(b"content-length: 0\r\n");
            Framing::Length(0)
        }
        (None, BodyLength::Known(len)) => {
            out.extend_from_slice(b"content-length: ");
            out.extend_from_slice(itoa::Buffer::new().format(len).as_bytes());
            out.extend_from_slice(b"\r\n");
            Framing::Length(len)
        }
    };
    if !wrote_date {
        date_line(out);
    }
    out.extend_from_slice(b"\r\n");
    Some((framing, last))
}

/// One line of `name` with every value, comma-joined, and `extra` after.
fn joined<'a>(out: &mut Vec<u8>, name: &str, values: impl Iterator<Item = &'a HeaderValue>, extra: Option<&str>) {
    out.extend_from_slice(name.as_bytes());
    for (i, value) in values.enumerate() {
        if i > 0 {
            out.extend_from_slice(b", ");
        }
        out.extend_from_slice(value.as_bytes());
    }
    if let Some(extra) = extra {
        out.extend_from_slice(b", ");
        out.extend_from_slice(extra.as_bytes());
    }
    out.extend_from_slice(b"\r\n");
}

/// A chunk's size line (`1A2F\r\n`).
fn chunk_size(out: &mut Vec<u8>, len: usize) {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let digits = usize::BITS.saturating_sub(len.leading_zeros()).div_ceil(4).max(1);
    for i in (0..digits).rev() {
        let nibble = len.checked_shr(i.saturating_mul(4)).unwrap_or(0) & 0xF;
        out.push(HEX.get(nibble).copied().unwrap_or(b'0'));
    }
    out.extend_from_slice(b"\r\n");
}

/// `content-length`'s value as hyper reads it: digits only.
fn content_length(value: &HeaderValue) -> Option<u64> {
    let bytes = value.as_bytes();
    if bytes.is_empty() || !bytes.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(bytes).ok()?.parse().ok()
}

/// Whether the last comma-separated token of `value` is `token`.
fn last_token_is(value: &HeaderValue, token: &str) -> bool {
    value
        .to_str()
        .ok()
        .and_then(|s| s.rsplit(',').next())
        .is_some_and(|t| t.trim().eq_ignore_ascii_case(token))
}

/// `date: <now>\r\n`, formatted once a second per thread, as hyper caches it.
fn date_line(out: &mut Vec<u8>) {
    use std::cell::RefCell;
    use std::time::{SystemTime, UNIX_EPOCH};
    thread_local! {
        static CACHED: RefCell<(u64, [u8; 29])> = const { RefCell::new((u64::MAX, [0; 29])) };
    }
    let now = SystemTime::now();
    let secs = now.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    CACHED.with(|cached| {
        let mut cached = cached.borrow_mut();
        if cached.0 != secs {
            let text = httpdate::fmt_http_date(now);
            if let Some(bytes) = text.as_bytes().get(..29) {
                cached.1.copy_from_slice(bytes);
                cached.0 = secs;
            }
        }
        out.extend_from_slice(b"date: ");
        out.extend_from_slice(&cached.1);
        out.extend_from_slice(b"\r\n");
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_sizes_are_upper_case_hex_without_leading_zeros() {
        for (len, line) in [(0, "0\r\n"), (1, "1\r\n"), (15, "F\r\n"), (16, "10\r\n"), (0x1a2f, "1A2F\r\n"), (usize::MAX, "FFFFFFFFFFFFFFFF\r\n")] {
            let mut out = Vec::new();
            chunk_size(&mut out, len);
            assert_eq!(String::from_utf8(out).unwrap(), line, "{len}");
        }
    }
}
