//! The decision script's wire format: the arguments of one call and the
//! reply read back into answers (the script itself is `decide.lua`).

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use redis::Script;
use redis::aio::ConnectionLike;

use crate::config::Window;
use crate::limiter::{Check, CheckCount, Clock, StoreAnswer, StoreError, WindowCount};

/// The decision script, loaded once per server and then called by hash.
const DECIDE_LUA: &str = include_str!("decide.lua");

/// A check that can wait in a queue or cross tasks.
#[derive(Clone)]
pub(super) struct OwnedCheck {
    pub(super) key: String,
    pub(super) windows: Vec<Window>,
    pub(super) cost: u64,
    pub(super) shadow: bool,
    pub(super) quota: bool,
}

/// The decision script and what every call of it carries.
#[derive(Clone)]
pub(super) struct DecideScript {
    script: Arc<Script>,
    /// Whether a `SCRIPT LOAD` went ahead of the first call. Without it,
    /// the first call on a fresh server fails with `NOSCRIPT` before
    /// redis-rs loads the script, and that error shows in the server's
    /// error statistics; a server that restarts later costs one again.
    loaded: Arc<AtomicBool>,
    pinned_clock: Option<Arc<dyn Clock>>,
    pub(super) compact_entries: usize,
    /// The decision deadline (`--redis-timeout`): a call Redis runs later
    /// than its callers waited charges nothing.
    pub(super) deadline: Option<Duration>,
    /// The server's clock as quick replies tell it, shared by every
    /// thread's calls without a lock.
    server_clock: Arc<ServerClock>,
}

/// The server's clock as a quick reply told it: the clock minus tollgate's
/// (ms since `base`) when that call was sent, and when that was. Read as
/// now + offset it is ahead of the server's by at most the call's way
/// there, never behind; two atomics, as a read that mixes two replies
/// only misplaces the drift slack by the time between them.
struct ServerClock {
    base: Instant,
    offset: AtomicI64,
    /// Ms since `base` when `offset` was learned; `u64::MAX`: never.
    learned: AtomicU64,
}

impl ServerClock {
    fn new() -> Self {
        ServerClock {
            base: Instant::now(),
            offset: AtomicI64::new(0),
            learned: AtomicU64::new(u64::MAX),
        }
    }

    fn ms(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.base).as_millis()).unwrap_or(u64::MAX)
    }
}

/// A reply slower than this does not set the server's clock: the bound
/// would drift late by as much.
const QUICK_REPLY: Duration = Duration::from_millis(10);

/// A server clock learned longer ago than this is not relied on. Under
/// load it is learned again with every quick reply; a stall (no quick
/// reply) keeps the last one, with the slack growing for drift.
const CLOCK_LIFETIME: Duration = Duration::from_secs(600);

/// Slack on the bound past the deadline. The learned clock can only read
/// ahead of the server's (by the calibrating call's way there), so a call
/// run in time is never past the bound but for drift: this, plus
/// [`DRIFT_DIVISOR`]'s share of the clock's age. A call run within the
/// slack of its callers giving up is still charged.
const LATE_MARGIN: Duration = Duration::from_millis(2);

/// Two clocks drift apart by at most 1/2000 of the time (NTP slews at up
/// to 500 ppm).
const DRIFT_DIVISOR: u32 = 2000;

