//! Where idle keep-alive connections wait for their next request without a
//! task of their own: one per listener.
//!
//! A parked connection (see [`super::connection`]) is taken off tokio's
//! reactor and registered with the lot's own epoll set (mio's `Poll`, itself
//! watched by tokio as one file descriptor), next to the little kept to
//! serve it again. When its client sends (or hangs up) the lot hands it back
//! to the listener's accept loop, which spawns its task again; when its
//! keep-alive time runs out, or the server stops, the lot closes it.
//!
//! Waiting costs a slot in the lot's table (~50 B: the socket, its deadline
//! and what the connection keeps, a pointer and a number) and the
//! connection's [`Activity`], instead of a task, its timer and tokio's
//! registration (~1.4 KB), which is how NGINX's idle connections cost what
//! they do. How a connection is served again is the same for all of a
//! lot's, so the lot holds it once, not each connection a closure of its
//! own. The table is blocks of slots, not a map with a deadline index
//! beside it: fewer bytes, and no array that copies itself as it grows.
//! The price is a walk over the table twice a second for the connections
//! past their time, which for 100,000 parked connections is well under a
//! millisecond (BENCHMARKS.md §55).
//!
//! [`Activity`]: super::connection

use std::collections::BinaryHeap;
use std::future::Future;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use mio::net::TcpStream as MioStream;
use mio::{Events, Interest, Poll, Registry, Token};
use prometheus_client::metrics::gauge::Gauge;
use tokio::io::unix::AsyncFd;
use tokio::sync::{mpsc, watch};

/// A connection's task, handed back to the accept loop to be spawned.
pub(super) type Resumed = Pin<Box<dyn Future<Output = ()> + Send>>;

/// How a lot's connections are served again: given a socket (registered
/// with tokio again) and what was kept of its connection, the future that
/// serves it from there.
pub(super) type Resume<T> = Box<dyn Fn(tokio::net::TcpStream, T) -> Resumed + Send + Sync>;

/// Most readiness events taken from the set at a time.
const EVENTS: usize = 256;

/// How often parked connections are looked at when none is due sooner.
const SWEEP_EVERY: Duration = Duration::from_millis(500);

/// The shortest time between two looks: a parked connection is closed at
/// most this late.
const SWEEP_GAP: Duration = Duration::from_millis(100);

/// A table this small is kept as it is unless empty (~50 KB at most).
#[cfg(not(test))]
const KEEP_SLOTS: usize = 1024;
#[cfg(test)]
const KEEP_SLOTS: usize = BLOCK;

/// A token's lower half names a slot, its upper half the park that filled
/// it.
const HALF: u32 = usize::BITS / 2;
const SLOT_MASK: usize = (1 << HALF) - 1;

fn token(slot: usize, park: usize) -> Token {
    Token((park << HALF) | slot)
}

/// The slot and the park a token names.
fn split(token: Token) -> (usize, usize) {
    (token.0 & SLOT_MASK, token.0 >> HALF)
}

/// One listener's parked connections, each keeping a `T`.
pub(super) struct Lot<T> {
    /// The set they wait in: one file descriptor per lot.
    poll: Mutex<Poll>,
    table: Mutex<Table<MioStream, T>>,
    /// The accept loop, which spawns a connection's task again.
    resumed: mpsc::UnboundedSender<Resumed>,
    resume: Resume<T>,
    /// `tollgate_client_connections_waiting`: one for each parked connection.
    waiting: Gauge,
    /// Tells the lot's task of a deadline earlier than the one it sleeps to.
    sooner: tokio::sync::Notify,
}

