//! In-process counters: the embedded default for a single instance.
//!
//! Same layout and semantics as the Redis script (`decide.lua`): per counter
//! a list of `(time, running total)` entries, so a window's count is a binary
//! search and a subtraction, and the exact retry time is a short walk from the
//! window's oldest entry. One lock covers a whole decision, which is what
//! makes "charge every counter or none" hold.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::{Check, CheckCount, CounterStore, StoreAnswer, StoreError, WindowCount};

/// How often idle counters are swept out, in milliseconds.
const SWEEP_EVERY_MS: u64 = 10_000;

/// A millisecond clock that never goes backwards.
pub trait Clock: Send + Sync {
    /// Milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
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
        self.epoch_ms + self.start.elapsed().as_millis() as u64
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

/// Counters kept in this process.
pub struct MemoryStore {
    clock: Arc<dyn Clock>,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    counters: HashMap<String, Counter>,
    next_sweep_ms: u64,
}

/// One counter: entries oldest first, each with the running total after it.
struct Counter {
    /// Running total before the oldest kept entry.
    base: u64,
    entries: VecDeque<(u64, u64)>,
    expires_at_ms: u64,
}

impl Counter {
    fn total(&self) -> u64 {
        self.entries.back().map_or(self.base, |e| e.1)
    }

    fn total_before(&self, index: usize) -> u64 {
        if index == 0 {
            self.base
        } else {
            self.entries[index - 1].1
        }
    }

    /// Counts one window and works out when `cost` would fit.
    fn window(&self, now: u64, limit: u64, period: u64, cost: u64) -> WindowCount {
        let start = (now + 1).saturating_sub(period);
        let first = self.entries.partition_point(|e| e.0 < start);
        let (used, reset_ms) = match self.entries.get(first) {
            Some(&(at, _)) => (self.total() - self.total_before(first), at + period - now),
            None => (0, period),
        };
        let retry_ms = if used + cost <= limit {
            None
        } else if cost > limit {
            Some(period)
        } else {
            // Entries leave oldest first: find the one whose departure frees enough.
            let excess = used + cost - limit;
            (first..self.entries.len())
                .find(|&i| self.entries[i].1 - self.total_before(first) >= excess)
                .map(|i| self.entries[i].0 + period - now)
        };
        WindowCount {
            used,
            reset_ms,
            retry_ms,
        }
    }
}

impl MemoryStore {
    /// An empty store reading time from `clock`.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        MemoryStore {
            clock,
            state: Mutex::new(State::default()),
        }
    }

    /// How many counters are live (for tests and metrics).
    pub fn len(&self) -> usize {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).counters.len()
    }

    /// Whether no counter is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn decide_now(&self, checks: &[Check<'_>]) -> StoreAnswer {
        let now = self.clock.now_ms();
        // A panic elsewhere cannot leave a half-charged decision behind (the
        // charge loop below does not panic), so a poisoned lock is still sound.
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        if now >= state.next_sweep_ms {
            state.counters.retain(|_, c| c.expires_at_ms > now);
            state.next_sweep_ms = now + SWEEP_EVERY_MS;
        }
        let mut admitted = true;
        let mut counts = Vec::with_capacity(checks.len());
        for check in checks {
            let counter = state.counters.get(check.key).filter(|c| c.expires_at_ms > now);
            let windows: Vec<WindowCount> = check
                .windows
                .iter()
                .map(|w| match counter {
                    Some(c) => c.window(now, w.requests, w.period_ms, check.cost),
                    None => {
                        let retry_ms = (check.cost > w.requests).then_some(w.period_ms);
                        WindowCount {
                            used: 0,
                            reset_ms: w.period_ms,
                            retry_ms,
                        }
                    }
                })
                .collect();
            let fits = windows.iter().all(|w| w.retry_ms.is_none());
            admitted &= fits || check.shadow;
            counts.push(CheckCount { charged: fits, windows });
        }
        for (check, count) in checks.iter().zip(counts.iter_mut()) {
            count.charged &= admitted && check.cost > 0;
            if count.charged {
                let longest = check.windows.iter().map(|w| w.period_ms).max().unwrap_or(0);
                charge(&mut state.counters, check.key, now, longest, check.cost);
            }
        }
        StoreAnswer {
            admitted,
            checks: counts,
        }
    }
}

fn charge(counters: &mut HashMap<String, Counter>, key: &str, now: u64, longest: u64, cost: u64) {
    let counter = match counters.get_mut(key) {
        Some(c) => c,
        None => counters.entry(key.to_string()).or_insert(Counter {
            base: 0,
            entries: VecDeque::new(),
            expires_at_ms: 0,
        }),
    };
    if counter.expires_at_ms <= now {
        counter.base = 0;
        counter.entries.clear();
    }
    let oldest_kept = (now + 1).saturating_sub(longest);
    while counter.entries.front().is_some_and(|e| e.0 < oldest_kept) {
        counter.base = counter.entries.pop_front().map_or(counter.base, |e| e.1);
    }
    let total = counter.total() + cost;
    counter.entries.push_back((now, total));
    counter.expires_at_ms = now + longest;
}

