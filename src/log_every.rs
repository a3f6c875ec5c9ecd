//! Log lines at most once a second. A failure met by every request (Redis
//! gone, the upstream down) is one readable line a second, carrying how
//! many failures it stands for, instead of a line per request: thousands a
//! second that bury everything else and cost the requests their CPU.

use std::sync::OnceLock;
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

/// Failures of one kind told at most once a second, each line saying how
/// many it stands for. Those of the last second of an outage are told by
/// the first success a second or more after the last failure, so the
/// lines add up to every failure.
#[derive(Default)]
pub struct Folded {
    untold: AtomicU64,
    last_failed_ms: AtomicU64,
    lines: LineEvery,
}

impl Folded {
    /// Nothing failed yet.
    pub const fn new() -> Self {
        Folded {
            untold: AtomicU64::new(0),
            last_failed_ms: AtomicU64::new(0),
            lines: LineEvery::new(),
        }
    }

    /// One more failure: how many failures from before a second without
    /// any are untold (no success came to tell them), to be said apart
    /// rather than under this one's cause, which may differ; and, when a line is
    /// due, how many failures it stands for (this one included). This
    /// caller writes both.
    pub fn failed(&self) -> (Option<u64>, Option<u64>) {
        let now = clock_ms();
        let earlier = match now.saturating_sub(self.last_failed_ms.load(Ordering::Relaxed)) >= 1000 {
            true => Some(self.untold.swap(0, Ordering::Relaxed)).filter(|&n| n > 0),
            false => None,
        };
        self.untold.fetch_add(1, Ordering::Relaxed);
        self.last_failed_ms.store(now, Ordering::Relaxed);
        (earlier, self.lines.claim().then(|| self.untold.swap(0, Ordering::Relaxed)))
    }

    /// A success. When failures are untold, none came for a second and a
    /// line is due, how many they are: this caller writes the line saying
    /// it works again.
    pub fn answered(&self) -> Option<u64> {
        // One load while nothing failed: no write shared between threads.
        if self.untold.load(Ordering::Relaxed) == 0 {
            return None;
        }
        if clock_ms().saturating_sub(self.last_failed_ms.load(Ordering::Relaxed)) < 1000 {
            return None;
        }
        self.lines
            .claim()
            .then(|| self.untold.swap(0, Ordering::Relaxed))
            .filter(|&n| n > 0)
    }
}

impl Folded {
    /// The failures not told yet, if any, taken to be told now whatever
    /// the time (the process is stopping: there is no later line).
    pub fn untold(&self) -> Option<u64> {
        Some(self.untold.swap(0, Ordering::Relaxed)).filter(|&n| n > 0)
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
        let f = Folded::new();
        assert_eq!(f.answered(), None, "nothing failed");
        assert_eq!(f.failed(), (None, Some(1)), "the first failure is told at once");
        for _ in 0..99 {
            assert_eq!(f.failed(), (None, None));
        }
        assert_eq!(f.answered(), None, "a failure came less than a second ago");
        std::thread::sleep(std::time::Duration::from_millis(1010));
        // A second without failures and no success: the 99 are told apart
        // from this one, whose cause may differ.
        assert_eq!(f.failed(), (Some(99), Some(1)));
        f.failed();
        std::thread::sleep(std::time::Duration::from_millis(1010));
        assert_eq!(f.answered(), Some(1), "the last second's, told on the way back");
        assert_eq!(f.answered(), None, "and once");
        assert_eq!(f.untold(), None);
        f.failed();
        f.failed();
        assert_eq!(f.untold(), Some(2), "at a stop, whatever the time");
        assert_eq!(f.untold(), None);
    }
}
