//! The decision: given the counters a request touches, admit it or not.
//!
//! Every surface (proxy, Envoy RLS, ext_authz, auth_request) ends here through
//! [`Limiter::decide`]. The limiter asks a [`CounterStore`] to check and charge
//! all counters of one request together, applies each rule's failure mode when
//! the store cannot answer in time, and returns a [`Decision`] that the
//! surfaces render in their own wire format. Nothing else talks to the store.

mod clock;
mod denials;
mod memory;
mod redis;

pub use clock::{Clock, ManualClock, SystemClock};
pub use memory::{DEFAULT_MAX_COUNTERS, MemoryStore};
pub use redis::{COMPACT_ENTRIES, RedisMode, RedisStore};

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::config::{FailureMode, Rule, Window};
use crate::metrics;

/// One counter to check (and charge) for one request.
#[derive(Debug, Clone, Copy)]
pub struct Check<'a> {
    /// The counter's key in the store.
    pub key: &'a str,
    /// Every window of the counter's rule; all must have room.
    pub windows: &'a [Window],
    /// Units this request takes from each window (0: check only).
    pub cost: u64,
    /// A shadow counter never refuses the request.
    pub shadow: bool,
    /// A quota counter refuses only when every quota counter of the request
    /// lacks room (envoyproxy/ratelimit's `quota_mode`); a shadow one has room.
    pub quota: bool,
}

/// What the store saw in one window, before this request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowCount {
    /// Units inside the window before this request.
    pub used: u64,
    /// Milliseconds until the oldest counted unit leaves the window.
    pub reset_ms: u64,
    /// Milliseconds until this request's cost fits; `None` when it fits now
    /// or never will.
    pub retry_ms: Option<u64>,
    /// The request asks more of this window than its whole limit: it can
    /// never fit, however long it waits.
    pub never: bool,
}

impl WindowCount {
    /// Whether this window has no room for the request.
    pub fn over(&self) -> bool {
        self.never || self.retry_ms.is_some()
    }
}

/// What the store did with one counter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckCount {
    /// Whether this request was added to the counter.
    pub charged: bool,
    /// One entry per window, in the order given.
    pub windows: Vec<WindowCount>,
}

/// The store's answer for a whole request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreAnswer {
    /// True when every enforcing counter had room in every window, and one
    /// quota counter did (if there were any).
    pub admitted: bool,
    /// One entry per check, in the order given.
    pub checks: Vec<CheckCount>,
}

/// Why the store could not answer. Backend-neutral: each store converts
/// its own errors (the Redis store: `limiter::redis`).
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The store did not answer within the decision deadline.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The store failed to answer: connection, I/O or a server error.
    #[error("{store}: {source}")]
    Failed {
        /// Which store (`redis`), also the failure's metric label.
        store: &'static str,
        /// Whether asking again soon may succeed (a lost connection, a
        /// failover) rather than not until an operator acts.
        transient: bool,
        /// What went wrong.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The store answered something it never should.
    #[error("unexpected reply from {store}: {reason}")]
    Reply {
        /// Which store.
        store: &'static str,
        /// What was wrong with it.
        reason: String,
    },
    /// The store cannot be set up as asked (at start-up).
    #[error("{0}")]
    Config(String),
}

impl StoreError {
    /// The `kind` label of `tollgate_store_errors_total`.
    pub fn label(&self) -> &'static str {
        match self {
            StoreError::Timeout(_) => "timeout",
            StoreError::Failed { store, .. } => store,
            StoreError::Reply { .. } => "reply",
            StoreError::Config(_) => "config",
        }
    }

    /// Whether asking again soon may succeed.
    pub fn is_transient(&self) -> bool {
        match self {
            StoreError::Timeout(_) => true,
            StoreError::Failed { transient, .. } => *transient,
            StoreError::Reply { .. } | StoreError::Config(_) => false,
        }
    }
}

