//! The limits file: what operators write, validated into the rules the limiter
//! enforces.
//!
//! `file` reads YAML or JSON into these types and rejects anything doubtful
//! with `file:line: reason`; the rest of tollgate only ever sees a [`Limits`]
//! that passed validation, so the request path never re-checks it.

mod envoy;
mod file;
mod index;
mod lint;
mod schema;
mod tree;

pub use envoy::unit_ms as envoy_unit_ms;
pub use file::{ConfigError, MAX_FILE_BYTES, parse_str, read_limits};
pub use index::RuleIndex;
pub use lint::{never_matching, surface_warnings, warnings};
pub use tree::{DescriptorTree, EntryPattern, Shadowed, ValuePattern};

use std::sync::Arc;

use http::{HeaderName, Method, StatusCode};

/// The largest limit or cost tollgate accepts: a trillion units. Counts stay
/// exact far past it in both stores (the Redis script's running totals are
/// Lua numbers, exact to 2^53); a cost above every window's limit is simply
/// a request that never fits.
pub const MAX_UNITS: u64 = 1_000_000_000_000;
use serde::Serialize;

/// Every rule of one limits file, under one domain.
#[derive(Debug, Clone, Serialize)]
pub struct Limits {
    /// Namespaces the counter keys, so two files never share counters.
    pub domain: String,
    /// Which format the file was written in.
    pub format: Format,
    /// The rules, in file order (headers and logs follow this order).
    pub rules: Vec<Arc<Rule>>,
    /// Rules that match Envoy descriptors, arranged for lookup.
    #[serde(skip)]
    pub tree: DescriptorTree,
    /// The HTTP rules, arranged for lookup.
    #[serde(skip)]
    pub index: Arc<RuleIndex>,
}

/// The two limits file formats tollgate reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// tollgate's own (`rules:`).
    Tollgate,
    /// envoyproxy/ratelimit's (`descriptors:`), loaded unchanged.
    EnvoyRatelimit,
}

impl Limits {
    /// Limits of `domain` with these rules, indexed for lookup.
    pub fn new(domain: String, format: Format, rules: Vec<Arc<Rule>>, tree: DescriptorTree) -> Limits {
        let index = Arc::new(RuleIndex::new(&rules));
        Limits {
            domain,
            format,
            rules,
            tree,
            index,
        }
    }

    /// Several envoyproxy/ratelimit files of one domain as one (its
    /// `MERGE_DOMAIN_CONFIG`): their top-level descriptors side by side, in
    /// file order; a composite key declared twice is an error. tollgate's
    /// own files are never merged: one domain, one file.
    pub fn merge(parts: &[Arc<Limits>]) -> Result<Limits, String> {
        let Some((first, rest)) = parts.split_first() else {
            return Err("nothing to merge".into());
        };
        let mut merged = (**first).clone();
        for part in rest {
            if part.format != Format::EnvoyRatelimit || merged.format != Format::EnvoyRatelimit {
                return Err(format!(
                    "domain \"{}\" is declared by several files; only envoyproxy/ratelimit files can share one",
                    merged.domain
                ));
            }
            merged.tree.merge(&part.tree).map_err(|e| e.to_string())?;
            merged.rules.extend(part.rules.iter().cloned());
        }
        merged.index = Arc::new(RuleIndex::new(&merged.rules));
        Ok(merged)
    }

    /// The rules the HTTP surfaces (proxy, ext_authz, auth_request) apply.
    pub fn http_rules(&self) -> impl Iterator<Item = &Arc<Rule>> {
        self.rules.iter().filter(|r| r.descriptor.is_none())
    }
}

