//! Reading a limits file (YAML or JSON, one schema) into validated [`Limits`].
//!
//! Validation happens inside deserialization, so every error carries the line
//! of the value it is about; a duplicate rule name points at the second rule.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::marker::PhantomData;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use http::{HeaderName, Method, StatusCode};
use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, SeqAccess, Visitor};

use super::{
    Cost, EntryPattern, FailureMode, HeaderValueMatch, Limits, Matcher, Part, PathPattern, Rule, ValuePattern, Window,
};

/// Longest accepted rule name; names end up in headers and metric labels.
const MAX_NAME_LEN: usize = 64;
/// Longest accepted window: counters must expire at some point.
const MAX_PERIOD: Duration = Duration::from_secs(366 * 24 * 3600);

/// Why a limits file was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The file as named on the command line.
    pub file: String,
    /// 1-based line the problem is on, when the parser knows it.
    pub line: Option<usize>,
    /// What is wrong, in words.
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{}: {}", self.file, line, self.reason),
            None => write!(f, "{}: {}", self.file, self.reason),
        }
    }
}

impl std::error::Error for ConfigError {}

/// Reads the limits file, at most [`MAX_FILE_BYTES`] of it: a huge
/// file, or a link to `/dev/zero`, is refused without being read whole.
pub fn read_limits(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let limit = u64::try_from(MAX_FILE_BYTES).unwrap_or(u64::MAX);
    let mut bytes = Vec::new();
    // Opening a FIFO blocks until a writer comes, and a device never ends:
    // only regular files (links followed) are read.
    if !std::fs::metadata(path)?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    std::fs::File::open(path)?
        .take(limit.saturating_add(1))
        .read_to_end(&mut bytes)?;
    if bytes.len() > MAX_FILE_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {} MiB", MAX_FILE_BYTES >> 20),
        ));
    }
    String::from_utf8(bytes).map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"))
}

/// Validates limits from text; `file` names it in errors and picks the format
/// (`.json` is JSON, anything else YAML).
pub fn parse_str(text: &str, file: &str) -> Result<Limits, ConfigError> {
    check_shape(text).map_err(|(line, reason)| ConfigError {
        file: file.to_string(),
        line,
        reason,
    })?;
    if looks_like_envoy(text, file) {
        let raw: super::envoy::EnvoyFile = deserialize(text, file)?;
        return raw.into_limits().map_err(|reason| ConfigError {
            file: file.to_string(),
            line: None,
            reason,
        });
    }
    let raw: RawLimits = deserialize(text, file)?;
    let default_mode = raw.failure_mode.unwrap_or_default();
    let mut tree = super::DescriptorTree::default();
    let mut rules = Vec::with_capacity(raw.rules.0.len());
    for parsed in raw.rules.0 {
        let mut rule = parsed.rule;
        rule.failure_mode = parsed.failure_mode.unwrap_or(default_mode);
        let rule = Arc::new(rule);
        if let Some(path) = &rule.descriptor {
            // Duplicates were refused while parsing, with their line.
            let _ = tree.insert(path, Some(rule.clone()));
        }
        rules.push(rule);
    }
    Ok(Limits {
        domain: raw.domain.0,
        format: super::Format::Tollgate,
        rules,
        tree,
    })
}

/// Largest limits file read, in bytes.
pub const MAX_FILE_BYTES: usize = 8 << 20;
/// Deepest nesting of `[` / `{` a limits file may use; YAML and JSON parse
/// time grows with the square of it, and no real file needs more than a few.
const MAX_NESTING: usize = 64;
/// Widest indentation a line may have (block nesting is indentation).
const MAX_INDENT: usize = 256;

