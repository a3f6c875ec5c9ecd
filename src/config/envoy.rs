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

use serde::Deserialize;
use serde::de::{self, DeserializeSeed, Deserializer, SeqAccess, Visitor};

use super::schema::{Domain, validated_map};
use super::{DescriptorTree, EntryPattern, Format, Limits, Rule, ValuePattern, Window};

/// A whole envoyproxy/ratelimit file.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub(super) struct EnvoyFile {
    domain: Domain,
    #[serde(default)]
    descriptors: Descriptors,
}

/// One level of descriptors; two with the same composite key are an error.
#[derive(Default)]
struct Descriptors(Vec<Descriptor>);

struct Descriptor {
    entry: EntryPattern,
    rate_limit: Option<RawRateLimit>,
    descriptors: Descriptors,
    shadow_mode: bool,
    quota_mode: bool,
    metadata: Option<serde_json::Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDescriptor {
    #[serde(default, deserialize_with = "scalar")]
    key: Option<String>,
    #[serde(default, deserialize_with = "scalar")]
    value: Option<String>,
    #[serde(default)]
    rate_limit: Option<RawRateLimit>,
    #[serde(default)]
    descriptors: Descriptors,
    #[serde(default)]
    shadow_mode: bool,
    #[serde(default)]
    quota_mode: bool,
    #[serde(default)]
    share_threshold: bool,
    #[serde(default)]
    metadata: Option<serde_json::Value>,
    /// `detailed_metric` and `value_to_metric` only put request values into
    /// envoyproxy/ratelimit's metric names; accepted so such files load,
    /// while tollgate's metric labels stay bounded to rule names.
    #[serde(default)]
    #[allow(dead_code)]
    detailed_metric: bool,
    #[serde(default)]
    #[allow(dead_code)]
    value_to_metric: bool,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRateLimit {
    #[serde(default, deserialize_with = "scalar")]
    unit: Option<String>,
    #[serde(default)]
    requests_per_unit: Option<u32>,
    #[serde(default)]
    unlimited: bool,
    #[serde(default, deserialize_with = "scalar")]
    name: Option<String>,
    #[serde(default, deserialize_with = "nullable")]
    replaces: Vec<Replace>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Replace {
    #[serde(default, deserialize_with = "scalar")]
    name: Option<String>,
}

/// A string field that, as in envoyproxy/ratelimit's YAML reader, also
/// takes a number or boolean as written (`value: 200`).
fn scalar<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    struct ScalarVisitor;
    impl<'de> Visitor<'de> for ScalarVisitor {
        type Value = Option<String>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a string")
        }
        fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_bool<E: de::Error>(self, v: bool) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
            Ok(Some(v.to_string()))
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
    }
    d.deserialize_any(ScalarVisitor)
}

/// A list that may be written empty (`replaces:` with nothing after it).
fn nullable<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Vec<T>, D::Error> {
    Ok(Option::<Vec<T>>::deserialize(d)?.unwrap_or_default())
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
            // `descriptors:` with nothing after it is an empty level.
            fn visit_unit<E: de::Error>(self) -> Result<Descriptors, E> {
                Ok(Descriptors::default())
            }
            fn visit_none<E: de::Error>(self) -> Result<Descriptors, E> {
                Ok(Descriptors::default())
            }
        }
        d.deserialize_any(ListVisitor)
    }
}

struct UniqueDescriptor<'a> {
    seen: &'a mut HashSet<String>,
}