/// Why a connection could not be parked (it is closed).
#[derive(Debug, thiserror::Error)]
pub(super) enum ParkError {
    /// Taking it off tokio's reactor or onto the lot's set failed.
    #[error("cannot park the connection: {0}")]
    Io(#[from] io::Error),
    /// More connections are parked than a token can tell apart.
    #[error("cannot park the connection: the lot is full")]
    Full,
    /// The server is stopping.
    #[error("not parked: the server is stopping")]
    Stopped,
}

impl<T: Send + 'static> Lot<T> {
    /// A lot whose connections are served again by `resume`, spawned
    /// through `resumed`, counted in `waiting` while parked, with the task
    /// that watches them (until `stop` turns true, closing them all).
    pub(super) fn start(
        resumed: mpsc::UnboundedSender<Resumed>,
        resume: Resume<T>,
        waiting: Gauge,
        stop: watch::Receiver<bool>,
    ) -> io::Result<Arc<Lot<T>>> {
        let poll = Poll::new()?;
        let fd = SetFd(poll.as_raw_fd());
        let lot = Arc::new(Lot {
            poll: Mutex::new(poll),
            table: Mutex::new(Table::default()),
            resumed,
            resume,
            waiting,
            sooner: tokio::sync::Notify::new(),
        });
        // SAFETY: the descriptor is the Poll's, which the lot owns; the
        // AsyncFd lives in the lot's task, which holds the lot.
        let set = unsafe { AsyncFd::register_with_interest(fd, tokio::io::Interest::READABLE) }
            .map_err(io::Error::from)?;
        tokio::spawn(watch_lot(lot.clone(), set, stop));
        Ok(lot)
    }
}

impl<T> Lot<T> {
    /// Parks `stream` until it is readable, for at most `keepalive`,
    /// keeping `kept` to serve it again with.
    pub(super) fn park(&self, stream: tokio::net::TcpStream, keepalive: Duration, kept: T) -> Result<(), ParkError> {
        let mut stream = MioStream::from_std(stream.into_std()?);
        let now = Instant::now();
        // Past any keep-alive time an operator can write, it never expires.
        let deadline = now
            .checked_add(keepalive)
            .or_else(|| now.checked_add(FOREVER))
            .unwrap_or(now);
        let mut table = lock(&self.table);
        if table.closed {
            // The watch task is gone: nothing would ever sweep or close it.
            return Err(ParkError::Stopped);
        }
        let token = table.next_token().ok_or(ParkError::Full)?;
        // Readable covers the client hanging up too (read returns 0).
        self.registry(|r| r.register(&mut stream, token, Interest::READABLE))?;
        table.insert(token, stream, deadline, kept);
        self.waiting.inc();
        if deadline < table.next_sweep {
            table.next_sweep = deadline;
            self.sooner.notify_one();
        }
        Ok(())
    }

    fn registry<R>(&self, with: impl FnOnce(&Registry) -> io::Result<R>) -> io::Result<R> {
        with(lock(&self.poll).registry())
    }

    /// Takes the connections `pick` names (those still here) off the lot
    /// and out of the set. It picks under the same lock as they are taken:
    /// a compaction in between would move them to other tokens.
    fn take(&self, pick: impl FnOnce(&Table<MioStream, T>) -> Vec<Token>) -> Vec<Parked<MioStream, T>> {
        let mut table = lock(&self.table);
        let tokens = pick(&table);
        let taken: Vec<_> = tokens.into_iter().filter_map(|t| table.remove(t)).collect();
        self.waiting.dec_by(i64::try_from(taken.len()).unwrap_or(i64::MAX));
        if table.wants_compacting() {
            // Moved connections are registered again under their new
            // tokens; an event already taken under an old one is told
            // again by the set (a re-registered socket that is readable is
            // reported anew), and the old token names no one else (it
            // names the same connection if that stayed in its slot).
            let poll = lock(&self.poll);
            let mut lost = Vec::new();
            table.compact(|stream, token| {
                poll.registry()
                    .reregister(stream, token, Interest::READABLE)
                    .inspect_err(|e| lost.push(e.kind()))
                    .is_ok()
            });
            drop(poll);
            self.waiting.dec_by(i64::try_from(lost.len()).unwrap_or(i64::MAX));
            if let Some(kind) = lost.first() {
                tracing::debug!(closed = lost.len(), error = ?kind, "parked connections closed: cannot move them");
            }
        }
        drop(table);
        let mut taken = taken;
        for parked in &mut taken {
            let _ = self.registry(|r| r.deregister(&mut parked.stream));
        }
        taken
    }

