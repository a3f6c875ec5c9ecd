//! The JSON behind the operator page: `/api/state` (status, rules with
//! their live rates, the callers refused most) and `/api/explain` (what a
//! request would get now, charging nothing).
//!
//! Everything a caller controls (counter values, paths, header values) goes
//! out as JSON strings; the page puts them on screen as text.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::Mutex;

use http::{HeaderMap, HeaderName, HeaderValue, Method};
use serde::Deserialize;
use serde_json::{Value as Json, json};

use crate::activity::{self, Outcome};
use crate::config::{Part, PathPattern, Rule, ValuePattern, Window};
use crate::limiter::{Limiter, Verdict};
use crate::limits::descriptors::Descriptor;
use crate::limits::http::{RequestInfo, request_host};
use crate::limits::{self, keys};
use crate::reload::LiveFiles;

/// Callers shown in the top-limited list at most.
const TOP_SHOWN: usize = 20;

/// Which rules the last reload of each file added or changed.
#[derive(Default)]
pub(super) struct Changes {
    files: Mutex<HashMap<String, FileRules>>,
}

struct FileRules {
    version: String,
    /// Per rule id, a hash of the whole rule (header match values
    /// included, which `/config` hides).
    rules: HashMap<String, u64>,
    changed: HashSet<String>,
}

impl Changes {
    /// Looks at every file's version; a file whose version moved has its
    /// rules compared with the ones it had.
    pub(super) fn observe(&self, files: &LiveFiles) {
        let mut known = self.files.lock().unwrap_or_else(|e| e.into_inner());
        for file in files.files().iter() {
            let status = file.status();
            if known.get(&status.file).is_some_and(|f| f.version == status.version) {
                continue;
            }
            let limits = file.active().load_full();
            let rules: HashMap<String, u64> = limits.rules.iter().map(|r| (r.id.clone(), fingerprint(r))).collect();
            let changed = match known.get(&status.file) {
                Some(before) => rules
                    .iter()
                    .filter(|(id, text)| before.rules.get(*id) != Some(*text))
                    .map(|(id, _)| id.clone())
                    .collect(),
                // Loaded at start: nothing to compare with.
                None => HashSet::new(),
            };
            known.insert(
                status.file.clone(),
                FileRules {
                    version: status.version.clone(),
                    rules,
                    changed,
                },
            );
        }
    }

    fn changed(&self, file: &str, rule_id: &str) -> bool {
        let known = self.files.lock().unwrap_or_else(|e| e.into_inner());
        known.get(file).is_some_and(|f| f.changed.contains(rule_id))
    }
}

/// A rule's fingerprint: everything it says, hidden values included.
fn fingerprint(rule: &Rule) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    format!("{rule:?}").hash(&mut h);
    h.finish()
}

/// Longest reload error shown: a bad value is quoted whole in it, and the
/// page polls this every second.
const MAX_ERROR_CHARS: usize = 2_000;

fn clip(text: &str) -> String {
    match text.char_indices().nth(MAX_ERROR_CHARS) {
        Some((at, _)) => format!("{}… ({} bytes in all)", &text[..at], text.len()),
        None => text.to_owned(),
    }
}

/// The status bar's part: version, uptime, store and files.
pub(super) fn status(limiter: &Limiter, files: &LiveFiles) -> Json {
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "started_at": rfc3339(activity::get().started_at()),
        "uptime_s": activity::get().uptime().as_secs(),
        "store": store(limiter),
        "files": files.files().iter().map(|f| {
            let mut status = serde_json::to_value(&*f.status()).unwrap_or(Json::Null);
            if let Some(map) = status.as_object_mut() {
                map.insert("domain".into(), json!(f.active().load().domain));
                if let Some(Json::String(e)) = map.get("last_error") {
                    let clipped = clip(e);
                    map.insert("last_error".into(), json!(clipped));
                }
            }
            status
        }).collect::<Vec<_>>(),
        "refused": files.refused().into_iter().map(|(file, error)| json!({"file": file, "last_error": clip(&error)})).collect::<Vec<_>>(),
    })
}

/// `/api/state`: everything the page shows.
pub(super) fn state(limiter: &Limiter, files: &LiveFiles, changes: &Changes, query: &RuleQuery) -> Json {
    changes.observe(files);
    let (rules, rules_total, rules_matched) = rules(files, changes, query);
    let mut state = status(limiter, files);
    if let Some(map) = state.as_object_mut() {
        map.insert("rules".into(), json!(rules));
        map.insert("rules_total".into(), json!(rules_total));
        map.insert("rules_matched".into(), json!(rules_matched));
        map.insert("top_limited".into(), json!(top_limited(files)));
    }
    state
}

