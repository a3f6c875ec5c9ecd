//! tollgate's own limits file schema (`rules:`), validated as it is
//! deserialized so every error carries the line of the value it is about;
//! a duplicate rule name points at the second rule. Reading the file and
//! telling the two formats apart is [`super::file`]'s.

use std::collections::{BTreeMap, HashSet};
use std::fmt;
use std::marker::PhantomData;
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

impl RawLimits {
    /// The limits the file describes, each rule with its failure mode.
    pub(super) fn into_limits(self) -> Limits {
        let default_mode = self.failure_mode.unwrap_or_default();
        let mut tree = super::DescriptorTree::default();
        let mut rules = Vec::with_capacity(self.rules.0.len());
        for parsed in self.rules.0 {
            let mut rule = parsed.rule;
            rule.failure_mode = parsed.failure_mode.unwrap_or(default_mode);
            let rule = Arc::new(rule);
            if let Some(path) = &rule.descriptor {
                // Duplicates were refused while parsing, with their line.
                let _ = tree.insert(path, Some(rule.clone()));
            }
            rules.push(rule);
        }
        Limits::new(self.domain.0, super::Format::Tollgate, rules, tree)
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct RawLimits {
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
    grpc_status: Option<u16>,
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
        let grpc_status = match self.grpc_status {
            None => super::RESOURCE_EXHAUSTED,
            Some(code @ 1..=16) => code,
            Some(code) => {
                return Err(format!(
                    "rule \"{name}\": grpc_status {code} is not a gRPC error code (1 to 16; 8 is RESOURCE_EXHAUSTED, 14 UNAVAILABLE)"
                ));
            }
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
                grpc_status,
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
    #[serde(default, deserialize_with = "unique_headers")]
    headers: BTreeMap<String, String>,
}

/// `match.headers`, refusing a name given twice (in any case): a map keeps
/// the last, which silently widened a rule (`x-tier: free` then `x-tier:
/// "*"`), and two spellings of one name were two conditions no request met.
fn unique_headers<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, String>, D::Error> {
    struct Unique;
    impl<'de> de::Visitor<'de> for Unique {
        type Value = BTreeMap<String, String>;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a map of header names to values")
        }
        fn visit_map<A: de::MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
            let mut out = BTreeMap::new();
            while let Some((name, value)) = map.next_entry::<String, String>()? {
                if out.keys().any(|k: &String| k.eq_ignore_ascii_case(&name)) {
                    return Err(de::Error::custom(format!(
                        "header \"{name}\" is named twice (header names are case-insensitive)"
                    )));
                }
                out.insert(name, value);
            }
            Ok(out)
        }
    }
    d.deserialize_map(Unique)
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
        // Rules see paths in matching form, so a pattern is brought to the
        // same form (a prefix ending mid-segment only has its escapes folded:
        // removing dot segments there would change what it continues).
        let path = path.map(|p| match p {
            PathPattern::Exact(p) => PathPattern::Exact(crate::path::matching_form(&p).into_owned()),
            PathPattern::Prefix(p) if p.ends_with('/') => {
                PathPattern::Prefix(crate::path::matching_form(&p).into_owned())
            }
            PathPattern::Prefix(p) => PathPattern::Prefix(crate::path::fold_escapes(&p).into_owned()),
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
            /// Bucket length: the window keeps one count per bucket.
            #[serde(default)]
            precision: Option<String>,
        }
        validated_map(d, "a limit { requests, per }", |raw: Raw| {
            if raw.requests == 0 {
                return Err("requests must be at least 1".to_string());
            }
            if raw.requests > super::MAX_UNITS {
                return Err(format!("requests may be at most {} (10^12)", super::MAX_UNITS));
            }
            let period_ms = parse_period(&raw.per)?;
            let precision_ms = match raw.precision.as_deref() {
                None => 0,
                Some(text) => {
                    let p = parse_period(text).map_err(|e| format!("precision: {e}"))?;
                    if p > period_ms {
                        return Err(format!(
                            "precision \"{text}\" is longer than the window \"{}\"",
                            raw.per
                        ));
                    }
                    if !period_ms.is_multiple_of(p) {
                        // A bucket straddling the window's end would make a
                        // unit count up to two precisions past `per`.
                        return Err(format!(
                            "precision \"{text}\" does not divide the window \"{}\" evenly; use one that does",
                            raw.per
                        ));
                    }
                    if period_ms.div_ceil(p) > super::MAX_BUCKETS {
                        return Err(format!(
                            "precision \"{text}\" cuts the window \"{}\" into more than {} buckets; use a coarser one",
                            raw.per,
                            super::MAX_BUCKETS
                        ));
                    }
                    p
                }
            };
            Ok(WindowSpec(Window {
                requests: raw.requests,
                period_ms,
                precision_ms,
            }))
        })
    }
}

/// Parses a window length such as `3s`, `90s`, `1m`, `500ms`, `1h`, `1d`.
pub(super) fn parse_period(text: &str) -> Result<u64, String> {
    // Months and years are not whole days (humantime makes `1M` 30.44 days
    // and `1y` 365.25), and `1M` is a minute mistyped as easily as not.
    let units = text.split(|c: char| !c.is_ascii_alphabetic()).filter(|u| !u.is_empty());
    if let Some(unit) = units
        .into_iter()
        .find(|u| matches!(*u, "M" | "month" | "months" | "y" | "yr" | "yrs" | "year" | "years"))
    {
        return Err(format!(
            "\"{text}\": \"{unit}\" is a month or a year, which are not whole days; write the days (30d, 365d), or m for minutes"
        ));
    }
    let d = humantime::parse_duration(text.trim()).map_err(|e| {
        // humantime's own list of units names months and years, refused above.
        let why = match e {
            humantime::DurationError::UnknownUnit { unit, .. } if !unit.is_empty() => {
                format!("unknown time unit \"{unit}\"; units: ms, s, m, h, d, w")
            }
            other => other.to_string(),
        };
        format!("\"{text}\" is not a duration ({why}); write e.g. 500ms, 3s, 1m, 1h")
    })?;
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
            "client_cert" => Part::ClientCert,
            other => match other.split_once(':') {
                Some(("header", name)) => Part::Header(
                    HeaderName::from_bytes(name.as_bytes())
                        .map_err(|_| de::Error::custom(format!("\"{name}\" is not a header name")))?,
                ),
                Some(("query", name)) if !name.is_empty() => Part::Query(name.to_string()),
                _ => {
                    return Err(de::Error::custom(format!(
                        "unknown by entry \"{other}\"; expected client_ip, client_ip/V6LEN, client_ip/V4LEN/V6LEN, method, path, host, header:NAME, query:NAME or client_cert"
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
