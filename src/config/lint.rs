//! What `tollgate check` warns about: rules that load, yet will not do what
//! their author likely meant on some surface or under some traffic.
//!
//! Nothing here refuses a file (that is `schema`'s job, with a line number);
//! these are advice, printed by `check` and never consulted on a request.

use http::StatusCode;

use super::{FailureMode, Format, Limits, Part, PathPattern, Rule};

/// Everything `tollgate check` warns about in one file.
pub fn warnings(limits: &Limits) -> Vec<String> {
    let mut out = never_matching(limits);
    out.extend(surface_warnings(limits));
    out.extend(large_counters(limits));
    out.extend(shadows_failing_closed(limits));
    out
}

/// Shadow rules that say `failure_mode: closed`: a shadow rule never
/// refuses, so it fails open, which its author may not expect.
pub fn shadows_failing_closed(limits: &Limits) -> Vec<String> {
    limits
        .rules
        .iter()
        .filter(|r| r.shadow && r.failure_mode == FailureMode::Closed)
        .map(|r| {
            format!(
                "rule \"{}\": a shadow rule never refuses, so it fails open when the store cannot answer, failure_mode: closed notwithstanding",
                r.name
            )
        })
        .collect()
}

/// What one admitted request costs an exact window's counter in Redis (a
/// stream entry, with the shipped `stream-node-max-bytes 256`, measured at
/// 100,000 entries by `bench/precision`, BENCHMARKS.md section 26).
const BYTES_PER_ENTRY: u64 = 56;
/// One counter larger than this is worth a warning.
const LARGE_COUNTER_BYTES: u64 = 1 << 20;

/// Rules whose exact windows let one counter grow past a megabyte: the
/// exact windows of a rule share one log of admitted requests, kept for the
/// longest of them, so that window's limit bounds it; a quota of 100,000 a
/// day is ~5.6 MB per caller. A `precision` bounds it.
pub fn large_counters(limits: &Limits) -> Vec<String> {
    let mut out = Vec::new();
    for rule in &limits.rules {
        let Some(w) = rule
            .windows
            .iter()
            .filter(|w| w.buckets().is_none())
            .max_by_key(|w| w.period_ms)
        else {
            continue;
        };
        let bytes = w.requests.saturating_mul(BYTES_PER_ENTRY);
        if bytes <= LARGE_COUNTER_BYTES {
            continue;
        }
        let text = |ms| humantime::format_duration(std::time::Duration::from_millis(ms));
        let size = format!(
            "rule \"{}\": {} per {} is an exact window, so one counter holds up to ~{:.1} MB in Redis (one entry per admitted request)",
            rule.name,
            w.requests,
            text(w.period_ms),
            bytes as f64 / 1e6,
        );
        if limits.format == Format::EnvoyRatelimit {
            // That format has no precision; the rule can move to tollgate's.
            out.push(format!(
                "{size}; a rule in tollgate's format can bound it with a precision"
            ));
            continue;
        }
        let precision = suggested_precision(w.period_ms);
        let buckets = super::Buckets::new(w.period_ms, precision);
        let bits = u64::from(u64::BITS - w.requests.leading_zeros());
        let ring = buckets.len.saturating_mul(bits).div_ceil(8);
        out.push(format!(
            "{size}; write precision: {p} to keep ~{} KB per counter (counted per {p} bucket: a refusal may last up to {p} longer)",
            // The counts and the ring's 19-byte header, to the nearest KB.
            ring.saturating_add(19).saturating_add(500).div_euclid(1000).max(1),
            p = text(precision),
        ));
    }
    out
}

/// A bucket length that divides `period_ms` into at most ~1,440 buckets:
/// a round one when one does, else the shortest that does.
fn suggested_precision(period_ms: u64) -> u64 {
    const ROUND: [u64; 10] = [
        1_000, 5_000, 10_000, 30_000, 60_000, 300_000, 600_000, 1_800_000, 3_600_000, 86_400_000,
    ];
    let divides = |p: u64| p > 0 && period_ms.is_multiple_of(p) && period_ms / p <= 1_440;
    ROUND.iter().copied().find(|p| divides(*p)).unwrap_or_else(|| {
        (1..=1_440u64.min(period_ms))
            .rev()
            .find(|n| period_ms.is_multiple_of(*n))
            .map_or(period_ms, |n| period_ms / n)
    })
}

