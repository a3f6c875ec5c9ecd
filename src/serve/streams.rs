//! The HTTP/2 streams of client connections, each run by hyper as a task of
//! its own, watched for a client that never opens its flow-control window.
//!
//! A client that stops reading one HTTP/2 stream (its window shut, the
//! connection otherwise alive) leaves hyper waiting for window space with a
//! frame of the response in hand: our response body is not asked for the
//! next one, so nothing of ours runs, and the stream, and the upstream
//! connection streaming to it, were held for as long as the client stayed.
//! hyper spawns each stream through the connection's executor; this one runs
//! it under a [`Watch`] that ends it (hyper resets the stream) once it has
//! held a frame the client would not take for the send timeout, as NGINX's
//! `send_timeout` and Envoy's `stream_idle_timeout` end such a stream. A
//! socket the client stops reading altogether is cut by the connection's
//! own write timeout instead (`connection::SendWait`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::time::Sleep;

tokio::task_local! {
    /// The stream whose task is running, for the response body made in it.
    static STREAM: Arc<Progress>;
}

/// How a stream's response body is being taken.
#[derive(Default)]
pub(super) struct Progress {
    /// Times hyper asked the body for a frame.
    asked: AtomicU64,
    /// The body has been handed to hyper.
    handed: AtomicBool,
    /// hyper waits for the client to make room before it asks again: the
    /// last ask gave it a frame, or its task ran without asking (hyper asks
    /// whenever the stream has window space).
    holding: AtomicBool,
}

impl Progress {
    /// The running stream's, if this runs in one (HTTP/2 only).
    pub(super) fn current() -> Option<Arc<Progress>> {
        STREAM.try_with(Arc::clone).ok()
    }

    /// The response's body was handed to hyper.
    pub(super) fn handed(&self) {
        self.handed.store(true, Ordering::Relaxed);
    }

    /// hyper asked for a frame; `given`: one was handed over.
    pub(super) fn asked(&self, given: bool) {
        self.asked.fetch_add(1, Ordering::Relaxed);
        self.holding.store(given, Ordering::Relaxed);
    }
}

/// Spawns what hyper runs for each HTTP/2 stream under a [`Watch`].
#[derive(Clone)]
pub(super) struct StreamExecutor {
    /// The send timeout.
    pub limit: Duration,
}

impl<F> hyper::rt::Executor<F> for StreamExecutor
where
    F: Future<Output = ()> + Send + 'static,
{
    fn execute(&self, fut: F) {
        tokio::spawn(Watch {
            inner: Box::pin(fut),
            progress: Arc::default(),
            limit: self.limit,
            timer: None,
            seen: 0,
        });
    }
}

/// A stream's task, ended when its client takes no frame for `limit`.
struct Watch<F> {
    inner: Pin<Box<F>>,
    progress: Arc<Progress>,
    limit: Duration,
    /// Running while the stream holds a frame for the client.
    timer: Option<Pin<Box<Sleep>>>,
    /// `progress.asked` when the timer was set.
    seen: u64,
}

impl<F: Future<Output = ()>> Future for Watch<F> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        let progress = this.progress.clone();
        let before = progress.asked.load(Ordering::Relaxed);
        if STREAM.sync_scope(progress, || this.inner.as_mut().poll(cx)).is_ready() {
            return Poll::Ready(());
        }
        let asked = this.progress.asked.load(Ordering::Relaxed);
        if asked == before && this.progress.handed.load(Ordering::Relaxed) {
            // Woken (the upstream sent more, say) and the body was not
            // asked: the stream has no window space.
            this.progress.holding.store(true, Ordering::Relaxed);
        }
        if !this.progress.holding.load(Ordering::Relaxed) {
            // Waiting on the upstream (its own timeout), or not begun.
            this.timer = None;
            return Poll::Pending;
        }
        let Some(deadline) = tokio::time::Instant::now().checked_add(this.limit) else {
            return Poll::Pending;
        };
        match &mut this.timer {
            Some(timer) if asked == this.seen => {
                if timer.as_mut().poll(cx).is_ready() {
                    tracing::info!(timeout = ?this.limit, "HTTP/2 stream reset: the client took none of its response for --send-timeout (its window stayed shut)");
                    return Poll::Ready(());
                }
            }
            _ => {
                this.seen = asked;
                let timer = this.timer.get_or_insert_with(|| Box::pin(tokio::time::sleep_until(deadline)));
                timer.as_mut().reset(deadline);
                // Registers the wake-up.
                let _ = timer.as_mut().poll(cx);
            }
        }
        Poll::Pending
    }
}
