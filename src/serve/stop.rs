//! A listener's stop as its connections see it: the server-wide shutdown
//! channel relayed onto the listener's thread, and beside it a flag that a
//! connection waiting for its next request watches without the channel.
//!
//! A `watch` receiver's wait takes the channel's lock and joins (then
//! leaves) its waiter list each time a connection waits; the proxy's own
//! HTTP/1.1 path waits once or twice per request, so that was ~400
//! instructions of every request (BENCHMARKS.md section 62). A [`StopSeat`] instead
//! puts its connection's waker on the flag's list once and, while the
//! connection's task stays the same, checks an atomic on each wait.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};

use tokio::sync::watch;

/// A listener's stop on one thread: the relayed channel (for the waits
/// that are not per request) and the flag with its waiting connections.
#[derive(Clone)]
pub(crate) struct Stop {
    /// Set (and its sender gone) once the server stops.
    pub(crate) rx: watch::Receiver<bool>,
    flag: Arc<Flag>,
}

/// Set once, with the wakers of the connections waiting on it.
#[derive(Default)]
struct Flag {
    set: AtomicBool,
    waiting: Mutex<Waiting>,
}

/// Wakers by seat, with the seats given back to reuse.
#[derive(Default)]
struct Waiting {
    wakers: Vec<Option<Waker>>,
    free: Vec<usize>,
}

impl Stop {
    /// Relays `shutdown` onto the calling task's runtime: a task that sets
    /// the flag, wakes whoever waits on it and sets the channel once
    /// `shutdown` is set (or its sender is gone). It ends then, or when
    /// every receiver of the relay is gone.
    pub(crate) fn relay(shutdown: &watch::Receiver<bool>) -> Stop {
        let mut shutdown = shutdown.clone();
        let (tx, rx) = watch::channel(*shutdown.borrow());
        let flag = Arc::new(Flag::default());
        if *shutdown.borrow() {
            flag.raise();
        }
        let raised = flag.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = super::stopped(&mut shutdown) => {
                    raised.raise();
                    let _ = tx.send(true);
                }
                _ = tx.closed() => {}
            }
        });
        Stop { rx, flag }
    }

    /// A place to wait on the flag for one connection.
    pub(crate) fn seat(&self) -> StopSeat {
        StopSeat {
            flag: self.flag.clone(),
            index: None,
            waker: None,
        }
    }
}

impl Flag {
    fn raise(&self) {
        // Set before the list is emptied, under the lock a seat adds itself
        // with: a seat that adds itself after this sees the flag set.
        self.set.store(true, Ordering::SeqCst);
        let wakers: Vec<Waker> = match self.waiting.lock() {
            Ok(mut waiting) => waiting.wakers.iter_mut().filter_map(Option::take).collect(),
            Err(_) => return,
        };
        wakers.into_iter().for_each(Waker::wake);
    }
}

/// One connection's place on its listener's stop flag, given back when
/// the connection ends (or parks: its task ends then).
pub(crate) struct StopSeat {
    flag: Arc<Flag>,
    /// Where its waker is on the flag's list, once it has waited.
    index: Option<usize>,
    /// The waker put there, to tell whether a wait is still the same task's.
    waker: Option<Waker>,
}

impl StopSeat {
    /// Whether the server is stopping.
    pub(crate) fn is_set(&self) -> bool {
        self.flag.set.load(Ordering::Acquire)
    }

    /// Resolves once the server is stopping.
    pub(crate) async fn stopped(&mut self) {
        std::future::poll_fn(|cx| self.poll_stopped(cx)).await
    }

    fn poll_stopped(&mut self, cx: &mut Context<'_>) -> Poll<()> {
        if self.is_set() {
            return Poll::Ready(());
        }
        // Most waits are the same task's as the last: nothing to write.
        if self.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            return Poll::Pending;
        }
        let Ok(mut waiting) = self.flag.waiting.lock() else {
            return Poll::Pending;
        };
        let waker = cx.waker().clone();
        let index = match self.index {
            Some(index) => index,
            None => match waiting.free.pop() {
                Some(index) => index,
                None => {
                    waiting.wakers.push(None);
                    waiting.wakers.len().saturating_sub(1)
                }
            },
        };
        if let Some(slot) = waiting.wakers.get_mut(index) {
            *slot = Some(waker.clone());
        }
        drop(waiting);
        self.index = Some(index);
        self.waker = Some(waker);
        // Raised while the waker went on (it may have emptied the list first).
        if self.is_set() { Poll::Ready(()) } else { Poll::Pending }
    }
}

impl Drop for StopSeat {
    fn drop(&mut self) {
        let Some(index) = self.index else { return };
        if let Ok(mut waiting) = self.flag.waiting.lock() {
            if let Some(slot) = waiting.wakers.get_mut(index) {
                *slot = None;
            }
            waiting.free.push(index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn every_waiting_seat_wakes_when_the_server_stops_and_a_late_one_at_once() {
        let (tx, rx) = watch::channel(false);
        let stop = Stop::relay(&rx);
        let mut waiting = tokio::task::JoinSet::new();
        for _ in 0..5 {
            let mut seat = stop.seat();
            waiting.spawn(async move { seat.stopped().await });
        }
        // One seat comes and goes: its place is given back and reused.
        drop(stop.seat());
        {
            let mut gone = stop.seat();
            let _ = tokio::time::timeout(Duration::from_millis(10), gone.stopped()).await;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(waiting.try_join_next().is_none(), "none stopped before the stop");
        tx.send(true).unwrap();
        let all = tokio::time::timeout(Duration::from_secs(2), waiting.join_all()).await;
        assert_eq!(all.map(|done| done.len()).ok(), Some(5));
        let mut late = stop.seat();
        assert!(late.is_set());
        tokio::time::timeout(Duration::from_millis(100), late.stopped())
            .await
            .expect("a seat taken after the stop is stopped at once");
        assert!(*stop.rx.borrow(), "the channel is relayed too");
    }

    #[tokio::test]
    async fn a_seat_that_moves_to_another_task_is_woken_there() {
        let (tx, rx) = watch::channel(false);
        let stop = Stop::relay(&rx);
        let mut seat = stop.seat();
        // Waits once in this task, then is handed to another (as a parked
        // connection's state is when it is served again).
        let _ = tokio::time::timeout(Duration::from_millis(10), seat.stopped()).await;
        let moved = tokio::spawn(async move { seat.stopped().await });
        tokio::time::sleep(Duration::from_millis(20)).await;
        tx.send(true).unwrap();
        tokio::time::timeout(Duration::from_secs(2), moved)
            .await
            .expect("woken in the task it moved to")
            .unwrap();
    }
}
