//! The decision: given the counters a request touches, admit it or not.
//!
//! Every surface (proxy, Envoy RLS, ext_authz, auth_request) ends here through
//! [`Limiter::decide`]. The limiter asks a [`CounterStore`] to check and charge
//! all counters of one request together, applies each rule's failure mode when
//! the store cannot answer in time, and returns a [`Decision`] that the
//! surfaces render in their own wire format. Nothing else talks to the store.

mod clock;
mod decision;
mod denials;
mod memory;
mod redis;
mod store;

pub use clock::{Clock, ManualClock, SystemClock};
pub use decision::{Decision, Hit, RuleOutcome, Verdict, WindowOutcome};
pub use store::{Check, CheckCount, CounterStore, Store, StoreAnswer, StoreError, WindowCount};
pub use memory::{DEFAULT_MAX_COUNTERS, MemoryStore};
pub use redis::{COMPACT_ENTRIES, RedisMode, RedisStore, SentinelAuth};

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::config::{FailureMode, Rule, Window};
use crate::metrics;

/// Decides requests against a store, within a deadline.
pub struct Limiter {
    store: Store,
    /// Times cached refusals (the same clock the memory store reads).
    clock: Arc<dyn Clock>,
    deadline: Duration,
    failures: FailureLog,
    denials: denials::DenialCache,
    rejections: denials::RejectionLog,
}

impl Limiter {
    /// A limiter whose decisions wait at most `deadline` for the store.
    pub fn new(store: Store, deadline: Duration) -> Self {
        Self::with_clock(store, deadline, Arc::new(SystemClock::default()))
    }

    /// As [`Limiter::new`], with cached refusals timed by `clock` (tests
    /// that step time by hand pass the store's manual clock).
    pub fn with_clock(store: Store, deadline: Duration, clock: Arc<dyn Clock>) -> Self {
        Limiter {
            store,
            clock,
            deadline,
            failures: FailureLog::default(),
            denials: denials::DenialCache::default(),
            rejections: denials::RejectionLog::default(),
        }
    }

