//! Every decision path against a brute-force reference model.
//!
//! Random sequences of requests go through every surface: the Envoy RLS
//! service, the ext_authz and auth_request endpoints, the reverse proxy
//! (served on a loopback port in this process, so its clock can be stepped
//! by hand) and the HTTP rule path itself, on the
//! memory store and on the Redis script, with the denial cache on and off:
//! random costs (past the limits too), descriptors repeated in one request,
//! several rules and windows, reloads that raise and lower limits (and turn
//! a rule into shadow mode) mid-sequence, and clock steps. Every answer must
//! be the model's: a plain list of admitted units with their times.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::google::protobuf::UInt64Value;
use http::{HeaderMap, HeaderValue, Method};
use proptest::prelude::*;
use tollgate::config::Window;
use tollgate::limiter::{Clock, Limiter, ManualClock, MemoryStore, RedisMode, RedisStore, Store};
use tollgate::limits::RequestInfo;
use tollgate::reload::LiveFiles;
use tollgate::surfaces::decision_http::DecisionHttp;
use tollgate::surfaces::envoy_rls::RlsService;

use crate::common::{RedisServer, TestUpstream, client, get, property_runtime};
use crate::envoy::descriptor;
use tollgate::serve::{ConnLimits, Gate, serve};
use tollgate::surfaces::proxy::{Proxy, ProxyOptions};
use tollgate::upstream::Upstream;

const T0: u64 = 1_700_000_000_000;

/// Per counter, two versions of its rule (a reload switches between them):
/// windows and whether the rule is in shadow mode.
fn version(counter: usize, v: usize) -> (Vec<Window>, bool) {
    let w = |requests, period_ms| Window::exact(requests, period_ms);
    // A window with a precision: counted per bucket.
    let b = |requests, period_ms, precision_ms| Window {
        requests,
        period_ms,
        precision_ms,
    };
    match (counter, v) {
        (0, 0) => (vec![w(3, 1_000)], false),
        (0, _) => (vec![w(2, 300), w(3, 1_000)], false),
        // The bucketed limit raised past the bits its counts had in Redis.
        // 31 buckets of 50 ms keep block sums in Redis (blocks of 8).
        (1, 0) => (vec![w(2, 300), b(6, 1_500, 50), b(5, 2_000, 250)], false),
        (1, _) => (vec![b(9, 1_500, 50), b(8, 2_000, 250)], false),
        (2, 0) => (vec![w(4, 500), w(6, 1_500)], false),
        _ => (vec![w(2, 100), w(6, 1_500)], true),
    }
}

fn period_text(ms: u64) -> String {
    format!("{ms}ms")
}

/// The limits file for these versions: an RLS rule and an HTTP rule per counter.
fn limits_file(domain: &str, versions: &[usize; 3]) -> String {
    let mut out = format!("domain: {domain}\nrules:\n");
    for (c, v) in versions.iter().enumerate() {
        let (windows, shadow) = version(c, *v);
        let limits: Vec<String> = windows
            .iter()
            .map(|w| match w.precision_ms {
                0 => format!("{{ requests: {}, per: {} }}", w.requests, period_text(w.period_ms)),
                p => format!(
                    "{{ requests: {}, per: {}, precision: {} }}",
                    w.requests,
                    period_text(w.period_ms),
                    period_text(p)
                ),
            })
            .collect();
        let limits = limits.join(", ");
        out.push_str(&format!(
            "  - name: rls{c}\n    descriptor: [{{ key: k, value: c{c} }}]\n    shadow: {shadow}\n    limits: [{limits}]\n"
        ));
        out.push_str(&format!(
            "  - name: http{c}\n    match: {{ headers: {{ x-use-{c}: '*' }} }}\n    cost: header:x-cost-{c}\n    shadow: {shadow}\n    limits: [{limits}]\n"
        ));
    }
    out
}

/// What the model says of one check.
#[derive(Debug, Clone, PartialEq)]
struct Expected {
    /// Per window: retry ms (when over and it can fit later), never.
    windows: Vec<(Option<u64>, bool)>,
    /// Per window: remaining after the decision.
    remaining: Vec<u64>,
    shadow: bool,
}

impl Expected {
    fn over(&self) -> bool {
        self.windows.iter().any(|(r, n)| r.is_some() || *n)
    }
}

