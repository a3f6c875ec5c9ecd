//! Who the client is: the socket peer, or what a trusted proxy says it is.
//!
//! Forwarding headers are believed only from configured proxy addresses, as
//! NGINX's `real_ip` module with `real_ip_recursive on`: walk
//! `X-Forwarded-For` from the right and take the first address that is not a
//! trusted proxy. Anything else could be spoofed by the caller.

use std::cell::RefCell;
use std::net::IpAddr;

use http::HeaderName;

use crate::fields::Fields;

static X_FORWARDED_FOR: HeaderName = HeaderName::from_static("x-forwarded-for");
static X_REAL_IP: HeaderName = HeaderName::from_static("x-real-ip");
use ipnet::IpNet;

/// The proxies whose forwarding headers are believed.
#[derive(Debug, Clone, Default)]
pub struct TrustedProxies {
    nets: Vec<IpNet>,
}

/// A `--trusted-proxies` entry that is neither an address nor a CIDR.
#[derive(Debug, thiserror::Error)]
#[error("\"{0}\" is not an IP address or CIDR")]
pub struct BadCidr(String);

impl TrustedProxies {
    /// Parses addresses and CIDRs (`10.0.0.0/8`, `127.0.0.1`, `::1`).
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Self, BadCidr> {
        let nets = entries
            .iter()
            .map(|e| e.as_ref().trim())
            .filter(|e| !e.is_empty())
            .map(|e| {
                e.parse::<IpNet>()
                    .or_else(|_| e.parse::<IpAddr>().map(IpNet::from))
                    .map_err(|_| BadCidr(e.to_string()))
            })
            .collect::<Result<_, _>>()?;
        Ok(TrustedProxies { nets })
    }

    /// Whether `ip` is one of the trusted proxies.
    pub fn trusts(&self, ip: IpAddr) -> bool {
        let ip = ip.to_canonical();
        self.nets.iter().any(|n| n.contains(&ip))
    }

    /// The client address for a request that arrived from `peer`.
    pub fn client_ip(&self, peer: IpAddr, headers: Fields<'_>) -> IpAddr {
        let peer = peer.to_canonical();
        if !self.trusts(peer) {
            return peer;
        }
        let forwarded: Vec<&[u8]> = headers
            .get_all(&X_FORWARDED_FOR)
            .flat_map(|v| v.split(|b| *b == b','))
            .collect();
        if !forwarded.is_empty() {
            let mut client = peer;
            for hop in forwarded.iter().rev() {
                match parse_ip(hop) {
                    Some(ip) if self.trusts(ip) => client = ip,
                    Some(ip) => return ip,
                    // A malformed hop ends the walk: what lies left of it is unknowable.
                    None => return client,
                }
            }
            return client;
        }
        headers.get(&X_REAL_IP).and_then(parse_ip).unwrap_or(peer)
    }
}

/// An address as forwarding headers carry it: bare, or with a port
/// (`203.0.113.7:41000`, `[2001:db8::1]:443`, as some load balancers write
/// them), or a bracketed IPv6 address without one.
fn parse_ip(bytes: &[u8]) -> Option<IpAddr> {
    let text = std::str::from_utf8(bytes).ok()?.trim();
    text.parse::<IpAddr>()
        .ok()
        .or_else(|| text.parse::<std::net::SocketAddr>().ok().map(|a| a.ip()))
        .or_else(|| {
            text.strip_prefix('[')
                .and_then(|t| t.strip_suffix(']'))
                .and_then(|t| t.parse::<std::net::Ipv6Addr>().ok())
                .map(IpAddr::V6)
        })
        .map(|ip| ip.to_canonical())
}

/// An address as text. Keep-alive clients send many requests from one
/// address, so each thread keeps the last one it formatted (formatting an
/// address costs more than the rest of building its key).
pub fn ip_text(ip: IpAddr) -> String {
    thread_local! {
        static LAST: RefCell<Option<(IpAddr, String)>> = const { RefCell::new(None) };
    }
    LAST.with_borrow_mut(|last| match last {
        Some((cached, text)) if *cached == ip => text.clone(),
        _ => {
            let text = ip.to_string();
            *last = Some((ip, text.clone()));
            text
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderMap;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(http::HeaderName::from_bytes(k.as_bytes()).unwrap(), v.parse().unwrap());
        }
        h
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn untrusted_peers_cannot_spoof() {
        let t = TrustedProxies::parse(&["10.0.0.0/8"]).unwrap();
        let h = headers(&[("x-forwarded-for", "1.2.3.4"), ("x-real-ip", "5.6.7.8")]);
        assert_eq!(t.client_ip(ip("192.0.2.1"), crate::fields::Fields::Map(&h)), ip("192.0.2.1"));
    }

    #[test]
    fn walks_forwarded_for_from_the_right() {
        let t = TrustedProxies::parse(&["10.0.0.0/8", "127.0.0.1"]).unwrap();
        // The caller put 6.6.6.6 in themselves; 203.0.113.9 is what our proxy saw.
        let h = headers(&[
            ("x-forwarded-for", "6.6.6.6, 203.0.113.9"),
            ("x-forwarded-for", "10.1.1.1"),
        ]);
        assert_eq!(t.client_ip(ip("127.0.0.1"), crate::fields::Fields::Map(&h)), ip("203.0.113.9"));
        let all_trusted = headers(&[("x-forwarded-for", "10.0.0.2, 10.0.0.3")]);
        assert_eq!(t.client_ip(ip("127.0.0.1"), crate::fields::Fields::Map(&all_trusted)), ip("10.0.0.2"));
        let garbage = headers(&[("x-forwarded-for", "nonsense, 10.0.0.3")]);
        assert_eq!(t.client_ip(ip("127.0.0.1"), crate::fields::Fields::Map(&garbage)), ip("10.0.0.3"));
        // Load balancers that append the client's port (Azure App Gateway)
        // still name one client each, not the proxy for all of them.
        for (hop, client) in [
            ("203.0.113.9:41000", "203.0.113.9"),
            ("[2001:db8::1]:443", "2001:db8::1"),
            ("[2001:db8::2]", "2001:db8::2"),
        ] {
            let h = headers(&[("x-forwarded-for", hop)]);
            assert_eq!(t.client_ip(ip("127.0.0.1"), crate::fields::Fields::Map(&h)), ip(client), "{hop}");
        }
    }

    #[test]
    fn real_ip_and_mapped_addresses() {
        let t = TrustedProxies::parse(&["::1", "127.0.0.0/8"]).unwrap();
        let h = headers(&[("x-real-ip", "198.51.100.7")]);
        assert_eq!(t.client_ip(ip("::1"), crate::fields::Fields::Map(&h)), ip("198.51.100.7"));
        assert_eq!(t.client_ip(ip("::ffff:127.0.0.1"), crate::fields::Fields::Map(&h)), ip("198.51.100.7"));
        assert_eq!(t.client_ip(ip("::ffff:192.0.2.1"), crate::fields::Fields::Map(&h)), ip("192.0.2.1"));
        assert!(TrustedProxies::parse(&["10.0.0.0/33"]).is_err());
    }
}
