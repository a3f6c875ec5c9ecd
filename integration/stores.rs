//! One behaviour suite for both counter stores: the in-process one and the
//! Redis stream script on a real `redis-server`. Time is pinned by hand (the
//! script's test clock) so every expectation is exact.

use std::sync::Arc;

use proptest::prelude::*;
use tollgate::config::Window;
use tollgate::limiter::{
    Check, CounterStore, ManualClock, MemoryStore, RedisMode, RedisStore, StoreAnswer, WindowCount,
};

use crate::common::RedisServer;

const T0: u64 = 1_700_000_000_000;

/// A store driven synchronously, one decision per call.
type Decide = Box<dyn Fn(&[Check<'_>]) -> StoreAnswer + Send + Sync>;

struct Subject {
    name: &'static str,
    clock: Arc<ManualClock>,
    store: Decide,
    _redis: Option<RedisServer>,
}

fn subjects() -> Vec<Subject> {
    let memory_clock = Arc::new(ManualClock::new(T0));
    let memory = Arc::new(MemoryStore::new(memory_clock.clone()));
    let redis = RedisServer::start();
    let redis_clock = Arc::new(ManualClock::new(T0));
    let store =
        Arc::new(RedisStore::connect(&[redis.url()], &RedisMode::Standalone, Some(redis_clock.clone())).unwrap());
    vec![
        Subject {
            name: "memory",
            clock: memory_clock,
            store: Box::new(move |c| block(memory.decide(c))),
            _redis: None,
        },
        Subject {
            name: "redis",
            clock: redis_clock,
            store: Box::new(move |c| block(store.decide(c))),
            _redis: Some(redis),
        },
    ]
}

/// The stores are async; these tests drive them one call at a time.
fn block<F: std::future::Future<Output = Result<StoreAnswer, tollgate::limiter::StoreError>>>(f: F) -> StoreAnswer {
    tokio::task::block_in_place(|| tokio::runtime::Handle::current().block_on(f)).expect("store failed")
}

fn w(requests: u64, period_ms: u64) -> Window {
    Window::exact(requests, period_ms)
}

fn check<'a>(key: &'a str, windows: &'a [Window], cost: u64) -> Check<'a> {
    Check {
        key,
        windows,
        cost,
        shadow: false,
        quota: false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn windows_slide_and_retry_times_are_exact() {
    for s in subjects() {
        let ws = [w(3, 1_000), w(5, 10_000)];
        let decide = |cost| (s.store)(&[check("k", &ws, cost)]);
        // Three at t=0, t=100, t=200.
        for i in 0..3 {
            let a = decide(1);
            assert!(a.admitted, "{} #{i}", s.name);
            assert_eq!(a.checks[0].windows[0].used, i);
            s.clock.advance(100);
        }
        // t=300: the 1s window is full; the first unit leaves at t=1000.
        let a = decide(1);
        assert!(!a.admitted, "{}", s.name);
        assert!(!a.checks[0].charged);
        assert_eq!(
            a.checks[0].windows[0],
            WindowCount {
                used: 3,
                reset_ms: 700,
                retry_ms: Some(700),
                never: false
            }
        );
        assert_eq!(
            a.checks[0].windows[1],
            WindowCount {
                used: 3,
                reset_ms: 9_700,
                retry_ms: None,
                never: false
            }
        );
        // A cost of 2 needs the first two units gone: t=1100.
        assert_eq!(decide(2).checks[0].windows[0].retry_ms, Some(800), "{}", s.name);
        // More than the limit can ever hold: never, not a whole window.
        let a = decide(4).checks[0].windows[0];
        assert_eq!((a.retry_ms, a.never), (None, true), "{}", s.name);
        s.clock.advance(699);
        assert!(!decide(1).admitted, "{}: one ms early", s.name);
        s.clock.advance(1);
        let a = decide(1);
        assert!(a.admitted, "{}: exactly on time", s.name);
        assert_eq!(a.checks[0].windows[0].used, 2);
        // t=1300: the 1s window holds one unit, the 10s window four: one more fits.
        s.clock.advance(300);
        assert!(decide(1).admitted, "{}", s.name);
        // t=2300: the 1s window is empty but the 10s one is full until the
        // unit from t=0 leaves at t=10000.
        s.clock.advance(1_000);
        let a = decide(1);
        assert!(!a.admitted, "{}", s.name);
        assert_eq!(
            a.checks[0].windows[0],
            WindowCount {
                used: 0,
                reset_ms: 1_000,
                retry_ms: None,
                never: false
            }
        );
        assert_eq!(
            a.checks[0].windows[1],
            WindowCount {
                used: 5,
                reset_ms: 7_700,
                retry_ms: Some(7_700),
                never: false
            }
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_counters_or_none() {
    for s in subjects() {
        let small = [w(1, 5_000)];
        let large = [w(10, 5_000)];
        assert!((s.store)(&[check("a", &small, 1), check("b", &large, 1)]).admitted);
        let refused = (s.store)(&[check("a", &small, 1), check("b", &large, 1)]);
        assert!(!refused.admitted);
        assert!(!refused.checks[1].charged, "{}: b was not charged", s.name);
        let b = (s.store)(&[check("b", &large, 0)]);
        assert_eq!(
            b.checks[0].windows[0].used, 1,
            "{}: b holds only the admitted request",
            s.name
        );
        assert!(!b.checks[0].charged, "cost 0 checks without charging");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shadow_counters_never_refuse() {
    for s in subjects() {
        let ws = [w(1, 5_000)];
        let shadow = Check {
            key: "s",
            windows: &ws,
            cost: 1,
            shadow: true,
            quota: false,
        };
        assert!((s.store)(&[shadow]).admitted);
        let a = (s.store)(&[shadow, check("e", &ws, 1)]);
        assert!(a.admitted, "{}", s.name);
        assert!(a.checks[0].windows[0].retry_ms.is_some(), "it reports it would refuse");
        assert!(!a.checks[0].charged && a.checks[1].charged);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_keys_expire_after_the_longest_window() {
    let redis = RedisServer::start();
    let store = RedisStore::connect(&[redis.url()], &RedisMode::Standalone, None).unwrap();
    let ws = [w(50, 1_000), w(100, 3_000)];
    for key in ["tg:exp", "tg:exp-stream"] {
        if key == "tg:exp-stream" {
            // Nine requests at nine different instants make a stream.
            for _ in 0..9 {
                store.decide(&[check(key, &ws, 1)]).await.unwrap();
                tokio::time::sleep(std::time::Duration::from_millis(2)).await;
            }
            assert_eq!(redis.cli(&["TYPE", key]).unwrap().trim(), "stream");
        } else {
            store.decide(&[check(key, &ws, 1)]).await.unwrap();
            assert_eq!(redis.cli(&["TYPE", key]).unwrap().trim(), "string");
        }
        let ttl: i64 = redis.cli(&["PTTL", key]).unwrap().trim().parse().unwrap();
        assert!((2_000..=3_000).contains(&ttl), "{key}: pttl {ttl}");
    }
    // The compact form's one entry is Redis's own time, in ms.
    let time = redis.cli(&["TIME"]).unwrap();
    let now_s: u64 = time.lines().next().unwrap().trim().parse().unwrap();
    let entry: u64 = redis.cli(&["GET", "tg:exp"]).unwrap().trim().parse().unwrap();
    assert!(entry / 1000 <= now_s && now_s - entry / 1000 <= 2, "{entry} vs {now_s}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quiet_counter_is_a_small_string_until_it_grows_into_a_stream() {
    let redis = RedisServer::start();
    let clock = Arc::new(ManualClock::new(T0));
    let store = RedisStore::connect(&[redis.url()], &RedisMode::Standalone, Some(clock.clone())).unwrap();
    let ws = [w(100, 60_000)];
    let key = "tg:grow";
    let get = || redis.cli(&["GET", key]).unwrap().trim().to_string();
    let encoding = || redis.cli(&["OBJECT", "ENCODING", key]).unwrap().trim().to_string();
    let used = |a: &StoreAnswer| a.checks[0].windows[0].used;

    // One and two requests of one unit: an integer, as a fixed-window counter.
    store.decide(&[check(key, &ws, 1)]).await.unwrap();
    assert_eq!((get(), encoding()), (T0.to_string(), "int".to_string()));
    clock.advance(52);
    store.decide(&[check(key, &ws, 1)]).await.unwrap();
    assert_eq!((get(), encoding()), (format!("{T0}52"), "int".to_string()));
    // A larger cost and a request in the same ms write the general form.
    clock.advance(8);
    store.decide(&[check(key, &ws, 3)]).await.unwrap();
    store.decide(&[check(key, &ws, 1)]).await.unwrap();
    assert_eq!(get(), format!("{T0}*1,52*1,8*4"));
    let a = store.decide(&[check(key, &ws, 0)]).await.unwrap();
    assert_eq!(used(&a), 6);

    // Up to COMPACT_ENTRIES entries it stays a string; one more, a stream
    // holding the same entries, still counted exactly.
    let mut total = 6;
    for _ in 3..tollgate::limiter::COMPACT_ENTRIES {
        clock.advance(1_000);
        store.decide(&[check(key, &ws, 2)]).await.unwrap();
        total += 2;
    }
    assert_eq!(redis.cli(&["TYPE", key]).unwrap().trim(), "string");
    clock.advance(1_000);
    let a = store.decide(&[check(key, &ws, 1)]).await.unwrap();
    assert_eq!(used(&a), total, "counted before the switch");
    total += 1;
    assert_eq!(redis.cli(&["TYPE", key]).unwrap().trim(), "stream");
    let len: usize = redis.cli(&["XLEN", key]).unwrap().trim().parse().unwrap();
    assert_eq!(len, tollgate::limiter::COMPACT_ENTRIES + 1);
    let a = store.decide(&[check(key, &ws, 0)]).await.unwrap();
    assert_eq!(used(&a), total, "counted after the switch");
    // The first entries leave the window as they would have as a string.
    clock.advance(54_500);
    let a = store.decide(&[check(key, &ws, 0)]).await.unwrap();
    assert_eq!(used(&a), total - 6);

    // Entries older than the longest window are dropped at the next write.
    let quiet = "tg:quiet";
    store.decide(&[check(quiet, &ws, 1)]).await.unwrap();
    clock.advance(60_000);
    store.decide(&[check(quiet, &ws, 1)]).await.unwrap();
    assert_eq!(
        redis.cli(&["GET", quiet]).unwrap().trim(),
        (T0 + 60_560 + 60_000).to_string()
    );
}

type Step = (u64, Vec<(usize, u64, u8)>);

/// A check's role: bit 1 shadow, bit 2 quota (envoyproxy/ratelimit's quota_mode).
fn role() -> impl Strategy<Value = u8> {
    prop_oneof![6 => Just(0u8), 1 => Just(1), 2 => Just(2), 1 => Just(3)]
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    // Costs past a window's limit, and the same counter more than once in a
    // decision (an RLS request repeating a descriptor), are part of the space.
    let pick = (0usize..5, 0u64..6, role());
    prop::collection::vec((0u64..700, prop::collection::vec(pick, 1..4)), 1..60)
}

fn windows_of(key: usize) -> Vec<Window> {
    match key {
        0 => vec![w(3, 1_000)],
        1 => vec![w(2, 300), w(5, 2_000)],
        2 => vec![w(4, 500), w(6, 1_500)],
        // Bucketed windows (a precision), beside an exact one and alone,
        // with a period that is not a multiple of the precision.
        // Rings of 31 and 151 buckets keep block sums (blocks of 8 and 16
        // buckets, the last one short), which a walk or a long advance reads
        // in place of the block's counts.
        3 => vec![w(2, 250), bucketed(4, 1_000, 300), bucketed(3, 600, 20)],
        _ => vec![bucketed(3, 700, 200), bucketed(6, 2_000, 500), bucketed(8, 1_500, 10)],
    }
}

fn bucketed(requests: u64, period_ms: u64, precision_ms: u64) -> Window {
    Window {
        requests,
        period_ms,
        precision_ms,
    }
}

/// A real Redis and a runtime shared by every case of a property test, and
/// per case a memory store and a Redis store on one manual clock, with fresh
/// Redis keys.
struct StorePair {
    runtime: tokio::runtime::Runtime,
    redis: RedisServer,
    case: std::sync::atomic::AtomicU64,
}

impl StorePair {
    fn new() -> StorePair {
        StorePair {
            runtime: tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .unwrap(),
            redis: RedisServer::start(),
            case: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// A fresh case starting at `start` ms, whose Redis counters keep at
    /// most `compact` entries before they become streams.
    fn case(&self, prefix: &str, (start, compact): Form) -> (Arc<ManualClock>, MemoryStore, RedisStore, Vec<String>) {
        let n = self.case.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let clock = Arc::new(ManualClock::new(start));
        let memory = MemoryStore::new(clock.clone());
        let redis = self
            .runtime
            .block_on(async { RedisStore::connect(&[self.redis.url()], &RedisMode::Standalone, Some(clock.clone())) })
            .unwrap()
            .with_compact_entries(compact);
        let keys = (0..5).map(|k| format!("{prefix}:{n}:{k}")).collect();
        (clock, memory, redis, keys)
    }
}

/// Where a case's clock starts and how many entries a compact counter keeps.
type Form = (u64, usize);

/// Counters that are streams from the start, that switch after 1, 2, 3 or
/// the shipped number of entries, and clocks whose ms the compact form
/// spells as an integer (13 digits) or not.
fn form() -> impl Strategy<Value = Form> {
    (
        prop_oneof![3 => Just(T0), 1 => Just(5_000u64)],
        prop_oneof![
            Just(0usize),
            Just(1),
            Just(2),
            Just(3),
            Just(tollgate::limiter::COMPACT_ENTRIES)
        ],
    )
}

fn property_cases() -> ProptestConfig {
    ProptestConfig {
        cases: 48,
        ..ProptestConfig::default()
    }
}

#[test]
fn redis_script_answers_exactly_like_the_memory_store() {
    // The memory store is checked against a plain reference model in its own
    // unit tests; here the Lua script must give identical answers, field by
    // field, for random sequences of time steps, costs and counter sets.
    let pair = StorePair::new();
    let runtime = &pair.runtime;
    proptest!(property_cases(), |(steps in steps(), form in form())| {
        let (clock, memory, redis_store, keys) = pair.case("prop", form);
        for (dt, picks) in steps {
            clock.advance(dt);
            let specs: Vec<(usize, Vec<Window>, u64, u8)> =
                picks.iter().map(|&(k, cost, role)| (k, windows_of(k), cost, role)).collect();
            let checks: Vec<Check<'_>> = specs
                .iter()
                .map(|(k, ws, cost, role)| Check {
                    key: &keys[*k],
                    windows: ws,
                    cost: *cost,
                    shadow: role & 1 == 1,
                    quota: role & 2 == 2,
                })
                .collect();
            let expected = runtime.block_on(memory.decide(&checks)).unwrap();
            let got = runtime.block_on(redis_store.decide(&checks)).unwrap();
            prop_assert_eq!(got, expected);
        }
    });
}

type Batch = (u64, Vec<Vec<(usize, usize, u64, u8)>>);

fn batches() -> impl Strategy<Value = Vec<Batch>> {
    // (key, which of its two window sets, cost, shadow): a reload can change
    // a rule's windows while requests under the old ones are in the same call.
    let pick = (0usize..4, 0usize..2, 0u64..6, role());
    let request = prop::collection::vec(pick, 1..4);
    prop::collection::vec((0u64..700, prop::collection::vec(request, 1..8)), 1..30)
}

/// Each batch decided in one script call and, one request at a time, by
/// the memory store at the same instant: the answers must be the same.
/// A pick is (key, window set, cost, role).
fn decide_batches(
    pair: &StorePair,
    prefix: &str,
    form: Form,
    windows: &[[Vec<Window>; 2]],
    batches: Vec<Batch>,
) -> Result<(), TestCaseError> {
    let (clock, memory, redis_store, keys) = pair.case(prefix, form);
    let runtime = &pair.runtime;
    for (dt, requests) in batches {
        clock.advance(dt);
        let requests: Vec<Vec<Check<'_>>> = requests
            .into_iter()
            .map(|picks| {
                picks
                    .into_iter()
                    .map(|(k, set, cost, role)| Check {
                        key: &keys[k],
                        windows: &windows[k][set],
                        cost,
                        shadow: role & 1 == 1,
                        quota: role & 2 == 2,
                    })
                    .collect()
            })
            .collect();
        let expected: Vec<StoreAnswer> = requests
            .iter()
            .map(|checks| runtime.block_on(memory.decide(checks)).unwrap())
            .collect();
        let together: Vec<&[Check<'_>]> = requests.iter().map(|c| &c[..]).collect();
        let got = runtime.block_on(redis_store.decide_in_order(&together)).unwrap();
        prop_assert_eq!(got, expected);
    }
    Ok(())
}

#[test]
fn decisions_sharing_one_script_call_answer_as_if_alone() {
    // Under load several decisions go in one script call, and the script
    // reads each counter once per call and then follows its own appends:
    // every answer must still equal the memory store's, deciding the same
    // requests one at a time at the same instant.
    let pair = StorePair::new();
    proptest!(property_cases(), |(batches in batches(), form in form())| {
        // The second set keeps the longest window (how long entries are kept
        // may differ between the stores otherwise) and changes the others.
        let windows: Vec<[Vec<Window>; 2]> = vec![
            [windows_of(0), vec![w(2, 300), w(3, 1_000)]],
            [windows_of(1), vec![w(5, 2_000)]],
            [windows_of(2), vec![w(2, 100), w(6, 1_500)]],
            // A raised limit widens a bucketed window's counts in Redis.
            [windows_of(3), vec![w(2, 250), bucketed(9, 1_000, 300), bucketed(40, 600, 20)]],
        ];
        decide_batches(&pair, "batch", form, &windows, batches)?;
    });
}

/// A batch whose requests mostly repeat one counter: (key, window set,
/// cost, role) per check, a request of two checks now and then.
fn hot_batches() -> impl Strategy<Value = Vec<Batch>> {
    let cost = prop_oneof![6 => Just(1u64), 2 => Just(2), 1 => Just(3), 1 => Just(0), 1 => Just(7)];
    let role = prop_oneof![12 => Just(0u8), 1 => Just(1), 1 => Just(2)];
    let key = prop_oneof![6 => Just(0usize), 2 => Just(1), 1 => Just(2)];
    let pick = (key, prop_oneof![4 => Just(0usize), 1 => Just(1)], cost, role);
    let request = prop_oneof![8 => prop::collection::vec(pick.clone(), 1..2), 1 => prop::collection::vec(pick, 2..3)];
    prop::collection::vec((0u64..900, prop::collection::vec(request, 1..24)), 1..20)
}

#[test]
fn a_hot_counters_decisions_in_one_call_answer_as_if_alone() {
    // Alike decisions in a row on one counter go to the script as one run
    // and come back as a count of admissions: each answer must still be
    // the memory store's, deciding the same requests one at a time, with
    // runs cut short by the limit, broken by another cost, a shadow or
    // quota check, a request of two checks or a bucketed window between
    // them, across clock steps, a compact counter turning into a stream,
    // and a window set changed by a reload.
    let pair = StorePair::new();
    proptest!(property_cases(), |(batches in hot_batches(), form in form())| {
        // A set's longest exact window is the other's (how long entries
        // are kept may differ between the stores otherwise).
        let windows: Vec<[Vec<Window>; 2]> = vec![
            [vec![w(7, 2_000)], vec![w(3, 300), w(9, 2_000)]],
            [vec![w(2, 250), w(5, 1_000)], vec![w(4, 1_000)]],
            [vec![w(6, 600)], vec![w(3, 600), bucketed(4, 1_000, 300)]],
        ];
        decide_batches(&pair, "hot", form, &windows, batches)?;
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_decisions_share_calls_and_stay_exact() {
    let redis = RedisServer::start();
    let store = Arc::new(RedisStore::connect(&[redis.url()], &RedisMode::Standalone, None).unwrap());
    let windows = [w(50, 60_000)];
    let tasks: Vec<_> = (0..400)
        .map(|_| {
            let store = store.clone();
            tokio::spawn(async move {
                let checks = [Check {
                    key: "tg:batch:hot",
                    windows: &windows,
                    cost: 1,
                    shadow: false,
                    quota: false,
                }];
                store.decide(&checks).await.unwrap().admitted
            })
        })
        .collect();
    let mut admitted = 0;
    for t in tasks {
        admitted += usize::from(t.await.unwrap());
    }
    assert_eq!(admitted, 50, "exactly the limit, however decisions were grouped");
    let stats = redis.cli(&["INFO", "commandstats"]).unwrap();
    let calls: u64 = stats
        .lines()
        .find(|l| l.starts_with("cmdstat_evalsha:"))
        .and_then(|l| l.split("calls=").nth(1)?.split(',').next()?.parse().ok())
        .unwrap_or_else(|| panic!("{stats}"));
    eprintln!("400 concurrent decisions in {calls} EVALSHA calls");
    assert!(calls < 400, "decisions waiting together went in shared calls ({calls})");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_large_cost_finds_its_retry_time_in_a_few_seeks() {
    // 200k entries of one unit each, one per ms, in a 1 h window of 200k.
    let redis = RedisServer::start();
    let fill = format!(
        "for i = 1, 200000 do redis.call('XADD', KEYS[1], string.format('%d-0', {} + i), 'n', 1, 'c', i) end",
        T0 - 200_000
    );
    redis.cli(&["EVAL", &fill, "1", "tg:walk"]).unwrap();
    redis.cli(&["CONFIG", "RESETSTAT"]).unwrap();
    let clock = Arc::new(ManualClock::new(T0 + 1));
    let store = RedisStore::connect(&[redis.url()], &RedisMode::Standalone, Some(clock.clone())).unwrap();
    let windows = [w(200_000, 3_600_000)];
    let a = store.decide(&[check("tg:walk", &windows, 150_000)]).await.unwrap();
    assert!(!a.admitted);
    // 150k units must leave; the 150,000th was admitted at T0 - 50_000.
    assert_eq!(a.checks[0].windows[0].retry_ms, Some(3_600_000 - 50_000 - 1));
    let stats = redis.cli(&["INFO", "commandstats"]).unwrap();
    let stat = |field: &str| -> u64 {
        stats
            .lines()
            .filter(|l| l.starts_with("cmdstat_xrange:") || l.starts_with("cmdstat_xrevrange:"))
            .filter_map(|l| l.split(field).nth(1)?.split(',').next()?.parse::<u64>().ok())
            .sum()
    };
    eprintln!(
        "retry time over 200k entries: {} seeks, {} us inside Redis",
        stat("calls="),
        stat("usec=")
    );
    assert!(stat("calls=") <= 40, "a binary search, not a walk\n{stats}");
    // Reading 150k entries one by one takes Redis tens of milliseconds; a
    // search reads ~20 entries. Generous: this is about work, not speed.
    assert!(stat("usec=") < 5_000, "no entry-by-entry read\n{stats}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_fresh_counters_stays_within_redis_maxmemory() {
    // README's bound for Redis: maxmemory with volatile-lru (every counter
    // carries a TTL). A flood of fresh keys then evicts the least recently
    // used counters; no decision fails for want of memory.
    let redis = RedisServer::start_with(&["--maxmemory", "3mb", "--maxmemory-policy", "volatile-lru"]);
    let store = Arc::new(RedisStore::connect(&[redis.url()], &RedisMode::Standalone, None).unwrap());
    let ws = [w(100, 3_600_000)];
    let info = |section: &str, field: &str| -> u64 {
        let text = redis.cli(&["INFO", section]).unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix(field)?.strip_prefix(':'))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("{field} in {text}"))
    };
    let before = info("memory", "used_memory");
    for round in 0..60u32 {
        let tasks: Vec<_> = (0..1_000u32)
            .map(|i| {
                let store = store.clone();
                tokio::spawn(async move {
                    let key = format!("tg:2{{5=flood|}}{round}-{i}");
                    store.decide(&[check(&key, &ws, 1)]).await
                })
            })
            .collect();
        for t in tasks {
            let answer = t.await.unwrap().expect("no decision fails while Redis evicts");
            assert!(answer.admitted);
        }
    }
    let (used, evicted) = (info("memory", "used_memory"), info("stats", "evicted_keys"));
    eprintln!("60k fresh counters: used_memory {before} -> {used}, {evicted} evicted");
    assert!(evicted > 0, "the flood outgrew 3 MB and Redis evicted counters");
    assert!(
        used <= 3 * 1024 * 1024 + 256 * 1024,
        "used_memory {used} stays near maxmemory"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bucketed_window_holds_the_largest_limit_and_its_retry_time_is_its_buckets() {
    // The largest limit a file may write, spent in one request: the Redis
    // ring's counts are 40 bits wide, and the sum must stay exact.
    let max = tollgate::config::MAX_UNITS;
    let day = 86_400_000;
    let ws = [bucketed(max, day, 60_000)];
    let buckets = tollgate::config::Buckets::new(day, 60_000);
    for s in subjects() {
        let a = (s.store)(&[check("big", &ws, max)]);
        assert!(a.admitted, "{}", s.name);
        s.clock.advance(30_000);
        let b = (s.store)(&[check("big", &ws, 1)]);
        assert!(!b.admitted, "{}", s.name);
        let window = b.checks[0].windows[0];
        let leaves = buckets.leaves_in(buckets.of(T0), T0 + 30_000);
        assert_eq!((window.used, window.retry_ms), (max, Some(leaves)), "{}", s.name);
        // A day and at most one minute after it was admitted.
        assert!((day - 30_000..day + 60_000 - 30_000).contains(&leaves), "{leaves}");
        s.clock.advance(leaves - 1);
        assert!(!(s.store)(&[check("big", &ws, 1)]).admitted, "{}: one ms early", s.name);
        s.clock.advance(1);
        let c = (s.store)(&[check("big", &ws, max)]);
        assert!(c.admitted, "{}: the whole limit again once the bucket left", s.name);
        // More than the limit in one request never fits.
        let d = (s.store)(&[check("other", &ws, max + 1)]);
        assert!(!d.admitted && d.checks[0].windows[0].never, "{}", s.name);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ring_written_before_block_sums_answers_as_it_did() {
    // A ring the script wrote before it kept block sums (its header's width
    // below 64) is rebuilt with them when first read: its counts answer as
    // the memory store answers for the same history.
    let ws = [bucketed(10, 1_000, 20)]; // 51 buckets, blocks of 8, counts of 4 bits
    let redis = RedisServer::start();
    let clock = Arc::new(ManualClock::new(T0));
    let store = RedisStore::connect(&[redis.url()], &RedisMode::Standalone, Some(clock.clone())).unwrap();
    // In memory: 3 units 800 ms ago, 4 units 200 ms ago.
    let memory_clock = Arc::new(ManualClock::new(T0 - 800));
    let memory = MemoryStore::new(memory_clock.clone());
    assert!(block(memory.decide(&[check("old", &ws, 3)])).admitted);
    memory_clock.advance(600);
    assert!(block(memory.decide(&[check("old", &ws, 4)])).admitted);
    memory_clock.advance(200);
    // In Redis, as the earlier script laid it out: u8 width, u48 newest
    // bucket, u48 sum, u48 oldest counted bucket, then the counts.
    let (first, cur) = (T0 / 20 - 40, T0 / 20 - 10);
    let slot = |j: u64| (152 + (j % 51) * 4).to_string();
    let (cur_text, first_text) = (cur.to_string(), first.to_string());
    let (first_slot, cur_slot) = (slot(first), slot(cur));
    redis
        .cli(&[
            "BITFIELD",
            "old|1000/20",
            "SET",
            "u8",
            "0",
            "4",
            "SET",
            "u48",
            "8",
            &cur_text,
            "SET",
            "u48",
            "56",
            "7",
            "SET",
            "u48",
            "104",
            &first_text,
            "SET",
            "u4",
            &first_slot,
            "3",
            "SET",
            "u4",
            &cur_slot,
            "4",
        ])
        .expect("redis-cli");
    for (dt, cost) in [(0, 4), (0, 3), (240, 4), (400, 1), (30, 2), (1_000, 10)] {
        clock.advance(dt);
        memory_clock.advance(dt);
        let got = block(store.decide(&[check("old", &ws, cost)]));
        let expected = block(memory.decide(&[check("old", &ws, cost)]));
        assert_eq!(got, expected, "cost {cost} after {dt} ms");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_within_the_newest_block_waits_only_for_the_buckets_it_needs() {
    // 51 buckets of 20 ms, blocks of 8: one unit at the start of a block,
    // then 4 at the start of the next and 5 at its end, the newest bucket.
    // The Redis ring does not keep the newest bucket's block sum, so a retry
    // walk past the oldest 8 buckets must read that block's counts.
    let ws = [bucketed(10, 1_000, 20)];
    let buckets = tollgate::config::Buckets::new(1_000, 20);
    let start = (0..51)
        .find(|k| ((T0 / 20 + k) % 51).is_multiple_of(8) && (T0 / 20 + k) % 51 <= 32)
        .unwrap();
    for s in subjects() {
        s.clock.advance(start * 20);
        assert!((s.store)(&[check("blk", &ws, 1)]).admitted, "{}", s.name);
        s.clock.advance(8 * 20);
        let at = T0 + (start + 8) * 20;
        assert!((s.store)(&[check("blk", &ws, 4)]).admitted, "{}", s.name);
        s.clock.advance(7 * 20);
        assert!((s.store)(&[check("blk", &ws, 5)]).admitted, "{}", s.name);
        let refused = (s.store)(&[check("blk", &ws, 3)]);
        assert!(!refused.admitted, "{}", s.name);
        let window = refused.checks[0].windows[0];
        // 1 + 4 units free room for 3: the second charge's bucket leaving.
        let leaves = buckets.leaves_in(buckets.of(at), at + 7 * 20);
        assert_eq!((window.used, window.retry_ms), (10, Some(leaves)), "{}", s.name);
    }
}