/// The brute-force sliding window: admitted units with their times, per
/// counter and form. A counter's exact windows share one log, written when
/// its rule has an exact window; a window with a precision has a log of its
/// own (a reload that adds or changes one starts it afresh, README).
#[derive(Default)]
struct Model {
    log: HashMap<String, Vec<(u64, u64)>>,
}

/// The log `w` of counter `key` counts from.
fn log_of(key: &str, w: &Window) -> String {
    match w.precision_ms {
        0 => key.to_string(),
        p => format!("{key}|{}/{p}", w.period_ms),
    }
}

impl Model {
    /// Units `w` counts at `now`: the last `period` ms, or with a precision
    /// every unit fewer than `ceil(period / precision) + 1` buckets old.
    fn used(&self, key: &str, now: u64, w: &Window) -> u64 {
        let counted = |t: u64| match w.precision_ms {
            0 => now - t < w.period_ms,
            p => now / p - t / p < w.period_ms.div_ceil(p) + 1,
        };
        self.log
            .get(&log_of(key, w))
            .map_or(0, |l| l.iter().filter(|(t, _)| counted(*t)).map(|(_, n)| n).sum())
    }

    /// Decides checks (key, windows, cost, shadow) together; returns admitted
    /// and per check what the caller must be told.
    fn decide(&mut self, now: u64, checks: &[(String, Vec<Window>, u64, bool)]) -> (bool, Vec<Expected>) {
        let mut claims: HashMap<&str, u64> = HashMap::new();
        let mut out = Vec::new();
        let mut fits_all = Vec::new();
        for (key, windows, cost, shadow) in checks {
            let claim = claims.get(key.as_str()).copied().unwrap_or(0);
            let ws: Vec<(Option<u64>, bool)> = windows
                .iter()
                .map(|w| {
                    let used = self.used(key, now, w) + claim;
                    if used + cost <= w.requests {
                        (None, false)
                    } else if claim + cost > w.requests {
                        (None, true)
                    } else {
                        let retry = (1..=w.period_ms + 2 * w.precision_ms)
                            .find(|d| self.used(key, now + d, w) + claim + cost <= w.requests);
                        (retry, false)
                    }
                })
                .collect();
            let fits = ws.iter().all(|(r, n)| r.is_none() && !n);
            if fits {
                *claims.entry(key.as_str()).or_default() += cost;
            }
            fits_all.push(fits);
            out.push(Expected {
                windows: ws,
                remaining: Vec::new(),
                shadow: *shadow,
            });
        }
        let admitted = checks.iter().zip(&fits_all).all(|(c, f)| *f || c.3);
        let mut claims: HashMap<&str, u64> = HashMap::new();
        for ((c, fits), e) in checks.iter().zip(&fits_all).zip(out.iter_mut()) {
            let charged = admitted && *fits && c.2 > 0;
            let claim = claims.get(c.0.as_str()).copied().unwrap_or(0);
            let taken = if charged { c.2 } else { 0 };
            e.remaining =
                c.1.iter()
                    .map(|w| w.requests.saturating_sub(self.used(&c.0, now, w) + claim + taken))
                    .collect();
            if *fits {
                *claims.entry(c.0.as_str()).or_default() += c.2;
            }
        }
        for ((c, fits), _) in checks.iter().zip(&fits_all).zip(&out) {
            if admitted && *fits && c.2 > 0 {
                let mut logs: Vec<String> = c.1.iter().map(|w| log_of(&c.0, w)).collect();
                logs.sort();
                logs.dedup();
                for log in logs {
                    self.log.entry(log).or_default().push((now, c.2));
                }
            }
        }
        (admitted, out)
    }

    /// The retry time the caller is told: the latest over window of an
    /// enforcing check, or none when a window can never hold the request.
    fn retry_after(expected: &[Expected]) -> Option<u64> {
        let refusing: Vec<&Expected> = expected.iter().filter(|e| e.over() && !e.shadow).collect();
        if refusing.iter().any(|e| e.windows.iter().any(|w| w.1)) {
            return None;
        }
        refusing.iter().flat_map(|e| e.windows.iter()).filter_map(|w| w.0).max()
    }
}