/// Where counters live. Implementations decide a whole request atomically:
/// they charge every check that fits when the request is admitted (every
/// check that is neither shadow nor quota fits, and some quota check fits
/// or is shadow, if there are quota checks), and charge nothing otherwise.
pub trait CounterStore: Send + Sync {
    /// Checks every window of every counter and charges them together.
    fn decide(&self, checks: &[Check<'_>]) -> impl Future<Output = Result<StoreAnswer, StoreError>> + Send;

    /// Notes that these counters were asked about without a decision (a
    /// refusal from the denial cache), so the store keeps them as in use.
    /// A store that cannot see it cheaply does nothing.
    fn touch<'a>(&self, _keys: impl Iterator<Item = &'a str>) {}

    /// Whether the store answers in this process without waiting on I/O,
    /// so a decision needs no deadline timer.
    fn in_process(&self) -> bool {
        false
    }
}

/// The stores tollgate can run with, picked at start-up.
pub enum Store {
    /// In-process counters for a single instance (the embedded default).
    Memory(MemoryStore),
    /// Counters in Redis, shared by every instance.
    Redis(RedisStore),
}

impl Store {
    /// The store's name in logs and metrics.
    pub fn name(&self) -> &'static str {
        match self {
            Store::Memory(_) => "memory",
            Store::Redis(_) => "redis",
        }
    }
}

impl CounterStore for Store {
    async fn decide(&self, checks: &[Check<'_>]) -> Result<StoreAnswer, StoreError> {
        match self {
            Store::Memory(s) => s.decide(checks).await,
            Store::Redis(s) => s.decide(checks).await,
        }
    }

    fn touch<'a>(&self, keys: impl Iterator<Item = &'a str>) {
        match self {
            Store::Memory(s) => s.touch(keys),
            Store::Redis(s) => s.touch(keys),
        }
    }

    fn in_process(&self) -> bool {
        match self {
            Store::Memory(s) => s.in_process(),
            Store::Redis(s) => s.in_process(),
        }
    }
}

/// One rule's counter touched by a request.
#[derive(Debug, Clone)]
pub struct Hit {
    /// The rule whose windows apply.
    pub rule: Arc<Rule>,
    /// The counter key (domain, rule and descriptor values).
    pub key: String,
    /// Units this request costs.
    pub cost: u64,
}

/// The overall answer for a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Every enforcing rule had room; counters were charged.
    Allowed,
    /// At least one enforcing rule had no room; nothing was charged.
    Limited,
    /// The store failed and every touched rule fails open.
    FailedOpen,
    /// The store failed and a touched rule fails closed.
    FailedClosed,
}

impl From<Verdict> for metrics::Answer {
    fn from(v: Verdict) -> Self {
        match v {
            Verdict::Allowed => metrics::Answer::Allowed,
            Verdict::Limited => metrics::Answer::Limited,
            Verdict::FailedOpen => metrics::Answer::FailedOpen,
            Verdict::FailedClosed => metrics::Answer::FailedClosed,
        }
    }
}

impl Verdict {
    /// Whether the request goes through.
    pub fn admits(self) -> bool {
        matches!(self, Verdict::Allowed | Verdict::FailedOpen)
    }
}

/// One window of one rule, as the caller should see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowOutcome {
    /// The window (limit and length).
    pub window: Window,
    /// Units left in the window after this decision.
    pub remaining: u64,
    /// Milliseconds until more quota frees up.
    pub reset_ms: u64,
    /// Milliseconds until a request of this cost fits, when it does not now.
    pub retry_ms: Option<u64>,
    /// The request asks more of this window than its whole limit.
    pub never: bool,
}

impl WindowOutcome {
    /// Whether this window refused the request.
    pub fn over(&self) -> bool {
        self.never || self.retry_ms.is_some()
    }
}

/// What one rule said about the request.
#[derive(Debug, Clone)]
pub struct RuleOutcome {
    /// The rule.
    pub rule: Arc<Rule>,
    /// Whether some window had no room (for a shadow rule: would have refused).
    pub over: bool,
    /// Whether the request was counted against this rule.
    pub charged: bool,
    /// Per window, in the rule's order; empty when the store failed.
    pub windows: Vec<WindowOutcome>,
}

/// The decision for one request.
#[derive(Debug, Clone)]
pub struct Decision {
    /// Admit or refuse, and why.
    pub verdict: Verdict,
    /// One entry per hit, in the order given.
    pub rules: Vec<RuleOutcome>,
}

impl Decision {
    /// The enforcing rules that refused the request. Quota rules refuse
    /// only together: when none of them had room.
    pub fn refusing(&self) -> impl Iterator<Item = &RuleOutcome> {
        let quotas_refuse = self.rules.iter().filter(|r| r.rule.quota).all(|r| r.over && !r.rule.shadow);
        self.rules
            .iter()
            .filter(move |r| r.over && !r.rule.shadow && (quotas_refuse || !r.rule.quota))
    }

