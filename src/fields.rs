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
/// [`Lines::new`] takes the fields of a head httparse read, and holds them
/// as a map would: names in lower case (HTTP names are case-insensitive; a
/// map keeps them so), and no name repeated apart (`a`, `b`, `a`: a map
/// gives a name's values together, so its order would not be the lines').
/// httparse admits exactly the names and values `http` does (tests pin
/// it), so a head either reads into both or into neither.
#[derive(Debug, Clone)]
pub struct Lines {
    head: Bytes,
    /// Name start, name end, value start, value end, per field.
    spans: Vec<[u32; 4]>,
}

/// `http`'s bound on a name's length (httparse has none).
const MAX_NAME: usize = 1 << 16;

impl Lines {
    /// The fields httparse read in `head` at `spans` (each within it): the
    /// head back when a name is too long for a map or repeated apart (it
    /// is then read into a map instead). Names are put in lower case in
    /// place.
    pub fn new(mut head: BytesMut, spans: Vec<[u32; 4]>) -> Result<Lines, BytesMut> {
        for &[a, b, c, d] in &spans {
            let (a, b) = (a as usize, b as usize);
            let fits = a < b && b.saturating_sub(a) < MAX_NAME && b <= c as usize && c <= d && d as usize <= head.len();
            match head.get_mut(a..b) {
                Some(name) if fits => name.make_ascii_lowercase(),
                _ => return Err(head),
            }
        }
        let lines = Lines { head: head.freeze(), spans };
        if lines.repeats_apart() {
            return Err(BytesMut::from(lines.head));
        }
        Ok(lines)
    }

    /// The head the lines are in.
    pub fn head(&self) -> &Bytes {
        &self.head
    }

    /// The head the lines were in, given back.
    pub fn into_head(self) -> Bytes {
        self.head
    }

    /// Whether some name comes, then another, then it again.
    fn repeats_apart(&self) -> bool {
        let same = |a: &[u32; 4], b: &[u32; 4]| {
            a[1].wrapping_sub(a[0]) == b[1].wrapping_sub(b[0]) && self.name_at(a) == self.name_at(b)
        };
        self.spans.iter().enumerate().any(|(i, span)| match self.spans.get(..i).and_then(<[_]>::split_last) {
            Some((last, earlier)) => !same(last, span) && earlier.iter().any(|s| same(s, span)),
            None => false,
        })
    }

    fn name_at(&self, &[start, end, _, _]: &[u32; 4]) -> &[u8] {
        self.head.get(start as usize..end as usize).unwrap_or_default()
    }

    fn value_at(&self, &[_, _, start, end]: &[u32; 4]) -> &[u8] {
        self.head.get(start as usize..end as usize).unwrap_or_default()
    }

    /// Lines over `fields` laid out as a head, read as our own server
    /// reads one (for tests): the head back when httparse refuses it.
    #[cfg(test)]
    pub(crate) fn laid_out<'f>(fields: impl Iterator<Item = (&'f [u8], &'f [u8])>) -> Result<Lines, BytesMut> {
        let mut head = b"GET / HTTP/1.1\r\n".to_vec();
        for (name, value) in fields {
            head.extend_from_slice(name);
            head.extend_from_slice(b": ");
            head.extend_from_slice(value);
            head.extend_from_slice(b"\r\n");
        }
        head.extend_from_slice(b"\r\n");
        let mut storage = [httparse::EMPTY_HEADER; 64];
        let mut req = httparse::Request::new(&mut storage);
        if !matches!(req.parse(&head), Ok(httparse::Status::Complete(_))) {
            return Err(BytesMut::from(&head[..]));
        }
        let at = |s: &[u8]| u32::try_from((s.as_ptr() as usize).wrapping_sub(head.as_ptr() as usize)).unwrap_or(u32::MAX);
        let len = |s: &[u8]| u32::try_from(s.len()).unwrap_or(u32::MAX);
        let spans = req
            .headers
            .iter()
            .map(|h| {
                let (n, v) = (h.name.as_bytes(), h.value);
                [at(n), at(n).saturating_add(len(n)), at(v), at(v).saturating_add(len(v))]
            })
            .collect();
        Lines::new(BytesMut::from(&head[..]), spans)
    }

    /// The fields in a map, for a way that takes one. Lines always read
    /// into one (httparse admits what `http` does: the tests pin it, and
    /// [`Lines::new`] keeps names to `http`'s bound).
    pub fn to_map(&self) -> HeaderMap {
        map_of(&self.head, &self.spans).unwrap_or_default()
    }
}

