//! How a decision is told to the caller: `Retry-After`, the RateLimit headers
//! of draft-ietf-httpapi-ratelimit-headers, and the refusal body.
//!
//! Every surface renders decisions through here so that the proxy,
//! ext_authz, auth_request and RLS answers look the same. Policy items are named
//! after the rule, one item per window; `RateLimit` lists the same items in
//! the same order.

use std::borrow::Cow;

use bytes::Bytes;
use http::header::{CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue, RETRY_AFTER};
use http::{Response, StatusCode};

use crate::fields::Fields;
use crate::limiter::{Decision, RuleOutcome, Verdict, WindowOutcome};

/// A gRPC call's deadline.
static GRPC_TIMEOUT: HeaderName = HeaderName::from_static("grpc-timeout");

/// `RateLimit-Policy`: the quota of each window.
pub const RATELIMIT_POLICY: HeaderName = HeaderName::from_static("ratelimit-policy");
/// `RateLimit`: what is left of each window and when more frees up.
pub const RATELIMIT: HeaderName = HeaderName::from_static("ratelimit");

/// Whole seconds, rounded up: a client that waits this long will fit.
pub fn ceil_secs(ms: u64) -> u64 {
    ms.div_ceil(1000)
}

/// A refused request's answer: `status`, the JSON refusal body,
/// `Retry-After` and the RateLimit headers of the refusing rules.
pub fn refusal(decision: &Decision, status: StatusCode) -> Response<Bytes> {
    let mut response = Response::new(refusal_body(decision));
    *response.status_mut() = status;
    let h = response.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    refusal_headers(decision, h);
    response
}

/// A refused gRPC call's answer, as a gRPC client reads one: HTTP 200 and
/// a trailers-only response (`grpc-status` in the headers, no body) with
/// `RESOURCE_EXHAUSTED` (8) and a `grpc-message` naming the rule, the wait
/// as `google.rpc.RetryInfo` in `grpc-status-details-bin` (what gRPC's
/// retry-aware clients read), beside `Retry-After` and the RateLimit
/// headers. A bare 429 is reported by gRPC clients as `UNAVAILABLE`, which
/// they retry at once. A store that failed closed answers `UNAVAILABLE` (14).
pub fn grpc_refusal(decision: &Decision) -> Response<Bytes> {
    let status = match decision.verdict {
        Verdict::FailedClosed => {
            use tonic_types::{ErrorDetails, StatusExt};
            // As its Retry-After: 1.
            let wait = ErrorDetails::with_retry_info(Some(std::time::Duration::from_secs(1)));
            let message = "the rate limiter cannot reach its counters; retry shortly";
            tonic::Status::with_error_details(tonic::Code::Unavailable, message, wait)
        }
        _ => {
            let refusing = decision.refusing().next();
            let rule = refusing.map_or("", |r| r.rule.name.as_str());
            let code = refusing.map_or(crate::config::RESOURCE_EXHAUSTED, |r| r.rule.grpc_status);
            let code = tonic::Code::from(i32::from(code));
            match decision.retry_after_ms() {
                Some(ms) => {
                    use tonic_types::{ErrorDetails, StatusExt};
                    let wait = std::time::Duration::from_millis(ms);
                    let message = format!("rate limited by rule {rule}; retry after {} s", ceil_secs(ms));
                    tonic::Status::with_error_details(code, message, ErrorDetails::with_retry_info(Some(wait)))
                }
                None => tonic::Status::new(
                    code,
                    format!("rate limited by rule {rule}: this call costs more than the rule's whole limit"),
                ),
            }
        }
    };
    let mut response = grpc_status(&status);
    refusal_headers(decision, response.headers_mut());
    response
}

/// tollgate's own failure answered to a gRPC call (trailers-only, HTTP 200):
/// `code` is `UNAVAILABLE`, `DEADLINE_EXCEEDED`...
pub fn grpc_error(code: tonic::Code, message: &str) -> Response<Bytes> {
    grpc_status(&tonic::Status::new(code, message))
}