/// One rule: which requests it sees, how it tells callers apart, its windows.
#[derive(Debug, Clone, Serialize)]
pub struct Rule {
    /// Unique within the file; names the counter in keys.
    pub id: String,
    /// Shown in headers, logs and metrics (the id unless the file names it).
    pub name: String,
    /// The name the RLS reports in `current_limit` and `replaces` refers to:
    /// empty for an unnamed envoyproxy/ratelimit limit, as there.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub limit_name: String,
    /// For Envoy descriptors: the entries this rule matches, in order.
    /// A rule with a descriptor is not applied by the HTTP surfaces.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub descriptor: Option<Vec<EntryPattern>>,
    /// Matches and reports, but never counts or refuses (Envoy `unlimited`).
    pub unlimited: bool,
    /// Names of rules this one displaces when both match one request.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub replaces: Vec<String>,
    /// Which requests this rule applies to.
    #[serde(rename = "match")]
    pub matcher: Matcher,
    /// The request parts whose values make one counter per caller.
    pub by: Vec<Part>,
    /// All windows are checked together: a request needs room in each.
    pub windows: Vec<Window>,
    /// Count and report, never reject.
    pub shadow: bool,
    /// envoyproxy/ratelimit's `quota_mode`: being over refuses the request
    /// only when every quota rule the request touches is over.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub quota: bool,
    /// Handed to Envoy in the RLS answer's dynamic metadata when the request
    /// passes this rule (envoyproxy/ratelimit's `metadata`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metadata: Option<serde_json::Value>,
    /// Status sent to a rejected caller.
    #[serde(serialize_with = "ser_status")]
    pub status: StatusCode,
    /// The gRPC status a refused gRPC call gets (8, RESOURCE_EXHAUSTED, unless
    /// the file says otherwise; Envoy's rate limit filter answers 14).
    #[serde(skip_serializing_if = "is_resource_exhausted")]
    pub grpc_status: u16,
    /// What one request costs.
    pub cost: Cost,
    /// What to do when the counter store cannot answer in time.
    pub failure_mode: FailureMode,
}

/// `requests` per `period`, over a sliding window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub struct Window {
    /// How many units fit in the window.
    pub requests: u64,
    /// Window length in milliseconds.
    pub period_ms: u64,
    /// Bucket length in milliseconds of a bucketed window, 0 for an exact
    /// one. A bucketed window keeps one count per bucket instead of one
    /// entry per admitted request (bounded memory, see [`Buckets`]).
    #[serde(skip_serializing_if = "is_zero")]
    pub precision_ms: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Most buckets one window may keep (its `per / precision`): a Redis call
/// that touches a whole ring (a limit raised past its counts' width) takes
/// ~13 ms of Redis time at 10,000 (BENCHMARKS.md section 26).
pub const MAX_BUCKETS: u64 = 10_000;

impl Window {
    /// An exact window of `requests` per `period_ms`.
    pub const fn exact(requests: u64, period_ms: u64) -> Window {
        Window {
            requests,
            period_ms,
            precision_ms: 0,
        }
    }

    /// The longest of `windows`, in milliseconds (0 for none): how long
    /// a counter's entries matter.
    pub fn longest_ms(windows: &[Window]) -> u64 {
        windows.iter().map(|w| w.period_ms).max().unwrap_or(0)
    }

    /// The longest exact window of `windows` (0 for none): how long a
    /// counter's entry log must reach back.
    pub fn longest_exact_ms(windows: &[Window]) -> u64 {
        windows
            .iter()
            .filter(|w| w.buckets().is_none())
            .map(|w| w.period_ms)
            .max()
            .unwrap_or(0)
    }

    /// How a bucketed window cuts time, or `None` for an exact window.
    pub fn buckets(&self) -> Option<Buckets> {
        (self.precision_ms > 0).then(|| Buckets::new(self.period_ms, self.precision_ms))
    }

    /// The window length in whole seconds, rounded up (as the headers state it).
    pub fn period_secs(&self) -> u64 {
        self.period_ms.div_ceil(1000)
    }
}

/// The buckets of a window with a `precision`: the semantics both stores
/// implement (and the reference model in the tests states).
///
/// Time is cut into buckets of `precision` ms: bucket `j` is
/// `[j * precision, (j + 1) * precision)`. A unit admitted in bucket `j`
/// is counted while the current bucket is before `j + len`, where `len` is
/// `ceil(per / precision) + 1`. So every unit is counted for at least `per`
/// (never more than `requests` are admitted within any span of `per`, as in
/// the exact window) and for less than `per + precision` when `per` is a
/// multiple of `precision`: a bucketed window may refuse for up to one
/// `precision` longer than the exact one, never admit more.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Buckets {
    /// Bucket length in ms (at least 1).
    pub precision: u64,
    /// Buckets a unit is counted in, the current one included.
    pub len: u64,
}

