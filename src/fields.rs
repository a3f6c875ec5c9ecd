//! A request's header fields as rules and the proxy read them: hyper's
//! [`HeaderMap`], or the lines of a head tollgate's own server read,
//! left where they lie in its bytes.
//!
//! Building a map costs a proxied GET ~8 % of its instructions (hashing,
//! inserting and dropping every field: BENCHMARKS.md §68), and the proxy
//! only writes most fields out again. So our own server hands the proxy
//! [`Lines`], and every reader (the rules, the client address, the host,
//! the forwarded head) goes through [`Fields`], which answers alike over
//! either: the same values for a name, in the same order.

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, HeaderName, HeaderValue};

/// A request's header fields, however they were read.
#[derive(Debug, Clone, Copy)]
pub enum Fields<'a> {
    /// hyper's map (HTTP/2, requests with bodies, other listeners).
    Map(&'a HeaderMap),
    /// The lines of a head our own HTTP/1.1 server read.
    Lines(&'a Lines),
}

/// A head's field lines: where each name and value lies in its bytes.
///
/// What [`Lines::new`] takes, it holds as a map would: names in lower case
/// (HTTP names are case-insensitive; a map keeps them so), every name one
/// `http` takes, and no name repeated apart (`a`, `b`, `a`: a map gives a
/// name's values together, so iterating it would not be the lines' order).
#[derive(Debug, Clone)]
pub struct Lines {
    head: Bytes,
    /// Name start, name end, value start, value end, per field.
    spans: Vec<[u32; 4]>,
}

/// Whether `b` may be in a field name: RFC 9110's `tchar`, the set httparse
/// reads a name with and `http` takes one in.
const fn is_tchar(b: u8) -> bool {
    matches!(b, b'0'..=b'9' | b'a'..=b'z' | b'A'..=b'Z' | b'!' | b'#' | b'$' | b'%' | b'&' | b'\'' | b'*' | b'+' | b'-' | b'.' | b'^' | b'_' | b'`' | b'|' | b'~')
}

/// Whether `b` may be in a field value as `http` takes one (what httparse
/// admits: tab, space, visible ASCII and obs-text).
const fn is_value_byte(b: u8) -> bool {
    (b >= 0x20 && b != 0x7f) || b == b'\t'
}

/// `http`'s bound on a name's length.
const MAX_NAME: usize = 1 << 16;

impl Lines {
    /// The fields of `head` at `spans` (each within it): `None` when a
    /// name is empty, too long or not a token, a value holds a byte a
    /// map refuses, or a name is repeated apart; the head is then read
    /// into a map instead. Names are put in lower case in place.
    pub fn new(mut head: BytesMut, spans: Vec<[u32; 4]>) -> Result<Lines, BytesMut> {
        let fits = |[a, b, c, d]: [u32; 4]| {
            let (a, b, c, d) = (a as usize, b as usize, c as usize, d as usize);
            a < b && b.saturating_sub(a) < MAX_NAME && b <= c && c <= d && d <= head.len()
        };
        if !spans.iter().all(|s| fits(*s)) {
            return Err(head);
        }
        for span in &spans {
            let [a, b, c, d] = span.map(|n| n as usize);
            let name_ok = head.get(a..b).is_some_and(|n| n.iter().all(|b| is_tchar(*b)));
            let value_ok = head.get(c..d).is_some_and(|v| v.iter().all(|b| is_value_byte(*b)));
            if !name_ok || !value_ok {
                return Err(head);
            }
            if let Some(name) = head.get_mut(a..b) {
                name.make_ascii_lowercase();
            }
        }
        let lines = Lines { head: head.freeze(), spans };
        if lines.repeats_apart() {
            return Err(BytesMut::from(lines.head));
        }
        Ok(lines)
    }

    /// Whether some name comes, then another, then it again.
    fn repeats_apart(&self) -> bool {
        self.spans.iter().enumerate().any(|(i, span)| {
            let name = self.name_at(span);
            match self.spans.get(..i).and_then(<[_]>::split_last) {
                Some((last, earlier)) => self.name_at(last) != name && earlier.iter().any(|s| self.name_at(s) == name),
                None => false,
            }
        })
    }

    fn name_at(&self, &[start, end, _, _]: &[u32; 4]) -> &[u8] {
        self.head.get(start as usize..end as usize).unwrap_or_default()
    }

    fn value_at(&self, &[_, _, start, end]: &[u32; 4]) -> &[u8] {
        self.head.get(start as usize..end as usize).unwrap_or_default()
    }

    /// A name as text (a token: ASCII).
    fn name_text(&self, span: &[u32; 4]) -> &str {
        std::str::from_utf8(self.name_at(span)).unwrap_or_default()
    }

    /// The fields in a map, for a way that takes one.
    pub fn to_map(&self) -> HeaderMap {
        let mut map = HeaderMap::with_capacity(self.spans.len().saturating_add(4));
        for span in &self.spans {
            let name = HeaderName::from_bytes(self.name_at(span));
            let value = HeaderValue::from_maybe_shared(self.head.slice_ref(self.value_at(span)));
            if let (Ok(name), Ok(value)) = (name, value) {
                map.append(name, value);
            }
        }
        map
    }
}

impl<'a> Fields<'a> {
    /// The values of `name`, in order.
    pub fn get_all<'n>(self, name: &'n HeaderName) -> Values<'a, 'n> {
        match self {
            Fields::Map(map) => Values::Map(map.get_all(name).iter()),
            Fields::Lines(lines) => Values::Lines {
                lines,
                spans: lines.spans.iter(),
                name: name.as_str().as_bytes(),
            },
        }
    }

    /// The first value of `name`.
    pub fn get(self, name: &HeaderName) -> Option<&'a [u8]> {
        self.get_all(name).next()
    }

    /// Whether any field is named `name`.
    pub fn contains(self, name: &HeaderName) -> bool {
        self.get(name).is_some()
    }

    /// How many fields (a name's every value counted).
    pub fn len(self) -> usize {
        match self {
            Fields::Map(map) => map.len(),
            Fields::Lines(lines) => lines.spans.len(),
        }
    }

    /// Whether there are none.
    pub fn is_empty(self) -> bool {
        self.len() == 0
    }

    /// Every field: its name (lower case) and value, a name's values
    /// one after another.
    pub fn iter(self) -> Iter<'a> {
        match self {
            Fields::Map(map) => Iter::Map(map.iter()),
            Fields::Lines(lines) => Iter::Lines { lines, spans: lines.spans.iter() },
        }
    }

    /// Each name once, in order.
    pub fn names(self) -> impl Iterator<Item = &'a str> {
        let mut previous: Option<&str> = None;
        self.iter().filter_map(move |(name, _)| {
            let fresh = previous != Some(name);
            previous = Some(name);
            fresh.then_some(name)
        })
    }

    /// The bytes the fields take as HTTP/1 lines (`name: value\r\n`), as
    /// hyper's bound counts them.
    pub fn head_bytes(self) -> usize {
        self.iter()
            .map(|(name, value)| name.len().saturating_add(value.len()).saturating_add(4))
            .fold(0, usize::saturating_add)
    }
}