/// The counter store: what and where it is, and how it has answered.
pub(super) fn store(limiter: &Limiter) -> Json {
    let s = activity::get().store();
    let round_trip = match (limiter.store_address(), s.calls) {
        (None, _) | (_, 0) => Json::Null,
        _ => json!({"calls": s.calls, "p50_ms": s.p50_ms, "p99_ms": s.p99_ms}),
    };
    json!({
        "kind": limiter.store_name(),
        "address": limiter.store_address(),
        "up": s.up,
        "last_error": s.last_error,
        "round_trip": round_trip,
    })
}

/// Which rules a listing shows: those whose name, id, match, domain or file
/// contain `filter` (any case), at most `limit` of them, the busiest of the
/// last 15 minutes first when there are more (then shown in file order).
#[derive(Debug, Clone)]
pub(super) struct RuleQuery {
    pub filter: String,
    pub limit: usize,
}

/// Rules listed when the query names no `limit`: enough for any hand-written
/// file, few enough that a page polling once a second stays light with ten
/// thousand generated rules.
pub(super) const DEFAULT_RULES_SHOWN: usize = 500;

/// Most rules one answer lists, whatever `limit` asks (about 0.6 MB).
pub(super) const MAX_RULES_SHOWN: usize = 2_000;

impl RuleQuery {
    /// `?filter=...&limit=N` (percent-encoded), defaults for the rest.
    pub(super) fn parse(query: Option<&str>) -> RuleQuery {
        let mut q = RuleQuery {
            filter: String::new(),
            limit: DEFAULT_RULES_SHOWN,
        };
        for pair in query.unwrap_or_default().split('&') {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            let v = percent_encoding::percent_decode_str(&v.replace('+', " "))
                .decode_utf8_lossy()
                .into_owned();
            match k {
                "filter" => q.filter = v.trim().to_lowercase(),
                // Capped: an answer is held whole until its reader takes it.
                "limit" => q.limit = v.parse().unwrap_or(DEFAULT_RULES_SHOWN).min(MAX_RULES_SHOWN),
                _ => {}
            }
        }
        q
    }
}

/// The rules `query` selects, with their live rates and history, and how
/// many rules there are in all and how many matched the filter.
pub(super) fn rules(files: &LiveFiles, changes: &Changes, query: &RuleQuery) -> (Vec<Json>, usize, usize) {
    struct Row {
        file: String,
        domain: String,
        rule: std::sync::Arc<Rule>,
        matches: String,
        summary: Option<activity::RuleSummary>,
        busy: u64,
    }
    let mut rows = Vec::new();
    let mut total = 0usize;
    for file in files.files().iter() {
        let status = file.status();
        let limits = file.active().load_full();
        for rule in &limits.rules {
            total = total.saturating_add(1);
            let matches = match_summary(rule);
            let wanted = query.filter.is_empty()
                || [&rule.name, &rule.id, &matches, &limits.domain, &status.file]
                    .iter()
                    .any(|t| t.to_lowercase().contains(&query.filter));
            if !wanted {
                continue;
            }
            // A rule with nothing in 15 minutes sends no history: with
            // thousands of rules, most of the answer would be zeros.
            let summary = crate::metrics::get()
                .rule_activity(&rule.name)
                .map(|a| a.summary())
                .filter(|s| s.history.iter().any(|h| h.iter().any(|&n| n > 0)));
            let busy = summary
                .as_ref()
                .map_or(0, |s| s.history.iter().flatten().map(|&n| u64::from(n)).sum());
            rows.push(Row {
                file: status.file.clone(),
                domain: limits.domain.clone(),
                rule: rule.clone(),
                matches,
                summary,
                busy,
            });
        }
    }
    let matched = rows.len();
    if rows.len() > query.limit {
        // The busiest, then back in file order.
        let mut order: Vec<usize> = (0..rows.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(rows.get(i).map_or(0, |r| r.busy)));
        let mut keep: Vec<usize> = order.into_iter().take(query.limit).collect();
        keep.sort_unstable();
        let mut kept = Vec::with_capacity(keep.len());
        for (i, row) in rows.into_iter().enumerate() {
            if keep.binary_search(&i).is_ok() {
                kept.push(row);
            }
        }
        rows = kept;
    }
    let out = rows
        .into_iter()
        .map(|row| {
            let Row {
                file,
                domain,
                rule,
                matches,
                summary,
                ..
            } = row;
            let rate = |o: Outcome| {
                summary
                    .as_ref()
                    .and_then(|s| s.rate.get(o as usize).copied())
                    .unwrap_or(0.0)
            };
            let history = |o: Outcome| {
                summary
                    .as_ref()
                    .and_then(|s| s.history.get(o as usize))
                    .map(|h| json!(h))
            };
            let total: f64 = [
                Outcome::Allowed,
                Outcome::Limited,
                Outcome::ShadowLimited,
                Outcome::Failed,
            ]
            .into_iter()
            .map(rate)
            .sum();
            let refused = rate(Outcome::Limited) + rate(Outcome::ShadowLimited);
            json!({
                "changed": changes.changed(&file, &rule.id),
                "file": file,
                "domain": domain,
                "id": rule.id,
                "name": rule.name,
                "match": matches,
                "by": by_summary(&rule),
                "windows": rule.windows.iter().map(window_text).collect::<Vec<_>>(),
                "shadow": rule.shadow,
                "quota": rule.quota,
                "unlimited": rule.unlimited,
                "status": rule.status.as_u16(),
                "rate": {
                    "allowed": round(rate(Outcome::Allowed)),
                    "limited": round(rate(Outcome::Limited)),
                    "shadow_limited": round(rate(Outcome::ShadowLimited)),
                    "failed": round(rate(Outcome::Failed)),
                },
                "limited_share": (total > 0.0).then(|| round(refused / total)),
                "history": summary.as_ref().map(|_| json!({
                    "step_s": activity::STEP_SECONDS,
                    "allowed": history(Outcome::Allowed),
                    "limited": history(Outcome::Limited),
                    "shadow_limited": history(Outcome::ShadowLimited),
                    "failed": history(Outcome::Failed),
                })),
            })
        })
        .collect();
    (out, total, matched)
}

