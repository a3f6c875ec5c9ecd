//! Log lines at most once a second. A failure met by every request (Redis
//! gone, the upstream down) is one readable line a second, carrying how
//! many failures it stands for, instead of a line per request: thousands a
//! second that bury everything else and cost the requests their CPU.

use std::sync::{Mutex, OnceLock};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

/// When lines were last written, and which caller writes the next one.
#[derive(Default)]
pub struct LineEvery {
    last_logged_ms: AtomicU64,
}

impl LineEvery {
    /// No line written yet: the first is due at once.
    pub const fn new() -> Self {
        LineEvery {
            last_logged_ms: AtomicU64::new(0),
        }
    }

    /// Whether a line is due (a second or more since the last), claiming it
    /// for this caller: of callers racing for it, one is told yes.
    pub fn claim(&self) -> bool {
        let now = clock_ms();
        let last = self.last_logged_ms.load(Ordering::Relaxed);
        now.saturating_sub(last) >= 1000
            && self
                .last_logged_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
    }
}

/// Failures told at most once a second, each line saying how many it
/// stands for, split by whether they failed open or closed. Those of the
/// last second of an outage are told by the first success a second or more
/// after the last failure; those from before a second without any, by the
/// next failure, apart from it (its cause may differ); and at a stop, by
/// [`Folded::untold`]: the lines add up to every failure.
#[derive(Default)]
pub struct Folded {
    open: AtomicU64,
    closed: AtomicU64,
    last_failed_ms: AtomicU64,
    lines: LineEvery,
    /// The cause of the last failure not told yet, when its caller gave one.
    cause: Mutex<Option<String>>,
}

/// Failures a line stands for, and the cause of the last of them when known.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Told {
    /// Failures that failed open (or that have no mode).
    pub open: u64,
    /// Failures that failed closed.
    pub closed: u64,
    /// The last one's cause, empty when none was kept.
    pub cause: String,
}

impl Told {
    /// All the failures the line stands for.
    pub fn failures(&self) -> u64 {
        self.open.saturating_add(self.closed)
    }
}

impl Folded {
    /// Nothing failed yet.
    pub const fn new() -> Self {
        Folded {
            open: AtomicU64::new(0),
            closed: AtomicU64::new(0),
            last_failed_ms: AtomicU64::new(0),
            lines: LineEvery::new(),
            cause: Mutex::new(None),
        }
    }

    /// One more failure, `closed` or not: the failures from before a second
    /// without any, untold (to be said apart, under their own cause); and,
    /// when a line is due, the failures it stands for, this one included
    /// (said under this one's cause, which the caller has). Otherwise
    /// `cause` is kept for the line that will tell this one. This caller
    /// writes both lines.
    pub fn failed(&self, closed: bool, cause: impl FnOnce() -> String) -> (Option<Told>, Option<Told>) {
        let now = clock_ms();
        let earlier = match now.saturating_sub(self.last_failed_ms.load(Ordering::Relaxed)) >= 1000 {
            true => self.untold(),
            false => None,
        };
        let pending = if closed { &self.closed } else { &self.open };
        pending.fetch_add(1, Ordering::Relaxed);
        self.last_failed_ms.store(now, Ordering::Relaxed);
        let due = self.lines.claim().then(|| self.take());
        if due.is_none() {
            *self.cause.lock().unwrap_or_else(|e| e.into_inner()) = Some(cause());
        }
        (earlier, due)
    }

    /// A success. When failures are untold, none came for a second and a
    /// line is due, the failures: this caller writes the line saying it
    /// works again.
    pub fn answered(&self) -> Option<Told> {
        // One load each while nothing failed: no write shared between threads.
        if self.open.load(Ordering::Relaxed) == 0 && self.closed.load(Ordering::Relaxed) == 0 {
            return None;
        }
        if clock_ms().saturating_sub(self.last_failed_ms.load(Ordering::Relaxed)) < 1000 {
            return None;
        }
        self.lines.claim().then(|| self.take()).filter(|t| t.failures() > 0)
    }

    /// The failures not told yet, if any, taken to be told now whatever
    /// the time (the process is stopping: there is no later line).
    pub fn untold(&self) -> Option<Told> {
        Some(self.take()).filter(|t| t.failures() > 0)
    }

    fn take(&self) -> Told {
        Told {
            open: self.open.swap(0, Ordering::Relaxed),
            closed: self.closed.swap(0, Ordering::Relaxed),
            cause: self
                .cause
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
                .unwrap_or_default(),
        }
    }
}

/// Ms since the first look, plus a second (so that a zero "last logged"
/// is already a second ago).
pub fn clock_ms() -> u64 {
    static START: OnceLock<Instant> = OnceLock::new();
    let elapsed = u64::try_from(START.get_or_init(Instant::now).elapsed().as_millis()).unwrap_or(u64::MAX);
    elapsed.saturating_add(1000)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_a_second_whoever_asks() {
        let every = LineEvery::default();
        assert!(every.claim(), "the first line is due at once");
        assert!(!every.claim(), "the next waits a second");
        let every = std::sync::Arc::new(every);
        std::thread::sleep(std::time::Duration::from_millis(1010));
        let told: usize = (0..4)
            .map(|_| {
                let every = every.clone();
                std::thread::spawn(move || (0..100).filter(|_| every.claim()).count())
            })
            .map(|t| t.join().unwrap())
            .sum();
        assert_eq!(told, 1, "of callers racing for it, one writes the line");
    }

    #[test]
    fn folded_failures_add_up_to_every_failure() {
        let told = |open, closed, cause: &str| {
            Some(Told {
                open,
                closed,
                cause: cause.to_string(),
            })
        };
        let f = Folded::new();
        let cause = || "down".to_string();
        assert_eq!(f.answered(), None, "nothing failed");
        assert_eq!(f.failed(false, cause), (None, told(1, 0, "")), "the first is told at once");
        for i in 0..99 {
            assert_eq!(f.failed(i % 3 == 0, || format!("down {i}")), (None, None));
        }
        assert_eq!(f.answered(), None, "a failure came less than a second ago");
        std::thread::sleep(std::time::Duration::from_millis(1010));
        // A second without failures and no success: the 99 are told apart
        // from this one, whose cause may differ, under the last one's.
        assert_eq!(f.failed(false, cause), (told(66, 33, "down 98"), told(1, 0, "")));
        f.failed(true, cause);
        std::thread::sleep(std::time::Duration::from_millis(1010));
        assert_eq!(f.answered(), told(0, 1, "down"), "the last second's, told on the way back");
        assert_eq!(f.answered(), None, "and once");
        assert_eq!(f.untold(), None);
        f.failed(false, cause);
        f.failed(false, cause);
        assert_eq!(f.untold(), told(2, 0, "down"), "at a stop, whatever the time");
        assert_eq!(f.untold(), None);
    }
}