    /// Milliseconds until a retry of this request would be admitted: the
    /// latest of the refusing windows, since it needs room in all of them,
    /// but for quota rules the earliest of them, since one with room is
    /// enough. `None` when it was not refused, or when it can never be
    /// admitted as sent (it costs more than a window's whole limit).
    pub fn retry_after_ms(&self) -> Option<u64> {
        if self.never_fits() {
            return None;
        }
        let rule_retry = |r: &RuleOutcome| r.windows.iter().filter_map(|w| w.retry_ms).max();
        let enforced = self.refusing().filter(|r| !r.rule.quota).filter_map(rule_retry).max();
        let quota = self
            .refusing()
            .filter(|r| r.rule.quota && !r.windows.iter().any(|w| w.never))
            .filter_map(rule_retry)
            .min();
        enforced.max(quota)
    }

    /// Whether waiting cannot help: a refusing window could never hold this
    /// request's cost (for quota rules: every one of them has such a window).
    pub fn never_fits(&self) -> bool {
        let never = |r: &RuleOutcome| r.windows.iter().any(|w| w.never);
        let mut quotas = self.refusing().filter(|r| r.rule.quota).peekable();
        let quota_never = quotas.peek().is_some() && quotas.all(never);
        quota_never || self.refusing().filter(|r| !r.rule.quota).any(never)
    }

    /// The window with the least room left among enforcing rules (ties go to
    /// the one that frees up last), for the headers on an admitted response.
    pub fn tightest(&self) -> Option<(&RuleOutcome, &WindowOutcome)> {
        self.rules
            .iter()
            .filter(|r| !r.rule.shadow)
            .flat_map(|r| r.windows.iter().map(move |w| (r, w)))
            .min_by_key(|(_, w)| (w.remaining, std::cmp::Reverse(w.reset_ms)))
    }