/// The counters refused most lately.
pub(super) fn top_limited(files: &LiveFiles) -> Vec<Json> {
    // Which (domain, rule name) are descriptor rules, to show their values as pairs.
    let mut descriptor_rules = HashSet::new();
    for file in files.files().iter() {
        let limits = file.active().load_full();
        for rule in limits.rules.iter().filter(|r| r.descriptor.is_some()) {
            descriptor_rules.insert((limits.domain.clone(), rule.name.clone()));
        }
    }
    activity::get()
        .top_limited(TOP_SHOWN)
        .into_iter()
        .map(|r| {
            let domain = keys::describe(&r.counter).map(|p| p.domain);
            let descriptor = domain
                .as_ref()
                .is_some_and(|d| descriptor_rules.contains(&(d.clone(), r.rule.clone())));
            json!({
                "rule": r.rule,
                "domain": domain,
                "counter": r.counter,
                "values": shown_values(&r.counter, descriptor),
                "refusals": r.refusals,
                "last_refused_s_ago": round(r.last_ms_ago as f64 / 1000.0),
                "retry_in_ms": r.retry_in_ms,
            })
        })
        .collect()
}

/// What names a rule's counters apart: its `by` parts, or for a descriptor
/// rule the entries whose every value counts apart (a bare key).
fn by_summary(rule: &Rule) -> Vec<String> {
    match &rule.descriptor {
        Some(entries) => entries
            .iter()
            .filter(|e| matches!(e.value, ValuePattern::Any | ValuePattern::Wildcard(_)) && !e.shared)
            .map(|e| e.key.clone())
            .collect(),
        None => rule.by.iter().map(Part::key).collect(),
    }
}

/// A counter's values as the page shows them: each as sent (a hashed one
/// as an object, so text posing as a hash is told apart), and for a
/// descriptor rule as `key=value` pairs.
fn shown_values(key: &str, descriptor: bool) -> Json {
    let Some(parts) = keys::describe(key) else {
        return json!([]);
    };
    if !descriptor {
        return json!(parts.values);
    }
    // A descriptor key holds the first value (in the tag), then its key,
    // then the other keys and values in turn.
    let mut values = parts.values.into_iter();
    let first = values.next();
    let mut pairs = Vec::new();
    let mut pending = first.and_then(|v| values.next().map(|k| (k, v)));
    while let Some((k, v)) = pending {
        let k = k.display();
        pairs.push(match v {
            keys::KeyValue::Text(v) => json!(format!("{k}={v}")),
            hashed => {
                let mut j = json!(hashed);
                if let Some(map) = j.as_object_mut() {
                    map.insert("key".into(), json!(k));
                }
                j
            }
        });
        pending = values.next().and_then(|k| values.next().map(|v| (k, v)));
    }
    json!(pairs)
}