/// A map of the fields at `spans` in `head`, sharing its bytes: `None` when
/// a span lies outside it or holds a name or value a map refuses. Room is
/// left for the forwarding fields the proxy adds (`X-Forwarded-For`,
/// `-Proto`, `-Host`, `Host`): a map made only as large as the head grew
/// rehashed every field on each proxied request (BENCHMARKS.md §57).
pub fn map_of(head: &Bytes, spans: &[[u32; 4]]) -> Option<HeaderMap> {
    let mut map = HeaderMap::with_capacity(spans.len().saturating_add(4));
    for &[name_start, name_end, value_start, value_end] in spans {
        let name = HeaderName::from_bytes(head.get(name_start as usize..name_end as usize)?).ok()?;
        let value = head.get(value_start as usize..value_end as usize)?;
        map.append(name, HeaderValue::from_maybe_shared(head.slice_ref(value)).ok()?);
    }
    Some(map)
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
    /// one after another. Names are bytes: a check that they are text on
    /// every read cost more than the map did.
    pub fn iter(self) -> Iter<'a> {
        match self {
            Fields::Map(map) => Iter::Map(map.iter()),
            Fields::Lines(lines) => Iter::Lines { lines, spans: lines.spans.iter() },
        }
    }

    /// Each name once, in order.
    pub fn names(self) -> impl Iterator<Item = &'a [u8]> {
        let mut previous: Option<&[u8]> = None;
        self.iter().filter_map(move |(name, _)| {
            let fresh = previous != Some(name);
            previous = Some(name);
            fresh.then_some(name)
        })
    }

    /// The bytes the fields take as HTTP/1 lines (`name: value\r\n`), as
    /// hyper's bound counts them.
    pub fn head_bytes(self) -> usize {
        match self {
            Fields::Map(map) => map
                .iter()
                .map(|(name, value)| name.as_str().len().saturating_add(value.len()).saturating_add(4))
                .fold(0, usize::saturating_add),
            Fields::Lines(lines) => lines
                .spans
                .iter()
                .map(|&[a, b, c, d]| b.saturating_sub(a).saturating_add(d.saturating_sub(c)).saturating_add(4) as usize)
                .fold(0, usize::saturating_add),
        }
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
                // Lengths first: most names differ in theirs.
                let len = name.len();
                spans
                    .find(|s| s[1].wrapping_sub(s[0]) as usize == len && lines.name_at(s) == *name)
                    .map(|s| lines.value_at(s))
            }
        }
    }
}

/// Every field of [`Fields`]: its name (lower case) and value, as bytes.
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
    type Item = (&'a [u8], &'a [u8]);

    fn next(&mut self) -> Option<(&'a [u8], &'a [u8])> {
        match self {
            Iter::Map(fields) => fields.next().map(|(n, v)| (n.as_str().as_bytes(), v.as_bytes())),
            Iter::Lines { lines, spans } => {
                let lines: &'a Lines = lines;
                spans.next().map(|s| (lines.name_at(s), lines.value_at(s)))
            }
        }
    }
}

