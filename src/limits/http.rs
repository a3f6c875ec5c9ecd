//! From an HTTP request to the counters it touches.
//!
//! The proxy, ext_authz and auth_request surfaces describe a request as a
//! [`RequestInfo`]; [`hits`] finds the rules that match it and, per rule, the
//! `by` values that name its counter (see [`keys`]).

use std::net::IpAddr;

use http::Method;

use crate::fields::{Fields, text};
use percent_encoding::percent_decode;

use super::keys::{self, Value};
use crate::config::{Cost, Limits, Part, Rule};
use crate::limiter::Hit;

/// The parts of a request that rules look at.
#[derive(Debug, Clone, Copy)]
pub struct RequestInfo<'a> {
    /// The request method.
    pub method: &'a Method,
    /// The path, without the query.
    pub path: &'a str,
    /// The raw query string, if any.
    pub query: Option<&'a str>,
    /// The host the client asked for, as sent (may carry a port).
    pub host: Option<&'a str>,
    /// All request headers.
    pub headers: Fields<'a>,
    /// The client address, after trusted-proxy resolution.
    pub client_ip: IpAddr,
    /// The subject of the client's verified TLS certificate, if it sent one.
    pub client_cert: Option<&'a str>,
}

/// A request that cannot be decided as sent (answered 400).
///
/// Where a request says one thing twice, tollgate cannot know which of the
/// two the upstream will believe (frameworks differ: Express and Rails read
/// the first or the last of a repeated query parameter, PHP the last), and
/// counting either would let a caller pick a fresh counter. So it refuses.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RequestError {
    /// The header a rule takes its cost from is not a positive integer.
    #[error("header {header} must be one positive integer up to 10^12 (rule {rule})")]
    BadCost {
        /// The rule that reads the header.
        rule: String,
        /// The header name.
        header: String,
    },
    /// A value a rule keys on was sent more than once.
    #[error("{what} was sent more than once; rule {rule} counts by it, so send it once")]
    Repeated {
        /// The rule that reads the value.
        rule: String,
        /// `header NAME` or `query parameter NAME`.
        what: String,
    },
    /// More than one `Host` header (RFC 9112 §3.2).
    #[error("more than one Host header")]
    HostRepeated,
    /// A host with userinfo (`user@host`), which neither `:authority`
    /// (RFC 9113 §8.3.1) nor `Host` (RFC 9112 §3.2) may carry.
    #[error("the host must not carry userinfo (user@host)")]
    HostUserinfo,
    /// A host with a comma: a list, or a single header value that an
    /// upstream splits into one.
    #[error("the host must be one host name, not a list")]
    HostList,
    /// An HTTP/1.1 request without `Host` (RFC 9112 §3.2), or an HTTP/2
    /// one with neither `:authority` nor `host` (RFC 9113 §8.3.1).
    #[error("request without a Host header or :authority")]
    HostMissing,
    /// A host that names no host: empty, with a space, a control character,
    /// a character URL parsers end or refuse a host at, a byte past ASCII,
    /// or an empty label (`a..b`), or a port that is not digits (RFC 9112
    /// §3.2: 400). Upstreams read such values their own way (a trailing
    /// `..` dropped, the part before a space taken) while rules on the host
    /// see none they name. NGINX refuses most of them too.
    #[error("the host is not a valid host name")]
    HostInvalid,
    /// The target's authority and `Host` name different hosts: rules would
    /// see one and the upstream the other (RFC 9113 §8.3.1 calls it malformed).
    #[error("the request target's host and the Host header differ")]
    HostConflict,
    /// A target that is a bare `host:port` (authority form): RFC 9112
    /// §3.2.3 keeps it for CONNECT, which is not proxied. NGINX refuses it.
    #[error("the request target must be a path or an absolute URI")]
    TargetForm,
    /// A method not in upper case: methods are case-sensitive (RFC 9110
    /// §9.1), yet some frameworks upper-case them, so `post` could dodge a
    /// POST rule and still reach a POST handler. NGINX refuses them too.
    #[error("the method must be upper case")]
    MethodCase,
    /// A path servers read differently (see [`crate::path::is_ambiguous`]).
    #[error("the path holds an encoded slash, backslash or NUL, or a dot segment with ;parameters, which servers read differently")]
    AmbiguousPath,
}

/// The host a request is for: the target's authority (HTTP/2 `:authority`,
/// or an absolute-form HTTP/1.1 target, which RFC 9112 §3.2.2 says wins over
/// `Host`), else the one `Host` header. Two `Host` headers, or none on
/// HTTP/1.1, are refused as RFC 9112 requires.
pub fn request_host<'a>(
    version: http::Version,
    uri: &'a http::Uri,
    headers: Fields<'a>,
) -> Result<Option<&'a str>, RequestError> {
    let mut hosts = headers.get_all(&http::header::HOST);
    let host = hosts.next();
    if hosts.next().is_some() {
        return Err(RequestError::HostRepeated);
    }
    if let Some(plain) = plain_host(uri, host) {
        return Ok(Some(plain));
    }
    checked_host(version, uri, host)
}

/// The host of nearly every request, an origin-form target with a plain
/// `Host`, told in one pass: a valid host holds no `@`, `,` nor byte past
/// ASCII, which is all [`checked_host`] looks for besides (four passes,
/// BENCHMARKS.md §71). `None` for any other request, whatever its answer.
fn plain_host<'a>(uri: &http::Uri, host: Option<&'a [u8]>) -> Option<&'a str> {
    if uri.authority().is_some() {
        return None;
    }
    host.filter(|h| valid_host(h)).and_then(|h| std::str::from_utf8(h).ok())
}

