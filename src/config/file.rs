//! Reading a limits file (YAML or JSON; tollgate's format or
//! envoyproxy/ratelimit's) into validated [`Limits`]: size and shape checks
//! before any parsing, the format told apart, and every error as
//! `file:line: reason`. Each format's schema validates as it deserializes
//! ([`super::schema`], [`super::envoy`]).

use std::fmt;
use std::path::Path;

use super::Limits;
use super::schema::RawLimits;

/// Why a limits file was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    /// The file as named on the command line.
    pub file: String,
    /// 1-based line the problem is on, when the parser knows it.
    pub line: Option<usize>,
    /// What is wrong, in words.
    pub reason: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.line {
            Some(line) => write!(f, "{}:{}: {}", self.file, line, self.reason),
            None => write!(f, "{}: {}", self.file, self.reason),
        }
    }
}

impl std::error::Error for ConfigError {}

/// Reads the limits file, at most [`MAX_FILE_BYTES`] of it: a huge
/// file, or a link to `/dev/zero`, is refused without being read whole.
pub fn read_limits(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let limit = u64::try_from(MAX_FILE_BYTES).unwrap_or(u64::MAX);
    let mut bytes = Vec::new();
    // Opening a FIFO blocks until a writer comes, and a device never ends:
    // only regular files (links followed) are read.
    if !std::fs::metadata(path)?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    // Non-blocking: a file that says it is regular but blocks its reader
    // (`/proc/kmsg`) would hold the reload thread, and every later reload,
    // for good; it fails here instead. Real files ignore the flag.
    let mut open = std::fs::OpenOptions::new();
    open.read(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::custom_flags(&mut open, libc::O_NONBLOCK);
    open.open(path)?.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() > MAX_FILE_BYTES {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than {} MiB", MAX_FILE_BYTES >> 20),
        ));
    }
    String::from_utf8(bytes).map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"))
}

/// Validates limits from text; `file` names it in errors and picks the format
/// (`.json` is JSON, anything else YAML).
pub fn parse_str(text: &str, file: &str) -> Result<Limits, ConfigError> {
    // A byte-order mark (Windows Notepad, PowerShell's Out-File) is not
    // content: YAML 1.2 allows one, and the parser read it as the start of
    // a second document ("more than one document").
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    check_shape(text).map_err(|(line, reason)| ConfigError {
        file: file.to_string(),
        line,
        reason,
    })?;
    if looks_like_envoy(text, file) {
        let raw: super::envoy::EnvoyFile = deserialize(text, file)?;
        return raw.into_limits().map_err(|reason| ConfigError {
            file: file.to_string(),
            line: None,
            reason,
        });
    }
    let raw: RawLimits = deserialize(text, file)?;
    Ok(raw.into_limits())
}

/// Largest limits file read, in bytes.
pub const MAX_FILE_BYTES: usize = 8 << 20;
/// Deepest nesting of `[` / `{` a limits file may use; YAML and JSON parse
/// time grows with the square of it, and no real file needs more than a few.
const MAX_NESTING: usize = 64;
/// Widest indentation a line may have (block nesting is indentation).
const MAX_INDENT: usize = 256;

/// Refuses files whose size or nesting would make parsing slow, before any
/// parser sees them; returns the offending line and why.
fn check_shape(text: &str) -> Result<(), (Option<usize>, String)> {
    if text.len() > MAX_FILE_BYTES {
        return Err((None, format!("file is larger than {} MiB", MAX_FILE_BYTES >> 20)));
    }
    let mut depth = 0usize;
    for (i, line) in text.lines().enumerate() {
        let number = i.saturating_add(1);
        if line.len().saturating_sub(line.trim_start().len()) > MAX_INDENT {
            return Err((Some(number), format!("indented deeper than {MAX_INDENT} columns")));
        }
        let mut quote: Option<char> = None;
        let mut escaped = false;
        let mut previous = ' ';
        for c in line.chars() {
            match quote {
                Some('"') if escaped => escaped = false,
                Some('"') if c == '\\' => escaped = true,
                Some(q) if c == q => quote = None,
                Some(_) => {}
                None => match c {
                    '#' if previous.is_whitespace() => break,
                    '"' | '\'' => quote = Some(c),
                    '[' | '{' => {
                        depth = depth.saturating_add(1);
                        if depth > MAX_NESTING {
                            return Err((Some(number), format!("nested deeper than {MAX_NESTING} levels")));
                        }
                    }
                    ']' | '}' => depth = depth.saturating_sub(1),
                    _ => {}
                },
            }
            previous = c;
        }
    }
    Ok(())
}

