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
}