impl Buckets {
    /// The buckets of a `period_ms` window cut every `precision_ms` (> 0).
    pub fn new(period_ms: u64, precision_ms: u64) -> Buckets {
        let precision = precision_ms.max(1);
        Buckets {
            precision,
            len: period_ms.div_ceil(precision).saturating_add(1),
        }
    }

    /// The bucket holding `ms`.
    pub fn of(&self, ms: u64) -> u64 {
        ms / self.precision
    }

    /// Milliseconds from `now` until units of bucket `j` stop counting.
    pub fn leaves_in(&self, j: u64, now: u64) -> u64 {
        j.saturating_add(self.len)
            .saturating_mul(self.precision)
            .saturating_sub(now)
    }
}

/// Which requests a rule applies to; an empty field matches everything.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Matcher {
    /// Any of these methods (empty: all).
    #[serde(serialize_with = "ser_methods")]
    pub methods: Vec<Method>,
    /// Exact path, or prefix when written with a trailing `*`.
    pub path: Option<PathPattern>,
    /// Compare paths without regard to ASCII case.
    pub ignore_case: bool,
    /// Exact host (port ignored, case-insensitive).
    pub host: Option<String>,
    /// Headers that must be present, with this value unless it is `*`.
    #[serde(serialize_with = "ser_header_matches")]
    pub headers: Vec<(HeaderName, HeaderValueMatch)>,
}

/// How a path is matched.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PathPattern {
    /// The path equals this.
    Exact(String),
    /// The path starts with this.
    Prefix(String),
}

/// How a header value is matched.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HeaderValueMatch {
    /// Present, whatever its value.
    Any,
    /// Present with exactly this value.
    Exact(String),
}

/// A request part a rule keys its counters on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Part {
    /// The client address, after trusted-proxy resolution, as a network of
    /// this many leading bits (IPv4, IPv6): `client_ip/64` gives one counter
    /// per IPv6 /64, so one attacker's /64 is one caller, not 2^64.
    ClientIp {
        /// Prefix length kept of an IPv4 address (32: the whole address).
        v4: u8,
        /// Prefix length kept of an IPv6 address (128: the whole address).
        v6: u8,
    },
    /// The request method.
    Method,
    /// The request path (no query).
    Path,
    /// The host the client asked for (port removed, lower-cased).
    Host,
    /// A request header's value.
    Header(HeaderName),
    /// A query parameter's value.
    Query(String),
    /// The subject of the client's verified TLS certificate (proxy listener
    /// with `--tls-client-ca`).
    ClientCert,
}

impl Part {
    /// The descriptor key this part produces, as written in the file.
    pub fn key(&self) -> String {
        match self {
            Part::ClientIp { v4: 32, v6: 128 } => "client_ip".into(),
            Part::ClientIp { v4: 32, v6 } => format!("client_ip/{v6}"),
            Part::ClientIp { v4, v6 } => format!("client_ip/{v4}/{v6}"),
            Part::Method => "method".into(),
            Part::Path => "path".into(),
            Part::Host => "host".into(),
            Part::Header(name) => format!("header:{name}"),
            Part::Query(name) => format!("query:{name}"),
            Part::ClientCert => "client_cert".into(),
        }
    }
}

impl Serialize for Part {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.key())
    }
}

/// What one request costs against a rule's windows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cost {
    /// A fixed number of units.
    Fixed(u64),
    /// The integer value of this request header (1 when absent).
    Header(#[serde(serialize_with = "ser_header_name")] HeaderName),
}

/// What a rule does when the counters cannot be consulted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FailureMode {
    /// Admit the request (Envoy's default).
    #[default]
    Open,
    /// Reject the request with 503.
    Closed,
}

/// gRPC's RESOURCE_EXHAUSTED: what a refused gRPC call is answered by default.
pub const RESOURCE_EXHAUSTED: u16 = 8;

fn is_resource_exhausted(code: &u16) -> bool {
    *code == RESOURCE_EXHAUSTED
}

impl Rule {
    /// An envoyproxy/ratelimit limit named `id` (and shown by it), with no
    /// windows yet and the reference's defaults: 429, cost 1, fail open.
    pub fn envoy_limit(id: String) -> Rule {
        Rule {
            name: id.clone(),
            limit_name: String::new(),
            id,
            descriptor: None,
            unlimited: false,
            replaces: Vec::new(),
            matcher: Matcher::default(),
            by: Vec::new(),
            windows: Vec::new(),
            shadow: false,
            quota: false,
            metadata: None,
            status: StatusCode::TOO_MANY_REQUESTS,
            grpc_status: RESOURCE_EXHAUSTED,
            cost: Cost::Fixed(1),
            failure_mode: FailureMode::Open,
        }
    }