/// Parses `text` as JSON (`.json`) or YAML into `T`, keeping the line of the
/// first problem.
pub(super) fn deserialize<T: serde::de::DeserializeOwned>(text: &str, file: &str) -> Result<T, ConfigError> {
    if file.ends_with(".json") {
        serde_json::from_str(text).map_err(|e| ConfigError {
            file: file.to_string(),
            line: (e.line() > 0).then_some(e.line()),
            reason: strip_position(&e.to_string(), " at line "),
        })
    } else {
        yaml_serde::from_str(text).map_err(|e| {
            let reason = strip_position(&e.to_string(), " at line ");
            let mut line = e.location().map(|l| l.line());
            // The YAML parser places a repeated key at its mapping's first
            // line; the operator looks for the repeat.
            if let (Some(at), Some(key)) = (line, repeated_key(&reason)) {
                line = repeat_of(text, at, key).or(line);
            }
            ConfigError {
                file: file.to_string(),
                line,
                reason,
            }
        })
    }
}

/// The key a "duplicate field `key`" error names (after any path prefix).
fn repeated_key(reason: &str) -> Option<&str> {
    let rest = &reason[reason.find("duplicate field `")? + "duplicate field `".len()..];
    rest.get(..rest.find('`')?)
}

/// A line's indentation, the column of its key (after any `- `), and the
/// text from that key on.
fn key_column(line: &str) -> (usize, usize, &str) {
    let body = line.trim_start();
    let indent = line.len() - body.len();
    let after_dash = body
        .strip_prefix('-')
        .filter(|r| r.starts_with(' '))
        .map(str::trim_start);
    let body = after_dash.unwrap_or(body);
    (indent, line.len() - body.len(), body)
}

/// The line of `key`'s second appearance among the keys of the block
/// mapping whose first key is on line `start` (1-based); `None` for a flow
/// mapping (`{...}`, one line) or when it is not found.
fn repeat_of(text: &str, start: usize, key: &str) -> Option<usize> {
    let mut lines = text.lines().enumerate().skip(start.checked_sub(1)?);
    let (_, first) = lines.next()?;
    let (_, column, body) = key_column(first);
    let names = |body: &str| {
        body.strip_prefix(key)
            .is_some_and(|rest| rest.trim_start().starts_with(':'))
    };
    let mut seen = names(body);
    for (i, line) in lines {
        let (indent, at, body) = key_column(line);
        if body.is_empty() || body.starts_with('#') {
            continue;
        }
        if indent < column {
            return None;
        }
        if at == column && names(body) {
            if seen {
                return Some(i + 1);
            }
            seen = true;
        }
    }
    None
}

/// An envoyproxy/ratelimit file is recognised by its shape: a top-level
/// `descriptors` key (even with nothing after it) and no `rules`.
fn looks_like_envoy(text: &str, file: &str) -> bool {
    type Shape = std::collections::HashMap<String, serde::de::IgnoredAny>;
    if file.ends_with(".json") {
        let shape: Option<Shape> = serde_json::from_str(text).ok();
        return shape.is_some_and(|s| s.contains_key("descriptors") && !s.contains_key("rules"));
    }
    // In block style (every file seen in practice), the top-level keys are
    // the lines that start with a key; reading them saves parsing a large
    // file twice. A file not written that way is parsed for its shape.
    let top = |key: &str| {
        text.lines().any(|l| {
            l.strip_prefix(key)
                .is_some_and(|rest| rest.trim_start().starts_with(':'))
        })
    };
    let (descriptors, rules) = (top("descriptors"), top("rules"));
    if descriptors || rules || text.lines().any(|l| l.starts_with("domain:")) {
        return descriptors && !rules;
    }
    let shape: Option<Shape> = yaml_serde::from_str(text).ok();
    shape.is_some_and(|s| s.contains_key("descriptors") && !s.contains_key("rules"))
}

/// Both parsers append "at line N column M"; the line is reported separately.
fn strip_position(message: &str, marker: &str) -> String {
    match message.rfind(marker) {
        Some(i) => message[..i].to_string(),
        None => message.to_string(),
    }
}