/// Rules no request can ever reach. Every matching HTTP rule applies, so an
/// HTTP rule is unreachable only through its own pattern: a prefix that
/// no normalised path starts with (`/api//v1*`, `/a/./b*`). Envoy
/// descriptors are tried in order at each level, so a wildcard there can
/// be shadowed by an earlier one (`foo*` before `foobar*`), and a key
/// without a value by a wildcard that takes every value (`key_*`).
pub fn never_matching(limits: &Limits) -> Vec<String> {
    let mut out = Vec::new();
    for rule in limits.http_rules() {
        if let Some(PathPattern::Exact(p) | PathPattern::Prefix(p)) = &rule.matcher.path
            && p.bytes()
                .any(|b| b.is_ascii() && !crate::path::may_stand_raw(b) && b != b'%' && b != b'/')
        {
            out.push(format!(
                "rule \"{}\" never matches: a request path cannot hold spaces, control characters, <, > or ` (HTTP servers refuse them); write them percent-encoded (%20)",
                rule.name
            ));
            continue;
        }
        if let Some(PathPattern::Exact(p) | PathPattern::Prefix(p)) = &rule.matcher.path
            && has_malformed_escape(p)
        {
            out.push(format!(
                "rule \"{}\" matches only paths with a malformed escape (% not followed by two hex digits), which NGINX and most servers refuse with 400",
                rule.name
            ));
            continue;
        }
        if let Some(PathPattern::Prefix(prefix)) = &rule.matcher.path
            && let Some(reachable) = unreachable_prefix(prefix, rule.matcher.ignore_case)
        {
            out.push(format!(
                "rule \"{}\" never matches: request paths are normalised before matching (see Security notes), and none starts with \"{prefix}\"; write \"{reachable}*\"",
                rule.name
            ));
        }
    }
    for rule in limits.http_rules() {
        if let Some(why) = impossible_condition(rule) {
            out.push(format!("rule \"{}\" never matches: {why}", rule.name));
        }
        if let Some(why) = several_cookies(rule) {
            out.push(format!("rule \"{}\" {why}", rule.name));
        }
    }
    for shadowed in limits.tree.shadowed() {
        let literal = if shadowed.wildcard {
            " (only a value spelled as its pattern, `*` included, reaches it)"
        } else {
            ""
        };
        out.push(format!(
            "descriptor {} is shadowed: the wildcard \"{}\", tried before it at its level, takes every value it would match{literal}",
            shadowed.path.join(" > "),
            shadowed.by
        ));
    }
    out
}

/// Whether `path` holds a `%` that does not begin a two-digit escape.
fn has_malformed_escape(path: &str) -> bool {
    path.match_indices('%').any(|(at, _)| {
        path.as_bytes()
            .get(at + 1..at + 3)
            .is_none_or(|digits| !digits.iter().all(u8::is_ascii_hexdigit))
    })
}

/// A condition of `rule` no request meets, written as an author may take
/// it to mean "anything" or copy it with stray spaces.
fn impossible_condition(rule: &Rule) -> Option<String> {
    let m = &rule.matcher;
    if m.methods.iter().any(|method| method.as_str() == "*") {
        return Some("\"*\" is not a method (leave `methods` out to match every method)".into());
    }
    if m.host.as_deref() == Some("") {
        return Some("an empty host is no request's host (leave `host` out to match every host)".into());
    }
    // The rule's one trailing dot is gone already; one left is an empty label.
    if let Some(host) = m.host.as_deref()
        && (!crate::limits::http::valid_host(host.as_bytes()) || host.ends_with('.'))
    {
        return Some(format!(
            "\"{host}\" is no host a request can name (the proxy refuses such a host with 400: userinfo, a list, spaces, %, bytes past ASCII, an empty label)"
        ));
    }
    m.headers.iter().find_map(|(name, want)| match want {
        super::HeaderValueMatch::Exact(v) if v.trim_ascii() != v => Some(format!(
            "header {name} is compared without the spaces and tabs around a value, so \"{v}\" never equals one; write \"{}\"",
            v.trim_ascii()
        )),
        _ => None,
    })
}

