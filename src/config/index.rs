//! A file's HTTP rules arranged for lookup, so matching a request costs the
//! same whether the file holds one rule or ten thousand.
//!
//! The index narrows a request down to the rules that could match it: by
//! host (a map), then by path (exact paths in a map; prefixes in a sorted
//! list where each prefix points at the longest other prefix it starts with,
//! so every prefix of a path is found with one binary search), then, where
//! several rules of one path share a header condition with exact values
//! (one rule per tenant: `x-tenant: t1`, `x-tenant: t2`, ...), by that
//! header's value (a map). Methods, and the other header conditions, are
//! left to [`Matcher::matches`](super::Matcher::matches), which decides each
//! survivor exactly as the linear scan does, so the rules that match, and
//! their order, are the scan's. The index is built when a file is parsed,
//! off the request path.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use http::HeaderName;

use crate::fields::Fields;

use super::{HeaderValueMatch, PathPattern, Rule};

/// The HTTP rules of one file, by host and path; positions are indexes into
/// the file's `rules`.
#[derive(Debug, Default)]
pub struct RuleIndex {
    /// Rules without a `host` condition.
    any_host: PathIndex,
    /// Rules with one, by lower-cased host.
    hosts: HashMap<Box<str>, PathIndex>,
    /// Any rule matches regardless of case, so paths are also looked up
    /// lower-cased (see [`crate::path::fold_case`]).
    folds: bool,
    /// How long building took, for the reload log line.
    built_in: Duration,
}

/// The rules of one host (or of any host), by path.
#[derive(Debug, Default)]
struct PathIndex {
    /// Rules without a `path` condition.
    any: Bucket,
    /// Exact paths, case-sensitive.
    exact: HashMap<Box<str>, Bucket>,
    /// Exact paths with `ignore_case`, lower-cased.
    exact_folded: HashMap<Box<str>, Bucket>,
    /// Prefixes, case-sensitive.
    prefixes: Prefixes,
    /// Prefixes with `ignore_case`, lower-cased.
    prefixes_folded: Prefixes,
}

/// Distinct prefixes in byte order, each with the rules that use it.
#[derive(Debug, Default)]
struct Prefixes {
    entries: Vec<PrefixEntry>,
}

#[derive(Debug)]
struct PrefixEntry {
    prefix: Box<str>,
    rules: Bucket,
    /// The longest other prefix in the list that this one starts with.
    shorter: Option<usize>,
}

impl RuleIndex {
    /// Indexes the HTTP rules (those without a `descriptor`) of `rules`.
    pub fn new(rules: &[Arc<Rule>]) -> RuleIndex {
        let started = Instant::now();
        let mut any_host = PathBuilder::default();
        let mut hosts: HashMap<Box<str>, PathBuilder> = HashMap::new();
        let mut folds = false;
        for (at, rule) in rules.iter().enumerate() {
            if rule.descriptor.is_some() {
                continue;
            }
            let m = &rule.matcher;
            let paths = match &m.host {
                None => &mut any_host,
                Some(h) => hosts.entry(h.to_ascii_lowercase().into()).or_default(),
            };
            folds |= m.ignore_case && m.path.is_some();
            paths.add(at, m.path.as_ref(), m.ignore_case);
        }
        let mut index = RuleIndex {
            any_host: any_host.build(rules),
            hosts: hosts.into_iter().map(|(h, b)| (h, b.build(rules))).collect(),
            folds,
            built_in: Duration::ZERO,
        };
        index.built_in = started.elapsed();
        index
    }

    /// How long building the index took.
    pub fn built_in(&self) -> Duration {
        self.built_in
    }

