//! envoyproxy/ratelimit configuration files, loaded unchanged.
//!
//! A file with `domain` and nested `descriptors` becomes ordinary tollgate
//! rules (one window each, the `unit` as the window length, counted as a
//! sliding window) plus the descriptor tree the RLS surface looks them up in.
//! Nodes without `rate_limit` stay in the tree as placeholders, so they keep
//! winning over less specific siblings exactly as in envoyproxy/ratelimit.

use std::collections::HashSet;
use std::fmt;
use std::sync::Arc;

use http::StatusCode;
use serde::Deserialize;
use serde::de::{DeserializeSeed, Deserializer, SeqAccess, Visitor};

use super::file::{Domain, validated_map};
use super::{Cost, DescriptorTree, EntryPattern, FailureMode, Format, Limits, Matcher, Rule, ValuePattern, Window};

/// A whole envoyproxy/ratelimit file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct EnvoyFile {
    domain: Domain,
    #[serde(default)]
    descriptors: Descriptors,
}

/// One level of descriptors; a repeated `key`/`value` pair is an error.
#[derive(Default)]
struct Descriptors(Vec<Descriptor>);

struct Descriptor {
    key: String,
    value: Option<String>,
    rate_limit: Option<RawRateLimit>,
    descriptors: Descriptors,
    shadow_mode: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDescriptor {
    key: String,
    #[serde(default)]
    value: Option<String>,
    #[serde(default)]
    rate_limit: Option<RawRateLimit>,
    #[serde(default)]
    descriptors: Descriptors,
    #[serde(default)]
    shadow_mode: bool,
    /// Only changes metric names in envoyproxy/ratelimit; accepted so such
    /// files load, while tollgate's metric labels stay bounded to rule names.
    #[serde(default)]
    #[allow(dead_code)]
    detailed_metric: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRateLimit {
    #[serde(default)]
    unit: Option<String>,
    #[serde(default)]
    requests_per_unit: Option<u32>,
    #[serde(default)]
    unlimited: bool,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    replaces: Vec<Replace>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Replace {
    name: String,
}

/// Window length of an Envoy `unit`, in milliseconds.
pub fn unit_ms(unit: &str) -> Option<u64> {
    const SECOND: u64 = 1000;
    Some(match unit.to_ascii_lowercase().as_str() {
        "second" => SECOND,
        "minute" => 60 * SECOND,
        "hour" => 3600 * SECOND,
        "day" => 86_400 * SECOND,
        "week" => 7 * 86_400 * SECOND,
        "month" => 30 * 86_400 * SECOND,
        "year" => 365 * 86_400 * SECOND,
        _ => return None,
    })
}

impl<'de> Deserialize<'de> for Descriptors {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct ListVisitor;
        impl<'de> Visitor<'de> for ListVisitor {
            type Value = Descriptors;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of descriptors")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Descriptors, A::Error> {
                let mut seen = HashSet::new();
                let mut list = Vec::new();
                while let Some(d) = seq.next_element_seed(UniqueDescriptor { seen: &mut seen })? {
                    list.push(d);
                }
                Ok(Descriptors(list))
            }
        }
        d.deserialize_seq(ListVisitor)
    }
}

struct UniqueDescriptor<'a> {
    seen: &'a mut HashSet<(String, Option<String>)>,
}

impl<'de> DeserializeSeed<'de> for UniqueDescriptor<'_> {
    type Value = Descriptor;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Descriptor, D::Error> {
        validated_map(
            d,
            "a descriptor (key, value, rate_limit, descriptors)",
            |raw: RawDescriptor| {
                if raw.key.is_empty() {
                    return Err("descriptor key must not be empty".to_string());
                }
                let what = match &raw.value {
                    Some(v) => format!("{}={v}", raw.key),
                    None => raw.key.clone(),
                };
                if !self.seen.insert((raw.key.clone(), raw.value.clone())) {
                    return Err(format!("duplicate descriptor {what}"));
                }
                if let Some(rl) = &raw.rate_limit
                    && !rl.unlimited
                {
                    let unit = rl
                        .unit
                        .as_deref()
                        .ok_or_else(|| format!("descriptor {what}: rate_limit needs a unit"))?;
                    if unit_ms(unit).is_none() {
                        return Err(format!(
                            "descriptor {what}: unknown unit \"{unit}\" (second, minute, hour, day, week, month, year)"
                        ));
                    }
                    if rl.requests_per_unit.is_none() {
                        return Err(format!("descriptor {what}: rate_limit needs requests_per_unit"));
                    }
                }
                Ok(Descriptor {
                    key: raw.key,
                    value: raw.value,
                    rate_limit: raw.rate_limit,
                    descriptors: raw.descriptors,
                    shadow_mode: raw.shadow_mode,
                })
            },
        )
    }
}

impl EnvoyFile {
    /// Flattens the nested descriptors into rules and their lookup tree.
    pub(super) fn into_limits(self) -> Result<Limits, String> {
        let mut rules = Vec::new();
        let mut tree = DescriptorTree::default();
        let mut path = Vec::new();
        add_level(self.descriptors.0, &mut path, &mut rules, &mut tree)?;
        Ok(Limits {
            domain: self.domain.0,
            format: Format::EnvoyRatelimit,
            rules,
            tree,
        })
    }
}

