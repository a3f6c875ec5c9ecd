//! Where idle keep-alive connections wait for their next request without a
//! task of their own: one per listener.
//!
//! A parked connection (see [`super::connection`]) is taken off tokio's
//! reactor and registered with the lot's own epoll set (mio's `Poll`, itself
//! watched by tokio as one file descriptor), next to the few bytes needed to
//! serve it again. When its client sends (or hangs up) the lot hands it back
//! to the listener's accept loop, which spawns its task again; when its
//! keep-alive time runs out, or the server stops, the lot closes it.
//! Waiting costs an entry here (~0.1 KB) and the connection's [`Activity`]
//! instead of a task, its timer and tokio's registration (~1.4 KB), which is
//! how NGINX's idle connections cost what they do.
//!
//! [`Activity`]: super::connection

use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use mio::net::TcpStream as MioStream;
use mio::{Events, Interest, Poll, Registry, Token};
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, watch};

use crate::metrics::Held;

/// A connection's task, handed back to the accept loop to be spawned.
pub(super) type Resumed = Pin<Box<dyn Future<Output = ()> + Send>>;

/// What brings a parked connection back: given its socket (registered with
/// tokio again), the future that serves it from there.
pub(super) type Resume = Box<dyn FnOnce(tokio::net::TcpStream) -> Resumed + Send>;

/// Most readiness events taken from the set at a time.
const EVENTS: usize = 256;

/// How often connections past their keep-alive time are looked for: a
/// parked one is closed at most this late.
const SWEEP_EVERY: Duration = Duration::from_millis(500);

/// One listener's parked connections.
pub(super) struct Lot {
    /// The set they wait in: one file descriptor per lot.
    poll: Mutex<Poll>,
    state: Mutex<State>,
    /// The accept loop, which spawns a connection's task again.
    resumed: mpsc::UnboundedSender<Resumed>,
}

#[derive(Default)]
struct State {
    parked: HashMap<Token, Parked>,
    /// When each parked connection is to be closed, earliest first.
    deadlines: BTreeSet<(Instant, Token)>,
    next: usize,
}

struct Parked {
    stream: MioStream,
    deadline: Instant,
    resume: Resume,
    /// Its place in `tollgate_client_connections_waiting`.
    _waiting: Held,
}

/// Why a connection could not be parked (it is closed).
#[derive(Debug, thiserror::Error)]
pub(super) enum ParkError {
    /// Taking it off tokio's reactor or onto the lot's set failed.
    #[error("cannot park the connection: {0}")]
    Io(#[from] io::Error),
}

impl Lot {
    /// A lot whose connections are spawned again through `resumed`, with the
    /// task that watches them (until `stop` turns true, closing them all).
    pub(super) fn start(resumed: mpsc::UnboundedSender<Resumed>, stop: watch::Receiver<bool>) -> io::Result<Arc<Lot>> {
        let poll = Poll::new()?;
        let fd = SetFd(poll.as_raw_fd());
        let lot = Arc::new(Lot {
            poll: Mutex::new(poll),
            state: Mutex::new(State::default()),
            resumed,
        });
        // SAFETY: the descriptor is the Poll's, which the lot owns; the
        // AsyncFd lives in the lot's task, which holds the lot.
        let set = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
            .map_err(io::Error::from)?;
        tokio::spawn(watch_lot(lot.clone(), set, stop));
        Ok(lot)
    }

    /// Parks `stream` until it is readable, for at most `keepalive`;
    /// `resume` serves it again then.
    pub(super) fn park(
        &self,
        stream: tokio::net::TcpStream,
        keepalive: Duration,
        waiting: Held,
        resume: Resume,
    ) -> Result<(), ParkError> {
        let mut stream = MioStream::from_std(stream.into_std()?);
        let now = Instant::now();
        // Past any keep-alive time an operator can write, it never expires.
        let deadline = now.checked_add(keepalive).unwrap_or(now);
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let token = Token(state.next);
        state.next = state.next.wrapping_add(1);
        // Readable covers the client hanging up too (read returns 0).
        self.registry(|r| r.register(&mut stream, token, Interest::READABLE))?;
        state.deadlines.insert((deadline, token));
        state.parked.insert(
            token,
            Parked {
                stream,
                deadline,
                resume,
                _waiting: waiting,
            },
        );
        Ok(())
    }