impl CounterStore for MemoryStore {
    async fn decide(&self, checks: &[Check<'_>]) -> Result<StoreAnswer, StoreError> {
        Ok(self.decide_now(checks))
    }

    async fn ping(&self) -> Result<(), StoreError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Window;
    use proptest::prelude::*;

    fn check<'a>(key: &'a str, windows: &'a [Window], cost: u64, shadow: bool) -> Check<'a> {
        Check {
            key,
            windows,
            cost,
            shadow,
        }
    }

    #[test]
    fn idle_counters_are_swept() {
        let clock = Arc::new(ManualClock::new(1_000));
        let store = MemoryStore::new(clock.clone());
        let w = [Window {
            requests: 5,
            period_ms: 1_000,
        }];
        store.decide_now(&[check("a", &w, 1, false)]);
        assert_eq!(store.len(), 1);
        clock.advance(SWEEP_EVERY_MS + 1);
        store.decide_now(&[check("b", &w, 1, false)]);
        assert_eq!(store.len(), 1, "a expired and was swept, b is live");
    }

    /// The plainest possible sliding window: every admitted request kept with
    /// its time, a window's count summed from scratch.
    #[derive(Default)]
    struct Model {
        log: HashMap<usize, Vec<(u64, u64)>>,
    }

    impl Model {
        fn used(&self, key: usize, now: u64, period: u64) -> u64 {
            self.log
                .get(&key)
                .map_or(0, |l| l.iter().filter(|(t, _)| now - t < period).map(|(_, n)| n).sum())
        }

        /// Returns (admitted, per check: charged).
        fn decide(&mut self, now: u64, checks: &[(usize, Vec<Window>, u64, bool)]) -> (bool, Vec<bool>) {
            let fits: Vec<bool> = checks
                .iter()
                .map(|(key, windows, cost, _)| {
                    windows
                        .iter()
                        .all(|w| self.used(*key, now, w.period_ms) + cost <= w.requests)
                })
                .collect();
            let admitted = checks.iter().zip(&fits).all(|(c, f)| *f || c.3);
            let charged: Vec<bool> = checks
                .iter()
                .zip(&fits)
                .map(|(c, f)| admitted && *f && c.2 > 0)
                .collect();
            for (c, ch) in checks.iter().zip(&charged) {
                if *ch {
                    self.log.entry(c.0).or_default().push((now, c.2));
                }
            }
            (admitted, charged)
        }

        /// When `cost` would fit in this window, by trying every future millisecond.
        fn retry(&self, key: usize, now: u64, w: Window, cost: u64) -> Option<u64> {
            if self.used(key, now, w.period_ms) + cost <= w.requests {
                return None;
            }
            if cost > w.requests {
                return Some(w.period_ms);
            }
            (1..=w.period_ms).find(|d| self.used(key, now + d, w.period_ms) + cost <= w.requests)
        }
    }

    type Step = (u64, Vec<(usize, u64, bool)>);

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        let check = (0usize..3, 0u64..4, prop::bool::weighted(0.2));
        prop::collection::vec((0u64..700, prop::collection::vec(check, 1..3)), 1..120)
    }

    /// Three counters with fixed windows; each step picks some of them.
    fn rule_windows(key: usize) -> Vec<Window> {
        match key {
            0 => vec![Window {
                requests: 3,
                period_ms: 1_000,
            }],
            1 => vec![
                Window {
                    requests: 2,
                    period_ms: 300,
                },
                Window {
                    requests: 5,
                    period_ms: 2_000,
                },
            ],
            _ => vec![
                Window {
                    requests: 4,
                    period_ms: 500,
                },
                Window {
                    requests: 6,
                    period_ms: 1_500,
                },
            ],
        }
    }

    proptest! {
        #[test]
        fn matches_the_reference_model(steps in steps()) {
            let clock = Arc::new(ManualClock::new(1_000_000));
            let store = MemoryStore::new(clock.clone());
            let mut model = Model::default();
            let names = ["k0", "k1", "k2"];
            for (dt, picks) in steps {
                clock.advance(dt);
                let now = clock.now_ms();
                let mut picks = picks;
                picks.sort_by_key(|p| p.0);
                picks.dedup_by_key(|p| p.0);
                let specs: Vec<(usize, Vec<Window>, u64, bool)> =
                    picks.iter().map(|&(k, cost, shadow)| (k, rule_windows(k), cost, shadow)).collect();
                let checks: Vec<Check<'_>> =
                    specs.iter().map(|(k, w, cost, shadow)| check(names[*k], w, *cost, *shadow)).collect();
                let expected_retry: Vec<Vec<Option<u64>>> = specs
                    .iter()
                    .map(|(k, ws, cost, _)| ws.iter().map(|w| model.retry(*k, now, *w, *cost)).collect())
                    .collect();
                let answer = store.decide_now(&checks);
                let (admitted, charged) = model.decide(now, &specs);
                prop_assert_eq!(answer.admitted, admitted);
                for (i, count) in answer.checks.iter().enumerate() {
                    prop_assert_eq!(count.charged, charged[i]);
                    let got: Vec<Option<u64>> = count.windows.iter().map(|w| w.retry_ms).collect();
                    prop_assert_eq!(&got, &expected_retry[i]);
                }
            }
        }
    }
}
