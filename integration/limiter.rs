//! The limiter's behaviour suite, one set of named tests run against both
//! counter stores: every test below exists as `limiter::memory::<name>` and
//! `limiter::redis::<name>` (a real `redis-server`). The tests decide whole
//! requests through [`Limiter::decide`], denial cache included, with time
//! stepped by hand (the Redis script's pinned clock), so each expectation
//! is exact and holds for whichever store an operator picks.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tollgate::config::parse_str;
use tollgate::limiter::{
    Clock, Decision, Hit, Limiter, ManualClock, MemoryStore, RedisMode, RedisStore, Store, Verdict,
};

use crate::common::RedisServer;

const T0: u64 = 1_700_000_000_000;

/// A limiter over one store, and the clock both read.
struct Subject {
    limiter: Limiter,
    _redis: Option<RedisServer>,
}

impl Subject {
    fn memory(clock: Arc<dyn Clock>) -> Subject {
        let store = Store::Memory(MemoryStore::new(clock.clone()));
        Subject {
            // Nothing in memory waits on a deadline.
            limiter: Limiter::with_clock(store, Duration::from_millis(50), clock),
            _redis: None,
        }
    }

    fn redis(clock: Arc<dyn Clock>) -> Subject {
        let redis = RedisServer::start();
        let store = RedisStore::connect(&[redis.url()], &RedisMode::Standalone, Some(clock.clone())).unwrap();
        Subject {
            // A debug build on a loaded machine: a generous deadline, so a
            // slow answer is not taken for a failure.
            limiter: Limiter::with_clock(Store::Redis(store), Duration::from_secs(2), clock),
            _redis: Some(redis),
        }
    }

    async fn decide(&self, hits: &[Hit]) -> Decision {
        let decision = self.limiter.decide(hits).await;
        assert!(
            !matches!(decision.verdict, Verdict::FailedOpen | Verdict::FailedClosed),
            "the store failed"
        );
        decision
    }
}

/// Each `async fn name(subject, clock)` becomes a test per store.
macro_rules! for_each_store {
    ($(async fn $name:ident($s:ident, $clock:ident: $clock_ty:ty = $make:expr) $body:block)*) => {
        mod memory {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let $clock: Arc<$clock_ty> = Arc::new($make);
                    let $s = Subject::memory($clock.clone());
                    $body
                }
            )*
        }
        mod redis {
            use super::*;
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let $clock: Arc<$clock_ty> = Arc::new($make);
                    let $s = Subject::redis($clock.clone());
                    $body
                }
            )*
        }
    };
}

/// One hit per rule of `yaml_rules` (tollgate's format), each on its own key.
fn hits(yaml_rules: &str) -> Vec<Hit> {
    let limits = parse_str(&format!("domain: t\nrules:\n{yaml_rules}"), "t.yaml").unwrap();
    limits
        .rules
        .iter()
        .map(|r| Hit {
            rule: r.clone(),
            key: format!("tg:test:{}", r.name),
            cost: 1,
        })
        .collect()
}

fn costing(mut hits: Vec<Hit>, cost: u64) -> Vec<Hit> {
    for h in &mut hits {
        h.cost = cost;
    }
    hits
}

/// A clock that moves `step` ms every time it is read: the store decides
/// later than the limiter asked, and answers later still.
struct Ticking {
    now: AtomicU64,
    step: AtomicU64,
}

impl Clock for Ticking {
    fn now_ms(&self) -> u64 {
        self.now.fetch_add(self.step.load(Ordering::SeqCst), Ordering::SeqCst)
    }
}

