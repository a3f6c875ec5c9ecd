//! Counter keys: the same for every surface and both stores.
//!
//! `tg:2{<domain><first value>}<rule><other values>`, each part
//! length-prefixed so caller-controlled values can never collide with each
//! other, a rule or another domain, and long values hashed to bound keys.

use std::fmt::Write;

use sha2::{Digest, Sha256};

/// Values longer than this are stored as a hash.
const MAX_VALUE_LEN: usize = 64;

/// A `by` value as the caller sent it: text, or bytes that are not UTF-8.
/// Bytes are never turned into text (a lossy conversion would give `\x80`,
/// `\xFF` and U+FFFD one counter, so one caller could spend another's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// UTF-8 text.
    Text(String),
    /// Anything else.
    Bytes(Vec<u8>),
}

impl Value {
    /// Text when `bytes` are UTF-8, else the bytes themselves.
    pub fn from_bytes(bytes: Vec<u8>) -> Value {
        match String::from_utf8(bytes) {
            Ok(text) => Value::Text(text),
            Err(e) => Value::Bytes(e.into_bytes()),
        }
    }

    /// Whether nothing was sent (a rule then counts nothing, as NGINX skips
    /// an empty key).
    pub fn is_empty(&self) -> bool {
        match self {
            Value::Text(t) => t.is_empty(),
            Value::Bytes(b) => b.is_empty(),
        }
    }

    fn push(&self, key: &mut String) {
        match self {
            Value::Text(t) => push_component(key, t),
            // `<len>~<sha256>`: the `~` keeps bytes apart from any text.
            Value::Bytes(b) => push_digest(key, b, '~'),
        }
    }
}

/// The counter of an HTTP rule (`rule_id`) for the request's `by` values.
pub fn http_key(domain: &str, rule_id: &str, values: &[Value]) -> String {
    // The first value is in the hash tag already; the body carries the rest.
    let Some((first, rest)) = values.split_first() else {
        return global_key(domain, rule_id);
    };
    let mut key = key_start(domain, |k| first.push(k), rule_id);
    for value in rest {
        value.push(&mut key);
    }
    key
}

/// `tg:2{<domain><first value>}<rule>`: the braces are a Redis Cluster hash
/// tag, so counters of one domain keyed first on the same value (say the
/// client address) share a slot and are decided in one atomic call. A `}`
/// inside a value only shortens the tag; the key itself stays unique. The
/// `2` is the key layout: counters of the first layout (`tg:{`, the first
/// value written twice, streams only) are never read as ones of this one.
fn key_start(domain: &str, first: impl FnOnce(&mut String), rule_id: &str) -> String {
    let mut key = String::with_capacity(64);
    key.push_str("tg:2{");
    push_component(&mut key, domain);
    first(&mut key);
    key.push('}');
    push_component(&mut key, rule_id);
    key
}

/// The counter of an Envoy descriptor matched to rule `rule_id`: the request's own
/// values, so a bare `key` or a `value*` pattern counts each value apart.
/// The first entry's value is in the hash tag; the body keeps its key.
pub fn descriptor_key<'a>(domain: &str, rule_id: &str, entries: impl IntoIterator<Item = (&'a str, &'a str)>) -> String {
    let mut entries = entries.into_iter();
    let Some((k1, v1)) = entries.next() else {
        return global_key(domain, rule_id);
    };
    let mut key = key_start(domain, |k| push_component(k, v1), rule_id);
    push_component(&mut key, k1);
    for (k, v) in entries {
        push_component(&mut key, k);
        push_component(&mut key, v);
    }
    key
}

/// The one counter of a rule keyed on nothing: tagged by the rule, so the
/// global rules of a domain spread over Cluster slots, and ended by an empty
/// component no caller's value can be (empty values count nothing), so it
/// is never the counter of a value equal to the rule's name.
fn global_key(domain: &str, rule_id: &str) -> String {
    let mut key = key_start(domain, |k| push_component(k, rule_id), rule_id);
    push_component(&mut key, "");
    key
}