pub(super) fn owned_checks(checks: &[Check<'_>]) -> Vec<OwnedCheck> {
    checks
        .iter()
        .map(|c| OwnedCheck {
            key: c.key.to_string(),
            windows: c.windows.to_vec(),
            cost: c.cost,
            shadow: c.shadow,
            quota: c.quota,
        })
        .collect()
}

/// The one answer of a call that decided one request.
pub(super) fn single(mut answers: Vec<StoreAnswer>) -> Result<StoreAnswer, StoreError> {
    answers.pop().ok_or_else(|| super::bad_reply("empty reply"))
}

/// Longest a script call is waited for when no decision deadline is set
/// (Cluster, tests), and the least otherwise.
const CALL_LIMIT: Duration = Duration::from_secs(1);

impl DecideScript {
    /// How long a call may take before it is given up: twice the decision
    /// deadline (its callers have long gone), at least [`CALL_LIMIT`].
    pub(super) fn call_limit(&self) -> Duration {
        self.deadline.map_or(CALL_LIMIT, |d| d.saturating_mul(2).max(CALL_LIMIT))
    }

    /// The script, with Redis's clock (or `pinned_clock`, for tests) and
    /// counters compact up to `compact_entries` entries.
    pub(super) fn new(pinned_clock: Option<Arc<dyn Clock>>, compact_entries: usize) -> Self {
        DecideScript {
            script: Arc::new(Script::new(DECIDE_LUA)),
            loaded: Arc::new(AtomicBool::new(false)),
            pinned_clock,
            compact_entries,
            deadline: None,
            server_clock: Arc::new(ServerClock::new()),
        }
    }

    /// The time on the server's clock after which a call sent at `sent`
    /// is too late to charge, or 0 when it is not known (no deadline, a
    /// pinned clock, nothing learned of the server's clock lately). Only
    /// ever later than the truth: a call its callers still wait for is
    /// never taken for late.
    fn not_after(&self, sent: Instant) -> i64 {
        let Some(deadline) = self.deadline.filter(|_| self.pinned_clock.is_none()) else {
            return 0;
        };
        let clock = &self.server_clock;
        let learned = clock.learned.load(Ordering::Acquire);
        let now = clock.ms(sent);
        let age = Duration::from_millis(now.saturating_sub(learned));
        if learned == u64::MAX || age > CLOCK_LIFETIME {
            return 0;
        }
        let slack = deadline
            .saturating_add(LATE_MARGIN)
            .saturating_add(age.checked_div(DRIFT_DIVISOR).unwrap_or_default());
        let server_now = i64::try_from(now)
            .unwrap_or(i64::MAX)
            .saturating_add(clock.offset.load(Ordering::Relaxed));
        server_now.saturating_add(i64::try_from(slack.as_millis()).unwrap_or(i64::MAX))
    }

    /// Learns the server's clock from a reply to a call sent at `sent`.
    fn learn_clock(&self, server_ms: i64, sent: Instant) {
        if sent.elapsed() <= QUICK_REPLY {
            let clock = &self.server_clock;
            let at = clock.ms(sent);
            clock
                .offset
                .store(server_ms.saturating_sub(i64::try_from(at).unwrap_or(i64::MAX)), Ordering::Relaxed);
            clock.learned.store(at, Ordering::Release);
        }
    }

    /// One script call deciding `decisions` (each: its checks, and whether
    /// it is a dry run that charges nothing), the first of which began to
    /// wait at `asked`: the call charges nothing once that decision's
    /// deadline has passed, however long the call took to go out (a PING
    /// first, a connection made again).
    pub(super) async fn call<C: ConnectionLike + Send>(
        &self,
        conn: &mut C,
        decisions: &[(&[OwnedCheck], bool)],
        asked: Instant,
    ) -> Result<Vec<StoreAnswer>, StoreError> {
        if !self.loaded.load(Ordering::Relaxed) {
            self.script.load_async(conn).await?;
            self.loaded.store(true, Ordering::Relaxed);
        }
        let pinned = self.pinned_clock.as_ref().map_or(0, |c| c.now_ms());
        let sent = Instant::now();
        let not_after = self.not_after(asked.min(sent));
        let shapes = Shapes::of(decisions);
        let mut call = self.script.prepare_invoke();
        call.arg(pinned).arg(self.compact_entries).arg(shapes.checks.len());
        for check in &shapes.checks {
            call.arg(check.cost)
                .arg(u8::from(check.shadow) | u8::from(check.quota) << 1)
                .arg(check.windows.len());
            for w in &check.windows {
                call.arg(w.requests).arg(w.period_ms).arg(w.precision_ms);
            }
        }
        call.arg(shapes.decisions.len());
        for (dry_run, at) in &shapes.decisions {
            let numbers = shapes.numbers.get(at.clone()).unwrap_or_default();
            call.arg(u8::from(*dry_run)).arg(numbers.len());
            for shape in numbers {
                call.arg(*shape);
            }
        }
        let entries = entries(decisions, &shapes.of_decision);
        call.arg(entries.len());
        for entry in &entries {
            let Some((checks, _)) = decisions.get(entry.first) else {
                continue;
            };
            let shape = shapes.of_decision.get(entry.first).copied().unwrap_or(0);
            if entry.count > 1 {
                // Its decisions share one key: sent once.
                if let Some(check) = checks.first() {
                    call.key(&check.key);
                }
                call.arg(0i64.saturating_sub(i64::try_from(entry.count).unwrap_or(i64::MAX)))
                    .arg(shape);
            } else {
                for check in checks.iter() {
                    call.key(&check.key);
                }
                call.arg(shape);
            }
        }
        // The rings of bucketed windows, after every counter (the script
        // finds them by name): declared so that Redis Cluster, while their
        // slot migrates, answers TRYAGAIN until counter and ring have both
        // moved, rather than run the script where one of them is missing.
        for ring in rings(decisions) {
            call.key(ring);
        }
        call.arg(not_after);
        let mut reply: Vec<i64> = call.invoke_async(conn).await?;
        let decided_at = reply.pop().ok_or_else(|| super::bad_reply("empty reply"))?;
        self.learn_clock(decided_at, sent);
        if not_after > 0 && decided_at > not_after {
            tracing::debug!(
                late_ms = decided_at.saturating_sub(not_after),
                decisions = decisions.len(),
                "a decision call ran in Redis after its callers had given up on it: it charged nothing"
            );
        }
        parse_reply(&reply, decisions, &entries)
    }
}

/// Decisions in a row that the script decides as one run: `count` of them
/// from `first` (1: a decision alone).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Entry {
    first: usize,
    count: usize,
}

