//! A timer kept for the life of a connection, so a request on it costs no
//! timer of its own: our own server's connections keep one for their
//! watchdog (`serve::connection::own`). The deadlines a connection's
//! requests set only move later, so one `Sleep` is kept and left to ring
//! early; each ring looks at the time again.

use std::pin::Pin;
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

    /// Rings within `wait` from now at the latest.
    pub fn within(&mut self, wait: Duration) {
        // Past any time an operator can write: no ring needed.
        if let Some(at) = Instant::now().checked_add(wait) {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn it_rings_at_the_soonest_time_it_was_set_to() {
        let start = Instant::now();
        let mut alarm = Alarm::new();
        alarm.within(Duration::from_secs(5));
        alarm.within(Duration::from_secs(2));
        alarm.within(Duration::from_secs(9));
        alarm.rung().await;
        assert_eq!(start.elapsed(), Duration::from_secs(2));
        // Rung: set again, it rings at the new time, not at once.
        alarm.within(Duration::from_secs(3));
        alarm.rung().await;
        assert_eq!(start.elapsed(), Duration::from_secs(5));
    }
}