/// [`request_host`] with the target's every form and any `Host`, each
/// refusal told apart.
fn checked_host<'a>(
    version: http::Version,
    uri: &'a http::Uri,
    host: Option<&'a [u8]>,
) -> Result<Option<&'a str>, RequestError> {
    if uri.authority().is_some() && uri.scheme().is_none() {
        return Err(RequestError::TargetForm);
    }
    // RFC 9113 §8.3.1: no userinfo in :authority; RFC 9112 §3.2: none in Host.
    // `user@api.example.com` would dodge a rule on api.example.com while
    // an upstream that drops the userinfo serves it as that host.
    let userinfo = uri.authority().is_some_and(|a| a.as_str().contains('@'))
        || host.is_some_and(|h| h.contains(&b'@'));
    if userinfo {
        return Err(RequestError::HostUserinfo);
    }
    // `api.example.com,other` names no host, misses rules on
    // api.example.com, and is what an upstream reading X-Forwarded-Host as
    // a list takes for api.example.com.
    let listed = uri.authority().is_some_and(|a| a.as_str().contains(','))
        || host.is_some_and(|h| h.contains(&b','));
    if listed {
        return Err(RequestError::HostList);
    }
    let invalid = uri.authority().is_some_and(|a| !valid_host(a.as_str().as_bytes()))
        || host.is_some_and(|h| !valid_host(h));
    if invalid {
        return Err(RequestError::HostInvalid);
    }
    if let Some(authority) = uri.authority() {
        // RFC 9112 §3.2: an HTTP/1.1 request without Host is a 400, even
        // with an absolute target (as NGINX answers it).
        if host.is_none() && version == http::Version::HTTP_11 {
            return Err(RequestError::HostMissing);
        }
        let differs = host
            .and_then(|h| text(h).map(canonical_host))
            .is_some_and(|h| h != canonical_host(authority.as_str()));
        if differs || host.is_some_and(|h| text(h).is_none()) {
            return Err(RequestError::HostConflict);
        }
        return Ok(Some(authority.as_str()));
    }
    match host {
        // A valid host is visible ASCII: text.
        Some(h) => Ok(std::str::from_utf8(h).ok()),
        // HTTP/2 with neither `:authority` nor `host` too, as NGINX answers it.
        None if version == http::Version::HTTP_11 || version == http::Version::HTTP_2 => {
            Err(RequestError::HostMissing)
        }
        None => Ok(None),
    }
}

/// The counters of every rule of `limits` that matches the request, found
/// by trying every rule in turn: the plain reading of a file, against which
/// the index the surfaces use ([`crate::config::RuleIndex`]) is tested.
/// Paths are matched normalised (see [`crate::path`]), whatever the surface
/// passed in.
pub fn hits(limits: &Limits, req: &RequestInfo<'_>) -> Result<Vec<Hit>, RequestError> {
    let form = MatchingForm::of(req)?;
    let (req, host) = (&RequestInfo { path: &form.path, ..*req }, form.host.as_deref());
    let every = limits.rules.iter().enumerate().filter(|(_, r)| r.descriptor.is_none()).map(|(at, _)| at);
    let mut hits = Vec::new();
    file_hits(limits, every, req, host, &mut hits)?;
    Ok(hits)
}

/// [`hits`] over several files, in order, each looked up in its index, the
/// request checked and put in matching form once for all of them.
pub(super) fn each_file_hits<L: std::ops::Deref<Target = Limits>>(
    files: &[L],
    req: &RequestInfo<'_>,
    hits: &mut Vec<Hit>,
) -> Result<(), RequestError> {
    // No limits, nothing to refuse (as when no rule matches).
    if files.is_empty() {
        return Ok(());
    }
    let form = MatchingForm::of(req)?;
    let (req, host) = (&RequestInfo { path: &form.path, ..*req }, form.host.as_deref());
    for limits in files {
        let candidates = limits.index.candidates(req.path, host, req.headers);
        file_hits(limits, candidates.into_iter(), req, host, hits)?;
    }
    Ok(())
}

/// The path and host of a request as rules compare them.
struct MatchingForm<'a> {
    path: std::borrow::Cow<'a, str>,
    host: Option<std::borrow::Cow<'a, str>>,
}