/// Refuses files whose size or nesting would make parsing slow, before any
/// parser sees them; returns the offending line and why.
fn check_shape(text: &str) -> Result<(), (Option<usize>, String)> {
    if text.len() > MAX_FILE_BYTES {
        return Err((None, format!("file is larger than {} MiB", MAX_FILE_BYTES >> 20)));
    }
    let mut depth = 0usize;
    for (i, line) in text.lines().enumerate() {
        let number = i.saturating_add(1);
        if line.len().saturating_sub(line.trim_start().len()) > MAX_INDENT {
            return Err((Some(number), format!("indented deeper than {MAX_INDENT} columns")));
        }
        let mut quote: Option<char> = None;
        let mut escaped = false;
        let mut previous = ' ';
        for c in line.chars() {
            match quote {
                Some('"') if escaped => escaped = false,
                Some('"') if c == '\\' => escaped = true,
                Some(q) if c == q => quote = None,
                Some(_) => {}
                None => match c {
                    '#' if previous.is_whitespace() => break,
                    '"' | '\'' => quote = Some(c),
                    '[' | '{' => {
                        depth = depth.saturating_add(1);
                        if depth > MAX_NESTING {
                            return Err((Some(number), format!("nested deeper than {MAX_NESTING} levels")));
                        }
                    }
                    ']' | '}' => depth = depth.saturating_sub(1),
                    _ => {}
                },
            }
            previous = c;
        }
    }
    Ok(())
}

/// Parses `text` as JSON (`.json`) or YAML into `T`, keeping the line of the
/// first problem.
pub(super) fn deserialize<T: serde::de::DeserializeOwned>(text: &str, file: &str) -> Result<T, ConfigError> {
    if file.ends_with(".json") {
        serde_json::from_str(text).map_err(|e| ConfigError {
            file: file.to_string(),
            line: (e.line() > 0).then_some(e.line()),
            reason: strip_position(&e.to_string(), " at line "),
        })
    } else {
        yaml_serde::from_str(text).map_err(|e| ConfigError {
            file: file.to_string(),
            line: e.location().map(|l| l.line()),
            reason: strip_position(&e.to_string(), " at line "),
        })
    }
}

/// An envoyproxy/ratelimit file is recognised by its shape: a top-level
/// `descriptors` key (even with nothing after it) and no `rules`.
fn looks_like_envoy(text: &str, file: &str) -> bool {
    type Shape = std::collections::HashMap<String, serde::de::IgnoredAny>;
    let shape: Option<Shape> = if file.ends_with(".json") {
        serde_json::from_str(text).ok()
    } else {
        yaml_serde::from_str(text).ok()
    };
    match shape {
        Some(s) => s.contains_key("descriptors") && !s.contains_key("rules"),
        // Not parseable as a whole (a syntax error further down): judge by
        // the top-level keys as written, so the error is reported in terms
        // of the format the file is in.
        None if !file.ends_with(".json") => {
            let top = |key: &str| {
                text.lines().any(|l| {
                    l.strip_prefix(key)
                        .is_some_and(|rest| rest.trim_start().starts_with(':'))
                })
            };
            top("descriptors") && !top("rules")
        }
        None => false,
    }
}

/// Both parsers append "at line N column M"; the line is reported separately.
fn strip_position(message: &str, marker: &str) -> String {
    match message.rfind(marker) {
        Some(i) => message[..i].to_string(),
        None => message.to_string(),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimits {
    domain: Domain,
    #[serde(default)]
    failure_mode: Option<FailureMode>,
    #[serde(default)]
    rules: RuleList,
}

pub(super) struct Domain(pub(super) String);

impl<'de> Deserialize<'de> for Domain {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        if s.is_empty() {
            return Err(de::Error::custom("domain must not be empty"));
        }
        Ok(Domain(s))
    }
}

struct ParsedRule {
    rule: Rule,
    failure_mode: Option<FailureMode>,
}

#[derive(Default)]
struct RuleList(Vec<ParsedRule>);

impl<'de> Deserialize<'de> for RuleList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ListVisitor;
        impl<'de> Visitor<'de> for ListVisitor {
            type Value = RuleList;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of rules")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<RuleList, A::Error> {
                let mut seen = Seen::default();
                let mut rules = Vec::new();
                while let Some(rule) = seq.next_element_seed(UniqueRule { seen: &mut seen })? {
                    rules.push(rule);
                }
                Ok(RuleList(rules))
            }
        }
        d.deserialize_seq(ListVisitor)
    }
}