fn add_level(
    level: Vec<Descriptor>,
    path: &mut Vec<EntryPattern>,
    rules: &mut Vec<Arc<Rule>>,
    tree: &mut DescriptorTree,
) -> Result<(), String> {
    for d in level {
        path.push(EntryPattern {
            key: d.key.clone(),
            value: ValuePattern::parse(d.value.as_deref()),
        });
        let shadow = d.shadow_mode;
        let rule = d.rate_limit.map(|rl| Arc::new(rule_for(path, shadow, rl)));
        tree.insert(path, rule.clone()).map_err(|e| e.to_string())?;
        rules.extend(rule);
        add_level(d.descriptors.0, path, rules, tree)?;
        path.pop();
    }
    Ok(())
}

/// The id envoyproxy/ratelimit would use for this node: `key_value.key2`.
fn path_id(path: &[EntryPattern]) -> String {
    path.iter()
        .map(|e| match &e.value {
            ValuePattern::Any => e.key.clone(),
            ValuePattern::Exact(v) => format!("{}_{v}", e.key),
            ValuePattern::Prefix(p) => format!("{}_{p}*", e.key),
        })
        .collect::<Vec<_>>()
        .join(".")
}

fn rule_for(path: &[EntryPattern], shadow: bool, rl: RawRateLimit) -> Rule {
    let id = path_id(path);
    let windows = match (rl.unlimited, rl.unit.as_deref().and_then(unit_ms), rl.requests_per_unit) {
        (false, Some(period_ms), Some(requests)) => vec![Window {
            requests: u64::from(requests),
            period_ms,
        }],
        _ => Vec::new(),
    };
    Rule {
        name: rl.name.clone().unwrap_or_else(|| id.clone()),
        id,
        descriptor: Some(path.to_vec()),
        unlimited: rl.unlimited,
        replaces: rl.replaces.into_iter().map(|r| r.name).collect(),
        matcher: Matcher::default(),
        by: Vec::new(),
        windows,
        shadow,
        status: StatusCode::TOO_MANY_REQUESTS,
        cost: Cost::Fixed(1),
        failure_mode: FailureMode::Open,
    }
}

#[cfg(test)]
mod tests {
    use crate::config::{Format, parse_str};

    const MESSAGING: &str = "\
domain: messaging
descriptors:
  # Only allow 5 marketing messages a day
  - key: message_type
    value: marketing
    descriptors:
      - key: to_number
        rate_limit:
          unit: day
          requests_per_unit: 5
  - key: to_number
    rate_limit:
      unit: day
      requests_per_unit: 100
  - key: remote_address
    value: 50.0.0.5
    rate_limit: { unit: second, requests_per_unit: 0, name: blocked }
  - key: path
    value: /api/*
    rate_limit: { unit: minute, requests_per_unit: 20 }
  - key: ldap
    rate_limit: { unlimited: true }
";

    fn rule_name(l: &crate::config::Limits, entries: &[(&str, &str)]) -> Option<String> {
        l.tree.lookup(entries.iter().copied()).map(|r| r.name.clone())
    }

    #[test]
    fn nested_descriptors_match_as_in_envoy_ratelimit() {
        let l = parse_str(MESSAGING, "ratelimit.yaml").unwrap();
        assert_eq!(l.format, Format::EnvoyRatelimit);
        assert_eq!(l.domain, "messaging");
        assert_eq!(
            rule_name(&l, &[("message_type", "marketing"), ("to_number", "2061111111")]).as_deref(),
            Some("message_type_marketing.to_number")
        );
        assert_eq!(
            rule_name(&l, &[("to_number", "2061111111")]).as_deref(),
            Some("to_number")
        );
        // Depth must match: the placeholder level has no limit of its own.
        assert_eq!(rule_name(&l, &[("message_type", "marketing")]), None);
        assert_eq!(rule_name(&l, &[("message_type", "other"), ("to_number", "1")]), None);
        assert_eq!(rule_name(&l, &[("to_number", "1"), ("extra", "x")]), None);
        assert_eq!(
            rule_name(&l, &[("remote_address", "50.0.0.5")]).as_deref(),
            Some("blocked")
        );
        assert_eq!(rule_name(&l, &[("remote_address", "50.0.0.6")]), None);
        assert_eq!(rule_name(&l, &[("path", "/api/users")]).as_deref(), Some("path_/api/*"));
        assert_eq!(rule_name(&l, &[("path", "/apx")]), None);
        let day = l.tree.lookup([("to_number", "1")]).unwrap();
        assert_eq!(day.windows[0].period_ms, 86_400_000);
        assert!(l.tree.lookup([("ldap", "x")]).unwrap().unlimited);
    }

    #[test]
    fn envoy_files_are_checked_like_envoy_ratelimit_does() {
        for (from, to, why) in [
            (
                "unit: day\n          requests_per_unit: 5",
                "unit: fortnight\n          requests_per_unit: 5",
                "unknown unit",
            ),
            (
                "requests_per_unit: 20 }",
                "requests_per_unit: 20, colour: red }",
                "unknown field `colour`",
            ),
            (
                "  - key: ldap\n",
                "  - key: to_number\n",
                "duplicate descriptor to_number",
            ),
            (
                "unit: minute, requests_per_unit: 20",
                "unit: minute",
                "needs requests_per_unit",
            ),
        ] {
            assert!(MESSAGING.contains(from), "{from}");
            let err = parse_str(&MESSAGING.replace(from, to), "ratelimit.yaml").unwrap_err();
            assert!(err.reason.contains(why), "{to}: {err}");
            assert!(err.line.is_some(), "{err}");
        }
    }
}
