//! Request paths as the upstream will understand them.
//!
//! Rules match the normalised path, and the proxy forwards that same path,
//! so `/login`, `//login`, `/./login`, `/log%69n` and `/api/../login` are one
//! path for the limits and for the upstream alike. Normalising follows RFC
//! 3986 §6.2.2 (percent-decoding of unreserved characters, upper-case hex,
//! dot-segment removal) plus merging repeated slashes, as NGINX does. An
//! encoded slash (`%2F`) stays encoded: decoding it would change segments.

use std::borrow::Cow;

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
    let bytes = path.as_bytes();
    let mut out = String::with_capacity(path.len() + 1);
    if !path.starts_with('/') {
        out.push('/');
    }
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%'
            && i + 2 < bytes.len()
            && let (Some(h), Some(l)) = (hex(bytes[i + 1]), hex(bytes[i + 2]))
        {
            let c = (h << 4 | l) as char;
            if c.is_ascii_alphanumeric() || "-._~".contains(c) {
                out.push(c);
            } else {
                out.push('%');
                out.push(bytes[i + 1].to_ascii_uppercase() as char);
                out.push(bytes[i + 2].to_ascii_uppercase() as char);
            }
            i += 3;
            continue;
        }
        // Multi-byte UTF-8 is copied whole; it is not split at a byte boundary.
        let ch_len = path[i..].chars().next().map_or(1, char::len_utf8);
        out.push_str(&path[i..i + ch_len]);
        i += ch_len;
    }
    out
}

fn hex(b: u8) -> Option<u8> {
    (b as char).to_digit(16).map(|d| d as u8)
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
    fn normal_paths_are_borrowed() {
        assert!(matches!(normalize("/api/v1/users"), std::borrow::Cow::Borrowed(_)));
    }
}