impl<'a> MatchingForm<'a> {
    /// The request's matching form, or why it cannot be matched at all.
    fn of(req: &RequestInfo<'a>) -> Result<MatchingForm<'a>, RequestError> {
        if crate::path::is_ambiguous(req.path) {
            return Err(RequestError::AmbiguousPath);
        }
        if req.method.as_str().bytes().any(|b| b.is_ascii_lowercase()) {
            return Err(RequestError::MethodCase);
        }
        Ok(MatchingForm {
            path: crate::path::matching_form(req.path),
            host: req.host.map(canonical_host),
        })
    }
}

/// The counters of the rules at `positions` (in file order) of one file
/// that match a request in matching form.
fn file_hits(
    limits: &Limits,
    positions: impl Iterator<Item = usize>,
    req: &RequestInfo<'_>,
    host: Option<&str>,
    hits: &mut Vec<Hit>,
) -> Result<(), RequestError> {
    for at in positions {
        let Some(rule) = limits.rules.get(at) else { continue };
        if !rule.matcher.matches(req.method, req.path, host, req.headers) {
            continue;
        }
        // As NGINX skips an empty key, a rule without all its values counts nothing.
        let Some(key) = counter_key(&limits.domain, rule, req, host)? else {
            continue;
        };
        let cost = cost_of(rule, req.headers)?;
        hits.push(Hit {
            rule: rule.clone(),
            key,
            cost,
        });
    }
    Ok(())
}

fn cost_of(rule: &Rule, headers: Fields<'_>) -> Result<u64, RequestError> {
    match &rule.cost {
        Cost::Fixed(n) => Ok(*n),
        Cost::Header(name) => {
            let mut values = headers.get_all(name);
            let Some(v) = values.next() else { return Ok(1) };
            let bad = || RequestError::BadCost {
                rule: rule.name.clone(),
                header: name.to_string(),
            };
            if values.next().is_some() {
                return Err(bad());
            }
            text(v)
                .and_then(|s| s.trim().parse::<u64>().ok())
                .filter(|n| (1..=crate::config::MAX_UNITS).contains(n))
                .ok_or_else(bad)
        }
    }
}

fn counter_key(
    domain: &str,
    rule: &Rule,
    req: &RequestInfo<'_>,
    host: Option<&str>,
) -> Result<Option<String>, RequestError> {
    let mut values = Vec::with_capacity(rule.by.len());
    for part in &rule.by {
        let Some(value) = part_value(part, rule, req, host)? else {
            return Ok(None);
        };
        if value.is_empty() {
            return Ok(None);
        }
        values.push(value);
    }
    Ok(Some(keys::http_key(domain, &rule.id, &values)))
}

fn part_value(
    part: &Part,
    rule: &Rule,
    req: &RequestInfo<'_>,
    host: Option<&str>,
) -> Result<Option<Value>, RequestError> {
    let repeated = |what: String| RequestError::Repeated {
        rule: rule.name.clone(),
        what,
    };
    let text = |s: String| Some(Value::Text(s));
    Ok(match part {
        Part::ClientIp { v4, v6 } => text(client_network(req.client_ip, *v4, *v6)),
        Part::Method => text(req.method.as_str().to_string()),
        // `/a/` and `/a` reach the same handler in most frameworks.
        Part::Path => {
            let path = match req.path.strip_suffix('/') {
                Some(p) if !p.is_empty() => p,
                _ => req.path,
            };
            // A rule that matches regardless of case counts every casing
            // of a path as one path.
            text(if rule.matcher.ignore_case {
                crate::path::fold_case(path).into_owned()
            } else {
                path.to_string()
            })
        }
        Part::Host => host.and_then(|h| text(h.to_string())),
        Part::Header(name) if name == http::header::COOKIE => {
            // The one line the upstream gets (see `cookie_line`).
            let joined = cookie_line(req.headers);
            (!joined.is_empty()).then(|| Value::from_bytes(joined))
        }
        Part::Header(name) => {
            let mut values = req.headers.get_all(name);
            let Some(first) = values.next() else { return Ok(None) };
            if values.next().is_some() {
                return Err(repeated(format!("header {name}")));
            }
            // HTTP/1 parsers strip the spaces and tabs around a value; HTTP/2
            // hands them through, and the upstream's parser strips them.
            Some(Value::from_bytes(first.trim_ascii().to_vec()))
        }
        Part::ClientCert => req.client_cert.map(|s| Value::Text(s.to_string())),
        Part::Query(name) => match req.query {
            None => None,
            Some(query) => {
                // The same value twice is one value whichever a framework
                // takes (`?tenant=a&Tenant=a`, a link's stray `&amp;`).
                let mut values = query_values(query, name);
                let first = values.next();
                if values.any(|v| Some(&v) != first.as_ref()) {
                    return Err(repeated(format!("query parameter {name}")));
                }
                first
            }
        },
    })
}

/// Every `Cookie` field of `headers` as one line, joined with `; `: an
/// HTTP/2 client sends one field per cookie (browsers do), and RFC 9113
/// §8.2.3 has them joined so; the proxy passes this line on, and a rule
/// keyed on `header:cookie` counts it.
pub fn cookie_line(headers: Fields<'_>) -> Vec<u8> {
    let mut joined = Vec::new();
    for (i, line) in headers.get_all(&http::header::COOKIE).enumerate() {
        if i > 0 {
            joined.extend_from_slice(b"; ");
        }
        joined.extend_from_slice(line.trim_ascii());
    }
    joined
}

/// The client address, or its network when the rule keeps fewer bits
/// (`2001:db8:1:2::/64`). IPv4-mapped IPv6 addresses count as IPv4.
fn client_network(ip: IpAddr, v4: u8, v6: u8) -> String {
    let ip = ip.to_canonical();
    let bits = match ip {
        IpAddr::V4(_) => v4,
        IpAddr::V6(_) => v6,
    };
    match ipnet::IpNet::new(ip, bits) {
        Ok(net) if net.prefix_len() < net.max_prefix_len() => net.trunc().to_string(),
        _ => crate::client_ip::ip_text(ip),
    }
}

/// Every value of query parameter `name`, percent-decoded (`+` is a space).
/// `;` separates parameters too, as Rack 2 (Rails before 7.1) reads it, so
/// `?x=1;tenant=a` cannot hide a parameter from the rule. So are the names
/// frameworks read as `name` (see [`same_parameter`]): each is a value of
/// `name`, so it is counted as one, or refused as repeated beside another.
fn query_values<'a>(query: &'a str, name: &'a str) -> impl Iterator<Item = Value> + 'a {
    // A rule on a name that is itself a framework's spelling of something
    // (`filter[tenant]`) is matched exactly.
    let plain = !name.contains(['[', ']', '\0']);
    // A `;` segment whose value starts with `=` is a FIQL/RSQL equality
    // inside one parameter (`search=status==open;tenant==acme`, Spring's
    // and JAX-RS's filters), not a parameter: Rack 2 reads it as `tenant`
    // = `=acme`, which no real value starts with. (Any `=` later in a
    // value, base64's padding, is read by Rack 2 as the caller sent it.)
    let fiql = |seg: &str| seg.split_once('=').is_some_and(|(_, v)| v.starts_with('='));
    let pairs = query.split('&').flat_map(move |part| {
        part.split(';')
            .enumerate()
            .filter(move |(i, seg)| *i == 0 || !fiql(seg))
            .map(|(_, seg)| seg)
    });
    pairs.filter_map(move |pair| {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let k = decode(k);
        let same = k == name.as_bytes() || (plain && same_parameter(&k, name.as_bytes()));
        same.then(|| Value::from_bytes(decode(v)))
    })
}

/// Whether a framework reads the query parameter named `k` as `name` (a
/// plain name): ASP.NET Core in any case (`TENANT`), PHP ([`php_name`]:
/// `%20tenant`, `tenant%00x`, `ten.ant` for `ten_ant`), Rack 2
/// ([`rack_name`]: `[tenant]`, `tenant]`), Spring's default-value marker
/// (`!tenant`), and each as an array (`tenant[]`, `tenant[0]`: Rails reads
/// `where(tenant: params[:tenant])` as `IN`). A named index
/// (`page[size]`) makes a hash, no value of `page`.
fn same_parameter(k: &[u8], name: &[u8]) -> bool {
    // Most names are none of these: no allocation for them.
    if k.eq_ignore_ascii_case(name) {
        return true;
    }
    if !k.iter().any(|b| matches!(b, b' ' | b'.' | b'[' | b']' | 0 | b'!' | b'_')) {
        return false;
    }
    let k = k.strip_prefix(b"!").unwrap_or(k);
    let indexed = |base_len: usize| {
        // What follows the base: nothing, `]`s (Rack 2), or an array index.
        let rest = k.get(base_len..).unwrap_or_default();
        let index = rest.strip_prefix(b"[").and_then(|r| r.strip_suffix(b"]"));
        rest.iter().all(|&b| b == b']') || index.is_some_and(|i| i.iter().all(u8::is_ascii_digit))
    };
    let rack = rack_name(k);
    let rack_base = k.iter().position(|&b| b != b'[' && b != b']').unwrap_or(0);
    (rack.eq_ignore_ascii_case(name) && indexed(rack_base.saturating_add(rack.len())))
        || (php_indexed(k) && php_name(k).eq_ignore_ascii_case(&php_name(name)))
}

/// Whether PHP reads `k` as a plain value or an array element (`a[]`,
/// `a[0]`), not as a hash (`a[key]`).
fn php_indexed(k: &[u8]) -> bool {
    match k.iter().position(|&b| b == b'[') {
        None => true,
        Some(open) => {
            let rest = k.get(open.saturating_add(1)..).unwrap_or_default();
            match rest.iter().position(|&b| b == b']') {
                // An unclosed `[` is read as `_`: a plain name.
                None => true,
                Some(close) => rest.get(..close).unwrap_or_default().iter().all(u8::is_ascii_digit),
            }
        }
    }
}

/// A query parameter's name as PHP reads it: up to a NUL, leading spaces
/// dropped, `.` and spaces as `_`, and an array's index dropped
/// (`tenant[]`), or a `[` no `]` closes read as `_` (and every `.`, space
/// and `[` after it).
fn php_name(name: &[u8]) -> Vec<u8> {
    let name = name.split(|&b| b == 0).next().unwrap_or_default();
    let name = name.iter().position(|&b| b != b' ').and_then(|at| name.get(at..)).unwrap_or_default();
    let mut out = Vec::with_capacity(name.len());
    for (at, &b) in name.iter().enumerate() {
        let rest = name.get(at.saturating_add(1)..).unwrap_or_default();
        match b {
            b'[' if rest.contains(&b']') => return out,
            b'[' => {
                out.push(b'_');
                out.extend(rest.iter().map(|&b| if matches!(b, b' ' | b'.' | b'[') { b'_' } else { b }));
                return out;
            }
            b' ' | b'.' => out.push(b'_'),
            _ => out.push(b),
        }
    }
    out
}

/// A query parameter's name as Rack 2 reads it: brackets around it
/// dropped (`[tenant]`, `]tenant`, `tenant]`), and what follows the first
/// run of other bytes (an array's or a hash's index), except a lone `[`
/// (`tenant[` is a name of its own).
fn rack_name(name: &[u8]) -> &[u8] {
    let bracket = |b: &u8| *b == b'[' || *b == b']';
    let start = name.iter().position(|b| !bracket(b)).unwrap_or(name.len());
    let rest = name.get(start..).unwrap_or_default();
    let end = rest.iter().position(bracket).unwrap_or(rest.len());
    let after = rest.get(end..).unwrap_or_default();
    let after = after.get(after.iter().position(|&b| b != b']').unwrap_or(after.len())..).unwrap_or_default();
    match after {
        b"[" => name,
        _ => rest.get(..end).unwrap_or_default(),
    }
}

/// Percent-decoded bytes (`+` is a space), not forced into UTF-8.
fn decode(s: &str) -> Vec<u8> {
    let plus_as_space = s.replace('+', " ");
    percent_decode(plus_as_space.as_bytes()).collect()
}

/// The host as rules compare it: no port, lower case, no trailing dot
/// (`API.Example.com.:443` is `api.example.com`, as DNS and most servers
/// read it).
fn canonical_host(host: &str) -> std::borrow::Cow<'_, str> {
    let host = strip_port(host.trim());
    let host = host.strip_suffix('.').unwrap_or(host);
    // On every request: allocate only when there is a capital to lower.
    if host.bytes().any(|b| b.is_ascii_uppercase()) {
        std::borrow::Cow::Owned(host.to_ascii_lowercase())
    } else {
        std::borrow::Cow::Borrowed(host)
    }
}