/// A `cookie` condition on several cookies: it meets only that one line
/// as written, where a condition on one cookie meets it among others.
fn several_cookies(rule: &Rule) -> Option<String> {
    rule.matcher.headers.iter().find_map(|(name, want)| match want {
        super::HeaderValueMatch::Exact(v) if *name == http::header::COOKIE && v.contains(';') => Some(format!(
            "meets the cookies \"{v}\" only as that one line, as written: never in another order, beside another cookie, or from an HTTP/2 browser (which sends each cookie on a line of its own); match one cookie (\"{}\")",
            v.split(';').next().unwrap_or_default().trim()
        )),
        _ => None,
    })
}

/// For a prefix that no path in matching form starts with, the prefix
/// those paths would be written with instead. Exact paths and prefixes
/// ending in `/` are normalised when the file is read; a prefix ending
/// mid-segment is kept as written, so it is judged by what normalising a
/// path that continues it gives.
fn unreachable_prefix(prefix: &str, ignore_case: bool) -> Option<String> {
    let continued = format!("{prefix}x");
    let normal = crate::path::matching_form(&continued);
    let reachable = if ignore_case {
        crate::path::fold_case(&normal).starts_with(&*crate::path::fold_case(prefix))
    } else {
        normal.starts_with(prefix)
    };
    (!reachable).then(|| {
        let mut instead = normal.strip_suffix('x').unwrap_or(&normal).to_string();
        // An escape cut short at the end (`%a`) is completed by the path,
        // which writes it upper-case.
        if let Some(at) = instead.rfind('%').filter(|at| instead.len() - at <= 2) {
            let tail = instead.split_off(at).to_ascii_uppercase();
            instead.push_str(&tail);
        }
        instead
    })
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shadow_rule_failing_closed_is_told_it_fails_open() {
        let file = |extra: &str| {
            format!("domain: d\nrules:\n  - {{ name: watch, {extra}limits: [{{ requests: 5, per: 1m }}] }}\n")
        };
        let parsed = |extra: &str| crate::config::parse_str(&file(extra), "t.yaml").unwrap();
        let told = warnings(&parsed("shadow: true, failure_mode: closed, "));
        assert!(
            told.iter()
                .any(|w| w.contains("rule \"watch\": a shadow rule never refuses")),
            "{told:?}"
        );
        for extra in ["shadow: true, ", "failure_mode: closed, ", ""] {
            assert!(shadows_failing_closed(&parsed(extra)).is_empty(), "{extra}");
        }
    }

    #[test]
    fn exact_windows_that_make_large_counters_suggest_a_precision() {
        let file = |limit: &str| {
            format!("domain: d\nrules:\n  - {{ name: quota, by: [header:x-api-key], limits: [{limit}] }}\n")
        };
        let large =
            large_counters(&crate::config::parse_str(&file("{ requests: 100000, per: 1d }"), "t.yaml").unwrap());
        assert_eq!(large.len(), 1, "{large:?}");
        assert!(large[0].contains("~5.6 MB"), "{large:?}");
        assert!(large[0].contains("precision: 1m to keep ~3 KB"), "{large:?}");
        // The advice works: with it, no warning.
        let bucketed = file("{ requests: 100000, per: 1d, precision: 1m }");
        assert!(large_counters(&crate::config::parse_str(&bucketed, "t.yaml").unwrap()).is_empty());
        assert!(
            large_counters(&crate::config::parse_str(&file("{ requests: 15000, per: 1h }"), "t.yaml").unwrap())
                .is_empty()
        );
        // A precision the file cannot use is refused with its reason.
        for (limit, why) in [
            ("{ requests: 5, per: 1m, precision: 2m }", "longer than the window"),
            ("{ requests: 5, per: 1d, precision: 1ms }", "more than 10000 buckets"),
            (
                "{ requests: 5, per: 1m, precision: soon }",
                "precision: \"soon\" is not a duration",
            ),
            (
                "{ requests: 5, per: 2s, precision: 1500ms }",
                "does not divide the window",
            ),
            (
                "{ requests: 5, per: 2001ms, precision: 1s }",
                "does not divide the window",
            ),
        ] {
            let err = crate::config::parse_str(&file(limit), "t.yaml")
                .unwrap_err()
                .to_string();
            assert!(err.contains(why), "{limit}: {err}");
        }
    }

    #[test]
    fn the_suggested_precision_is_one_the_file_accepts() {
        let file = |limit: &str| {
            format!("domain: d\nrules:\n  - {{ name: quota, by: [header:x-api-key], limits: [{limit}] }}\n")
        };
        for per in ["1000001ms", "7d", "366d", "90001s", "1h"] {
            let large = large_counters(
                &crate::config::parse_str(&file(&format!("{{ requests: 100000, per: {per} }}")), "t.yaml").unwrap(),
            );
            assert_eq!(large.len(), 1, "{per}: {large:?}");
            let p = large[0]
                .split("precision: ")
                .nth(1)
                .and_then(|t| t.split(" to keep").next())
                .unwrap();
            let p = p.replace(' ', "");
            let with = file(&format!("{{ requests: 100000, per: {per}, precision: {p} }}"));
            assert!(
                crate::config::parse_str(&with, "t.yaml").is_ok_and(|l| large_counters(&l).is_empty()),
                "{per}: precision {p} is refused or still large"
            );
        }
        // The rule's log is kept for its longest exact window, whose limit
        // bounds it: a large limit over a shorter window is no large counter.
        let bounded = file("{ requests: 100000, per: 1m }, { requests: 1000, per: 1d }");
        assert!(large_counters(&crate::config::parse_str(&bounded, "t.yaml").unwrap()).is_empty());
        // envoyproxy/ratelimit's format has no precision to suggest.
        let envoy = "domain: d\ndescriptors:\n  - key: k\n    rate_limit: { unit: day, requests_per_unit: 100000 }\n";
        let large = large_counters(&crate::config::parse_str(envoy, "t.yaml").unwrap());
        assert_eq!(large.len(), 1, "{large:?}");
        assert!(
            large[0].contains("tollgate's format") && !large[0].contains("write precision"),
            "{large:?}"
        );
    }

    fn never(text: &str) -> Vec<String> {
        never_matching(&crate::config::parse_str(text, "t.yaml").unwrap())
    }

    #[test]
    fn prefixes_no_normalised_path_starts_with_are_reported() {
        let rules = |path: &str, ignore_case: bool| {
            format!(
                "domain: d\nrules:\n  - {{ name: r, match: {{ path: '{path}', ignore_case: {ignore_case} }}, limits: [{{ requests: 1, per: 1s }}] }}\n"
            )
        };
        for (path, instead) in [("/api//v1*", "/api/v1"), ("/a/./b*", "/a/b"), ("/a/%2e/b*", "/a/b")] {
            let found = never(&rules(path, false));
            assert_eq!(found.len(), 1, "{path}: {found:?}");
            assert!(found[0].contains(&format!("write \"{instead}*\"")), "{found:?}");
        }
        for path in [
            "/api/v1*",
            "/api/v1/*",
            "/a/..x*",
            "/a/.*",
            "/a%3A*",
            "/a%25*",
            // Escapes are folded when the file is read, as in requests.
            "/%7Euser*",
            "/a%3a*",
            "/caf%C3%A9*",
            "/a%20b*",
            "/*",
            "/exact",
            "/a//b/",
        ] {
            assert_eq!(never(&rules(path, false)), Vec::<String>::new(), "{path}");
        }
        let spaced = never(&rules("/a b*", false));
        assert!(
            spaced.len() == 1 && spaced[0].contains("cannot hold spaces"),
            "{spaced:?}"
        );
        for malformed in ["/a%", "/a%4*", "/a%G1", "/p%zz/*"] {
            let found = never(&rules(malformed, false));
            assert!(
                found.len() == 1 && found[0].contains("malformed escape"),
                "{malformed}: {found:?}"
            );
        }
        for raw in ["/a<b", "/a`b*", "/a\tb"] {
            let found = never(&rules(raw, false));
            assert!(
                found.len() == 1 && found[0].contains("cannot hold spaces"),
                "{raw}: {found:?}"
            );
        }
    }

    #[test]
    fn conditions_no_request_meets_are_reported() {
        let rule = |m: &str| {
            never(&format!(
                "domain: d\nrules:\n  - {{ name: r, match: {{ {m} }}, limits: [{{ requests: 1, per: 1s }}] }}\n"
            ))
        };
        for (m, says) in [
            ("methods: ['*']", "is not a method"),
            ("host: ''", "empty host"),
            ("host: a@b.com", "no host a request can name"),
            ("host: 'a b'", "no host a request can name"),
            ("host: a%2eb", "no host a request can name"),
            ("host: a..b", "no host a request can name"),
            ("host: a..", "no host a request can name"),
            ("headers: { x-t: ' v' }", "write \"v\""),
            ("headers: { x-t: \"v\\t\" }", "write \"v\""),
            ("headers: { cookie: 'a=1; b=2' }", "match one cookie (\"a=1\")"),
        ] {
            let found = rule(m);
            assert!(found.len() == 1 && found[0].contains(says), "{m}: {found:?}");
        }
        for m in [
            "methods: [GET]",
            "host: a.com",
            "host: API.Example.com.",
            "host: '[::1]'",
            "host: my_host",
            "headers: { x-t: v }",
            "headers: { x-t: '' }",
            "headers: { x-t: '*' }",
            "headers: { cookie: 'a=1' }",
            "headers: { x-t: 'a; b' }",
        ] {
            assert_eq!(rule(m), Vec::<String>::new(), "{m}");
        }
    }

    #[test]
    fn descriptors_behind_an_earlier_wildcard_are_reported() {
        let text = "domain: d\ndescriptors:\n  - key: path\n    value: 'foo*'\n    rate_limit: { unit: second, requests_per_unit: 1 }\n  - key: path\n    value: 'foobar*'\n    rate_limit: { unit: second, requests_per_unit: 2 }\n  - key: path\n    value: '*bar'\n    rate_limit: { unit: second, requests_per_unit: 3 }\n  - key: remote_address\n    descriptors:\n      - key: path\n        value: '*'\n        rate_limit: { unit: second, requests_per_unit: 4 }\n      - key: path\n        rate_limit: { unit: second, requests_per_unit: 5 }\n      - key: path\n        value: exact\n        rate_limit: { unit: second, requests_per_unit: 6 }\n";
        let found = never(text);
        // As the lookup answers: the earlier wildcard takes the values.
        let limits = crate::config::parse_str(text, "t.yaml").unwrap();
        let limit_of = |entries: &[(&str, &str)]| {
            limits
                .tree
                .lookup(entries.iter().copied())
                .map(|m| m.rule.windows[0].requests)
        };
        assert_eq!(limit_of(&[("path", "foobar1")]), Some(1));
        assert_eq!(limit_of(&[("remote_address", "a"), ("path", "anything")]), Some(4));
        assert_eq!(limit_of(&[("remote_address", "a"), ("path", "exact")]), Some(6));
        assert_eq!(
            found,
            vec![
                "descriptor path_foobar* is shadowed: the wildcard \"path_foo*\", tried before it at its level, takes every value it would match (only a value spelled as its pattern, `*` included, reaches it)",
                "descriptor remote_address > path is shadowed: the wildcard \"path_*\", tried before it at its level, takes every value it would match",
            ]
        );
    }
}