/// Appends `<len>=<value>` (or `<len>#<sha256>` for long values) and a
/// separator, so no value can be mistaken for another or for a boundary.
fn push_component(key: &mut String, value: &str) {
    if value.len() <= MAX_VALUE_LEN {
        // On every request: push_str, not the formatting machinery.
        key.push_str(itoa::Buffer::new().format(value.len()));
        key.push('=');
        key.push_str(value);
        key.push('|');
    } else {
        push_digest(key, value.as_bytes(), '#');
    }
}

/// Appends `<len><mark><first 16 bytes of SHA-256, hex>|`.
fn push_digest(key: &mut String, value: &[u8], mark: char) {
    let digest = Sha256::digest(value);
    let _ = write!(key, "{}{mark}", value.len());
    for byte in digest.iter().take(16) {
        let _ = write!(key, "{byte:02x}");
    }
    key.push('|');
}

/// A counter key read back for people: its domain and the values that name
/// it (a hashed value as `sha256:<hex>…`). `None` for a key of another layout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyParts {
    /// The domain (limits file) the counter belongs to.
    pub domain: String,
    /// The rule's id.
    pub rule_id: String,
    /// The values after the domain, in order, the rule's id left out (for
    /// a descriptor: the first value, then keys and values alternating).
    pub values: Vec<KeyValue>,
}

/// One value of a counter key, read back.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[serde(untagged)]
pub enum KeyValue {
    /// Kept as sent.
    Text(String),
    /// Stored as a hash: longer than 64 bytes, or not UTF-8.
    Hashed {
        /// The first 16 bytes of its SHA-256, hex.
        sha256: String,
        /// Its length in bytes.
        bytes: usize,
        /// Whether it was UTF-8 text.
        text: bool,
    },
}

impl KeyValue {
    /// The value as text, a hashed one as `sha256:<hex>… (N bytes)`.
    pub fn display(&self) -> String {
        match self {
            KeyValue::Text(t) => t.clone(),
            KeyValue::Hashed { sha256, bytes, .. } => format!("sha256:{sha256}… ({bytes} bytes)"),
        }
    }
}

/// Reads `key` back into its parts (see [`KeyParts`]).
pub fn describe(key: &str) -> Option<KeyParts> {
    let rest = key.strip_prefix("tg:2{")?;
    let (domain, rest) = text_component(rest)?;
    let (first, rest) = component(rest)?;
    let rest = rest.strip_prefix('}')?;
    let (rule_id, mut rest) = text_component(rest)?;
    let mut values = vec![first];
    while !rest.is_empty() {
        let (value, after) = component(rest)?;
        values.push(value);
        rest = after;
    }
    // A global counter carries the rule's id as its tag and an empty end.
    if values.len() == 2
        && values.first() == Some(&KeyValue::Text(rule_id.clone()))
        && values.get(1) == Some(&KeyValue::Text(String::new()))
    {
        values.clear();
    }
    Some(KeyParts {
        domain,
        rule_id,
        values,
    })
}

/// A component that names (a domain, a rule id): never hashed here.
fn text_component(s: &str) -> Option<(String, &str)> {
    match component(s)? {
        (KeyValue::Text(t), rest) => Some((t, rest)),
        (hashed, rest) => Some((hashed.display(), rest)),
    }
}