    /// The status a refused caller gets: the first refusing rule's, or 503
    /// when the store failed closed.
    pub fn status(&self) -> http::StatusCode {
        match self.verdict {
            Verdict::FailedClosed => http::StatusCode::SERVICE_UNAVAILABLE,
            _ => self
                .refusing()
                .next()
                .map(|r| r.rule.status)
                .unwrap_or(http::StatusCode::OK),
        }
    }
}

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
        let started = Instant::now();
        let metrics = metrics::get();
        let decision = match self.denials.check(hits, self.clock.now_ms()) {
            Some(cached) => {
                metrics.denial_cache_hit();
                // A caller refused again and again is in use, not idle: its
                // counters must not be the ones a flood evicts, or it would
                // come back to a fresh window.
                self.store.touch(hits.iter().map(|h| h.key.as_str()));
                for r in cached.rules.iter().filter(|r| r.over) {
                    metrics.rule(&r.rule.name, metrics::RuleEvent::LimitedCached);
                }
                cached
            }
            None => {
                // The store decided after this instant: a cached refusal
                // counts its retry time from here, never from the reply.
                let asked = self.clock.now_ms();
                let decision = self.ask_store(hits).await;
                self.denials.remember(hits, &decision, asked);
                if decision.verdict == Verdict::Allowed {
                    self.denials.charged(hits, &decision);
                }
                for r in &decision.rules {
                    if let Some(outcome) = rule_outcome(decision.verdict, r) {
                        metrics.rule(&r.rule.name, outcome);
                    }
                }
                decision
            }
        };
        if decision.verdict == Verdict::Limited {
            self.rejections.record(hits, &decision);
        }
        metrics.decision_time(started.elapsed());
        decision
    }

    async fn ask_store(&self, hits: &[Hit]) -> Decision {
        let checks: Vec<Check<'_>> = hits
            .iter()
            .map(|h| Check {
                key: &h.key,
                windows: &h.rule.windows,
                cost: h.cost,
                shadow: h.rule.shadow,
                quota: h.rule.quota,
            })
            .collect();
        let asked = Instant::now();
        // Nothing to wait for in process: no deadline timer on the hot path.
        let answer = match self.store.in_process() {
            true => self.store.decide(&checks).await,
            false => match tokio::time::timeout(self.deadline, self.store.decide(&checks)).await {
                Ok(answer) => answer,
                Err(_) => Err(StoreError::Timeout(self.deadline)),
            },
        };
        let answer = match answer {
            // Every surface renders one outcome per hit, in order.
            Ok(answer) if answer.checks.len() != hits.len() => {
                let e = StoreError::Reply {
                    store: self.store.name(),
                    reason: format!("{} counters for {} checks", answer.checks.len(), hits.len()),
                };
                return self.failed(hits, e);
            }
            Ok(answer) => {
                metrics::get().store_time(asked.elapsed());
                answer
            }
            Err(e) => return self.failed(hits, e),
        };
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

    fn failed(&self, hits: &[Hit], error: StoreError) -> Decision {
        metrics::get().store_error(error.label());
        let closed = hits
            .iter()
            .any(|h| h.rule.failure_mode == FailureMode::Closed && !h.rule.shadow);
        let verdict = if closed {
            Verdict::FailedClosed
        } else {
            Verdict::FailedOpen
        };
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

/// The metrics word for what one rule said; `None` for a rule that had room
/// in a request another rule refused (it decided nothing).
fn rule_outcome(verdict: Verdict, rule: &RuleOutcome) -> Option<metrics::RuleEvent> {
    Some(match verdict {
        Verdict::FailedOpen => metrics::RuleEvent::FailedOpen,
        Verdict::FailedClosed => metrics::RuleEvent::FailedClosed,
        _ if rule.over && rule.rule.shadow => metrics::RuleEvent::ShadowLimited,
        _ if rule.over => metrics::RuleEvent::Limited,
        Verdict::Limited => return None,
        Verdict::Allowed => metrics::RuleEvent::Allowed,
    })
}

/// Logs store failures at most once a second, with how many were folded in,
/// so an outage is one readable line per second rather than one per request.
#[derive(Default)]
struct FailureLog {
    since_last: AtomicU64,
    last_logged_ms: AtomicU64,
}

impl FailureLog {
    fn record(&self, error: &StoreError, verdict: Verdict) {
        static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
        let elapsed = u64::try_from(START.get_or_init(Instant::now).elapsed().as_millis()).unwrap_or(u64::MAX);
        let now = elapsed.saturating_add(1000);
        let folded = self.since_last.fetch_add(1, Ordering::Relaxed);
        let last = self.last_logged_ms.load(Ordering::Relaxed);
        if now.saturating_sub(last) >= 1000
            && self
                .last_logged_ms
                .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            self.since_last.store(0, Ordering::Relaxed);
            let mode = if verdict == Verdict::FailedClosed {
                "failing closed"
            } else {
                "failing open"
            };
            tracing::warn!(%error, failures = folded.saturating_add(1), "counter store unavailable, {mode}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse_str;

    fn hits(yaml_rules: &str) -> Vec<Hit> {
        let limits = parse_str(&format!("domain: t\nrules:\n{yaml_rules}"), "t.yaml").unwrap();
        limits
            .rules
            .iter()
            .map(|r| Hit {
                rule: r.clone(),
                key: format!("k:{}", r.name),
                cost: 1,
            })
            .collect()
    }

    fn limiter(clock: &Arc<ManualClock>) -> Limiter {
        Limiter::new(
            Store::Memory(MemoryStore::new(clock.clone())),
            Duration::from_millis(50),
        )
    }

    #[tokio::test]
    async fn remaining_and_retry_follow_the_windows() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let l = limiter(&clock);
        let h = hits("  - name: r\n    limits: [{requests: 2, per: 10s}, {requests: 3, per: 60s}]\n");
        let d = l.decide(&h).await;
        assert_eq!(d.verdict, Verdict::Allowed);
        assert_eq!(d.rules[0].windows[0].remaining, 1);
        assert_eq!(d.rules[0].windows[1].remaining, 2);
        assert_eq!(d.tightest().unwrap().1.window.period_ms, 10_000);
        clock.advance(4_000);
        l.decide(&h).await;
        let d = l.decide(&h).await;
        assert_eq!(d.verdict, Verdict::Limited);
        assert_eq!(d.status(), http::StatusCode::TOO_MANY_REQUESTS);
        // The first unit leaves the 10s window 6s from now.
        assert_eq!(d.retry_after_ms(), Some(6_000));
    }

    #[tokio::test]
    async fn a_caller_refused_from_the_cache_is_not_evicted_by_a_flood() {
        // README: a caller that keeps asking while refused stays refused. Its
        // refusals come from the denial cache, yet its counter must count as
        // used, or a flood of fresh keys evicts it and the caller comes back
        // to a fresh window.
        let clock = Arc::new(ManualClock::new(1_000_000));
        let l = Limiter::with_clock(
            Store::Memory(MemoryStore::new(clock.clone()).with_max_counters(1_000)),
            Duration::from_millis(50),
            clock.clone(),
        );
        let caller = hits("  - name: pace\n    limits: [{requests: 5, per: 10s}]\n");
        // One unit now, four a second later.
        assert_eq!(l.decide(&caller).await.verdict, Verdict::Allowed);
        clock.advance(1_000);
        for _ in 0..4 {
            assert_eq!(l.decide(&caller).await.verdict, Verdict::Allowed);
        }
        let mut flood = hits("  - name: flood\n    limits: [{requests: 5, per: 10s}]\n");
        for i in 0..8_990u64 {
            clock.advance(1);
            if let Some(h) = flood.first_mut() {
                h.key = format!("fresh:{i}");
            }
            l.decide(&flood).await;
            if i % 20 == 0 {
                assert_eq!(l.decide(&caller).await.verdict, Verdict::Limited, "at {i}");
            }
        }
        // The first unit has left; the four others have not: one fits.
        clock.advance(20);
        assert_eq!(l.decide(&caller).await.verdict, Verdict::Allowed);
        assert_eq!(
            l.decide(&caller).await.verdict,
            Verdict::Limited,
            "the caller's window survived the flood"
        );
    }

    /// A clock that moves `step` ms every time it is read: the store
    /// decides later than the limiter asked, and answers later still.
    struct Ticking {
        now: AtomicU64,
        step: AtomicU64,
    }

    impl Clock for Ticking {
        fn now_ms(&self) -> u64 {
            self.now.fetch_add(self.step.load(Ordering::SeqCst), Ordering::SeqCst)
        }
    }

    #[tokio::test]
    async fn a_cached_refusal_ends_no_later_than_the_real_one() {
        let clock = Arc::new(Ticking {
            now: AtomicU64::new(1_000_000),
            step: AtomicU64::new(0),
        });
        let l = Limiter::with_clock(
            Store::Memory(MemoryStore::new(clock.clone())),
            Duration::from_millis(50),
            clock.clone(),
        );
        let h = hits("  - name: r\n    limits: [{requests: 1, per: 1s}]\n");
        assert_eq!(l.decide(&h).await.verdict, Verdict::Allowed);
        // The store decides 100 ms after the limiter asked; the unit admitted
        // at 1_000_000 leaves at 1_001_000 whatever the cache was told.
        clock.step.store(100, Ordering::SeqCst);
        assert_eq!(l.decide(&h).await.verdict, Verdict::Limited);
        clock.step.store(0, Ordering::SeqCst);
        clock.now.store(1_001_000, Ordering::SeqCst);
        assert_eq!(
            l.decide(&h).await.verdict,
            Verdict::Allowed,
            "the cache must not refuse past the real retry time"
        );
    }

    #[tokio::test]
    async fn quota_rules_are_waited_for_until_the_first_frees_up() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let l = Limiter::with_clock(
            Store::Memory(MemoryStore::new(clock.clone())),
            Duration::from_millis(50),
            clock.clone(),
        );
        let mut h = hits(
            "  - name: a\n    limits: [{requests: 1, per: 1s}]\n  - name: b\n    limits: [{requests: 1, per: 10s}]\n",
        );
        for hit in &mut h {
            Arc::make_mut(&mut hit.rule).quota = true;
        }
        assert_eq!(l.decide(&h).await.verdict, Verdict::Allowed);
        clock.advance(200);
        let d = l.decide(&h).await;
        assert_eq!(d.verdict, Verdict::Limited, "neither quota has room");
        assert_eq!(d.retry_after_ms(), Some(800), "a frees up first, and one quota is enough");
        // Asked again just before, and just when, a frees up: the cached
        // refusal must not outlive it.
        clock.advance(799);
        assert_eq!(l.decide(&h).await.verdict, Verdict::Limited);
        clock.advance(1);
        assert_eq!(l.decide(&h).await.verdict, Verdict::Allowed);
    }

    #[tokio::test]
    async fn store_failure_applies_the_failure_mode() {
        let store = RedisStore::connect(&["redis://127.0.0.1:1/".to_string()], &RedisMode::Standalone, None).unwrap();
        let l = Limiter::new(Store::Redis(store), Duration::from_millis(50));
        let open = hits("  - name: r\n    limits: [{requests: 1, per: 1s}]\n");
        assert_eq!(l.decide(&open).await.verdict, Verdict::FailedOpen);
        let closed = hits("  - name: r\n    failure_mode: closed\n    limits: [{requests: 1, per: 1s}]\n");
        let d = l.decide(&closed).await;
        assert_eq!(d.verdict, Verdict::FailedClosed);
        assert_eq!(d.status(), http::StatusCode::SERVICE_UNAVAILABLE);
    }
}