/// Names and descriptor patterns of the rules read so far.
#[derive(Default)]
struct Seen {
    names: HashSet<String>,
    /// Composite keys (`key_value`): two spellings of one key collide.
    patterns: HashSet<Vec<String>>,
}

/// Deserializes one rule and refuses a name (or descriptor) used before, so
/// the error is reported at the duplicate rule itself.
struct UniqueRule<'a> {
    seen: &'a mut Seen,
}

impl<'de> DeserializeSeed<'de> for UniqueRule<'_> {
    type Value = ParsedRule;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<ParsedRule, D::Error> {
        validated_map(d, "a rule (name, match, by, limits ...)", |raw: RawRule| {
            if !self.seen.names.insert(raw.name.clone()) {
                return Err(format!("duplicate rule name \"{}\"", raw.name));
            }
            let parsed = raw.into_rule()?;
            if let Some(pattern) = &parsed.rule.descriptor
                && !self
                    .seen
                    .patterns
                    .insert(pattern.iter().map(EntryPattern::composite).collect())
            {
                return Err(format!(
                    "rule \"{}\": another rule already matches this descriptor",
                    parsed.rule.name
                ));
            }
            Ok(parsed)
        })
    }
}

/// Deserializes a mapping as `R` and validates it with `check` while the
/// parser is still inside the mapping, so an error carries the mapping's line
/// rather than that of whatever encloses it.
pub(super) fn validated_map<'de, D, R, T>(
    d: D,
    what: &'static str,
    check: impl FnOnce(R) -> Result<T, String>,
) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    R: Deserialize<'de>,
{
    struct MapVisitor<F, R>(F, &'static str, PhantomData<R>);
    impl<'de, F, R, T> Visitor<'de> for MapVisitor<F, R>
    where
        R: Deserialize<'de>,
        F: FnOnce(R) -> Result<T, String>,
    {
        type Value = T;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str(self.1)
        }
        fn visit_map<A: de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
            let raw = R::deserialize(de::value::MapAccessDeserializer::new(map))?;
            (self.0)(raw).map_err(de::Error::custom)
        }
    }
    d.deserialize_map(MapVisitor(check, what, PhantomData))
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    name: String,
    #[serde(default, rename = "match")]
    matcher: Option<RawMatch>,
    #[serde(default)]
    descriptor: Option<Vec<RawEntry>>,
    #[serde(default)]
    by: Vec<PartSpec>,
    limits: Vec<WindowSpec>,
    #[serde(default)]
    shadow: bool,
    #[serde(default)]
    status: Option<u16>,
    #[serde(default)]
    cost: Option<CostSpec>,
    #[serde(default)]
    failure_mode: Option<FailureMode>,
}

