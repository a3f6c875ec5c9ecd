//! The limits in force at one moment, as one immutable value.
//!
//! The watch (`reload`) builds a new [`Catalog`] whenever a limits file
//! changes or a file comes or goes, and swaps it in whole: a request reads
//! one catalog from start to end, so it never sees half of a deploy.

use std::collections::HashMap;
use std::sync::Arc;

use arc_swap::ArcSwap;
use http::HeaderName;

use crate::fields::Fields;

use super::http::{RequestError, RequestInfo};
use crate::config::{Cost, Limits, Part};
use crate::limiter::Hit;

/// The catalog in force, shared by every surface and swapped by the watch.
pub type SharedCatalog = Arc<ArcSwap<Catalog>>;

/// Every file's limits in `--config` order, and per domain the limits in
/// force (the files of one domain merged, when merging is on).
#[derive(Debug, Default)]
pub struct Catalog {
    files: Vec<Arc<Limits>>,
    domains: HashMap<String, Arc<Limits>>,
    /// The request headers HTTP rules read: to match, to key, to cost.
    read_headers: Vec<HeaderName>,
    /// Whether one of them has `_` in its name.
    underscore_read: bool,
}

impl Catalog {
    /// A catalog of `files`, in the order their HTTP rules apply. Files that
    /// share a domain are merged; the watch checks that they can be before
    /// it lets a file in, so a failed merge here serves the first file.
    pub fn new(files: Vec<Arc<Limits>>) -> Catalog {
        let mut parts: Vec<(String, Vec<Arc<Limits>>)> = Vec::new();
        for limits in &files {
            match parts.iter_mut().find(|(d, _)| *d == limits.domain) {
                Some((_, list)) => list.push(limits.clone()),
                None => parts.push((limits.domain.clone(), vec![limits.clone()])),
            }
        }
        let domains = parts
            .into_iter()
            .filter_map(|(domain, mut list)| {
                let limits = if list.len() == 1 {
                    list.pop()?
                } else {
                    match Limits::merge(&list) {
                        Ok(merged) => Arc::new(merged),
                        Err(e) => {
                            tracing::error!(%domain, "{e}");
                            list.into_iter().next()?
                        }
                    }
                };
                Some((domain, limits))
            })
            .collect();
        let mut read_headers: Vec<HeaderName> = Vec::new();
        for rule in files.iter().flat_map(|l| l.http_rules()) {
            let keyed = rule.by.iter().filter_map(|p| match p {
                Part::Header(name) => Some(name),
                _ => None,
            });
            let matched = rule.matcher.headers.iter().map(|(name, _)| name);
            let costed = match &rule.cost {
                Cost::Header(name) => Some(name),
                Cost::Fixed(_) => None,
            };
            for name in keyed.chain(matched).chain(costed) {
                if !read_headers.contains(name) {
                    read_headers.push(name.clone());
                }
            }
        }
        let underscore_read = read_headers.iter().any(|r| r.as_str().contains('_'));
        Catalog {
            files,
            domains,
            read_headers,
            underscore_read,
        }
    }

    /// The fields of `headers` named as a header some HTTP rule reads, but
    /// spelled with `_` for `-` or the other way round (`X_Api_Key` for
    /// `x-api-key`): CGI-style servers (Rack, PHP, WSGI) read both
    /// spellings as one, so one the rule never sees could carry the key, or
    /// a second key beside the counted one, to the upstream. The proxy
    /// drops them, as NGINX drops every name with `_` by default
    /// (`underscores_in_headers off`).
    pub fn respelled_headers(&self, headers: Fields<'_>) -> Vec<HeaderName> {
        if self.read_headers.is_empty() {
            return Vec::new();
        }
        // Most requests have no `_` in any name, and most rules read none.
        // A name a rule reads itself is kept (rules reading both
        // `x-api-key` and `x_api_key` see each as the other's respelling).
        headers
            .names()
            .filter(|name| self.underscore_read || name.contains(&b'_'))
            .filter_map(|name| std::str::from_utf8(name).ok())
            .filter(|name| {
                self.read_headers.iter().any(|read| respells(read.as_str(), name))
                    && !self.read_headers.iter().any(|read| read.as_str() == *name)
            })
            .filter_map(|name| HeaderName::from_bytes(name.as_bytes()).ok())
            .collect()
    }