/// Whether `host` (a `Host` value or an authority) is a host and an optional port as NGINX accepts one:
/// not empty, no space, control character, slash, backslash, `@` or `,`, no empty
/// label (one trailing dot is the root's, as in DNS), a bracketed literal
/// only whole and first, and a port of digits.
pub(crate) fn valid_host(host: &[u8]) -> bool {
    let digits = |port: &[u8]| port.iter().all(u8::is_ascii_digit);
    if host.first() == Some(&b'[') {
        let Some(end) = host.iter().position(|&b| b == b']') else {
            return false;
        };
        let (Some(literal), Some(port)) = (host.get(1..end), host.get(end.saturating_add(1)..)) else {
            return false;
        };
        // An IPv6 address: no client sends an IPvFuture (RFC 3986
        // §3.2.2), nor a zone (RFC 9110 has none in a URI's host).
        let v6 = std::str::from_utf8(literal).is_ok_and(|l| l.parse::<std::net::Ipv6Addr>().is_ok());
        let port_ok = port.is_empty() || port.strip_prefix(b":").is_some_and(digits);
        return port_ok && v6;
    }
    // One pass, a table look-up a byte: on every request. A name has no
    // `:`, so the first starts the port; a dot after a dot (or first) is an
    // empty label.
    let mut after_dot = true;
    for (at, &b) in host.iter().enumerate() {
        match HOST_BYTE.get(usize::from(b)).copied().unwrap_or(BAD) {
            NAME => after_dot = false,
            DOT if after_dot => return false,
            DOT => after_dot = true,
            COLON => return at > 0 && host.get(at.saturating_add(1)..).is_some_and(digits),
            _ => return false,
        }
    }
    !host.is_empty()
}

