//! In-process counters: the embedded default for a single instance.
//!
//! Same layout and semantics as the Redis script (`decide.lua`): per counter
//! a list of `(time, running total)` entries, so a window's count is a binary
//! search and a subtraction, and the exact retry time is a short walk from the
//! window's oldest entry. One lock covers a whole decision, which is what
//! makes "charge every counter or none" hold.
//!
//! The store holds at most `--max-counters` counters, whatever keys callers
//! make up: expired counters are shed a few per decision (never a full
//! scan under the lock), and when the store is full a new counter takes the
//! place of the least recently used of a random sample, as NGINX's
//! `limit_req` zone and Redis's `allkeys-lru` do. An evicted caller's
//! history is forgotten: it starts a fresh window.

use std::sync::{Arc, Mutex};


mod counters;

use counters::State;

use super::{Check, CheckCount, Clock, CounterStore, StoreAnswer, StoreError, WindowCount};

/// The default bound on live counters (`--max-counters`): about 200 MB at
/// worst for one-request counters on 64-bit targets.
pub const DEFAULT_MAX_COUNTERS: usize = 1_000_000;

/// Counters kept in this process.
pub struct MemoryStore {
    clock: Arc<dyn Clock>,
    state: Mutex<State>,
    max_counters: usize,
}

impl MemoryStore {
    /// An empty store reading time from `clock`.
    pub fn new(clock: Arc<dyn Clock>) -> Self {
        MemoryStore {
            clock,
            state: Mutex::new(State::new()),
            max_counters: DEFAULT_MAX_COUNTERS,
        }
    }

    /// The same store holding at most `max` counters (at least one).
    pub fn with_max_counters(mut self, max: usize) -> Self {
        self.max_counters = max.max(1);
        self
    }

    /// How many counters are live (for tests and metrics).
    pub fn len(&self) -> usize {
        self.state.lock().unwrap_or_else(|e| e.into_inner()).counters.len()
    }