/// What a rule matches, in one line.
fn match_summary(rule: &Rule) -> String {
    if let Some(entries) = &rule.descriptor {
        let entries: Vec<String> = entries
            .iter()
            .map(|e| match &e.value {
                ValuePattern::Any => e.key.clone(),
                ValuePattern::Exact(v) | ValuePattern::Wildcard(v) => format!("{}={v}", e.key),
            })
            .collect();
        return format!("descriptor {}", entries.join(", "));
    }
    let m = &rule.matcher;
    let mut parts: Vec<String> = Vec::new();
    if !m.methods.is_empty() {
        parts.push(m.methods.iter().map(Method::as_str).collect::<Vec<_>>().join("|"));
    }
    match &m.path {
        Some(PathPattern::Exact(p)) => parts.push(p.clone()),
        Some(PathPattern::Prefix(p)) => parts.push(format!("{p}*")),
        None => {}
    }
    if m.ignore_case {
        parts.push("(any case)".into());
    }
    if let Some(h) = &m.host {
        parts.push(format!("host {h}"));
    }
    for (name, value) in &m.headers {
        // A matched value may be a credential: only whether one is required.
        match value {
            crate::config::HeaderValueMatch::Any => parts.push(format!("header {name}")),
            crate::config::HeaderValueMatch::Exact(_) => parts.push(format!("header {name}=(hidden)")),
        }
    }
    if parts.is_empty() {
        return "every request".into();
    }
    parts.join(" ")
}

fn window_text(w: &Window) -> String {
    let per = humantime::format_duration(std::time::Duration::from_millis(w.period_ms));
    match w.precision_ms {
        0 => format!("{} per {per}", w.requests),
        p => format!(
            "{} per {per} (in steps of {})",
            w.requests,
            humantime::format_duration(std::time::Duration::from_millis(p))
        ),
    }
}

fn round(x: f64) -> f64 {
    (x * 1000.0).round() / 1000.0
}

fn rfc3339(t: std::time::SystemTime) -> String {
    humantime::format_rfc3339_seconds(t).to_string()
}

/// A dry-run question, in either form.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExplainRequest {
    /// HTTP: the method (default GET).
    method: Option<String>,
    /// HTTP: the path, with the query if any (default `/`).
    path: Option<String>,
    /// HTTP: the host asked for.
    host: Option<String>,
    /// HTTP: request headers, in order.
    #[serde(default)]
    headers: Vec<(String, String)>,
    /// HTTP: the client's address as tollgate resolves it (default 127.0.0.1).
    client: Option<String>,
    /// RLS: the domain.
    domain: Option<String>,
    /// RLS: the descriptors.
    descriptors: Option<Vec<DescriptorRequest>>,
}

/// One RLS descriptor of a dry-run question.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DescriptorRequest {
    entries: Vec<(String, String)>,
    hits_addend: Option<u64>,
}

