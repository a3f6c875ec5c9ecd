//! Envoy's global rate limit service (RLS v3, gRPC): `ShouldRateLimit`.
//!
//! Translation only: the request's domain picks a limits file, whose
//! descriptor tree resolves the descriptors (`limits::descriptors`), and all
//! of them are decided together by the limiter, so a refused request charges
//! nothing. The answer carries one status per
//! descriptor, in order, with the exact time until the window frees up.

use std::collections::HashMap;
use std::sync::Arc;

use envoy_types::pb::envoy::config::core::v3::HeaderValue;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::RateLimitDescriptor;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::rate_limit::Unit;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::{Code, DescriptorStatus, RateLimit};
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_server::RateLimitService;
use envoy_types::pb::envoy::service::ratelimit::v3::{RateLimitRequest, RateLimitResponse};
use envoy_types::pb::google::protobuf::value::Kind;
use envoy_types::pb::google::protobuf::{Duration as PbDuration, ListValue, Struct as PbStruct, Value as PbValue};
use http::HeaderMap;

use crate::config::FailureMode;
use crate::render;
use crate::limiter::{Decision, Limiter, RuleOutcome, Verdict};
use crate::limits::{self, Descriptor, Override, Resolved};
use crate::metrics::{self, Surface};
use crate::limits::SharedCatalog;

/// Most descriptors one RLS request may carry. Envoy sends one per rate
/// limit action of a route (a handful); an unbounded request would become
/// one script call long enough to make every other decision miss its
/// deadline and fail open.
pub const MAX_DESCRIPTORS: usize = 64;
/// Most entries one descriptor may carry.
pub const MAX_ENTRIES: usize = 32;

/// The RLS service, shared by every gRPC connection.
pub struct RlsService {
    limiter: Arc<Limiter>,
    catalog: SharedCatalog,
    dynamic_metadata: bool,
    shadow_mode: bool,
    quota_mode: bool,
    headers: bool,
}

impl RlsService {
    /// An RLS service deciding with `limiter` against the files in `catalog`.
    pub fn new(limiter: Arc<Limiter>, catalog: SharedCatalog) -> Self {
        RlsService {
            limiter,
            catalog,
            dynamic_metadata: false,
            shadow_mode: false,
            quota_mode: false,
            headers: true,
        }
    }

    /// Also answer with dynamic metadata (the request's domain, descriptors,
    /// and the `metadata` of every limit it passed), as envoyproxy/ratelimit
    /// does with `RESPONSE_DYNAMIC_METADATA`.
    pub fn with_dynamic_metadata(mut self, on: bool) -> Self {
        self.dynamic_metadata = on;
        self
    }

    /// Answer every request OK, whatever its descriptors' statuses say
    /// (envoyproxy/ratelimit's global `SHADOW_MODE`): a dry run of new limits.
    /// A request over a limit is still not counted.
    pub fn with_shadow_mode(mut self, on: bool) -> Self {
        self.shadow_mode = on;
        self
    }

    /// Treat every limit as `quota_mode` (envoyproxy/ratelimit's global
    /// `QUOTA_MODE`): a request is refused only when all its limits are over.
    pub fn with_quota_mode(mut self, on: bool) -> Self {
        self.quota_mode = on;
        self
    }

    /// Whether answers carry the RateLimit headers for Envoy to add to the
    /// response (on by default).
    pub fn with_headers(mut self, on: bool) -> Self {
        self.headers = on;
        self
    }