/// One step: a time step, maybe a reload of one counter's rule, then one
/// request on the RLS surface or the HTTP path.
#[derive(Debug, Clone)]
enum Step {
    Rls {
        dt: u64,
        items: Vec<(usize, u64)>,
    },
    /// `surface`: 0 the rule path itself, 1 ext_authz, 2 auth_request, 3 the proxy.
    Http {
        dt: u64,
        items: Vec<(usize, u64)>,
        surface: u8,
    },
    Reload {
        counter: usize,
    },
}

fn steps() -> impl Strategy<Value = Vec<Step>> {
    let rls =
        (0u64..700, prop::collection::vec((0usize..3, 0u64..6), 1..5)).prop_map(|(dt, items)| Step::Rls { dt, items });
    // One rule per counter on HTTP (so no repeats), costs from 1.
    let http =
        (0u64..700, prop::collection::btree_map(0usize..3, 1u64..6, 1..4), 0u8..4).prop_map(|(dt, items, surface)| {
            Step::Http {
                dt,
                items: items.into_iter().collect(),
                surface,
            }
        });
    let reload = (0usize..3).prop_map(|counter| Step::Reload { counter });
    prop::collection::vec(prop_oneof![4 => rls, 4 => http, 1 => reload], 1..50)
}

/// One runtime and one redis-server for all cases of the test.
struct Rig {
    runtime: tokio::runtime::Runtime,
    redis: RedisServer,
    upstream: TestUpstream,
    case: AtomicU64,
    dir: tempfile::TempDir,
}

struct Case {
    clock: Arc<ManualClock>,
    limiter: Arc<Limiter>,
    files: Arc<LiveFiles>,
    rls: RlsService,
    decision_http: DecisionHttp,
    /// The reverse proxy, served on a loopback port in this process.
    proxy: std::net::SocketAddr,
    _stop: tokio::sync::watch::Sender<bool>,
    domain: String,
    file: PathBuf,
}

impl Rig {
    fn case(&self, redis: bool) -> Case {
        let n = self.case.fetch_add(1, Ordering::SeqCst);
        let domain = format!("model{n}");
        let file = self.dir.path().join(format!("{domain}.yaml"));
        std::fs::write(&file, limits_file(&domain, &[0, 0, 0])).unwrap();
        let clock = Arc::new(ManualClock::new(T0));
        let store = if redis {
            let c: Arc<dyn Clock> = clock.clone();
            let s = self
                .runtime
                .block_on(async { RedisStore::connect(&[self.redis.url()], &RedisMode::Standalone, Some(c)) })
                .unwrap();
            Store::Redis(s)
        } else {
            Store::Memory(MemoryStore::new(clock.clone()))
        };
        let limiter = Arc::new(Limiter::with_clock(store, Duration::from_secs(2), clock.clone()));
        let files = Arc::new(LiveFiles::load(std::slice::from_ref(&file), false).unwrap());
        let catalog = files.catalog();
        let l = limiter.clone();
        files.on_change(move || l.forget_denials());
        let rls = RlsService::new(limiter.clone(), catalog.clone());
        let decision_http = DecisionHttp::new(limiter.clone(), catalog.clone(), Default::default());
        let options = ProxyOptions {
            upstream: Upstream::parse(&format!("http://{}", self.upstream.addr), None).unwrap(),
            upstream_timeout: Duration::from_secs(5),
            body_timeout: Duration::from_secs(5),
            upstream_keepalive: 64,
            upstream_keepalive_timeout: Duration::from_secs(50),
            trusted: Default::default(),
            ratelimit_headers: true,
        };
        let proxy = Arc::new(Proxy::new(limiter.clone(), catalog.clone(), options));
        let (stop, stopped) = tokio::sync::watch::channel(false);
        let listener = self
            .runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .unwrap();
        let proxy_addr = listener.local_addr().unwrap();
        self.runtime.spawn(serve(
            listener,
            ConnLimits::default(),
            Gate::new("proxy", None),
            None,
            stopped,
            move |req, peer| proxy.clone().handle(req, peer),
        ));
        Case {
            proxy: proxy_addr,
            _stop: stop,
            decision_http,
            clock,
            limiter,
            files,
            rls,
            domain,
            file,
        }
    }
}