/// A trailers-only gRPC response carrying `status`.
fn grpc_status(status: &tonic::Status) -> Response<Bytes> {
    let mut response = Response::new(Bytes::new());
    let h = response.headers_mut();
    h.insert(CONTENT_TYPE, HeaderValue::from_static("application/grpc"));
    // Fails only for metadata a caller put in, and this status has none.
    if let Err(e) = status.add_header(h) {
        tracing::debug!(error = %e, "gRPC status not rendered whole");
    }
    response
}

/// A `grpc-timeout` that is not up to eight digits and a unit of H, M, S,
/// m, u or n (`100m`, `5S`).
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
#[error("malformed grpc-timeout")]
pub struct MalformedTimeout;

/// A gRPC call's deadline from its `grpc-timeout` header (`Ok(None)`
/// without one).
pub fn grpc_deadline(headers: Fields<'_>) -> Result<Option<std::time::Duration>, MalformedTimeout> {
    let mut values = headers.get_all(&GRPC_TIMEOUT);
    let first = values.next();
    // Two deadlines: tollgate would keep one and the upstream the other.
    if values.next().is_some() {
        return Err(MalformedTimeout);
    }
    match first {
        None => Ok(None),
        Some(v) => grpc_timeout(v).map(Some).ok_or(MalformedTimeout),
    }
}

