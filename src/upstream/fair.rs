//! A connection whose reader yields now and then, so that an upstream
//! sending without pause cannot hold its proxy thread.
//!
//! hyper's HTTP/1 client reads on its connection's task until the socket
//! has nothing more; an upstream that floods bytes that make no frame
//! (endless chunk-size digits, spaces after a size) kept it reading for
//! seconds at a time on a fast link, while the thread's other requests
//! waited, and the body timeout (which runs between frames) never got a
//! turn. Through [`Fair`], every [`READ_PER_TURN`] bytes the read says
//! "not yet" once, with the task woken at once: the runtime serves the
//! others and comes back. Our own HTTP/1.1 client bounds its work per poll
//! itself (`http1.rs`).

use std::io;
use std::pin::Pin;
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, ReadBuf};

/// Bytes read between two turns given to the thread's other tasks.
const READ_PER_TURN: usize = 64 * 1024;

/// `T`, whose reads yield once every [`READ_PER_TURN`] bytes.
pub struct Fair<T> {
    io: T,
    /// Bytes read since the last turn given.
    read: usize,
}

impl<T> Fair<T> {
    /// Wraps `io`.
    pub fn new(io: T) -> Self {
        Fair { io, read: 0 }
    }

    /// The connection itself.
    pub fn into_inner(self) -> T {
        self.io
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for Fair<T> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        if self.read >= READ_PER_TURN {
            self.read = 0;
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        let n = buf.filled().len().saturating_sub(before);
        self.read = self.read.saturating_add(n);
        polled
    }
}

writes_through!(Fair);
