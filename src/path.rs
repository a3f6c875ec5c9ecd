//! Request paths as the upstream will understand them.
//!
//! Rules match the normalised path, and the proxy forwards that same path,
//! so `/login`, `//login`, `/./login`, `/log%69n` and `/api/../login` are one
//! path for the limits and for the upstream alike. Normalising follows RFC
//! 3986 §6.2.2 (percent-decoding of unreserved characters, upper-case hex,
//! dot-segment removal) plus merging repeated slashes, as NGINX does. An
//! encoded slash (`%2F`) stays encoded: decoding it would change segments.
//!
//! Matching goes one step further than forwarding: NGINX, Tomcat, Express
//! and Rails decode every escape before routing, so `/caf%C3%A9` and a raw
//! `/café`, or `%7B` and a raw `{`, name one resource to them. The matching
//! form folds such spellings into one ([`fold_escapes`]), so none can dodge
//! a rule or buy a fresh `by: [path]` counter; the upstream still receives
//! the lighter RFC form.

use std::borrow::Cow;

/// Whether the path hides a segment boundary: an encoded slash or backslash
/// (`%2F`, `%5C`), a raw backslash, or an encoded NUL. Servers disagree on
/// what these mean (some decode `%2F` to `/`, Windows servers read `\` as
/// `/`), so no single reading can be matched safely; such requests are
/// refused, as Envoy's `path_with_escaped_slashes_action: REJECT_REQUEST`.
/// So is a dot segment with parameters (`/api/..;/orders`): Tomcat strips
/// the parameter and climbs out of `/api/`, NGINX and Express read a
/// segment named `..;` and route under it.
pub fn is_ambiguous(path: &str) -> bool {
    !is_plain(path) && is_ambiguous_full(path)
}

/// [`is_ambiguous`] without the shortcut.
fn is_ambiguous_full(path: &str) -> bool {
    if path.contains('\\') || has_dot_segment_with_params(path) {
        return true;
    }
    let bytes = path.as_bytes();
    bytes.windows(3).any(|w| {
        w.first() == Some(&b'%')
            && matches!(
                (
                    w.get(1).map(u8::to_ascii_uppercase),
                    w.get(2).map(u8::to_ascii_uppercase)
                ),
                (Some(b'2'), Some(b'F')) | (Some(b'5'), Some(b'C')) | (Some(b'0'), Some(b'0'))
            )
    })
}

/// `text` without regard to case, for `ignore_case` rules: Unicode
/// lower case (`/ÉCOLE` is `/école`, as case-insensitive routers that
/// read Unicode take it), borrowed when nothing changes.
pub fn fold_case(text: &str) -> Cow<'_, str> {
    if text.is_ascii() {
        if text.bytes().any(|b| b.is_ascii_uppercase()) {
            return Cow::Owned(text.to_ascii_lowercase());
        }
        return Cow::Borrowed(text);
    }
    let lower = text.to_lowercase();
    if lower == text { Cow::Borrowed(text) } else { Cow::Owned(lower) }
}

/// Whether a segment is `.` or `..` (escaped or not) followed by `;params`.
fn has_dot_segment_with_params(path: &str) -> bool {
    path.contains(';')
        && path.split('/').any(|segment| {
            let Some((head, _)) = segment.split_once(';') else {
                return false;
            };
            let dots = head.to_ascii_lowercase().replace("%2e", ".");
            dots == "." || dots == ".."
        })
}

/// The path rules are matched on: `;parameters` removed from every segment
/// before normalising (Tomcat and other servlet containers route
/// `/login;jsessionid=x` and `/api/..;/login` as `/login`), so a parameter
/// can neither dodge a rule nor hide a `..`.
pub fn matching_form(path: &str) -> Cow<'_, str> {
    match is_plain(path) {
        true => Cow::Borrowed(path),
        false => matching_form_full(path),
    }
}

/// [`matching_form`] without the shortcut.
fn matching_form_full(path: &str) -> Cow<'_, str> {
    let normal = if path.contains(';') {
        let stripped: String = path
            .split('/')
            .map(|segment| segment.split(';').next().unwrap_or(""))
            .collect::<Vec<_>>()
            .join("/");
        Cow::Owned(normalize_full(&stripped).into_owned())
    } else {
        normalize_full(path)
    };
    match fold_escapes(&normal) {
        Cow::Borrowed(_) => normal,
        Cow::Owned(folded) => Cow::Owned(folded),
    }
}

