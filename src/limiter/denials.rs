//! What the limiter remembers about refusals.
//!
//! [`DenialCache`]: a refusal stays exact until its retry time, because counts
//! inside a sliding window only grow from other instances and units leave at
//! fixed times. So a refused request is refused again, without asking the
//! store, when the very same request (the same counters with the same costs)
//! comes again before its retry time: a flood from one caller over its limit
//! costs the store about one call per retry period per instance. The whole
//! decision is kept, every counter of the request read, so the answer stays
//! exact: the same retry time, and a window whose retry or reset time has
//! passed since is no longer reported (what is left in it is not known).
//! A request this instance admits drops every cached refusal of the
//! counters it charged; a reload of the limits drops them all.
//!
//! [`RejectionLog`]: one log line per refused counter, then a summary of how
//! many more were refused, at most every few seconds per counter.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::{Decision, Hit, Verdict};

/// Most requests remembered at once; past it, expired ones go, then all.
const MAX_ENTRIES: usize = 100_000;
/// Most bytes of signatures and keys remembered at once, likewise.
const MAX_BYTES: usize = 64 << 20;
/// A request touching more counters than this is not remembered: its
/// entry would be large, and the cache is for floods of simple requests.
const MAX_HITS: usize = 64;
/// How often one counter's refusals are logged at most.
const LOG_EVERY: Duration = Duration::from_secs(10);

struct Denial {
    /// Milliseconds (the limiter's clock) until which the refusal holds.
    until: u64,
    /// When the store was asked.
    at: u64,
    /// The counters of the request, to forget it when one is charged.
    keys: Vec<String>,
    decision: Decision,
}

#[derive(Default)]
struct Entries {
    /// By request signature (see [`signature`]).
    by_request: HashMap<Arc<str>, Denial>,
    /// Counter key -> signatures of cached requests that read it (shared,
    /// so a request of N counters costs N handles, not N signatures).
    by_key: HashMap<String, HashSet<Arc<str>>>,
    /// About how many bytes the signatures and keys take.
    bytes: usize,
}

/// About what one remembered request costs in memory.
fn weight(signature: &str, keys: &[String]) -> usize {
    keys.iter()
        .map(|k| k.len().saturating_mul(2).saturating_add(64))
        .fold(signature.len(), usize::saturating_add)
}

/// Exact refusals of whole requests, until their retry time.
#[derive(Default)]
pub(super) struct DenialCache {
    entries: Mutex<Entries>,
    /// Lets the common case (nothing cached) skip the lock.
    len: AtomicUsize,
}

/// What makes two requests the same to the store: their counters, in
/// order, each with its cost and its rule's windows.
fn signature(hits: &[Hit]) -> String {
    // Built for every request while refusals are cached: itoa, not write!
    // (whose formatting machinery was two thirds of a cached refusal's
    // lookup).
    let mut s = String::with_capacity(hits.len().saturating_mul(64));
    let mut n = itoa::Buffer::new();
    for h in hits {
        s.push_str(&h.key);
        s.push('\u{0}');
        s.push_str(n.format(h.cost));
        s.push('\u{0}');
        s.push(if h.rule.shadow { '1' } else { '0' });
        s.push(if h.rule.quota { '1' } else { '0' });
        for w in &h.rule.windows {
            s.push('\u{0}');
            s.push_str(n.format(w.requests));
            s.push('/');
            s.push_str(n.format(w.period_ms));
        }
        s.push('\u{1}');
    }
    s
}

impl DenialCache {
    /// The cached refusal of this very request, if it still holds, with its
    /// times moved on to `now`.
    pub(super) fn check(&self, hits: &[Hit], now: u64) -> Option<Decision> {
        if self.len.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let signature = signature(hits);
        let entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        let d = entries.by_request.get(signature.as_str())?;
        if d.until <= now {
            return None;
        }
        let elapsed = now.saturating_sub(d.at);
        let mut decision = d.decision.clone();
        drop(entries);
        for (outcome, hit) in decision.rules.iter_mut().zip(hits) {
            // Same rule, new handle (a reload clears the cache anyway).
            outcome.rule = hit.rule.clone();
            // A window whose retry time has come since, or that had room and
            // whose reset has come, is no longer known (what is left in it
            // now): it is not reported, rather than reported stale (r=0 long
            // after it emptied). A refusing window whose first units left
            // but not yet enough of them still refuses until its retry time,
            // which is exact; the refusal's retry time is that window's.
            // One the cost exceeds whole refuses it for good (a shadow
            // rule's: an enforced one's refusal is not cached).
            let passed = |ms: u64| ms <= elapsed;
            outcome.windows.retain(|w| match w.retry_ms {
                _ if w.never => true,
                Some(retry) => !passed(retry),
                None => !passed(w.reset_ms),
            });
            for w in &mut outcome.windows {
                w.retry_ms = w.retry_ms.map(|r| r.saturating_sub(elapsed));
                // Once the oldest units left, the next to leave do so by the
                // retry time at the latest: the only reset still known.
                w.reset_ms = match w.retry_ms {
                    Some(retry) if passed(w.reset_ms) => retry,
                    _ => w.reset_ms.saturating_sub(elapsed),
                };
            }
            outcome.over = outcome.windows.iter().any(super::WindowOutcome::over);
        }
        Some(decision)
    }

