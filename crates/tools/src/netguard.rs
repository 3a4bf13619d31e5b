//! Which network destinations `fetch` may reach.
//!
//! A model chooses the URLs `fetch` opens, so a page (or a prompt injection
//! in one) must not be able to point it at the machine itself, the private
//! network, or a cloud metadata service. The guard is applied to the
//! resolved addresses of every hop, before any connection is made, and the
//! connection is then pinned to the address that was checked so a second
//! DNS answer cannot swap it (DNS rebinding).
//!
//! Refused unless allow-listed: unspecified, loopback, private (RFC 1918),
//! shared/CGNAT (100.64/10), link-local (169.254/16, fe80::/10, which
//! includes the metadata address 169.254.169.254), unique-local (fc00::/7,
//! which includes fd00:ec2::254), multicast, broadcast, documentation and
//! reserved ranges, and IPv4-mapped/NAT64 forms of any of those.
//!
//! `LH_FETCH_ALLOW` is a comma-separated list of host names (matched
//! exactly, case-insensitively, before resolution) and IP addresses or CIDRs
//! (matched against the resolved address).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use ipnet::IpNet;

/// The allow-list of `fetch`: exact host names and networks.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowList {
    pub hosts: Vec<String>,
    pub nets: Vec<IpNet>,
}

/// `host,10.0.0.0/8` as [`AllowList::parse`] reads it; `none` when empty.
impl std::fmt::Display for AllowList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.hosts.is_empty() && self.nets.is_empty() {
            return f.write_str("none");
        }
        let items: Vec<String> = self
            .hosts
            .iter()
            .cloned()
            .chain(self.nets.iter().map(IpNet::to_string))
            .collect();
        f.write_str(&items.join(","))
    }
}

impl AllowList {
    /// Parses `host,10.0.0.0/8,127.0.0.1,...`; an IP address is a /32 or /128.
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut out = AllowList::default();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            if let Ok(net) = item.parse::<IpNet>() {
                out.nets.push(net);
            } else if let Ok(ip) = item.trim_matches(['[', ']']).parse::<IpAddr>() {
                out.nets.push(IpNet::from(ip));
            } else if item.contains('/') {
                return Err(format!("LH_FETCH_ALLOW: `{item}` is not a valid CIDR"));
            } else {
                out.hosts.push(item.to_ascii_lowercase());
            }
        }
        Ok(out)
    }

    pub fn is_empty(&self) -> bool {
        self.hosts.is_empty() && self.nets.is_empty()
    }

    /// The list in `LH_FETCH_ALLOW` syntax.
    pub fn display(&self) -> String {
        let mut parts: Vec<String> = self.hosts.clone();
        parts.extend(self.nets.iter().map(|n| n.to_string()));
        parts.join(",")
    }
}

/// Decides whether a host and its addresses may be contacted.
#[derive(Debug, Clone, Default)]
pub struct NetGuard {
    allow: AllowList,
}

impl NetGuard {
    pub fn new(allow: AllowList) -> Self {
        NetGuard { allow }
    }

    pub fn allow_list(&self) -> &AllowList {
        &self.allow
    }

    /// Whether the host name itself is allow-listed (then any address is fine).
    pub fn host_allowed(&self, host: &str) -> bool {
        let h = host.trim_end_matches('.').to_ascii_lowercase();
        self.allow.hosts.contains(&h)
    }

    /// `Err(reason)` when `ip` must not be contacted.
    pub fn check_ip(&self, ip: IpAddr) -> Result<(), String> {
        if self.allow.nets.iter().any(|n| n.contains(&ip)) {
            return Ok(());
        }
        match forbidden_reason(ip) {
            Some(why) => Err(format!("{ip} is a {why} address")),
            None => Ok(()),
        }
    }
}

/// Why an address is not a public destination, or `None` when it is.
pub fn forbidden_reason(ip: IpAddr) -> Option<&'static str> {
    match ip {
        IpAddr::V4(v4) => forbidden_v4(v4),
        IpAddr::V6(v6) => forbidden_v6(v6),
    }
}