    /// The longest window, which bounds how long counter entries matter.
    pub fn longest_period_ms(&self) -> u64 {
        Window::longest_ms(&self.windows)
    }
}

request_path! {
    impl Matcher {
        /// Whether a request with these attributes falls under the rule.
        pub fn matches(&self, method: &Method, path: &str, host: Option<&str>, headers: crate::fields::Fields<'_>) -> bool {
            // HEAD runs the GET handler in NGINX and in most frameworks, so a
            // GET rule counts HEAD too.
            let head_as_get = method == Method::HEAD && self.methods.contains(&Method::GET);
            if !self.methods.is_empty() && !self.methods.contains(method) && !head_as_get {
                return false;
            }
            if let Some(pattern) = &self.path {
                let ok = match (pattern, self.ignore_case) {
                    // An exact path also matches its spelling with a trailing
                    // slash, which Express, Rails and Django route alike.
                    (PathPattern::Exact(p), false) => path == p || path.strip_suffix('/') == Some(p),
                    (PathPattern::Exact(p), true) if path.is_ascii() && p.is_ascii() => {
                        path.eq_ignore_ascii_case(p) || path.strip_suffix('/').is_some_and(|q| q.eq_ignore_ascii_case(p))
                    }
                    (PathPattern::Exact(p), true) => {
                        let (path, p) = (crate::path::fold_case(path), crate::path::fold_case(p));
                        path == p || path.strip_suffix('/') == Some(&*p)
                    }
                    (PathPattern::Prefix(p), false) => path.starts_with(p.as_str()),
                    (PathPattern::Prefix(p), true) if path.is_ascii() && p.is_ascii() => path
                        .as_bytes()
                        .get(..p.len())
                        .is_some_and(|head| head.eq_ignore_ascii_case(p.as_bytes())),
                    (PathPattern::Prefix(p), true) => {
                        crate::path::fold_case(path).starts_with(&*crate::path::fold_case(p))
                    }
                };
                if !ok {
                    return false;
                }
            }
            if let Some(want) = &self.host {
                match host {
                    Some(h) if h.eq_ignore_ascii_case(want) => {}
                    _ => return false,
                }
            }
            self.headers.iter().all(|(name, want)| {
                match_values(headers, name).any(|v| match want {
                    HeaderValueMatch::Any => true,
                    HeaderValueMatch::Exact(s) => v == s.as_bytes(),
                })
            })
        }
    }

    /// The values a `match.headers` condition on `name` meets (and the rule
    /// index looks up): each of its lines, without the spaces and tabs
    /// around it (HTTP/2 passes them through where HTTP/1 parsers strip
    /// them); for `Cookie`, each cookie of a line as well. An HTTP/1.1
    /// browser sends its cookies on one line (`a=1; tier=free`) and an
    /// HTTP/2 one each on a line of its own: the same cookies meet the
    /// same conditions either way, and one more cookie cannot slip a
    /// request out from under a rule.
    pub fn match_values<'a>(headers: crate::fields::Fields<'a>, name: &'a HeaderName) -> impl Iterator<Item = &'a [u8]> {
        let cookie = *name == http::header::COOKIE;
        headers.get_all(name).flat_map(move |line| {
            let line = line.trim_ascii();
            // An empty piece (`a=1;;b=2`, a `;` at the end) is no cookie.
            let crumbs = (cookie && line.contains(&b';'))
                .then(|| line.split(|b| *b == b';').map(<[u8]>::trim_ascii).filter(|c| !c.is_empty()));
            std::iter::once(line).chain(crumbs.into_iter().flatten())
        })
    }
}

fn ser_status<S: serde::Serializer>(status: &StatusCode, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_u16(status.as_u16())
}

fn ser_methods<S: serde::Serializer>(methods: &[Method], s: S) -> Result<S::Ok, S::Error> {
    s.collect_seq(methods.iter().map(Method::as_str))
}

fn ser_header_name<S: serde::Serializer>(name: &HeaderName, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(name.as_str())
}