/// The values of one name, in order.
pub enum Values<'a, 'n> {
    /// From a map.
    Map(http::header::ValueIter<'a, HeaderValue>),
    /// From lines.
    Lines {
        lines: &'a Lines,
        spans: std::slice::Iter<'a, [u32; 4]>,
        name: &'n [u8],
    },
}

impl<'a> Iterator for Values<'a, '_> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        match self {
            Values::Map(values) => values.next().map(HeaderValue::as_bytes),
            Values::Lines { lines, spans, name } => {
                let lines: &'a Lines = lines;
                spans.find(|s| lines.name_at(s) == *name).map(|s| lines.value_at(s))
            }
        }
    }
}

/// Every field of [`Fields`]: its name (lower case) and value.
pub enum Iter<'a> {
    /// From a map.
    Map(http::header::Iter<'a, HeaderValue>),
    /// From lines.
    Lines {
        lines: &'a Lines,
        spans: std::slice::Iter<'a, [u32; 4]>,
    },
}

impl<'a> Iterator for Iter<'a> {
    type Item = (&'a str, &'a [u8]);

    fn next(&mut self) -> Option<(&'a str, &'a [u8])> {
        match self {
            Iter::Map(fields) => fields.next().map(|(n, v)| (n.as_str(), v.as_bytes())),
            Iter::Lines { lines, spans } => {
                let lines: &'a Lines = lines;
                spans.next().map(|s| (lines.name_text(s), lines.value_at(s)))
            }
        }
    }
}