    /// Sends the connection behind `token` back to be served.
    fn wake(&self, token: Token) {
        let Some(parked) = self.take(|_| vec![token]).pop() else { return };
        let std: std::net::TcpStream = parked.stream.into();
        match tokio::net::TcpStream::from_std(std) {
            Ok(stream) => {
                // The accept loop is gone only when the server stops.
                let _ = self.resumed.send((self.resume)(stream, parked.kept));
            }
            Err(e) => tracing::debug!(error = %e, "parked connection could not be served again"),
        }
    }

    /// Closes the connections whose keep-alive time ran out; when to look
    /// again: at the next deadline, or after [`SWEEP_EVERY`] at the latest.
    fn sweep(&self, now: Instant) -> Instant {
        let mut next = now.checked_add(SWEEP_EVERY).unwrap_or(now);
        let soonest = now.checked_add(SWEEP_GAP).unwrap_or(now);
        let closed = self
            .take(|table| {
                let (due, earliest) = table.due(now);
                // A walk costs ~0.1 ms per 100,000 connections: not more
                // than one per SWEEP_GAP, however spread their deadlines.
                next = earliest.map_or(next, |e| e.clamp(soonest, next));
                due
            })
            .len();
        {
            let mut table = lock(&self.table);
            // A connection parked since the walk may have asked for sooner.
            if !(now < table.next_sweep && table.next_sweep < next) {
                table.next_sweep = next;
            }
            next = table.next_sweep.max(soonest);
        }
        if closed > 0 {
            tracing::debug!(closed, "idle connections closed");
        }
        next
    }

    /// The keep-alive deadlines of the `most` connections nearest theirs
    /// (the longest idle), for a gate to choose among its lots' with.
    pub(super) fn earliest(&self, most: usize) -> Vec<Instant> {
        lock(&self.table).earliest(most).into_iter().map(|(deadline, _)| deadline).collect()
    }

    /// Closes up to `most` parked connections whose keep-alive deadline is
    /// `until` or before, those nearest it (the longest idle) first, to
    /// make room for new ones; how many it closed.
    pub(super) fn reclaim(&self, most: usize, until: Instant) -> usize {
        let pick = |table: &Table<MioStream, T>| {
            let earliest = table.earliest(most).into_iter();
            earliest.filter(|&(deadline, _)| deadline <= until).map(|(_, t)| t).collect()
        };
        let closed = self.take(pick).len();
        if closed > 0 {
            tracing::debug!(closed, "idle connections closed to make room");
        }
        closed
    }

    /// Closes every parked connection, and any parked from now on.
    fn close_all(&self) {
        let all = {
            let mut table = lock(&self.table);
            let all = table.take_all();
            table.closed = true;
            all
        };
        self.waiting.dec_by(i64::try_from(all.len()).unwrap_or(i64::MAX));
        for mut parked in all {
            let _ = self.registry(|r| r.deregister(&mut parked.stream));
        }
    }

    /// How many connections are parked.
    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.table).len
    }
}

impl<T> Drop for Lot<T> {
    fn drop(&mut self) {
        let left = lock(&self.table).len;
        self.waiting.dec_by(i64::try_from(left).unwrap_or(i64::MAX));
    }
}

/// A deadline for a keep-alive time too long to add to now.
const FOREVER: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

fn lock<X>(m: &Mutex<X>) -> MutexGuard<'_, X> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Slots per block of the table. The table grows a block at a time: an
/// array grown by doubling would copy itself each time and leave the
/// copies it outgrew among freed pages.
const BLOCK: usize = 32;

/// [`BLOCK`] slots, each empty or holding a parked connection.
type Block<S, T> = Box<[Option<Parked<S, T>>]>;

