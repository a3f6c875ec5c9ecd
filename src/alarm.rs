//! A timer kept for the life of a connection, so a request on it costs no
//! timer of its own.
//!
//! A tokio `Sleep` made per request is registered in the runtime's timer
//! wheel on its first poll and taken out when dropped: ~680 instructions a
//! proxied request (BENCHMARKS.md §62). The deadlines a connection's
//! requests set only move later, so one `Sleep` is kept instead and left to
//! ring early: each ring looks at the time again and, when the deadline in
//! force has not come yet, waits on to it. Our own server's connections
//! keep one for their watchdog (`serve::connection::own`), and our own
//! client's upstream connections one for the wait on each answer
//! (`upstream::pool`).
//!
//! A kept timer holds the waker of the task that last waited on it: an
//! idle upstream connection holds its last client's task until it is
//! parked, a second later, or carries a request again.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use tokio::time::{Instant, Sleep};

/// A connection's timer: moved sooner when a deadline is sooner, otherwise
/// left to ring early.
pub struct Alarm {
    sleep: Pin<Box<Sleep>>,
    /// When it rings, if set since it last did.
    armed: Option<Instant>,
}

impl Default for Alarm {
    fn default() -> Self {
        Self::new()
    }
}

impl Alarm {
    /// An alarm set for no time.
    pub fn new() -> Alarm {
        let now = Instant::now();
        let never = now.checked_add(Duration::from_secs(365 * 86_400)).unwrap_or(now);
        Alarm {
            sleep: Box::pin(tokio::time::sleep_until(never)),
            armed: None,
        }
    }

    /// Rings within `wait` from `now`, a moment just read, at the latest.
    pub fn within(&mut self, now: Instant, wait: Duration) {
        // Past any time an operator can write: no ring needed.
        if let Some(at) = now.checked_add(wait) {
            self.by(at);
        }
    }

    /// Rings at `at` at the latest; earlier when it was set sooner.
    pub fn by(&mut self, at: Instant) {
        if self.armed.is_none_or(|armed| at < armed) {
            self.sleep.as_mut().reset(at);
            self.armed = Some(at);
        }
    }

    /// Rings: at the soonest time it was set to since it last rang, or at
    /// once when that has passed.
    pub async fn rung(&mut self) {
        self.sleep.as_mut().await;
        self.armed = None;
    }

    /// Rings at `due`, not before: an earlier ring (a deadline since
    /// passed by) is waited past. A poll, for a wait polled beside another
    /// (no future of its own to keep); never rings without a `due`.
    pub fn poll_at(&mut self, cx: &mut Context<'_>, due: Option<Instant>) -> Poll<()> {
        let Some(due) = due else { return Poll::Pending };
        loop {
            self.by(due);
            ready!(self.sleep.as_mut().poll(cx));
            self.armed = None;
            if Instant::now() >= due {
                return Poll::Ready(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn ring_at(alarm: &mut Alarm, due: Instant) {
        std::future::poll_fn(|cx| alarm.poll_at(cx, Some(due))).await
    }

    #[tokio::test(start_paused = true)]
    async fn it_rings_at_the_soonest_time_it_was_set_to() {
        let start = Instant::now();
        let mut alarm = Alarm::new();
        alarm.within(Instant::now(), Duration::from_secs(5));
        alarm.within(Instant::now(), Duration::from_secs(2));
        alarm.within(Instant::now(), Duration::from_secs(9));
        alarm.rung().await;
        assert_eq!(start.elapsed(), Duration::from_secs(2));
        // Rung: set again, it rings at the new time, not at once.
        alarm.within(Instant::now(), Duration::from_secs(3));
        alarm.rung().await;
        assert_eq!(start.elapsed(), Duration::from_secs(5));
    }

    #[tokio::test(start_paused = true)]
    async fn at_waits_past_an_earlier_ring_to_its_own_time() {
        let start = Instant::now();
        let mut alarm = Alarm::new();
        // An earlier request's deadline, still set.
        alarm.by(start + Duration::from_secs(1));
        ring_at(&mut alarm, start + Duration::from_secs(4)).await;
        assert_eq!(start.elapsed(), Duration::from_secs(4));
    }

    #[tokio::test(start_paused = true)]
    async fn a_ring_missed_while_nobody_waited_does_not_end_the_next_wait() {
        let start = Instant::now();
        let mut alarm = Alarm::new();
        alarm.by(start + Duration::from_secs(1));
        // It rings with nobody waiting (an idle kept connection).
        tokio::time::sleep(Duration::from_secs(3)).await;
        ring_at(&mut alarm, start + Duration::from_secs(6)).await;
        assert_eq!(start.elapsed(), Duration::from_secs(6));
        // And once more after a ring that was seen.
        ring_at(&mut alarm, start + Duration::from_secs(8)).await;
        assert_eq!(start.elapsed(), Duration::from_secs(8));
    }

    #[tokio::test(start_paused = true)]
    async fn a_sooner_deadline_moves_it_sooner() {
        let start = Instant::now();
        let mut alarm = Alarm::new();
        alarm.by(start + Duration::from_secs(10));
        ring_at(&mut alarm, start + Duration::from_secs(3)).await;
        assert_eq!(start.elapsed(), Duration::from_secs(3));
    }
}