/// What a byte is in a host name: see [`valid_host`].
const NAME: u8 = 0;
const DOT: u8 = 1;
const COLON: u8 = 2;
const BAD: u8 = 3;
// Built at compile time, where an index out of bounds fails the build.
#[allow(clippy::indexing_slicing)]
static HOST_BYTE: [u8; 256] = {
    let mut table = [NAME; 256];
    let mut b = 0;
    while b < 256 {
        table[b] = match b as u8 {
            b'.' => DOT,
            b':' => COLON,
            // What RFC 3986 keeps out of a host name and URL parsers
            // (WHATWG's, Node's `new URL`, Python's `urlsplit`) end it at
            // or refuse, `%` (WHATWG decodes it: `api%2Eexample.com`), and
            // bytes past ASCII (IDNA maps full-width letters to ASCII ones;
            // a host on the wire is ASCII, punycode for others).
            0..=b' ' | 0x7f..=0xff | b'/' | b'\\' | b'[' | b']' | b'#' | b'?' | b'%' | b'<' | b'>' | b'^' | b'|'
            | b'"' | b'`' | b'{' | b'}' => BAD,
            // Userinfo and lists: refused before with errors of their own,
            // and refused here so one pass tells a plain host.
            b'@' | b',' => BAD,
            _ => NAME,
        };
        b += 1;
    }
    table
};

