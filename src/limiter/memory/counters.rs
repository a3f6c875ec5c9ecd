//! The memory store's counters: each one's entries and window arithmetic
//! ([`Counter`]), and the bounded map of them ([`State`]): a few expired
//! counters shed per decision, and the least recently used of a sample
//! evicted when the map is full.

use std::collections::VecDeque;

use indexmap::IndexMap;

use super::super::{Check, WindowCount};
use crate::config::{Buckets, Window};

/// Counters each decision looks at for expiry: enough to shed them faster
/// than decisions create them, never a scan of the whole store.
const SWEEP_STEP: usize = 4;
/// Counters sampled to choose the one to evict.
const EVICTION_SAMPLES: usize = 8;
/// Shortest pause between two "evicting" log lines.
const EVICTION_LOG_EVERY_MS: u64 = 60_000;

pub(super) struct State {
    /// Indexed, so the sweep can walk it and eviction can sample it.
    pub(super) counters: IndexMap<String, Counter>,
    /// Where the sweep looks next.
    sweep_at: usize,
    /// xorshift64 state for eviction samples.
    rng: u64,
    /// Live counters evicted since the last log line, and when that was.
    evicted_unlogged: u64,
    last_eviction_log_ms: Option<u64>,
}

/// One counter: entries oldest first, each with the running total after it.
///
/// Running totals wrap modulo 2^64 and are only ever subtracted from one
/// another, so a window's count stays exact however long the counter lives
/// (limits and costs are capped far below 2^64, see `config::MAX_UNITS`).
pub(super) struct Counter {
    /// Running total before the oldest kept entry.
    base: u64,
    entries: VecDeque<(u64, u64)>,
    /// When the entries stop mattering: the longest exact window after the
    /// last exact charge (as the Redis stream's expiry). A rule reloaded to
    /// bucketed windows only leaves them to lapse, not to count forever.
    entries_expire_ms: u64,
    /// One ring per bucketed window (its `precision`), kept while it holds
    /// counts even if a reload took the window away (as the Redis ring's key
    /// is kept until it expires): the window coming back finds them.
    rings: Vec<Ring>,
    /// When the whole counter stops mattering (entries and every ring).
    pub(super) expires_at_ms: u64,
    /// When a decision last read or charged it (the eviction order).
    pub(super) used_ms: u64,
}

/// A bucketed window's counts: the buckets that hold any, oldest first,
/// as `(bucket, units)`, within the buckets a unit is counted in (see
/// [`Buckets`]); the Redis store keeps the same counts in a fixed ring.
struct Ring {
    period: u64,
    buckets: Buckets,
    counts: VecDeque<(u64, u64)>,
    /// Units in `counts`.
    sum: u64,
    /// The newest bucket seen: a clock that steps back stays in it.
    cur: u64,
}

impl Ring {
    fn new(w: &Window, b: Buckets) -> Ring {
        Ring {
            period: w.period_ms,
            buckets: b,
            counts: VecDeque::new(),
            sum: 0,
            cur: 0,
        }
    }

    fn is(&self, w: &Window, b: Buckets) -> bool {
        self.period == w.period_ms && self.buckets == b
    }

    /// Drops the buckets that stopped counting by `now`.
    fn advance(&mut self, now: u64) {
        self.cur = self.cur.max(self.buckets.of(now));
        while let Some(&(j, n)) = self.counts.front() {
            if j.saturating_add(self.buckets.len) > self.cur {
                break;
            }
            self.sum = self.sum.saturating_sub(n);
            self.counts.pop_front();
        }
    }

    fn charge(&mut self, cost: u64) {
        match self.counts.back_mut() {
            Some((j, n)) if *j == self.cur => *n = n.saturating_add(cost),
            _ => self.counts.push_back((self.cur, cost)),
        }
        self.sum = self.sum.saturating_add(cost);
    }

    /// As [`Counter::window`], for this ring (advanced to `now`).
    fn window(&self, now: u64, limit: u64, claim: u64, cost: u64) -> WindowCount {
        let used = self.sum.saturating_add(claim);
        let reset_ms = self
            .counts
            .front()
            .map_or(self.buckets.leaves_in(self.cur, now), |&(j, _)| self.buckets.leaves_in(j, now));
        let (retry_ms, never) = if used.saturating_add(cost) <= limit {
            (None, false)
        } else if claim.saturating_add(cost) > limit {
            (None, true)
        } else {
            // Buckets leave oldest first: the one whose leaving frees enough.
            let excess = used.saturating_add(cost).saturating_sub(limit);
            let mut freed = 0u64;
            let leaving = self.counts.iter().find(|&&(_, n)| {
                freed = freed.saturating_add(n);
                freed >= excess
            });
            let j = leaving.map_or(self.cur, |&(j, _)| j);
            (Some(self.buckets.leaves_in(j, now)), false)
        };
        WindowCount {
            used,
            reset_ms,
            retry_ms,
            never,
        }
    }
}