/// The parked connections, by slot: `S` is the socket, `T` what is kept.
struct Table<S, T> {
    blocks: Vec<Block<S, T>>,
    /// Slots below this have held a connection; the table's next new one.
    used_to: usize,
    /// Emptied slots below `used_to`, filled before new ones.
    free: Vec<usize>,
    /// Slots filled.
    len: usize,
    /// Parks so far, modulo what a token's upper half holds: so that an
    /// event for a connection that left is not taken for the next one in
    /// its slot.
    parks: usize,
    /// The server stopped: nothing is parked any more.
    closed: bool,
    /// When the lot's task sweeps next.
    next_sweep: Instant,
}

impl<S, T> Default for Table<S, T> {
    fn default() -> Self {
        Table {
            blocks: Vec::new(),
            used_to: 0,
            free: Vec::new(),
            len: 0,
            parks: 0,
            closed: false,
            next_sweep: Instant::now(),
        }
    }
}

struct Parked<S, T> {
    stream: S,
    /// Which park this is: the upper half of its token.
    park: usize,
    deadline: Instant,
    kept: T,
}

impl<S, T> Table<S, T> {
    /// The token the next connection parked gets (none: no slot left).
    fn next_token(&mut self) -> Option<Token> {
        let slot = self.free.last().copied().unwrap_or(self.used_to);
        if slot > SLOT_MASK {
            return None;
        }
        self.parks = self.parks.wrapping_add(1) & (usize::MAX >> HALF);
        Some(token(slot, self.parks))
    }

    /// Slots the table has room for.
    fn capacity(&self) -> usize {
        self.blocks.len().saturating_mul(BLOCK)
    }

    fn place(&mut self, slot: usize) -> Option<&mut Option<Parked<S, T>>> {
        self.blocks.get_mut(slot / BLOCK)?.get_mut(slot % BLOCK)
    }

    /// Fills the slot of `token`, which [`Table::next_token`] just gave.
    fn insert(&mut self, token: Token, stream: S, deadline: Instant, kept: T) {
        let (slot, park) = split(token);
        if self.free.last() == Some(&slot) {
            self.free.pop();
        } else {
            self.used_to = slot.saturating_add(1);
        }
        if slot >= self.capacity() {
            self.blocks.push(std::iter::repeat_with(|| None).take(BLOCK).collect());
        }
        if let Some(place) = self.place(slot) {
            *place = Some(Parked {
                stream,
                park,
                deadline,
                kept,
            });
            self.len = self.len.saturating_add(1);
        }
    }

    /// Empties the slot `token` names, if it still holds that park.
    fn remove(&mut self, token: Token) -> Option<Parked<S, T>> {
        let (slot, park) = split(token);
        let place = self.place(slot)?;
        if place.as_ref()?.park != park {
            return None;
        }
        let parked = place.take()?;
        self.free.push(slot);
        self.len = self.len.saturating_sub(1);
        Some(parked)
    }

    /// Tokens of the connections due at `now`, and the earliest deadline
    /// of the others.
    fn due(&self, now: Instant) -> (Vec<Token>, Option<Instant>) {
        let mut due = Vec::new();
        let mut earliest: Option<Instant> = None;
        for (slot, p) in self.filled() {
            if p.deadline <= now {
                due.push(token(slot, p.park));
            } else if earliest.is_none_or(|e| p.deadline < e) {
                earliest = Some(p.deadline);
            }
        }
        (due, earliest)
    }

    /// Up to `most` connections with the earliest deadlines: their
    /// deadlines and tokens.
    fn earliest(&self, most: usize) -> Vec<(Instant, Token)> {
        if most == 0 {
            return Vec::new();
        }
        // The latest of the earliest so far on top.
        let mut heap = BinaryHeap::with_capacity(most.min(self.len).saturating_add(1));
        for (slot, p) in self.filled() {
            if heap.len() < most {
                heap.push((p.deadline, token(slot, p.park).0));
            } else if heap.peek().is_some_and(|&(latest, _)| p.deadline < latest) {
                heap.pop();
                heap.push((p.deadline, token(slot, p.park).0));
            }
        }
        heap.into_iter().map(|(deadline, t)| (deadline, Token(t))).collect()
    }