    /// A catalog shared for swapping.
    pub fn shared(self) -> SharedCatalog {
        Arc::new(ArcSwap::from_pointee(self))
    }

    /// Every file's limits, in the order their HTTP rules apply.
    pub fn files(&self) -> &[Arc<Limits>] {
        &self.files
    }

    /// The limits in force for an Envoy RLS `domain`.
    pub fn domain(&self, domain: &str) -> Option<&Arc<Limits>> {
        self.domains.get(domain)
    }

    /// The counters an HTTP request touches, across every file.
    pub fn http_hits(&self, req: &RequestInfo<'_>) -> Result<Vec<Hit>, RequestError> {
        let mut hits = Vec::new();
        super::http::each_file_hits(&self.files, req, &mut hits)?;
        Ok(hits)
    }
}

/// Whether `name` is `read` with some `-` written `_` or some `_` written
/// `-` (both lower case, as `HeaderName`s are).
fn respells(read: &str, name: &str) -> bool {
    let dash = |b: u8| if b == b'_' { b'-' } else { b };
    read != name
        && read.len() == name.len()
        && read.bytes().zip(name.bytes()).all(|(r, n)| dash(r) == dash(n))
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;

    #[test]
    fn a_respelling_is_removed_unless_a_rule_reads_that_name_too() {
        let one = Catalog::new(vec![limits(
            "domain: a\nrules:\n  - name: k\n    by: [header:x-api-key]\n    limits: [{requests: 1, per: 1m}]\n",
        )]);
        let mut headers = HeaderMap::new();
        for name in ["x-api-key", "x_api_key", "x-api_key", "x-other_key"] {
            headers.insert(HeaderName::from_static(name), "v".parse().unwrap());
        }
        let removed = |c: &Catalog| {
            let mut names: Vec<String> = c.respelled_headers(Fields::Map(&headers)).iter().map(|n| n.to_string()).collect();
            names.sort();
            names
        };
        assert_eq!(removed(&one), ["x-api_key", "x_api_key"]);
        let both = Catalog::new(vec![limits(
            "domain: a\nrules:\n  - name: k\n    by: [header:x-api-key]\n    limits: [{requests: 1, per: 1m}]\n  - name: u\n    by: [header:x_api_key]\n    limits: [{requests: 1, per: 1m}]\n",
        )]);
        assert_eq!(removed(&both), ["x-api_key"], "both read: each kept");
    }

    #[test]
    fn respellings_are_told_apart_from_the_names_rules_read() {
        assert!(respells("x-api-key", "x_api_key"));
        assert!(respells("x-api-key", "x-api_key"));
        assert!(respells("x_tenant", "x-tenant"));
        assert!(!respells("x-api-key", "x-api-key"), "the name itself");
        assert!(!respells("x-api-key", "x_api_keys"));
        assert!(!respells("x-api-key", "x.api.key"));
    }

    fn limits(text: &str) -> Arc<Limits> {
        Arc::new(crate::config::parse_str(text, "t.yaml").unwrap())
    }

    #[test]
    fn files_of_one_domain_answer_as_one_and_http_rules_keep_file_order() {
        let a = limits("domain: d\ndescriptors:\n  - key: a\n    rate_limit: {unit: second, requests_per_unit: 1}\n");
        let b = limits("domain: d\ndescriptors:\n  - key: b\n    rate_limit: {unit: second, requests_per_unit: 2}\n");
        let c = limits("domain: e\nrules:\n  - name: r\n    limits: [{requests: 1, per: 1s}]\n");
        let catalog = Catalog::new(vec![a, b, c.clone()]);
        let d = catalog.domain("d").unwrap();
        assert_eq!(d.rules.len(), 2, "both files' limits answer for the domain");
        assert_eq!(catalog.files().len(), 3);
        assert!(Arc::ptr_eq(catalog.domain("e").unwrap(), &c));
        assert!(catalog.domain("f").is_none());
    }
}