    /// The store's name: `memory` or `redis`.
    pub fn store_name(&self) -> &'static str {
        self.store.name()
    }

    /// Where the Redis store is, safe to show (never credentials); `None`
    /// for the memory store.
    pub fn store_address(&self) -> Option<&str> {
        match &self.store {
            Store::Memory(_) => None,
            Store::Redis(r) => Some(r.server()),
        }
    }

    /// Drops every cached denial (the limits changed, so they may be wrong).
    pub fn forget_denials(&self) {
        self.denials.clear();
    }

    /// Whether the store decides within the deadline: a real decision (one
    /// unit on a probe counter that expires within a second), so a Redis
    /// that answers PING but refuses writes (out of memory) is not ready.
    pub async fn ready(&self) -> Result<(), StoreError> {
        let windows = [Window {
            requests: crate::config::MAX_UNITS,
            period_ms: 1_000,
            precision_ms: 0,
        }];
        let probe = [Check {
            key: "tg:2{readyz}probe",
            windows: &windows,
            cost: 1,
            shadow: false,
            quota: false,
        }];
        tokio::time::timeout(self.deadline, self.store.decide(&probe))
            .await
            .map_err(|_| StoreError::Timeout(self.deadline))?
            .map(|_| ())
    }

    /// Decides one request: all hits are checked and charged together.
    pub async fn decide(&self, hits: &[Hit]) -> Decision {
        if hits.is_empty() {
            return Decision {
                verdict: Verdict::Allowed,
                rules: Vec::new(),
            };
        }
        // One read of the time for the cache, the store's timing and the
        // decision's: a request's path reads the clock enough already.
        let started = Instant::now();
        let now_ms = self.clock.at(started);
        let metrics = metrics::get();
        // When the store answered, read once for its timing and the
        // decision's.
        let mut answered = None;
        let decision = match self.denials.check(hits, now_ms) {
            Some(cached) => {
                metrics.denial_cache_hit();
                // A caller refused again and again is in use, not idle: its
                // counters must not be the ones a flood evicts, or it would
                // come back to a fresh window.
                self.store.touch(hits.iter().map(|h| h.key.as_str()));
                // As the store's decision told it, but for the enforced
                // rules that refuse: a shadow rule over its limit never
                // refuses, cached or not.
                for r in cached.rules.iter().filter(|r| r.over) {
                    let event = if r.rule.shadow {
                        metrics::RuleEvent::ShadowLimited
                    } else {
                        metrics::RuleEvent::LimitedCached
                    };
                    metrics.rule(&r.rule.name, event, started);
                }
                cached
            }
            None => {
                // The store decided after this instant: a cached refusal
                // counts its retry time from here, never from the reply.
                let (decision, at) = self.ask_store(hits, started).await;
                answered = at;
                self.denials.remember(hits, &decision, now_ms);
                // A refusal can have charged too: on Redis Cluster, a slot
                // charged before another refused (the store's gap).
                if decision.rules.iter().any(|r| r.charged) {
                    self.denials.charged(hits, &decision);
                }
                for r in &decision.rules {
                    if let Some(outcome) = rule_outcome(decision.verdict, r) {
                        metrics.rule(&r.rule.name, outcome, started);
                    }
                }
                decision
            }
        };
        if decision.verdict == Verdict::Limited {
            self.rejections.record(hits, &decision);
        }
        let ended = answered.unwrap_or_else(Instant::now);
        metrics.decision_time(ended.saturating_duration_since(started));
        decision
    }

    /// Tells the store failures no log line has told yet: called as the
    /// process stops, after the last decision.
    pub fn tell_untold_failures(&self) {
        self.failures.tell_untold();
    }

    /// What `hits` would get now, charging nothing (the admin page's dry
    /// run), as [`Limiter::decide`] would answer it: from the denial cache
    /// when it holds a refusal for them (`None` counts then), else from the
    /// store, with what it counted per hit. The metrics do not see it.
    pub async fn explain(&self, hits: &[Hit]) -> Result<(Decision, Option<Vec<CheckCount>>), StoreError> {
        if let Some(cached) = self.denials.check(hits, self.clock.now_ms()) {
            return Ok((cached, None));
        }
        let checks = checks_of(hits);
        let answer = tokio::time::timeout(self.deadline, self.store.peek(&checks))
            .await
            .map_err(|_| StoreError::Timeout(self.deadline))
            .and_then(|answer| answer);
        let answer = match answer.and_then(|a| self.one_count_per_hit(hits, a)) {
            Ok(answer) => answer,
            // As `decide` answers it with the store down.
            Err(e) => return never_fits(hits).map(|refusal| (refusal, None)).ok_or(e),
        };
        let counts = answer.checks.clone();
        Ok((decision_of(hits, answer), Some(counts)))
    }

    /// The store's decision for `hits`, asked at `asked`, and when it
    /// answered (none when it failed).
    async fn ask_store(&self, hits: &[Hit], asked: Instant) -> (Decision, Option<Instant>) {
        let checks = checks_of(hits);
        // Nothing to wait for in process: no deadline timer on the hot path.
        let answer = match self.store.in_process() {
            true => self.store.decide(&checks).await,
            false => {
                // Pinned where it is made: the deadline's wrapper then holds
                // a pointer, not another copy of the store's future.
                let decide = std::pin::pin!(self.store.decide(&checks));
                match tokio::time::timeout(self.deadline, decide).await {
                    Ok(answer) => answer,
                    Err(_) => Err(StoreError::Timeout(self.deadline)),
                }
            }
        };
        match answer.and_then(|a| self.one_count_per_hit(hits, a)) {
            Ok(answer) => {
                let answered = Instant::now();
                let took = answered.saturating_duration_since(asked);
                metrics::get().store_time(took);
                self.failures.answered();
                // The admin page shows Redis's round trips; memory has none.
                if !self.store.in_process() {
                    crate::activity::get().store_answered(took);
                }
                (decision_of(hits, answer), Some(answered))
            }
            Err(e) => (self.failed(hits, e), None),
        }
    }

    /// The store's answer, if it has one count per hit: every surface
    /// renders one outcome per hit, in order.
    fn one_count_per_hit(&self, hits: &[Hit], answer: StoreAnswer) -> Result<StoreAnswer, StoreError> {
        match answer.checks.len() == hits.len() {
            true => Ok(answer),
            false => Err(StoreError::Reply {
                store: self.store.name(),
                reason: format!("{} counters for {} checks", answer.checks.len(), hits.len()),
            }),
        }
    }

    fn failed(&self, hits: &[Hit], error: StoreError) -> Decision {
        metrics::get().store_error(error.label());
        crate::activity::get().store_failed(&error);
        // A cost above a window's whole limit never fits, whatever the
        // counters hold: refused as the store would have, not let through
        // because it could not be asked.
        if let Some(refusal) = never_fits(hits) {
            return refusal;
        }
        let verdict = failure_verdict(hits);
        self.failures.record(&error, verdict);
        let rules = hits
            .iter()
            .map(|h| RuleOutcome {
                rule: h.rule.clone(),
                over: false,
                charged: false,
                windows: Vec::new(),
            })
            .collect();
        Decision { verdict, rules }
    }
}

