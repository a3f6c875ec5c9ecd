//! Prometheus metrics, served as text on the admin listener's `/metrics`.
//!
//! One process-wide set, so every part records where it knows the fact (the
//! limiter its decisions, the proxy its upstream, the reloader its reloads)
//! without threading a handle through. Label values are rule names, file
//! names and fixed words only: nothing a caller sends ever becomes a label,
//! so the number of series stays bounded by the configuration.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, OnceLock, RwLock};
use std::time::Duration;

use prometheus_client::encoding::{EncodeLabelSet, EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::exponential_buckets;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;

/// What a rule said about one request.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum RuleEvent {
    /// Had room; charged.
    Allowed,
    /// Refused the request.
    Limited,
    /// A shadow rule that would have refused.
    ShadowLimited,
    /// The store failed; admitted by the failure mode.
    FailedOpen,
    /// The store failed; refused by the failure mode.
    FailedClosed,
    /// Refused by the local cache of an exact denial, without asking the store.
    LimitedCached,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DecisionLabels {
    rule: String,
    outcome: &'static str,
}

impl RuleEvent {
    const COUNT: usize = 6;

    fn as_str(self) -> &'static str {
        match self {
            RuleEvent::Allowed => "allowed",
            RuleEvent::Limited => "limited",
            RuleEvent::ShadowLimited => "shadow_limited",
            RuleEvent::FailedOpen => "failed_open",
            RuleEvent::FailedClosed => "failed_closed",
            RuleEvent::LimitedCached => "limited_cached",
        }
    }
}

impl Surface {
    const COUNT: usize = 4;

    fn as_str(self) -> &'static str {
        match self {
            Surface::Proxy => "proxy",
            Surface::Rls => "envoy_rls",
            Surface::ExtAuthz => "ext_authz",
            Surface::AuthRequest => "auth_request",
        }
    }
}

impl Answer {
    const COUNT: usize = 5;

    fn as_str(self) -> &'static str {
        match self {
            Answer::Allowed => "allowed",
            Answer::Limited => "limited",
            Answer::FailedOpen => "failed_open",
            Answer::FailedClosed => "failed_closed",
            Answer::BadRequest => "bad_request",
        }
    }
}

/// Which surface a request came through.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Surface {
    /// The reverse proxy.
    Proxy,
    /// Envoy RLS gRPC.
    Rls,
    /// Envoy ext_authz.
    ExtAuthz,
    /// NGINX auth_request.
    AuthRequest,
}