/// A window of a counter that holds nothing: only this decision's `claim`.
/// It resets when a unit admitted now would stop counting: after `per`, or
/// for a bucketed window when the current bucket leaves.
pub(super) fn fresh(now: u64, w: &Window, claim: u64, cost: u64) -> WindowCount {
    WindowCount {
        used: claim,
        reset_ms: w.buckets().map_or(w.period_ms, |b| b.leaves_in(b.of(now), now)),
        retry_ms: None,
        never: claim.saturating_add(cost) > w.requests,
    }
}

impl Counter {
    fn total(&self) -> u64 {
        self.entries.back().map_or(self.base, |e| e.1)
    }

    fn total_before(&self, index: usize) -> u64 {
        match index.checked_sub(1).and_then(|i| self.entries.get(i)) {
            Some(e) => e.1,
            None => self.base,
        }
    }

    /// Moves every bucketed window to `now` (what left them is dropped).
    pub(super) fn advance(&mut self, now: u64) {
        for ring in &mut self.rings {
            ring.advance(now);
        }
    }

    /// Counts one window (advanced to `now`, if bucketed) and works out when
    /// `claim` (units this decision already takes from the counter) plus
    /// `cost` would fit.
    pub(super) fn window(&self, now: u64, w: &Window, claim: u64, cost: u64) -> WindowCount {
        match w.buckets() {
            Some(b) => match self.rings.iter().find(|r| r.is(w, b)) {
                Some(ring) => ring.window(now, w.requests, claim, cost),
                None => fresh(now, w, claim, cost),
            },
            None if self.entries_expire_ms <= now => fresh(now, w, claim, cost),
            None => self.exact_window(now, w.requests, w.period_ms, claim, cost),
        }
    }

    fn exact_window(&self, now: u64, limit: u64, period: u64, claim: u64, cost: u64) -> WindowCount {
        let start = now.saturating_add(1).saturating_sub(period);
        let first = self.entries.partition_point(|e| e.0 < start);
        let before_first = self.total_before(first);
        let (counted, reset_ms) = match self.entries.get(first) {
            Some(&(at, _)) => (
                self.total().wrapping_sub(before_first),
                at.saturating_add(period).saturating_sub(now),
            ),
            None => (0, period),
        };
        let used = counted.saturating_add(claim);
        let demand = claim.saturating_add(cost);
        let (retry_ms, never) = if used.saturating_add(cost) <= limit {
            (None, false)
        } else if demand > limit {
            (None, true)
        } else {
            // Entries leave oldest first: the first entry whose departure
            // frees `excess` units. Running totals only grow inside the
            // window, so this is a binary search, not a walk.
            let excess = used.saturating_add(cost).saturating_sub(limit);
            let i = self
                .entries
                .partition_point(|e| e.0 < start || e.1.wrapping_sub(before_first) < excess);
            let retry = self
                .entries
                .get(i)
                .map_or(period, |e| e.0.saturating_add(period).saturating_sub(now));
            (Some(retry), false)
        };
        WindowCount {
            used,
            reset_ms,
            retry_ms,
            never,
        }
    }
}

impl State {
    /// An empty map.
    pub(super) fn new() -> State {
        State {
            counters: IndexMap::new(),
            sweep_at: 0,
            rng: 0x9E37_79B9_7F4A_7C15,
            evicted_unlogged: 0,
            last_eviction_log_ms: None,
        }
    }

    /// Sheds the expired counters among the next few.
    pub(super) fn sweep(&mut self, now: u64) {
        for _ in 0..SWEEP_STEP {
            if self.sweep_at >= self.counters.len() {
                self.sweep_at = 0;
            }
            match self.counters.get_index(self.sweep_at) {
                // The last counter moves into this slot: look at it next.
                Some((_, c)) if c.expires_at_ms <= now => {
                    self.counters.swap_remove_index(self.sweep_at);
                }
                Some(_) => self.sweep_at = self.sweep_at.saturating_add(1),
                None => return,
            }
        }
    }

    fn random(&mut self) -> u64 {
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.rng = x;
        x
    }

