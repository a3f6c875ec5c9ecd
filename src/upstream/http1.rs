//! An HTTP/1.1 client of our own for the proxy's commonest exchange: a
//! request without a body to a plain `http://` upstream, on a connection
//! kept alive between requests.
//!
//! hyper's client is general (bodies streamed both ways, protocol
//! switches, a task per connection owning its buffers), and that
//! generality was about a sixth of the instructions of a proxied request
//! (BENCHMARKS.md §47). Here the request's head is written from one
//! buffer, the answer is read on the request's own task, and the
//! connection goes back to the pool once the body has been read to its
//! end. The pool keeps hyper for everything else: requests with bodies,
//! TLS, HTTP/2, protocol switches.
//!
//! An answer is read as hyper's client reads it: the framing of RFC 9112
//! §6.3 in hyper's order, chunk sizes, extensions and trailers with
//! hyper's bounds, `Connection` weighed as hyper weighs it. The tests hold
//! it to hyper's client as the reference over random answers cut at random
//! places: a disagreement on where a body ends would hand the rest of one
//! answer to the next request on the connection.

use std::future::Future;
use std::io;
use std::mem::MaybeUninit;
use std::pin::{Pin, pin};
use std::task::{Context, Poll, ready};

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http::header::{self, HeaderName, HeaderValue};
use http::{HeaderMap, Method, Request, Response, StatusCode, Version};
use hyper::body::{Body, Frame, SizeHint};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use super::pool::MAX_RESPONSE_HEAD;

/// Most fields in a response head, or in its trailers (hyper's bound).
const MAX_FIELDS: usize = 100;

/// Most bytes of chunk extensions in one body (hyper's bound).
const MAX_EXTENSION_BYTES: u64 = 16 * 1024;

/// Room for the first read of an answer: its head, and usually its body.
const FIRST_READ: usize = 8 * 1024;

/// Largest room a read of a long body grows to (doubling while reads fill it).
const MOST_READ: usize = 128 * 1024;

/// Most bytes of chunked framing (sizes, extensions, trailers) read in one
/// poll; then the body yields. Framing that never ends (`0000…`, a size
/// followed by endless spaces) would otherwise be read on one poll for as
/// long as the upstream sends it: the thread's other requests starve, and
/// the body timeout, which runs between polls, never fires.
const FRAMING_PER_POLL: usize = 16 * 1024;

/// Why an exchange ended before a response head was read whole.
#[derive(Debug, thiserror::Error)]
pub enum Http1Error {
    /// Not a byte of an answer came: the connection closed (or was reset)
    /// as the request went out, as an upstream closing an idle connection
    /// looks.
    #[error("the upstream closed the connection without answering{}", Cause(.0))]
    Unanswered(Option<io::Error>),
    /// Reading the head failed after part of it came.
    #[error("reading the upstream's response head failed: {0}")]
    Io(io::Error),
    /// The connection ended in the middle of the head.
    #[error("the upstream closed the connection in the middle of the response head")]
    CutHead,
    /// The head is not HTTP/1.x.
    #[error("the upstream sent a malformed response head: {0}")]
    Malformed(httparse::Error),
    /// The head is longer than [`MAX_RESPONSE_HEAD`] or has more than 100 fields.
    #[error("the upstream sent a response head larger than 64 KB or with more than 100 fields")]
    HeadTooLarge,
    /// `Content-Length` is not a number, or its values differ.
    #[error("the upstream sent an invalid Content-Length")]
    ContentLength,
    /// HTTP/1.0 has no transfer codings (RFC 9112 §6.1).
    #[error("the upstream sent Transfer-Encoding in an HTTP/1.0 response")]
    TransferEncoding10,
    /// A 101 to a request that asked for no protocol switch.
    #[error("the upstream switched protocols unasked (a 101 to a request that asked for no switch)")]
    UnaskedSwitch,
}

impl Http1Error {
    /// Whether the connection ended (closed, or reset) before a whole head
    /// came: nothing, or part of a status line or of the fields, or only
    /// interim answers. What NGINX's `proxy_next_upstream error` counts as
    /// an error "reading the response header", after which a request on a
    /// kept connection may go again; a head that came whole but is wrong
    /// (malformed, too large) is the upstream's answer, not a lost one.
    pub fn head_lost(&self) -> bool {
        matches!(self, Http1Error::Unanswered(_) | Http1Error::CutHead | Http1Error::Io(_))
    }
}

/// An optional cause, after `": "`.
struct Cause<'a>(&'a Option<io::Error>);

impl std::fmt::Display for Cause<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            Some(e) => write!(f, ": {e}"),
            None => Ok(()),
        }
    }
}