fn forbidden_v4(ip: Ipv4Addr) -> Option<&'static str> {
    let o = ip.octets();
    if ip == Ipv4Addr::new(169, 254, 169, 254) {
        return Some("cloud metadata");
    }
    if ip.is_unspecified() || o[0] == 0 {
        return Some("unspecified");
    }
    if ip.is_loopback() {
        return Some("loopback");
    }
    if ip.is_private() {
        return Some("private");
    }
    if ip.is_link_local() {
        return Some("link-local");
    }
    if o[0] == 100 && (o[1] & 0xc0) == 64 {
        return Some("shared (CGNAT)");
    }
    if ip.is_broadcast() || ip.is_multicast() {
        return Some("broadcast/multicast");
    }
    if ip.is_documentation()
        || (o[0] == 192 && o[1] == 0 && o[2] == 0)
        || (o[0] == 198 && (o[1] & 0xfe) == 18)
    {
        return Some("reserved");
    }
    if o[0] >= 240 {
        return Some("reserved");
    }
    None
}

fn forbidden_v6(ip: Ipv6Addr) -> Option<&'static str> {
    let s = ip.segments();
    if ip == Ipv6Addr::new(0xfd00, 0x0ec2, 0, 0, 0, 0, 0, 0x254) {
        return Some("cloud metadata");
    }
    if ip.is_unspecified() {
        return Some("unspecified");
    }
    if ip.is_loopback() {
        return Some("loopback");
    }
    // IPv4-mapped (::ffff:a.b.c.d) and NAT64 (64:ff9b::/96) carry an IPv4
    // destination: judge that one.
    if let Some(v4) = ip.to_ipv4_mapped() {
        return forbidden_v4(v4);
    }
    if s[0] == 0x64 && s[1] == 0xff9b && s[2..6] == [0, 0, 0, 0] {
        let v4 = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
        return forbidden_v4(v4);
    }
    if (s[0] & 0xfe00) == 0xfc00 {
        return Some("unique-local");
    }
    if (s[0] & 0xffc0) == 0xfe80 {
        return Some("link-local");
    }
    if (s[0] & 0xffc0) == 0xfec0 {
        return Some("site-local");
    }
    if (s[0] & 0xff00) == 0xff00 {
        return Some("multicast");
    }
    if s[0] == 0x2001 && s[1] == 0x0db8 {
        return Some("documentation");
    }
    // Other IPv4-compatible forms (::a.b.c.d, deprecated).
    if s[0..6] == [0, 0, 0, 0, 0, 0] {
        return Some("reserved");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refused(s: &str) -> bool {
        NetGuard::default().check_ip(s.parse().unwrap()).is_err()
    }

    #[test]
    fn private_and_special_addresses_are_refused() {
        for a in [
            "127.0.0.1",
            "127.1.2.3",
            "::1",
            "10.0.0.1",
            "172.16.5.4",
            "192.168.1.1",
            "169.254.169.254",
            "169.254.1.1",
            "0.0.0.0",
            "100.64.0.1",
            "fd00:ec2::254",
            "fc00::1",
            "fe80::1",
            "::ffff:127.0.0.1",
            "::ffff:10.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "224.0.0.1",
            "255.255.255.255",
            "::",
        ] {
            assert!(refused(a), "{a} should be refused");
        }
        for a in [
            "93.184.216.34",
            "1.1.1.1",
            "2606:4700:4700::1111",
            "8.8.8.8",
        ] {
            assert!(!refused(a), "{a} should be allowed");
        }
    }

    #[test]
    fn allow_list_admits_hosts_and_networks() {
        let allow = AllowList::parse("sim.local, 127.0.0.1, 10.0.0.0/8, [::1]").unwrap();
        assert_eq!(allow.hosts, vec!["sim.local".to_string()]);
        let g = NetGuard::new(allow);
        assert!(g.host_allowed("SIM.local"));
        assert!(!g.host_allowed("localhost"));
        assert!(g.check_ip("127.0.0.1".parse().unwrap()).is_ok());
        assert!(g.check_ip("127.0.0.2".parse().unwrap()).is_err());
        assert!(g.check_ip("10.9.9.9".parse().unwrap()).is_ok());
        assert!(g.check_ip("::1".parse().unwrap()).is_ok());
        assert!(g.check_ip("169.254.169.254".parse().unwrap()).is_err());
        assert!(AllowList::parse("10.0.0.0/99").is_err());
    }
}