/// Whether a byte may stand unescaped in a request path as HTTP servers
/// accept it (RFC 3986 `pchar`, plus `"`, `{`, `}`, `|`, `[`, `]` and `^`
/// that clients such as curl send raw), other than the separators `/` and
/// `;` and the escape character `%` itself.
pub fn may_stand_raw(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b"!\"$&'()*+,-.:=@[]^_{|}~".contains(&b)
}

/// One spelling for every way of writing the same bytes: an escape is
/// decoded when its byte may stand raw ([`may_stand_raw`]) or belongs to a
/// UTF-8 character (`%C3%A9` is `é`), and kept, upper-case, when decoding
/// would change what the path says (`%25`, `%2F`, `%3B`, `%3F`, `%23`), the
/// byte cannot stand raw (space, controls, `<`, `>`), or the bytes are not
/// UTF-8. Decoding happens once, so `%2541` stays `%2541`, and folding a
/// folded path changes nothing.
pub fn fold_escapes(path: &str) -> Cow<'_, str> {
    if !path.contains('%') {
        return Cow::Borrowed(path);
    }
    let mut bytes: Vec<u8> = Vec::with_capacity(path.len());
    let mut rest = path.as_bytes();
    while let Some((&first, tail)) = rest.split_first() {
        let escaped = match (first, tail) {
            (b'%', [h, l, ..]) => hex(*h).zip(hex(*l)).map(|(h, l)| h << 4 | l),
            _ => None,
        };
        match escaped {
            Some(b) if may_stand_raw(b) || !b.is_ascii() => {
                bytes.push(b);
                rest = tail.get(2..).unwrap_or_default();
            }
            Some(b) => {
                push_escape(&mut bytes, b);
                rest = tail.get(2..).unwrap_or_default();
            }
            None => {
                bytes.push(first);
                rest = tail;
            }
        }
    }
    let mut out = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        out.push_str(chunk.valid());
        let mut escaped = Vec::with_capacity(chunk.invalid().len().saturating_mul(3));
        for &b in chunk.invalid() {
            push_escape(&mut escaped, b);
        }
        // Escapes are ASCII, so this is always valid UTF-8.
        out.push_str(std::str::from_utf8(&escaped).unwrap_or_default());
    }
    Cow::Owned(out)
}

fn push_escape(out: &mut Vec<u8>, b: u8) {
    const DIGITS: &[u8; 16] = b"0123456789ABCDEF";
    out.push(b'%');
    out.extend(
        [b >> 4, b & 0xF]
            .iter()
            .filter_map(|&d| DIGITS.get(usize::from(d)).copied()),
    );
}

/// The normalised form of an absolute request path (no query).
pub fn normalize(path: &str) -> Cow<'_, str> {
    match is_plain(path) {
        true => Cow::Borrowed(path),
        false => normalize_full(path),
    }
}

/// [`normalize`] without the shortcut.
fn normalize_full(path: &str) -> Cow<'_, str> {
    if is_normal(path) {
        return Cow::Borrowed(path);
    }
    let decoded = decode_unreserved(path);
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            s => segments.push(s),
        }
    }
    let mut out = String::with_capacity(decoded.len());
    for s in &segments {
        out.push('/');
        out.push_str(s);
    }
    // A trailing slash (or a last segment that was a dot) names a directory.
    let ends_as_dir = decoded.ends_with('/') || decoded.ends_with("/.") || decoded.ends_with("/..");
    if out.is_empty() || (ends_as_dir && !segments.is_empty()) {
        out.push('/');
    }
    Cow::Owned(out)
}

/// Whether `path` is plainly in every form already: rooted, with no
/// escape, parameter, backslash, empty segment or segment starting with a
/// dot. Most paths are; one pass over their bytes spares them the several
/// searches of [`is_ambiguous`], [`matching_form`] and [`normalize`] (each
/// returns `path` itself for such a path).
fn is_plain(path: &str) -> bool {
    let bytes = path.as_bytes();
    if bytes.first() != Some(&b'/') {
        return false;
    }
    let mut after_slash = false;
    for &b in bytes {
        if matches!(b, b'%' | b';' | b'\\') || (after_slash && matches!(b, b'/' | b'.')) {
            return false;
        }
        after_slash = b == b'/';
    }
    true
}

/// Whether `path` is already normal: cheap, so the common case allocates nothing.
fn is_normal(path: &str) -> bool {
    path.starts_with('/')
        && !path.contains('%')
        && !path.contains("//")
        && !path.split('/').any(|s| s == "." || s == "..")
}