/// A request's overall answer.
#[derive(Clone, Copy, Debug, Hash, PartialEq, Eq)]
pub enum Answer {
    /// Admitted (no rule refused, or no rule matched).
    Allowed,
    /// Refused by a limit.
    Limited,
    /// Admitted because the store failed.
    FailedOpen,
    /// Refused because the store failed.
    FailedClosed,
    /// Refused as malformed (400).
    BadRequest,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    surface: &'static str,
    verdict: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ClassLabels {
    class: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReloadLabels {
    file: String,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ConfigLabels {
    file: String,
    version: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct FileLabels {
    file: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ListenerLabels {
    listener: &'static str,
}

/// Every metric tollgate exports.
pub struct Metrics {
    registry: Registry,
    decisions: Family<DecisionLabels, Counter>,
    requests: Family<RequestLabels, Counter>,
    decision_seconds: Histogram,
    store_seconds: Histogram,
    store_errors: Family<KindLabels, Counter>,
    upstream: Family<ClassLabels, Counter>,
    upstream_seconds: Histogram,
    response_seconds: Family<ListenerLabels, Histogram, fn() -> Histogram>,
    first_request_seconds: Family<ListenerLabels, Histogram, fn() -> Histogram>,
    reloads: Family<ReloadLabels, Counter>,
    config: Family<ConfigLabels, Gauge>,
    config_error: Family<FileLabels, Gauge>,
    denial_cache_hits: Counter,
    counters_evicted: Counter,
    memory_counters: Gauge,
    unknown_domain: Counter,
    client_body_stalls: Counter,
    upstream_body_stalls: Counter,
    client_connections: Family<ListenerLabels, Gauge>,
    waiting_connections: Family<ListenerLabels, Gauge>,
    connections_deferred: Family<ListenerLabels, Counter>,
    connections_reclaimed: Family<ListenerLabels, Counter>,
    accept_errors: Family<ListenerLabels, Counter>,
    upstream_connections: Gauge,
    tls_reloads: Family<ResultLabels, Counter>,
    tls_handshake_failures: Family<ListenerLabels, Counter>,
    /// The version last published per file, so a reload retires the old series.
    versions: Mutex<HashMap<String, String>>,
    /// Per rule name, one counter handle per outcome and its recent
    /// activity for the admin page.
    rule_counters: RwLock<HashMap<String, Arc<RuleHandles>>>,
    /// Tells this registry's entries in [`RULES_SEEN`] from another's.
    id: u64,
    /// Handles of `requests`, per surface and verdict, made on first use
    /// (so a series appears once it counts something) and then reused
    /// instead of hashing the labels on every request.
    request_counters: [[OnceLock<Counter>; Answer::COUNT]; Surface::COUNT],
    /// Handles of `upstream`, per entry of `UPSTREAM_CLASSES`.
    upstream_counters: [OnceLock<Counter>; UPSTREAM_CLASSES.len()],
}

/// What one rule name's decisions are recorded into.
#[derive(Default)]
struct RuleHandles {
    counters: [OnceLock<Counter>; RuleEvent::COUNT],
    activity: Arc<crate::activity::RuleActivity>,
}

/// A thread's rule handles: per registry (by id), per rule name.
type RulesSeen = Vec<(u64, Seen)>;

/// Rules a thread keeps at hand beside its map: a busy thread decides for
/// the same few rules again and again.
const RECENT: usize = 4;

/// One registry's rule handles on one thread.
#[derive(Default)]
struct Seen {
    /// The last few rules recorded, found by comparing names: hashing the
    /// name into the map was most of a decision's metrics (BENCHMARKS.md
    /// §64).
    recent: [Option<(Arc<str>, Arc<RuleHandles>)>; RECENT],
    /// Where the next of `recent` goes.
    next: usize,
    names: HashMap<Arc<str>, Arc<RuleHandles>>,
}

impl Seen {
    /// The handles of the rule named `rule`, if this thread has them.
    fn find(&mut self, rule: &str) -> Option<&RuleHandles> {
        let recent =
            |kept: &Option<(Arc<str>, Arc<RuleHandles>)>| kept.as_ref().is_some_and(|(name, _)| **name == *rule);
        if let Some(at) = self.recent.iter().position(recent) {
            return self.recent.get(at)?.as_ref().map(|(_, handles)| &**handles);
        }
        let (name, handles) = self.names.get_key_value(rule)?;
        let found = (name.clone(), handles.clone());
        let slot = self.recent.get_mut(self.next % RECENT)?;
        self.next = self.next.wrapping_add(1);
        *slot = Some(found);
        slot.as_ref().map(|(_, handles)| &**handles)
    }
}

/// Most rule names a thread keeps the handles of per registry; past it
/// (names retired by reloads pile up), it starts over.
const RULES_SEEN_MAX: usize = 4096;

thread_local! {
    /// The handles of the rules this thread recorded: a decision finds its
    /// rule's without the shared map's lock, whose count every thread
    /// writes. A map, not a list, so that a file whose traffic spreads
    /// over thousands of rules finds each as cheaply as a few.
    static RULES_SEEN: std::cell::RefCell<RulesSeen> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Every class `upstream` is called with.
const UPSTREAM_CLASSES: [&str; 8] = ["1xx", "2xx", "3xx", "4xx", "5xx", "other", "error", "timeout"];

/// Bounds of a latency histogram (then `+Inf`).
const BOUNDS: usize = 32;
/// Shards of a histogram's counts: threads that record into one take
/// different shards (while there are fewer threads than shards).
const SHARDS: usize = 8;

/// A latency histogram recorded without a lock: the proxy's threads record
/// four or five a request, and prometheus_client's own takes a mutex shared
/// by every thread (its cache line going from core to core) and finds the
/// bucket by walking the bounds. Each thread counts into a shard of its
/// own; `/metrics` sums them. Exposed exactly as a prometheus_client
/// histogram of the same bounds is.
#[derive(Clone)]
pub struct Histogram(Arc<HistogramInner>);

struct HistogramInner {
    bounds: [f64; BOUNDS],
    shards: [Shard; SHARDS],
}

/// One shard's counts, alone on its cache lines.
#[repr(align(128))]
struct Shard {
    /// Per bucket (the last is `+Inf`), not cumulative.
    buckets: [AtomicU64; BOUNDS + 1],
    /// The sum of what was recorded, in nanoseconds: whole, so shards add up exactly.
    nanos: AtomicU64,
}

impl Histogram {
    fn new() -> Self {
        // 50 µs to ~2.3 s, each bound √2 times the last: fine enough to tell
        // a p99 of 1 ms from one of 1.4 ms, which the targets of
        // BENCHMARKS.md need.
        let mut bounds = [f64::INFINITY; BOUNDS];
        for (b, v) in bounds
            .iter_mut()
            .zip(exponential_buckets(0.000_05, std::f64::consts::SQRT_2, BOUNDS as u16))
        {
            *b = v;
        }
        let shard = || Shard {
            buckets: std::array::from_fn(|_| AtomicU64::new(0)),
            nanos: AtomicU64::new(0),
        };
        Histogram(Arc::new(HistogramInner {
            bounds,
            shards: std::array::from_fn(|_| shard()),
        }))
    }

    /// Records one time.
    pub fn observe(&self, d: Duration) {
        let inner = &*self.0;
        let secs = d.as_secs_f64();
        // The first bound at or above it, as prometheus_client counts.
        let bucket = inner.bounds.partition_point(|b| *b < secs);
        let Some(shard) = inner.shards.get(shard_of_thread()) else {
            return;
        };
        if let Some(count) = shard.buckets.get(bucket) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        shard.nanos.fetch_add(nanos, Ordering::Relaxed);
    }
}

/// This thread's shard of every histogram.
fn shard_of_thread() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local! {
        static SHARD: usize = NEXT.fetch_add(1, Ordering::Relaxed) % SHARDS;
    }
    SHARD.try_with(|s| *s).unwrap_or(0)
}

impl std::fmt::Debug for Histogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Histogram")
    }
}

impl TypedMetric for Histogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for Histogram {
    fn encode(&self, mut encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        let inner = &*self.0;
        let mut buckets: Vec<(f64, u64)> = inner.bounds.iter().map(|b| (*b, 0)).collect();
        buckets.push((f64::INFINITY, 0));
        let mut nanos: u64 = 0;
        for shard in &inner.shards {
            for ((_, n), c) in buckets.iter_mut().zip(&shard.buckets) {
                *n = n.saturating_add(c.load(Ordering::Relaxed));
            }
            nanos = nanos.wrapping_add(shard.nanos.load(Ordering::Relaxed));
        }
        let count = buckets.iter().fold(0u64, |a, (_, n)| a.saturating_add(*n));
        // Nanoseconds to seconds: exact far past any real total.
        #[allow(clippy::cast_precision_loss)]
        let sum = nanos as f64 / 1e9;
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

static METRICS: LazyLock<Metrics> = LazyLock::new(Metrics::new);

/// One unit of a gauge, held while alive: an open connection counts until
/// whatever holds it is dropped, however its task ends.
pub struct Held(Gauge);

impl Held {
    /// Adds one to `gauge` until the result is dropped.
    pub fn new(gauge: Gauge) -> Held {
        gauge.inc();
        Held(gauge)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.0.dec();
    }
}

/// The process's metrics.
pub fn get() -> &'static Metrics {
    &METRICS
}

impl Metrics {
    fn new() -> Self {
        let mut registry = Registry::default();
        let m = Metrics {
            decisions: Family::default(),
            requests: Family::default(),
            decision_seconds: Histogram::new(),
            store_seconds: Histogram::new(),
            store_errors: Family::default(),
            upstream: Family::default(),
            upstream_seconds: Histogram::new(),
            response_seconds: Family::new_with_constructor(Histogram::new),
            first_request_seconds: Family::new_with_constructor(Histogram::new),
            reloads: Family::default(),
            config: Family::default(),
            config_error: Family::default(),
            denial_cache_hits: Counter::default(),
            counters_evicted: Counter::default(),
            memory_counters: Gauge::default(),
            unknown_domain: Counter::default(),
            client_body_stalls: Counter::default(),
            upstream_body_stalls: Counter::default(),
            client_connections: Family::default(),
            waiting_connections: Family::default(),
            connections_deferred: Family::default(),
            connections_reclaimed: Family::default(),
            accept_errors: Family::default(),
            upstream_connections: Gauge::default(),
            tls_reloads: Family::default(),
            tls_handshake_failures: Family::default(),
            versions: Mutex::default(),
            rule_counters: RwLock::default(),
            id: {
                static NEXT: AtomicU64 = AtomicU64::new(0);
                NEXT.fetch_add(1, Ordering::Relaxed)
            },
            request_counters: Default::default(),
            upstream_counters: Default::default(),
            registry: Registry::default(),
        };
        registry.register("tollgate_decisions", "Rule outcomes, per rule", m.decisions.clone());
        registry.register(
            "tollgate_requests",
            "Requests decided, per surface and verdict",
            m.requests.clone(),
        );
        registry.register(
            "tollgate_decision_seconds",
            "Time to decide one request",
            m.decision_seconds.clone(),
        );
        registry.register(
            "tollgate_store_seconds",
            "Counter store round trips that answered",
            m.store_seconds.clone(),
        );
        registry.register(
            "tollgate_store_errors",
            "Counter store failures (timeout, redis, reply)",
            m.store_errors.clone(),
        );
        registry.register(
            "tollgate_upstream_responses",
            "Upstream answers by status class",
            m.upstream.clone(),
        );
        registry.register(
            "tollgate_upstream_seconds",
            "Time to the upstream's response headers",
            m.upstream_seconds.clone(),
        );
        registry.register(
            "tollgate_first_request_seconds",
            "Time from accepting a connection (its TLS handshake included) to its first request's head, per listener",
            m.first_request_seconds.clone(),
        );
        registry.register(
            "tollgate_response_seconds",
            "Time from a request's head to its response's last byte, per listener",
            m.response_seconds.clone(),
        );
        registry.register(
            "tollgate_tls_reloads",
            "Reloads of the listeners' certificate after its files changed (ok, failed)",
            m.tls_reloads.clone(),
        );
        registry.register(
            "tollgate_tls_handshake_failures",
            "TLS handshakes that failed or timed out (a client certificate refused, plain HTTP on a TLS port...), per listener",
            m.tls_handshake_failures.clone(),
        );
        registry.register(
            "tollgate_config_reloads",
            "Limits file reloads (ok, failed)",
            m.reloads.clone(),
        );
        registry.register(
            "tollgate_config_info",
            "The active limits version per file",
            m.config.clone(),
        );
        registry.register(
            "tollgate_config_last_reload_failed",
            "1 while a file's last edit was refused",
            m.config_error.clone(),
        );
        registry.register(
            "tollgate_denial_cache_hits",
            "Requests refused from the exact local denial cache",
            m.denial_cache_hits.clone(),
        );
        registry.register(
            "tollgate_counters_evicted",
            "Live counters the memory store forgot to stay within --max-counters (least recently used of a sample)",
            m.counters_evicted.clone(),
        );
        registry.register(
            "tollgate_memory_counters",
            "Counters the memory store holds",
            m.memory_counters.clone(),
        );
        registry.register(
            "tollgate_client_body_stalls",
            "Request bodies cut off after --upstream-body-timeout without a byte",
            m.client_body_stalls.clone(),
        );
        registry.register(
            "tollgate_upstream_body_stalls",
            "Upstream response bodies cut off after --upstream-body-timeout without a byte",
            m.upstream_body_stalls.clone(),
        );
        registry.register(
            "tollgate_client_connections",
            "Client connections open, per listener",
            m.client_connections.clone(),
        );
        registry.register(
            "tollgate_client_connections_waiting",
            "Client connections waiting for a request with no HTTP state held (before the first, or parked idle between two), per listener",
            m.waiting_connections.clone(),
        );
        registry.register(
            "tollgate_connections_deferred",
            "New connections left waiting in the listen backlog because --max-connections were open",
            m.connections_deferred.clone(),
        );
        registry.register(
            "tollgate_connections_reclaimed",
            "Idle client connections closed to make room for new ones while --max-connections were open (the admin listener: 128)",
            m.connections_reclaimed.clone(),
        );
        registry.register(
            "tollgate_accept_errors",
            "Connections the operating system failed to hand over (out of file descriptors, mostly)",
            m.accept_errors.clone(),
        );
        registry.register(
            "tollgate_upstream_connections",
            "Connections to the upstream open, in use or idle in the keep-alive pool",
            m.upstream_connections.clone(),
        );
        registry.register(
            "tollgate_rls_unknown_domain",
            "RLS requests for a domain no file declares",
            m.unknown_domain.clone(),
        );
        Metrics { registry, ..m }
    }

    /// The whole set in Prometheus text format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }

    /// Records what one rule said about a request decided at `at`.
    pub fn rule(&self, rule: &str, outcome: RuleEvent, at: std::time::Instant) {
        use crate::activity::Outcome;
        let recent = match outcome {
            RuleEvent::Allowed => Outcome::Allowed,
            RuleEvent::Limited | RuleEvent::LimitedCached => Outcome::Limited,
            RuleEvent::ShadowLimited => Outcome::ShadowLimited,
            RuleEvent::FailedOpen | RuleEvent::FailedClosed => Outcome::Failed,
        };
        let record = |handles: &RuleHandles| {
            // The hot path reuses counter handles instead of building labels.
            let counter = handles.counters[outcome as usize].get_or_init(|| {
                self.decisions.get_or_create_owned(&DecisionLabels {
                    rule: rule.to_string(),
                    outcome: outcome.as_str(),
                })
            });
            counter.inc();
            handles.activity.record(recent, at);
        };
        let seen = RULES_SEEN.with_borrow_mut(|seen| {
            let mine = seen.iter_mut().find(|(id, _)| *id == self.id);
            mine.and_then(|(_, seen)| seen.find(rule)).map(record).is_some()
        });
        if seen {
            return;
        }
        // Once per rule name and thread: the shared map, written only for
        // a name no thread recorded before.
        let handles = {
            let mut counters = self.rule_counters.write().unwrap_or_else(|e| e.into_inner());
            counters.entry(rule.to_string()).or_default().clone()
        };
        record(&handles);
        RULES_SEEN.with_borrow_mut(|seen| {
            let at = match seen.iter().position(|(id, _)| *id == self.id) {
                Some(at) => at,
                None => {
                    seen.push((self.id, Seen::default()));
                    seen.len().saturating_sub(1)
                }
            };
            if let Some((_, seen)) = seen.get_mut(at) {
                if seen.names.len() >= RULES_SEEN_MAX {
                    seen.names.clear();
                }
                seen.names.insert(rule.into(), handles);
            }
        });
    }

    /// The recent activity of the rule named `rule`, if it decided anything.
    pub fn rule_activity(&self, rule: &str) -> Option<Arc<crate::activity::RuleActivity>> {
        let counters = self.rule_counters.read().unwrap_or_else(|e| e.into_inner());
        counters.get(rule).map(|h| h.activity.clone())
    }

    /// Records a request's verdict on a surface.
    pub fn request(&self, surface: Surface, verdict: Answer) {
        self.request_counters[surface as usize][verdict as usize]
            .get_or_init(|| {
                self.requests
                    .get_or_create(&RequestLabels {
                        surface: surface.as_str(),
                        verdict: verdict.as_str(),
                    })
                    .clone()
            })
            .inc();
    }

    /// Records the time one decision took.
    pub fn decision_time(&self, d: Duration) {
        self.decision_seconds.observe(d);
    }

    /// Records a store round trip that answered.
    pub fn store_time(&self, d: Duration) {
        self.store_seconds.observe(d);
    }

    /// Records a store failure of this kind.
    pub fn store_error(&self, kind: &'static str) {
        self.store_errors.get_or_create(&KindLabels { kind }).inc();
    }

    /// Records an upstream answer (status class, or `error` / `timeout`).
    pub fn upstream(&self, class: &'static str, d: Duration) {
        match UPSTREAM_CLASSES.iter().position(|c| *c == class) {
            Some(i) => self.upstream_counters[i]
                .get_or_init(|| self.upstream.get_or_create(&ClassLabels { class }).clone())
                .inc(),
            None => self.upstream.get_or_create(&ClassLabels { class }).inc(),
        };
        self.upstream_seconds.observe(d);
    }

    /// Records a reload of `file` and, when it succeeded, its new version.
    pub fn reload(&self, file: &str, ok: bool) {
        let result = if ok { "ok" } else { "failed" };
        self.reloads
            .get_or_create(&ReloadLabels {
                file: file.to_string(),
                result,
            })
            .inc();
        self.config_error
            .get_or_create(&FileLabels { file: file.to_string() })
            .set(i64::from(!ok));
    }

    /// Retires every series of a limits file no longer served (removed
    /// from its directory, or refused and then removed): an alert on its
    /// refused edit would otherwise fire for as long as the process runs.
    pub fn forget_file(&self, file: &str) {
        let mut versions = self.versions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = versions.remove(file) {
            self.config.remove(&ConfigLabels {
                file: file.to_string(),
                version: old,
            });
        }
        self.config_error.remove(&FileLabels { file: file.to_string() });
    }

    /// A file just served: its version published, no refused edit.
    pub fn file_served(&self, file: &str, version: &str) {
        self.config_version(file, version);
        self.config_error
            .get_or_create(&FileLabels { file: file.to_string() })
            .set(0);
    }

    /// Publishes the active version of `file`, retiring the previous one.
    pub fn config_version(&self, file: &str, version: &str) {
        let mut versions = self.versions.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(old) = versions.insert(file.to_string(), version.to_string()) {
            self.config.remove(&ConfigLabels {
                file: file.to_string(),
                version: old,
            });
        }
        self.config
            .get_or_create(&ConfigLabels {
                file: file.to_string(),
                version: version.to_string(),
            })
            .set(1);
    }

    /// Records a request refused from the denial cache.
    pub fn denial_cache_hit(&self) {
        self.denial_cache_hits.inc();
    }

    /// Records a body that stalled past the body timeout (`upstream`: the
    /// upstream's response, else the client's request).
    pub fn body_stalled(&self, upstream: bool) {
        if upstream {
            self.upstream_body_stalls.inc();
        } else {
            self.client_body_stalls.inc();
        }
    }

    /// Records an RLS request for an unknown domain.
    pub fn unknown_domain(&self) {
        self.unknown_domain.inc();
    }

    /// Records a live counter evicted from the memory store.
    pub fn counter_evicted(&self) {
        self.counters_evicted.inc();
    }

    /// The gauge of client connections open on `listener`.
    pub fn client_connections(&self, listener: &'static str) -> Gauge {
        self.client_connections
            .get_or_create(&ListenerLabels { listener })
            .clone()
    }

    /// The counter of `listener`'s failed TLS handshakes.
    pub fn tls_handshake_failures(&self, listener: &'static str) -> Counter {
        self.tls_handshake_failures
            .get_or_create(&ListenerLabels { listener })
            .clone()
    }

    /// Records a reload of the listeners' certificate.
    pub fn tls_reload(&self, ok: bool) {
        let result = if ok { "ok" } else { "failed" };
        self.tls_reloads.get_or_create(&ResultLabels { result }).inc();
    }

    /// The histogram of `listener`'s connections' time to their first request.
    pub fn first_request_seconds(&self, listener: &'static str) -> Histogram {
        self.first_request_seconds
            .get_or_create(&ListenerLabels { listener })
            .clone()
    }

    /// The histogram of `listener`'s request times, head to last byte.
    pub fn response_seconds(&self, listener: &'static str) -> Histogram {
        self.response_seconds
            .get_or_create(&ListenerLabels { listener })
            .clone()
    }

    /// The gauge of `listener`'s connections waiting for a request.
    pub fn waiting_connections(&self, listener: &'static str) -> Gauge {
        self.waiting_connections
            .get_or_create(&ListenerLabels { listener })
            .clone()
    }

    /// Records a new connection on `listener` left waiting for a free slot.
    pub fn connection_deferred(&self, listener: &'static str) {
        self.connections_deferred
            .get_or_create(&ListenerLabels { listener })
            .inc();
    }

    /// Idle connections of `listener` closed to make room for new ones.
    pub fn connections_reclaimed(&self, listener: &'static str) -> Counter {
        self.connections_reclaimed
            .get_or_create(&ListenerLabels { listener })
            .clone()
    }

    /// Records a failed accept on `listener`.
    pub fn accept_error(&self, listener: &'static str) {
        self.accept_errors.get_or_create(&ListenerLabels { listener }).inc();
    }

    /// The gauge of open upstream connections.
    pub fn upstream_connections(&self) -> &Gauge {
        &self.upstream_connections
    }

    /// Publishes how many counters the memory store holds.
    pub fn memory_counters(&self, n: usize) {
        self.memory_counters.set(i64::try_from(n).unwrap_or(i64::MAX));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Rule outcomes recorded from several threads, for more rule names
    /// than a thread keeps handles of, and into two registries on one
    /// thread: each series counts exactly what was recorded into it.
    #[test]
    fn every_rules_outcomes_are_counted_in_their_own_registry() {
        let (a, b) = (Metrics::new(), Metrics::new());
        let names: Vec<String> = (0..RULES_SEEN_MAX * 2 + 3).map(|i| format!("rule-{i}")).collect();
        let now = std::time::Instant::now();
        std::thread::scope(|s| {
            for t in 0..3 {
                let (a, b, names) = (&a, &b, &names);
                s.spawn(move || {
                    for round in 0..3 {
                        for (i, name) in names.iter().enumerate() {
                            a.rule(name, RuleEvent::Allowed, now);
                            if (i + t + round) % 2 == 0 {
                                b.rule(name, RuleEvent::Limited, now);
                                b.rule(name, RuleEvent::Allowed, now);
                            }
                            if i % 5 == 0 {
                                a.rule(name, RuleEvent::LimitedCached, now);
                            }
                        }
                    }
                });
            }
        });
        let series = |text: String| -> HashMap<String, u64> {
            text.lines()
                .filter_map(|l| l.rsplit_once(' '))
                .filter_map(|(k, v)| Some((k.to_string(), v.parse().ok()?)))
                .collect()
        };
        let count = |all: &HashMap<String, u64>, name: &str, outcome: &str| -> u64 {
            let key = format!("tollgate_decisions_total{{rule=\"{name}\",outcome=\"{outcome}\"}}");
            all.get(&key).copied().unwrap_or(0)
        };
        let (ta, tb) = (series(a.render()), series(b.render()));
        for (i, name) in names.iter().enumerate() {
            assert_eq!(count(&ta, name, "allowed"), 9, "{name}");
            assert_eq!(
                count(&ta, name, "limited_cached"),
                if i % 5 == 0 { 9 } else { 0 },
                "{name}"
            );
            assert_eq!(count(&ta, name, "limited"), 0, "{name}");
            let limited: u64 = (0..3)
                .flat_map(|t| (0..3).map(move |r| (i + t + r) % 2 == 0))
                .filter(|&x| x)
                .count() as u64;
            assert_eq!(count(&tb, name, "limited"), limited, "{name}");
            assert_eq!(count(&tb, name, "allowed"), limited, "{name}");
        }
    }

    /// A few rules in turn, more than a thread keeps at hand, some names
    /// the start of others: each counts its own and no other's.
    #[test]
    fn rules_in_turn_count_their_own() {
        let m = Metrics::new();
        let names = ["r", "r1", "r10", "r100", "s", "r1", "t"];
        let now = std::time::Instant::now();
        for round in 0..50 {
            for (i, name) in names.iter().enumerate() {
                let event = if (i + round) % 3 == 0 {
                    RuleEvent::Limited
                } else {
                    RuleEvent::Allowed
                };
                m.rule(name, event, now);
            }
        }
        let text = m.render();
        let count = |name: &str, outcome: &str| -> u64 {
            let key = format!("tollgate_decisions_total{{rule=\"{name}\",outcome=\"{outcome}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(key.as_str()))
                .map_or(0, |v| v.parse().unwrap())
        };
        for name in ["r", "r1", "r10", "r100", "s", "t"] {
            let (mut allowed, mut limited) = (0, 0);
            for round in 0..50 {
                for (i, n) in names.iter().enumerate() {
                    if *n == name {
                        if (i + round) % 3 == 0 {
                            limited += 1
                        } else {
                            allowed += 1
                        }
                    }
                }
            }
            assert_eq!(
                (count(name, "allowed"), count(name, "limited")),
                (allowed, limited),
                "{name}"
            );
        }
    }

    /// `metric` as `/metrics` shows it, under the name `t`.
    fn text(metric: impl prometheus_client::registry::Metric) -> String {
        let mut registry = Registry::default();
        registry.register("t", "t", metric);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).unwrap();
        out
    }

    proptest! {
        #[test]
        fn a_histogram_shows_what_prometheus_clients_own_shows(
            micros in prop::collection::vec(prop_oneof![0u64..5_000, 0u64..5_000_000_000], 0..200),
            threads in 1usize..12,
        ) {
            let ours = Histogram::new();
            let theirs = prometheus_client::metrics::histogram::Histogram::new(exponential_buckets(
                0.000_05,
                std::f64::consts::SQRT_2,
                BOUNDS as u16,
            ));
            // Recorded from several threads, as the proxy's are: more
            // threads than shards too.
            std::thread::scope(|s| {
                for chunk in micros.chunks(micros.len().div_ceil(threads).max(1)) {
                    let ours = ours.clone();
                    s.spawn(move || {
                        for m in chunk {
                            ours.observe(Duration::from_micros(*m));
                        }
                    });
                }
            });
            for m in &micros {
                theirs.observe(Duration::from_micros(*m).as_secs_f64());
            }
            let (ours, theirs) = (text(ours), text(theirs));
            let split = |t: &str| -> (Vec<String>, f64) {
                let mut sum = 0.0;
                let mut rest = Vec::new();
                for line in t.lines() {
                    match line.strip_prefix("t_sum ") {
                        Some(v) => sum = v.parse().unwrap(),
                        None => rest.push(line.to_string()),
                    }
                }
                (rest, sum)
            };
            let ((ours, our_sum), (theirs, their_sum)) = (split(&ours), split(&theirs));
            // Every bucket, the count and the rest line for line; the sum in
            // whole nanoseconds where theirs adds floats.
            prop_assert_eq!(ours, theirs);
            prop_assert!((our_sum - their_sum).abs() <= 1e-9 * their_sum.max(1.0), "{} {}", our_sum, their_sum);
        }
    }
}