/// A `grpc-timeout` value read as a duration, if it is well formed.
fn grpc_timeout(value: &[u8]) -> Option<std::time::Duration> {
    let text = crate::fields::text(value)?;
    let split = text.len().checked_sub(1)?;
    let (digits, unit) = (text.get(..split)?, text.get(split..)?);
    if digits.is_empty() || digits.len() > 8 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let n: u64 = digits.parse().ok()?;
    use std::time::Duration;
    Some(match unit {
        "H" => Duration::from_secs(n.checked_mul(3600)?),
        "M" => Duration::from_secs(n.checked_mul(60)?),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

/// Whether a request is a gRPC call (`application/grpc`, `application/grpc+proto`,
/// in any case, as media types are). gRPC-Web (`application/grpc-web…`) is
/// another protocol, answered as plain HTTP.
pub fn is_grpc(headers: Fields<'_>) -> bool {
    let Some(v) = headers.get(&CONTENT_TYPE) else { return false };
    let prefix = b"application/grpc";
    v.get(..prefix.len()).is_some_and(|p| p.eq_ignore_ascii_case(prefix))
        && matches!(v.get(prefix.len()), None | Some(b'+' | b';'))
}

/// tollgate's own answer to a request it cannot decide or forward: a small
/// JSON body naming the status and why (none when `message` is empty).
pub fn error(status: StatusCode, message: &str) -> Response<Bytes> {
    let mut response = Response::new(Bytes::new());
    *response.status_mut() = status;
    if !message.is_empty() {
        let body = serde_json::json!({ "error": status.canonical_reason().unwrap_or("error"), "message": message });
        *response.body_mut() = Bytes::from(body.to_string());
        response
            .headers_mut()
            .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    }
    response
}

/// [`refusal`] with its fields written out (in the order its map holds
/// them), for a body that carries them ([`crate::serve::CarriesFields`]):
/// the proxy's refusals, which a map only slowed (BENCHMARKS.md §64).
pub fn refusal_written(decision: &Decision) -> (crate::serve::WrittenFields, Bytes) {
    let mut fields = crate::serve::WrittenFields {
        lines: Vec::with_capacity(256),
        has_date: false,
    };
    fields.push(CONTENT_TYPE.as_str().as_bytes(), b"application/json");
    let (retry, ratelimit) = refusal_values(decision);
    if let Some(retry) = retry {
        fields.push(RETRY_AFTER.as_str().as_bytes(), retry.as_bytes());
    }
    if let Some((policy, state)) = ratelimit {
        fields.push(RATELIMIT_POLICY.as_str().as_bytes(), policy.as_bytes());
        fields.push(RATELIMIT.as_str().as_bytes(), state.as_bytes());
    }
    (fields, refusal_body(decision))
}

/// Headers for a refused request: `Retry-After` and every window of the
/// refusing rules (or just `Retry-After: 1` when the store failed closed).
pub fn refusal_headers(decision: &Decision, headers: &mut HeaderMap) {
    let (retry, ratelimit) = refusal_values(decision);
    if let Some(retry) = retry {
        headers.insert(RETRY_AFTER, retry);
    }
    if let Some((policy, state)) = ratelimit {
        headers.insert(RATELIMIT_POLICY, policy);
        headers.insert(RATELIMIT, state);
    }
}

/// The values of [`refusal_headers`]' `Retry-After` and RateLimit pair.
fn refusal_values(decision: &Decision) -> (Option<HeaderValue>, Option<(HeaderValue, HeaderValue)>) {
    if decision.verdict == Verdict::FailedClosed {
        return (Some(HeaderValue::from_static("1")), None);
    }
    // A request that costs more than a window's whole limit never fits:
    // no Retry-After would be true.
    let retry = (!decision.never_fits()).then(|| {
        let retry = ceil_secs(decision.retry_after_ms().unwrap_or(1000)).max(1);
        HeaderValue::from(retry)
    });
    let mut windows: Vec<(&RuleOutcome, &WindowOutcome)> = Vec::new();
    // A window whose state is not known (the store could not be asked)
    // tells none, rather than that none is left.
    for (r, w) in decision.refusing().flat_map(|r| r.windows.iter().filter(|w| !w.unknown).map(move |w| (r, w))) {
        // A counter named twice in one request (a repeated RLS descriptor)
        // is one policy item, not two.
        if !windows
            .iter()
            .any(|(seen, sw)| seen.rule.id == r.rule.id && sw.window == w.window)
        {
            windows.push((r, w));
        }
    }
    (retry, ratelimit_pair(&windows))
}

/// Headers for an admitted request: the tightest window only.
pub fn admission_headers(decision: &Decision, headers: &mut HeaderMap) {
    if let Some(pair) = admission_values(decision) {
        insert_ratelimit(headers, pair);
    }
}

/// Puts [`admission_values`]' `RateLimit-Policy` and `RateLimit` into
/// `headers`, in place of any it held (an upstream's own).
pub fn insert_ratelimit(headers: &mut HeaderMap, (policy, state): (HeaderValue, HeaderValue)) {
    headers.insert(RATELIMIT_POLICY, policy);
    headers.insert(RATELIMIT, state);
}

/// The values of [`admission_headers`]' `RateLimit-Policy` and `RateLimit`,
/// for a response that writes them some other way; `None` when it adds
/// none.
pub fn admission_values(decision: &Decision) -> Option<(HeaderValue, HeaderValue)> {
    ratelimit_pair(&[decision.tightest()?])
}

/// `RateLimit-Policy` and `RateLimit` for `windows`.
fn ratelimit_pair(windows: &[(&RuleOutcome, &WindowOutcome)]) -> Option<(HeaderValue, HeaderValue)> {
    let (policy, state) = match windows {
        [] => return None,
        // Most admissions: one window, whose policy is built once.
        [(rule, w)] => (
            single_policy(&rule.rule.name, w.window.requests, w.window.period_secs()),
            HeaderValue::from_maybe_shared(Bytes::from(one_state(&sf_string(&rule.rule.name), w))).ok(),
        ),
        _ => {
            let (policy, state) = ratelimit_values(windows);
            (
                HeaderValue::from_maybe_shared(Bytes::from(policy)).ok(),
                HeaderValue::from_maybe_shared(Bytes::from(state)).ok(),
            )
        }
    };
    Some((policy?, state?))
}

/// `RateLimit-Policy` and `RateLimit` for `windows`, one item each.
fn ratelimit_values(windows: &[(&RuleOutcome, &WindowOutcome)]) -> (String, String) {
    let mut policy = String::with_capacity(64);
    let mut state = String::with_capacity(64);
    for (i, (rule, w)) in windows.iter().enumerate() {
        let sep = if i == 0 { "" } else { ", " };
        let name = sf_string(&rule.rule.name);
        policy.push_str(sep);
        push_policy(&mut policy, &name, w.window.requests, w.window.period_secs());
        state.push_str(sep);
        push_state(&mut state, &name, w);
    }
    (policy, state)
}

/// `"name";q=Q;w=W`, one window's policy item (`name` escaped already).
fn push_policy(out: &mut String, name: &str, requests: u64, period_secs: u64) {
    // Built on every decision told: push_str and itoa, not format!.
    let mut n = itoa::Buffer::new();
    out.push('"');
    out.push_str(name);
    out.push_str("\";q=");
    out.push_str(n.format(requests));
    out.push_str(";w=");
    out.push_str(n.format(period_secs));
}

/// `"name";r=R;t=T`, one window's state item (`name` escaped already).
fn push_state(out: &mut String, name: &str, w: &WindowOutcome) {
    let mut n = itoa::Buffer::new();
    out.push('"');
    out.push_str(name);
    out.push_str("\";r=");
    out.push_str(n.format(w.remaining));
    out.push_str(";t=");
    out.push_str(n.format(ceil_secs(w.retry_ms.unwrap_or(w.reset_ms))));
}

/// The `RateLimit` item of one window.
fn one_state(name: &str, w: &WindowOutcome) -> String {
    let mut state = String::with_capacity(name.len().saturating_add(32));
    push_state(&mut state, name, w);
    state
}

/// The `RateLimit-Policy` of one window, kept per thread for the last few
/// rules and windows told (nearly every admission of a proxy's busy rules
/// tells the same again): it changes only with the limits.
fn single_policy(rule: &str, requests: u64, period_secs: u64) -> Option<HeaderValue> {
    use std::cell::RefCell;
    /// Policies kept per thread: a few busy rules in turn still hit.
    const KEPT: usize = 4;
    type Kept = (String, u64, u64, HeaderValue);
    thread_local! {
        static LAST: RefCell<([Option<Kept>; KEPT], usize)> = const { RefCell::new(([None, None, None, None], 0)) };
    }
    let kept = LAST
        .try_with(|last| {
            last.borrow().0.iter().flatten().find_map(|(name, q, w, value)| {
                (name == rule && *q == requests && *w == period_secs).then(|| value.clone())
            })
        })
        .ok()
        .flatten();
    if kept.is_some() {
        return kept;
    }
    let name = sf_string(rule);
    let mut policy = String::with_capacity(name.len().saturating_add(32));
    push_policy(&mut policy, &name, requests, period_secs);
    let value = HeaderValue::from_maybe_shared(Bytes::from(policy)).ok()?;
    // The oldest kept one makes room; a thread past its locals (being
    // torn down) keeps nothing.
    let _ = LAST.try_with(|last| {
        let (slots, next) = &mut *last.borrow_mut();
        if let Some(slot) = slots.get_mut(*next % KEPT) {
            *slot = Some((rule.to_owned(), requests, period_secs, value.clone()));
        }
        *next = next.wrapping_add(1);
    });
    Some(value)
}

/// `name` as the inside of a structured-field string: `\` and `"` escaped,
/// anything outside printable ASCII dropped (names from Envoy files are free-form).
fn sf_string(name: &str) -> Cow<'_, str> {
    if name
        .bytes()
        .all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\')
    {
        return Cow::Borrowed(name);
    }
    let mut out = String::with_capacity(name.len());
    for c in name.chars().filter(|c| (' '..='~').contains(c)) {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    Cow::Owned(out)
}

/// A short JSON body naming the rule and window that refused.
pub fn refusal_body(decision: &Decision) -> Bytes {
    // Which rule and window it names, and what goes between `limit` and
    // `rule` (keys in sorted order).
    let (refusing, window, head, middle) = match decision.verdict {
        Verdict::FailedClosed => return Bytes::from_static(UNAVAILABLE),
        _ if decision.never_fits() => {
            let refusing = decision.refusing().find(|r| r.windows.iter().any(|w| w.never));
            let window = refusing.and_then(|r| r.windows.iter().find(|w| w.never));
            (refusing, window, &b"cost_exceeds_limit"[..], None)
        }
        _ => {
            // The rule whose status the answer has; of its windows, the one
            // that holds the request out longest.
            let refusing = decision.refusing().next();
            let window = refusing.and_then(RuleOutcome::telling_window);
            let wait = ceil_secs(decision.retry_after_ms().unwrap_or(0));
            (refusing, window, &b"rate_limited"[..], Some(wait))
        }
    };
    let mut out = Vec::with_capacity(192);
    out.extend_from_slice(b"{\"error\":\"");
    out.extend_from_slice(head);
    out.extend_from_slice(b"\",\"limit\":");
    push_number(&mut out, window.map(|w| w.window.requests));
    match middle {
        None => out.extend_from_slice(b",\"message\":\"this request costs more than the rule's whole limit; it can never be admitted as sent\""),
        Some(wait) => {
            out.extend_from_slice(b",\"retry_after_seconds\":");
            push_number(&mut out, Some(wait));
        }
    }
    out.extend_from_slice(b",\"rule\":");
    push_string(&mut out, refusing.map(|r| r.rule.name.as_str()));
    out.extend_from_slice(b",\"window_seconds\":");
    push_seconds(&mut out, window.map(|w| w.window.period_ms));
    out.push(b'}');
    Bytes::from(out)
}

// The refusal bodies are written by hand, byte for byte as they were first
// built (a `serde_json::Value` map, so keys in sorted order; a client
// comparing bytes, or a cached fixture, keeps seeing the same text), and a
// proptest holds them to that: on a flood of refusals the map's building,
// printing and freeing had been a fifth of each refusal's work, and typed
// serde still 2 k instructions.

const UNAVAILABLE: &[u8] =
    b"{\"error\":\"rate_limiter_unavailable\",\"message\":\"the rate limiter cannot reach its counters; retry shortly\"}";

/// A JSON number, or `null`.
fn push_number(out: &mut Vec<u8>, n: Option<u64>) {
    match n {
        Some(n) => out.extend_from_slice(itoa::Buffer::new().format(n).as_bytes()),
        None => out.extend_from_slice(b"null"),
    }
}

/// A JSON string as serde_json writes it, or `null`.
fn push_string(out: &mut Vec<u8>, s: Option<&str>) {
    match s {
        // Nothing to escape (rule names nearly always): as is.
        Some(s) if s.bytes().all(|b| b >= 0x20 && b != b'"' && b != b'\\') => {
            out.push(b'"');
            out.extend_from_slice(s.as_bytes());
            out.push(b'"');
        }
        Some(s) => {
            let _ = serde_json::to_writer(&mut *out, s);
        }
        None => out.extend_from_slice(b"null"),
    }
}

/// Milliseconds as seconds, as serde_json writes the `f64` (shortest
/// form, `.0` when whole), or `null`.
fn push_seconds(out: &mut Vec<u8>, ms: Option<u64>) {
    let Some(ms) = ms else {
        out.extend_from_slice(b"null");
        return;
    };
    // Past 2^53 ms an f64 is no longer exact: serde_json's own reading.
    if ms >= 1 << 53 {
        let _ = serde_json::to_writer(&mut *out, &(ms as f64 / 1000.0));
        return;
    }
    let mut n = itoa::Buffer::new();
    out.extend_from_slice(n.format(ms / 1000).as_bytes());
    out.push(b'.');
    match ms % 1000 {
        0 => out.push(b'0'),
        frac => {
            // Three digits, zero-padded, without trailing zeros.
            let padded = n.format(frac.saturating_add(1000)).as_bytes();
            let digits = padded.get(1..).unwrap_or_default();
            let keep = digits.iter().rposition(|&d| d != b'0').map_or(0, |at| at.saturating_add(1));
            out.extend_from_slice(digits.get(..keep).unwrap_or_default());
        }
    }
}

#[cfg(test)]
mod grpc_tests {
    use super::*;

    #[test]
    fn grpc_timeouts_as_the_protocol_spells_them() {
        let at = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert("grpc-timeout", HeaderValue::from_str(v).unwrap());
            grpc_deadline(crate::fields::Fields::Map(&h))
        };
        use std::time::Duration;
        assert_eq!(grpc_deadline(crate::fields::Fields::Map(&HeaderMap::new())), Ok(None));
        assert_eq!(at("100m"), Ok(Some(Duration::from_millis(100))));
        assert_eq!(at("5S"), Ok(Some(Duration::from_secs(5))));
        assert_eq!(at("2H"), Ok(Some(Duration::from_secs(7200))));
        assert_eq!(at("99999999n"), Ok(Some(Duration::from_nanos(99_999_999))));
        // The largest a caller can write stays a plain (if distant) deadline.
        assert_eq!(at("99999999H"), Ok(Some(Duration::from_secs(99_999_999 * 3600))));
        for bad in ["", "m", "100", "123456789m", "10x", "-1S", "1.5S", "１S", "abc"] {
            assert_eq!(at(bad), Err(MalformedTimeout), "{bad}");
        }
        let mut twice = HeaderMap::new();
        twice.append("grpc-timeout", HeaderValue::from_static("1S"));
        twice.append("grpc-timeout", HeaderValue::from_static("abc"));
        assert_eq!(grpc_deadline(crate::fields::Fields::Map(&twice)), Err(MalformedTimeout), "sent twice");
    }

    #[test]
    fn grpc_calls_are_told_by_their_content_type_in_any_case() {
        let grpc = |v: &str| {
            let mut h = HeaderMap::new();
            h.insert(CONTENT_TYPE, HeaderValue::from_str(v).unwrap());
            is_grpc(crate::fields::Fields::Map(&h))
        };
        for yes in ["application/grpc", "application/grpc+proto", "APPLICATION/GRPC", "Application/gRPC+json", "application/grpc;x=1"] {
            assert!(grpc(yes), "{yes}");
        }
        for no in ["application/grpc-web", "application/grpc-web+proto", "application/grpcx", "text/plain", "application/gr"] {
            assert!(!grpc(no), "{no}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Window, parse_str};
    use crate::limiter::RuleOutcome;
    use std::sync::Arc;

    fn decision() -> Decision {
        let limits = parse_str(
            "domain: d\nrules:\n  - name: login\n    limits: [{requests: 20, per: 60s}, {requests: 5, per: 3s}]\n",
            "l.yaml",
        )
        .unwrap();
        let rule = limits.rules[0].clone();
        Decision {
            verdict: Verdict::Limited,
            rules: vec![RuleOutcome {
                rule,
                over: true,
                charged: false,
                windows: vec![
                    WindowOutcome {
                        window: Window {
                            requests: 5,
                            period_ms: 3000,
                            precision_ms: 0,
                        },
                        remaining: 0,
                        reset_ms: 1200,
                        retry_ms: Some(2100),
                        never: false,
                        unknown: false,
                    },
                    WindowOutcome {
                        window: Window {
                            requests: 20,
                            period_ms: 60_000,
                            precision_ms: 0,
                        },
                        remaining: 14,
                        reset_ms: 41_000,
                        retry_ms: None,
                        never: false,
                        unknown: false,
                    },
                ],
            }],
        }
    }

    #[test]
    fn refusal_lists_every_window_of_the_refusing_rule() {
        let mut h = HeaderMap::new();
        refusal_headers(&decision(), &mut h);
        assert_eq!(h[RETRY_AFTER], "3");
        assert_eq!(h[RATELIMIT_POLICY], "\"login\";q=5;w=3, \"login\";q=20;w=60");
        assert_eq!(h[RATELIMIT], "\"login\";r=0;t=3, \"login\";r=14;t=41");
        let body: serde_json::Value = serde_json::from_slice(&refusal_body(&decision())).unwrap();
        assert_eq!(body["rule"], "login");
        assert_eq!(body["limit"], 5);
        assert_eq!(body["window_seconds"], 3.0);
        assert_eq!(body["retry_after_seconds"], 3);
    }

    #[test]
    fn refusal_bodies_keep_the_bytes_clients_have_seen() {
        // The bodies as they were first built (a `serde_json::Value` map,
        // keys sorted), for each of the three refusals, with a name that
        // needs escaping: the typed bodies print the same bytes.
        let mut d = decision();
        Arc::make_mut(&mut d.rules[0].rule).name = "lo\"g\\in\u{e9}".into();
        let name = d.rules[0].rule.name.clone();
        let limited = serde_json::json!({
            "error": "rate_limited", "rule": name, "limit": 5,
            "window_seconds": 3.0, "retry_after_seconds": 3,
        });
        assert_eq!(refusal_body(&d), limited.to_string());
        d.rules[0].windows[1].never = true;
        let never = serde_json::json!({
            "error": "cost_exceeds_limit",
            "message": "this request costs more than the rule's whole limit; it can never be admitted as sent",
            "rule": name, "limit": 20, "window_seconds": 60.0,
        });
        assert_eq!(refusal_body(&d), never.to_string());
        d.verdict = Verdict::FailedClosed;
        let closed = serde_json::json!({
            "error": "rate_limiter_unavailable",
            "message": "the rate limiter cannot reach its counters; retry shortly",
        });
        assert_eq!(refusal_body(&d), closed.to_string());
    }

    proptest::proptest! {
        /// Any name, limit, window and wait: the hand-written bodies are the
        /// bytes serde_json printed for the map they were first built as.
        #[test]
        fn refusal_bodies_are_the_maps_bytes(
            name in "[a-z\"\\\\\u{0}-\u{1f}\u{e9}\u{202e} ]{0,12}",
            limit in proptest::prop_oneof![proptest::num::u64::ANY, 0u64..100],
            seconds in proptest::prop_oneof![0u64..100, 0u64..=366 * 86_400],
            frac in proptest::prop_oneof![
                0u64..1000,
                proptest::sample::select(vec![0u64, 1, 10, 100, 120, 250, 500, 990, 999]),
            ],
            retry_ms in 0u64..100_000_000,
            never in proptest::bool::ANY,
        ) {
            let mut d = decision();
            Arc::make_mut(&mut d.rules[0].rule).name = name.clone();
            d.rules[0].windows[0].window.requests = limit;
            let period_ms = (seconds * 1000 + frac).max(1);
            d.rules[0].windows[0].window.period_ms = period_ms;
            d.rules[0].windows[0].retry_ms = Some(retry_ms);
            d.rules[0].windows[1].retry_ms = None;
            d.rules[0].windows[0].never = never;
            let want = if d.never_fits() {
                let w = d.rules[0].windows.iter().find(|w| w.never).unwrap();
                serde_json::json!({
                    "error": "cost_exceeds_limit",
                    "message": "this request costs more than the rule's whole limit; it can never be admitted as sent",
                    "rule": name, "limit": w.window.requests,
                    "window_seconds": w.window.period_ms as f64 / 1000.0,
                })
            } else {
                let w = RuleOutcome::telling_window(&d.rules[0]).unwrap();
                serde_json::json!({
                    "error": "rate_limited", "rule": name, "limit": w.window.requests,
                    "window_seconds": w.window.period_ms as f64 / 1000.0,
                    "retry_after_seconds": ceil_secs(d.retry_after_ms().unwrap_or(0)),
                })
            };
            proptest::prop_assert_eq!(
                String::from_utf8_lossy(&refusal_body(&d)).into_owned(),
                want.to_string()
            );
        }
    }

    proptest::proptest! {
        /// The proxy's refusal written out is the refusal's map, field for
        /// field in the map's order, with the same body: whatever the
        /// rule's name, its windows' states and whether the store failed.
        #[test]
        fn a_refusal_written_out_is_its_map(
            name in "[a-z\"\\\\\u{e9} ]{0,8}",
            retry in proptest::option::of(0u64..100_000),
            never in proptest::bool::ANY,
            unknown in proptest::bool::ANY,
            closed in proptest::bool::ANY,
        ) {
            let mut d = decision();
            Arc::make_mut(&mut d.rules[0].rule).name = name;
            d.rules[0].windows[0].retry_ms = retry;
            d.rules[0].windows[1].never = never;
            d.rules[0].windows[0].unknown = unknown;
            if closed {
                d.verdict = Verdict::FailedClosed;
            }
            let by_map = refusal(&d, StatusCode::TOO_MANY_REQUESTS);
            let (written, body) = refusal_written(&d);
            let mut map_lines = Vec::new();
            for (name, value) in by_map.headers() {
                map_lines.extend_from_slice(name.as_str().as_bytes());
                map_lines.extend_from_slice(b": ");
                map_lines.extend_from_slice(value.as_bytes());
                map_lines.extend_from_slice(b"\r\n");
            }
            proptest::prop_assert_eq!(String::from_utf8_lossy(&written.lines), String::from_utf8_lossy(&map_lines));
            proptest::prop_assert!(!written.has_date);
            proptest::prop_assert_eq!(&body, by_map.body());
        }
    }

    #[test]
    fn a_refusal_names_the_window_that_holds_it_out_longest() {
        // Both windows refuse (a cost of 3 against 5/3s with none left and
        // 20/60s with 2 left): the request fits only once the 60s one has
        // room, and the body names that one, as Retry-After does.
        let mut d = decision();
        d.rules[0].windows[1].remaining = 2;
        d.rules[0].windows[1].retry_ms = Some(41_000);
        let body: serde_json::Value = serde_json::from_slice(&refusal_body(&d)).unwrap();
        assert_eq!(body["limit"], 20);
        assert_eq!(body["window_seconds"], 60.0);
        assert_eq!(body["retry_after_seconds"], 41);
        let mut h = HeaderMap::new();
        refusal_headers(&d, &mut h);
        assert_eq!(h[RETRY_AFTER], "41");
    }

    #[test]
    fn sub_second_windows_are_whole_seconds_rounded_up() {
        // The draft's fields are integers: 500ms is w=1, 1500ms w=2.
        let mut d = decision();
        d.rules[0].windows[0].window.period_ms = 500;
        d.rules[0].windows[1].window.period_ms = 1500;
        let mut h = HeaderMap::new();
        refusal_headers(&d, &mut h);
        assert_eq!(h[RATELIMIT_POLICY], "\"login\";q=5;w=1, \"login\";q=20;w=2");
    }

    #[test]
    fn names_are_escaped_as_structured_field_strings() {
        assert_eq!(sf_string("a\"b\\c\u{e9}d"), "a\\\"b\\\\cd");
    }

    #[test]
    fn admission_names_the_tightest_window() {
        let mut d = decision();
        d.verdict = Verdict::Allowed;
        d.rules[0].over = false;
        d.rules[0].windows[0].retry_ms = None;
        d.rules[0].windows[0].remaining = 2;
        let mut h = HeaderMap::new();
        admission_headers(&d, &mut h);
        assert_eq!(h[RATELIMIT_POLICY], "\"login\";q=5;w=3");
        assert_eq!(h[RATELIMIT], "\"login\";r=2;t=2");
    }

    proptest::proptest! {
        /// One window's values, built apart (its policy kept per thread),
        /// read as the general path writes them, rule after rule, with a
        /// reload's changes between.
        #[test]
        fn one_window_is_told_as_the_general_path_tells_it(
            told in proptest::collection::vec(
                ("[ab\"\\\\\u{e9} ]{0,4}", 0u64..4, 1u64..5_000, 0u64..4, 0u64..5_000, proptest::option::of(0u64..5_000)),
                1..12,
            )
        ) {
            for (name, requests, period_ms, remaining, reset_ms, retry_ms) in told {
                let mut d = decision();
                let mut rule = (*d.rules[0].rule).clone();
                rule.name = name;
                d.rules[0].rule = Arc::new(rule);
                d.rules[0].windows.truncate(1);
                let w = &mut d.rules[0].windows[0];
                w.window.requests = requests;
                w.window.period_ms = period_ms;
                w.remaining = remaining;
                w.reset_ms = reset_ms;
                w.retry_ms = retry_ms;
                let one = [(&d.rules[0], &d.rules[0].windows[0])];
                let (one_policy, one_state) = ratelimit_pair(&one).unwrap();
                let (policy, state) = ratelimit_values(&one);
                proptest::prop_assert_eq!(one_policy.as_bytes(), policy.as_bytes());
                proptest::prop_assert_eq!(one_state.as_bytes(), state.as_bytes());
            }
        }
    }
}
