//! Time for both stores: milliseconds that never go backwards, or a clock
//! moved by hand in tests.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

/// A millisecond clock that never goes backwards.
pub trait Clock: Send + Sync {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;

    /// Milliseconds since the Unix epoch at `instant`, a moment just read:
    /// a clock kept by [`Instant`] answers without reading the time again
    /// (each read is a system clock read, several per request add up).
    fn at(&self, instant: Instant) -> u64 {
        let _ = instant;
        self.now_ms()
    }
}

/// Wall-clock milliseconds, advanced by a monotonic clock so that a step of
/// the system time cannot move windows backwards.
pub struct SystemClock {
    start: Instant,
    epoch_ms: u64,
}

impl Default for SystemClock {
    fn default() -> Self {
        let epoch_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        SystemClock {
            start: Instant::now(),
            epoch_ms,
        }
    }
}

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        self.at(Instant::now())
    }

    fn at(&self, instant: Instant) -> u64 {
        let elapsed = instant.saturating_duration_since(self.start);
        self.epoch_ms
            .saturating_add(u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX))
    }
}

/// A clock moved by hand, for exact tests of window arithmetic.
pub struct ManualClock(AtomicU64);

impl ManualClock {
    /// A clock reading `ms`.
    pub fn new(ms: u64) -> Self {
        ManualClock(AtomicU64::new(ms))
    }

    /// Moves the clock forward.
    pub fn advance(&self, ms: u64) {
        self.0.fetch_add(ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.0.load(Ordering::SeqCst)
    }
}