    fn filled(&self) -> impl Iterator<Item = (usize, &Parked<S, T>)> {
        self.blocks.iter().enumerate().flat_map(|(b, block)| {
            let first = b.saturating_mul(BLOCK);
            block
                .iter()
                .enumerate()
                .filter_map(move |(i, p)| Some((first.saturating_add(i), p.as_ref()?)))
        })
    }

    /// Whether the table holds much more room than connections: after a
    /// burst, it would otherwise keep the burst's size for good.
    fn wants_compacting(&self) -> bool {
        let room = self.capacity();
        // A one-block table stays when empty, for a listener whose one idle
        // connection comes and goes.
        (self.len == 0 && room > BLOCK) || (room > KEEP_SLOTS && self.len < room / 8)
    }

    /// Moves the connections to the lowest slots of a table just big
    /// enough; `moved` is told each one's socket and new token, and one for
    /// which it returns false is dropped (closed).
    fn compact(&mut self, mut moved: impl FnMut(&mut S, Token) -> bool) {
        let old = std::mem::take(self);
        self.parks = old.parks;
        for mut parked in old.blocks.into_iter().flat_map(|b| b.into_vec()).flatten() {
            if let Some(t) = self.next_token().map(|t| token(split(t).0, parked.park))
                && moved(&mut parked.stream, t)
            {
                self.insert(t, parked.stream, parked.deadline, parked.kept);
            }
        }
        self.parks = old.parks;
        self.closed = old.closed;
        self.next_sweep = old.next_sweep;
    }