/// Why a dry-run question cannot be answered (400).
#[derive(Debug, thiserror::Error)]
pub enum ExplainError {
    /// The body is not the JSON asked for.
    #[error("not an explain request: {0}")]
    Json(#[from] serde_json::Error),
    /// A field holds something no request could.
    #[error("{0}")]
    Field(String),
    /// tollgate would answer such a request 400 itself.
    #[error("{0}")]
    Request(#[from] limits::http::RequestError),
}

/// How the RLS is set to answer, which its dry runs follow.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct RlsModes {
    /// `--rls-quota-mode`.
    pub quota: bool,
    /// `--rls-shadow-mode`: every answer is OK.
    pub shadow: bool,
}

/// `/api/explain`: what the request described by `body` would get now.
pub(super) async fn explain(
    limiter: &Limiter,
    files: &LiveFiles,
    rls: RlsModes,
    body: &[u8],
) -> Result<Json, ExplainError> {
    let q: ExplainRequest = serde_json::from_slice(body)?;
    let catalog = files.catalog().load_full();
    let hits = match (&q.domain, &q.descriptors) {
        (Some(domain), Some(descriptors)) => {
            // Asked as the RLS would be, and refused as it refuses.
            use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
            use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
            use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
            use envoy_types::pb::google::protobuf::UInt64Value;
            let req = RateLimitRequest {
                domain: domain.clone(),
                descriptors: descriptors
                    .iter()
                    .map(|d| RateLimitDescriptor {
                        entries: d
                            .entries
                            .iter()
                            .map(|(key, value)| Entry {
                                key: key.clone(),
                                value: value.clone(),
                            })
                            .collect(),
                        hits_addend: d.hits_addend.map(|value| UInt64Value { value }),
                        ..Default::default()
                    })
                    .collect(),
                hits_addend: 0,
            };
            if let Some(why) = crate::surfaces::envoy_rls::invalid(&req) {
                return Err(ExplainError::Field(why));
            }
            let Some(limits) = catalog.domain(domain).cloned() else {
                return Ok(
                    json!({"verdict": "no_rule", "status": 200, "retry_after_ms": null, "store_error": null, "rules": [], "note": "no limits file has this domain"}),
                );
            };
            // As the RLS: 1 unless given; 0 checks without charging.
            let descriptors: Vec<Descriptor<'_>> = req
                .descriptors
                .iter()
                .map(|d| crate::surfaces::envoy_rls::descriptor(d, 1))
                .collect();
            limits::resolve(&limits, &descriptors, rls.quota).hits
        }
        (None, None) => {
            let method = q.method.as_deref().unwrap_or("GET");
            let method = Method::from_bytes(method.as_bytes())
                .map_err(|_| ExplainError::Field(format!("not a method: {method:?}")))?;
            let target = q.path.as_deref().unwrap_or("/");
            if !target.starts_with('/') {
                return Err(ExplainError::Field("the path must start with /".into()));
            }
            let uri: http::Uri = target
                .parse()
                .map_err(|e| ExplainError::Field(format!("not a path: {e}")))?;
            let mut headers = HeaderMap::new();
            for (name, value) in &q.headers {
                let name = HeaderName::from_bytes(name.as_bytes())
                    .map_err(|_| ExplainError::Field(format!("not a header name: {name:?}")))?;
                let value = HeaderValue::from_str(value)
                    .map_err(|_| ExplainError::Field(format!("not a header value for {name}")))?;
                headers.append(name, value);
            }
            // An empty one is asked as given: a request whose Host is
            // empty, which the proxy refuses (the page leaves the field
            // out when it is blank).
            if let Some(host) = &q.host {
                let value = HeaderValue::from_str(host).map_err(|_| ExplainError::Field("not a host".into()))?;
                // Appended: a Host header given besides is two hosts (400).
                headers.append(http::header::HOST, value);
            }
            // The proxy answers 431 past these (hyper's bounds, ours on HTTP/2).
            let bounds = crate::serve::ConnLimits::default();
            if !bounds.admits(crate::fields::Fields::Map(&headers)) {
                return Err(ExplainError::Field(format!(
                    "the proxy answers 431 to more than {} header fields or {} bytes of them",
                    bounds.max_headers, bounds.max_header_bytes
                )));
            }
            // Without a host the question is about a request that named
            // none (rules on a host then do not match), not a bad one.
            let version = match headers.contains_key(http::header::HOST) {
                true => http::Version::HTTP_11,
                false => http::Version::HTTP_10,
            };
            let client: IpAddr = match q.client.as_deref() {
                None | Some("") => IpAddr::from([127, 0, 0, 1]),
                Some(c) => c
                    .parse()
                    .map_err(|_| ExplainError::Field(format!("not an IP address: {c:?}")))?,
            };
            let host = request_host(version, &uri, crate::fields::Fields::Map(&headers))?;
            let info = RequestInfo {
                method: &method,
                path: uri.path(),
                query: uri.query(),
                host,
                headers: crate::fields::Fields::Map(&headers),
                client_ip: client,
                client_cert: None,
            };
            catalog.http_hits(&info)?
        }
        _ => {
            return Err(ExplainError::Field(
                "give method/path/host/headers/client for an HTTP request, or domain and descriptors for an RLS one"
                    .into(),
            ));
        }
    };
    drop(catalog);
    if hits.is_empty() {
        return Ok(
            json!({"verdict": "no_rule", "status": 200, "retry_after_ms": null, "store_error": null, "rules": []}),
        );
    }
    let mut answer = match limiter.explain(&hits).await {
        Ok((decision, counts)) => {
            let rules: Vec<Json> = hits
                .iter()
                .zip(&decision.rules)
                .enumerate()
                .map(|(i, (hit, outcome))| {
                    let counted = counts.as_ref().and_then(|c| c.get(i));
                    let windows: Vec<Json> = outcome
                        .windows
                        .iter()
                        .enumerate()
                        .map(|(j, w)| {
                            json!({
                                "window": window_text(&w.window),
                                "limit": w.window.requests,
                                "per_ms": w.window.period_ms,
                                // Not known for a refusal the denial cache answers.
                                "used": counted.and_then(|c| c.windows.get(j)).map(|c| c.used),
                                "remaining": w.remaining,
                                "reset_ms": w.reset_ms,
                                "retry_ms": w.retry_ms,
                                "never": w.never,
                            })
                        })
                        .collect();
                    hit_json(hit, json!({"would_refuse": outcome.over, "windows": windows}))
                })
                .collect();
            json!({
                "verdict": verdict_word(decision.verdict),
                "status": match decision.verdict.admits() {
                    true => 200,
                    false => decision.status().as_u16(),
                },
                "retry_after_ms": decision.retry_after_ms(),
                "from_denial_cache": counts.is_none(),
                "store_error": null,
                "rules": rules,
            })
        }
        Err(e) => {
            activity::get().store_failed(&e);
            // As a decision would go: the rules' failure modes decide.
            let verdict = crate::limiter::failure_verdict(&hits);
            let rules: Vec<Json> = hits
                .iter()
                .map(|h| {
                    let closes = crate::limiter::fails_closed(&h.rule);
                    hit_json(
                        h,
                        json!({
                            "failure_mode": if closes { "closed" } else { "open" },
                            "would_refuse": verdict == Verdict::FailedClosed && closes,
                            "windows": [],
                        }),
                    )
                })
                .collect();
            json!({
                "verdict": verdict_word(verdict),
                "status": if verdict.admits() { 200 } else { 503 },
                // The surfaces send `Retry-After: 1` with a fail-closed 503.
                "retry_after_ms": (verdict == Verdict::FailedClosed).then_some(1000),
                "from_denial_cache": false,
                "store_error": e.to_string(),
                "rules": rules,
            })
        }
    };
    // In shadow mode the RLS answers OK whatever the limits decided.
    if rls.shadow
        && q.domain.is_some()
        && answer["status"] != 200
        && let Some(map) = answer.as_object_mut()
    {
        let decided = map.insert("verdict".into(), json!("allowed"));
        map.insert("status".into(), json!(200));
        map.insert("retry_after_ms".into(), Json::Null);
        map.insert(
            "note".into(),
            json!(format!(
                "--rls-shadow-mode: the RLS answers OK; without it this would be {}",
                decided.as_ref().and_then(Json::as_str).unwrap_or("refused")
            )),
        );
    }
    Ok(answer)
}

/// One rule's counter in an explain answer, with `extra` fields.
fn hit_json(hit: &crate::limiter::Hit, extra: Json) -> Json {
    let mut out = json!({
        "rule": hit.rule.name,
        "id": hit.rule.id,
        "domain": keys::describe(&hit.key).map(|p| p.domain),
        "shadow": hit.rule.shadow,
        "quota": hit.rule.quota,
        "cost": hit.cost,
        "counter": hit.key,
        "values": shown_values(&hit.key, hit.rule.descriptor.is_some()),
    });
    if let (Some(map), Json::Object(more)) = (out.as_object_mut(), extra) {
        map.extend(more);
    }
    out
}

fn verdict_word(verdict: Verdict) -> &'static str {
    match verdict {
        Verdict::Allowed => "allowed",
        Verdict::Limited => "limited",
        Verdict::FailedOpen => "failed_open",
        Verdict::FailedClosed => "failed_closed",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rule_listing_is_capped_whatever_it_asks() {
        assert_eq!(RuleQuery::parse(Some("limit=100000")).limit, MAX_RULES_SHOWN);
        assert_eq!(RuleQuery::parse(Some("limit=7&filter=Per%20Key")).limit, 7);
        assert_eq!(RuleQuery::parse(Some("filter=Per%20Key")).filter, "per key");
        assert_eq!(RuleQuery::parse(None).limit, DEFAULT_RULES_SHOWN);
        assert_eq!(RuleQuery::parse(Some("limit=x")).limit, DEFAULT_RULES_SHOWN);
    }
}