    fn registry<T>(&self, with: impl FnOnce(&Registry) -> io::Result<T>) -> io::Result<T> {
        with(self.poll.lock().unwrap_or_else(|p| p.into_inner()).registry())
    }

    /// Takes a connection off the lot, out of the set.
    fn take(&self, token: Token) -> Option<Parked> {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let mut parked = state.parked.remove(&token)?;
        state.deadlines.remove(&(parked.deadline, token));
        // A map never shrinks by itself: after a burst it would keep the
        // burst's table for good.
        let (len, capacity) = (state.parked.len(), state.parked.capacity());
        if capacity > 1024 && len < capacity / 8 {
            state.parked.shrink_to(len.saturating_mul(2));
        }
        drop(state);
        let _ = self.registry(|r| r.deregister(&mut parked.stream));
        Some(parked)
    }

    /// Sends the connection behind `token` back to be served.
    fn wake(&self, token: Token) {
        let Some(parked) = self.take(token) else { return };
        let std: std::net::TcpStream = parked.stream.into();
        match tokio::net::TcpStream::from_std(std) {
            Ok(stream) => {
                // The accept loop is gone only when the server stops.
                let _ = self.resumed.send((parked.resume)(stream));
            }
            Err(e) => tracing::debug!(error = %e, "parked connection could not be served again"),
        }
    }

    /// Closes the connections whose keep-alive time ran out.
    fn sweep(&self, now: Instant) {
        let closed = self.close_earliest(usize::MAX, |deadline| deadline <= now);
        if closed > 0 {
            tracing::debug!(closed, "idle connections closed");
        }
    }

    /// Closes up to `most` parked connections, those nearest their
    /// keep-alive deadline (the longest idle) first, to make room for new
    /// ones; how many it closed.
    pub(super) fn reclaim(&self, most: usize) -> usize {
        let closed = self.close_earliest(most, |_| true);
        if closed > 0 {
            tracing::debug!(closed, "idle connections closed to make room");
        }
        closed
    }

    /// Closes up to `most` connections in deadline order while `due` holds
    /// of the next one's deadline; how many it closed.
    fn close_earliest(&self, most: usize, due: impl Fn(Instant) -> bool) -> usize {
        let mut closed = 0usize;
        while closed < most {
            let token = {
                let state = self.state.lock().unwrap_or_else(|p| p.into_inner());
                match state.deadlines.first() {
                    Some(&(deadline, token)) if due(deadline) => token,
                    _ => break,
                }
            };
            // Gone already if its client sent meanwhile: it is served, not closed.
            if self.take(token).is_some() {
                closed = closed.saturating_add(1);
            }
        }
        closed
    }

    /// Closes every parked connection.
    fn close_all(&self) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.deadlines.clear();
        for (_, mut parked) in state.parked.drain() {
            let _ = self.registry(|r| r.deregister(&mut parked.stream));
        }
        state.parked.shrink_to_fit();
    }

    /// How many connections are parked.
    #[cfg(test)]
    fn len(&self) -> usize {
        self.state.lock().unwrap_or_else(|p| p.into_inner()).parked.len()
    }
}

/// The lot's epoll descriptor, as tokio watches it.
struct SetFd(RawFd);

