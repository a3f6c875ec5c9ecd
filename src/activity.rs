//! What tollgate has been doing lately, for the operator page: per rule the
//! decisions of the last 15 minutes, the counters refused most in the last
//! minutes, and how the counter store has been answering.
//!
//! Like [`crate::metrics`] it depends on nobody's types and is fed from the
//! same places; unlike Prometheus counters it keeps time itself, so the
//! admin page can show rates and charts without a Prometheus server. Every
//! structure here is bounded whatever the traffic.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime};

/// One-second slots behind a rule's live rate.
const FINE_SLOTS: usize = 11;
/// Seconds the live rate is averaged over (the complete seconds before now).
pub const RATE_SECONDS: u64 = 10;
/// Seconds per step of a rule's history.
pub const STEP_SECONDS: u64 = 10;
/// Steps of history kept: 15 minutes.
pub const STEPS: usize = 90;
/// Counters remembered by [`TopLimited`] at most.
const TOP_CAPACITY: usize = 1_000;
/// Refusals are counted per period of this many seconds; the list shows the
/// current period and the one before.
const TOP_PERIOD_S: u64 = 60;
/// A counter not refused for this long leaves the list.
const TOP_FORGET_S: u64 = 300;
/// Seconds of store round trips kept for the percentiles.
const TRIP_SECONDS: usize = 60;
/// Round-trip buckets, each √2 wider than the last from [`TRIP_FIRST_US`].
const TRIP_BUCKETS: usize = 40;
const TRIP_FIRST_US: f64 = 25.0;

/// What one rule said, as the page groups it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Had room.
    Allowed = 0,
    /// Refused (by the store or the denial cache).
    Limited = 1,
    /// A shadow rule that would have refused.
    ShadowLimited = 2,
    /// The store failed (open or closed).
    Failed = 3,
}

const OUTCOMES: usize = 4;

/// The process's recent activity.
pub struct Activity {
    started: Instant,
    started_at: SystemTime,
    top: TopLimited,
    store: StoreHealth,
}

/// The process-wide recorder.
pub fn get() -> &'static Activity {
    static ACTIVITY: OnceLock<Activity> = OnceLock::new();
    ACTIVITY.get_or_init(|| Activity {
        started: Instant::now(),
        started_at: SystemTime::now(),
        top: TopLimited::default(),
        store: StoreHealth::default(),
    })
}

impl Activity {
    /// How long the process has run.
    pub fn uptime(&self) -> Duration {
        self.started.elapsed()
    }

    /// When the process started.
    pub fn started_at(&self) -> SystemTime {
        self.started_at
    }

    /// Seconds since start: the clock every ring here is kept by.
    fn now_s(&self) -> u64 {
        self.started.elapsed().as_secs()
    }

    /// Seconds from start to `at`.
    fn seconds_at(&self, at: Instant) -> u64 {
        at.saturating_duration_since(self.started).as_secs()
    }