/// Why a response body ended before its end.
#[derive(Debug, thiserror::Error)]
pub enum BodyFailed {
    /// The connection closed before the length or the last chunk.
    #[error("the upstream closed the connection before the end of the body")]
    Incomplete,
    /// Reading failed (a reset).
    #[error("reading the upstream's response body failed: {0}")]
    Io(#[from] io::Error),
    /// The chunked framing is broken.
    #[error("the upstream's chunked body is malformed: {0}")]
    Chunk(&'static str),
    /// A trailer field is malformed.
    #[error("the upstream's trailers are malformed: {0}")]
    Trailers(&'static str),
}

/// Whether `req` can go by this client: no body, an origin-form target,
/// a method that is neither CONNECT nor a protocol switch's.
pub fn fits<B: Body>(req: &Request<B>) -> bool {
    req.body().is_end_stream()
        && req.method() != Method::CONNECT
        && req.uri().scheme().is_none()
        && req.uri().authority().is_none()
        && !req.headers().contains_key(header::UPGRADE)
}

/// Sends `req`'s head on `io` and reads the answer's head; the body is
/// read as it is polled, and once read to its end hands `io` back
/// ([`ResponseBody::reusable`]). `peer` is the version the connection's
/// last answer came in (HTTP/1.1 for a new one): an upstream that answered
/// HTTP/1.0 is spoken HTTP/1.0 to, asking for keep-alive, as hyper's
/// client does. `req` is only borrowed: when nothing answered
/// ([`Http1Error::unanswered`]) it can go again on another connection.
/// `fields`, when given, are the request's header fields as written
/// (`name: value\r\n` lines), in place of `req`'s map.
pub async fn exchange<T, B>(
    mut io: T,
    req: &Request<B>,
    fields: Option<&[u8]>,
    peer: Version,
) -> Result<Response<ResponseBody<T>>, Http1Error>
where
    T: AsyncRead + AsyncWrite + Unpin,
{
    let head = request_head(req, fields, peer == Version::HTTP_10);
    if let Err(e) = io.write_all(&head).await {
        return Err(Http1Error::Unanswered(Some(e)));
    }
    if let Err(e) = io.flush().await {
        return Err(Http1Error::Unanswered(Some(e)));
    }
    drop(head);
    let head_only = req.method() == Method::HEAD;
    let mut buf = BytesMut::with_capacity(FIRST_READ);
    let mut answered = false;
    loop {
        if buf.capacity() == buf.len() {
            buf.reserve(FIRST_READ);
        }
        let n = match io.read_buf(&mut buf).await {
            Ok(n) => n,
            Err(e) if !answered => return Err(Http1Error::Unanswered(Some(e))),
            Err(e) => return Err(Http1Error::Io(e)),
        };
        if n == 0 {
            return Err(if answered {
                Http1Error::CutHead
            } else {
                Http1Error::Unanswered(None)
            });
        }
        answered = true;
        // A buffer may hold interim answers (100, 103) before the final one.
        while !buf.is_empty() {
            match parse_head(&mut buf, head_only)? {
                Parsed::Partial => break,
                Parsed::Interim => continue,
                Parsed::Final(head, fields, decoder, keep_alive) => {
                    let body = ResponseBody {
                        io: Some(io),
                        buf,
                        decoder,
                        keep_alive,
                        version: head.version(),
                        read_size: FIRST_READ,
                        fields: Some(fields),
                        written: None,
                    };
                    return Ok(head.map(|()| body));
                }
            }
        }
    }
}

/// `req`'s head as HTTP/1.1 writes it (its fields from its map, or
/// `fields` already written), or as HTTP/1.0 asking for keep-alive when
/// `http10`. `Transfer-Encoding` is left out: the request has no body
/// (hyper's client drops it the same way).
fn request_head<B>(req: &Request<B>, fields: Option<&[u8]>, http10: bool) -> Vec<u8> {
    let target = req.uri().path_and_query().map_or("/", |pq| pq.as_str());
    let method = req.method().as_str();
    let written = match fields {
        Some(fields) => fields.len(),
        None => req.headers().iter().fold(0usize, |n, (name, value)| {
            n.saturating_add(name.as_str().len()).saturating_add(value.len()).saturating_add(4)
        }),
    };
    let size = method.len().saturating_add(target.len()).saturating_add(13).saturating_add(written).saturating_add(26);
    let mut head = Vec::with_capacity(size);
    head.extend_from_slice(method.as_bytes());
    head.push(b' ');
    head.extend_from_slice(target.as_bytes());
    head.extend_from_slice(if http10 { b" HTTP/1.0\r\n" } else { b" HTTP/1.1\r\n" });
    match fields {
        Some(fields) => head.extend_from_slice(fields),
        None => {
            for (name, value) in req.headers() {
                if name == header::TRANSFER_ENCODING {
                    continue;
                }
                head.extend_from_slice(name.as_str().as_bytes());
                head.extend_from_slice(b": ");
                head.extend_from_slice(value.as_bytes());
                head.extend_from_slice(b"\r\n");
            }
        }
    }
    // HTTP/1.0 closes after each answer unless asked not to. (Written
    // fields are a proxy's: `Connection` is never among them.)
    if http10 && !req.headers().get_all(header::CONNECTION).iter().any(|v| has_token(v, "keep-alive")) {
        head.extend_from_slice(b"connection: keep-alive\r\n");
    }
    head.extend_from_slice(b"\r\n");
    head
}

/// What the start of a buffer held.
// Made once per answer and taken apart at once: boxing the large variant
// would be one more allocation per request, for no copy saved.
#[allow(clippy::large_enum_variant)]
enum Parsed {
    /// Not yet a whole head.
    Partial,
    /// An interim answer (1xx), taken off the buffer.
    Interim,
    /// The final answer's head, taken off the buffer (its fields apart,
    /// as they came), with how its body is framed and whether the
    /// connection may carry another request after.
    Final(Response<()>, UpstreamFields, Decoder, bool),
}

/// An answer's header fields as they came: the head's bytes, and where each
/// field's name and value lie in them. The proxy relays the ones it passes
/// on as written, never building a map of them; a map of every field
/// (`HeaderName`s made, values checked, hashed and stored) was about a
/// tenth of a proxied request's instructions (BENCHMARKS.md §63).
#[derive(Debug, Clone)]
pub struct UpstreamFields {
    head: Bytes,
    spans: Vec<[u32; 4]>,
}

impl UpstreamFields {
    /// Each field's name and value, in the order they came (names in the
    /// upstream's case; both as httparse took them: a name of token
    /// characters, a value of visible bytes, tabs and obs-text, trimmed,
    /// the same bytes `HeaderName` and `HeaderValue` accept).
    pub fn iter(&self) -> impl Iterator<Item = (&[u8], &[u8])> {
        self.spans.iter().filter_map(|span| {
            let [name_start, name_end, value_start, value_end] = span.map(|n| n as usize);
            Some((self.head.get(name_start..name_end)?, self.head.get(value_start..value_end)?))
        })
    }

    /// `part` (a name or value from these fields) as shared bytes of
    /// the head, not copied; `None` for bytes from elsewhere.
    pub fn share(&self, part: &[u8]) -> Option<Bytes> {
        let start = (part.as_ptr() as usize).checked_sub(self.head.as_ptr() as usize)?;
        let end = start.checked_add(part.len())?;
        (end <= self.head.len()).then(|| self.head.slice(start..end))
    }

    /// The fields of `head` (a response head, whole), as [`exchange`] would
    /// take them apart: for tests of what is made of them.
    #[cfg(test)]
    pub(crate) fn of_head(head: &[u8]) -> Option<UpstreamFields> {
        let mut buf = BytesMut::from(head);
        match parse_head(&mut buf, true).ok()? {
            Parsed::Final(_, fields, _, _) => Some(fields),
            _ => None,
        }
    }

    /// The head's length in bytes (its fields and more: its start line).
    pub fn head_len(&self) -> usize {
        self.head.len()
    }

    /// The fields in a map, for what reads or writes only from one.
    pub fn to_map(&self) -> HeaderMap {
        let mut map = HeaderMap::with_capacity(self.spans.len());
        for span in &self.spans {
            let [name_start, name_end, value_start, value_end] = span.map(|n| n as usize);
            let (Some(name), Some(_)) = (self.head.get(name_start..name_end), self.head.get(value_start..value_end)) else {
                continue;
            };
            // httparse takes no name or value these refuse (see `iter`).
            if let (Ok(name), Ok(value)) = (
                HeaderName::from_bytes(name),
                HeaderValue::from_maybe_shared(self.head.slice(value_start..value_end)),
            ) {
                map.append(name, value);
            }
        }
        map
    }
}

/// Reads the response head at the start of `buf`, taking it off when whole.
fn parse_head(buf: &mut BytesMut, head_only: bool) -> Result<Parsed, Http1Error> {
    let mut fields = [const { MaybeUninit::<httparse::Header<'_>>::uninit() }; MAX_FIELDS];
    // Where each field's name and value lie in the head, to share its bytes.
    let mut spans = [[0u32; 4]; MAX_FIELDS];
    let mut response = httparse::Response::new(&mut []);
    let len = match httparse::ParserConfig::default().parse_response_with_uninit_headers(&mut response, buf, &mut fields) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() > MAX_RESPONSE_HEAD => return Err(Http1Error::HeadTooLarge),
        Ok(httparse::Status::Partial) => return Ok(Parsed::Partial),
        Err(httparse::Error::TooManyHeaders) => return Err(Http1Error::HeadTooLarge),
        Err(e) => return Err(Http1Error::Malformed(e)),
    };
    if len > MAX_RESPONSE_HEAD {
        return Err(Http1Error::HeadTooLarge);
    }
    let status = response
        .code
        .and_then(|code| StatusCode::from_u16(code).ok())
        .ok_or(Http1Error::Malformed(httparse::Error::Status))?;
    let version = match response.version {
        Some(1) => Version::HTTP_11,
        _ => Version::HTTP_10,
    };
    let reason = response
        .reason
        .filter(|r| Some(*r) != status.canonical_reason())
        .map(|r| Bytes::copy_from_slice(r.as_bytes()));
    let base = buf.as_ptr() as usize;
    let at = |s: &[u8]| u32::try_from((s.as_ptr() as usize).wrapping_sub(base)).unwrap_or(u32::MAX);
    let count = response.headers.len();
    for (span, field) in spans.iter_mut().zip(response.headers.iter()) {
        let name = at(field.name.as_bytes());
        let value = at(field.value);
        *span = [
            name,
            name.saturating_add(u32::try_from(field.name.len()).unwrap_or(u32::MAX)),
            value,
            value.saturating_add(u32::try_from(field.value.len()).unwrap_or(u32::MAX)),
        ];
    }
    let head = buf.split_to(len).freeze();
    // 100 Continue, 102, 103 Early Hints: hyper's client passes none on.
    if status.is_informational() && status != StatusCode::SWITCHING_PROTOCOLS {
        return Ok(Parsed::Interim);
    }
    if status == StatusCode::SWITCHING_PROTOCOLS {
        return Err(Http1Error::UnaskedSwitch);
    }
    let mut keep_alive = version == Version::HTTP_11;
    let mut said_close = false;
    // The framing fields, noted as they pass rather than looked up after.
    let mut length = Length::Absent;
    let mut chunked_last = None;
    let spans = spans.get(..count).unwrap_or_default().to_vec();
    for [name_start, name_end, value_start, value_end] in spans.iter().map(|span| span.map(|n| n as usize)) {
        let (Some(name), Some(value)) = (head.get(name_start..name_end), head.get(value_start..value_end)) else {
            return Err(Http1Error::Malformed(httparse::Error::HeaderName));
        };
        if name.eq_ignore_ascii_case(b"connection") {
            // Once one `Connection` line says close, a later keep-alive
            // does not undo it; an HTTP/1.0 answer is kept only when asked.
            if said_close || has_token_in(value, "close") {
                said_close = true;
                keep_alive = false;
            } else if !keep_alive {
                keep_alive = has_token_in(value, "keep-alive");
            }
        } else if name.eq_ignore_ascii_case(b"content-length") {
            length = length.and(value);
        } else if name.eq_ignore_ascii_case(b"transfer-encoding") {
            // Chunked only when it is the last coding of the last line.
            chunked_last = Some(
                visible(value)
                    && value
                        .rsplit(|b| *b == b',')
                        .next()
                        .is_some_and(|c| c.trim_ascii().eq_ignore_ascii_case(b"chunked")),
            );
        }
    }
    let decoder = decoder(status, version, head_only, chunked_last, length)?;
    let mut response = Response::new(());
    *response.status_mut() = status;
    *response.version_mut() = version;
    if let Some(reason) = reason.and_then(|r| hyper::ext::ReasonPhrase::try_from(r).ok()) {
        response.extensions_mut().insert(reason);
    }
    Ok(Parsed::Final(response, UpstreamFields { head, spans }, decoder, keep_alive))
}

/// Whether `value`'s comma-separated tokens hold `token` (in any case).
pub(crate) fn has_token(value: &HeaderValue, token: &str) -> bool {
    has_token_in(value.as_bytes(), token)
}

/// [`has_token`] of a value's bytes: a list is read only when it is
/// visible ASCII, as `HeaderValue::to_str` reads it.
pub(crate) fn has_token_in(value: &[u8], token: &str) -> bool {
    // Nearly every answer says `keep-alive` or `close` alone: one token,
    // told without splitting (asked for `close`, `keep-alive` went the
    // long way, BENCHMARKS.md §63).
    if !value.contains(&b',') {
        return value.trim_ascii().eq_ignore_ascii_case(token.as_bytes());
    }
    visible(value)
        && value
            .split(|b| *b == b',')
            .any(|t| t.trim_ascii().eq_ignore_ascii_case(token.as_bytes()))
}

/// Whether `value` is visible ASCII and tabs (what `HeaderValue::to_str` takes).
fn visible(value: &[u8]) -> bool {
    value.iter().all(|b| *b == b'\t' || (0x20..0x7f).contains(b))
}

/// What the `Content-Length` fields of a head came to, read as hyper's
/// client reads them: digits alone, values equal however repeated.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Length {
    Absent,
    Is(u64),
    /// Not a number, or values that differ.
    Invalid,
}

impl Length {
    /// What all of `values` come to.
    pub fn of<'a>(values: impl IntoIterator<Item = &'a HeaderValue>) -> Length {
        values.into_iter().fold(Length::Absent, |length, v| length.and(v.as_bytes()))
    }

    /// This and one more field's value (`n` or `n, n, ...`).
    pub fn and(self, value: &[u8]) -> Length {
        // Nearly every length is digits alone: read without splitting.
        if let Some(n) = digits(value) {
            return self.and_number(Some(n));
        }
        if !visible(value) {
            return Length::Invalid;
        }
        value
            .split(|b| *b == b',')
            .fold(self, |length, n| length.and_number(digits(n.trim_ascii())))
    }

    /// This and one more value (`None`: not a number).
    fn and_number(self, n: Option<u64>) -> Length {
        match (self, n) {
            (Length::Invalid, _) | (_, None) => Length::Invalid,
            (Length::Absent, Some(n)) => Length::Is(n),
            (Length::Is(l), Some(n)) if l == n => Length::Is(n),
            (Length::Is(_), Some(_)) => Length::Invalid,
        }
    }
}

/// How the body of an answer is framed, in the order of RFC 9112 §6.3:
/// `chunked_last` says whether the last transfer coding, if any, is
/// chunked.
fn decoder(
    status: StatusCode,
    version: Version,
    head_only: bool,
    chunked_last: Option<bool>,
    length: Length,
) -> Result<Decoder, Http1Error> {
    if matches!(status, StatusCode::NO_CONTENT | StatusCode::NOT_MODIFIED) || head_only {
        return Ok(Decoder::Length(0));
    }
    match (chunked_last, length) {
        (Some(_), _) if version == Version::HTTP_10 => Err(Http1Error::TransferEncoding10),
        (Some(true), _) => Ok(Decoder::Chunked(Chunked::default())),
        // Another coding last: the body runs to the connection's close.
        (Some(false), _) | (None, Length::Absent) => Ok(Decoder::Eof),
        // hyper keeps the two largest values for its own marks.
        (None, Length::Is(n)) if n <= u64::MAX.saturating_sub(2) => Ok(Decoder::Length(n)),
        (None, _) => Err(Http1Error::ContentLength),
    }
}

/// A decimal number of ASCII digits alone, if it fits in a u64.
fn digits(s: &[u8]) -> Option<u64> {
    if s.is_empty() {
        return None;
    }
    s.iter().try_fold(0u64, |n, b| match b {
        b'0'..=b'9' => n.checked_mul(10)?.checked_add(u64::from(b.wrapping_sub(b'0'))),
        _ => None,
    })
}

/// How much of a body is left, by its framing.
#[derive(Debug)]
enum Decoder {
    /// This many bytes (`Content-Length`).
    Length(u64),
    /// Chunks up to the last, then trailers.
    Chunked(Chunked),
    /// Everything until the connection closes.
    Eof,
    /// Read to its end.
    Done,
    /// Failed: nothing more is read.
    Failed,
}

/// Where a chunked body's reading stands.
#[derive(Debug, Default)]
struct Chunked {
    state: ChunkState,
    /// The size being read, then what is left of the chunk.
    size: u64,
    /// Extension bytes seen in the whole body.
    extension_bytes: u64,
    /// The trailer section as read, with its count of lines.
    trailers: Option<BytesMut>,
    trailer_lines: usize,
}

/// The chunked grammar (RFC 9112 §7.1), one state per place in it.
#[derive(Debug, Default, Clone, Copy, PartialEq)]
enum ChunkState {
    #[default]
    Start,
    Size,
    SizeSpace,
    Extension,
    SizeLf,
    Data,
    DataCr,
    DataLf,
    Trailer,
    TrailerLf,
    EndCr,
    EndLf,
    End,
}

impl Chunked {
    /// Reads framing from `buf` until a piece of data, the end or an error;
    /// `Ok(None)` when `buf` ran out first, [`Step::Busy`] once `budget`
    /// framing bytes have been read.
    fn step(&mut self, buf: &mut BytesMut, budget: &mut usize) -> Result<Option<Step>, BodyFailed> {
        use ChunkState::*;
        loop {
            if self.state == End {
                return Ok(Some(Step::End));
            }
            if self.state == Data {
                if buf.is_empty() {
                    return Ok(None);
                }
                let n = usize::try_from(self.size).unwrap_or(usize::MAX).min(buf.len());
                self.size = self.size.saturating_sub(n as u64);
                if self.size == 0 {
                    self.state = DataCr;
                }
                return Ok(Some(Step::Data(buf.split_to(n).freeze())));
            }
            let Some(&byte) = buf.first() else { return Ok(None) };
            let Some(left) = budget.checked_sub(1) else { return Ok(Some(Step::Busy)) };
            *budget = left;
            buf.advance(1);
            self.state = match (self.state, byte) {
                (Start | Size, b'0'..=b'9' | b'a'..=b'f' | b'A'..=b'F') => {
                    let digit = match byte {
                        b'0'..=b'9' => byte.wrapping_sub(b'0'),
                        b'a'..=b'f' => byte.wrapping_sub(b'a').wrapping_add(10),
                        _ => byte.wrapping_sub(b'A').wrapping_add(10),
                    };
                    self.size = self
                        .size
                        .checked_mul(16)
                        .and_then(|s| s.checked_add(u64::from(digit)))
                        .ok_or(BodyFailed::Chunk("chunk size overflows"))?;
                    Size
                }
                (Start, _) => return Err(BodyFailed::Chunk("missing chunk size")),
                (Size | SizeSpace, b'\t' | b' ') => SizeSpace,
                (Size | SizeSpace, b';') => Extension,
                (Size | SizeSpace, b'\r') => SizeLf,
                (Size | SizeSpace, _) => return Err(BodyFailed::Chunk("invalid chunk size")),
                (Extension, b'\r') => SizeLf,
                (Extension, b'\n') => return Err(BodyFailed::Chunk("chunk extension contains a newline")),
                (Extension, _) => {
                    self.extension_bytes = self.extension_bytes.saturating_add(1);
                    if self.extension_bytes >= MAX_EXTENSION_BYTES {
                        return Err(BodyFailed::Chunk("chunk extensions over 16 KB"));
                    }
                    Extension
                }
                (SizeLf, b'\n') if self.size == 0 => EndCr,
                (SizeLf, b'\n') => Data,
                (SizeLf, _) => return Err(BodyFailed::Chunk("chunk size line without LF")),
                (DataCr, b'\r') => DataLf,
                (DataCr, _) => return Err(BodyFailed::Chunk("chunk data without CR after it")),
                (DataLf, b'\n') => Start,
                (DataLf, _) => return Err(BodyFailed::Chunk("chunk data without LF after it")),
                (EndCr, b'\r') => {
                    if let Some(trailers) = &mut self.trailers {
                        push_trailer(trailers, byte)?;
                    }
                    EndLf
                }
                (EndCr, _) => {
                    push_trailer(self.trailers.get_or_insert_with(|| BytesMut::with_capacity(64)), byte)?;
                    Trailer
                }
                (Trailer, _) => {
                    if let Some(trailers) = &mut self.trailers {
                        push_trailer(trailers, byte)?;
                    }
                    if byte == b'\r' { TrailerLf } else { Trailer }
                }
                (TrailerLf, b'\n') => {
                    if self.trailer_lines >= MAX_FIELDS {
                        return Err(BodyFailed::Trailers("more than 100 trailer fields"));
                    }
                    self.trailer_lines = self.trailer_lines.saturating_add(1);
                    if let Some(trailers) = &mut self.trailers {
                        push_trailer(trailers, byte)?;
                    }
                    EndCr
                }
                (TrailerLf, _) => return Err(BodyFailed::Chunk("trailer line without LF")),
                (EndLf, b'\n') => {
                    if let Some(trailers) = &mut self.trailers {
                        push_trailer(trailers, byte)?;
                    }
                    End
                }
                (EndLf, _) => return Err(BodyFailed::Chunk("last chunk without LF after it")),
                (Data | End, _) => return Err(BodyFailed::Chunk("unreachable chunk state")),
            };
        }
    }

    /// The trailers read, as fields.
    fn trailer_fields(&mut self) -> Result<Option<HeaderMap>, BodyFailed> {
        let Some(section) = self.trailers.take() else { return Ok(None) };
        let mut fields = vec![httparse::EMPTY_HEADER; self.trailer_lines];
        match httparse::parse_headers(&section, &mut fields) {
            Ok(httparse::Status::Complete((_, fields))) => {
                let mut trailers = HeaderMap::with_capacity(fields.len());
                for field in fields {
                    let name =
                        HeaderName::from_bytes(field.name.as_bytes()).map_err(|_| BodyFailed::Trailers("invalid field name"))?;
                    let value = HeaderValue::from_bytes(field.value).map_err(|_| BodyFailed::Trailers("invalid field value"))?;
                    trailers.append(name, value);
                }
                Ok(Some(trailers))
            }
            Ok(httparse::Status::Partial) => Err(BodyFailed::Trailers("incomplete trailer section")),
            Err(_) => Err(BodyFailed::Trailers("malformed trailer section")),
        }
    }
}

/// Adds a byte to the trailer section, within the bound on a head.
fn push_trailer(trailers: &mut BytesMut, byte: u8) -> Result<(), BodyFailed> {
    if trailers.len() >= MAX_RESPONSE_HEAD {
        return Err(BodyFailed::Trailers("trailers larger than 64 KB"));
    }
    trailers.put_u8(byte);
    Ok(())
}

/// What a step through chunked framing came to.
enum Step {
    Data(Bytes),
    End,
    /// The poll's share of framing was read: time to yield.
    Busy,
}

/// An answer's body, read from its connection as it is polled.
pub struct ResponseBody<T> {
    /// The connection, until the body fails or its connection is taken back.
    io: Option<T>,
    /// Bytes read and not yet handed on.
    buf: BytesMut,
    decoder: Decoder,
    /// Whether the answer lets the connection carry another request.
    keep_alive: bool,
    /// The answer's version, which the next request on the connection speaks.
    version: Version,
    /// Room given to the next read.
    read_size: usize,
    /// The answer's header fields, until taken.
    fields: Option<UpstreamFields>,
    /// The fields as the proxy relays them, for the server, until taken.
    written: Option<crate::serve::WrittenFields>,
}

impl<T> ResponseBody<T> {
    /// The answer's header fields (`None` once taken): the response's own
    /// map is empty.
    pub fn take_fields(&mut self) -> Option<UpstreamFields> {
        self.fields.take()
    }

    /// Keeps the fields as relayed, for the server.
    pub fn carry(&mut self, written: crate::serve::WrittenFields) {
        self.written = Some(written);
    }

    /// The fields as relayed (`None` once taken).
    pub fn take_written(&mut self) -> Option<crate::serve::WrittenFields> {
        self.written.take()
    }
}

impl<T: AsyncRead + Unpin> ResponseBody<T> {
    /// The connection, once the body has been read to its end and the
    /// connection may carry the next request (kept alive, nothing read past
    /// the answer: bytes the upstream sent unasked make it unfit), with the
    /// version the upstream answered in, for [`exchange`]'s `peer`.
    pub fn reusable(&mut self) -> Option<(T, Version)> {
        let done = matches!(self.decoder, Decoder::Done | Decoder::Length(0));
        let io = (done && self.keep_alive && self.buf.is_empty()).then(|| self.io.take()).flatten()?;
        Some((io, self.version))
    }

    /// Fails the body: its connection is closed, nothing more is read.
    fn fail(&mut self, e: BodyFailed) -> Poll<Option<Result<Frame<Bytes>, BodyFailed>>> {
        self.decoder = Decoder::Failed;
        self.io = None;
        Poll::Ready(Some(Err(e)))
    }
}

/// Reads what the connection has into `buf`: `Ok(0)` at its end.
fn poll_fill<T: AsyncRead + Unpin>(
    io: &mut Option<T>,
    buf: &mut BytesMut,
    read_size: &mut usize,
    cx: &mut Context<'_>,
) -> Poll<io::Result<usize>> {
    let Some(io) = io else { return Poll::Ready(Ok(0)) };
    if buf.capacity().saturating_sub(buf.len()) < *read_size / 2 {
        buf.reserve(*read_size);
    }
    let room = buf.capacity().saturating_sub(buf.len());
    let n = ready!(pin!(io.read_buf(buf)).poll(cx))?;
    // A read that filled its room says more is waiting: give the next more.
    if n >= room && *read_size < MOST_READ {
        *read_size = read_size.saturating_mul(2);
    }
    Poll::Ready(Ok(n))
}

impl<T: AsyncRead + Unpin> Body for ResponseBody<T> {
    type Data = Bytes;
    type Error = BodyFailed;

    fn poll_frame(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyFailed>>> {
        let this = self.get_mut();
        let mut budget = FRAMING_PER_POLL;
        loop {
            match &mut this.decoder {
                Decoder::Done | Decoder::Failed => return Poll::Ready(None),
                Decoder::Length(0) => {
                    this.decoder = Decoder::Done;
                    return Poll::Ready(None);
                }
                Decoder::Length(rest) => {
                    if this.buf.is_empty() {
                        match ready!(poll_fill(&mut this.io, &mut this.buf, &mut this.read_size, cx)) {
                            Ok(0) => return this.fail(BodyFailed::Incomplete),
                            Ok(_) => {}
                            Err(e) => return this.fail(e.into()),
                        }
                        continue;
                    }
                    let n = usize::try_from(*rest).unwrap_or(usize::MAX).min(this.buf.len());
                    *rest = rest.saturating_sub(n as u64);
                    if *rest == 0 {
                        this.decoder = Decoder::Done;
                    }
                    return Poll::Ready(Some(Ok(Frame::data(this.buf.split_to(n).freeze()))));
                }
                Decoder::Eof => {
                    if !this.buf.is_empty() {
                        return Poll::Ready(Some(Ok(Frame::data(this.buf.split().freeze()))));
                    }
                    match ready!(poll_fill(&mut this.io, &mut this.buf, &mut this.read_size, cx)) {
                        Ok(0) => {
                            this.decoder = Decoder::Done;
                            this.keep_alive = false;
                            this.io = None;
                            return Poll::Ready(None);
                        }
                        Ok(_) => {}
                        Err(e) => return this.fail(e.into()),
                    }
                }
                Decoder::Chunked(chunked) => match chunked.step(&mut this.buf, &mut budget) {
                    Ok(Some(Step::Busy)) => {
                        cx.waker().wake_by_ref();
                        return Poll::Pending;
                    }
                    Ok(Some(Step::Data(data))) => return Poll::Ready(Some(Ok(Frame::data(data)))),
                    Ok(Some(Step::End)) => {
                        let trailers = chunked.trailer_fields();
                        this.decoder = Decoder::Done;
                        match trailers {
                            Ok(Some(trailers)) => return Poll::Ready(Some(Ok(Frame::trailers(trailers)))),
                            Ok(None) => return Poll::Ready(None),
                            Err(e) => return this.fail(e),
                        }
                    }
                    Ok(None) => match ready!(poll_fill(&mut this.io, &mut this.buf, &mut this.read_size, cx)) {
                        Ok(0) => return this.fail(BodyFailed::Incomplete),
                        Ok(_) => {}
                        Err(e) => return this.fail(e.into()),
                    },
                    Err(e) => return this.fail(e),
                },
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        // A failed body has no end: it was cut.
        matches!(self.decoder, Decoder::Done | Decoder::Length(0))
    }

    fn size_hint(&self) -> SizeHint {
        match self.decoder {
            Decoder::Length(n) => SizeHint::with_exact(n),
            Decoder::Done => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

#[cfg(test)]
mod tests {
    //! hyper's HTTP/1.1 client is the reference: each case runs the same
    //! two requests against the same scripted upstream (answers cut into
    //! writes at random places) through hyper's client and ours, and both
    //! must send the same bytes and read the same answers, fail where the
    //! other fails, and agree on whether the connection can carry the next
    //! request.

    use super::*;
    use http_body_util::{BodyExt, Empty};
    use hyper_util::rt::TokioIo;
    use proptest::prelude::*;
    use std::io::Write as _;
    use std::time::Duration;
    use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};

    /// How an answer's body is framed on the wire.
    #[derive(Debug, Clone)]
    enum Framing {
        Length,
        /// Declared this much off the body's length (more: the body is cut).
        LengthOff(i8),
        /// `Content-Length: n, n`.
        LengthList,
        /// Two `Content-Length` lines, equal or not.
        LengthTwice(bool),
        LengthBad(&'static str),
        Chunked {
            sizes: Vec<usize>,
            extension: bool,
            upper: bool,
            trailers: Vec<(String, String)>,
            coding: &'static str,
        },
        /// Chunked, with one byte of the encoding replaced.
        ChunkedBroken(usize, u8),
        /// `chunked, gzip`: read to the close.
        CodingNotLast,
        ChunkedAndLength,
        /// Neither: read to the close.
        Unframed,
    }

    #[derive(Debug, Clone)]
    struct Answer {
        interim: Option<&'static str>,
        version: &'static str,
        status: u16,
        /// `None`: the status's canonical reason.
        reason: Option<&'static str>,
        fields: Vec<(String, Vec<u8>)>,
        connection: Option<&'static str>,
        framing: Framing,
        body: Vec<u8>,
        /// Bytes left off the end, the connection then closed.
        cut: Option<usize>,
        /// Whether the upstream closes the connection after this answer.
        close: bool,
        /// Where the upstream's writes pause.
        pauses: Vec<usize>,
    }

    fn chunked(body: &[u8], sizes: &[usize], extension: bool, upper: bool, trailers: &[(String, String)]) -> Vec<u8> {
        let mut w = Vec::new();
        let mut rest = body;
        let mut i = 0;
        while !rest.is_empty() {
            let n = sizes.get(i % sizes.len().max(1)).copied().unwrap_or(7).clamp(1, rest.len());
            let (chunk, after) = rest.split_at(n);
            if upper {
                write!(w, "{n:X}").unwrap();
            } else {
                write!(w, "{n:x}").unwrap();
            }
            if extension {
                w.extend_from_slice(b";name=value");
            }
            w.extend_from_slice(b"\r\n");
            w.extend_from_slice(chunk);
            w.extend_from_slice(b"\r\n");
            rest = after;
            i += 1;
        }
        w.extend_from_slice(b"0\r\n");
        for (name, value) in trailers {
            write!(w, "{name}: {value}\r\n").unwrap();
        }
        w.extend_from_slice(b"\r\n");
        w
    }

    impl Answer {
        fn wire(&self) -> Vec<u8> {
            let mut w = Vec::new();
            if let Some(interim) = self.interim {
                w.extend_from_slice(interim.as_bytes());
            }
            let canonical = StatusCode::from_u16(self.status).ok().and_then(|s| s.canonical_reason());
            let reason = self.reason.or(canonical).unwrap_or("Whatever");
            write!(w, "{} {} {}\r\n", self.version, self.status, reason).unwrap();
            for (name, value) in &self.fields {
                w.extend_from_slice(name.as_bytes());
                w.extend_from_slice(b": ");
                w.extend_from_slice(value);
                w.extend_from_slice(b"\r\n");
            }
            if let Some(connection) = self.connection {
                write!(w, "Connection: {connection}\r\n").unwrap();
            }
            let len = self.body.len();
            let body = match &self.framing {
                Framing::Length => {
                    write!(w, "Content-Length: {len}\r\n").unwrap();
                    self.body.clone()
                }
                Framing::LengthOff(off) => {
                    write!(w, "Content-Length: {}\r\n", (len as i64 + i64::from(*off)).max(0)).unwrap();
                    self.body.clone()
                }
                Framing::LengthList => {
                    write!(w, "Content-Length: {len}, {len}\r\n").unwrap();
                    self.body.clone()
                }
                Framing::LengthTwice(equal) => {
                    let other = if *equal { len } else { len + 1 };
                    write!(w, "Content-Length: {len}\r\ncontent-length: {other}\r\n").unwrap();
                    self.body.clone()
                }
                Framing::LengthBad(value) => {
                    write!(w, "Content-Length: {value}\r\n").unwrap();
                    self.body.clone()
                }
                Framing::Chunked {
                    sizes,
                    extension,
                    upper,
                    trailers,
                    coding,
                } => {
                    write!(w, "Transfer-Encoding: {coding}\r\n").unwrap();
                    chunked(&self.body, sizes, *extension, *upper, trailers)
                }
                Framing::ChunkedBroken(at, byte) => {
                    w.extend_from_slice(b"Transfer-Encoding: chunked\r\n");
                    let mut body = chunked(&self.body, &[5], false, false, &[]);
                    let at = at % body.len();
                    body[at] = *byte;
                    body
                }
                Framing::CodingNotLast => {
                    w.extend_from_slice(b"Transfer-Encoding: chunked, gzip\r\n");
                    self.body.clone()
                }
                Framing::ChunkedAndLength => {
                    w.extend_from_slice(b"Transfer-Encoding: chunked\r\nContent-Length: 3\r\n");
                    chunked(&self.body, &[4], false, false, &[])
                }
                Framing::Unframed => self.body.clone(),
            };
            w.extend_from_slice(b"\r\n");
            w.extend_from_slice(&body);
            if let Some(cut) = self.cut {
                w.truncate(w.len().saturating_sub(cut));
            }
            w
        }
    }

    fn framing() -> impl Strategy<Value = Framing> {
        prop_oneof![
            4 => Just(Framing::Length),
            1 => (-3i8..3).prop_map(Framing::LengthOff),
            1 => Just(Framing::LengthList),
            1 => any::<bool>().prop_map(Framing::LengthTwice),
            1 => prop::sample::select(vec!["abc", "+5", "-1", "", "1 2", "18446744073709551615", "99999999999999999999"]).prop_map(Framing::LengthBad),
            4 => (
                prop::collection::vec(1usize..40, 1..4),
                any::<bool>(),
                any::<bool>(),
                prop::collection::vec(("x-[a-z]{1,5}", "[ -~]{0,12}"), 0..3),
                prop::sample::select(vec!["chunked", "Chunked", "gzip, chunked", "gzip,chunked "]),
            )
                .prop_map(|(sizes, extension, upper, trailers, coding)| Framing::Chunked {
                    sizes,
                    extension,
                    upper,
                    trailers: trailers.into_iter().map(|(n, v)| (n, v.trim().to_string())).collect(),
                    coding,
                }),
            2 => (any::<usize>(), prop::sample::select(vec![b'\n', b'\r', b'x', b' ', b';', b'0', b'F', 0u8])).prop_map(|(at, b)| Framing::ChunkedBroken(at, b)),
            1 => Just(Framing::CodingNotLast),
            1 => Just(Framing::ChunkedAndLength),
            1 => Just(Framing::Unframed),
        ]
    }

    fn answer() -> impl Strategy<Value = Answer> {
        (
            (
                prop::option::weighted(0.15, prop::sample::select(vec!["HTTP/1.1 100 Continue\r\n\r\n", "HTTP/1.1 103 Early Hints\r\nLink: </a.css>\r\n\r\n"])),
                prop::sample::select(vec!["HTTP/1.1", "HTTP/1.1", "HTTP/1.1", "HTTP/1.0"]),
                prop::sample::select(vec![200u16, 200, 201, 204, 206, 304, 404, 500, 599, 999]),
                prop::option::weighted(0.2, prop::sample::select(vec!["", "Fine", "OK but not quite", "D\u{e9}j\u{e0} vu"])),
            ),
            prop::collection::vec(
                (
                    "(x-[a-z]{1,6}|set-cookie|cache-control|X-Mixed-Case)",
                    prop::collection::vec(prop_oneof![0x20u8..0x7f, 0x80u8..=0xff, Just(b'\t')], 0..24),
                ),
                0..5,
            ),
            prop::option::weighted(0.3, prop::sample::select(vec!["close", "keep-alive", "Keep-Alive, Upgrade", "CLOSE", "upgrade", "keep-alive,close", "te , Close", "closed", "keep-alive-ish"])),
            framing(),
            prop::collection::vec(any::<u8>(), 0..120),
            (prop::option::weighted(0.1, 1usize..30), prop::bool::weighted(0.1), prop::collection::vec(any::<usize>(), 0..4)),
        )
            .prop_map(|((interim, version, status, reason), fields, connection, framing, body, (cut, close, pauses))| {
                // A value cannot start or end with white space on the
                // wire: httparse trims it, and the comparison would be
                // of the trimming.
                let fields = fields
                    .into_iter()
                    .map(|(n, v)| (n, v.trim_ascii().to_vec()))
                    .collect();
                Answer {
                    interim,
                    version,
                    status,
                    reason,
                    fields,
                    connection,
                    framing,
                    body,
                    cut,
                    close,
                    pauses,
                }
            })
    }

    /// A request as the proxy sends one (no body), in parts to make twice.
    #[derive(Debug, Clone)]
    struct Asked {
        method: &'static str,
        target: String,
        fields: Vec<(String, Vec<u8>)>,
    }

    impl Asked {
        fn request(&self) -> Request<Empty<Bytes>> {
            let mut req = Request::builder().method(self.method).uri(&self.target);
            for (name, value) in &self.fields {
                req = req.header(name, HeaderValue::from_bytes(value).unwrap());
            }
            req.body(Empty::new()).unwrap()
        }
    }

    fn asked() -> impl Strategy<Value = Asked> {
        (
            prop::sample::select(vec!["GET", "GET", "HEAD", "DELETE", "OPTIONS"]),
            "/[a-z0-9/._~%-]{0,20}(\\?[a-z0-9=&%]{0,12})?",
            prop::collection::vec(
                (
                    // No Transfer-Encoding: the proxy strips it (and
                    // hyper's removal of it reorders the other fields).
                    "(host|accept|x-[a-z]{1,6}|content-length|te|x-forwarded-for)",
                    prop::collection::vec(prop_oneof![0x21u8..0x7f, 0x80u8..=0xff], 0..20),
                ),
                0..6,
            ),
        )
            .prop_map(|(method, target, fields)| Asked { method, target, fields })
    }

    /// What a client made of one exchange.
    #[derive(Debug, PartialEq)]
    enum Outcome {
        /// No response head.
        Failed,
        /// Nothing within the patience (a body read to a close that never comes).
        Hung,
        Answered {
            status: u16,
            version: Version,
            reason: Option<Vec<u8>>,
            fields: Vec<(String, Vec<u8>)>,
            body: Vec<u8>,
            trailers: Option<Vec<(String, Vec<u8>)>>,
            body_failed: bool,
            /// Whether the connection then carries the next request.
            reused: bool,
        },
    }

    const PATIENCE: Duration = Duration::from_secs(30);

    fn fields(headers: &HeaderMap) -> Vec<(String, Vec<u8>)> {
        headers.iter().map(|(n, v)| (n.as_str().to_string(), v.as_bytes().to_vec())).collect()
    }

    /// A body as read to its end, its failure or the patience.
    struct Read {
        data: Vec<u8>,
        trailers: Option<Vec<(String, Vec<u8>)>>,
        failed: bool,
        hung: bool,
    }

    async fn read_body<B>(body: &mut B) -> Read
    where
        B: Body<Data = Bytes> + Unpin,
    {
        let mut read = Read {
            data: Vec::new(),
            trailers: None,
            failed: false,
            hung: false,
        };
        loop {
            match tokio::time::timeout(PATIENCE, body.frame()).await {
                Err(_) => read.hung = true,
                Ok(None) => {}
                Ok(Some(Err(_))) => read.failed = true,
                Ok(Some(Ok(frame))) => {
                    match frame.into_data() {
                        Ok(d) => read.data.extend_from_slice(&d),
                        Err(frame) => read.trailers = frame.into_trailers().ok().map(|t| fields(&t)),
                    }
                    continue;
                }
            }
            return read;
        }
    }

    fn answered<B>(head: &Response<B>, read: Read, reused: bool) -> Outcome {
        Outcome::Answered {
            status: head.status().as_u16(),
            version: head.version(),
            reason: head.extensions().get::<hyper::ext::ReasonPhrase>().map(|r| r.as_bytes().to_vec()),
            fields: fields(head.headers()),
            body: read.data,
            trailers: read.trailers,
            body_failed: read.failed,
            reused,
        }
    }

    /// The scripted upstream: reads each request's head, writes its answer
    /// in pieces, closes when told. Returns the request heads it read.
    async fn upstream(mut io: DuplexStream, answers: Vec<Answer>) -> Vec<Vec<u8>> {
        let mut heads = Vec::new();
        let mut buf = Vec::new();
        for answer in answers {
            loop {
                if let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    heads.push(buf.drain(..end + 4).collect());
                    break;
                }
                let mut chunk = [0u8; 4096];
                match io.read(&mut chunk).await {
                    Ok(0) | Err(_) => return heads,
                    Ok(n) => buf.extend_from_slice(&chunk[..n]),
                }
            }
            let wire = answer.wire();
            let mut stops: Vec<usize> = answer.pauses.iter().map(|p| p % (wire.len() + 1)).collect();
            stops.sort_unstable();
            stops.push(wire.len());
            let mut from = 0;
            for to in stops {
                if to > from {
                    if io.write_all(&wire[from..to]).await.is_err() {
                        return heads;
                    }
                    from = to;
                }
                for _ in 0..4 {
                    tokio::task::yield_now().await;
                }
            }
            if answer.close || answer.cut.is_some() {
                return heads;
            }
        }
        heads
    }

    /// Lets every task run until none can.
    async fn settle() {
        for _ in 0..32 {
            tokio::task::yield_now().await;
        }
    }

    /// An answer read whole (its head, body and how the body was read),
    /// or what a client came to without a head.
    async fn answer_to<B, E>(exchange: impl Future<Output = Result<Response<B>, E>>) -> Result<(http::response::Parts, B, Read), Outcome>
    where
        B: Body<Data = Bytes> + Unpin,
    {
        let (head, mut body) = match tokio::time::timeout(PATIENCE, exchange).await {
            Err(_) => return Err(Outcome::Hung),
            Ok(Err(_)) => return Err(Outcome::Failed),
            Ok(Ok(response)) => response.into_parts(),
        };
        let read = read_body(&mut body).await;
        Ok((head, body, read))
    }

    async fn by_hyper(asked: &[Asked], answers: Vec<Answer>) -> (Vec<Outcome>, Vec<Vec<u8>>) {
        let (client, server) = tokio::io::duplex(1 << 20);
        let upstream = tokio::spawn(upstream(server, answers));
        let (mut send, conn) = hyper::client::conn::http1::Builder::new()
            .max_header_size(MAX_RESPONSE_HEAD)
            .handshake::<_, Empty<Bytes>>(TokioIo::new(client))
            .await
            .unwrap();
        tokio::spawn(conn);
        let mut outcomes = Vec::new();
        for asked in asked {
            let exchange = send.send_request(asked.request());
            let Ok((head, body, read)) = answer_to(exchange).await.map_err(|o| outcomes.push(o)) else { break };
            let hung = read.hung;
            drop(body);
            settle().await;
            let reused = !hung && !send.is_closed() && send.is_ready();
            outcomes.push(if hung { Outcome::Hung } else { answered(&Response::from_parts(head, ()), read, reused) });
            if !reused {
                break;
            }
        }
        drop(send);
        let heads = tokio::time::timeout(PATIENCE, upstream).await.unwrap().unwrap();
        (outcomes, heads)
    }

    /// Whether nothing has come on a connection: no bytes, no close.
    fn quiet(io: &mut DuplexStream) -> bool {
        let mut cx = Context::from_waker(std::task::Waker::noop());
        let mut byte = [0u8; 1];
        let mut read = tokio::io::ReadBuf::new(&mut byte);
        Pin::new(io).poll_read(&mut cx, &mut read).is_pending()
    }

    async fn by_ours(asked: &[Asked], answers: Vec<Answer>) -> (Vec<Outcome>, Vec<Vec<u8>>) {
        let (client, server) = tokio::io::duplex(1 << 20);
        let upstream = tokio::spawn(upstream(server, answers));
        let mut io = Some((client, Version::HTTP_11));
        let mut outcomes = Vec::new();
        for asked in asked {
            let Some((conn, peer)) = io.take() else { break };
            let request = asked.request();
            let Ok((head, mut body, read)) = answer_to(exchange(conn, &request, None, peer)).await.map_err(|o| outcomes.push(o)) else { break };
            let hung = read.hung;
            settle().await;
            io = body.reusable().filter(|_| !hung);
            if let Some((conn, _)) = &mut io
                && !quiet(conn)
            {
                io = None;
            }
            // The fields come apart from the head, as they came.
            let mut head = head;
            assert!(head.headers.is_empty());
            head.headers = body.take_fields().expect("an answer's fields").to_map();
            drop(body);
            outcomes.push(if hung { Outcome::Hung } else { answered(&Response::from_parts(head, ()), read, io.is_some()) });
            if io.is_none() {
                break;
            }
        }
        drop(io);
        let heads = tokio::time::timeout(PATIENCE, upstream).await.unwrap().unwrap();
        (outcomes, heads)
    }

    fn paused_runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap()
    }

    /// Our client's answer to one request on a connection whose upstream
    /// sends `wire` and then closes.
    async fn one(wire: &[u8], method: &str) -> Result<Response<ResponseBody<DuplexStream>>, Http1Error> {
        let (client, mut server) = tokio::io::duplex(1 << 20);
        let wire = wire.to_vec();
        tokio::spawn(async move {
            let mut head = [0u8; 4096];
            let _ = server.read(&mut head).await;
            let _ = server.write_all(&wire).await;
        });
        let asked = Asked {
            method: match method {
                "HEAD" => "HEAD",
                _ => "GET",
            },
            target: "/".into(),
            fields: Vec::new(),
        };
        exchange(client, &asked.request(), None, Version::HTTP_11).await
    }

    #[test]
    fn written_fields_go_out_as_given_and_an_http10_peer_is_asked_to_keep_alive() {
        let req = Request::get("/a?b").body(Empty::<Bytes>::new()).unwrap();
        let fields = b"host: api\r\nx-forwarded-for: 10.0.0.1\r\n";
        assert_eq!(
            request_head(&req, Some(fields), false),
            b"GET /a?b HTTP/1.1\r\nhost: api\r\nx-forwarded-for: 10.0.0.1\r\n\r\n"
        );
        assert_eq!(
            request_head(&req, Some(fields), true),
            b"GET /a?b HTTP/1.0\r\nhost: api\r\nx-forwarded-for: 10.0.0.1\r\nconnection: keep-alive\r\n\r\n"
        );
    }

    #[test]
    fn a_token_is_one_of_the_comma_separated_values_in_any_case() {
        let value = |v: &'static str| HeaderValue::from_static(v);
        for (v, close) in [
            ("close", true),
            ("Close", true),
            ("\tclose ", true),
            ("keep-alive, close", true),
            ("te,CLOSE", true),
            ("keep-alive", false),
            ("closed", false),
            ("close-ish", false),
            ("", false),
            ("clo se", false),
        ] {
            assert_eq!(has_token(&value(v), "close"), close, "{v:?}");
        }
        let lengths = |vs: &[&'static str]| Length::of(vs.iter().map(|v| value(v)).collect::<Vec<_>>().iter());
        assert_eq!(lengths(&["5"]), Length::Is(5));
        assert_eq!(lengths(&["0005"]), Length::Is(5));
        assert_eq!(lengths(&["5, 5", "5"]), Length::Is(5));
        assert_eq!(lengths(&["5", "6"]), Length::Invalid);
        assert_eq!(lengths(&["5, 6"]), Length::Invalid);
        assert_eq!(lengths(&["+5"]), Length::Invalid);
        assert_eq!(lengths(&["18446744073709551616"]), Length::Invalid);
        assert_eq!(lengths(&[]), Length::Absent);
    }

    #[tokio::test]
    async fn a_request_with_a_body_or_a_protocol_switch_is_left_to_hyper() {
        let plain = Request::get("/a?b").body(Empty::<Bytes>::new()).unwrap();
        assert!(fits(&plain));
        let with_body = Request::post("/a").body(http_body_util::Full::new(Bytes::from_static(b"x"))).unwrap();
        assert!(!fits(&with_body));
        let switching = Request::get("/ws").header("upgrade", "websocket").body(Empty::<Bytes>::new()).unwrap();
        assert!(!fits(&switching));
        let connect = Request::connect("example.com:443").body(Empty::<Bytes>::new()).unwrap();
        assert!(!fits(&connect));
        let absolute = Request::get("http://example.com/").body(Empty::<Bytes>::new()).unwrap();
        assert!(!fits(&absolute));
    }

    #[tokio::test]
    async fn a_head_past_64_kb_an_unasked_switch_and_a_cut_head_fail_the_exchange() {
        let mut big = b"HTTP/1.1 200 OK\r\n".to_vec();
        while big.len() <= MAX_RESPONSE_HEAD {
            big.extend_from_slice(b"x-filler: 0123456789012345678901234567890123456789\r\n");
        }
        big.extend_from_slice(b"content-length: 0\r\n\r\n");
        assert!(matches!(one(&big, "GET").await, Err(Http1Error::HeadTooLarge)));
        let switch = b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n";
        assert!(matches!(one(switch, "GET").await, Err(Http1Error::UnaskedSwitch)));
        // A connection ended before a whole head may have an idempotent
        // request sent again elsewhere, as NGINX does; a whole head that is
        // wrong is the upstream's answer.
        let cut = one(b"HTTP/1.1 200 OK\r\ncontent-le", "GET").await.err().unwrap();
        assert!(matches!(cut, Http1Error::CutHead) && cut.head_lost(), "{cut}");
        let silent = one(b"", "GET").await.err().unwrap();
        assert!(matches!(silent, Http1Error::Unanswered(None)) && silent.head_lost(), "{silent}");
        let interim = one(b"HTTP/1.1 100 Continue\r\n\r\n", "GET").await.err().unwrap();
        assert!(interim.head_lost(), "{interim}");
        let malformed = one(b"HTTP/1.1 200 OK\r\nbad name: x\r\n\r\n", "GET").await.err().unwrap();
        assert!(matches!(malformed, Http1Error::Malformed(_)) && !malformed.head_lost(), "{malformed}");
        assert!(!Http1Error::HeadTooLarge.head_lost() && !Http1Error::UnaskedSwitch.head_lost());
        // A 100 Continue before the answer is passed over, as hyper does.
        let continued = one(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok", "GET").await.unwrap();
        assert_eq!(continued.status(), StatusCode::OK);
    }

    #[tokio::test]
    async fn trailers_past_64_kb_fail_the_body() {
        let mut wire = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n".to_vec();
        for i in 0..90 {
            wire.extend_from_slice(format!("x-t{i}: {}\r\n", "v".repeat(800)).as_bytes());
        }
        wire.extend_from_slice(b"\r\n");
        let (_, mut body) = one(&wire, "GET").await.unwrap().into_parts();
        let read = read_body(&mut body).await;
        assert_eq!((read.data.as_slice(), read.failed), (&b"ok"[..], true));
        assert!(body.reusable().is_none());
    }

    /// README: trailers of more than 100 fields cut the response (hyper's
    /// bound), and an interim head of more than 100 fields fails the
    /// exchange, though it is not passed on.
    #[tokio::test]
    async fn more_than_100_trailer_or_interim_fields_fail_at_100_they_pass() {
        for (fields, fails) in [(100, false), (101, true)] {
            let mut wire = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n".to_vec();
            for i in 0..fields {
                wire.extend_from_slice(format!("x-t{i}: v\r\n").as_bytes());
            }
            wire.extend_from_slice(b"\r\n");
            let (_, mut body) = one(&wire, "GET").await.unwrap().into_parts();
            let read = read_body(&mut body).await;
            assert_eq!((read.data.as_slice(), read.failed), (&b"ok"[..], fails), "{fields} trailer fields");
            let mut wire = b"HTTP/1.1 103 Early Hints\r\n".to_vec();
            for i in 0..fields {
                wire.extend_from_slice(format!("link: </{i}.css>\r\n").as_bytes());
            }
            wire.extend_from_slice(b"\r\nHTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok");
            assert_eq!(one(&wire, "GET").await.is_err(), fails, "an interim head of {fields} fields");
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 768, ..ProptestConfig::default() })]

        #[test]
        fn reads_every_answer_as_hypers_client_does(asked in prop::collection::vec(asked(), 2), answers in prop::collection::vec(answer(), 2)) {
            let reference = paused_runtime().block_on(by_hyper(&asked, answers.clone()));
            let ours = paused_runtime().block_on(by_ours(&asked, answers));
            prop_assert_eq!(&ours.1, &reference.1, "request heads differ");
            prop_assert_eq!(&ours.0, &reference.0);
        }
    }
}