impl AsRawFd for SetFd {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// Serves the lot's set until the server stops.
async fn watch_lot(lot: Arc<Lot>, set: AsyncFd<SetFd>, mut stop: watch::Receiver<bool>) {
    let mut events = Events::with_capacity(EVENTS);
    let mut sweep = tokio::time::interval(SWEEP_EVERY);
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            ready = set.readable() => {
                let Ok(mut ready) = ready else { break };
                let polled = ready.try_io(|_| {
                    let mut poll = lot.poll.lock().unwrap_or_else(|p| p.into_inner());
                    poll.poll(&mut events, Some(Duration::ZERO))?;
                    match events.is_empty() {
                        // Drained: tokio waits for the set's next edge.
                        true => Err(io::ErrorKind::WouldBlock.into()),
                        false => Ok(()),
                    }
                });
                if let Ok(Err(e)) = polled {
                    tracing::warn!(error = %e, "the parked connections' set failed");
                }
                for event in events.iter() {
                    lot.wake(event.token());
                }
            }
            _ = sweep.tick() => lot.sweep(Instant::now()),
            _ = super::stopped(&mut stop) => {
                lot.close_all();
                break;
            }
        }
    }
    // Off tokio's reactor before the lot (and with it the descriptor) can go.
    drop(set);
    drop(lot);
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    fn waiting() -> Held {
        Held::new(prometheus_client::metrics::gauge::Gauge::default())
    }

    /// A connected pair over loopback: (the server's side, the client's).
    async fn pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = tokio::net::TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        (listener.accept().await.unwrap().0, client)
    }

    /// A resume that hands the socket to `tx` (and reads what came).
    fn resume_to(tx: tokio::sync::mpsc::UnboundedSender<Vec<u8>>) -> Resume {
        Box::new(move |mut stream| {
            Box::pin(async move {
                let mut buf = vec![0; 16];
                let n = stream.read(&mut buf).await.unwrap_or(0);
                buf.truncate(n);
                let _ = tx.send(buf);
            })
        })
    }

    #[tokio::test]
    async fn a_parked_connection_comes_back_when_its_client_sends() {
        let (resumed_tx, mut resumed) = mpsc::unbounded_channel();
        let (_stop_tx, stop) = watch::channel(false);
        let lot = Lot::start(resumed_tx, stop).unwrap();
        let (got_tx, mut got) = mpsc::unbounded_channel();
        let (server, mut client) = pair().await;
        lot.park(server, Duration::from_secs(60), waiting(), resume_to(got_tx)).unwrap();
        assert_eq!(lot.len(), 1);
        client.write_all(b"GET /").await.unwrap();
        let task = tokio::time::timeout(Duration::from_secs(5), resumed.recv()).await.unwrap().unwrap();
        tokio::spawn(task);
        assert_eq!(got.recv().await.unwrap(), b"GET /", "the bytes are read where the task resumes");
        assert_eq!(lot.len(), 0);
    }

    #[tokio::test]
    async fn reclaiming_closes_the_longest_idle_first() {
        let (resumed_tx, _resumed) = mpsc::unbounded_channel();
        let (_stop_tx, stop) = watch::channel(false);
        let lot = Lot::start(resumed_tx, stop).unwrap();
        let (got_tx, _got) = mpsc::unbounded_channel();
        let mut clients = Vec::new();
        for _ in 0..3 {
            let (server, client) = pair().await;
            lot.park(server, Duration::from_secs(60), waiting(), resume_to(got_tx.clone())).unwrap();
            clients.push(client);
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(lot.reclaim(2), 2);
        assert_eq!(lot.len(), 1);
        let mut buf = [0u8; 1];
        for (i, client) in clients.iter_mut().enumerate() {
            let read = tokio::time::timeout(Duration::from_millis(300), client.read(&mut buf)).await;
            match i {
                0 | 1 => assert_eq!(read.unwrap().unwrap(), 0, "parked first, closed first"),
                _ => assert!(read.is_err(), "the newest is still parked"),
            }
        }
        assert_eq!(lot.reclaim(5), 1, "only what there is");
    }

    #[tokio::test]
    async fn keepalive_time_and_stop_close_parked_connections() {
        let (resumed_tx, _resumed) = mpsc::unbounded_channel();
        let (stop_tx, stop) = watch::channel(false);
        let lot = Lot::start(resumed_tx, stop).unwrap();
        let (got_tx, _got) = mpsc::unbounded_channel();
        let (short, mut short_client) = pair().await;
        let (long, mut long_client) = pair().await;
        lot.park(short, Duration::from_millis(100), waiting(), resume_to(got_tx.clone())).unwrap();
        lot.park(long, Duration::from_secs(60), waiting(), resume_to(got_tx)).unwrap();
        let mut buf = [0u8; 1];
        let closed = tokio::time::timeout(Duration::from_secs(3), short_client.read(&mut buf)).await;
        assert_eq!(closed.unwrap().unwrap(), 0, "closed after its keep-alive time");
        assert_eq!(lot.len(), 1, "the other one still waits");
        stop_tx.send(true).unwrap();
        let closed = tokio::time::timeout(Duration::from_secs(3), long_client.read(&mut buf)).await;
        assert_eq!(closed.unwrap().unwrap(), 0, "closed when the server stops");
    }
}