/// The refusal of `hits` when one of them asks an enforced window for more
/// than its whole limit, with what the hits before it on the same counter
/// ask (a descriptor repeated in one RLS request), as the stores decide it,
/// charging nothing; `None` when each could fit. What is left in the
/// windows is not known without the store: they say 0.
fn never_fits(hits: &[Hit]) -> Option<Decision> {
    // What each hit asks of its counter, with the hits before it there.
    let asked: Vec<u64> = hits
        .iter()
        .enumerate()
        .map(|(i, h)| {
            hits.iter()
                .take(i.saturating_add(1))
                .filter(|other| other.key == h.key)
                .fold(0u64, |sum, other| sum.saturating_add(other.cost))
        })
        .collect();
    let too_much = |h: &Hit, asked: u64, w: &Window| !h.rule.shadow && asked > w.requests;
    let any = hits
        .iter()
        .zip(&asked)
        .any(|(h, &asked)| h.rule.windows.iter().any(|w| too_much(h, asked, w)));
    if !any {
        return None;
    }
    let rules = hits
        .iter()
        .zip(&asked)
        .map(|(h, &asked)| {
            let windows: Vec<WindowOutcome> = h
                .rule
                .windows
                .iter()
                .filter(|w| too_much(h, asked, w))
                .map(|w| WindowOutcome {
                    window: *w,
                    remaining: 0,
                    reset_ms: 0,
                    retry_ms: None,
                    never: true,
                    unknown: true,
                })
                .collect();
            RuleOutcome {
                rule: h.rule.clone(),
                over: !windows.is_empty(),
                charged: false,
                windows,
            }
        })
        .collect();
    Some(Decision {
        verdict: Verdict::Limited,
        rules,
    })
}

/// Whether `rule` refuses when the store cannot answer: its failure mode is
/// closed and it enforces (a shadow rule never refuses).
pub fn fails_closed(rule: &Rule) -> bool {
    rule.failure_mode == FailureMode::Closed && !rule.shadow
}

/// What a request touching `hits` gets when the store cannot answer: closed
/// if any of its rules fails closed.
pub fn failure_verdict(hits: &[Hit]) -> Verdict {
    match hits.iter().any(|h| fails_closed(&h.rule)) {
        true => Verdict::FailedClosed,
        false => Verdict::FailedOpen,
    }
}

/// What the store is asked for `hits`.
fn checks_of(hits: &[Hit]) -> Vec<Check<'_>> {
    hits.iter()
        .map(|h| Check {
            key: &h.key,
            windows: &h.rule.windows,
            cost: h.cost,
            shadow: h.rule.shadow,
            quota: h.rule.quota,
        })
        .collect()
}

