//! Bodies in flight through the proxy, with an idle timeout between frames.
//!
//! A stalled upstream must not hold a client forever, and a stalled client
//! upload must not hold an upstream connection: either body is cut off when
//! no frame arrives for the body timeout (`--upstream-body-timeout`), and the
//! event is counted. The client's body also tells the proxy when it has been
//! sent whole, so the wait for the upstream's answer (`--upstream-timeout`)
//! starts then, not while the client is still uploading; and it tells
//! whether the upstream side is taking it at all (a connection that never
//! comes up, an upstream that stops reading), which ends the wait after the
//! body timeout too, as NGINX's `proxy_send_timeout` does.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use hyper::body::{Body, Frame, Incoming, SizeHint};
use tokio::sync::oneshot;
use tokio::time::{Instant, Sleep};

/// What a body reports when it stalls or fails.
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// An error's causes, each after `": "`, for a log line that says what
/// hyper only sums up ("http2 error" over "stream error received: refused").
pub struct Causes<'a>(pub &'a (dyn std::error::Error + 'static));

impl std::fmt::Display for Causes<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut source = self.0.source();
        while let Some(cause) = source {
            write!(f, ": {cause}")?;
            source = cause.source();
        }
        Ok(())
    }
}

/// The body timeout ran out between two frames.
#[derive(Debug, thiserror::Error)]
#[error("no body data for {0:?}")]
pub struct Stalled(pub Duration);

/// A deadline that moves forward with every frame, made on first need.
pub struct IdleTimer {
    limit: Duration,
    sleep: Option<Pin<Box<Sleep>>>,
}

impl IdleTimer {
    /// A timer allowing `limit` between frames.
    pub fn new(limit: Duration) -> Self {
        IdleTimer { limit, sleep: None }
    }

    /// A frame arrived: the next may take `limit` again.
    fn touch(&mut self) {
        if let Some(sleep) = self.sleep.as_mut()
            && let Some(next) = Instant::now().checked_add(self.limit)
        {
            sleep.as_mut().reset(next);
        }
    }

    /// Whether the wait for the next frame has run out (registers a wake-up
    /// otherwise).
    fn expired(&mut self, cx: &mut Context<'_>) -> bool {
        let limit = self.limit;
        let sleep = self.sleep.get_or_insert_with(|| Box::pin(tokio::time::sleep(limit)));
        sleep.as_mut().poll(cx).is_ready()
    }

