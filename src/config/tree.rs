//! Envoy descriptor matching, exactly as envoyproxy/ratelimit does it, so a
//! migrated file answers every request the same way.
//!
//! Each configured level is named by its composite key: `key_value`, or
//! `key` when no value is given. A request entry `(k, v)` is looked up level
//! by level: first the composite `k_v` itself, then the level's wildcard
//! patterns (a `*` anywhere matches any run of characters) in file order,
//! the first that matches `k_v` winning, then the bare `k`. The rule at the
//! node the last entry reaches applies; a descriptor deeper or shallower
//! than the configured tree matches nothing.

use std::collections::HashMap;
use std::sync::Arc;

use serde::Serialize;

use super::Rule;

/// How one descriptor entry's value is matched.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ValuePattern {
    /// Any value; each distinct value gets its own counter.
    Any,
    /// Exactly this value.
    Exact(String),
    /// This pattern, where each `*` matches any run of characters.
    Wildcard(String),
}

impl ValuePattern {
    /// Reads a configured value: absent or empty is any, one with `*` a wildcard.
    pub fn parse(value: Option<&str>) -> Self {
        match value {
            None | Some("") => ValuePattern::Any,
            Some(v) if v.contains('*') => ValuePattern::Wildcard(v.to_string()),
            Some(v) => ValuePattern::Exact(v.to_string()),
        }
    }
}

/// One level of a descriptor pattern.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct EntryPattern {
    /// The descriptor key.
    pub key: String,
    /// What its value must be.
    pub value: ValuePattern,
    /// Every value this wildcard matches shares one counter
    /// (envoyproxy/ratelimit's `share_threshold`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub shared: bool,
}

impl EntryPattern {
    /// The name envoyproxy/ratelimit gives this level: `key` or `key_value`.
    pub fn composite(&self) -> String {
        match &self.value {
            ValuePattern::Any => self.key.clone(),
            ValuePattern::Exact(v) | ValuePattern::Wildcard(v) => format!("{}_{v}", self.key),
        }
    }
}

/// Descriptor patterns arranged for lookup.
#[derive(Debug, Clone, Default)]
pub struct DescriptorTree {
    root: Level,
}

#[derive(Debug, Clone, Default)]
struct Level {
    /// Every node of the level by composite key, wildcards included.
    nodes: HashMap<String, Node>,
    /// The level's wildcard patterns, in file order.
    wildcards: Vec<Wildcard>,
}

#[derive(Debug, Clone)]
struct Wildcard {
    composite: String,
    /// The composite split at each `*`: at least two pieces.
    pieces: Vec<String>,
}

#[derive(Debug, Clone, Default)]
struct Node {
    rule: Option<Arc<Rule>>,
    /// For a `share_threshold` wildcard: the value that names the shared
    /// counter (the pattern itself, `files*`).
    shared_value: Option<String>,
    /// Written as a key without a value: reached by any value that no
    /// exact value or wildcard of its level takes first.
    any_value: bool,
    children: Level,
}

/// Two patterns of one level have the same composite key.
#[derive(Debug, thiserror::Error)]
#[error("duplicate descriptor composite key '{0}'")]
pub struct DuplicatePattern(pub String);

/// The rule a request descriptor matched, and how to name its counter.
#[derive(Debug)]
pub struct TreeMatch<'a> {
    /// The rule at the node the last entry reached.
    pub rule: &'a Arc<Rule>,
    /// Entries matched by a `share_threshold` wildcard, by index, with the
    /// value that replaces theirs in the counter key.
    pub shared: Vec<(usize, &'a str)>,
}