/// `example.com:8080` → `example.com`; `[::1]:80` → `[::1]`.
fn strip_port(host: &str) -> &str {
    if host.starts_with('[') {
        return host.split_once(']').map_or(host, |(h, _)| &host[..=h.len()]);
    }
    host.rsplit_once(':').map_or(host, |(h, port)| {
        if port.bytes().all(|b| b.is_ascii_digit()) {
            h
        } else {
            host
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;
    use crate::config::parse_str;

    #[test]
    fn hosts_are_valid_as_nginx_takes_them() {
        for good in [
            "api.example.com",
            "API.example.com:8080",
            "api.example.com.",
            "api.example.com:",
            "localhost",
            "127.0.0.1:80",
            "[::1]",
            "[::1]:443",
            "my_host",
            "xn--caf-dma.example",
            "a-b.c~d!e$f&g'h(i)j*k+l;m=n",
        ] {
            assert!(valid_host(good.as_bytes()), "{good}");
        }
        for bad in [
            "",
            ".",
            ":80",
            "api.example.com x",
            "api.example.com..",
            "api..example.com",
            ".example.com",
            "api.example.com/x",
            "api.example.com\\x",
            "api.example.com\tx",
            "api.example.com:8o",
            "api.example.com:80:90",
            "api.example.com#x",
            "api.example.com?x",
            "api%2Eexample.com",
            "api.example.com<x",
            "api.example.com|x",
            "\u{ff41}pi.example.com",
            "api.example.com\u{0}",
            "[api.example.com]",
            "[v1.fe]",
            "[v1.a#b]",
            "[::1",
            "[::1]x",
            "api[1].example.com",
            "user@api.example.com",
            "api.example.com,other",
            "[::1]:80,x",
        ] {
            assert!(!valid_host(bad.as_bytes()), "{bad:?}");
        }
    }

    const LIMITS: &str = "\
domain: api
rules:
  - name: login
    match: { methods: [POST], path: /login }
    by: [client_ip]
    limits: [{ requests: 5, per: 3s }]
  - name: per-key
    by: [header:x-api-key, query:tenant]
    limits: [{ requests: 100, per: 1m }]
    cost: header:x-cost
  - name: hosts
    by: [host, method, path]
    limits: [{ requests: 100, per: 1m }]
";

    fn request<'a>(
        method: &'a Method,
        path: &'a str,
        query: Option<&'a str>,
        headers: &'a HeaderMap,
    ) -> RequestInfo<'a> {
        RequestInfo {
            method,
            path,
            query,
            host: Some("API.example.com:8443"),
            headers: crate::fields::Fields::Map(headers),
            client_ip: "10.0.0.7".parse().unwrap(),
            client_cert: None,
        }
    }

    #[test]
    fn matching_rules_and_their_counters() {
        let limits = parse_str(LIMITS, "l.yaml").unwrap();
        let mut h = HeaderMap::new();
        h.insert("x-api-key", "k1".parse().unwrap());
        h.insert("x-cost", "3".parse().unwrap());
        let hits = hits(&limits, &request(&Method::POST, "/login", Some("tenant=a%20b&x=1"), &h)).unwrap();
        let keys: Vec<&str> = hits.iter().map(|h| h.key.as_str()).collect();
        assert_eq!(
            keys,
            vec![
                "tg:2{3=api|8=10.0.0.7|}5=login|",
                "tg:2{3=api|2=k1|}7=per-key|3=a b|",
                "tg:2{3=api|15=api.example.com|}5=hosts|4=POST|6=/login|",
            ]
        );
        assert_eq!(hits[1].cost, 3);
        assert_eq!(hits[0].cost, 1);
    }

    #[test]
    fn missing_or_empty_values_skip_the_rule() {
        let limits = parse_str(LIMITS, "l.yaml").unwrap();
        let mut h = HeaderMap::new();
        let hits_of = |h: &HeaderMap| {
            hits(&limits, &request(&Method::GET, "/x", Some("tenant=t"), h))
                .unwrap()
                .into_iter()
                .map(|h| h.rule.name.clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(hits_of(&h), vec!["hosts"]);
        h.insert("x-api-key", "".parse().unwrap());
        assert_eq!(hits_of(&h), vec!["hosts"]);
    }

    #[test]
    fn query_names_php_and_rack_read_as_the_rules_are_its_values() {
        let values = |q: &str, name: &str| {
            query_values(q, name)
                .map(|v| match v {
                    Value::Text(t) => t,
                    other => format!("{other:?}"),
                })
                .collect::<Vec<_>>()
        };
        for spelling in [
            "tenant",
            "tenant[]",
            "tenant[0]",
            "%20tenant",
            "+tenant",
            "%20%20tenant[3]",
            "TENANT",
            "Tenant[]",
            "!tenant",
            "tenant%00",
            "tenant%00x",
            "[tenant]",
            "tenant]",
            "]tenant",
            "%5Btenant%5D",
        ] {
            assert_eq!(values(&format!("x=1&{spelling}=acme"), "tenant"), ["acme"], "{spelling}");
        }
        assert_eq!(values("tenant=a&tenant[]=b", "tenant"), ["a", "b"], "two values: refused as repeated");
        assert_eq!(values("ten.ant=a", "ten_ant"), ["a"], "PHP reads . as _");
        assert_eq!(values("ten_ant=a", "ten.ant"), ["a"]);
        assert_eq!(values("ten[ant=a", "ten_ant"), ["a"], "PHP reads an unclosed [ as _");
        assert_eq!(values("ten%5bant=a", "ten_ant"), ["a"]);
        assert_eq!(values("oauth[client.id=a", "oauth_client_id"), ["a"], "PHP: _ for . after an unclosed [");
        // A FIQL/RSQL filter's `;` is an AND inside one value, not a
        // separator; a plain `;tenant=a` (Rack 2) still is one.
        assert!(values("search=status==open;tenant==acme", "tenant").is_empty());
        assert_eq!(values("x=1;tenant=a", "tenant"), ["a"]);
        // Any other `=` in a value is the value's (Rack 2 reads it so).
        assert_eq!(values(";api_key=QUJD==", "api_key"), ["QUJD=="]);
        assert_eq!(values("x=1;tenant=acme=", "tenant"), ["acme="]);
        assert_eq!(values("tenant=a;tenant=b=", "tenant"), ["a", "b="], "two values: 400");
        // A named index makes a hash, no value: JSON:API's page[size].
        assert!(values("page[number]=2&page[size]=10", "page").is_empty());
        // A rule on a framework's spelling itself is matched exactly.
        assert_eq!(values("filter[tenant]=a&filter[status]=b", "filter[tenant]"), ["a"]);
        for other in ["tenants=a", "tenant[=a", "xtenant=a", "ten ant2=a", "filter[tenant]=a", "tenant_id=a"] {
            assert!(values(other, "tenant").is_empty(), "{other}");
        }
    }

    #[test]
    fn cookie_fields_are_one_value_as_the_upstream_gets_them() {
        let limits = parse_str(
            "domain: c\nrules:\n  - name: per-session\n    by: [header:cookie]\n    limits: [{ requests: 5, per: 1m }]\n",
            "c.yaml",
        )
        .unwrap();
        let key = |lines: &[&str]| {
            let mut h = HeaderMap::new();
            for line in lines {
                h.append("cookie", line.parse().unwrap());
            }
            let hits = hits(&limits, &request(&Method::GET, "/", None, &h)).unwrap();
            hits.into_iter().map(|h| h.key).collect::<Vec<_>>()
        };
        // Two fields (an HTTP/2 browser) are the one line HTTP/1.1 sends.
        assert_eq!(key(&["sid=abc", "csrftoken=xyz"]), key(&["sid=abc; csrftoken=xyz"]));
        assert_eq!(key(&["sid=abc"]).len(), 1);
    }

    #[test]
    fn bad_cost_header_is_an_error() {
        let limits = parse_str(LIMITS, "l.yaml").unwrap();
        let mut h = HeaderMap::new();
        h.insert("x-api-key", "k1".parse().unwrap());
        h.insert("x-cost", "-2".parse().unwrap());
        let err = hits(&limits, &request(&Method::GET, "/", Some("tenant=t"), &h)).unwrap_err();
        assert_eq!(
            err,
            RequestError::BadCost {
                rule: "per-key".into(),
                header: "x-cost".into()
            }
        );
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 512, ..Default::default() })]
        /// Fuzz: whatever a caller sends, matching answers hits or a 400
        /// reason, never a panic, and keys stay short.
        #[test]
        fn any_request_gives_hits_or_a_reason(
            method in "[A-Z]{1,8}",
            path in "[ -~]{0,120}",
            query in proptest::option::of("[ -~]{0,120}"),
            host in proptest::option::of("[ -~]{0,80}"),
            headers in proptest::collection::vec(("(x-api-key|x-cost|x-tier|host|x-[a-z]{1,5})", "[ -~]{0,100}"), 0..8),
            v6: bool,
        ) {
            let limits = parse_str(&format!("{LIMITS}  - name: net\n    by: [client_ip/24/64]\n    limits: [{{ requests: 1, per: 1s }}]\n"), "l.yaml").unwrap();
            let Ok(method) = Method::from_bytes(method.as_bytes()) else { return Ok(()) };
            let mut h = HeaderMap::new();
            for (k, v) in &headers {
                if let (Ok(k), Ok(v)) = (http::HeaderName::from_bytes(k.as_bytes()), http::HeaderValue::from_str(v)) {
                    h.append(k, v);
                }
            }
            let client_ip = if v6 { "2001:db8::1".parse().unwrap() } else { "10.0.0.7".parse().unwrap() };
            let req = RequestInfo { method: &method, path: &path, query: query.as_deref(), host: host.as_deref(), headers: crate::fields::Fields::Map(&h), client_ip, client_cert: None };
            if let Ok(hits) = hits(&limits, &req) {
                for hit in hits {
                    proptest::prop_assert!(hit.key.len() < 400, "{}", hit.key);
                    proptest::prop_assert!(hit.cost >= 1 && hit.cost <= crate::config::MAX_UNITS);
                }
            }
        }
    }

    /// One rule of a random file: its number, methods, path, `ignore_case`,
    /// host, header conditions and `by`.
    type RandomRule<'a> = (usize, Vec<&'a str>, Option<String>, bool, Option<&'a str>, Option<&'a str>, &'a str);

    /// One rule of a random file, as YAML.
    fn rule_yaml((n, methods, path, ignore_case, host, header, by): RandomRule<'_>) -> String {
        let mut m = Vec::new();
        if !methods.is_empty() {
            m.push(format!("methods: [{}]", methods.join(", ")));
        }
        if let Some(p) = path {
            m.push(format!("path: '{p}'"));
        }
        if ignore_case {
            m.push("ignore_case: true".into());
        }
        if let Some(h) = host {
            m.push(format!("host: '{h}'"));
        }
        if let Some(h) = header {
            m.push(format!("headers: {{ {h} }}"));
        }
        format!(
            "  - name: r{n}\n    match: {{ {} }}\n    by: [{by}]\n    limits: [{{ requests: 5, per: 1s }}]\n",
            m.join(", ")
        )
    }

    /// A path written from pieces the normaliser and the matcher treat
    /// specially: case, encoded letters, dot segments, empty segments,
    /// characters raw or escaped, escapes that must stay escapes.
    fn path_strategy() -> impl proptest::strategy::Strategy<Value = String> {
        use proptest::prelude::*;
        let segment = prop::sample::select(vec![
            "a", "A", "b", "ab", "aB", "%61", "%41", ".", "..", "", "a;x", "%7e", "\u{e9}", "%C3%A9", "%c3%a9", "{", "%7B",
            "%25", "%2561", "%20", "\u{c9}", "%C3%89", "\u{c9}T\u{c9}", "\u{212a}",
        ]);
        prop::collection::vec(segment, 0..4).prop_map(|s| format!("/{}", s.join("/")))
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 2000, ..Default::default() })]
        /// The index finds exactly the rules, in the order, and with the
        /// counters, that trying every rule in turn finds.
        #[test]
        fn the_index_matches_what_the_linear_scan_matches(
            rules in proptest::collection::vec((
                proptest::sample::subsequence(vec!["GET", "POST", "HEAD"], 0..=2),
                proptest::option::of((path_strategy(), 0..3u8)),
                proptest::bool::ANY,
                proptest::option::of(proptest::sample::select(vec!["a.com", "A.com", "b.com", "a.com."])),
                // Header conditions, several rules often keyed on one name.
                proptest::option::weighted(0.5, proptest::sample::select(vec![
                    "x-t: v", "x-t: w", "x-t: v", "x-t: '*'", "x-u: v", "x-t: v, x-u: w", "X-T: v, x-t: w", "x-t: ' v'", "x-t: ''",
                ])),
                proptest::sample::select(vec!["", "path", "host", "method"]),
            ), 0..14),
            requests in proptest::collection::vec((
                proptest::sample::select(vec!["GET", "POST", "HEAD", "PUT"]),
                path_strategy(),
                proptest::option::of(proptest::sample::select(vec!["a.com", "A.COM:8080", "a.com.", "b.com", "[::1]:80", "c.com"])),
                proptest::collection::vec(proptest::sample::select(vec![
                    ("x-t", "v"), ("x-t", " v\t"), ("x-t", "w"), ("x-t", "V"), ("x-t", ""), ("x-u", "w"), ("x-u", "v"),
                ]), 0..3),
            ), 1..20),
        ) {
            let mut yaml = String::from("domain: d\nrules:\n");
            for (n, (methods, path, ignore_case, host, header, by)) in rules.into_iter().enumerate() {
                // 0: exact; 1: a prefix; 2: a prefix ending in a slash.
                let path = path.map(|(p, shape)| match shape {
                    0 => p,
                    1 => format!("{p}*"),
                    _ => format!("{}/*", p.trim_end_matches('/')),
                });
                yaml.push_str(&rule_yaml((n, methods, path, ignore_case, host, header, by)));
            }
            let Ok(limits) = parse_str(&yaml, "r.yaml") else { return Ok(()) };
            let limits = std::sync::Arc::new(limits);
            for (method, path, host, header) in requests {
                let method = Method::from_bytes(method.as_bytes()).unwrap();
                let mut headers = HeaderMap::new();
                for (name, value) in header {
                    headers.append(name, value.parse().unwrap());
                }
                let req = RequestInfo { method: &method, path: &path, query: None, host, headers: crate::fields::Fields::Map(&headers), client_ip: "10.0.0.1".parse().unwrap(), client_cert: None };
                let seen = |hits: Vec<Hit>| hits.into_iter().map(|h| (h.rule.name.clone(), h.key, h.cost)).collect::<Vec<_>>();
                let scan = hits(&limits, &req).map(seen);
                let mut indexed = Vec::new();
                let indexed = each_file_hits(std::slice::from_ref(&limits), &req, &mut indexed).map(|()| seen(indexed));
                proptest::prop_assert_eq!(scan, indexed, "{} {:?} on {:?} with {:?}\n{}", method, path, host, headers, yaml);
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 4000, ..Default::default() })]
        /// The one-pass host of a plain request answers as every check in
        /// turn does: the same host, or a refusal told apart by them.
        #[test]
        fn a_plain_host_told_in_one_pass_is_the_checked_one(
            host in proptest::option::of(proptest::collection::vec(proptest::sample::select(vec![
                b'a', b'Z', b'0', b'9', b'.', b':', b'-', b'_', b'@', b',', b'[', b']', b' ', b'%', b'/', b'\\', b'\t', 0x7f, 0xc3, 0xa9,
            ]), 0..12)),
            authority in proptest::option::of(proptest::sample::select(vec!["a.com", "u@a.com", "a.com,b", "[::1]:80", "A.COM."])),
            version in proptest::sample::select(vec![http::Version::HTTP_10, http::Version::HTTP_11, http::Version::HTTP_2]),
        ) {
            let uri: http::Uri = match authority {
                Some(a) => format!("http://{a}/x").parse().unwrap(),
                None => "/x".parse().unwrap(),
            };
            let mut headers = HeaderMap::new();
            if let Some(h) = &host {
                let Ok(value) = http::HeaderValue::from_bytes(h) else { return Ok(()) };
                headers.insert(http::header::HOST, value);
            }
            let fields = crate::fields::Fields::Map(&headers);
            proptest::prop_assert_eq!(request_host(version, &uri, fields), checked_host(version, &uri, host.as_deref()), "{:?} {:?}", uri, host);
        }
    }

    #[test]
    fn ports_are_stripped_from_hosts() {
        assert_eq!(strip_port("example.com:80"), "example.com");
        assert_eq!(strip_port("example.com"), "example.com");
        assert_eq!(strip_port("[::1]:80"), "[::1]");
        assert_eq!(strip_port("[::1]"), "[::1]");
    }

    #[test]
    fn an_http11_request_names_its_host_in_host_and_its_target_is_no_bare_authority() {
        let none = HeaderMap::new();
        let absolute: http::Uri = "http://api.example.com/x".parse().unwrap();
        let fields = crate::fields::Fields::Map(&none);
        assert_eq!(request_host(http::Version::HTTP_11, &absolute, fields), Err(RequestError::HostMissing));
        // HTTP/1.0 needs no Host; HTTP/2 names it in :authority.
        assert_eq!(request_host(http::Version::HTTP_10, &absolute, fields), Ok(Some("api.example.com")));
        assert_eq!(request_host(http::Version::HTTP_2, &absolute, fields), Ok(Some("api.example.com")));
        let bare: http::Uri = "api.example.com:80".parse().unwrap();
        let mut headers = HeaderMap::new();
        headers.insert(http::header::HOST, "api.example.com".parse().unwrap());
        let fields = crate::fields::Fields::Map(&headers);
        assert_eq!(request_host(http::Version::HTTP_11, &bare, fields), Err(RequestError::TargetForm));
    }

    #[test]
    fn a_host_with_userinfo_is_refused_in_either_place() {
        // `user@api.example.com` would miss a rule on api.example.com.
        let uri: http::Uri = "http://user@api.example.com/x".parse().unwrap();
        let none = HeaderMap::new();
        let refused = request_host(http::Version::HTTP_2, &uri, crate::fields::Fields::Map(&none));
        assert!(matches!(refused, Err(RequestError::HostUserinfo)), "{refused:?}");
        let mut headers = HeaderMap::new();
        headers.insert(http::header::HOST, "user@api.example.com".parse().unwrap());
        let origin: http::Uri = "/x".parse().unwrap();
        let refused = request_host(http::Version::HTTP_11, &origin, crate::fields::Fields::Map(&headers));
        assert!(matches!(refused, Err(RequestError::HostUserinfo)), "{refused:?}");
        headers.insert(http::header::HOST, "api.example.com,other".parse().unwrap());
        let refused = request_host(http::Version::HTTP_11, &origin, crate::fields::Fields::Map(&headers));
        assert!(matches!(refused, Err(RequestError::HostList)), "{refused:?}");
        headers.insert(http::header::HOST, "api.example.com".parse().unwrap());
        assert_eq!(request_host(http::Version::HTTP_11, &origin, crate::fields::Fields::Map(&headers)).unwrap(), Some("api.example.com"));
    }
}