impl<'de> DeserializeSeed<'de> for UniqueDescriptor<'_> {
    type Value = Descriptor;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Descriptor, D::Error> {
        validated_map(
            d,
            "a descriptor (key, value, rate_limit, descriptors)",
            |raw: RawDescriptor| {
                let key = raw.key.unwrap_or_default();
                if key.is_empty() {
                    return Err("descriptor has empty key".to_string());
                }
                let entry = EntryPattern {
                    key,
                    value: ValuePattern::parse(raw.value.as_deref()),
                    shared: raw.share_threshold,
                };
                let composite = entry.composite();
                if !self.seen.insert(composite.clone()) {
                    return Err(format!("duplicate descriptor composite key '{composite}'"));
                }
                if raw.share_threshold && !composite.contains('*') {
                    return Err(format!(
                        "share_threshold can only be used with wildcard values (containing '*'), but found key '{composite}'"
                    ));
                }
                if let Some(rl) = &raw.rate_limit {
                    let unit = rl.unit.as_deref().unwrap_or_default();
                    let known = unit_ms(unit).is_some();
                    if rl.unlimited && known {
                        return Err(format!(
                            "descriptor {composite}: should not specify rate limit unit when unlimited"
                        ));
                    }
                    if !rl.unlimited && !known {
                        return Err(format!(
                            "descriptor {composite}: invalid rate limit unit '{unit}' (second, minute, hour, day, week, month, year)"
                        ));
                    }
                    let name = rl.name.as_deref().unwrap_or_default();
                    for r in &rl.replaces {
                        match r.name.as_deref().unwrap_or_default() {
                            "" => {
                                return Err(format!(
                                    "descriptor {composite}: should not have an empty replaces entry"
                                ));
                            }
                            n if n == name => {
                                return Err(format!(
                                    "descriptor {composite}: replaces should not contain name of same descriptor"
                                ));
                            }
                            _ => {}
                        }
                    }
                }
                if let Some(m) = &raw.metadata
                    && !(m.is_object() || m.is_null())
                {
                    return Err(format!("descriptor {composite}: metadata must be a map"));
                }
                Ok(Descriptor {
                    entry,
                    rate_limit: raw.rate_limit,
                    descriptors: raw.descriptors,
                    shadow_mode: raw.shadow_mode,
                    quota_mode: raw.quota_mode,
                    metadata: raw.metadata.filter(|m| m.as_object().is_some_and(|o| !o.is_empty())),
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
        Ok(Limits::new(self.domain.0, Format::EnvoyRatelimit, rules, tree))
    }
}

fn add_level(
    level: Vec<Descriptor>,
    path: &mut Vec<EntryPattern>,
    rules: &mut Vec<Arc<Rule>>,
    tree: &mut DescriptorTree,
) -> Result<(), String> {
    for d in level {
        path.push(d.entry);
        let rule = d
            .rate_limit
            .map(|rl| Arc::new(rule_for(path, d.shadow_mode, d.quota_mode, d.metadata, rl)));
        tree.insert(path, rule.clone()).map_err(|e| e.to_string())?;
        rules.extend(rule);
        add_level(d.descriptors.0, path, rules, tree)?;
        path.pop();
    }
    Ok(())
}

/// The id envoyproxy/ratelimit would use for this node: `key_value.key2`.
fn path_id(path: &[EntryPattern]) -> String {
    path.iter().map(EntryPattern::composite).collect::<Vec<_>>().join(".")
}

fn rule_for(
    path: &[EntryPattern],
    shadow: bool,
    quota: bool,
    metadata: Option<serde_json::Value>,
    rl: RawRateLimit,
) -> Rule {
    let id = path_id(path);
    let windows = match (rl.unlimited, rl.unit.as_deref().and_then(unit_ms)) {
        (false, Some(period_ms)) => vec![Window {
            // Absent means 0, as in envoyproxy/ratelimit: every request is over.
            requests: u64::from(rl.requests_per_unit.unwrap_or(0)),
            period_ms,
            precision_ms: 0,
        }],
        _ => Vec::new(),
    };
    let limit_name = rl.name.unwrap_or_default();
    let base = Rule::envoy_limit(id);
    Rule {
        name: if limit_name.is_empty() {
            base.id.clone()
        } else {
            limit_name.clone()
        },
        limit_name,
        descriptor: Some(path.to_vec()),
        unlimited: rl.unlimited,
        replaces: rl.replaces.into_iter().filter_map(|r| r.name).collect(),
        windows,
        shadow,
        quota,
        metadata,
        ..base
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
        l.tree.lookup(entries.iter().copied()).map(|m| m.rule.name.clone())
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
        let day = l.tree.lookup([("to_number", "1")]).unwrap().rule;
        assert_eq!(day.windows[0].period_ms, 86_400_000);
        assert!(l.tree.lookup([("ldap", "x")]).unwrap().rule.unlimited);
    }

    #[test]
    fn envoy_files_are_checked_like_envoy_ratelimit_does() {
        for (from, to, why) in [
            (
                "unit: day\n          requests_per_unit: 5",
                "unit: fortnight\n          requests_per_unit: 5",
                "invalid rate limit unit 'fortnight'",
            ),
            (
                "requests_per_unit: 20 }",
                "requests_per_unit: 20, colour: red }",
                "unknown field `colour`",
            ),
            (
                "  - key: ldap\n",
                "  - key: to_number\n",
                "duplicate descriptor composite key 'to_number'",
            ),
            (
                "{ unlimited: true }",
                "{ unlimited: true, unit: second }",
                "should not specify rate limit unit when unlimited",
            ),
            (
                "value: 50.0.0.5\n",
                "value: 50.0.0.5\n    share_threshold: true\n",
                "share_threshold can only be used with wildcard values",
            ),
            (
                "name: blocked }",
                "name: blocked, replaces: [{ name: blocked }] }",
                "replaces should not contain name of same descriptor",
            ),
            (
                "name: blocked }",
                "name: blocked, replaces: [{ name: '' }] }",
                "should not have an empty replaces entry",
            ),
        ] {
            assert!(MESSAGING.contains(from), "{from}");
            let err = parse_str(&MESSAGING.replace(from, to), "ratelimit.yaml").unwrap_err();
            assert!(err.reason.contains(why), "{to}: {err}");
            assert!(err.line.is_some(), "{err}");
        }
    }
}