    /// Decides one RLS request.
    pub async fn decide(&self, req: &RateLimitRequest) -> RateLimitResponse {
        // The catalog guard is let go before the decision awaits: arc-swap
        // guards are cheap only while few are held at once on a thread.
        let Some(limits) = self.catalog.load().domain(&req.domain).cloned() else {
            // envoyproxy/ratelimit answers OK for domains it does not know.
            metrics::get().unknown_domain();
            metrics::get().request(Surface::Rls, metrics::Answer::Allowed);
            tracing::debug!(domain = ?req.domain, "no limits for this domain; answering OK");
            let mut response = ok_response(req.descriptors.len());
            if self.dynamic_metadata {
                response.dynamic_metadata = Some(request_metadata(req, std::iter::empty()));
            }
            return response;
        };
        let request_hits = u64::from(if req.hits_addend == 0 { 1 } else { req.hits_addend });
        let descriptors: Vec<Descriptor<'_>> = req.descriptors.iter().map(|d| descriptor(d, request_hits)).collect();
        let Resolved { rules, hits, hit_of } = limits::resolve(&limits, &descriptors, self.quota_mode);
        let decision = self.limiter.decide(&hits).await;
        metrics::get().request(Surface::Rls, decision.verdict.into());

        let statuses: Vec<DescriptorStatus> = rules
            .iter()
            .zip(&hit_of)
            .map(|(rule, hit)| match (rule, hit) {
                (Some(rule), _) if rule.unlimited => DescriptorStatus {
                    code: Code::Ok as i32,
                    current_limit: None,
                    limit_remaining: u32::MAX,
                    ..Default::default()
                },
                (_, Some(h)) => match decision.rules.get(*h) {
                    Some(outcome) => descriptor_status(&decision, outcome),
                    // Never happens: the limiter answers one outcome per hit.
                    None => DescriptorStatus {
                        code: Code::Ok as i32,
                        ..Default::default()
                    },
                },
                _ => DescriptorStatus {
                    code: Code::Ok as i32,
                    ..Default::default()
                },
            })
            .collect();
        let admitted = decision.verdict.admits() || self.shadow_mode;
        let overall = if admitted { Code::Ok } else { Code::OverLimit };
        let mut headers = HeaderMap::new();
        match (self.headers, admitted) {
            (false, _) => {}
            (true, true) => render::admission_headers(&decision, &mut headers),
            (true, false) => render::refusal_headers(&decision, &mut headers),
        }
        let dynamic_metadata = self.dynamic_metadata.then(|| {
            // The limits of the descriptors answered OK, as envoyproxy/ratelimit
            // collects them; a shadow limit that was over counts as passed.
            let passed = rules
                .iter()
                .zip(&statuses)
                .filter(|(_, s)| s.code == Code::Ok as i32)
                .filter_map(|(rule, _)| rule.as_ref().filter(|rule| !rule.unlimited))
                .filter_map(|rule| rule.metadata.as_ref());
            request_metadata(req, passed)
        });
        RateLimitResponse {
            overall_code: overall as i32,
            statuses,
            response_headers_to_add: header_options(&headers),
            dynamic_metadata,
            ..Default::default()
        }
    }
}

/// The dynamic metadata of an answer: the request's domain, descriptors
/// (`key=value` entries and their own `hitsAddend`), its `hitsAddend`, and
/// the `metadata` of the passed limits merged (the first value of a key wins,
/// maps merge).
fn request_metadata<'a>(req: &RateLimitRequest, passed: impl Iterator<Item = &'a serde_json::Value>) -> PbStruct {
    let mut fields = HashMap::new();
    fields.insert("domain".to_string(), string_value(req.domain.clone()));
    let descriptors = req
        .descriptors
        .iter()
        .map(|d| {
            let mut f = HashMap::new();
            let entries = d
                .entries
                .iter()
                .map(|e| string_value(format!("{}={}", e.key, e.value)))
                .collect();
            f.insert("entries".to_string(), list_value(entries));
            if let Some(h) = &d.hits_addend {
                f.insert("hitsAddend".to_string(), number_value(h.value as f64));
            }
            PbValue {
                kind: Some(Kind::StructValue(PbStruct { fields: f })),
            }
        })
        .collect();
    fields.insert("descriptors".to_string(), list_value(descriptors));
    if req.hits_addend != 0 {
        fields.insert("hitsAddend".to_string(), number_value(f64::from(req.hits_addend)));
    }
    let mut merged = serde_json::Map::new();
    for metadata in passed {
        if let Some(m) = metadata.as_object() {
            merge(&mut merged, m);
        }
    }
    if !merged.is_empty() {
        fields.insert("metadata".to_string(), to_pb(&serde_json::Value::Object(merged)));
    }
    PbStruct { fields }
}

/// Adds `from`'s keys to `into`; where both hold a map the maps merge,
/// otherwise what `into` has stays.
fn merge(into: &mut serde_json::Map<String, serde_json::Value>, from: &serde_json::Map<String, serde_json::Value>) {
    for (k, v) in from {
        match (into.get_mut(k), v) {
            (Some(serde_json::Value::Object(a)), serde_json::Value::Object(b)) => merge(a, b),
            (Some(_), _) => {}
            (None, v) => {
                into.insert(k.clone(), v.clone());
            }
        }
    }
}

fn to_pb(v: &serde_json::Value) -> PbValue {
    use serde_json::Value as J;
    let kind = match v {
        J::Null => Kind::NullValue(0),
        J::Bool(b) => Kind::BoolValue(*b),
        J::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        J::String(s) => Kind::StringValue(s.clone()),
        J::Array(a) => Kind::ListValue(ListValue {
            values: a.iter().map(to_pb).collect(),
        }),
        J::Object(o) => Kind::StructValue(PbStruct {
            fields: o.iter().map(|(k, v)| (k.clone(), to_pb(v))).collect(),
        }),
    };
    PbValue { kind: Some(kind) }
}