/// Decodes `%XX` for unreserved characters and upper-cases the rest.
fn decode_unreserved(path: &str) -> String {
    let mut out = String::with_capacity(path.len().saturating_add(1));
    if !path.starts_with('/') {
        out.push('/');
    }
    let mut rest = path;
    while let Some(at) = rest.find('%') {
        let (before, escape) = rest.split_at(at);
        out.push_str(before);
        let digits = escape.as_bytes().get(1..3);
        match digits.map(|d| (d, d.first().copied().and_then(hex), d.last().copied().and_then(hex))) {
            Some((d, Some(h), Some(l))) => {
                let c = char::from(h << 4 | l);
                if c.is_ascii_alphanumeric() || "-._~".contains(c) {
                    out.push(c);
                } else {
                    out.push('%');
                    out.extend(d.iter().map(|b| char::from(b.to_ascii_uppercase())));
                }
                // Both digits are ASCII, so index 3 is a character boundary.
                rest = escape.get(3..).unwrap_or("");
            }
            _ => {
                out.push('%');
                rest = escape.get(1..).unwrap_or("");
            }
        }
    }
    out.push_str(rest);
    out
}

fn hex(b: u8) -> Option<u8> {
    char::from(b).to_digit(16).and_then(|d| u8::try_from(d).ok())
}

#[cfg(test)]
mod tests {
    use super::{is_ambiguous_full, is_plain, matching_form_full, normalize, normalize_full};

    #[test]
    fn every_spelling_of_login_is_login() {
        for spelling in [
            "/login",
            "//login",
            "/./login",
            "/log%69n",
            "/api/../login",
            "/%6C%6f%67in",
            "/a/b/../../login",
        ] {
            assert_eq!(normalize(spelling), "/login", "{spelling}");
        }
    }

    #[test]
    fn what_must_not_change() {
        assert_eq!(
            normalize("/a%2fb"),
            "/a%2Fb",
            "an encoded slash stays a byte of the segment"
        );
        assert_eq!(normalize("/a%20b"), "/a%20b");
        assert_eq!(normalize("/dir/"), "/dir/");
        assert_eq!(normalize("/dir/."), "/dir/");
        assert_eq!(normalize("/../../"), "/");
        assert_eq!(normalize("/"), "/");
        assert_eq!(normalize("/%zz"), "/%zz", "invalid escapes are left alone");
        assert_eq!(normalize("/caf\u{e9}//x"), "/caf\u{e9}/x");
        assert_eq!(normalize("/%"), "/%");
        assert_eq!(normalize("/Login"), "/Login", "case is kept; rules decide");
    }

    #[test]
    fn parameters_neither_dodge_nor_hide() {
        use super::matching_form;
        assert_eq!(matching_form("/login;jsessionid=x"), "/login");
        assert_eq!(matching_form("/a;x/b;y/"), "/a/b/");
        assert_eq!(matching_form("/plain"), "/plain");
    }

    #[test]
    fn hidden_separators_are_ambiguous() {
        use super::is_ambiguous;
        for p in [
            "/login%2F",
            "/a%2fb",
            "/a%5Cb",
            "/a\\b",
            "/a%00",
            "/api/..;/login",
            "/api/.;/login",
            "/api/%2e%2E;x/login",
            "/api/.%2e;/",
            "/..;",
        ] {
            assert!(is_ambiguous(p), "{p}");
        }
        for p in ["/login", "/a%20b", "/%2", "/%", "/login;x", "/a/...;x/b", "/a/;x/b", "/a..;/b"] {
            assert!(!is_ambiguous(p), "{p}");
        }
    }

    #[test]
    fn every_spelling_of_a_character_is_one_path_to_the_rules() {
        use super::matching_form;
        for (spellings, folded) in [
            (&["/caf\u{e9}", "/caf%C3%A9", "/caf%c3%a9", "/ca%66%C3%A9"][..], "/caf\u{e9}"),
            (&["/j/{x}", "/j/%7Bx%7D", "/j/%7bx%7d"], "/j/{x}"),
            (&["/a:b@c", "/a%3Ab%40c"], "/a:b@c"),
            (&["/a!*+b", "/a%21%2A%2bb"], "/a!*+b"),
            (&["/%22q%22", "/\"q\""], "/\"q\""),
        ] {
            for s in spellings {
                assert_eq!(matching_form(s), folded, "{s}");
            }
        }
    }