/// A value as text, as [`HeaderValue::to_str`] gives it: only when every
/// byte is visible ASCII or a tab.
pub fn text(value: &[u8]) -> Option<&str> {
    if value.iter().all(|b| *b == b'\t' || (0x20..0x7f).contains(b)) {
        std::str::from_utf8(value).ok()
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Lines over `fields`, laid out as a head is, with where each lies.
    fn lines_of(fields: &[(Vec<u8>, Vec<u8>)]) -> Result<Lines, BytesMut> {
        let mut head = b"GET / HTTP/1.1\r\n".to_vec();
        let mut spans = Vec::new();
        for (name, value) in fields {
            let at = |n: usize| u32::try_from(n).unwrap();
            let name_at = head.len();
            head.extend_from_slice(name);
            head.extend_from_slice(b": ");
            let value_at = head.len();
            head.extend_from_slice(value);
            head.extend_from_slice(b"\r\n");
            spans.push([at(name_at), at(name_at + name.len()), at(value_at), at(value_at + value.len())]);
        }
        head.extend_from_slice(b"\r\n");
        Lines::new(BytesMut::from(&head[..]), spans)
    }

    fn pairs(fields: Fields<'_>) -> Vec<(String, Vec<u8>)> {
        fields.iter().map(|(n, v)| (n.to_string(), v.to_vec())).collect()
    }

    #[test]
    fn a_name_byte_is_one_http_and_httparse_take() {
        for b in 0..=255u8 {
            let http = HeaderName::from_bytes(&[b]).is_ok();
            let head = [&b"GET / HTTP/1.1\r\n"[..], &[b], b": v\r\n\r\n"].concat();
            let mut storage = [httparse::EMPTY_HEADER; 4];
            let parsed = matches!(httparse::Request::new(&mut storage).parse(&head), Ok(httparse::Status::Complete(_)));
            assert_eq!(is_tchar(b), http, "byte {b:#x}: http");
            // A line's end ends the head there.
            if b != b'\r' && b != b'\n' {
                assert_eq!(is_tchar(b), parsed, "byte {b:#x}: httparse");
            }
        }
    }

    #[test]
    fn a_value_byte_is_one_http_and_httparse_take() {
        for b in 0..=255u8 {
            let http = HeaderValue::from_bytes(&[b'a', b, b'a']).is_ok();
            assert_eq!(is_value_byte(b), http, "byte {b:#x}: http");
            if b == b'\r' || b == b'\n' {
                continue;
            }
            let head = [&b"GET / HTTP/1.1\r\nx: a"[..], &[b], b"a\r\n\r\n"].concat();
            let mut storage = [httparse::EMPTY_HEADER; 4];
            let parsed = matches!(httparse::Request::new(&mut storage).parse(&head), Ok(httparse::Status::Complete(_)));
            assert_eq!(is_value_byte(b), parsed, "byte {b:#x}: httparse");
        }
    }

    #[test]
    fn a_name_repeated_apart_is_read_into_a_map() {
        let field = |n: &str, v: &str| (n.as_bytes().to_vec(), v.as_bytes().to_vec());
        assert!(lines_of(&[field("a", "1"), field("A", "2"), field("b", "3")]).is_ok());
        assert!(lines_of(&[field("a", "1"), field("b", "2"), field("A", "3")]).is_err());
        assert!(lines_of(&[field("a b", "1")]).is_err());
        assert!(lines_of(&[field("a", "1\u{7f}")]).is_err());
    }

    /// A name from a few a rule or the proxy reads, in any case, or now and
    /// then one a map refuses.
    fn name() -> impl Strategy<Value = Vec<u8>> {
        let pool = prop::sample::select(vec![
            "host", "cookie", "x-api-key", "x_api_key", "x-forwarded-for", "content-type", "te", "connection", "a", "b",
        ]);
        prop_oneof![
            20 => (pool, prop::collection::vec(any::<bool>(), 16)).prop_map(|(n, upper)| {
                n.bytes().zip(upper.into_iter().cycle()).map(|(b, u)| if u { b.to_ascii_uppercase() } else { b }).collect()
            }),
            1 => prop::collection::vec(any::<u8>(), 0..4),
        ]
    }

    fn value() -> impl Strategy<Value = Vec<u8>> {
        prop::collection::vec(prop_oneof![8 => 0x20u8..0x7f, 1 => Just(b'\t'), 1 => 0x80u8..=0xff, 1 => any::<u8>()], 0..10)
    }

    proptest! {
        /// Whatever lines are taken read as the map the same head makes
        /// (the map's way, every field appended in order); whatever a map
        /// refuses, or would give in another order, is not taken.
        #[test]
        fn lines_read_as_the_map_of_the_same_head(fields in prop::collection::vec((name(), value()), 0..8)) {
            let mut map = HeaderMap::new();
            let mut refused = false;
            for (n, v) in &fields {
                match (HeaderName::from_bytes(n), HeaderValue::from_bytes(v)) {
                    (Ok(n), Ok(v)) => { map.append(n, v); }
                    _ => refused = true,
                }
            }
            let lower: Vec<Vec<u8>> = fields.iter().map(|(n, _)| n.to_ascii_lowercase()).collect();
            let apart = (0..lower.len()).any(|i| (0..i.saturating_sub(1)).any(|j| lower[j] == lower[i]) && i > 0 && lower[i - 1] != lower[i]);
            match lines_of(&fields) {
                Err(_) => prop_assert!(refused || apart, "taken by a map in order, yet refused"),
                Ok(lines) => {
                    prop_assert!(!refused && !apart);
                    let (l, m) = (Fields::Lines(&lines), Fields::Map(&map));
                    prop_assert_eq!(pairs(l), pairs(m));
                    prop_assert_eq!(l.len(), m.len());
                    prop_assert_eq!(l.head_bytes(), m.head_bytes());
                    prop_assert_eq!(l.names().collect::<Vec<_>>(), m.names().collect::<Vec<_>>());
                    prop_assert_eq!(pairs(Fields::Map(&lines.to_map())), pairs(m));
                    for n in ["host", "cookie", "x-api-key", "x_api_key", "a", "b", "absent"] {
                        let n = HeaderName::from_static(n);
                        prop_assert_eq!(l.get_all(&n).collect::<Vec<_>>(), m.get_all(&n).collect::<Vec<_>>());
                        prop_assert_eq!(l.get(&n), m.get(&n));
                        prop_assert_eq!(l.contains(&n), m.contains(&n));
                    }
                }
            }
        }

        /// `text` is `HeaderValue::to_str`.
        #[test]
        fn text_is_what_a_header_value_gives(v in value()) {
            if let Ok(value) = HeaderValue::from_bytes(&v) {
                prop_assert_eq!(text(&v), value.to_str().ok());
            }
        }
    }
}
