//! From an Envoy RLS request's descriptors to the counters they touch.
//!
//! The RLS surface translates each descriptor into a [`Descriptor`] (its
//! entries, its own `limit` if any, its cost); [`resolve`] looks each up in
//! the domain's descriptor tree, applies overrides and `replaces`, and names
//! one counter per limited descriptor, as envoyproxy/ratelimit does.

use std::sync::Arc;

use super::keys;
use crate::config::{self, Limits, Rule, Window};
use crate::limiter::Hit;

/// One descriptor of an RLS request, as the limits see it.
#[derive(Debug, Clone)]
pub struct Descriptor<'a> {
    /// Its entries (key, value), in order.
    pub entries: Vec<(&'a str, &'a str)>,
    /// Its own limit, sent with the request, if any.
    pub limit: Option<Override<'a>>,
    /// The units it charges (0: checked, not charged).
    pub cost: u64,
}

/// A descriptor's own limit: `requests` per one `unit`, an Envoy unit name
/// (`second` … `year`, any case). An unknown unit is ignored and the
/// configured limit applies.
#[derive(Debug, Clone, Copy)]
pub struct Override<'a> {
    /// Requests per unit.
    pub requests: u32,
    /// The unit's name.
    pub unit: &'a str,
}

/// What the limits say about a request's descriptors.
pub struct Resolved {
    /// Per descriptor, the rule that applies (`None`: no limit applies, or
    /// another matched limit `replaces` it). Unlimited rules are kept, so the
    /// surface can answer them as such.
    pub rules: Vec<Option<Arc<Rule>>>,
    /// One hit per limited descriptor, to decide together.
    pub hits: Vec<Hit>,
    /// Per descriptor, the index of its hit in `hits`.
    pub hit_of: Vec<Option<usize>>,
}

/// The rule one descriptor matched, and the values its counter is named by
/// where a `share_threshold` wildcard stands in for the request's own.
struct Matched<'a> {
    rule: Arc<Rule>,
    shared: Vec<(usize, &'a str)>,
}

/// Resolves every descriptor against `limits` (one domain's). With
/// `quota_mode`, every limit is decided as a `quota_mode` one
/// (envoyproxy/ratelimit's global `QUOTA_MODE`).
pub fn resolve(limits: &Limits, descriptors: &[Descriptor<'_>], quota_mode: bool) -> Resolved {
    let mut matched: Vec<Option<Matched<'_>>> = descriptors
        .iter()
        .map(|d| {
            let configured = limits.tree.lookup(d.entries.iter().copied()).map(|m| Matched {
                rule: m.rule.clone(),
                shared: m.shared,
            });
            match d.limit.and_then(override_rule) {
                Some(rule) => Some(override_counter(rule, configured)),
                None => configured,
            }
        })
        .collect();
    // A matched limit that `replaces` others drops every named limit of
    // that name from this request; unlimited ones stay unlimited.
    let replaced: Vec<String> = matched
        .iter()
        .flatten()
        .flat_map(|m| m.rule.replaces.iter().cloned())
        .collect();
    if !replaced.is_empty() {
        for m in matched.iter_mut() {
            if m.as_ref().is_some_and(|m| {
                !m.rule.unlimited && !m.rule.limit_name.is_empty() && replaced.contains(&m.rule.limit_name)
            }) {
                *m = None;
            }
        }
    }

    let mut hits = Vec::new();
    let mut hit_of = vec![None; descriptors.len()];
    for (i, (d, m)) in descriptors.iter().zip(&matched).enumerate() {
        let Some(m) = m.as_ref().filter(|m| !m.rule.unlimited) else {
            continue;
        };
        let entries = d.entries.iter().enumerate().map(|(j, &(key, value))| {
            let value = m.shared.iter().find(|(at, _)| *at == j).map_or(value, |s| s.1);
            (key, value)
        });
        if let Some(slot) = hit_of.get_mut(i) {
            *slot = Some(hits.len());
        }
        let rule = match quota_mode && !m.rule.quota {
            true => Arc::new(Rule {
                quota: true,
                ..(*m.rule).clone()
            }),
            false => m.rule.clone(),
        };
        hits.push(Hit {
            rule,
            key: keys::descriptor_key(&limits.domain, &m.rule.id, entries),
            cost: d.cost,
        });
    }
    Resolved {
        rules: matched.into_iter().map(|m| m.map(|m| m.rule)).collect(),
        hits,
        hit_of,
    }
}

/// An override counts on the configured limit's counter when that limit has
/// one window of the same length (as envoyproxy/ratelimit, which keys by
/// entries and unit), with its precision, else on one counter per unit:
/// changing the override's amount, or sending it on some requests only,
/// never starts from zero.
fn override_counter<'a>(mut rule: Arc<Rule>, configured: Option<Matched<'_>>) -> Matched<'a> {
    if let Some(configured) = configured
        && let [c] = configured.rule.windows.as_slice()
        && let [o] = rule.windows.as_slice()
        && o.period_ms == c.period_ms
    {
        let counted = Window { precision_ms: c.precision_ms, ..*o };
        let rule = Arc::make_mut(&mut rule);
        rule.id = configured.rule.id.clone();
        // The same counts: a bucketed window's live in its ring, not the log.
        rule.windows = vec![counted];
    }
    // An override counts the request's own values, wildcard or not.
    Matched {
        rule,
        shared: Vec::new(),
    }
}

/// The rule for a descriptor that brings its own `limit`.
fn override_rule(o: Override<'_>) -> Option<Arc<Rule>> {
    let period_ms = config::envoy_unit_ms(o.unit)?;
    let unit = o.unit.to_ascii_lowercase();
    Some(Arc::new(Rule {
        windows: vec![Window {
            requests: u64::from(o.requests),
            period_ms,
            precision_ms: 0,
        }],
        // envoyproxy/ratelimit reports an override without a name. Its
        // metrics label is the unit's alone: the amount is the caller's,
        // and every amount sent would have made one more series.
        ..Rule::envoy_limit(format!("override_per_{unit}"))
    }))
}