impl RawRule {
    fn into_rule(self) -> Result<ParsedRule, String> {
        let name = self.name;
        if name.is_empty() || name.len() > MAX_NAME_LEN {
            return Err(format!("rule name must be 1 to {MAX_NAME_LEN} characters"));
        }
        if !name.bytes().all(|b| b.is_ascii_alphanumeric() || b"_-.:".contains(&b)) {
            return Err(format!("rule name \"{name}\" may use only letters, digits and _ - . :"));
        }
        if self.limits.is_empty() {
            return Err(format!("rule \"{name}\" needs at least one entry in limits"));
        }
        let status = match self.status {
            None => StatusCode::TOO_MANY_REQUESTS,
            Some(code @ 400..=599) => StatusCode::from_u16(code).expect("400..=599 is a valid status"),
            Some(code) => return Err(format!("rule \"{name}\": status {code} is not a 4xx or 5xx code")),
        };
        let mut windows: Vec<Window> = self.limits.into_iter().map(|w| w.0).collect();
        windows.sort_by_key(|w| w.period_ms);
        if let Some(CostSpec(Cost::Fixed(cost))) = &self.cost
            && let Some(w) = windows.iter().find(|w| w.requests < *cost)
        {
            return Err(format!(
                "rule \"{name}\": cost {cost} is more than the limit of {} per {}ms, so no request could ever be admitted",
                w.requests, w.period_ms
            ));
        }
        if let Some(period) = windows.windows(2).find_map(|p| match p {
            [a, b] if a.period_ms == b.period_ms => Some(a.period_ms),
            _ => None,
        }) {
            return Err(format!(
                "rule \"{name}\" has two limits with the same period ({period}ms)"
            ));
        }
        let descriptor = match self.descriptor {
            None => None,
            Some(_) if self.matcher.is_some() || !self.by.is_empty() => {
                return Err(format!(
                    "rule \"{name}\": a rule with a descriptor (for Envoy) cannot also have match or by"
                ));
            }
            Some(entries) if entries.is_empty() => {
                return Err(format!("rule \"{name}\": descriptor needs at least one entry"));
            }
            Some(entries) => Some(
                entries
                    .into_iter()
                    .map(|e| EntryPattern {
                        key: e.key,
                        value: ValuePattern::parse(e.value.as_deref()),
                        shared: false,
                    })
                    .collect(),
            ),
        };
        Ok(ParsedRule {
            rule: Rule {
                id: name.clone(),
                limit_name: name.clone(),
                name,
                descriptor,
                unlimited: false,
                replaces: Vec::new(),
                matcher: self.matcher.unwrap_or_default().into_matcher()?,
                by: self.by.into_iter().map(|p| p.0).collect(),
                windows,
                shadow: self.shadow,
                quota: false,
                metadata: None,
                status,
                cost: self.cost.map(|c| c.0).unwrap_or(Cost::Fixed(1)),
                failure_mode: FailureMode::Open,
            },
            failure_mode: self.failure_mode,
        })
    }
}

/// One `{ key, value }` entry of a rule's Envoy descriptor.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry {
    key: String,
    #[serde(default)]
    value: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawMatch {
    #[serde(default)]
    methods: Vec<String>,
    #[serde(default)]
    path: Option<String>,
    #[serde(default)]
    ignore_case: bool,
    #[serde(default)]
    host: Option<String>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
}

impl RawMatch {
    fn into_matcher(self) -> Result<Matcher, String> {
        let methods = self
            .methods
            .iter()
            .map(|m| {
                Method::from_bytes(m.to_ascii_uppercase().as_bytes())
                    .map_err(|_| format!("\"{m}\" is not an HTTP method"))
            })
            .collect::<Result<_, _>>()?;
        let path = match self.path {
            None => None,
            Some(p) if !p.starts_with('/') => return Err(format!("path \"{p}\" must start with /")),
            // Requests are matched without query and without ;parameters,
            // and requests with an encoded slash or backslash are refused.
            Some(p) if p.contains(['?', ';', '#']) || crate::path::is_ambiguous(&p) => {
                return Err(format!(
                    "path \"{p}\": ?, ;, # and encoded slashes never reach a match (queries and ;parameters are not part of the matched path; %2F and %5C are refused)"
                ));
            }
            Some(p) => match p.strip_suffix('*') {
                Some(prefix) if !prefix.contains('*') => Some(PathPattern::Prefix(prefix.to_string())),
                None if !p.contains('*') => Some(PathPattern::Exact(p)),
                _ => return Err(format!("path \"{p}\": * is allowed only at the end")),
            },
        };
        let headers = self
            .headers
            .into_iter()
            .map(|(name, value)| {
                let name =
                    HeaderName::from_bytes(name.as_bytes()).map_err(|_| format!("\"{name}\" is not a header name"))?;
                let value = if value == "*" {
                    HeaderValueMatch::Any
                } else {
                    HeaderValueMatch::Exact(value)
                };
                Ok((name, value))
            })
            .collect::<Result<_, String>>()?;
        // Rules see normalised paths, so a pattern is normalised the same way
        // (a prefix only when it ends at a segment boundary).
        let path = path.map(|p| match p {
            PathPattern::Exact(p) => PathPattern::Exact(crate::path::normalize(&p).into_owned()),
            PathPattern::Prefix(p) if p.ends_with('/') => PathPattern::Prefix(crate::path::normalize(&p).into_owned()),
            PathPattern::Prefix(p) => PathPattern::Prefix(p),
        });
        // Requests are compared without port, trailing dot or case; a rule
        // written otherwise would silently never match.
        let host = match self.host {
            Some(h) if h.contains(':') && !h.starts_with('[') || h.contains("]:") => {
                return Err(format!("host \"{h}\": write it without a port (ports are ignored)"));
            }
            Some(h) => Some(h.strip_suffix('.').unwrap_or(&h).to_ascii_lowercase()),
            None => None,
        };
        Ok(Matcher {
            methods,
            path,
            ignore_case: self.ignore_case,
            host,
            headers,
        })
    }
}