fn ser_header_matches<S: serde::Serializer>(
    headers: &[(HeaderName, HeaderValueMatch)],
    s: S,
) -> Result<S::Ok, S::Error> {
    // Shown on /config: a matched value may be a credential, so only
    // whether one is required is said.
    s.collect_map(headers.iter().map(|(name, value)| {
        let v = match value {
            HeaderValueMatch::Any => "*",
            HeaderValueMatch::Exact(_) => "(a value, hidden)",
        };
        (name.as_str(), v)
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matcher(yaml: &str) -> Matcher {
        let limits = parse_str(
            &format!("domain: t\nrules:\n  - name: r\n    match: {yaml}\n    limits: [{{requests: 1, per: 1s}}]\n"),
            "t.yaml",
        )
        .unwrap();
        limits.rules[0].matcher.clone()
    }

    #[test]
    fn exact_and_prefix_paths() {
        let h = http::HeaderMap::new();
        let exact = matcher("{path: /login}");
        assert!(exact.matches(&Method::GET, "/login", None, crate::fields::Fields::Map(&h)));
        assert!(!exact.matches(&Method::GET, "/login/x", None, crate::fields::Fields::Map(&h)));
        let prefix = matcher("{path: /api/*}");
        assert!(prefix.matches(&Method::GET, "/api/users", None, crate::fields::Fields::Map(&h)));
        assert!(prefix.matches(&Method::GET, "/api/", None, crate::fields::Fields::Map(&h)));
        assert!(!prefix.matches(&Method::GET, "/apix", None, crate::fields::Fields::Map(&h)));
    }

    #[test]
    fn a_cookie_condition_meets_each_cookie_of_a_line_and_other_headers_are_whole() {
        let one = |name: &'static str, v: &str| {
            let mut h = http::HeaderMap::new();
            h.append(name, v.parse().unwrap());
            h
        };
        let meets =
            |m: &Matcher, h: &http::HeaderMap| m.matches(&Method::GET, "/", None, crate::fields::Fields::Map(h));
        let cookie = matcher("{headers: {cookie: tier=free}}");
        for line in ["tier=free", "a=1; tier=free", " a=1 ;tier=free ; b=2", "tier=free;"] {
            assert!(meets(&cookie, &one("cookie", line)), "{line:?}");
        }
        // Compared as sent (README): spellings some frameworks read as
        // `tier=free` do not meet it.
        for line in [
            "a=1; tier=freeish",
            "tier=free, a=1",
            "a=tier=free",
            "tier=\"free\"",
            "tier = free",
            "%74ier=free",
        ] {
            assert!(!meets(&cookie, &one("cookie", line)), "{line:?}");
        }
        // The whole line still meets a condition written as one.
        assert!(meets(
            &matcher("{headers: {cookie: 'a=1; b=2'}}"),
            &one("cookie", "a=1; b=2")
        ));
        // An empty piece is no cookie (the 39th attack); an empty line is
        // an empty value, as before.
        let empty = matcher("{headers: {cookie: ''}}");
        for line in ["a=1;;b=2", "a=1;", ";", "a=1; ; b=2"] {
            assert!(!meets(&empty, &one("cookie", line)), "{line:?}");
        }
        assert!(meets(&empty, &one("cookie", "")));
        assert!(!meets(&matcher("{headers: {x-tier: free}}"), &one("x-tier", "a; free")));
    }

    #[test]
    fn methods_host_and_headers() {
        let m = matcher("{methods: [POST], host: API.example.com, headers: {x-key: '*', x-tier: free}}");
        let mut h = http::HeaderMap::new();
        h.insert("x-key", "k".parse().unwrap());
        h.insert("x-tier", "free".parse().unwrap());
        assert!(m.matches(
            &Method::POST,
            "/",
            Some("api.example.com"),
            crate::fields::Fields::Map(&h)
        ));
        assert!(!m.matches(
            &Method::GET,
            "/",
            Some("api.example.com"),
            crate::fields::Fields::Map(&h)
        ));
        assert!(!m.matches(&Method::POST, "/", Some("other"), crate::fields::Fields::Map(&h)));
        h.insert("x-tier", "paid".parse().unwrap());
        assert!(!m.matches(
            &Method::POST,
            "/",
            Some("api.example.com"),
            crate::fields::Fields::Map(&h)
        ));
    }
}