fn string_value(s: String) -> PbValue {
    PbValue {
        kind: Some(Kind::StringValue(s)),
    }
}

fn number_value(n: f64) -> PbValue {
    PbValue {
        kind: Some(Kind::NumberValue(n)),
    }
}

fn list_value(values: Vec<PbValue>) -> PbValue {
    PbValue {
        kind: Some(Kind::ListValue(ListValue { values })),
    }
}

#[tonic::async_trait]
impl RateLimitService for RlsService {
    async fn should_rate_limit(
        &self,
        request: tonic::Request<RateLimitRequest>,
    ) -> Result<tonic::Response<RateLimitResponse>, tonic::Status> {
        let req = request.get_ref();
        if let Some(why) = invalid(req) {
            metrics::get().request(Surface::Rls, metrics::Answer::BadRequest);
            return Err(tonic::Status::invalid_argument(why));
        }
        Ok(tonic::Response::new(self.decide(req).await))
    }
}

/// Why a request is answered INVALID_ARGUMENT, if it is (envoyproxy/ratelimit
/// refuses an empty domain or descriptor list too); the admin's dry run
/// refuses the same.
pub(crate) fn invalid(req: &RateLimitRequest) -> Option<String> {
    if req.domain.is_empty() {
        return Some("rate limit domain must not be empty".into());
    }
    if req.descriptors.is_empty() {
        return Some("rate limit descriptor list must not be empty".into());
    }
    if req.descriptors.len() > MAX_DESCRIPTORS || req.descriptors.iter().any(|d| d.entries.len() > MAX_ENTRIES) {
        return Some(format!(
            "at most {MAX_DESCRIPTORS} descriptors of at most {MAX_ENTRIES} entries per request"
        ));
    }
    None
}

/// What the limits need of one descriptor: its entries, its own `limit`,
/// and its cost.
pub(crate) fn descriptor(d: &RateLimitDescriptor, request_hits: u64) -> Descriptor<'_> {
    Descriptor {
        entries: d.entries.iter().map(|e| (e.key.as_str(), e.value.as_str())).collect(),
        limit: d.limit.as_ref().map(|o| Override {
            requests: o.requests_per_unit,
            unit: Unit::try_from(o.unit).map_or("UNKNOWN", |u| u.as_str_name()),
        }),
        cost: cost_of(d, request_hits),
    }
}

/// A descriptor's own `hits_addend` wins over the request's; 0 there means
/// "check, do not charge". Refunds (`is_negative_hits`) are only checked:
/// units in a sliding window are never taken back.
fn cost_of(d: &RateLimitDescriptor, request_hits: u64) -> u64 {
    if d.is_negative_hits {
        return 0;
    }
    // Past the cap no window can hold it: one more than the cap says "never
    // fits" and keeps the store's arithmetic far from any overflow.
    d.hits_addend
        .as_ref()
        .map_or(request_hits, |v| v.value)
        .min(crate::config::MAX_UNITS.saturating_add(1))
}

/// The Envoy unit of a window, when the window is exactly one unit long.
fn unit_of(period_ms: u64) -> Unit {
    [
        Unit::Second,
        Unit::Minute,
        Unit::Hour,
        Unit::Day,
        Unit::Week,
        Unit::Month,
        Unit::Year,
    ]
    .into_iter()
    .find(|u| crate::config::envoy_unit_ms(u.as_str_name()) == Some(period_ms))
    .unwrap_or(Unit::Unknown)
}

fn descriptor_status(decision: &Decision, outcome: &RuleOutcome) -> DescriptorStatus {
    let rule = &outcome.rule;
    let refused = outcome.over && !rule.shadow;
    let failed_closed = decision.verdict == Verdict::FailedClosed;
    // The window that keeps the request out longest, so that waiting
    // `duration_until_reset` is enough; else the one with the least room.
    let window = outcome.telling_window();
    let code = if refused || (failed_closed && rule.failure_mode == FailureMode::Closed) {
        Code::OverLimit
    } else {
        Code::Ok
    };
    // Undecided (the store failed), or refused without the store (a cost
    // that can never fit): no limit is claimed, so Envoy adds no
    // `X-RateLimit-*` headers, rather than telling clients 0 remain.
    let decided = !matches!(decision.verdict, Verdict::FailedOpen | Verdict::FailedClosed)
        && !outcome.windows.iter().any(|w| w.unknown);
    let current = window
        .map(|w| w.window)
        .or_else(|| rule.windows.first().copied())
        .filter(|_| decided);
    DescriptorStatus {
        code: code as i32,
        current_limit: current.map(|w| RateLimit {
            name: rule.limit_name.clone(),
            requests_per_unit: u32::try_from(w.requests).unwrap_or(u32::MAX),
            unit: unit_of(w.period_ms) as i32,
        }),
        limit_remaining: window.map_or(0, |w| u32::try_from(w.remaining).unwrap_or(u32::MAX)),
        // A cost above the window's whole limit never fits: no time to give.
        duration_until_reset: window.filter(|w| !w.never).map(|w| {
            let ms = w.retry_ms.unwrap_or(w.reset_ms);
            let secs = ms.checked_div(1000).unwrap_or(0);
            let sub_ms = ms.checked_rem(1000).unwrap_or(0);
            PbDuration {
                seconds: i64::try_from(secs).unwrap_or(i64::MAX),
                nanos: i32::try_from(sub_ms.saturating_mul(1_000_000)).unwrap_or(0),
            }
        }),
        ..Default::default()
    }
}