/// One `{ requests, per }` entry.
struct WindowSpec(Window);

impl<'de> Deserialize<'de> for WindowSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(deny_unknown_fields)]
        struct Raw {
            requests: u64,
            per: String,
        }
        validated_map(d, "a limit { requests, per }", |raw: Raw| {
            if raw.requests == 0 {
                return Err("requests must be at least 1".to_string());
            }
            if raw.requests > super::MAX_UNITS {
                return Err(format!("requests may be at most {} (10^12)", super::MAX_UNITS));
            }
            let period_ms = parse_period(&raw.per)?;
            Ok(WindowSpec(Window {
                requests: raw.requests,
                period_ms,
            }))
        })
    }
}

/// Parses a window length such as `3s`, `90s`, `1m`, `500ms`, `1h`, `1d`.
fn parse_period(text: &str) -> Result<u64, String> {
    let d = humantime::parse_duration(text.trim())
        .map_err(|e| format!("\"{text}\" is not a duration ({e}); write e.g. 500ms, 3s, 1m, 1h"))?;
    if d.is_zero() || d.subsec_nanos() % 1_000_000 != 0 {
        return Err(format!(
            "\"{text}\": a window must be a positive whole number of milliseconds"
        ));
    }
    if d > MAX_PERIOD {
        return Err(format!("\"{text}\": a window may be at most 366 days"));
    }
    Ok(d.as_millis() as u64)
}

/// One `by` entry.
struct PartSpec(Part);

impl<'de> Deserialize<'de> for PartSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        let part = match s.as_str() {
            "client_ip" => Part::ClientIp { v4: 32, v6: 128 },
            other if other.starts_with("client_ip/") => parse_client_ip(other).map_err(de::Error::custom)?,
            "method" => Part::Method,
            "path" => Part::Path,
            "host" => Part::Host,
            other => match other.split_once(':') {
                Some(("header", name)) => Part::Header(
                    HeaderName::from_bytes(name.as_bytes())
                        .map_err(|_| de::Error::custom(format!("\"{name}\" is not a header name")))?,
                ),
                Some(("query", name)) if !name.is_empty() => Part::Query(name.to_string()),
                _ => {
                    return Err(de::Error::custom(format!(
                        "unknown by entry \"{other}\"; expected client_ip, client_ip/V6LEN, client_ip/V4LEN/V6LEN, method, path, host, header:NAME or query:NAME"
                    )));
                }
            },
        };
        Ok(PartSpec(part))
    }
}

