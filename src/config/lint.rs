//! What `tollgate check` warns about: rules that load, yet will not do what
//! their author likely meant on some surface or under some traffic.
//!
//! Nothing here refuses a file (that is `schema`'s job, with a line number);
//! these are advice, printed by `check` and never consulted on a request.

use http::StatusCode;

use super::{FailureMode, Limits, Part, PathPattern, Rule};

/// What the decision surfaces cannot say the way a rule asks, for
/// `tollgate check`: Envoy's ext_authz treats a 5xx from the service as its
/// own failure (and may let the request through), and NGINX's auth_request
/// accepts only 401 and 403 as a denial, so both carry such a status as 403
/// with `X-Tollgate-Status`.
pub fn surface_warnings(limits: &Limits) -> Vec<String> {
    let mut out = Vec::new();
    for rule in limits.http_rules() {
        if rule.status.is_server_error() {
            out.push(format!(
                "rule \"{}\": status {} is sent as 403 with X-Tollgate-Status: {} on ext_authz and auth_request (Envoy and NGINX take a 5xx from the decision service as its failure)",
                rule.name,
                rule.status.as_u16(),
                rule.status.as_u16()
            ));
        } else if rule.status != StatusCode::TOO_MANY_REQUESTS {
            out.push(format!(
                "rule \"{}\": status {} reaches NGINX auth_request clients only through X-Tollgate-Status (the shipped snippet answers 429)",
                rule.name,
                rule.status.as_u16()
            ));
        }
        if rule.failure_mode == FailureMode::Closed && !rule.shadow {
            out.push(format!(
                "rule \"{}\": failing closed is 503 on the proxy, and 403 with X-Tollgate-Status: 503 on ext_authz and auth_request",
                rule.name
            ));
        }
        if let Some(warning) = unbounded_counters(limits, rule) {
            out.push(warning);
        }
    }
    out
}

/// Windows this long keep a made-up key's counter around long enough for a
/// flood of them to matter.
const LONG_WINDOW_MS: u64 = 60_000;

/// A rule keyed only on values the caller makes up, over a long window, with
/// no `client_ip` rule deciding the same requests: every invented value is a
/// new counter, and nothing bounds how fast one client invents them. A
/// `client_ip` rule decided together refuses the flood, and a refused
/// request creates no counter.
fn unbounded_counters(limits: &Limits, rule: &Rule) -> Option<String> {
    let caller_chosen = !rule.by.is_empty() && rule.by.iter().all(|p| !matches!(p, Part::ClientIp { .. }));
    let longest = rule.longest_period_ms();
    if rule.shadow || !caller_chosen || longest < LONG_WINDOW_MS {
        return None;
    }
    let covers = |guard: &Rule| {
        let m = &guard.matcher;
        !guard.shadow
            && guard.by.iter().any(|p| matches!(p, Part::ClientIp { .. }))
            && m.methods.is_empty()
            && m.host.is_none()
            && m.headers.is_empty()
            && match (&m.path, &rule.matcher.path) {
                (None, _) => true,
                (Some(PathPattern::Prefix(p)), Some(PathPattern::Prefix(q) | PathPattern::Exact(q))) => {
                    q.starts_with(p.as_str())
                }
                (Some(g), Some(r)) => g == r,
                (Some(_), None) => false,
            }
    };
    if limits.http_rules().any(|r| covers(r)) {
        return None;
    }
    let keys: Vec<String> = rule.by.iter().map(Part::key).collect();
    Some(format!(
        "rule \"{}\" keys only on values the caller chooses ({}) over a {}s window: every made-up value is a new counter; add a client_ip rule for the same requests (say 20 per 1s), so a flood is refused before it creates counters",
        rule.name,
        keys.join(", "),
        longest / 1000
    ))
}