    /// Polls `body`, failing it with [`Stalled`] when no frame came in time.
    pub(super) fn poll<B>(&mut self, body: Pin<&mut B>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>>
    where
        B: Body<Data = Bytes>,
        B::Error: Into<BodyError>,
    {
        match body.poll_frame(cx) {
            Poll::Ready(frame) => {
                self.touch();
                Poll::Ready(frame.map(|f| f.map_err(Into::into)))
            }
            Poll::Pending if self.expired(cx) => Poll::Ready(Some(Err(Stalled(self.limit).into()))),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Where the client's body stands on its way upstream.
pub struct BodyProgress {
    /// Told once the body has been read: `true` whole, `false` if it failed
    /// (a stall, a reset). An HTTP/2 upstream exchange that fails after the
    /// client's body did is the client's doing, though hyper reports the
    /// reset stream.
    done: oneshot::Receiver<bool>,
    /// `None` for a body-less request: nothing is ever asked of it.
    asked: Option<Arc<Asked>>,
}

/// How the upstream connection has asked for the body.
struct Asked {
    /// When the body was wrapped.
    since: Instant,
    /// Milliseconds after `since` when it last asked for a piece.
    last_ms: AtomicU64,
    /// The last time, the client had not sent it yet.
    waiting_for_client: AtomicBool,
}

impl Asked {
    fn new() -> Self {
        Asked {
            since: Instant::now(),
            last_ms: AtomicU64::new(0),
            waiting_for_client: AtomicBool::new(false),
        }
    }
}

impl BodyProgress {
    /// Waits until the body has been read whole (`true`) or failed;
    /// `None` when it was dropped unread (its exchange failed first).
    pub async fn finished(&mut self) -> Option<bool> {
        (&mut self.done).await.ok()
    }

    /// Whether the body has been read whole or failed, if it has.
    pub fn try_finished(&mut self) -> Option<bool> {
        self.done.try_recv().ok()
    }

    /// As [`BodyProgress::finished`] if that is known already (a body-less
    /// request's is, from the start), else `None`: no timer is needed then.
    pub fn finished_now(&mut self) -> Option<Option<bool>> {
        match self.done.try_recv() {
            Ok(whole) => Some(Some(whole)),
            Err(oneshot::error::TryRecvError::Closed) => Some(None),
            Err(oneshot::error::TryRecvError::Empty) => None,
        }
    }

    /// How long since the upstream connection last asked for a piece of
    /// the body (or since the body was wrapped, if never), or `None` while
    /// it waits for the client to send one (the client's stall, which the
    /// body's own timer ends).
    pub fn unasked_for(&self) -> Option<Duration> {
        let asked = self.asked.as_ref()?;
        if asked.waiting_for_client.load(Ordering::Relaxed) {
            return None;
        }
        let last = Duration::from_millis(asked.last_ms.load(Ordering::Relaxed));
        Some(asked.since.elapsed().saturating_sub(last))
    }
}

/// The client's request body on its way upstream.
pub struct ClientBody {
    /// `None`: the body is in `held`, or there is none.
    body: Option<Incoming>,
    /// What is left to send of a body read ahead, so that the request can
    /// go out again when an HTTP/2 upstream leaves it unprocessed (boxed:
    /// rare, and the request moves through every send).
    held: Option<Box<Bytes>>,
    timer: IdleTimer,
    /// Told once the whole body has been read, or it failed.
    sent: Option<oneshot::Sender<bool>>,
    asked: Option<Arc<Asked>>,
}

impl ClientBody {
    /// Wraps `body` (`None`: the request has none), with where its
    /// progress is told.
    pub fn new(body: Option<Incoming>, idle: Duration) -> (Self, BodyProgress) {
        let (tx, rx) = oneshot::channel();
        // Most requests have no body: no allocation for them.
        let asked = body.as_ref().is_some_and(|b| !b.is_end_stream()).then(|| Arc::new(Asked::new()));
        let mut body = ClientBody {
            body,
            held: None,
            timer: IdleTimer::new(idle),
            sent: Some(tx),
            asked: asked.clone(),
        };
        // An empty body is never polled: it is sent with the head.
        if body.is_end_stream() {
            body.finished(true);
        }
        (body, BodyProgress { done: rx, asked })
    }

    /// A body read ahead, for a request sent again.
    pub fn again(held: Bytes, idle: Duration) -> Self {
        ClientBody {
            body: None,
            held: Some(Box::new(held)),
            timer: IdleTimer::new(idle),
            sent: None,
            asked: None,
        }
    }

    /// The whole body, read ahead if it is at most `limit` bytes long by
    /// its declared length, so the request can be sent again; `None` for a
    /// longer one or one of unknown length (streamed: it cannot be). Each
    /// piece is waited for under the body timeout, as when streamed.
    pub async fn hold(&mut self, limit: u64) -> Result<Option<Bytes>, BodyError> {
        if self.held.is_some() || self.body.as_ref().is_none_or(|b| b.is_end_stream()) {
            return Ok(Some(self.held.as_deref().cloned().unwrap_or_default()));
        }
        if self.size_hint().exact().is_none_or(|len| len > limit) {
            return Ok(None);
        }
        let mut data = bytes::BytesMut::new();
        while let Some(frame) = std::future::poll_fn(|cx| Pin::new(&mut *self).poll_frame(cx)).await {
            if let Ok(piece) = frame?.into_data() {
                data.extend_from_slice(&piece);
            }
        }
        let held = data.freeze();
        self.body = None;
        self.held = Some(Box::new(held.clone()));
        Ok(Some(held))
    }

    fn finished(&mut self, whole: bool) {
        if let Some(tx) = self.sent.take() {
            let _ = tx.send(whole);
        }
    }
}

impl Body for ClientBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = &mut *self;
        let Some(body) = this.body.as_mut() else {
            let Some(held) = this.held.as_mut() else {
                return Poll::Ready(None);
            };
            if held.is_empty() {
                return Poll::Ready(None);
            }
            return Poll::Ready(Some(Ok(Frame::data(std::mem::take(&mut **held)))));
        };
        let mut frame = this.timer.poll(Pin::new(body), cx);
        // Request trailers end the body here, as NGINX ends a body it reads
        // whole: an HTTP/2 upstream may not take them (NGINX's drops the
        // whole connection, every client's streams on it with it).
        if matches!(&frame, Poll::Ready(Some(Ok(f))) if f.is_trailers()) {
            frame = Poll::Ready(None);
        }
        if let Some(asked) = &this.asked {
            let ms = u64::try_from(asked.since.elapsed().as_millis()).unwrap_or(u64::MAX);
            asked.last_ms.store(ms, Ordering::Relaxed);
            asked.waiting_for_client.store(frame.is_pending(), Ordering::Relaxed);
        }
        match &frame {
            Poll::Ready(None) => this.finished(true),
            Poll::Ready(Some(Err(e))) => {
                if e.is::<Stalled>() {
                    crate::metrics::get().body_stalled(false);
                }
                this.finished(false);
            }
            _ => {}
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        match (&self.body, &self.held) {
            (Some(body), _) => body.is_end_stream(),
            (None, Some(held)) => held.is_empty(),
            (None, None) => true,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.body, &self.held) {
            (Some(body), _) => body.size_hint(),
            (None, Some(held)) => SizeHint::with_exact(held.len() as u64),
            (None, None) => SizeHint::with_exact(0),
        }
    }
}