    /// Remembers a refused request, from `asked` (the store decided after
    /// it, so the retry times hold from then at the latest).
    pub(super) fn remember(&self, hits: &[Hit], decision: &Decision, asked: u64) {
        if decision.verdict != Verdict::Limited || decision.rules.len() != hits.len() {
            return;
        }
        // A request that can never fit is not cached: it never reaches a
        // retry time, and answering it costs the store nothing new.
        let Some(retry) = decision.retry_after_ms() else {
            return;
        };
        if hits.len() > MAX_HITS {
            return;
        }
        let now = asked;
        let signature: Arc<str> = signature(hits).into();
        let keys: Vec<String> = hits.iter().map(|h| h.key.clone()).collect();
        let size = weight(&signature, &keys);
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if entries.by_request.len() >= MAX_ENTRIES || entries.bytes.saturating_add(size) > MAX_BYTES {
            entries.by_request.retain(|_, d| d.until > now);
            if entries.by_request.len() >= MAX_ENTRIES || entries.bytes.saturating_add(size) > MAX_BYTES {
                entries.by_request.clear();
            }
            let Entries { by_request, by_key, .. } = &mut *entries;
            by_key.retain(|_, sigs| {
                sigs.retain(|s| by_request.contains_key(s));
                !sigs.is_empty()
            });
            entries.bytes = entries.by_request.iter().map(|(s, d)| weight(s, &d.keys)).sum();
        }
        if let Some(old) = entries.by_request.remove(&signature) {
            entries.bytes = entries.bytes.saturating_sub(weight(&signature, &old.keys));
        }
        for key in &keys {
            entries.by_key.entry(key.clone()).or_default().insert(signature.clone());
        }
        entries.bytes = entries.bytes.saturating_add(size);
        entries.by_request.insert(
            signature,
            Denial {
                until: asked.saturating_add(retry),
                at: asked,
                keys,
                decision: decision.clone(),
            },
        );
        self.len.store(entries.by_request.len(), Ordering::Relaxed);
    }

    /// Forgets the refusals of requests touching counters this instance just
    /// charged: their retry times moved (later), so they are no longer exact.
    pub(super) fn charged(&self, hits: &[Hit], decision: &Decision) {
        if self.len.load(Ordering::Relaxed) == 0 {
            return;
        }
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        for (hit, outcome) in hits.iter().zip(&decision.rules) {
            if !outcome.charged {
                continue;
            }
            for sig in entries.by_key.remove(&hit.key).unwrap_or_default() {
                if let Some(d) = entries.by_request.remove(&sig) {
                    entries.bytes = entries.bytes.saturating_sub(weight(&sig, &d.keys));
                    for key in d.keys.iter().filter(|k| **k != hit.key) {
                        if let Some(sigs) = entries.by_key.get_mut(key) {
                            sigs.remove(&sig);
                            if sigs.is_empty() {
                                entries.by_key.remove(key);
                            }
                        }
                    }
                }
            }
        }
        self.len.store(entries.by_request.len(), Ordering::Relaxed);
    }

    /// Forgets everything.
    pub(super) fn clear(&self) {
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        entries.by_request.clear();
        entries.by_key.clear();
        entries.bytes = 0;
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
            let retry = match decision.never_fits() {
                true => None,
                false => outcome.windows.iter().filter_map(|w| w.retry_ms).max(),
            };
            crate::activity::get().refused(&hit.key, &outcome.rule.name, retry);
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
                window = %window.map(|w| match w.window.precision_ms {
                    0 => format!("{}/{}ms", w.window.requests, w.window.period_ms),
                    p => format!("{}/{}ms@{p}ms", w.window.requests, w.window.period_ms),
                }).unwrap_or_default(),
                retry_after_ms = window.and_then(|w| w.retry_ms).unwrap_or(0),
                // Escaped: the key holds the caller's values, which may
                // carry line breaks and terminal escapes.
                counter = ?hit.key,
                refused_since_last_line = folded,
                "rate limited"
            );
            seen.insert(hit.key.clone(), (now, 0));
        }
    }
}