    /// Frees one slot: the expired or least recently used counter of a
    /// random sample, never one of `spared`'s. Nothing when every counter
    /// is spared (a bound smaller than one request's counters).
    fn evict_one(&mut self, now: u64, spared: &[Check<'_>]) {
        let len = self.counters.len();
        let Some(len_u64) = u64::try_from(len).ok().filter(|l| *l > 0) else {
            return;
        };
        let is_spared = |key: &str| spared.iter().any(|c| c.key == key);
        let mut victim: Option<(usize, u64)> = None;
        for _ in 0..EVICTION_SAMPLES {
            let i = usize::try_from(self.random().checked_rem(len_u64).unwrap_or(0)).unwrap_or(0);
            let Some((key, c)) = self.counters.get_index(i) else {
                continue;
            };
            if is_spared(key) {
                continue;
            }
            // Expired counters go first; among live ones, the least recently used.
            let age = if c.expires_at_ms <= now { 0 } else { c.used_ms.saturating_add(1) };
            if victim.is_none_or(|(_, best)| age < best) {
                victim = Some((i, age));
            }
        }
        if victim.is_none() {
            // Every sample was spared: the first counter that is not, within
            // one more step than there are spared counters.
            victim = (0..len)
                .take(spared.len().saturating_add(1))
                .find(|&i| self.counters.get_index(i).is_some_and(|(key, _)| !is_spared(key)))
                .and_then(|i| self.counters.get_index(i).map(|(_, c)| (i, c.used_ms.saturating_add(1))));
        }
        let Some((i, age)) = victim else {
            return;
        };
        self.counters.swap_remove_index(i);
        if age == 0 {
            return;
        }
        crate::metrics::get().counter_evicted();
        self.evicted_unlogged = self.evicted_unlogged.saturating_add(1);
        let due = self
            .last_eviction_log_ms
            .is_none_or(|at| now.saturating_sub(at) >= EVICTION_LOG_EVERY_MS);
        if due {
            tracing::warn!(
                counters = len,
                evicted = self.evicted_unlogged,
                "memory store full (--max-counters): evicting the least recently used counters; their callers start fresh windows"
            );
            self.last_eviction_log_ms = Some(now);
            self.evicted_unlogged = 0;
        }
    }

    /// Charges `cost` to `key`, making room first when it is new. `decision`
    /// is every check of the request being charged: none of its counters is
    /// evicted to make room for another, or the request would lose a charge
    /// it was admitted with.
    pub(super) fn charge(&mut self, key: &str, now: u64, windows: &[Window], cost: u64, max: usize, decision: &[Check<'_>]) {
        if !self.counters.contains_key(key) {
            while self.counters.len() >= max {
                let before = self.counters.len();
                self.evict_one(now, decision);
                if self.counters.len() == before {
                    break;
                }
            }
            self.counters.insert(
                key.to_string(),
                Counter {
                    base: 0,
                    entries: VecDeque::new(),
                    entries_expire_ms: 0,
                    rings: Vec::new(),
                    expires_at_ms: 0,
                    used_ms: now,
                },
            );
        }
        let Some(counter) = self.counters.get_mut(key) else {
            return;
        };
        counter.used_ms = now;
        if counter.expires_at_ms <= now {
            counter.rings.clear();
        }
        if counter.entries_expire_ms <= now {
            counter.base = 0;
            counter.entries.clear();
        }
        let longest = Window::longest_exact_ms(windows);
        if longest > 0 {
            let oldest_kept = now.saturating_add(1).saturating_sub(longest);
            while counter.entries.front().is_some_and(|e| e.0 < oldest_kept) {
                counter.base = counter.entries.pop_front().map_or(counter.base, |e| e.1);
            }
            let total = counter.total().wrapping_add(cost);
            counter.entries.push_back((now, total));
            counter.entries_expire_ms = now.saturating_add(longest);
        }
        // A ring whose counts have all left is as good as none.
        counter.advance(now);
        counter.rings.retain(|r| r.sum > 0);
        for (w, b) in windows.iter().filter_map(|w| w.buckets().map(|b| (w, b))) {
            match counter.rings.iter_mut().find(|r| r.is(w, b)) {
                Some(ring) => ring.charge(cost),
                None => {
                    let mut ring = Ring::new(w, b);
                    ring.advance(now);
                    ring.charge(cost);
                    counter.rings.push(ring);
                }
            }
        }
        counter.expires_at_ms = counter
            .rings
            .iter()
            .map(|r| now.saturating_add(r.buckets.leaves_in(r.cur, now)))
            .fold(counter.entries_expire_ms, u64::max);
    }
}