// Both formats' schemas are tested through here, as a file is read.
#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::schema::parse_period;
    use crate::config::{Cost, FailureMode, Part, PathPattern, Window};
    use http::{HeaderName, Method, StatusCode};

    const GOOD: &str = "\
domain: api   # comment
failure_mode: closed
rules:
  - name: login
    match: { methods: [post], path: /login }
    by: [client_ip]
    limits:
      - { requests: 20, per: 60s }
      - { requests: 5, per: 3s }
  - name: api
    match: { path: /api/* }
    by: [header:X-Api-Key, query:tenant]
    limits: [{ requests: 100, per: 90s }]
    shadow: true
    status: 503
    cost: header:X-Cost
    failure_mode: open
";

    #[test]
    fn parses_the_documented_shape() {
        let l = parse_str(GOOD, "limits.yaml").unwrap();
        assert_eq!(l.domain, "api");
        let login = &l.rules[0];
        assert_eq!(login.matcher.methods, vec![Method::POST]);
        assert_eq!(login.matcher.path, Some(PathPattern::Exact("/login".into())));
        // Windows are kept shortest first.
        assert_eq!(
            login.windows,
            vec![
                Window {
                    requests: 5,
                    period_ms: 3000,
                    precision_ms: 0,
                },
                Window {
                    requests: 20,
                    period_ms: 60_000,
                    precision_ms: 0,
                }
            ]
        );
        assert_eq!(login.failure_mode, FailureMode::Closed);
        let api = &l.rules[1];
        assert_eq!(
            api.by,
            vec![
                Part::Header(HeaderName::from_static("x-api-key")),
                Part::Query("tenant".into())
            ]
        );
        assert!(api.shadow);
        assert_eq!(api.status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(api.cost, Cost::Header(HeaderName::from_static("x-cost")));
        assert_eq!(api.failure_mode, FailureMode::Open);
        assert_eq!(api.windows[0].period_ms, 90_000);
    }

    #[test]
    fn a_byte_order_mark_is_not_content() {
        // Windows Notepad and PowerShell's Out-File write one; the parser
        // read it as a second document ("more than one document").
        let with_bom = format!("\u{feff}{GOOD}");
        assert_eq!(parse_str(&with_bom, "limits.yaml").unwrap().rules.len(), 2);
        let json = "\u{feff}{\"domain\":\"api\",\"rules\":[]}";
        assert_eq!(parse_str(json, "limits.json").unwrap().domain, "api");
    }

    #[test]
    fn a_file_that_blocks_its_reader_is_refused_not_waited_for() {
        // From the twelfth attack: /proc/kmsg says it is a regular file and
        // blocks read(); the reload thread, and every later reload, waited
        // on it for good. Only where this machine lets it be opened.
        if std::fs::File::open("/proc/kmsg").is_err() {
            eprintln!("/proc/kmsg cannot be opened here: nothing to show");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let link = dir.path().join("limits.yaml");
        std::os::unix::fs::symlink("/proc/kmsg", &link).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(read_limits(&link).map(|_| ()).map_err(|e| e.kind()));
        });
        let read = rx.recv_timeout(std::time::Duration::from_secs(5));
        assert!(matches!(read, Ok(Err(_))), "{read:?}");
    }

    #[test]
    fn json_uses_the_same_schema() {
        let json = r#"{"domain":"api","rules":[{"name":"a","limits":[{"requests":2,"per":"1s"}]}]}"#;
        let l = parse_str(json, "limits.json").unwrap();
        assert_eq!(
            l.rules[0].windows[0],
            Window {
                requests: 2,
                period_ms: 1000,
                precision_ms: 0,
            }
        );
        let err = parse_str("{\"domain\":\"api\",\n\"rulez\":[]}", "limits.json").unwrap_err();
        assert_eq!(err.line, Some(2));
        assert!(err.reason.contains("unknown field `rulez`"), "{err}");
    }

    fn error_of(yaml: &str) -> ConfigError {
        parse_str(yaml, "conf/limits.yaml").unwrap_err()
    }

    #[test]
    fn a_header_named_twice_in_a_match_is_refused() {
        for headers in ["{ x-tier: free, x-tier: \"*\" }", "{ x-tier: free, X-Tier: paid }"] {
            let text = format!(
                "domain: a\nrules:\n  - name: a\n    match:\n      headers: {headers}\n    limits: [{{ requests: 1, per: 1s }}]\n"
            );
            let err = error_of(&text);
            assert!(err.reason.contains("is named twice"), "{headers}: {err}");
        }
        let json = r#"{"domain": "a", "rules": [{"name": "a", "match": {"headers": {"x-a": "1", "X-A": "2"}}, "limits": [{"requests": 1, "per": "1s"}]}]}"#;
        let err = parse_str(json, "l.json").map(|_| ()).unwrap_err();
        assert!(err.reason.contains("is named twice"), "{err}");
    }

    #[test]
    fn a_repeated_key_is_placed_at_its_repeat() {
        let top = "domain: a\ndomain: b\nrules: []\n";
        assert_eq!(error_of(top).line, Some(2));
        let nested = "domain: a\nrules:\n  - name: a\n    limits: [{ requests: 1, per: 1s }]\n  - name: b\n    limits: [{ requests: 1, per: 1s }]\n    # a comment\n    match: { path: /x }\n    shadow: true\n\n    shadow: false\n  - name: c\n    shadow: true\n";
        let err = error_of(nested);
        assert!(err.reason.contains("duplicate field `shadow`"), "{err}");
        assert_eq!(err.line, Some(11), "{err}");
        // A flow mapping keeps its own line.
        let flow = "domain: a\nrules:\n  - name: a\n    limits: [{ requests: 1, per: 1s, per: 2s }]\n";
        assert_eq!(error_of(flow).line, Some(4));
    }

    #[test]
    fn errors_name_file_line_and_reason() {
        let dup = GOOD.replace("name: api", "name: login");
        let err = error_of(&dup);
        assert_eq!(err.line, Some(10), "{err}");
        assert!(err.to_string().starts_with("conf/limits.yaml:10: "), "{err}");
        assert!(err.reason.contains("duplicate rule name \"login\""), "{err}");

        let unknown = GOOD.replace("shadow: true", "shadw: true");
        let err = error_of(&unknown);
        assert_eq!(err.line, Some(14), "{err}");
        assert!(err.reason.contains("unknown field `shadw`"), "{err}");

        let zero = GOOD.replace("requests: 5,", "requests: 0,");
        let err = error_of(&zero);
        assert_eq!(err.line, Some(9), "{err}");
        assert!(err.reason.contains("requests must be at least 1"), "{err}");

        let negative = GOOD.replace("requests: 5,", "requests: -5,");
        assert_eq!(error_of(&negative).line, Some(9));

        let duration = GOOD.replace("per: 3s", "per: 3 fortnights");
        let err = error_of(&duration);
        assert_eq!(err.line, Some(9), "{err}");
        assert!(err.reason.contains("is not a duration"), "{err}");
        // Not humantime's list of units, which names months and years.
        assert!(err.reason.contains("unknown time unit \"fortnights\""), "{err}");
        assert!(!err.reason.contains("month"), "{err}");

        let bare_number = GOOD.replace("per: 3s", "per: 3");
        assert!(error_of(&bare_number).reason.contains("is not a duration"));
    }

    #[test]
    fn refuses_doubtful_rules() {
        for (from, to, why) in [
            ("by: [client_ip]", "by: [cookie]", "unknown by entry"),
            ("path: /login", "path: login", "must start with /"),
            ("path: /login", "path: /a*b", "only at the end"),
            ("status: 503", "status: 200", "not a 4xx or 5xx"),
            (
                "status: 503",
                "status: 503\n    grpc_status: 0",
                "not a gRPC error code",
            ),
            (
                "status: 503",
                "status: 503\n    grpc_status: 17",
                "not a gRPC error code",
            ),
            ("cost: header:X-Cost", "cost: 0", "at least 1"),
            ("cost: header:X-Cost", "cost: lots", "expected a number"),
            ("per: 60s", "per: 3s", "same period"),
            ("name: api", "name: \"a b\"", "may use only"),
            ("domain: api", "domain: \"\"", "domain must not be empty"),
            ("methods: [post]", "methods: [\"PO ST\"]", "not an HTTP method"),
        ] {
            assert!(GOOD.contains(from), "{from}");
            let err = error_of(&GOOD.replace(from, to));
            assert!(err.reason.contains(why), "{from} -> {to}: {err}");
            assert!(err.line.is_some(), "{err}");
        }
    }

    #[test]
    fn syntax_errors_and_truncated_files_are_refused() {
        let half = &GOOD[..GOOD.len() / 2];
        assert!(parse_str(half, "l.yaml").is_err());
        let err = error_of("domain: api\nrules:\n  - name: [unclosed\n");
        assert!(err.line.is_some(), "{err}");
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 512, ..Default::default() })]
        /// Fuzz: any text, or the good file with a slice replaced by noise,
        /// is an answer (limits or file:line: reason), never a panic.
        #[test]
        fn the_parser_never_panics(
            noise in "[ -~\\n\\t\\[\\]{}:,'\"#*-]{0,300}",
            cut in 0usize..2000,
            len in 0usize..200,
            json: bool,
        ) {
            let file = if json { "f.json" } else { "f.yaml" };
            let _ = parse_str(&noise, file);
            let start = cut.min(GOOD.len());
            let end = start.saturating_add(len).min(GOOD.len());
            if GOOD.is_char_boundary(start) && GOOD.is_char_boundary(end) {
                let mutated = format!("{}{}{}", &GOOD[..start], noise, &GOOD[end..]);
                let _ = parse_str(&mutated, file);
            }
            let envoy = "domain: e\ndescriptors:\n  - key: k\n    rate_limit: { unit: second, requests_per_unit: 5 }\n";
            let at = cut.min(envoy.len());
            let _ = parse_str(&format!("{}{}{}", &envoy[..at], noise, &envoy[at..]), file);
        }
    }

    #[test]
    fn deep_nesting_and_huge_files_are_refused_quickly() {
        let started = std::time::Instant::now();
        for text in ["[".repeat(100_000), format!("domain: {}", "{".repeat(20_000))] {
            let e = parse_str(&text, "deep.yaml").unwrap_err();
            assert!(e.to_string().contains("nested deeper than 64 levels"), "{e}");
        }
        let e = parse_str(&"#".repeat(9 << 20), "big.yaml").unwrap_err();
        assert!(e.to_string().contains("larger than 8 MiB"), "{e}");
        // Brackets inside strings and comments are text, not nesting.
        let quoted = format!("domain: \"{}\"  # {}\nrules: []\n", "[".repeat(100), "{".repeat(100));
        assert!(parse_str(&quoted, "q.yaml").is_ok());
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
    }

    #[test]
    fn numbers_past_the_cap_and_costs_past_the_limit_are_refused() {
        let e = error_of("domain: d\nrules:\n  - name: r\n    limits: [{ requests: 9007199254740993, per: 1s }]\n");
        assert!(e.to_string().contains("at most 1000000000000"), "{e}");
        let e = error_of(
            "domain: d\nrules:\n  - name: r\n    cost: 18446744073709551615\n    limits: [{ requests: 5, per: 1s }]\n",
        );
        assert!(e.to_string().contains("at most 1000000000000"), "{e}");
        let e = error_of(
            "domain: d\nrules:\n  - name: r\n    cost: 10\n    limits: [{ requests: 5, per: 1s }, { requests: 50, per: 1m }]\n",
        );
        assert!(e.to_string().contains("no request could ever be admitted"), "{e}");
        assert!(e.line.is_some(), "{e}");
    }

    #[test]
    fn rules_that_could_never_match_are_refused() {
        for (m, why) in [
            ("{ host: api.example.com:8080 }", "without a port"),
            ("{ path: /se;x }", "never reach a match"),
            ("{ path: '/qp?a=1' }", "never reach a match"),
            ("{ path: '/x%2Fy*' }", "never reach a match"),
        ] {
            let e = error_of(&format!(
                "domain: d\nrules:\n  - name: r\n    match: {m}\n    limits: [{{ requests: 1, per: 1s }}]\n"
            ));
            assert!(e.to_string().contains(why), "{m}: {e}");
        }
        let l = parse_str("domain: d\nrules:\n  - name: r\n    match: { host: API.example.com. }\n    limits: [{ requests: 1, per: 1s }]\n", "l.yaml").unwrap();
        assert_eq!(l.rules[0].matcher.host.as_deref(), Some("api.example.com"));
    }

    #[test]
    fn durations() {
        assert_eq!(parse_period("500ms"), Ok(500));
        assert_eq!(parse_period("1m"), Ok(60_000));
        assert_eq!(parse_period("1h"), Ok(3_600_000));
        assert_eq!(parse_period("1d"), Ok(86_400_000));
        assert!(parse_period("0s").is_err());
        assert!(parse_period("1us").is_err());
        assert!(parse_period("400d").is_err());
        // From the twelfth attack: `1M` was a month (30.44 days) where a
        // minute was meant, and `1y` 365.25 days.
        for text in ["1M", "2 months", "1y", "1year", "1h 1M", "1yr", "0.5yrs"] {
            let e = parse_period(text).unwrap_err();
            assert!(e.contains("not whole days"), "{text}: {e}");
        }
        assert_eq!(parse_period("1min"), Ok(60_000));
    }
}
