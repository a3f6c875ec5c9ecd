//! A file's HTTP rules arranged for lookup, so matching a request costs the
//! same whether the file holds one rule or ten thousand.
//!
//! The index narrows a request down to the rules that could match it: by
//! host (a map), then by path (exact paths in a map; prefixes in a sorted
//! list where each prefix points at the longest other prefix it starts with,
//! so every prefix of a path is found with one binary search). Methods and
//! headers are left to [`Matcher::matches`](super::Matcher::matches), which
//! decides each survivor exactly as the linear scan does, so the rules that
//! match, and their order, are the scan's. The index is built when a file is
//! parsed, off the request path.

use std::borrow::Cow;
use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::{PathPattern, Rule};

/// The HTTP rules of one file, by host and path; positions are indexes into
/// the file's `rules`.
#[derive(Debug, Default)]
pub struct RuleIndex {
    /// Rules without a `host` condition.
    any_host: PathIndex,
    /// Rules with one, by lower-cased host.
    hosts: HashMap<Box<str>, PathIndex>,
    /// Any rule matches regardless of case, so paths are also looked up
    /// lower-cased.
    folds: bool,
    /// How long building took, for the reload log line.
    built_in: Duration,
}

/// The rules of one host (or of any host), by path.
#[derive(Debug, Default)]
struct PathIndex {
    /// Rules without a `path` condition.
    any: Vec<usize>,
    /// Exact paths, case-sensitive.
    exact: HashMap<Box<str>, Vec<usize>>,
    /// Exact paths with `ignore_case`, lower-cased.
    exact_folded: HashMap<Box<str>, Vec<usize>>,
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
    rules: Vec<usize>,
    /// The longest other prefix in the list that this one starts with.
    shorter: Option<usize>,
}

impl RuleIndex {
    /// Indexes the HTTP rules (those without a `descriptor`) of `rules`.
    pub fn new(rules: &[std::sync::Arc<Rule>]) -> RuleIndex {
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
            any_host: any_host.build(),
            hosts: hosts.into_iter().map(|(h, b)| (h, b.build())).collect(),
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
    /// `host` (without port); every rule that matches is among them.
    pub fn candidates(&self, path: &str, host: Option<&str>) -> Vec<usize> {
        let folded = if self.folds && path.bytes().any(|b| b.is_ascii_uppercase()) {
            Cow::Owned(path.to_ascii_lowercase())
        } else {
            Cow::Borrowed(path)
        };
        let mut out = Vec::new();
        self.any_host.collect(path, &folded, &mut out);
        if let Some(host) = host {
            let host = if host.bytes().any(|b| b.is_ascii_uppercase()) {
                Cow::Owned(host.to_ascii_lowercase())
            } else {
                Cow::Borrowed(host)
            };
            if let Some(paths) = self.hosts.get(host.as_ref()) {
                paths.collect(path, &folded, &mut out);
            }
        }
        out.sort_unstable();
        out.dedup();
        out
    }
}

impl PathIndex {
    /// Adds the rules that may match `path` (`folded`: it lower-cased).
    fn collect(&self, path: &str, folded: &str, out: &mut Vec<usize>) {
        out.extend_from_slice(&self.any);
        // An exact path also matches its spelling with a trailing slash.
        let exact = |map: &HashMap<Box<str>, Vec<usize>>, p: &str, out: &mut Vec<usize>| {
            if map.is_empty() {
                return;
            }
            for p in [Some(p), p.strip_suffix('/')].into_iter().flatten() {
                if let Some(rules) = map.get(p) {
                    out.extend_from_slice(rules);
                }
            }
        };
        exact(&self.exact, path, out);
        exact(&self.exact_folded, folded, out);
        self.prefixes.collect(path, out);
        self.prefixes_folded.collect(folded, out);
    }
}

impl Prefixes {
    /// Adds the rules of every prefix `path` starts with.
    ///
    /// Every prefix `q` of `path` lies between `q` and `path` in byte
    /// order, and every string there starts with `q`; so each such `q` is a
    /// prefix of the greatest entry not above `path`, and is found on that
    /// entry's chain of shorter prefixes.
    fn collect(&self, path: &str, out: &mut Vec<usize>) {
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
                out.extend_from_slice(&entry.rules);
            }
            next = entry.shorter;
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
            (Some(PathPattern::Exact(p)), true) => (&mut self.exact_folded, p.to_ascii_lowercase()),
            (Some(PathPattern::Prefix(p)), false) => (&mut self.prefixes, p.clone()),
            (Some(PathPattern::Prefix(p)), true) => (&mut self.prefixes_folded, p.to_ascii_lowercase()),
        };
        map.entry(key.into()).or_default().push(at);
    }

    fn build(self) -> PathIndex {
        PathIndex {
            any: self.any,
            exact: self.exact,
            exact_folded: self.exact_folded,
            prefixes: Prefixes::new(self.prefixes),
            prefixes_folded: Prefixes::new(self.prefixes_folded),
        }
    }
}

impl Prefixes {
    fn new(by_prefix: HashMap<Box<str>, Vec<usize>>) -> Prefixes {
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

    fn prefixes(list: &[&str]) -> Prefixes {
        Prefixes::new(list.iter().enumerate().map(|(i, p)| (Box::from(*p), vec![i])).collect())
    }

    #[test]
    fn every_prefix_of_a_path_is_found_once() {
        let list = ["/", "/a", "/a/", "/a/b", "/ab", "/b", "/a/bc", "/a/c"];
        let p = prefixes(&list);
        for path in ["/", "/a", "/a/b/c", "/ab", "/abc", "/a/bd", "/a/c", "/c", "", "/a/"] {
            let mut got = Vec::new();
            p.collect(path, &mut got);
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
        assert_eq!(index.candidates("/Login", Some("Api.Example.COM")), vec![0, 2]);
        assert_eq!(index.candidates("/Login/", Some("api.example.com")), vec![0, 2]);
        assert_eq!(index.candidates("/login", Some("api.example.com")), vec![2]);
        assert_eq!(index.candidates("/API/x", None), vec![1, 2]);
        assert_eq!(index.candidates("/Apix", None), vec![2]);
    }
}