    /// Whether no counter is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Decides `checks` now; a `dry` run checks with the real costs and
    /// charges nothing.
    fn decide_now(&self, checks: &[Check<'_>], dry: bool) -> StoreAnswer {
        let now = self.clock.now_ms();
        // A panic elsewhere cannot leave a half-charged decision behind (the
        // charge loop below does not panic), so a poisoned lock is still sound.
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        state.sweep(now);
        let mut admitted = true;
        let (mut quotas, mut quota_room) = (false, false);
        let mut counts = Vec::with_capacity(checks.len());
        // Units earlier checks of this decision take from a key: a counter
        // named twice is checked against both costs, not twice against one.
        let mut claims: Vec<(&str, u64)> = Vec::new();
        for (i, check) in checks.iter().enumerate() {
            let claim = claims.iter().find(|c| c.0 == check.key).map_or(0, |c| c.1);
            let counter = state
                .counters
                .get_mut(check.key)
                .map(|c| {
                    c.used_ms = now;
                    c.advance(now);
                    &*c
                })
                .filter(|c| c.expires_at_ms > now);
            let windows: Vec<WindowCount> = check
                .windows
                .iter()
                .map(|w| match counter {
                    Some(c) => c.window(now, w, claim, check.cost),
                    None => counters::fresh(now, w, claim, check.cost),
                })
                .collect();
            let fits = windows.iter().all(|w| !w.over());
            if check.quota {
                quotas = true;
                quota_room |= fits || check.shadow;
            } else {
                admitted &= fits || check.shadow;
            }
            // Only a later check can read a claim: a decision of one check
            // (most) makes none, and no allocation for it.
            if fits && i < checks.len().saturating_sub(1) {
                match claims.iter_mut().find(|c| c.0 == check.key) {
                    Some(c) => c.1 = c.1.saturating_add(check.cost),
                    None => claims.push((check.key, check.cost)),
                }
            }
            counts.push(CheckCount { charged: fits, windows });
        }
        admitted &= !quotas || quota_room;
        for (check, count) in checks.iter().zip(counts.iter_mut()) {
            count.charged &= admitted && check.cost > 0 && !dry;
            if count.charged {
                state.charge(check.key, now, check.windows, check.cost, self.max_counters, checks);
            }
        }
        crate::metrics::get().memory_counters(state.counters.len());
        StoreAnswer {
            admitted,
            checks: counts,
        }
    }
}

impl CounterStore for MemoryStore {
    async fn decide(&self, checks: &[Check<'_>]) -> Result<StoreAnswer, StoreError> {
        Ok(self.decide_now(checks, false))
    }

    async fn peek(&self, checks: &[Check<'_>]) -> Result<StoreAnswer, StoreError> {
        Ok(self.decide_now(checks, true))
    }

    fn in_process(&self) -> bool {
        true
    }

    /// Marks these counters used now, so eviction takes them last.
    fn touch<'a>(&self, keys: impl Iterator<Item = &'a str>) {
        let now = self.clock.now_ms();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        for key in keys {
            if let Some(counter) = state.counters.get_mut(key) {
                counter.used_ms = now;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::ManualClock;
    use crate::config::Window;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn check<'a>(key: &'a str, windows: &'a [Window], cost: u64, shadow: bool) -> Check<'a> {
        with_role(key, windows, cost, u8::from(shadow))
    }

    /// A check whose role is bit 1: shadow, bit 2: quota.
    fn with_role<'a>(key: &'a str, windows: &'a [Window], cost: u64, role: u8) -> Check<'a> {
        Check {
            key,
            windows,
            cost,
            shadow: role & 1 == 1,
            quota: role & 2 == 2,
        }
    }

    #[test]
    fn idle_counters_are_swept() {
        let clock = Arc::new(ManualClock::new(1_000));
        let store = MemoryStore::new(clock.clone());
        let w = [Window {
            requests: 5,
            period_ms: 1_000,
            precision_ms: 0,
        }];
        for i in 0..100 {
            store.decide_now(&[check(&format!("k{i}"), &w, 1, false)], false);
        }
        assert_eq!(store.len(), 100);
        clock.advance(1_001);
        // A few per decision, never all at once: gone after enough decisions.
        for _ in 0..30 {
            store.decide_now(&[check("live", &w, 1, false)], false);
        }
        assert_eq!(store.len(), 1, "only the live counter is left");
    }

    #[test]
    fn the_bound_holds_under_a_flood_of_fresh_keys_and_spares_busy_counters() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let store = MemoryStore::new(clock.clone()).with_max_counters(1_000);
        let hour = [Window {
            requests: 3,
            period_ms: 3_600_000,
            precision_ms: 0,
        }];
        // A caller at its limit, asking again and again while the flood runs.
        for _ in 0..3 {
            assert!(store.decide_now(&[check("busy", &hour, 1, false)], false).admitted);
        }
        for i in 0..50_000 {
            clock.advance(1);
            store.decide_now(&[check(&format!("fresh{i}"), &hour, 1, false)], false);
            assert!(store.len() <= 1_000);
            if i % 10 == 0 {
                assert!(
                    !store.decide_now(&[check("busy", &hour, 1, false)], false).admitted,
                    "a counter read every few ms is never the least recently used of a sample (flood step {i})"
                );
            }
        }
        assert_eq!(store.len(), 1_000);
    }

    /// The plainest possible sliding window: every admitted request kept with
    /// its time, a window's count summed from scratch.
    #[derive(Default)]
    struct Model {
        log: HashMap<usize, Vec<(u64, u64)>>,
    }

    /// What the model says of one window: used (with the decision's own
    /// earlier claims), retry time, never, reset time.
    type ModelWindow = (u64, Option<u64>, bool, u64);

    /// Whether `w` counts at `now` a unit admitted at `t`: an exact window
    /// the last `period` ms; a bucketed one every unit whose bucket is fewer
    /// than `ceil(period / precision) + 1` buckets before now's.
    fn counted(w: Window, t: u64, now: u64) -> bool {
        match w.precision_ms {
            0 => now - t < w.period_ms,
            p => now / p - t / p < w.period_ms.div_ceil(p) + 1,
        }
    }

    impl Model {
        fn used(&self, key: usize, now: u64, period: u64) -> u64 {
            self.used_in(key, now, Window::exact(u64::MAX, period))
        }

        /// Units counted in `w` at `now`.
        fn used_in(&self, key: usize, now: u64, w: Window) -> u64 {
            self.log
                .get(&key)
                .map_or(0, |l| l.iter().filter(|(t, _)| counted(w, *t, now)).map(|(_, n)| n).sum())
        }

        /// One window of one check, `claim` units already taken by earlier
        /// checks of the same decision on the same key. The retry time is
        /// found by trying every future millisecond.
        fn window(&self, key: usize, now: u64, w: Window, claim: u64, cost: u64) -> ModelWindow {
            let own = self.used_in(key, now, w);
            let used = own + claim;
            let longest = w.period_ms + 2 * w.precision_ms;
            // The reset is when the oldest counted unit leaves, or with none
            // when a unit admitted now would.
            let reset = match own {
                0 => (1..=longest).find(|d| !counted(w, now, now + d)),
                _ => (1..=longest).find(|d| self.used_in(key, now + d, w) < own),
            }
            .unwrap_or(longest);
            if used + cost <= w.requests {
                return (used, None, false, reset);
            }
            if claim + cost > w.requests {
                return (used, None, true, reset);
            }
            let retry = (1..=longest).find(|d| self.used_in(key, now + d, w) + claim + cost <= w.requests);
            (used, retry, false, reset)
        }

        /// Returns (admitted, per check: charged and its windows).
        #[allow(clippy::type_complexity)]
        fn decide(
            &mut self,
            now: u64,
            checks: &[(usize, Vec<Window>, u64, u8)],
        ) -> (bool, Vec<(bool, Vec<ModelWindow>)>) {
            let mut claims: HashMap<usize, u64> = HashMap::new();
            let mut out = Vec::new();
            for (key, windows, cost, _) in checks {
                let claim = claims.get(key).copied().unwrap_or(0);
                let ws: Vec<ModelWindow> = windows
                    .iter()
                    .map(|w| self.window(*key, now, *w, claim, *cost))
                    .collect();
                let fits = ws.iter().all(|w| w.1.is_none() && !w.2);
                if fits {
                    *claims.entry(*key).or_default() += cost;
                }
                out.push((fits, ws));
            }
            // Shadow checks never refuse; quota checks refuse only when none
            // of them has room.
            let room = |(c, o): (&(usize, Vec<Window>, u64, u8), &(bool, Vec<ModelWindow>))| o.0 || c.3 & 1 == 1;
            let pairs = || checks.iter().zip(&out);
            let enforced = pairs().filter(|(c, _)| c.3 & 2 == 0).all(room);
            let quotas: Vec<_> = pairs().filter(|(c, _)| c.3 & 2 == 2).collect();
            let admitted = enforced && (quotas.is_empty() || quotas.into_iter().any(room));
            for (c, o) in checks.iter().zip(out.iter_mut()) {
                o.0 &= admitted && c.2 > 0;
                if o.0 {
                    self.log.entry(c.0).or_default().push((now, c.2));
                }
            }
            (admitted, out)
        }
    }

    type Step = (u64, Vec<(usize, u64, u8)>);

    fn steps() -> impl Strategy<Value = Vec<Step>> {
        let role = prop_oneof![6 => Just(0u8), 1 => Just(1), 2 => Just(2), 1 => Just(3)];
        let check = (0usize..5, 0u64..6, role);
        prop::collection::vec((0u64..700, prop::collection::vec(check, 1..4)), 1..120)
    }

    fn bucketed(requests: u64, period_ms: u64, precision_ms: u64) -> Window {
        Window {
            requests,
            period_ms,
            precision_ms,
        }
    }

    /// Three counters with fixed windows; each step picks some of them.
    fn rule_windows(key: usize) -> Vec<Window> {
        match key {
            0 => vec![Window {
                requests: 3,
                period_ms: 1_000,
                precision_ms: 0,
            }],
            1 => vec![
                Window {
                    requests: 2,
                    period_ms: 300,
                    precision_ms: 0,
                },
                Window {
                    requests: 5,
                    period_ms: 2_000,
                    precision_ms: 0,
                },
            ],
            // Bucketed windows beside an exact one and alone, one with a
            // period that is not a multiple of its precision.
            3 => vec![Window::exact(2, 250), bucketed(4, 1_000, 300)],
            4 => vec![bucketed(3, 700, 200), bucketed(6, 2_000, 500)],
            _ => vec![
                Window {
                    requests: 4,
                    period_ms: 500,
                    precision_ms: 0,
                },
                Window {
                    requests: 6,
                    period_ms: 1_500,
                    precision_ms: 0,
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
            let names = ["k0", "k1", "k2", "k3", "k4"];
            for (dt, picks) in steps {
                clock.advance(dt);
                // The same key may come more than once in one decision.
                same_answers(&store, &mut model, clock.now_ms(), &picks, &names, rule_windows)?;
            }
        }
    }

    /// Decides `picks` in the store and the model; every field must agree.
    fn same_answers(
        store: &MemoryStore,
        model: &mut Model,
        now: u64,
        picks: &[(usize, u64, u8)],
        names: &[&str],
        windows_of: fn(usize) -> Vec<Window>,
    ) -> Result<(), TestCaseError> {
        let specs: Vec<(usize, Vec<Window>, u64, u8)> =
            picks.iter().map(|&(k, cost, role)| (k, windows_of(k), cost, role)).collect();
        let checks: Vec<Check<'_>> =
            specs.iter().map(|(k, w, cost, role)| with_role(names[*k], w, *cost, *role)).collect();
        let answer = store.decide_now(&checks, false);
        let (admitted, expected) = model.decide(now, &specs);
        prop_assert_eq!(answer.admitted, admitted);
        for (count, (charged, windows)) in answer.checks.iter().zip(&expected) {
            prop_assert_eq!(count.charged, *charged);
            let got: Vec<ModelWindow> = count.windows.iter().map(|w| (w.used, w.retry_ms, w.never, w.reset_ms)).collect();
            prop_assert_eq!(&got, windows);
        }
        Ok(())
    }

    fn eviction_steps() -> impl Strategy<Value = Vec<Step>> {
        let role = prop_oneof![6 => Just(0u8), 1 => Just(1), 2 => Just(2), 1 => Just(3)];
        let check = (0usize..6, 0u64..4, role);
        prop::collection::vec((0u64..400, prop::collection::vec(check, 1..4)), 1..150)
    }

    proptest! {
        /// Bounded, the store answers as the reference model would if it
        /// forgot exactly the counters the store no longer holds: eviction
        /// forgets whole counters (never one the request being charged
        /// uses) and touches nothing else, the bound holds, and while every
        /// key fits nothing live is forgotten.
        #[test]
        fn eviction_only_forgets_whole_counters(steps in eviction_steps(), max in 1usize..=7) {
            let clock = Arc::new(ManualClock::new(1_000_000));
            let store = MemoryStore::new(clock.clone()).with_max_counters(max);
            let mut model = Model::default();
            let names = ["k0", "k1", "k2", "k3", "k4", "k5"];
            // The most counters one request has named so far.
            let mut widest = 0;
            for (dt, picks) in steps {
                clock.advance(dt);
                let now = clock.now_ms();
                same_answers(&store, &mut model, now, &picks, &names, |k| rule_windows(k % 3))?;
                // A bound smaller than one request's counters gives way to
                // them: a request never loses a charge it was admitted with.
                let mut own: Vec<usize> = picks.iter().map(|p| p.0).collect();
                own.sort_unstable();
                own.dedup();
                widest = widest.max(own.len());
                prop_assert!(store.len() <= max.max(widest), "{} counters held, bound {}", store.len(), max);
                let state = store.state.lock().unwrap();
                for (k, name) in names.iter().enumerate() {
                    if state.counters.contains_key(*name) {
                        continue;
                    }
                    let longest = rule_windows(k % 3).iter().map(|w| w.period_ms).max().unwrap_or(0);
                    let live = model.used(k, now, longest) > 0;
                    prop_assert!(!(live && max >= names.len()), "{} forgot live counter {}", max, name);
                    model.log.remove(&k);
                }
            }
        }
    }

    proptest! {
        /// README's promises for a window with a precision, checked on what
        /// the store admits, not through the model: within any span of
        /// `per` no more than the limit is admitted, and a refusal is one an
        /// exact window of `per + precision` would also make.
        #[test]
        fn a_precision_never_admits_more_than_the_exact_window(
            arrivals in prop::collection::vec((0u64..400, 1u64..4), 1..200),
            (limit, buckets, precision) in (1u64..8, 1u64..6, 1u64..300),
        ) {
            let per = buckets * precision;
            let w = [bucketed(limit, per, precision)];
            let clock = Arc::new(ManualClock::new(1_000_000));
            let store = MemoryStore::new(clock.clone());
            let mut admitted: Vec<(u64, u64)> = Vec::new();
            for (dt, cost) in arrivals {
                clock.advance(dt);
                let now = clock.now_ms();
                let within = |span: u64| -> u64 {
                    admitted.iter().filter(|(t, _)| now - t < span).map(|(_, n)| n).sum()
                };
                if store.decide_now(&[check("k", &w, cost, false)], false).admitted {
                    prop_assert!(within(per) + cost <= limit, "more than {} within {}ms at {}", limit, per, now);
                    admitted.push((now, cost));
                } else {
                    prop_assert!(within(per + precision) + cost > limit, "refused at {} with room in per + precision", now);
                }
            }
        }
    }

    #[test]
    fn the_retry_search_is_exact_over_a_long_window() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let store = MemoryStore::new(clock.clone());
        let w = [Window {
            requests: 200_000,
            period_ms: 3_600_000,
            precision_ms: 0,
        }];
        for _ in 0..200_000 {
            store.decide_now(&[check("k", &w, 1, false)], false);
            clock.advance(1);
        }
        // Units leave one per ms from 1_000_000 + 3_600_000 on; 150_000 of
        // them must leave, the last of which was admitted at 1_000_000 + 149_999.
        let a = store.decide_now(&[check("k", &w, 150_000, false)], false);
        let now = clock.now_ms();
        assert_eq!(
            a.checks[0].windows[0].retry_ms,
            Some(1_000_000 + 149_999 + 3_600_000 - now)
        );
    }
}