    /// The positions, in file order, of the rules that may match a request
    /// for `path` (in matching form, see [`crate::path::matching_form`]) on
    /// `host` (without port) with `headers`; every rule that matches is
    /// among them.
    pub fn candidates(&self, path: &str, host: Option<&str>, headers: Fields<'_>) -> Vec<usize> {
        let folded = if self.folds {
            crate::path::fold_case(path)
        } else {
            Cow::Borrowed(path)
        };
        let mut out = Vec::new();
        self.any_host.collect(path, &folded, headers, &mut out);
        if let Some(host) = host {
            let host = if host.bytes().any(|b| b.is_ascii_uppercase()) {
                Cow::Owned(host.to_ascii_lowercase())
            } else {
                Cow::Borrowed(host)
            };
            if let Some(paths) = self.hosts.get(host.as_ref()) {
                paths.collect(path, &folded, headers, &mut out);
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }
}

impl PathIndex {
    /// Adds the rules that may match `path` (`folded`: it lower-cased).
    fn collect(&self, path: &str, folded: &str, headers: Fields<'_>, out: &mut Vec<usize>) {
        self.any.collect(headers, out);
        // An exact path also matches its spelling with a trailing slash.
        let exact = |map: &HashMap<Box<str>, Bucket>, p: &str, out: &mut Vec<usize>| {
            if map.is_empty() {
                return;
            }
            for p in [Some(p), p.strip_suffix('/')].into_iter().flatten() {
                if let Some(rules) = map.get(p) {
                    rules.collect(headers, out);
                }
            }
        };
        exact(&self.exact, path, out);
        exact(&self.exact_folded, folded, out);
        self.prefixes.collect(path, headers, out);
        self.prefixes_folded.collect(folded, headers, out);
    }
}

impl Prefixes {
    /// Adds the rules of every prefix `path` starts with.
    ///
    /// Every prefix `q` of `path` lies between `q` and `path` in byte
    /// order, and every string there starts with `q`; so each such `q` is a
    /// prefix of the greatest entry not above `path`, and is found on that
    /// entry's chain of shorter prefixes.
    fn collect(&self, path: &str, headers: Fields<'_>, out: &mut Vec<usize>) {
        let below = match self
            .entries
            .binary_search_by(|e| e.prefix.as_bytes().cmp(path.as_bytes()))
        {
            Ok(at) => Some(at),
            Err(at) => at.checked_sub(1),
        };
        let mut next = below;
        while let Some(entry) = next.and_then(|at| self.entries.get(at)) {
            if path.starts_with(entry.prefix.as_ref()) {
                entry.rules.collect(headers, out);
            }
            next = entry.shorter;
        }
    }
}

/// The rules that share one path key (or have no path), in file order.
/// Where at least two of them require the same header to hold an exact
/// value, those are found by the request's value of it instead of tried
/// one by one.
#[derive(Debug, Default)]
struct Bucket {
    /// Rules tried one by one.
    rules: Vec<usize>,
    /// Rules found by their value of one header.
    keyed: Option<Box<HeaderKeyed>>,
}

#[derive(Debug)]
struct HeaderKeyed {
    name: HeaderName,
    by_value: HashMap<Box<[u8]>, Vec<usize>>,
}

impl Bucket {
    /// Keys the rules at `positions` by the header most of them name with
    /// an exact value.
    fn new(positions: Vec<usize>, rules: &[Arc<Rule>]) -> Bucket {
        let exact_values = |at: usize| {
            rules
                .get(at)
                .into_iter()
                .flat_map(|rule| rule.matcher.headers.iter())
                .filter_map(|(name, want)| match want {
                    HeaderValueMatch::Exact(value) => Some((name, value)),
                    HeaderValueMatch::Any => None,
                })
        };
        let mut uses: HashMap<&HeaderName, usize> = HashMap::new();
        for &at in &positions {
            for (name, _) in exact_values(at) {
                *uses.entry(name).or_default() += 1;
            }
        }
        // The most used name; ties go to the first in byte order, so a file
        // always gets the same index.
        let Some(name) = uses
            .into_iter()
            .filter(|&(_, n)| n >= 2)
            .max_by(|a, b| a.1.cmp(&b.1).then_with(|| b.0.as_str().cmp(a.0.as_str())))
            .map(|(name, _)| name.clone())
        else {
            return Bucket {
                rules: positions,
                keyed: None,
            };
        };
        let mut plain = Vec::new();
        let mut by_value: HashMap<Box<[u8]>, Vec<usize>> = HashMap::new();
        for at in positions {
            // A rule may name the header twice with different values; it
            // then matches only a request carrying both, so either value
            // finds it.
            match exact_values(at).find(|(n, _)| **n == name) {
                Some((_, value)) => by_value.entry(value.as_bytes().into()).or_default().push(at),
                None => plain.push(at),
            }
        }
        Bucket {
            rules: plain,
            keyed: Some(Box::new(HeaderKeyed { name, by_value })),
        }
    }

    /// Adds the rules that may match a request with `headers`.
    fn collect(&self, headers: Fields<'_>, out: &mut Vec<usize>) {
        out.extend_from_slice(&self.rules);
        if let Some(keyed) = &self.keyed {
            // As the matcher compares: any of the values it meets.
            for value in super::match_values(headers, &keyed.name) {
                if let Some(rules) = keyed.by_value.get(value) {
                    out.extend_from_slice(rules);
                }
            }
        }
    }
}

/// A [`PathIndex`] being filled.
#[derive(Default)]
struct PathBuilder {
    any: Vec<usize>,
    exact: HashMap<Box<str>, Vec<usize>>,
    exact_folded: HashMap<Box<str>, Vec<usize>>,
    prefixes: HashMap<Box<str>, Vec<usize>>,
    prefixes_folded: HashMap<Box<str>, Vec<usize>>,
}

impl PathBuilder {
    fn add(&mut self, at: usize, path: Option<&PathPattern>, ignore_case: bool) {
        let (map, key) = match (path, ignore_case) {
            (None, _) => return self.any.push(at),
            (Some(PathPattern::Exact(p)), false) => (&mut self.exact, p.clone()),
            (Some(PathPattern::Exact(p)), true) => (&mut self.exact_folded, crate::path::fold_case(p).into_owned()),
            (Some(PathPattern::Prefix(p)), false) => (&mut self.prefixes, p.clone()),
            (Some(PathPattern::Prefix(p)), true) => (&mut self.prefixes_folded, crate::path::fold_case(p).into_owned()),
        };
        map.entry(key.into()).or_default().push(at);
    }

    fn build(self, rules: &[Arc<Rule>]) -> PathIndex {
        let buckets = |map: HashMap<Box<str>, Vec<usize>>| -> HashMap<Box<str>, Bucket> {
            map.into_iter().map(|(k, at)| (k, Bucket::new(at, rules))).collect()
        };
        PathIndex {
            any: Bucket::new(self.any, rules),
            exact: buckets(self.exact),
            exact_folded: buckets(self.exact_folded),
            prefixes: Prefixes::new(buckets(self.prefixes)),
            prefixes_folded: Prefixes::new(buckets(self.prefixes_folded)),
        }
    }
}

impl Prefixes {
    fn new(by_prefix: HashMap<Box<str>, Bucket>) -> Prefixes {
        let mut entries: Vec<PrefixEntry> = by_prefix
            .into_iter()
            .map(|(prefix, rules)| PrefixEntry {
                prefix,
                rules,
                shorter: None,
            })
            .collect();
        entries.sort_unstable_by(|a, b| a.prefix.cmp(&b.prefix));
        // In byte order, the prefixes an entry starts with come before it
        // and are exactly the stack left after popping those it does not.
        let mut stack: Vec<usize> = Vec::new();
        let mut shorter = Vec::with_capacity(entries.len());
        for (at, entry) in entries.iter().enumerate() {
            while let Some(top) = stack.last().and_then(|&top| entries.get(top)) {
                if entry.prefix.starts_with(top.prefix.as_ref()) {
                    break;
                }
                stack.pop();
            }
            shorter.push(stack.last().copied());
            stack.push(at);
        }
        for (entry, shorter) in entries.iter_mut().zip(shorter) {
            entry.shorter = shorter;
        }
        Prefixes { entries }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;

    fn prefixes(list: &[&str]) -> Prefixes {
        Prefixes::new(
            list.iter()
                .enumerate()
                .map(|(i, p)| {
                    let bucket = Bucket {
                        rules: vec![i],
                        keyed: None,
                    };
                    (Box::from(*p), bucket)
                })
                .collect(),
        )
    }

    #[test]
    fn every_prefix_of_a_path_is_found_once() {
        let list = ["/", "/a", "/a/", "/a/b", "/ab", "/b", "/a/bc", "/a/c"];
        let p = prefixes(&list);
        for path in ["/", "/a", "/a/b/c", "/ab", "/abc", "/a/bd", "/a/c", "/c", "", "/a/"] {
            let mut got = Vec::new();
            p.collect(path, Fields::Map(&HeaderMap::new()), &mut got);
            got.sort_unstable();
            let want: Vec<usize> = (0..list.len()).filter(|&i| path.starts_with(list[i])).collect();
            assert_eq!(got, want, "{path}");
        }
    }

    #[test]
    fn hosts_are_looked_up_without_case_and_paths_by_the_rules_case_setting() {
        let limits = crate::config::parse_str(
            "domain: d\nrules:\n  - { name: a, match: { host: API.example.com, path: /Login }, limits: [{ requests: 1, per: 1s }] }\n  - { name: b, match: { path: '/Api/*', ignore_case: true }, limits: [{ requests: 1, per: 1s }] }\n  - { name: c, limits: [{ requests: 1, per: 1s }] }\n",
            "t.yaml",
        )
        .unwrap();
        let index = &limits.index;
        assert_eq!(
            index.candidates("/Login", Some("Api.Example.COM"), Fields::Map(&HeaderMap::new())),
            vec![0, 2]
        );
        assert_eq!(
            index.candidates("/Login/", Some("api.example.com"), Fields::Map(&HeaderMap::new())),
            vec![0, 2]
        );
        assert_eq!(
            index.candidates("/login", Some("api.example.com"), Fields::Map(&HeaderMap::new())),
            vec![2]
        );
        assert_eq!(
            index.candidates("/API/x", None, Fields::Map(&HeaderMap::new())),
            vec![1, 2]
        );
        assert_eq!(index.candidates("/Apix", None, Fields::Map(&HeaderMap::new())), vec![2]);
    }
}