request_path! {
    impl DescriptorTree {
        /// Adds `path`'s node (creating the levels above it) and puts `rule`
        /// there. `rule: None` keeps a placeholder: it still wins over less
        /// specific patterns at its level, as in envoyproxy/ratelimit. A node that
        /// already has a rule is a duplicate.
        pub fn insert(&mut self, path: &[EntryPattern], rule: Option<Arc<Rule>>) -> Result<(), DuplicatePattern> {
            let Some((last, parents)) = path.split_last() else {
                return Ok(());
            };
            let mut level = &mut self.root;
            for entry in parents {
                level = &mut level.node_mut(entry).children;
            }
            let node = level.node_mut(last);
            if rule.is_some() {
                if node.rule.is_some() {
                    return Err(DuplicatePattern(last.composite()));
                }
                node.rule = rule;
            }
            Ok(())
        }

        /// Adds `other`'s top-level descriptors beside these (another file of
        /// the same domain); one composite key at the top of both is an error.
        pub fn merge(&mut self, other: &DescriptorTree) -> Result<(), DuplicatePattern> {
            if let Some(dup) = other.root.nodes.keys().find(|k| self.root.nodes.contains_key(*k)) {
                return Err(DuplicatePattern(dup.clone()));
            }
            for (composite, node) in &other.root.nodes {
                self.root.nodes.insert(composite.clone(), node.clone());
            }
            self.root.wildcards.extend(other.root.wildcards.iter().cloned());
            Ok(())
        }

        /// The rule for a request descriptor, if any.
        pub fn lookup<K: AsRef<str>, V: AsRef<str>>(
            &self,
            entries: impl IntoIterator<Item = (K, V)>,
        ) -> Option<TreeMatch<'_>> {
            let mut level = &self.root;
            let mut found: Option<&Node> = None;
            let mut shared = Vec::new();
            let mut composite = String::new();
            for (i, (key, value)) in entries.into_iter().enumerate() {
                if let Some(node) = found {
                    level = &node.children;
                }
                let key = key.as_ref();
                composite.clear();
                composite.push_str(key);
                composite.push('_');
                composite.push_str(value.as_ref());
                let node = match level.nodes.get(composite.as_str()) {
                    Some(node) => node,
                    None => match level.wildcards.iter().find(|w| w.matches(&composite)) {
                        Some(w) => {
                            let node = level.nodes.get(&w.composite)?;
                            if let Some(v) = &node.shared_value {
                                shared.push((i, v.as_str()));
                            }
                            node
                        }
                        None => level.nodes.get(key)?,
                    },
                };
                found = Some(node);
            }
            found
                .and_then(|n| n.rule.as_ref())
                .map(|rule| TreeMatch { rule, shared })
        }
    }
}

/// A level of the tree no request can reach, for `tollgate check`.
#[derive(Debug, PartialEq, Eq)]
pub struct Shadowed {
    /// The composite keys from the top down to the unreachable level.
    pub path: Vec<String>,
    /// The earlier wildcard that takes every request it would see.
    pub by: String,
    /// The level is a wildcard: a value spelled as its pattern (`*`
    /// included) still reaches it, by exact lookup.
    pub wildcard: bool,
}

impl DescriptorTree {
    /// The levels that can never match: a wildcard whose every value an
    /// earlier wildcard of its level matches first, or a bare key (any
    /// value) whose every value a wildcard of its level matches first.
    pub fn shadowed(&self) -> Vec<Shadowed> {
        let mut out = Vec::new();
        self.root.shadowed(&mut Vec::new(), &mut out);
        out
    }
}

impl Level {
    fn shadowed(&self, path: &mut Vec<String>, out: &mut Vec<Shadowed>) {
        for (at, later) in self.wildcards.iter().enumerate() {
            let earlier = self.wildcards.iter().take(at).find(|w| w.covers(&later.composite));
            if let Some(w) = earlier {
                out.push(Shadowed {
                    path: path.iter().cloned().chain([later.composite.clone()]).collect(),
                    by: w.composite.clone(),
                    wildcard: true,
                });
            }
        }
        let mut composites: Vec<&String> = self.nodes.keys().collect();
        composites.sort();
        for composite in composites {
            let Some(node) = self.nodes.get(composite) else {
                continue;
            };
            // A key without a value is any value: the pattern `key_*`.
            let any_value = format!("{composite}_*");
            if node.any_value
                && let Some(w) = self.wildcards.iter().find(|w| w.covers(&any_value))
            {
                out.push(Shadowed {
                    path: path.iter().cloned().chain([composite.clone()]).collect(),
                    by: w.composite.clone(),
                    wildcard: false,
                });
            }
            path.push(composite.clone());
            node.children.shadowed(path, out);
            path.pop();
        }
    }
}

impl Wildcard {
    /// Whether this wildcard matches every text the wildcard `pattern`
    /// matches: it does when it matches `pattern` itself with each `*` of
    /// `pattern` taken by one of its own `*`s (its literal pieces never
    /// hold a `*`, so plain matching does exactly that).
    fn covers(&self, pattern: &str) -> bool {
        self.matches(pattern)
    }
}

