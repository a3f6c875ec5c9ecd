//! Request paths as the upstream will understand them.
//!
//! Rules match the normalised path, and the proxy forwards that same path,
//! so `/login`, `//login`, `/./login`, `/log%69n` and `/api/../login` are one
//! path for the limits and for the upstream alike. Normalising follows RFC
//! 3986 §6.2.2 (percent-decoding of unreserved characters, upper-case hex,
//! dot-segment removal) plus merging repeated slashes, as NGINX does. An
//! encoded slash (`%2F`) stays encoded: decoding it would change segments.

use std::borrow::Cow;

/// Whether the path hides a segment boundary: an encoded slash or backslash
/// (`%2F`, `%5C`), a raw backslash, or an encoded NUL. Servers disagree on
/// what these mean (some decode `%2F` to `/`, Windows servers read `\` as
/// `/`), so no single reading can be matched safely; such requests are
/// refused, as Envoy's `path_with_escaped_slashes_action: REJECT_REQUEST`.
pub fn is_ambiguous(path: &str) -> bool {
    if path.contains('\\') {
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

/// The path rules are matched on: `;parameters` removed from every segment
/// before normalising (Tomcat and other servlet containers route
/// `/login;jsessionid=x` and `/api/..;/login` as `/login`), so a parameter
/// can neither dodge a rule nor hide a `..`.
pub fn matching_form(path: &str) -> Cow<'_, str> {
    if !path.contains(';') {
        return normalize(path);
    }
    let stripped: String = path
        .split('/')
        .map(|segment| segment.split(';').next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("/");
    Cow::Owned(normalize(&stripped).into_owned())
}

/// The normalised form of an absolute request path (no query).
pub fn normalize(path: &str) -> Cow<'_, str> {
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
    use super::normalize;

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
        assert_eq!(matching_form("/api/..;/login"), "/login");
        assert_eq!(matching_form("/a;x/b;y/"), "/a/b/");
        assert_eq!(matching_form("/plain"), "/plain");
    }

    #[test]
    fn hidden_separators_are_ambiguous() {
        use super::is_ambiguous;
        for p in ["/login%2F", "/a%2fb", "/a%5Cb", "/a\\b", "/a%00"] {
            assert!(is_ambiguous(p), "{p}");
        }
        for p in ["/login", "/a%20b", "/%2", "/%"] {
            assert!(!is_ambiguous(p), "{p}");
        }
    }

    #[test]
    fn normal_paths_are_borrowed() {
        assert!(matches!(normalize("/api/v1/users"), std::borrow::Cow::Borrowed(_)));
    }
}