    fn now_ms(&self) -> u64 {
        u64::try_from(self.started.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    /// Records that `rule_key`'s counter (of the rule named `rule`) refused
    /// a request; the caller may retry after `retry_ms` (`None`: never, as
    /// sent).
    pub fn refused(&self, counter: &str, rule: &str, retry_ms: Option<u64>) {
        self.top.record(counter, rule, retry_ms, self.now_ms());
    }

    /// The counters refused most lately, most refused first.
    pub fn top_limited(&self, n: usize) -> Vec<Refused> {
        self.top.top(n, self.now_ms())
    }

    /// Records a store call that answered after `took`.
    pub fn store_answered(&self, took: Duration) {
        self.store.answered(took, self.now_s());
    }

    /// Records that the store answered a probe (up again, if it was down),
    /// without counting it among the round trips of decisions.
    pub fn store_reachable(&self) {
        self.store.reachable();
    }

    /// Records a store call that failed.
    pub fn store_failed(&self, error: &dyn std::fmt::Display) {
        self.store.failed(error);
    }

    /// How the store has been answering.
    pub fn store(&self) -> StoreSummary {
        self.store.summary(self.now_s())
    }
}

/// One rule's decisions: per second for the live rate, per step for the
/// chart. Written without locks from every thread; a slot is cleared by
/// the first writer of its new second, so a count racing that clear may be
/// lost: a display figure, never a limit.
pub struct RuleActivity {
    fine: [Slot; FINE_SLOTS],
    steps: [Slot; STEPS],
}

#[derive(Default)]
struct Slot {
    /// 1 + the second (or step) the counts are for; 0: never used.
    at: AtomicU64,
    counts: [AtomicU32; OUTCOMES],
}

impl Slot {
    fn add(&self, at: u64, outcome: Outcome) {
        let tag = at.saturating_add(1);
        let seen = self.at.load(Ordering::Acquire);
        if seen != tag && self.at.compare_exchange(seen, tag, Ordering::AcqRel, Ordering::Acquire).is_ok() {
            for c in &self.counts {
                c.store(0, Ordering::Relaxed);
            }
        }
        if let Some(c) = self.counts.get(outcome as usize) {
            c.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn read(&self, at: u64) -> [u32; OUTCOMES] {
        if self.at.load(Ordering::Acquire) != at.saturating_add(1) {
            return [0; OUTCOMES];
        }
        let mut out = [0; OUTCOMES];
        for (o, c) in out.iter_mut().zip(&self.counts) {
            *o = c.load(Ordering::Relaxed);
        }
        out
    }
}

/// A rule's live rate and history, as read.
#[derive(Debug, Clone, PartialEq)]
pub struct RuleSummary {
    /// Decisions per second over the last [`RATE_SECONDS`], per [`Outcome`].
    pub rate: [f64; OUTCOMES],
    /// Per [`Outcome`], counts per step of [`STEP_SECONDS`], oldest first,
    /// the last one the step under way.
    pub history: [Vec<u32>; OUTCOMES],
}

impl Default for RuleActivity {
    fn default() -> Self {
        RuleActivity {
            fine: std::array::from_fn(|_| Slot::default()),
            steps: std::array::from_fn(|_| Slot::default()),
        }
    }
}

impl RuleActivity {
    /// Records one decision of the rule, made at `at` (read once for the
    /// whole decision).
    pub fn record(&self, outcome: Outcome, at: Instant) {
        self.record_at(get().seconds_at(at), outcome);
    }

    fn record_at(&self, now_s: u64, outcome: Outcome) {
        if let Some(s) = self.fine.get(slot(now_s, FINE_SLOTS)) {
            s.add(now_s, outcome);
        }
        let step = now_s / STEP_SECONDS;
        if let Some(s) = self.steps.get(slot(step, STEPS)) {
            s.add(step, outcome);
        }
    }

    /// The rule's rate and history as of now.
    pub fn summary(&self) -> RuleSummary {
        self.summary_at(get().now_s())
    }

    fn summary_at(&self, now_s: u64) -> RuleSummary {
        let mut sums = [0u64; OUTCOMES];
        // The complete seconds before this one: the one under way would
        // make the rate dip every time a second begins.
        for second in now_s.saturating_sub(RATE_SECONDS)..now_s {
            let counts = self.fine.get(slot(second, FINE_SLOTS)).map(|s| s.read(second)).unwrap_or_default();
            for (sum, c) in sums.iter_mut().zip(counts) {
                *sum = sum.saturating_add(u64::from(c));
            }
        }
        // A process younger than the averaging time averages over its life.
        let span = now_s.clamp(1, RATE_SECONDS) as f64;
        let rate = sums.map(|s| s as f64 / span);
        let now_step = now_s / STEP_SECONDS;
        let mut history: [Vec<u32>; OUTCOMES] = std::array::from_fn(|_| Vec::with_capacity(STEPS));
        for back in (0..STEPS as u64).rev() {
            let counts = match now_step.checked_sub(back) {
                Some(step) => self.steps.get(slot(step, STEPS)).map(|s| s.read(step)).unwrap_or_default(),
                None => [0; OUTCOMES],
            };
            for (h, c) in history.iter_mut().zip(counts) {
                h.push(c);
            }
        }
        RuleSummary { rate, history }
    }
}

fn slot(at: u64, len: usize) -> usize {
    usize::try_from(at.checked_rem(len as u64).unwrap_or(0)).unwrap_or(0)
}

/// A counter refused lately.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// The counter's key.
    pub counter: String,
    /// The rule's name.
    pub rule: String,
    /// Refusals in this period and the one before.
    pub refusals: u64,
    /// Milliseconds since the last refusal.
    pub last_ms_ago: u64,
    /// Milliseconds until the last refused request could have been admitted,
    /// from now; `None` when that time has passed or it never could.
    pub retry_in_ms: Option<u64>,
}

/// The counters refused most lately, bounded: when full, a new counter
/// takes the place of the one refused least (so a flood of fresh keys
/// cannot push out a caller refused a thousand times).
#[derive(Default)]
struct TopLimited {
    counters: Mutex<HashMap<String, Entry>>,
}

struct Entry {
    rule: String,
    /// The period `now` counts (milliseconds since start / period).
    period: u64,
    now: u64,
    before: u64,
    last_ms: u64,
    /// Milliseconds since start when it may try again.
    retry_at_ms: Option<u64>,
}

impl Entry {
    /// Refusals in `period` and the one before it.
    fn refusals(&self, period: u64) -> u64 {
        match period.saturating_sub(self.period) {
            0 => self.now.saturating_add(self.before),
            1 => self.now,
            _ => 0,
        }
    }
}

impl TopLimited {
    fn record(&self, counter: &str, rule: &str, retry_ms: Option<u64>, now_ms: u64) {
        let period = now_ms / 1000 / TOP_PERIOD_S;
        let retry_at_ms = retry_ms.map(|r| now_ms.saturating_add(r));
        let mut counters = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(e) = counters.get_mut(counter) {
            match period.saturating_sub(e.period) {
                0 => {}
                1 => (e.before, e.now) = (e.now, 0),
                _ => (e.before, e.now) = (0, 0),
            }
            e.period = period;
            e.now = e.now.saturating_add(1);
            e.last_ms = now_ms;
            e.retry_at_ms = retry_at_ms;
            return;
        }
        if counters.len() >= TOP_CAPACITY {
            // The stale go, then the least refused tenth at once: a flood
            // of fresh counters costs one pass per hundred of them under
            // this lock, not one per refusal.
            let forget_ms = TOP_FORGET_S.saturating_mul(1000);
            counters.retain(|_, e| now_ms.saturating_sub(e.last_ms) < forget_ms);
            let excess = counters.len().saturating_sub(TOP_CAPACITY - TOP_CAPACITY / 10);
            if let Some(i) = excess.checked_sub(1) {
                let mut ranks: Vec<(u64, u64)> = counters.values().map(|e| (e.refusals(period), e.last_ms)).collect();
                if i < ranks.len() {
                    // Ties with the cut go too: as little refused as it.
                    let cut = *ranks.select_nth_unstable(i).1;
                    counters.retain(|_, e| (e.refusals(period), e.last_ms) > cut);
                }
            }
        }
        counters.insert(
            counter.to_owned(),
            Entry {
                rule: rule.to_owned(),
                period,
                now: 1,
                before: 0,
                last_ms: now_ms,
                retry_at_ms,
            },
        );
    }

    fn top(&self, n: usize, now_ms: u64) -> Vec<Refused> {
        let period = now_ms / 1000 / TOP_PERIOD_S;
        let forget_ms = TOP_FORGET_S.saturating_mul(1000);
        let counters = self.counters.lock().unwrap_or_else(|e| e.into_inner());
        let mut list: Vec<Refused> = counters
            .iter()
            .filter(|(_, e)| now_ms.saturating_sub(e.last_ms) < forget_ms && e.refusals(period) > 0)
            .map(|(k, e)| Refused {
                counter: k.clone(),
                rule: e.rule.clone(),
                refusals: e.refusals(period),
                last_ms_ago: now_ms.saturating_sub(e.last_ms),
                retry_in_ms: e.retry_at_ms.and_then(|at| at.checked_sub(now_ms)).filter(|&r| r > 0),
            })
            .collect();
        drop(counters);
        list.sort_by(|a, b| b.refusals.cmp(&a.refusals).then(a.last_ms_ago.cmp(&b.last_ms_ago)));
        list.truncate(n);
        list
    }
}

/// How the counter store has answered: up or down, and its round trips per
/// second of the last minute in √2-wide buckets.
struct StoreHealth {
    trips: [TripSecond; TRIP_SECONDS],
    /// The text of the failure that began the outage while the store is
    /// down; `None` once a call answered after it.
    last_error: Mutex<Option<String>>,
    /// Whether `last_error` is set: read on every call, locked only then.
    down: std::sync::atomic::AtomicBool,
}

impl Default for StoreHealth {
    fn default() -> Self {
        StoreHealth {
            trips: std::array::from_fn(|_| TripSecond::default()),
            last_error: Mutex::new(None),
            down: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

struct TripSecond {
    at: AtomicU64,
    buckets: [AtomicU32; TRIP_BUCKETS],
}

impl Default for TripSecond {
    fn default() -> Self {
        TripSecond {
            at: AtomicU64::new(0),
            buckets: std::array::from_fn(|_| AtomicU32::new(0)),
        }
    }
}

/// How the store has been answering, as read.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreSummary {
    /// Whether the last call answered.
    pub up: bool,
    /// The last failure, while down.
    pub last_error: Option<String>,
    /// Calls answered in the last minute.
    pub calls: u64,
    /// Median round trip of those, in milliseconds (a bucket's upper bound).
    pub p50_ms: Option<f64>,
    /// 99th percentile, likewise.
    pub p99_ms: Option<f64>,
}

/// The upper bound of round-trip bucket `i`, in microseconds.
fn bucket_bound_us(i: usize) -> f64 {
    TRIP_FIRST_US * std::f64::consts::SQRT_2.powi(i32::try_from(i).unwrap_or(i32::MAX))
}

impl StoreHealth {
    fn answered(&self, took: Duration, now_s: u64) {
        // Bucket i holds (bound(i-1), bound(i)]: i = ceil(2 log2(us / first)).
        let ratio = took.as_secs_f64() * 1e6 / TRIP_FIRST_US;
        let bucket = match ratio > 1.0 {
            true => ((2.0 * ratio.log2()).ceil() as usize).min(TRIP_BUCKETS - 1),
            false => 0,
        };
        if let Some(second) = self.trips.get(slot(now_s, TRIP_SECONDS)) {
            let tag = now_s.saturating_add(1);
            let seen = second.at.load(Ordering::Acquire);
            if seen != tag && second.at.compare_exchange(seen, tag, Ordering::AcqRel, Ordering::Acquire).is_ok() {
                for b in &second.buckets {
                    b.store(0, Ordering::Relaxed);
                }
            }
            if let Some(b) = second.buckets.get(bucket) {
                b.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.reachable();
    }

    fn reachable(&self) {
        if self.down.load(Ordering::Relaxed) {
            let mut last = self.last_error.lock().unwrap_or_else(|e| e.into_inner());
            *last = None;
            // Under the lock, so a failure recorded meanwhile keeps its flag.
            self.down.store(false, Ordering::Relaxed);
        }
    }

    /// Through an outage every request fails: only its first failure is
    /// written out and locked for, the rest cost one atomic load.
    fn failed(&self, error: &dyn std::fmt::Display) {
        if self.down.load(Ordering::Relaxed) {
            return;
        }
        *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(error.to_string());
        self.down.store(true, Ordering::Relaxed);
    }

    fn summary(&self, now_s: u64) -> StoreSummary {
        let mut buckets = [0u64; TRIP_BUCKETS];
        for second in now_s.saturating_add(1).saturating_sub(TRIP_SECONDS as u64)..=now_s {
            let Some(s) = self.trips.get(slot(second, TRIP_SECONDS)) else { continue };
            if s.at.load(Ordering::Acquire) != second.saturating_add(1) {
                continue;
            }
            for (sum, b) in buckets.iter_mut().zip(&s.buckets) {
                *sum = sum.saturating_add(u64::from(b.load(Ordering::Relaxed)));
            }
        }
        let calls: u64 = buckets.iter().sum();
        let quantile = |q: f64| {
            if calls == 0 {
                return None;
            }
            let rank = ((calls as f64) * q).ceil().max(1.0) as u64;
            let mut seen = 0u64;
            buckets.iter().enumerate().find_map(|(i, &n)| {
                seen = seen.saturating_add(n);
                (seen >= rank).then(|| bucket_bound_us(i) / 1000.0)
            })
        };
        let last_error = self.last_error.lock().unwrap_or_else(|e| e.into_inner()).clone();
        StoreSummary {
            up: last_error.is_none(),
            last_error,
            calls,
            p50_ms: quantile(0.5),
            p99_ms: quantile(0.99),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rules_rate_is_the_last_ten_complete_seconds() {
        let r = RuleActivity::default();
        for s in 100..110 {
            for _ in 0..3 {
                r.record_at(s, Outcome::Allowed);
            }
            r.record_at(s, Outcome::Limited);
        }
        // The second under way does not count yet.
        r.record_at(110, Outcome::Limited);
        let now = r.summary_at(110);
        assert_eq!(now.rate, [3.0, 1.0, 0.0, 0.0]);
        // Ten seconds later the old seconds are gone, not wrapped around.
        let later = r.summary_at(121);
        assert_eq!(later.rate, [0.0, 0.0, 0.0, 0.0]);
    }

    #[test]
    fn history_is_ninety_steps_oldest_first_and_forgets_what_is_older() {
        let r = RuleActivity::default();
        r.record_at(5, Outcome::Failed);
        let early = r.summary_at(15);
        assert_eq!(early.history[Outcome::Failed as usize][STEPS - 2], 1, "one step back");
        r.record_at(905, Outcome::ShadowLimited);
        r.record_at(909, Outcome::ShadowLimited);
        let s = r.summary_at(909);
        assert!(s.history.iter().all(|h| h.len() == STEPS));
        assert_eq!(s.history[Outcome::ShadowLimited as usize].last(), Some(&2));
        // Step 0 (second 5) is 90 steps back from step 90: out of the chart.
        assert_eq!(s.history[Outcome::Failed as usize].iter().sum::<u32>(), 0);
    }

    #[test]
    fn top_limited_keeps_the_most_refused_when_fresh_keys_flood_in() {
        let top = TopLimited::default();
        for _ in 0..50 {
            top.record("hot", "per-client", Some(500), 1_000);
        }
        for i in 0..(TOP_CAPACITY * 3) {
            top.record(&format!("fresh-{i}"), "per-client", Some(500), 2_000);
        }
        let list = top.top(3, 2_100);
        assert_eq!(list.first().map(|r| (r.counter.as_str(), r.refusals)), Some(("hot", 50)));
        assert_eq!(list.first().and_then(|r| r.retry_in_ms), None, "its retry time passed");
        assert!(top.counters.lock().unwrap().len() <= TOP_CAPACITY);
    }

    #[test]
    fn top_limited_counts_two_periods_then_forgets() {
        let top = TopLimited::default();
        top.record("k", "r", Some(90_000), 0);
        top.record("k", "r", Some(90_000), 61_000);
        let now = top.top(10, 61_000);
        assert_eq!(now.first().map(|r| r.refusals), Some(2));
        assert_eq!(now.first().and_then(|r| r.retry_in_ms), Some(90_000));
        assert_eq!(top.top(10, 125_000).first().map(|r| r.refusals), Some(1), "only the newer period");
        assert!(top.top(10, 400_000).is_empty(), "forgotten after five minutes");
    }

    #[test]
    fn store_percentiles_and_state() {
        let h = StoreHealth::default();
        assert_eq!(h.summary(10).calls, 0);
        assert_eq!(h.summary(10).p50_ms, None);
        for _ in 0..98 {
            h.answered(Duration::from_micros(200), 10);
        }
        h.answered(Duration::from_millis(5), 10);
        h.answered(Duration::from_millis(5), 11);
        let s = h.summary(11);
        assert_eq!(s.calls, 100);
        let p50 = s.p50_ms.unwrap();
        let p99 = s.p99_ms.unwrap();
        assert!((0.2..0.29).contains(&p50), "{p50}");
        assert!((5.0..7.1).contains(&p99), "{p99}");
        h.failed(&"redis: connection refused");
        h.failed(&"redis: timed out");
        assert!(!h.summary(11).up);
        assert_eq!(
            h.summary(11).last_error.as_deref(),
            Some("redis: connection refused"),
            "the failure that began the outage"
        );
        h.answered(Duration::from_micros(100), 12);
        assert!(h.summary(12).up);
        assert_eq!(h.summary(80).calls, 0, "a minute later the old seconds are gone");
    }
}