/// One `<len>=<value>|` (or a digest) off the front of `s`, and the rest.
fn component(s: &str) -> Option<(KeyValue, &str)> {
    let mark = s.find(['=', '#', '~'])?;
    let len: usize = s.get(..mark)?.parse().ok()?;
    let after = s.get(mark.checked_add(1)?..)?;
    let kind = *s.as_bytes().get(mark)?;
    if kind == b'=' {
        let value = after.get(..len)?;
        let rest = after.get(len..)?.strip_prefix('|')?;
        return Some((KeyValue::Text(value.to_owned()), rest));
    }
    let (hex, rest) = after.split_once('|')?;
    let hashed = KeyValue::Hashed {
        sha256: hex.to_owned(),
        bytes: len,
        text: kind == b'#',
    };
    Some((hashed, rest))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_read_back_into_their_values() {
        let t = |s: &str| Value::Text(s.to_string());
        let k = http_key("api", "per-client", &[t("203.0.113.9"), t("a|1=b}")]);
        let parts = describe(&k).unwrap();
        assert_eq!(parts.domain, "api");
        assert_eq!(parts.rule_id, "per-client");
        let text = |v: &[KeyValue]| v.iter().map(KeyValue::display).collect::<Vec<_>>();
        assert_eq!(text(&parts.values), ["203.0.113.9", "a|1=b}"]);
        let global = describe(&http_key("api", "all", &[])).unwrap();
        assert!(global.values.is_empty(), "{global:?}");
        let d = describe(&descriptor_key("edge", "r", [("remote_address", "10.0.0.1"), ("path", "/x")])).unwrap();
        assert_eq!(text(&d.values), ["10.0.0.1", "remote_address", "path", "/x"]);
        let long = describe(&http_key("api", "r", &[t(&"x".repeat(100))])).unwrap();
        assert!(matches!(long.values[0], KeyValue::Hashed { bytes: 100, text: true, .. }), "{long:?}");
        let bytes = describe(&http_key("api", "r", &[Value::Bytes(vec![0xFF])])).unwrap();
        assert!(matches!(bytes.values[0], KeyValue::Hashed { bytes: 1, text: false, .. }), "{bytes:?}");
        // Text that looks like a hash is text.
        let posing = describe(&http_key("api", "r", &[t("sha256:00… (1 bytes)")])).unwrap();
        assert!(matches!(posing.values[0], KeyValue::Text(_)));
        for bad in ["", "tg:{3=api|}", "tg:2{3=ap", "tg:2{99=api|", "tg:2{3=api|1=a|}x"] {
            assert_eq!(describe(bad), None, "{bad}");
        }
    }

    #[test]
    fn values_cannot_collide_or_grow_keys() {
        let mut a = String::new();
        push_component(&mut a, "a|1=b");
        let mut b = String::new();
        push_component(&mut b, "a");
        push_component(&mut b, "b");
        assert_ne!(a, b);
        let long = "x".repeat(10_000);
        let mut k = String::new();
        push_component(&mut k, &long);
        assert!(k.len() < 50, "{k}");
        let mut fake = String::new();
        push_component(&mut fake, &k[..k.len() - 1]);
        assert_ne!(fake, k, "a literal value cannot pose as a hashed one");
    }

    #[test]
    fn every_way_of_naming_a_counter_is_its_own_key() {
        let t = |s: &str| Value::Text(s.to_string());
        let keys = [
            http_key("d", "r", &[]),
            http_key("d", "r", &[t("r")]),
            http_key("d", "r", &[t("a")]),
            http_key("d", "r", &[t("a"), t("b")]),
            http_key("d", "r", &[t("a|1=b")]),
            http_key("d", "r", &[t("\u{FFFD}")]),
            http_key("d", "r", &[Value::Bytes(vec![0x80])]),
            http_key("d", "r", &[Value::Bytes(vec![0xFF])]),
            http_key("d", "r2", &[t("a")]),
            http_key("d2", "r", &[t("a")]),
            descriptor_key("d", "r", [("k", "a")]),
            descriptor_key("d", "r", [("k2", "a")]),
            descriptor_key("d", "r", [("k", "a"), ("k", "b")]),
            descriptor_key("d", "r", [("k", "b"), ("k", "a")]),
        ];
        for (i, a) in keys.iter().enumerate() {
            for b in keys.iter().skip(i + 1) {
                assert_ne!(a, b);
            }
        }
        // A rule keyed on nothing and a descriptor with no entries are the
        // same global counter of the rule.
        assert_eq!(keys[0], descriptor_key("d", "r", []));
    }
}