    /// Empties the table.
    fn take_all(&mut self) -> Vec<Parked<S, T>> {
        let old = std::mem::take(self);
        old.blocks.into_iter().flat_map(|b| b.into_vec()).flatten().collect()
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
async fn watch_lot<T>(lot: Arc<Lot<T>>, set: AsyncFd<SetFd>, mut stop: watch::Receiver<bool>) {
    let mut events = Events::with_capacity(EVENTS);
    let sweep = tokio::time::sleep(SWEEP_EVERY);
    tokio::pin!(sweep);
    let mut swept = Instant::now();
    loop {
        tokio::select! {
            ready = set.readable() => {
                let Ok(mut ready) = ready else { break };
                let polled = ready.try_io(|_| {
                    let mut poll = lock(&lot.poll);
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
            _ = &mut sweep => {
                swept = Instant::now();
                let next = lot.sweep(swept);
                sweep.as_mut().reset(tokio::time::Instant::from_std(next));
            }
            _ = lot.sooner.notified() => {
                let next = lock(&lot.table).next_sweep;
                let next = next.max(swept.checked_add(SWEEP_GAP).unwrap_or(swept));
                sweep.as_mut().reset(tokio::time::Instant::from_std(next));
            }
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
    use std::collections::HashMap;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// A deadline past every one a test sets.
    fn far() -> Instant {
        Instant::now() + FOREVER
    }

    /// A connected pair over loopback: (the server's side, the client's).
    async fn pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let client = tokio::net::TcpStream::connect(listener.local_addr().unwrap()).await.unwrap();
        (listener.accept().await.unwrap().0, client)
    }

    /// What came on a connection that came back, with what it kept.
    type Came = mpsc::UnboundedReceiver<(u32, Vec<u8>)>;

    /// A lot whose connections, when they come back, read what came and
    /// send it to `got` with what they kept; and its resumed tasks.
    fn lot(stop: watch::Receiver<bool>, waiting: Gauge) -> (Arc<Lot<u32>>, mpsc::UnboundedReceiver<Resumed>, Came) {
        let (resumed_tx, resumed) = mpsc::unbounded_channel();
        let (got_tx, got) = mpsc::unbounded_channel();
        let resume: Resume<u32> = Box::new(move |mut stream, kept| {
            let got = got_tx.clone();
            Box::pin(async move {
                let mut buf = vec![0; 16];
                let n = stream.read(&mut buf).await.unwrap_or(0);
                buf.truncate(n);
                let _ = got.send((kept, buf));
            })
        });
        (Lot::start(resumed_tx, resume, waiting, stop).unwrap(), resumed, got)
    }

    #[tokio::test]
    async fn a_parked_connection_comes_back_when_its_client_sends() {
        let (_stop_tx, stop) = watch::channel(false);
        let waiting = Gauge::default();
        let (lot, mut resumed, mut got) = lot(stop, waiting.clone());
        let (server, mut client) = pair().await;
        lot.park(server, Duration::from_secs(60), 7).unwrap();
        assert_eq!((lot.len(), waiting.get()), (1, 1));
        client.write_all(b"GET /").await.unwrap();
        let task = tokio::time::timeout(Duration::from_secs(5), resumed.recv()).await.unwrap().unwrap();
        tokio::spawn(task);
        let (kept, bytes) = got.recv().await.unwrap();
        assert_eq!(bytes, b"GET /", "the bytes are read where the task resumes");
        assert_eq!(kept, 7, "with what the connection kept");
        assert_eq!((lot.len(), waiting.get()), (0, 0));
    }

    #[tokio::test]
    async fn reclaiming_closes_the_longest_idle_first() {
        let (_stop_tx, stop) = watch::channel(false);
        let waiting = Gauge::default();
        let (lot, _resumed, _got) = lot(stop, waiting.clone());
        let mut clients = Vec::new();
        // Keep-alive times that put the deadlines in another order than
        // the slots: the second parked is the one with the most time left.
        for (i, keepalive) in [50, 70, 60].into_iter().enumerate() {
            let (server, client) = pair().await;
            lot.park(server, Duration::from_secs(keepalive), i as u32).unwrap();
            clients.push(client);
        }
        assert_eq!(lot.reclaim(2, far()), 2);
        assert_eq!((lot.len(), waiting.get()), (1, 1));
        let mut buf = [0u8; 1];
        for (i, client) in clients.iter_mut().enumerate() {
            let read = tokio::time::timeout(Duration::from_millis(300), client.read(&mut buf)).await;
            match i {
                0 | 2 => assert_eq!(read.unwrap().unwrap(), 0, "nearest its deadline, closed first"),
                _ => assert!(read.is_err(), "the one with the most time left is still parked"),
            }
        }
        assert_eq!(lot.reclaim(5, far()), 1, "only what there is");
        assert_eq!(waiting.get(), 0);
    }

    #[tokio::test]
    async fn reclaiming_closes_none_past_the_deadline_it_is_given() {
        let (_stop_tx, stop) = watch::channel(false);
        let (lot, _resumed, _got) = lot(stop, Gauge::default());
        let mut clients = Vec::new();
        for (i, keepalive) in [50, 70, 60].into_iter().enumerate() {
            let (server, client) = pair().await;
            lot.park(server, Duration::from_secs(keepalive), i as u32).unwrap();
            clients.push(client);
        }
        let deadlines = lot.earliest(2);
        assert_eq!(deadlines.len(), 2);
        let until = *deadlines.iter().min().unwrap();
        assert_eq!(lot.reclaim(3, until), 1, "only the one due by then");
        assert_eq!(lot.len(), 2);
    }

    #[tokio::test]
    async fn keepalive_time_and_stop_close_parked_connections() {
        let (stop_tx, stop) = watch::channel(false);
        let waiting = Gauge::default();
        let (lot, _resumed, _got) = lot(stop, waiting.clone());
        let (short, mut short_client) = pair().await;
        let (long, mut long_client) = pair().await;
        lot.park(short, Duration::from_millis(100), 1).unwrap();
        lot.park(long, Duration::from_secs(60), 2).unwrap();
        let mut buf = [0u8; 1];
        let closed = tokio::time::timeout(Duration::from_secs(3), short_client.read(&mut buf)).await;
        assert_eq!(closed.unwrap().unwrap(), 0, "closed after its keep-alive time");
        assert_eq!((lot.len(), waiting.get()), (1, 1), "the other one still waits");
        stop_tx.send(true).unwrap();
        let closed = tokio::time::timeout(Duration::from_secs(3), long_client.read(&mut buf)).await;
        assert_eq!(closed.unwrap().unwrap(), 0, "closed when the server stops");
        assert_eq!(waiting.get(), 0);
    }

    #[tokio::test]
    async fn nothing_is_parked_once_the_server_stopped() {
        let (stop_tx, stop) = watch::channel(false);
        let waiting = Gauge::default();
        let (lot, _resumed, _got) = lot(stop, waiting.clone());
        stop_tx.send(true).unwrap();
        // The lot's task closes what it holds and ends.
        tokio::time::sleep(Duration::from_millis(100)).await;
        let (server, mut client) = pair().await;
        assert!(matches!(lot.park(server, Duration::from_secs(60), 1), Err(ParkError::Stopped)));
        assert_eq!((lot.len(), waiting.get()), (0, 0));
        let mut buf = [0u8; 1];
        let closed = tokio::time::timeout(Duration::from_secs(3), client.read(&mut buf)).await;
        assert_eq!(closed.unwrap().unwrap(), 0, "closed, not left open with no one to close it");
    }

    #[tokio::test]
    async fn a_keepalive_time_past_the_clock_never_runs_out() {
        let (_stop_tx, stop) = watch::channel(false);
        let (lot, _resumed, _got) = lot(stop, Gauge::default());
        let (server, mut client) = pair().await;
        lot.park(server, Duration::MAX, 1).unwrap();
        let mut buf = [0u8; 1];
        let read = tokio::time::timeout(Duration::from_millis(1200), client.read(&mut buf)).await;
        assert!(read.is_err(), "still parked after two sweeps: {read:?}");
        assert_eq!(lot.len(), 1);
    }

    #[tokio::test]
    async fn connections_moved_when_the_table_shrinks_still_come_back() {
        let (_stop_tx, stop) = watch::channel(false);
        let waiting = Gauge::default();
        let (lot, mut resumed, mut got) = lot(stop, waiting.clone());
        let mut clients = Vec::new();
        for i in 0..40 {
            let (server, client) = pair().await;
            // The first parked goes first when reclaiming.
            lot.park(server, Duration::from_secs(60 + i), i as u32).unwrap();
            clients.push(client);
        }
        let room = lock(&lot.table).capacity();
        assert!(room > KEEP_SLOTS);
        assert_eq!(lot.reclaim(37, far()), 37);
        let after = lock(&lot.table).capacity();
        assert!(after < room, "the table shrank: {room} -> {after}");
        assert_eq!((lot.len(), waiting.get()), (3, 3));
        for (i, client) in clients.iter_mut().enumerate().skip(37) {
            client.write_all(format!("req {i}").as_bytes()).await.unwrap();
            let task = tokio::time::timeout(Duration::from_secs(5), resumed.recv()).await.unwrap().unwrap();
            tokio::spawn(task);
            let (kept, bytes) = got.recv().await.unwrap();
            assert_eq!((kept, bytes), (i as u32, format!("req {i}").into_bytes()), "moved, and still its own");
        }
        assert_eq!((lot.len(), waiting.get()), (0, 0));
        assert_eq!(lock(&lot.table).capacity(), BLOCK, "an empty lot keeps one block");
    }

    #[tokio::test]
    async fn an_event_for_a_connection_that_left_wakes_no_other() {
        let (_stop_tx, stop) = watch::channel(false);
        let (lot, mut resumed, _got) = lot(stop, Gauge::default());
        let (first, _first_client) = pair().await;
        lot.park(first, Duration::from_secs(60), 1).unwrap();
        let gone = lock(&lot.table).earliest(1)[0].1;
        assert_eq!(lot.reclaim(1, far()), 1);
        let (second, _second_client) = pair().await;
        lot.park(second, Duration::from_secs(60), 2).unwrap();
        let now = lock(&lot.table).earliest(1)[0].1;
        assert_eq!(split(now).0, split(gone).0, "the same slot");
        lot.wake(gone);
        assert_eq!(lot.len(), 1, "the second is still parked");
        assert!(resumed.try_recv().is_err());
    }

    /// What the table is asked, in the model test.
    #[derive(Debug, Clone)]
    enum Op {
        Park(u16),
        /// The i-th token ever given (wrapping), whether still parked or not.
        Remove(usize),
        Due(u16),
        Earliest(u8),
    }

    fn op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        prop_oneof![
            4 => any::<u16>().prop_map(Op::Park),
            3 => any::<usize>().prop_map(Op::Remove),
            1 => any::<u16>().prop_map(Op::Due),
            1 => any::<u8>().prop_map(|m| Op::Earliest(m % 40)),
        ]
    }

    proptest::proptest! {
        /// The table against a map of token to (deadline, kept): removes,
        /// deadlines due and the earliest ones agree, stale tokens name no
        /// one, and compacting keeps every connection under its new token.
        #[test]
        fn the_table_answers_as_a_map_of_its_connections(ops in proptest::collection::vec(op(), 1..400)) {
            let base = Instant::now();
            let at = |ms: u16| base + Duration::from_millis(u64::from(ms));
            // The "socket" is the connection's current token, so that a
            // move can be followed.
            let mut table: Table<Token, u32> = Table::default();
            let mut model: HashMap<Token, (Instant, u32)> = HashMap::new();
            let mut given: Vec<Token> = Vec::new();
            for (n, op) in ops.into_iter().enumerate() {
                let kept = n as u32;
                match op {
                    Op::Park(ms) => {
                        let t = table.next_token().unwrap();
                        proptest::prop_assert!(!model.contains_key(&t), "a token in use given again");
                        table.insert(t, t, at(ms), kept);
                        model.insert(t, (at(ms), kept));
                        given.push(t);
                    }
                    Op::Remove(i) if !given.is_empty() => {
                        let t = given[i % given.len()];
                        let got = table.remove(t).map(|p| (p.deadline, p.kept));
                        proptest::prop_assert_eq!(got, model.remove(&t));
                        if table.wants_compacting() {
                            let mut moves = Vec::new();
                            table.compact(|old, new| {
                                moves.push((*old, new));
                                *old = new;
                                true
                            });
                            let mut moved = HashMap::new();
                            for (old, new) in moves {
                                moved.insert(new, model.remove(&old).unwrap());
                            }
                            proptest::prop_assert!(model.is_empty(), "every connection moved");
                            model = moved;
                            proptest::prop_assert!(table.capacity() < table.len + BLOCK, "just big enough");
                        }
                    }
                    Op::Remove(_) => {}
                    Op::Due(ms) => {
                        let (mut due, earliest) = table.due(at(ms));
                        due.sort();
                        let rest = model.values().map(|v| v.0).filter(|&d| d > at(ms)).min();
                        proptest::prop_assert_eq!(earliest, rest, "the next deadline");
                        let mut want: Vec<Token> = model.iter().filter(|(_, v)| v.0 <= at(ms)).map(|(t, _)| *t).collect();
                        want.sort();
                        proptest::prop_assert_eq!(due, want);
                    }
                    Op::Earliest(most) => {
                        let got = table.earliest(usize::from(most));
                        for (deadline, t) in &got {
                            proptest::prop_assert_eq!(*deadline, model[t].0);
                        }
                        let mut deadlines: Vec<Instant> = got.iter().map(|(d, _)| *d).collect();
                        deadlines.sort();
                        let mut all: Vec<Instant> = model.values().map(|v| v.0).collect();
                        all.sort();
                        all.truncate(usize::from(most));
                        proptest::prop_assert_eq!(deadlines, all);
                    }
                }
                proptest::prop_assert_eq!(table.len, model.len());
                for (t, p) in table.filled() {
                    proptest::prop_assert_eq!(p.stream, token(t, p.park), "each knows its token");
                }
            }
        }
    }
}