/// Whether a decision can be part of a run: one counter, exact windows
/// only, neither shadow nor quota (whose admission does not follow the
/// counts alone), a cost above 0 (a run's answers grow by it).
fn runnable(checks: &[OwnedCheck]) -> Option<&OwnedCheck> {
    match checks {
        [c] if !c.shadow
            && !c.quota
            && c.cost > 0
            && !c.windows.is_empty()
            && c.windows.iter().all(|w| w.precision_ms == 0) =>
        {
            Some(c)
        }
        _ => None,
    }
}

/// `decisions` as the script takes them: runs of alike decisions in a row
/// on one counter (a hot key's requests waiting together), each other
/// decision alone. Alike: the same decision shape (`of_decision`, which
/// holds dry run, cost, role and windows) and the same key. The order is
/// kept: the answers are those of deciding them one after the other.
fn entries(decisions: &[(&[OwnedCheck], bool)], of_decision: &[usize]) -> Vec<Entry> {
    let mut entries: Vec<Entry> = Vec::with_capacity(decisions.len());
    let mut run: Option<(&str, usize)> = None;
    for (i, ((checks, _), shape)) in decisions.iter().zip(of_decision).enumerate() {
        let this = runnable(checks).map(|c| (c.key.as_str(), *shape));
        match entries.last_mut() {
            Some(last) if this.is_some() && this == run => last.count = last.count.saturating_add(1),
            _ => entries.push(Entry { first: i, count: 1 }),
        }
        run = this;
    }
    entries
}

/// The ring keys of the bucketed windows of `decisions`, each once: the
/// script names them `<counter>|<period>/<precision>` (decide.lua).
fn rings(decisions: &[(&[OwnedCheck], bool)]) -> Vec<String> {
    let mut rings: Vec<String> = decisions
        .iter()
        .flat_map(|(checks, _)| checks.iter())
        .flat_map(|c| {
            c.windows
                .iter()
                .filter(|w| w.precision_ms > 0)
                .map(move |w| format!("{}|{}/{}", c.key, w.period_ms, w.precision_ms))
        })
        .collect();
    if rings.len() > 1 {
        rings.sort_unstable();
        rings.dedup();
    }
    rings
}

/// What a call's decisions have in common, sent once: the shapes of their
/// checks (all but the key) and of the decisions (dry run, and each key's
/// check shape), numbered from 1 as the script's tables are.
struct Shapes<'a> {
    checks: Vec<&'a OwnedCheck>,
    /// Dry run, and where the decision's check shapes lie in `numbers`.
    decisions: Vec<(bool, Range<usize>)>,
    numbers: Vec<usize>,
    of_decision: Vec<usize>,
}