impl Level {
    fn node_mut(&mut self, entry: &EntryPattern) -> &mut Node {
        let composite = entry.composite();
        if !self.nodes.contains_key(&composite) && composite.contains('*') {
            self.wildcards.push(Wildcard {
                pieces: composite.split('*').map(str::to_string).collect(),
                composite: composite.clone(),
            });
        }
        let node = self.nodes.entry(composite).or_default();
        node.any_value |= entry.value == ValuePattern::Any;
        if entry.shared
            && let ValuePattern::Wildcard(v) = &entry.value
        {
            node.shared_value = Some(v.clone());
        }
        node
    }
}

request_path! {
    impl Wildcard {
        /// Whether `text` matches: it starts with the first piece, ends with
        /// the last, and holds the middle pieces in order between them, without
        /// overlaps.
        fn matches(&self, text: &str) -> bool {
            let Some((first, rest)) = self.pieces.split_first() else {
                return false;
            };
            let Some((last, middle)) = rest.split_last() else {
                return text == first;
            };
            let Some(mut between) = text
                .strip_prefix(first.as_str())
                .and_then(|t| t.strip_suffix(last.as_str()))
            else {
                return false;
            };
            for piece in middle {
                match between.find(piece.as_str()) {
                    Some(at) => match between.get(at.saturating_add(piece.len())..) {
                        Some(after) => between = after,
                        None => return false,
                    },
                    None => return false,
                }
            }
            true
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn wildcard(pattern: &str) -> Wildcard {
        Wildcard {
            composite: pattern.to_string(),
            pieces: pattern.split('*').map(str::to_string).collect(),
        }
    }

    /// The plain definition: `*` matches any run of characters.
    fn reference_match(pattern: &[u8], text: &[u8]) -> bool {
        match pattern.split_first() {
            None => text.is_empty(),
            Some((b'*', rest)) => (0..=text.len()).any(|i| reference_match(rest, &text[i..])),
            Some((c, rest)) => text.first() == Some(c) && reference_match(rest, &text[1..]),
        }
    }

    #[test]
    fn wildcards_match_anywhere_in_the_value() {
        for (pattern, text, expected) in [
            ("path_bar*b", "path_barfoob", true),
            ("path_bar*b", "path_bar", false),
            ("path_bar*b", "path_barb", true),
            ("k_foo*bar*baz", "k_foo1bar2baz", true),
            ("k_foo*bar*baz", "k_foobarbaz", true),
            ("k_foo*bar*baz", "k_foobaz", false),
            ("k_*suffix", "k_my-suffix", true),
            ("k_*suffix", "k_suffixx", false),
            ("k_ab*ba", "k_aba", false),
            ("k_a*", "k_a", true),
        ] {
            assert_eq!(wildcard(pattern).matches(text), expected, "{pattern} ~ {text}");
        }
    }

    /// Every text over `ab` up to `len` characters.
    fn texts(len: usize) -> Vec<String> {
        let mut all = vec![String::new()];
        let mut last = vec![String::new()];
        for _ in 0..len {
            last = last.iter().flat_map(|t| [format!("{t}a"), format!("{t}b")]).collect();
            all.extend(last.iter().cloned());
        }
        all
    }

    proptest! {
        /// `covers` never claims more than the definition: whatever a
        /// covered pattern matches, the covering one matches too.
        #[test]
        fn a_covering_wildcard_matches_all_the_covered_one_matches(earlier in "[ab*]{0,3}\\*[ab*]{0,3}", later in "[ab]{0,3}\\*[ab*]{0,4}") {
            let (w, l) = (wildcard(&earlier), wildcard(&later));
            if w.covers(&later) {
                for text in texts(8) {
                    if reference_match(later.as_bytes(), text.as_bytes()) {
                        prop_assert!(reference_match(earlier.as_bytes(), text.as_bytes()), "{earlier} covers {later} but not {text}");
                    }
                }
            } else if l.pieces.len() == 2 && w.pieces.len() == 2 {
                // Decided exactly for one-star patterns: some text tells them apart.
                let witness = texts(8).into_iter().any(|t| {
                    reference_match(later.as_bytes(), t.as_bytes()) && !reference_match(earlier.as_bytes(), t.as_bytes())
                });
                prop_assert!(witness, "{earlier} does not cover {later}, yet no text tells them apart");
            }
        }

        #[test]
        fn wildcard_matching_agrees_with_its_definition(pattern in "[ab*]{0,8}", text in "[ab]{0,10}") {
            let pattern = format!("k_{pattern}*");
            let text = format!("k_{text}");
            prop_assert_eq!(wildcard(&pattern).matches(&text), reference_match(pattern.as_bytes(), text.as_bytes()));
        }
    }
}