/// The decision the store's answer for `hits` (one count per hit) makes.
fn decision_of(hits: &[Hit], answer: StoreAnswer) -> Decision {
    let rules = hits
        .iter()
        .zip(answer.checks)
        .map(|(hit, count)| {
            let windows: Vec<WindowOutcome> = hit
                .rule
                .windows
                .iter()
                .zip(&count.windows)
                .map(|(window, c)| {
                    let taken = if count.charged { hit.cost } else { 0 };
                    WindowOutcome {
                        window: *window,
                        remaining: window.requests.saturating_sub(c.used.saturating_add(taken)),
                        reset_ms: c.reset_ms,
                        retry_ms: c.retry_ms,
                        never: c.never,
                        unknown: false,
                    }
                })
                .collect();
            RuleOutcome {
                rule: hit.rule.clone(),
                over: windows.iter().any(WindowOutcome::over),
                charged: count.charged,
                windows,
            }
        })
        .collect();
    let verdict = if answer.admitted {
        Verdict::Allowed
    } else {
        Verdict::Limited
    };
    Decision { verdict, rules }
}

/// The metrics word for what one rule said; `None` for a rule that had room
/// in a request another rule refused (it decided nothing).
fn rule_outcome(verdict: Verdict, rule: &RuleOutcome) -> Option<metrics::RuleEvent> {
    Some(match verdict {
        // Each rule by its own failure mode: one that fails open admits,
        // even in a request another rule's closed mode refuses.
        Verdict::FailedOpen | Verdict::FailedClosed if fails_closed(&rule.rule) => metrics::RuleEvent::FailedClosed,
        Verdict::FailedOpen | Verdict::FailedClosed => metrics::RuleEvent::FailedOpen,
        _ if rule.over && rule.rule.shadow => metrics::RuleEvent::ShadowLimited,
        _ if rule.over => metrics::RuleEvent::Limited,
        Verdict::Limited => return None,
        Verdict::Allowed => metrics::RuleEvent::Allowed,
    })
}

/// Logs store failures at most once a second, with how many were folded in,
/// so an outage is one readable line per second rather than one per request
/// ([`crate::log_every::Folded`]: the lines add up to every failed decision).
#[derive(Default)]
struct FailureLog(crate::log_every::Folded);

impl FailureLog {
    fn record(&self, error: &StoreError, verdict: Verdict) {
        let (earlier, now) = self.0.failed(verdict == Verdict::FailedClosed, || error.to_string());
        if let Some(t) = earlier {
            tracing::warn!(failures = t.failures(), failed_open = t.open, failed_closed = t.closed, last_error = %t.cause, "counter store: decisions failed before the last second, not told yet");
        }
        if let Some(t) = now {
            let mode = match (t.open > 0, t.closed > 0) {
                (true, true) => "failing open and closed",
                (false, true) => "failing closed",
                _ => "failing open",
            };
            tracing::warn!(%error, transient = error.is_transient(), failures = t.failures(), failed_open = t.open, failed_closed = t.closed, "counter store unavailable, {mode}");
        }
    }

    /// The store answered: failures not told yet are, if a line is due and
    /// none failed for a second (while some still fail, their own lines,
    /// which carry the error, tell them).
    fn answered(&self) {
        if let Some(t) = self.0.answered() {
            tracing::warn!(failures = t.failures(), failed_open = t.open, failed_closed = t.closed, last_error = %t.cause, "counter store answering again; decisions failed since the last line");
        }
    }

    /// Tells the failures no line has told yet, whatever the time: the
    /// process is stopping, and no later decision will.
    fn tell_untold(&self) {
        if let Some(t) = self.0.untold() {
            tracing::warn!(failures = t.failures(), failed_open = t.open, failed_closed = t.closed, last_error = %t.cause, "counter store: decisions failed since the last line, told at shutdown");
        }
    }
}

// Tested at the limiter level, on both stores: integration/limiter.rs.
