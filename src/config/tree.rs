//! Envoy descriptor matching: a request descriptor `[(k1, v1), (k2, v2)]`
//! is looked up level by level, as envoyproxy/ratelimit does. At each level
//! `key` + exact `value` beats `key` + `value*` (longest prefix), which beats
//! a bare `key`; the rule at the node reached by the last entry applies. A
//! descriptor deeper or shallower than the configured tree matches nothing.

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
    /// Values starting with this (written `prefix*`); one counter per value.
    Prefix(String),
}

impl ValuePattern {
    /// Reads a configured value: absent is any, a trailing `*` a prefix.
    pub fn parse(value: Option<&str>) -> Self {
        match value {
            None => ValuePattern::Any,
            Some(v) => match v.strip_suffix('*') {
                Some(prefix) => ValuePattern::Prefix(prefix.to_string()),
                None => ValuePattern::Exact(v.to_string()),
            },
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
}

/// Descriptor patterns arranged for lookup.
#[derive(Debug, Clone, Default)]
pub struct DescriptorTree {
    root: Level,
}

#[derive(Debug, Clone, Default)]
struct Level {
    exact: HashMap<(String, String), Node>,
    prefix: Vec<(String, String, Node)>,
    any: HashMap<String, Node>,
}

#[derive(Debug, Clone, Default)]
struct Node {
    rule: Option<Arc<Rule>>,
    children: Level,
}

/// Two rules claim the same descriptor pattern.
#[derive(Debug, thiserror::Error)]
#[error("another rule already matches this descriptor")]
pub struct DuplicatePattern;

impl DescriptorTree {
    /// Adds a node for `path` (creating the levels above it) and puts `rule`
    /// there. `rule: None` keeps a placeholder: it still wins over less
    /// specific patterns at its level, as in envoyproxy/ratelimit.
    pub fn insert(&mut self, path: &[EntryPattern], rule: Option<Arc<Rule>>) -> Result<(), DuplicatePattern> {
        let mut level = &mut self.root;
        let Some((last, parents)) = path.split_last() else {
            return Ok(());
        };
        for entry in parents {
            level = &mut level.node_mut(entry).children;
        }
        let node = level.node_mut(last);
        if rule.is_some() {
            if node.rule.is_some() {
                return Err(DuplicatePattern);
            }
            node.rule = rule;
        }
        Ok(())
    }

    /// The rule for a request descriptor, if any.
    #[cfg_attr(
        not(test),
        deny(
            clippy::indexing_slicing,
            clippy::unwrap_used,
            clippy::expect_used,
            clippy::arithmetic_side_effects
        )
    )]
    pub fn lookup<K: AsRef<str>, V: AsRef<str>>(
        &self,
        entries: impl IntoIterator<Item = (K, V)>,
    ) -> Option<&Arc<Rule>> {
        let mut level = &self.root;
        let mut found: Option<&Node> = None;
        for (key, value) in entries {
            if let Some(node) = found {
                level = &node.children;
            }
            found = Some(level.find(key.as_ref(), value.as_ref())?);
        }
        found.and_then(|n| n.rule.as_ref())
    }
}

impl Level {
    fn node_mut(&mut self, entry: &EntryPattern) -> &mut Node {
        let key = entry.key.clone();
        match &entry.value {
            ValuePattern::Any => self.any.entry(key).or_default(),
            ValuePattern::Exact(v) => self.exact.entry((key, v.clone())).or_default(),
            ValuePattern::Prefix(p) => {
                let i = match self.prefix.iter().position(|(k, q, _)| *k == key && q == p) {
                    Some(i) => i,
                    None => {
                        self.prefix.push((key, p.clone(), Node::default()));
                        // Longest prefix first, so the most specific wins.
                        self.prefix.sort_by_key(|p| std::cmp::Reverse(p.1.len()));
                        self.prefix
                            .iter()
                            .position(|(k, q, _)| *k == entry.key && q == p)
                            .unwrap_or(0)
                    }
                };
                &mut self.prefix[i].2
            }
        }
    }

    fn find(&self, key: &str, value: &str) -> Option<&Node> {
        // Avoids allocating for the common exact-miss case only when the map is empty.
        if !self.exact.is_empty()
            && let Some(n) = self.exact.get(&(key.to_string(), value.to_string()))
        {
            return Some(n);
        }
        self.prefix
            .iter()
            .find(|(k, p, _)| k == key && value.starts_with(p.as_str()))
            .map(|(_, _, n)| n)
            .or_else(|| self.any.get(key))
    }
}