fn ok_response(descriptors: usize) -> RateLimitResponse {
    RateLimitResponse {
        overall_code: Code::Ok as i32,
        statuses: (0..descriptors)
            .map(|_| DescriptorStatus {
                code: Code::Ok as i32,
                ..Default::default()
            })
            .collect(),
        ..Default::default()
    }
}

fn header_options(headers: &HeaderMap) -> Vec<HeaderValue> {
    headers
        .iter()
        .map(|(name, value)| HeaderValue {
            key: name.as_str().to_string(),
            value: String::from_utf8_lossy(value.as_bytes()).into_owned(),
            ..Default::default()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limiter::{ManualClock, MemoryStore, Store};
    use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::{Entry, RateLimitOverride};
    use envoy_types::pb::google::protobuf::UInt64Value;
    use proptest::prelude::*;

    const LIMITS: &str = "\
domain: d
rules:
  - name: per-ip
    descriptor: [{ key: remote_address }]
    limits: [{ requests: 3, per: 1s }, { requests: 10, per: 90s }]
  - name: login
    descriptor: [{ key: remote_address }, { key: path, value: /login }]
    limits: [{ requests: 2, per: 3s }]
  - name: pre
    descriptor: [{ key: k, value: ab* }]
    shadow: true
    limits: [{ requests: 1, per: 1s }]
";

    fn service(dir: &tempfile::TempDir) -> RlsService {
        let path = dir.path().join("d.yaml");
        std::fs::write(&path, LIMITS).unwrap();
        let catalog = crate::reload::LiveFiles::load(&[path], false).unwrap().catalog();
        let clock = Arc::new(ManualClock::new(1_000_000));
        let limiter = Arc::new(Limiter::with_clock(
            Store::Memory(MemoryStore::new(clock.clone())),
            std::time::Duration::from_millis(50),
            clock,
        ));
        RlsService::new(limiter, catalog)
    }

    fn any_descriptor() -> impl Strategy<Value = RateLimitDescriptor> {
        let entry = (
            "(remote_address|path|k|[a-z]{0,3})",
            "(10.0.0.1|/login|abc|ab|[ -~]{0,20})",
        );
        (
            prop::collection::vec(entry, 0..4),
            prop::option::of(any::<u64>()),
            prop::option::of((any::<u32>(), -2i32..10)),
            any::<bool>(),
        )
            .prop_map(|(entries, hits, limit, negative)| RateLimitDescriptor {
                entries: entries.into_iter().map(|(key, value)| Entry { key, value }).collect(),
                hits_addend: hits.map(|value| UInt64Value { value }),
                limit: limit.map(|(requests_per_unit, unit)| RateLimitOverride {
                    requests_per_unit,
                    unit,
                }),
                is_negative_hits: negative,
            })
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 256, ..Default::default() })]
        /// Fuzz: any RLS request is answered, one status per descriptor, in
        /// order, never a panic (a panic resets the stream, and Envoy's
        /// default then admits the request).
        #[test]
        fn any_request_gets_one_status_per_descriptor(
            requests in prop::collection::vec((prop::collection::vec(any_descriptor(), 0..6), any::<u32>(), "(d|x|)"), 1..12),
        ) {
            let dir = tempfile::tempdir().unwrap();
            let rls = service(&dir);
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            for (descriptors, hits_addend, domain) in requests {
                let req = RateLimitRequest { domain, descriptors, hits_addend };
                let r = runtime.block_on(rls.decide(&req));
                prop_assert_eq!(r.statuses.len(), req.descriptors.len());
                prop_assert!(r.overall_code == Code::Ok as i32 || r.overall_code == Code::OverLimit as i32);
            }
        }
    }
}