fn run(rig: &Rig, redis: bool, cache: bool, steps: Vec<Step>) -> Result<(), TestCaseError> {
    let case = rig.case(redis);
    let mut model = Model::default();
    let mut versions = [0usize; 3];
    for step in steps {
        let (dt, items, on_rls, surface) = match step {
            Step::Reload { counter } => {
                versions[counter] = 1 - versions[counter];
                std::fs::write(&case.file, limits_file(&case.domain, &versions)).unwrap();
                case.files.reload_all("model");
                continue;
            }
            Step::Rls { dt, items } => (dt, items, true, 0),
            Step::Http { dt, items, surface } => (dt, items, false, surface),
        };
        case.clock.advance(dt);
        let now = case.clock.now_ms();
        if !cache {
            case.limiter.forget_denials();
        }
        let prefix = if on_rls { "rls" } else { "http" };
        let checks: Vec<(String, Vec<Window>, u64, bool)> = items
            .iter()
            .map(|&(c, cost)| {
                let (windows, shadow) = version(c, versions[c]);
                (format!("{prefix}{c}"), windows, cost, shadow)
            })
            .collect();
        let (admitted, expected) = model.decide(now, &checks);
        let retry = Model::retry_after(&expected);
        if on_rls {
            let req = RateLimitRequest {
                domain: case.domain.clone(),
                descriptors: items
                    .iter()
                    .map(|&(c, cost)| {
                        let mut d = descriptor(&[("k", &format!("c{c}"))]);
                        d.hits_addend = Some(UInt64Value { value: cost });
                        d
                    })
                    .collect(),
                hits_addend: 0,
            };
            let got = rig.runtime.block_on(case.rls.decide(&req));
            let code = |ok: bool| if ok { Code::Ok as i32 } else { Code::OverLimit as i32 };
            prop_assert_eq!(got.overall_code, code(admitted), "{:?} at {}", items, now - T0);
            prop_assert_eq!(got.statuses.len(), items.len());
            for (status, e) in got.statuses.iter().zip(&expected) {
                let read = status.current_limit.is_some();
                if read {
                    prop_assert_eq!(status.code, code(!e.over() || e.shadow), "{:?}", items);
                    if e.over() {
                        // Waiting duration_until_reset is enough: the latest
                        // of the descriptor's refusing windows (none when one
                        // can never hold the cost).
                        let never = e.windows.iter().any(|w| w.1);
                        let want = (!never).then(|| e.windows.iter().filter_map(|w| w.0).max()).flatten();
                        let got_ms = status
                            .duration_until_reset
                            .as_ref()
                            .map(|d| d.seconds as u64 * 1000 + d.nanos as u64 / 1_000_000);
                        prop_assert_eq!(
                            got_ms,
                            want,
                            "{:?} at {} (redis {}, cache {})",
                            items,
                            now - T0,
                            redis,
                            cache
                        );
                    }
                } else {
                    // Unread: only where a cached refusal answered the request.
                    prop_assert!(cache && !admitted, "a status without a limit: {:?}", status);
                    prop_assert_eq!(status.code, Code::Ok as i32);
                }
            }
            let header = got
                .response_headers_to_add
                .iter()
                .find(|h| h.key == "retry-after")
                .map(|h| h.value.clone());
            let want = (!admitted).then(|| retry.map(|ms| ms.div_ceil(1000).max(1).to_string()));
            match want {
                None => prop_assert_eq!(header, None),
                Some(want) => prop_assert_eq!(header, want, "{:?}", items),
            }
        } else if surface == 3 {
            let mut headers: Vec<(String, String)> = Vec::new();
            for &(c, cost) in &items {
                headers.push((format!("x-use-{c}"), "1".into()));
                headers.push((format!("x-cost-{c}"), cost.to_string()));
            }
            let headers: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
            let url = format!("http://{}/", case.proxy);
            let got = rig.runtime.block_on(async { get(&client(), &url, &headers).await });
            let want = if admitted { 200 } else { 429 };
            prop_assert_eq!(got.status.as_u16(), want, "proxy {:?} at {}", items, now - T0);
            let header = got.header("retry-after").map(str::to_string);
            let want = (!admitted).then(|| retry.map(|ms| ms.div_ceil(1000).max(1).to_string()));
            match want {
                None => prop_assert_eq!(header, None),
                Some(want) => prop_assert_eq!(header, want, "proxy {:?}", items),
            }
        } else if surface > 0 {
            // ext_authz and auth_request, as Envoy and NGINX ask them.
            let mut req = http::Request::builder().header("host", "h");
            req = if surface == 1 {
                req.uri("/ext_authz/")
            } else {
                req.uri("/auth_request")
                    .header("x-original-uri", "/")
                    .header("x-original-method", "GET")
            };
            for &(c, cost) in &items {
                req = req
                    .header(format!("x-use-{c}"), "1")
                    .header(format!("x-cost-{c}"), cost);
            }
            let req = req.body(()).unwrap();
            let peer = "10.0.0.1:5000".parse().unwrap();
            let got = rig.runtime.block_on(case.decision_http.handle(req, peer));
            let status = got.status().as_u16();
            let want = match (surface, admitted) {
                (1, true) => 200,
                (1, false) => 429,
                (_, true) => 204,
                (_, false) => 403,
            };
            prop_assert_eq!(status, want, "surface {} {:?} at {}", surface, items, now - T0);
            if surface == 2 && !admitted {
                prop_assert_eq!(
                    got.headers().get("x-tollgate-status").map(|v| v.as_bytes()),
                    Some(&b"429"[..])
                );
            }
            let header = got
                .headers()
                .get("retry-after")
                .map(|v| v.to_str().unwrap().to_string());
            let want = (!admitted).then(|| retry.map(|ms| ms.div_ceil(1000).max(1).to_string()));
            match want {
                None => prop_assert_eq!(header, None),
                Some(want) => prop_assert_eq!(header, want, "surface {} {:?}", surface, items),
            }
        } else {
            let mut headers = HeaderMap::new();
            for &(c, cost) in &items {
                headers.insert(
                    format!("x-use-{c}").parse::<http::HeaderName>().unwrap(),
                    HeaderValue::from_static("1"),
                );
                headers.insert(
                    format!("x-cost-{c}").parse::<http::HeaderName>().unwrap(),
                    HeaderValue::from(cost),
                );
            }
            let info = RequestInfo {
                method: &Method::GET,
                path: "/",
                query: None,
                host: Some("h"),
                headers: tollgate::fields::Fields::Map(&headers),
                client_ip: "10.0.0.1".parse().unwrap(),
                client_cert: None,
            };
            let hits = case.files.catalog().load().http_hits(&info).unwrap();
            let decision = rig.runtime.block_on(case.limiter.decide(&hits));
            prop_assert_eq!(decision.verdict.admits(), admitted, "{:?} at {}", items, now - T0);
            prop_assert_eq!(decision.rules.len(), items.len());
            let cached = decision.rules.iter().any(|r| r.windows.is_empty());
            prop_assert!(!cached || (cache && !admitted));
            if !admitted {
                prop_assert_eq!(decision.retry_after_ms(), retry, "{:?} {:#?}", items, decision.rules);
            }
            for (outcome, e) in decision.rules.iter().zip(&expected) {
                if outcome.windows.is_empty() {
                    continue;
                }
                prop_assert_eq!(outcome.over, e.over());
                // A refusal served from the denial cache keeps the remaining
                // counts it was cached with; only fresh answers are compared
                // field by field.
                if admitted || !cache {
                    let remaining: Vec<u64> = outcome.windows.iter().map(|w| w.remaining).collect();
                    prop_assert_eq!(&remaining, &e.remaining, "{:?}", items);
                }
            }
        }
    }
    Ok(())
}

#[test]
fn every_decision_path_answers_like_the_model() {
    let runtime = property_runtime();
    let upstream = runtime.block_on(TestUpstream::start());
    let rig = Rig {
        runtime,
        upstream,
        redis: RedisServer::start(),
        case: AtomicU64::new(0),
        dir: tempfile::tempdir().unwrap(),
    };
    // PROPTEST_CASES runs more for a soak; the suite runs 128.
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(128);
    let config = ProptestConfig {
        cases,
        ..ProptestConfig::default()
    };
    for (redis, cache) in [(false, false), (false, true), (true, false), (true, true)] {
        proptest!(config.clone(), |(steps in steps())| {
            run(&rig, redis, cache, steps)?;
        });
    }
}