    #[test]
    fn escapes_that_would_change_the_path_stay_escapes() {
        use super::matching_form;
        for (path, folded) in [
            ("/a%25b", "/a%25b"),
            ("/a%2541", "/a%2541"),
            ("/a%3fb", "/a%3Fb"),
            ("/a%23b", "/a%23b"),
            ("/a%3bb", "/a%3Bb"),
            ("/a%20b", "/a%20b"),
            ("/a%3Cb%3e", "/a%3Cb%3E"),
            ("/a%0a", "/a%0A"),
            ("/a%FF", "/a%FF"),
            ("/a%e9", "/a%E9"),
            ("/a%C3", "/a%C3"),
            ("/a%C3\u{e9}", "/a%C3\u{e9}"),
            ("/a%E2%82", "/a%E2%82"),
            ("/a%4", "/a%4"),
            ("/a%zz", "/a%zz"),
        ] {
            assert_eq!(matching_form(path), folded, "{path}");
        }
    }

    proptest::proptest! {
        /// The one-pass shortcut says "nothing to do" only where the full
        /// readings agree: the same path back, and not ambiguous.
        #[test]
        fn a_plain_path_is_its_own_every_form(
            chars in proptest::collection::vec(
                proptest::prop_oneof![
                    6 => proptest::sample::select("aZ9-_~\u{e9}?#:".chars().collect::<Vec<_>>()),
                    3 => proptest::sample::select("/.".chars().collect::<Vec<_>>()),
                    1 => proptest::sample::select("%2F;\\".chars().collect::<Vec<_>>()),
                ],
                0..12,
            )
        ) {
            let path: String = std::iter::once('/').chain(chars).collect();
            if is_plain(&path) {
                proptest::prop_assert!(!is_ambiguous_full(&path), "{}", path);
                proptest::prop_assert_eq!(normalize_full(&path), path.as_str());
                proptest::prop_assert_eq!(matching_form_full(&path), path.as_str());
            }
        }
    }

    proptest::proptest! {
        /// Any spelling of any bytes, each byte raw where a path may carry it
        /// raw or escaped in either case, folds to the matching form of its
        /// plainest spelling; and folding the result again changes nothing.
        #[test]
        fn spellings_fold_to_one_form(
            bytes in proptest::collection::vec(
                proptest::prop_oneof![
                    proptest::sample::select(b"aZ09-._~!$&'()*+,:=@[]^{|}\"%;?# <>`".to_vec()),
                    proptest::num::u8::ANY,
                ],
                0..12,
            ),
            choices in proptest::collection::vec(0u8..3, 12),
        ) {
            use super::{fold_escapes, matching_form, may_stand_raw};
            let plain = spell(&bytes, &[0; 12]);
            let spelled = spell(&bytes, &choices);
            let want = matching_form(&plain).into_owned();
            proptest::prop_assert_eq!(matching_form(&spelled), want.as_str(), "{} vs {}", spelled, plain);
            proptest::prop_assert_eq!(fold_escapes(&want), want.as_str());
            proptest::prop_assert_eq!(matching_form(&want), want.as_str());
            fn spell(bytes: &[u8], choices: &[u8]) -> String {
                let mut out = String::from("/x/");
                // The bytes that are UTF-8 go raw when `choices` says so.
                let text = String::from_utf8_lossy(bytes);
                let lossless = text.as_bytes() == bytes;
                for (i, &b) in bytes.iter().enumerate() {
                    let choice = choices.get(i).copied().unwrap_or(0);
                    let raw_ok = may_stand_raw(b) || (!b.is_ascii() && lossless);
                    match choice {
                        0 if raw_ok && b.is_ascii() => out.push(char::from(b)),
                        1 => out.push_str(&format!("%{b:02x}")),
                        _ => out.push_str(&format!("%{b:02X}")),
                    }
                }
                // A whole valid text may also be written raw, characters at once.
                if lossless && choices.first() == Some(&0) && bytes.iter().all(|&b| may_stand_raw(b) || !b.is_ascii()) {
                    return format!("/x/{text}");
                }
                out
            }
        }
    }

    #[test]
    fn case_folds_beyond_ascii() {
        use super::fold_case;
        assert_eq!(fold_case("/\u{c9}COLE"), "/\u{e9}cole");
        assert_eq!(fold_case("/Login"), "/login");
        assert!(matches!(fold_case("/login"), std::borrow::Cow::Borrowed(_)));
        assert!(matches!(fold_case("/\u{e9}t\u{e9}"), std::borrow::Cow::Borrowed(_)));
    }

    #[test]
    fn normal_paths_are_borrowed() {
        assert!(matches!(normalize("/api/v1/users"), std::borrow::Cow::Borrowed(_)));
    }
}