impl<'a> Shapes<'a> {
    /// A batch holds at most a few shapes (one per matching rule set), so a
    /// linear search finds them faster than hashing would.
    fn of(decisions: &[(&'a [OwnedCheck], bool)]) -> Self {
        let mut shapes = Shapes {
            checks: Vec::new(),
            decisions: Vec::new(),
            numbers: Vec::new(),
            of_decision: Vec::with_capacity(decisions.len()),
        };
        for (checks, dry_run) in decisions {
            // Written after the known shapes, and taken back if one matches:
            // no allocation per decision.
            let start = shapes.numbers.len();
            for check in checks.iter() {
                let number = shapes.check(check);
                shapes.numbers.push(number);
            }
            let (known, this) = shapes.numbers.split_at(start);
            let found = shapes
                .decisions
                .iter()
                .position(|(d, at)| d == dry_run && known.get(at.clone()) == Some(this));
            let number = match found {
                Some(i) => {
                    shapes.numbers.truncate(start);
                    i
                }
                None => {
                    shapes.decisions.push((*dry_run, start..shapes.numbers.len()));
                    shapes.decisions.len().saturating_sub(1)
                }
            };
            shapes.of_decision.push(number.saturating_add(1));
        }
        shapes
    }

    fn check(&mut self, check: &'a OwnedCheck) -> usize {
        let same = |c: &&OwnedCheck| {
            c.cost == check.cost && c.shadow == check.shadow && c.quota == check.quota && c.windows == check.windows
        };
        let found = self.checks.iter().position(same);
        let index = match found {
            Some(i) => i,
            None => {
                self.checks.push(check);
                self.checks.len().saturating_sub(1)
            }
        };
        index.saturating_add(1)
    }
}

fn parse_reply(
    reply: &[i64],
    decisions: &[(&[OwnedCheck], bool)],
    entries: &[Entry],
) -> Result<Vec<StoreAnswer>, StoreError> {
    let windows_of = |checks: &[OwnedCheck]| checks.first().map_or(0, |c| c.windows.len());
    let expected: usize = entries
        .iter()
        .filter_map(|e| Some((e, decisions.get(e.first)?.0)))
        .map(|(e, checks)| {
            if e.count > 1 {
                windows_of(checks).saturating_mul(3).saturating_add(2)
            } else {
                checks
                    .iter()
                    .map(|c| c.windows.len().saturating_mul(3).saturating_add(1))
                    .fold(1usize, usize::saturating_add)
            }
        })
        .fold(0usize, usize::saturating_add);
    if reply.len() != expected {
        return Err(super::bad_reply(format!(
            "{} integers, expected {expected}",
            reply.len()
        )));
    }
    let mut values = reply.iter().copied();
    let mut next = || values.next().unwrap_or(0);
    let mut answers = Vec::with_capacity(decisions.len());
    for entry in entries {
        let Some((checks, _)) = decisions.get(entry.first) else {
            continue;
        };
        if entry.count > 1 {
            let Some(check) = checks.first() else { continue };
            answers.extend(run_answers(check, entry.count, &mut next));
            continue;
        }
        let admitted = next() == 1;
        let checks = checks
            .iter()
            .map(|check| {
                let charged = next() == 1;
                let windows = check
                    .windows
                    .iter()
                    .map(|w| {
                        let used = u64::try_from(next()).unwrap_or(0);
                        let reset_ms = u64::try_from(next()).unwrap_or(0);
                        window_count(w, used, reset_ms, next())
                    })
                    .collect();
                CheckCount { charged, windows }
            })
            .collect();
        answers.push(StoreAnswer { admitted, checks });
    }
    Ok(answers)
}

/// A window's count as the script told it. No unit counts longer than an
/// exact window's period, or than a bucketed window's ring of buckets (one
/// more than the period takes): a time past that can only come from a
/// value the script misread (another program's under the key), and would
/// be cached as a refusal for as long, so it is held to that bound.
fn window_count(window: &Window, used: u64, reset_ms: u64, retry: i64) -> WindowCount {
    let longest = match window.precision_ms {
        0 => window.period_ms,
        p => window.period_ms.div_ceil(p).saturating_add(1).saturating_mul(p),
    };
    WindowCount {
        used,
        reset_ms: reset_ms.min(longest),
        retry_ms: u64::try_from(retry).ok().map(|r| r.min(longest)),
        never: retry == -2,
    }
}

/// The answers of a run of `count` decisions of `check` (decide.lua's run
/// reply): the first `admitted` admitted, each meeting the counts the ones
/// before it charged; the rest refused, all meeting the same counts.
fn run_answers(check: &OwnedCheck, count: usize, next: &mut impl FnMut() -> i64) -> Vec<StoreAnswer> {
    let admitted = usize::try_from(next()).unwrap_or(0).min(count);
    let charged = next() == 1;
    let windows: Vec<(&Window, u64, u64, i64)> = check
        .windows
        .iter()
        .map(|w| {
            let used = u64::try_from(next()).unwrap_or(0);
            let reset_ms = u64::try_from(next()).unwrap_or(0);
            (w, used, reset_ms, next())
        })
        .collect();
    (0..count)
        .map(|i| {
            let yes = i < admitted;
            let charges = if charged { u64::try_from(i.min(admitted)).unwrap_or(u64::MAX) } else { 0 };
            let counts = windows
                .iter()
                .map(|&(window, used, reset_ms, retry)| {
                    let used = used.saturating_add(charges.saturating_mul(check.cost));
                    window_count(window, used, reset_ms, if yes { -1 } else { retry })
                })
                .collect();
            StoreAnswer {
                admitted: yes,
                checks: vec![CheckCount {
                    charged: yes && charged,
                    windows: counts,
                }],
            }
        })
        .collect()
}

#[cfg(test)]
impl OwnedCheck {
    /// A check of `cost` against `requests` a minute, for tests.
    pub(super) fn per_minute(key: &str, requests: u64, cost: u64, shadow: bool) -> Self {
        OwnedCheck {
            key: key.into(),
            windows: vec![Window {
                requests,
                period_ms: 60_000,
                precision_ms: 0,
            }],
            cost,
            shadow,
            quota: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(key: &str, cost: u64, requests: u64) -> OwnedCheck {
        OwnedCheck::per_minute(key, requests, cost, false)
    }

    /// The 44th attack: a misread ring gave a retry time of 8.9 million
    /// years, cached as a refusal for as long.
    #[test]
    fn no_time_told_outlasts_the_window_and_a_bucket() {
        let w = Window {
            requests: 5,
            period_ms: 60_000,
            precision_ms: 1_000,
        };
        let c = window_count(&w, 5, 281_473_180_864_420, 281_473_180_864_420);
        assert_eq!((c.reset_ms, c.retry_ms), (61_000, Some(61_000)));
        // Buckets that do not divide the period: the ring holds one more
        // than the period takes, 6 of 200 ms for 900 ms.
        let odd = Window {
            requests: 5,
            period_ms: 900,
            precision_ms: 200,
        };
        assert_eq!(window_count(&odd, 5, 1_150, 5_000).retry_ms, Some(1_200));
        let exact = Window {
            requests: 5,
            period_ms: 900,
            precision_ms: 0,
        };
        assert_eq!(window_count(&exact, 5, 900, 5_000).retry_ms, Some(900));
        let c = window_count(&w, 5, 30_000, 12_345);
        assert_eq!((c.reset_ms, c.retry_ms, c.never), (30_000, Some(12_345), false));
        let c = window_count(&w, 0, 60_000, -2);
        assert_eq!((c.retry_ms, c.never), (None, true));
    }

    #[test]
    fn a_batch_sends_each_shape_once_and_every_decision_its_own_number() {
        let one = [check("a", 1, 10)];
        let other_key = [check("b", 1, 10)];
        let two = [check("a", 1, 10), check("c", 2, 10)];
        let other_limit = [check("a", 1, 11)];
        let decisions: Vec<(&[OwnedCheck], bool)> =
            vec![(&one, false), (&two, false), (&other_key, false), (&one, true), (&other_limit, false)];
        let shapes = Shapes::of(&decisions);
        // Keys are not part of a shape; cost and windows are.
        assert_eq!(shapes.checks.len(), 3);
        let kinds: Vec<(bool, &[usize])> = shapes
            .decisions
            .iter()
            .map(|(dry, at)| (*dry, shapes.numbers.get(at.clone()).unwrap()))
            .collect();
        assert_eq!(
            kinds,
            vec![(false, &[1][..]), (false, &[1, 2][..]), (true, &[1][..]), (false, &[3][..])]
        );
        assert_eq!(shapes.of_decision, vec![1, 2, 1, 3, 4]);
    }

    #[test]
    fn only_alike_decisions_in_a_row_on_one_counter_make_a_run() {
        let hot = [check("a", 1, 10)];
        let costlier = [check("a", 2, 10)];
        let other = [check("b", 1, 10)];
        let two = [check("a", 1, 10), check("a", 1, 10)];
        let shadow = [OwnedCheck::per_minute("a", 10, 1, true)];
        let free = [check("a", 0, 10)];
        let mut bucketed = [check("a", 1, 10)];
        bucketed[0].windows[0].precision_ms = 1_000;
        let decisions: Vec<(&[OwnedCheck], bool)> = vec![
            (&hot, false),
            (&hot, false),
            (&hot, false),
            (&costlier, false),
            (&hot, false),
            (&hot, true),
            (&hot, true),
            (&other, false),
            (&hot, false),
            (&two, false),
            (&two, false),
            (&shadow, false),
            (&shadow, false),
            (&free, false),
            (&free, false),
            (&bucketed, false),
            (&bucketed, false),
            (&hot, false),
        ];
        let shapes = Shapes::of(&decisions);
        let got: Vec<(usize, usize)> = entries(&decisions, &shapes.of_decision)
            .iter()
            .map(|e| (e.first, e.count))
            .collect();
        // A run breaks at another cost, a dry run, another key; decisions
        // of two keys, shadow, free or bucketed ones go alone.
        let mut want = vec![(0, 3), (3, 1), (4, 1), (5, 2), (7, 1), (8, 1)];
        want.extend((9..18).map(|i| (i, 1)));
        assert_eq!(got, want);
    }
}