/// A value as text, as [`HeaderValue::to_str`] gives it: only when every
/// byte is visible ASCII or a tab.
pub fn text(value: &[u8]) -> Option<&str> {
    match value.iter().all(|b| *b == b'\t' || (0x20..0x7f).contains(b)) {
        true => std::str::from_utf8(value).ok(),
        false => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pairs(fields: Fields<'_>) -> Vec<(Vec<u8>, Vec<u8>)> {
        fields.iter().map(|(n, v)| (n.to_vec(), v.to_vec())).collect()
    }

    /// Whether httparse reads a head with this one field whole.
    fn httparse_takes(name: &[u8], value: &[u8]) -> bool {
        let head = [&b"GET / HTTP/1.1\r\n"[..], name, b": ", value, b"\r\n\r\n"].concat();
        let mut storage = [httparse::EMPTY_HEADER; 4];
        matches!(httparse::Request::new(&mut storage).parse(&head), Ok(httparse::Status::Complete(_)))
    }

    #[test]
    fn a_name_byte_is_one_http_takes_if_httparse_takes_it() {
        // A line's end ends the head there: not a name's byte either way.
        for b in (0..=255u8).filter(|b| *b != b'\r' && *b != b'\n') {
            assert_eq!(HeaderName::from_bytes(&[b]).is_ok(), httparse_takes(&[b], b"v"), "byte {b:#x}");
        }
    }

    #[test]
    fn a_value_byte_is_one_http_takes_if_httparse_takes_it() {
        for b in (0..=255u8).filter(|b| *b != b'\r' && *b != b'\n') {
            let value = [b'a', b, b'a'];
            assert_eq!(HeaderValue::from_bytes(&value).is_ok(), httparse_takes(b"x", &value), "byte {b:#x}");
        }
    }

    #[test]
    fn a_name_repeated_apart_or_too_long_for_a_map_is_read_into_one() {
        let lines = |fields: &[(&str, &str)]| Lines::laid_out(fields.iter().map(|(n, v)| (n.as_bytes(), v.as_bytes())));
        assert!(lines(&[("a", "1"), ("A", "2"), ("b", "3")]).is_ok());
        assert!(lines(&[("a", "1"), ("b", "2"), ("A", "3")]).is_err());
        let long = "n".repeat(MAX_NAME);
        assert!(lines(&[(&long, "1")]).is_err());
        assert!(HeaderName::from_bytes(long.as_bytes()).is_err());
        assert!(lines(&[(&long[1..], "1")]).is_ok());
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
        /// A head our own server reads gives as lines what it gave as a
        /// map (each field httparse read appended in order, as the map was
        /// built): the same fields, in the same order, for every name; one
        /// whose names come apart is not taken as lines.
        #[test]
        fn lines_read_as_the_map_of_the_same_head(fields in prop::collection::vec((name(), value()), 0..8)) {
            let head = [
                &b"GET / HTTP/1.1\r\n"[..],
                &fields.iter().flat_map(|(n, v)| [&n[..], b": ", &v[..], b"\r\n"].concat()).collect::<Vec<u8>>(),
                b"\r\n",
            ].concat();
            let mut storage = [httparse::EMPTY_HEADER; 16];
            let mut req = httparse::Request::new(&mut storage);
            let parsed = matches!(req.parse(&head), Ok(httparse::Status::Complete(_)));
            let read = Lines::laid_out(fields.iter().map(|(n, v)| (&n[..], &v[..])));
            if !parsed {
                prop_assert!(read.is_err());
                return Ok(());
            }
            let mut map = HeaderMap::new();
            for h in req.headers.iter() {
                // What httparse takes, a map takes.
                let name = HeaderName::from_bytes(h.name.as_bytes());
                let value = HeaderValue::from_bytes(h.value);
                prop_assert!(name.is_ok() && value.is_ok(), "{:?}: {:?}", h.name, h.value);
                map.append(name.unwrap(), value.unwrap());
            }
            let lower: Vec<Vec<u8>> = req.headers.iter().map(|h| h.name.to_ascii_lowercase().into_bytes()).collect();
            let apart = (1..lower.len()).any(|i| lower[i - 1] != lower[i] && lower[..i - 1].contains(&lower[i]));
            match read {
                Err(_) => prop_assert!(apart, "a head a map reads in order, refused as lines"),
                Ok(lines) => {
                    prop_assert!(!apart);
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