for_each_store! {
    async fn a_dry_run_answers_as_a_decision_would_and_charges_nothing(s, clock: ManualClock = ManualClock::new(T0)) {
        // The admin page's "what would this request get?".
        let h = costing(hits("  - name: d\n    limits: [{requests: 3, per: 10s}, {requests: 5, per: 60s}]\n"), 2);
        let (fresh, counts) = s.limiter.explain(&h).await.unwrap();
        let counts = counts.expect("from the store");
        assert_eq!(fresh.verdict, Verdict::Allowed);
        assert_eq!(counts[0].windows.iter().map(|w| w.used).collect::<Vec<_>>(), [0, 0]);
        assert!(!counts[0].charged);
        for _ in 0..5 {
            assert_eq!(s.limiter.explain(&h).await.unwrap().0.verdict, Verdict::Allowed);
        }
        assert_eq!(s.decide(&h).await.verdict, Verdict::Allowed, "the dry runs took nothing");
        clock.advance(1_000);
        let (full, counts) = s.limiter.explain(&h).await.unwrap();
        let counts = counts.expect("from the store");
        assert_eq!(full.verdict, Verdict::Limited, "2 more do not fit in 3 per 10 s");
        assert_eq!(full.retry_after_ms(), Some(9_000));
        assert_eq!(counts[0].windows.iter().map(|w| w.used).collect::<Vec<_>>(), [2, 2]);
        let decided = s.decide(&h).await;
        assert_eq!(decided.verdict, Verdict::Limited);
        assert_eq!(decided.retry_after_ms(), full.retry_after_ms(), "the dry run said what the decision says");
        let one = costing(h.clone(), 1);
        assert_eq!(s.decide(&one).await.verdict, Verdict::Allowed, "a unit still fits: nothing was charged");
        let (after, counts) = s.limiter.explain(&one).await.unwrap();
        assert_eq!(after.verdict, Verdict::Limited);
        assert_eq!(counts.expect("from the store")[0].windows[0].used, 3);
        // A refusal the denial cache holds is answered from it, as the
        // proxy would (through a store outage, too).
        assert_eq!(s.decide(&one).await.verdict, Verdict::Limited);
        let (cached, counts) = s.limiter.explain(&one).await.unwrap();
        assert_eq!(cached.verdict, Verdict::Limited);
        assert!(counts.is_none(), "answered from the denial cache");
        assert_eq!(cached.retry_after_ms(), s.decide(&one).await.retry_after_ms());
    }

    async fn a_cached_refusal_stops_naming_a_window_once_it_has_freed(s, clock: ManualClock = ManualClock::new(T0)) {
        // Found by an independent tester: with both windows full, later
        // cached refusals kept reporting the 2 s window as r=0 long after
        // it had emptied.
        let h = hits("  - name: multi\n    limits: [{requests: 2, per: 2s}, {requests: 4, per: 20s}]\n");
        for step in [0, 0, 2_000, 0] {
            clock.advance(step);
            assert_eq!(s.decide(&h).await.verdict, Verdict::Allowed);
        }
        let fresh = s.decide(&h).await;
        assert_eq!(fresh.verdict, Verdict::Limited);
        let over: Vec<u64> = fresh.rules[0].windows.iter().filter(|w| w.over()).map(|w| w.window.period_ms).collect();
        assert_eq!(over, [2_000, 20_000], "both full");
        clock.advance(3_000);
        let cached = s.decide(&h).await;
        assert_eq!(cached.verdict, Verdict::Limited);
        assert_eq!(cached.retry_after_ms(), Some(15_000), "the first units leave the 20 s window at 20 s");
        let named: Vec<(u64, u64)> = cached.rules[0].windows.iter().map(|w| (w.window.period_ms, w.remaining)).collect();
        assert_eq!(named, [(20_000, 0)], "the 2 s window has emptied: not reported as full");
    }

    async fn a_cached_refusal_keeps_its_retry_time_after_the_windows_oldest_units_left(s, clock: ManualClock = ManualClock::new(T0)) {
        // Found by the model test in CI: once a refusing window's oldest
        // units had left (its reset passed) but not enough to fit the
        // request, the cached refusal dropped the window and with it the
        // retry time: a 429 without Retry-After.
        let one = costing(hits("  - name: late\n    limits: [{requests: 3, per: 10s}]\n"), 1);
        assert_eq!(s.decide(&one).await.verdict, Verdict::Allowed);
        clock.advance(5_000);
        let two = costing(one.clone(), 2);
        assert_eq!(s.decide(&two).await.verdict, Verdict::Allowed);
        clock.advance(1_000);
        let three = costing(one.clone(), 3);
        let fresh = s.decide(&three).await;
        assert_eq!(fresh.verdict, Verdict::Limited);
        assert_eq!(fresh.retry_after_ms(), Some(9_000), "all three units must leave: at 15 s");
        assert_eq!(fresh.rules[0].windows[0].reset_ms, 4_000, "the first leaves at 10 s");
        clock.advance(4_000);
        let cached = s.decide(&three).await;
        assert_eq!(cached.verdict, Verdict::Limited);
        assert_eq!(cached.retry_after_ms(), Some(5_000), "still refused until 15 s, and said so");
        assert_eq!(cached.rules[0].windows.len(), 1, "the refusing window is still named");
        clock.advance(5_000);
        assert_eq!(s.decide(&three).await.verdict, Verdict::Allowed, "and at 15 s it fits");
    }

    async fn a_cached_refusal_keeps_a_shadow_rules_window_the_cost_exceeds(s, clock: ManualClock = ManualClock::new(T0)) {
        // Found by the model test: a request refused by an enforced rule is
        // cached; a shadow rule of it whose 1 s window the cost exceeds
        // whole lost that window from the cached answer once a second had
        // passed, as if it had room: its RLS status then named its other
        // window with a reset time, where a cost that never fits has none.
        let mut h = costing(
            hits(
                "  - name: tight\n    limits: [{requests: 1, per: 10s}]\n  - name: trial\n    shadow: true\n    limits: [{requests: 2, per: 1s}, {requests: 6, per: 20s}]\n",
            ),
            1,
        );
        assert_eq!(s.decide(&h).await.verdict, Verdict::Allowed);
        h[1].cost = 5;
        for step in [0, 1_500] {
            clock.advance(step);
            let d = s.decide(&h).await;
            assert_eq!(d.verdict, Verdict::Limited, "after {step} ms");
            assert_eq!(d.retry_after_ms(), Some(10_000 - step), "after {step} ms");
            let trial = d.rules[1].telling_window().expect("a window");
            assert!(trial.never && trial.window.period_ms == 1_000, "after {step} ms: {trial:?}");
        }
    }

    async fn remaining_and_retry_follow_the_windows(s, clock: ManualClock = ManualClock::new(T0)) {
        let h = hits("  - name: r\n    limits: [{requests: 2, per: 10s}, {requests: 3, per: 60s}]\n");
        let d = s.decide(&h).await;
        assert_eq!(d.verdict, Verdict::Allowed);
        assert_eq!(d.rules[0].windows[0].remaining, 1);
        assert_eq!(d.rules[0].windows[1].remaining, 2);
        assert_eq!(d.tightest().unwrap().1.window.period_ms, 10_000);
        clock.advance(4_000);
        assert_eq!(s.decide(&h).await.verdict, Verdict::Allowed);
        let d = s.decide(&h).await;
        assert_eq!(d.verdict, Verdict::Limited);
        assert_eq!(d.status(), http::StatusCode::TOO_MANY_REQUESTS);
        // The first unit leaves the 10 s window 6 s from now.
        assert_eq!(d.retry_after_ms(), Some(6_000));
        clock.advance(6_000);
        assert_eq!(s.decide(&h).await.verdict, Verdict::Allowed, "and not a ms later");
    }

    async fn a_request_refused_by_one_rule_charges_none(s, clock: ManualClock = ManualClock::new(T0)) {
        let both = hits(
            "  - name: roomy\n    limits: [{requests: 3, per: 10s}]\n  - name: tight\n    limits: [{requests: 1, per: 10s}]\n",
        );
        assert_eq!(s.decide(&both).await.verdict, Verdict::Allowed);
        for _ in 0..5 {
            let d = s.decide(&both).await;
            assert_eq!(d.verdict, Verdict::Limited);
            assert!(d.rules.iter().all(|r| !r.charged), "refused whole");
        }
        clock.advance(10_000);
        let roomy_only = &both[..1];
        let d = s.decide(roomy_only).await;
        assert_eq!(d.rules[0].windows[0].remaining, 2, "the refusals took nothing from roomy");
    }

    async fn shadow_rules_report_but_never_refuse(s, clock: ManualClock = ManualClock::new(T0)) {
        let h = hits("  - name: trial\n    shadow: true\n    limits: [{requests: 1, per: 10s}]\n");
        assert_eq!(s.decide(&h).await.verdict, Verdict::Allowed);
        let d = s.decide(&h).await;
        assert_eq!(d.verdict, Verdict::Allowed, "a shadow rule never refuses");
        assert!(d.rules[0].over, "but says it would have");
        assert!(d.refusing().next().is_none());
        clock.advance(1);
    }

    async fn quota_rules_are_waited_for_until_the_first_frees_up(s, clock: ManualClock = ManualClock::new(T0)) {
        let mut h = hits(
            "  - name: a\n    limits: [{requests: 1, per: 1s}]\n  - name: b\n    limits: [{requests: 1, per: 10s}]\n",
        );
        for hit in &mut h {
            Arc::make_mut(&mut hit.rule).quota = true;
        }
        assert_eq!(s.decide(&h).await.verdict, Verdict::Allowed);
        clock.advance(200);
        let d = s.decide(&h).await;
        assert_eq!(d.verdict, Verdict::Limited, "neither quota has room");
        assert_eq!(d.retry_after_ms(), Some(800), "a frees up first, and one quota is enough");
        // Asked again just before, and just when, a frees up: the cached
        // refusal must not outlive it.
        clock.advance(799);
        assert_eq!(s.decide(&h).await.verdict, Verdict::Limited);
        clock.advance(1);
        assert_eq!(s.decide(&h).await.verdict, Verdict::Allowed);
    }

    async fn a_cached_refusal_ends_no_later_than_the_real_one(
        s,
        clock: Ticking = Ticking { now: AtomicU64::new(T0), step: AtomicU64::new(0) }
    ) {
        let h = hits("  - name: r\n    limits: [{requests: 1, per: 1s}]\n");
        assert_eq!(s.decide(&h).await.verdict, Verdict::Allowed);
        // The store decides 100 ms after the limiter asked; the unit admitted
        // at T0 leaves at T0 + 1 s whatever the cache was told.
        clock.step.store(100, Ordering::SeqCst);
        assert_eq!(s.decide(&h).await.verdict, Verdict::Limited);
        clock.step.store(0, Ordering::SeqCst);
        clock.now.store(T0 + 1_000, Ordering::SeqCst);
        assert_eq!(
            s.decide(&h).await.verdict,
            Verdict::Allowed,
            "the cache must not refuse past the real retry time"
        );
    }

    async fn huge_costs_never_wrap_the_count(s, clock: ManualClock = ManualClock::new(T0)) {
        let one = hits("  - name: r\n    limits: [{requests: 10, per: 60s}]\n");
        for _ in 0..9 {
            assert_eq!(s.decide(&one).await.verdict, Verdict::Allowed);
        }
        let d = s.decide(&costing(one.clone(), u64::MAX - 8)).await;
        assert_eq!(d.verdict, Verdict::Limited, "a cost past u64 must not wrap into room");
        assert!(d.never_fits() && d.retry_after_ms().is_none(), "waiting cannot help");
        assert_eq!(s.decide(&one).await.verdict, Verdict::Allowed, "the tenth unit still fits");
        assert_eq!(s.decide(&one).await.verdict, Verdict::Limited, "and then the window is full");
        clock.advance(1);
    }

    async fn one_counter_named_twice_is_charged_with_both_costs(s, clock: ManualClock = ManualClock::new(T0)) {
        let one = hits("  - name: r\n    limits: [{requests: 5, per: 60s}]\n");
        let four = costing([one.clone(), one.clone(), one.clone(), one.clone()].concat(), 1);
        assert_eq!(s.decide(&four).await.verdict, Verdict::Allowed);
        assert_eq!(
            s.decide(&four).await.verdict,
            Verdict::Limited,
            "4 + 4 > 5: the second request is refused whole"
        );
        clock.advance(1);
        assert_eq!(s.decide(&one).await.verdict, Verdict::Allowed);
        assert_eq!(s.decide(&one).await.verdict, Verdict::Limited, "5 admitted, no more");
    }

    async fn a_cost_of_zero_reads_without_charging(s, clock: ManualClock = ManualClock::new(T0)) {
        let one = hits("  - name: r\n    limits: [{requests: 2, per: 60s}]\n");
        assert_eq!(s.decide(&one).await.verdict, Verdict::Allowed);
        for _ in 0..3 {
            let d = s.decide(&costing(one.clone(), 0)).await;
            assert_eq!(d.verdict, Verdict::Allowed);
            assert_eq!(d.rules[0].windows[0].remaining, 1, "looking costs nothing");
        }
        clock.advance(1);
        assert_eq!(s.decide(&one).await.verdict, Verdict::Allowed);
        let d = s.decide(&costing(one.clone(), 0)).await;
        assert_eq!(d.rules[0].windows[0].remaining, 0);
    }

    async fn refusals_of_requests_with_a_thousand_counters_stay_cheap(s, clock: ManualClock = ManualClock::new(T0)) {
        // A request matching N rules once made the denial cache keep its
        // whole signature once per counter: N^2 bytes per refused caller
        // (10,000 rules: 4 GB for one refusal). Such requests are now
        // decided by the store every time, and still refused exactly.
        let rules: String = (0..1_000).map(|i| format!("  - {{ name: r{i}, limits: [{{requests: 1, per: 1h}}] }}\n")).collect();
        let many = hits(&rules);
        for caller in 0..10 {
            let mine: Vec<Hit> = many.iter().map(|h| Hit { key: format!("{}:{caller}", h.key), ..h.clone() }).collect();
            assert_eq!(s.decide(&mine).await.verdict, Verdict::Allowed);
            for _ in 0..3 {
                let refused = s.decide(&mine).await;
                assert_eq!(refused.verdict, Verdict::Limited, "caller {caller}");
                assert_eq!(refused.rules.len(), 1_000);
            }
        }
        // A simple request beside them is still cached and exact.
        let one = hits("  - name: one\n    limits: [{requests: 1, per: 10s}]\n");
        assert_eq!(s.decide(&one).await.verdict, Verdict::Allowed);
        assert_eq!(s.decide(&one).await.verdict, Verdict::Limited);
        clock.advance(10_000);
        assert_eq!(s.decide(&one).await.verdict, Verdict::Allowed);
    }
}

// What only one store can show.

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_caller_refused_from_the_cache_is_not_evicted_by_a_flood() {
    // README: a caller that keeps asking while refused stays refused. Its
    // refusals come from the denial cache, yet its counter must count as
    // used, or a flood of fresh keys evicts it and the caller comes back
    // to a fresh window.
    let clock = Arc::new(ManualClock::new(T0));
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
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
