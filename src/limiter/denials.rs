//! What the limiter remembers about refusals.
//!
//! [`DenialCache`]: a refusal stays exact until its retry time, because counts
//! inside a sliding window only grow from other instances and units leave at
//! fixed times. So a key refused for cost `k` is refused again, without asking
//! the store, for the same cost until then (a larger cost would also be
//! refused, but fits later than the cached time, which must stay exact); a flood from one caller over its
//! limit costs the store about one call per retry period per instance. A
//! reload of the limits drops the cache.
//!
//! [`RejectionLog`]: one log line per refused counter, then a summary of how
//! many more were refused, at most every few seconds per counter.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::{Decision, Hit, RuleOutcome, Verdict};

/// Most counters remembered at once; past it, expired ones go, then all.
const MAX_ENTRIES: usize = 100_000;
/// How often one counter's refusals are logged at most.
const LOG_EVERY: Duration = Duration::from_secs(10);

struct Denial {
    /// Milliseconds (the limiter's clock) until which the refusal holds.
    until: u64,
    /// When the store was asked.
    at: u64,
    /// Units the refused request asked of this counter (its cost plus what
    /// earlier checks of the same request took from it).
    demand: u64,
    outcome: RuleOutcome,
}

/// Exact refusals, by counter key, until their retry time.
#[derive(Default)]
pub(super) struct DenialCache {
    entries: Mutex<HashMap<String, Denial>>,
    /// Lets the common case (nothing cached) skip the lock.
    len: AtomicUsize,
}

/// Per hit, the units the request asks of the hit's counter up to and
/// including that hit (a counter may be named more than once).
fn demands(hits: &[Hit]) -> Vec<u64> {
    hits.iter()
        .enumerate()
        .map(|(i, hit)| {
            hits.iter()
                .take(i.saturating_add(1))
                .filter(|h| h.key == hit.key)
                .fold(0u64, |sum, h| sum.saturating_add(h.cost))
        })
        .collect()
}

impl DenialCache {
    /// A refusal for this request, if a cached denial still covers one of
    /// its counters. The decision has one outcome per hit, in order: the
    /// cached counters with their cached windows, the others unread.
    pub(super) fn check(&self, hits: &[Hit], now: u64) -> Option<Decision> {
        if self.len.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let demands = demands(hits);
        // A request some window could never hold is answered by the store
        // ("never", no retry time), whatever else is cached.
        if hits
            .iter()
            .zip(&demands)
            .any(|(h, d)| !h.rule.shadow && h.rule.windows.iter().any(|w| w.requests < *d))
        {
            return None;
        }
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let cached: Vec<Option<RuleOutcome>> = hits
            .iter()
            .zip(&demands)
            .enumerate()
            .map(|(i, (hit, demand))| {
                // A counter named again later in the request: how much the
                // store would count for it depends on whether the earlier
                // copies fit, which only the store knows. Left unread.
                if hit.rule.shadow || hits.iter().take(i).any(|h| h.key == hit.key) {
                    return None;
                }
                let d = entries.get(&hit.key)?;
                // Only the same demand: a larger one fits later than the
                // cached retry time, and that time must be exact.
                if d.until <= now || *demand != d.demand || d.outcome.rule.windows != hit.rule.windows {
                    return None;
                }
                let elapsed = now.saturating_sub(d.at);
                let mut outcome = d.outcome.clone();
                outcome.rule = hit.rule.clone();
                for w in &mut outcome.windows {
                    w.reset_ms = w.reset_ms.saturating_sub(elapsed).max(1);
                    w.retry_ms = w.retry_ms.map(|r| r.saturating_sub(elapsed).max(1));
                }
                Some(outcome)
            })
            .collect();
        drop(entries);
        if cached.iter().all(Option::is_none) {
            return None;
        }
        let rules = hits
            .iter()
            .zip(cached)
            .map(|(hit, cached)| {
                cached.unwrap_or_else(|| RuleOutcome {
                    rule: hit.rule.clone(),
                    over: false,
                    charged: false,
                    windows: Vec::new(),
                })
            })
            .collect();
        Some(Decision {
            verdict: Verdict::Limited,
            rules,
        })
    }

    /// Remembers the counters that refused this request, from `asked` (the
    /// store decided after it, so the retry times hold from then at the latest).
    pub(super) fn remember(&self, hits: &[Hit], decision: &Decision, asked: u64) {
        if decision.verdict != Verdict::Limited {
            return;
        }
        let now = asked;
        let demands = demands(hits);
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if entries.len() >= MAX_ENTRIES {
            entries.retain(|_, d| d.until > now);
            if entries.len() >= MAX_ENTRIES {
                entries.clear();
            }
        }
        for ((hit, outcome), demand) in hits.iter().zip(&decision.rules).zip(demands) {
            // A request that can never fit is not cached: it never reaches a
            // retry time, and answering it costs the store nothing new.
            if !outcome.over || hit.rule.shadow || outcome.windows.iter().any(|w| w.never) {
                continue;
            }
            let Some(retry) = outcome.windows.iter().filter_map(|w| w.retry_ms).max() else {
                continue;
            };
            entries.insert(
                hit.key.clone(),
                Denial {
                    until: asked.saturating_add(retry),
                    at: asked,
                    demand,
                    outcome: outcome.clone(),
                },
            );
        }
        self.len.store(entries.len(), Ordering::Relaxed);
    }

    /// Forgets the refusals of counters this instance just charged: their
    /// retry time moved (later), so the cached one is no longer exact.
    pub(super) fn charged(&self, hits: &[Hit], decision: &Decision) {
        if self.len.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        for (hit, outcome) in hits.iter().zip(&decision.rules) {
            if outcome.charged {
                entries.remove(&hit.key);
            }
        }
        self.len.store(entries.len(), Ordering::Relaxed);
    }

    /// Forgets everything.
    pub(super) fn clear(&self) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries.clear();
        self.len.store(0, Ordering::Relaxed);
    }
}

/// Per refused counter: when it was last logged and how many refusals since.
#[derive(Default)]
pub(super) struct RejectionLog {
    seen: Mutex<HashMap<String, (Instant, u64)>>,
}

impl RejectionLog {
    /// Logs a refusal, or folds it into the counter's next summary line.
    pub(super) fn record(&self, hits: &[Hit], decision: &Decision) {
        let now = Instant::now();
        let mut seen = self.seen.lock().unwrap_or_else(|e| e.into_inner());
        if seen.len() >= MAX_ENTRIES {
            seen.retain(|_, (at, _)| now.duration_since(*at) < LOG_EVERY);
        }
        for outcome in decision.refusing() {
            let Some(hit) = hits.iter().find(|h| h.rule.id == outcome.rule.id) else {
                continue;
            };
            let window = outcome.windows.iter().find(|w| w.over());
            let folded = match seen.get_mut(&hit.key) {
                Some((at, folded)) if now.duration_since(*at) < LOG_EVERY => {
                    *folded = folded.saturating_add(1);
                    continue;
                }
                Some((_, folded)) => *folded,
                None => 0,
            };
            tracing::info!(
                rule = %outcome.rule.name,
                window = %window.map(|w| format!("{}/{}ms", w.window.requests, w.window.period_ms)).unwrap_or_default(),
                retry_after_ms = window.and_then(|w| w.retry_ms).unwrap_or(0),
                counter = %hit.key,
                refused_since_last_line = folded,
                "rate limited"
            );
            seen.insert(hit.key.clone(), (now, 0));
        }
    }
}