/// `client_ip/64` (IPv6 prefix; IPv4 whole) or `client_ip/24/64` (both).
fn parse_client_ip(text: &str) -> Result<Part, String> {
    let bad = || {
        format!("\"{text}\": write client_ip/V6LEN (e.g. client_ip/64) or client_ip/V4LEN/V6LEN (e.g. client_ip/24/64)")
    };
    let lengths: Vec<&str> = text.trim_start_matches("client_ip/").split('/').collect();
    let len = |s: &str, max: u8| s.parse::<u8>().ok().filter(|n| (1..=max).contains(n));
    match lengths.as_slice() {
        [v6] => Ok(Part::ClientIp {
            v4: 32,
            v6: len(v6, 128).ok_or_else(bad)?,
        }),
        [v4, v6] => Ok(Part::ClientIp {
            v4: len(v4, 32).ok_or_else(bad)?,
            v6: len(v6, 128).ok_or_else(bad)?,
        }),
        _ => Err(bad()),
    }
}

/// `cost: 3` or `cost: header:X-Cost`.
struct CostSpec(Cost);

impl<'de> Deserialize<'de> for CostSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct CostVisitor;
        impl Visitor<'_> for CostVisitor {
            type Value = CostSpec;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a positive integer or header:NAME")
            }
            fn visit_u64<E: de::Error>(self, n: u64) -> Result<CostSpec, E> {
                if n == 0 {
                    return Err(E::custom("cost must be at least 1"));
                }
                if n > super::MAX_UNITS {
                    return Err(E::custom(format!("cost may be at most {} (10^12)", super::MAX_UNITS)));
                }
                Ok(CostSpec(Cost::Fixed(n)))
            }
            fn visit_i64<E: de::Error>(self, n: i64) -> Result<CostSpec, E> {
                match u64::try_from(n) {
                    Ok(n) => self.visit_u64(n),
                    Err(_) => Err(E::custom("cost must be at least 1")),
                }
            }
            fn visit_str<E: de::Error>(self, s: &str) -> Result<CostSpec, E> {
                match s.strip_prefix("header:") {
                    Some(name) => HeaderName::from_bytes(name.as_bytes())
                        .map(|n| CostSpec(Cost::Header(n)))
                        .map_err(|_| E::custom(format!("\"{name}\" is not a header name"))),
                    None => Err(E::custom(format!("cost \"{s}\": expected a number or header:NAME"))),
                }
            }
        }
        d.deserialize_any(CostVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "\
domain: api   # comment
failure_mode: closed
rules:
  - name: login
    match: { methods: [post], path: /login }
    by: [client_ip]
    limits:
      - { requests: 20, per: 60s }
      - { requests: 5, per: 3s }
  - name: api
    match: { path: /api/* }
    by: [header:X-Api-Key, query:tenant]
    limits: [{ requests: 100, per: 90s }]
    shadow: true
    status: 503
    cost: header:X-Cost
    failure_mode: open
";

    #[test]
    fn parses_the_documented_shape() {
        let l = parse_str(GOOD, "limits.yaml").unwrap();
        assert_eq!(l.domain, "api");
        let login = &l.rules[0];
        assert_eq!(login.matcher.methods, vec![Method::POST]);
        assert_eq!(login.matcher.path, Some(PathPattern::Exact("/login".into())));
        // Windows are kept shortest first.
        assert_eq!(
            login.windows,
            vec![
                Window {
                    requests: 5,
                    period_ms: 3000
                },
                Window {
                    requests: 20,
                    period_ms: 60_000
                }
            ]
        );
        assert_eq!(login.failure_mode, FailureMode::Closed);
        let api = &l.rules[1];
        assert_eq!(
            api.by,
            vec![
                Part::Header(HeaderName::from_static("x-api-key")),
                Part::Query("tenant".into())
            ]
        );
        assert!(api.shadow);
        assert_eq!(api.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(api.cost, Cost::Header(HeaderName::from_static("x-cost")));
        assert_eq!(api.failure_mode, FailureMode::Open);
        assert_eq!(api.windows[0].period_ms, 90_000);
    }

    #[test]
    fn json_uses_the_same_schema() {
        let json = r#"{"domain":"api","rules":[{"name":"a","limits":[{"requests":2,"per":"1s"}]}]}"#;
        let l = parse_str(json, "limits.json").unwrap();
        assert_eq!(
            l.rules[0].windows[0],
            Window {
                requests: 2,
                period_ms: 1000
            }
        );
        let err = parse_str("{\"domain\":\"api\",\n\"rulez\":[]}", "limits.json").unwrap_err();
        assert_eq!(err.line, Some(2));
        assert!(err.reason.contains("unknown field `rulez`"), "{err}");
    }

    fn error_of(yaml: &str) -> ConfigError {
        parse_str(yaml, "conf/limits.yaml").unwrap_err()
    }

    #[test]
    fn errors_name_file_line_and_reason() {
        let dup = GOOD.replace("name: api", "name: login");
        let err = error_of(&dup);
        assert_eq!(err.line, Some(10), "{err}");
        assert!(err.to_string().starts_with("conf/limits.yaml:10: "), "{err}");
        assert!(err.reason.contains("duplicate rule name \"login\""), "{err}");

        let unknown = GOOD.replace("shadow: true", "shadw: true");
        let err = error_of(&unknown);
        assert_eq!(err.line, Some(14), "{err}");
        assert!(err.reason.contains("unknown field `shadw`"), "{err}");

        let zero = GOOD.replace("requests: 5,", "requests: 0,");
        let err = error_of(&zero);
        assert_eq!(err.line, Some(9), "{err}");
        assert!(err.reason.contains("requests must be at least 1"), "{err}");

        let negative = GOOD.replace("requests: 5,", "requests: -5,");
        assert_eq!(error_of(&negative).line, Some(9));

        let duration = GOOD.replace("per: 3s", "per: 3 fortnights");
        let err = error_of(&duration);
        assert_eq!(err.line, Some(9), "{err}");
        assert!(err.reason.contains("is not a duration"), "{err}");

        let bare_number = GOOD.replace("per: 3s", "per: 3");
        assert!(error_of(&bare_number).reason.contains("is not a duration"));
    }

    #[test]
    fn refuses_doubtful_rules() {
        for (from, to, why) in [
            ("by: [client_ip]", "by: [cookie]", "unknown by entry"),
            ("path: /login", "path: login", "must start with /"),
            ("path: /login", "path: /a*b", "only at the end"),
            ("status: 503", "status: 200", "not a 4xx or 5xx"),
            ("cost: header:X-Cost", "cost: 0", "at least 1"),
            ("cost: header:X-Cost", "cost: lots", "expected a number"),
            ("per: 60s", "per: 3s", "same period"),
            ("name: api", "name: \"a b\"", "may use only"),
            ("domain: api", "domain: \"\"", "domain must not be empty"),
            ("methods: [post]", "methods: [\"PO ST\"]", "not an HTTP method"),
        ] {
            assert!(GOOD.contains(from), "{from}");
            let err = error_of(&GOOD.replace(from, to));
            assert!(err.reason.contains(why), "{from} -> {to}: {err}");
            assert!(err.line.is_some(), "{err}");
        }
    }

    #[test]
    fn syntax_errors_and_truncated_files_are_refused() {
        let half = &GOOD[..GOOD.len() / 2];
        assert!(parse_str(half, "l.yaml").is_err());
        let err = error_of("domain: api\nrules:\n  - name: [unclosed\n");
        assert!(err.line.is_some(), "{err}");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 512, ..Default::default() })]
        /// Fuzz: any text, or the good file with a slice replaced by noise,
        /// is an answer (limits or file:line: reason), never a panic.
        #[test]
        fn the_parser_never_panics(
            noise in "[ -~\\n\\t\\[\\]{}:,'\"#*-]{0,300}",
            cut in 0usize..2000,
            len in 0usize..200,
            json: bool,
        ) {
            let file = if json { "f.json" } else { "f.yaml" };
            let _ = parse_str(&noise, file);
            let start = cut.min(GOOD.len());
            let end = start.saturating_add(len).min(GOOD.len());
            if GOOD.is_char_boundary(start) && GOOD.is_char_boundary(end) {
                let mutated = format!("{}{}{}", &GOOD[..start], noise, &GOOD[end..]);
                let _ = parse_str(&mutated, file);
            }
            let envoy = "domain: e\ndescriptors:\n  - key: k\n    rate_limit: { unit: second, requests_per_unit: 5 }\n";
            let at = cut.min(envoy.len());
            let _ = parse_str(&format!("{}{}{}", &envoy[..at], noise, &envoy[at..]), file);
        }
    }

    #[test]
    fn deep_nesting_and_huge_files_are_refused_quickly() {
        let started = std::time::Instant::now();
        for text in ["[".repeat(100_000), format!("domain: {}", "{".repeat(20_000))] {
            let e = parse_str(&text, "deep.yaml").unwrap_err();
            assert!(e.to_string().contains("nested deeper than 64 levels"), "{e}");
        }
        let e = parse_str(&"#".repeat(9 << 20), "big.yaml").unwrap_err();
        assert!(e.to_string().contains("larger than 8 MiB"), "{e}");
        // Brackets inside strings and comments are text, not nesting.
        let quoted = format!("domain: \"{}\"  # {}\nrules: []\n", "[".repeat(100), "{".repeat(100));
        assert!(parse_str(&quoted, "q.yaml").is_ok());
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
    }

    #[test]
    fn numbers_past_the_cap_and_costs_past_the_limit_are_refused() {
        let e = error_of("domain: d\nrules:\n  - name: r\n    limits: [{ requests: 9007199254740993, per: 1s }]\n");
        assert!(e.to_string().contains("at most 1000000000000"), "{e}");
        let e = error_of(
            "domain: d\nrules:\n  - name: r\n    cost: 18446744073709551615\n    limits: [{ requests: 5, per: 1s }]\n",
        );
        assert!(e.to_string().contains("at most 1000000000000"), "{e}");
        let e = error_of(
            "domain: d\nrules:\n  - name: r\n    cost: 10\n    limits: [{ requests: 5, per: 1s }, { requests: 50, per: 1m }]\n",
        );
        assert!(e.to_string().contains("no request could ever be admitted"), "{e}");
        assert!(e.line.is_some(), "{e}");
    }

    #[test]
    fn rules_that_could_never_match_are_refused() {
        for (m, why) in [
            ("{ host: api.example.com:8080 }", "without a port"),
            ("{ path: /se;x }", "never reach a match"),
            ("{ path: '/qp?a=1' }", "never reach a match"),
            ("{ path: '/x%2Fy*' }", "never reach a match"),
        ] {
            let e = error_of(&format!(
                "domain: d\nrules:\n  - name: r\n    match: {m}\n    limits: [{{ requests: 1, per: 1s }}]\n"
            ));
            assert!(e.to_string().contains(why), "{m}: {e}");
        }
        let l = parse_str("domain: d\nrules:\n  - name: r\n    match: { host: API.example.com. }\n    limits: [{ requests: 1, per: 1s }]\n", "l.yaml").unwrap();
        assert_eq!(l.rules[0].matcher.host.as_deref(), Some("api.example.com"));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_period("500ms"), Ok(500));
        assert_eq!(parse_period("1m"), Ok(60_000));
        assert_eq!(parse_period("1h"), Ok(3_600_000));
        assert_eq!(parse_period("1d"), Ok(86_400_000));
        assert!(parse_period("0s").is_err());
        assert!(parse_period("1us").is_err());
        assert!(parse_period("400d").is_err());
    }
}
