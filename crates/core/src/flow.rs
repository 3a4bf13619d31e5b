//! Fleet-wide flow control, the pure part: provider limits, the lease
//! record that splits them between workers, and how one worker's slice is
//! decided.
//!
//! A limit is a rate (requests and tokens per minute, enforced as per
//! second) and a number of slots (concurrent requests). Each worker holds a
//! *lease*: a slice of every limit of one provider key, valid until a time,
//! written into the key's one record with a revision-conditioned write. The
//! sum of the live leases never exceeds the limits (each write takes at
//! most what the others leave free), and a worker that stops renewing
//! gives its slice back when its lease ends.
//!
//! A worker's slice is its *entitlement*, the max-min fair share of the
//! limit over every live worker's want (water filling: who wants less than
//! an equal share gets it, the rest is split evenly among the others),
//! bounded by what is free now. A worker holding more than it is entitled
//! to gives the excess back at its next renewal, so a newcomer's share
//! arrives within one renewal period.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A provider key's limits (`None`: that dimension is unlimited).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Limits {
    /// Requests per minute.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rpm: Option<u64>,
    /// Tokens per minute, input and output together.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tpm: Option<u64>,
    /// Concurrent requests.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<u64>,
}

impl Limits {
    pub fn is_empty(&self) -> bool {
        self.rpm.is_none() && self.tpm.is_none() && self.concurrency.is_none()
    }

    /// Parses one limit value: a whole number above 0.
    pub fn parse_value(name: &str, v: &str) -> Result<u64, String> {
        match v.trim().parse::<u64>() {
            Ok(0) => Err(format!(
                "{name}: 0 would stop every request; clear the limit instead"
            )),
            Ok(n) if n > 1_000_000_000_000 => Err(format!("{name}: {n} is too large")),
            Ok(n) => Ok(n),
            Err(_) => Err(format!("{name}: {v:?} is not a whole number above 0")),
        }
    }

    /// Checks a decoded value the way [`Limits::parse_value`] does.
    pub fn validate(&self) -> Result<(), String> {
        for (name, v) in [
            ("rpm", self.rpm),
            ("tpm", self.tpm),
            ("concurrency", self.concurrency),
        ] {
            if let Some(v) = v {
                Self::parse_value(name, &v.to_string())?;
            }
        }
        Ok(())
    }

    /// As a per-second [`Slice`] (unlimited dimensions are `f64::INFINITY`
    /// and `u64::MAX`).
    pub fn as_slice(&self) -> Slice {
        Slice {
            requests_per_sec: self.rpm.map_or(f64::INFINITY, |r| r as f64 / 60.0),
            tokens_per_sec: self.tpm.map_or(f64::INFINITY, |t| t as f64 / 60.0),
            concurrency: self.concurrency.unwrap_or(u64::MAX),
        }
    }
}

/// An amount of every limit: what a worker holds or wants.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Slice {
    pub requests_per_sec: f64,
    pub tokens_per_sec: f64,
    pub concurrency: u64,
}

impl Slice {
    /// A share `1/n` of `self` (slots rounded down, at least 1).
    pub fn share(&self, n: u64) -> Slice {
        let n = n.max(1);
        Slice {
            requests_per_sec: self.requests_per_sec / n as f64,
            tokens_per_sec: self.tokens_per_sec / n as f64,
            concurrency: if self.concurrency == u64::MAX {
                u64::MAX
            } else {
                (self.concurrency / n).max(1)
            },
        }
    }

    /// A fraction of `self` (slots rounded down, at least 1).
    pub fn fraction(&self, f: f64) -> Slice {
        Slice {
            requests_per_sec: self.requests_per_sec * f,
            tokens_per_sec: self.tokens_per_sec * f,
            concurrency: if self.concurrency == u64::MAX {
                u64::MAX
            } else {
                ((self.concurrency as f64 * f).floor() as u64).max(1)
            },
        }
    }
}

/// One worker's lease in the record.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Lease {
    /// What it holds.
    pub held: Slice,
    /// What it asked for (its demand, for the others' fair shares).
    pub want: Slice,
    /// When it ends, ms since the Unix epoch (the writer's clock).
    pub until_ms: u64,
}

/// Who the provider key is (never the credential itself).
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ProviderInfo {
    pub base_url: String,
    pub model: String,
    /// A short SHA-256 of the credential (`none` without one).
    pub credential: String,
}

/// The record of one provider key's leases (`lh_flow` key `lease.<id>`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LeaseRecord {
    #[serde(default)]
    pub provider: ProviderInfo,
    /// By worker id.
    #[serde(default)]
    pub leases: BTreeMap<String, Lease>,
}

impl LeaseRecord {
    /// Drops the leases that ended by `now_ms`.
    pub fn expire(&mut self, now_ms: u64) {
        self.leases.retain(|_, l| l.until_ms > now_ms);
    }

    /// The live workers' count (at least 1: the caller).
    pub fn workers(&self, me: &str) -> u64 {
        self.leases.len() as u64 + u64::from(!self.leases.contains_key(me))
    }

    /// Writes `me`'s lease for `want` under `limits`: what it may hold
    /// from now to `until_ms`. Expired leases are dropped first. A zero
    /// want removes the lease.
    pub fn grant(
        &mut self,
        me: &str,
        limits: &Limits,
        want: Slice,
        now_ms: u64,
        until_ms: u64,
    ) -> Slice {
        self.expire(now_ms);
        self.leases.remove(me);
        if want.requests_per_sec <= 0.0 && want.tokens_per_sec <= 0.0 && want.concurrency == 0 {
            return Slice::default();
        }
        let total = limits.as_slice();
        let others: Vec<&Lease> = self.leases.values().collect();
        let held = |f: fn(&Slice) -> f64| others.iter().map(|l| f(&l.held)).sum::<f64>();
        let wants = |f: fn(&Slice) -> f64| others.iter().map(|l| f(&l.want)).collect::<Vec<f64>>();
        let rate = |f: fn(&Slice) -> f64| {
            let limit = f(&total);
            if limit.is_infinite() {
                return f64::INFINITY;
            }
            let free = (limit - held(f)).max(0.0);
            fair(limit, &wants(f), f(&want)).min(free)
        };
        let requests_per_sec = rate(|s| s.requests_per_sec);
        let tokens_per_sec = rate(|s| s.tokens_per_sec);
        let concurrency = if total.concurrency == u64::MAX {
            u64::MAX
        } else {
            let c = |s: &Slice| s.concurrency as f64;
            let free = total
                .concurrency
                .saturating_sub(others.iter().map(|l| l.held.concurrency).sum());
            let w: Vec<f64> = others.iter().map(|l| c(&l.want)).collect();
            let share = (fair(total.concurrency as f64, &w, c(&want)).floor() as u64).min(free);
            // Slots are whole: a share below one is one while one is free.
            if share == 0 && want.concurrency > 0 && free > 0 {
                1
            } else {
                share
            }
        };
        let got = Slice {
            requests_per_sec,
            tokens_per_sec,
            concurrency,
        };
        // Unlimited dimensions are not written as infinities (JSON has none).
        let finite = |v: f64| if v.is_finite() { v } else { 0.0 };
        self.leases.insert(
            me.to_string(),
            Lease {
                held: Slice {
                    requests_per_sec: finite(got.requests_per_sec),
                    tokens_per_sec: finite(got.tokens_per_sec),
                    concurrency: if got.concurrency == u64::MAX {
                        0
                    } else {
                        got.concurrency
                    },
                },
                want: Slice {
                    requests_per_sec: finite(want.requests_per_sec),
                    tokens_per_sec: finite(want.tokens_per_sec),
                    concurrency: if want.concurrency == u64::MAX {
                        0
                    } else {
                        want.concurrency
                    },
                },
                until_ms,
            },
        );
        got
    }
}

/// Max-min fair share of `limit` for a worker wanting `mine` while the
/// others want `others`: water filling.
pub fn fair(limit: f64, others: &[f64], mine: f64) -> f64 {
    let mut all: Vec<f64> = others.iter().copied().chain([mine]).collect();
    if all.iter().sum::<f64>() <= limit {
        return mine;
    }
    all.sort_by(|a, b| a.total_cmp(b));
    let mut left = limit;
    let mut n = all.len() as f64;
    for w in all {
        let share = left / n;
        if w >= share {
            // Everyone from here on (mine included, if not yet served) gets `share`.
            return mine.min(share);
        }
        left -= w;
        n -= 1.0;
    }
    mine
}

/// The cooldown of a provider key (`lh_flow` key `cool.<id>`) or its open
/// circuit breaker (`breaker.<id>`): every worker waits until `until_ms`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pause {
    pub until_ms: u64,
    /// Why (the provider's error, or the breaker's cause).
    pub reason: String,
    /// The worker that saw it.
    pub by: String,
    #[serde(default)]
    pub provider: ProviderInfo,
}

/// The id of a tenant's running-jobs limit in `lh_limits` (its
/// `concurrency` is how many of the tenant's jobs the fleet runs at once;
/// its entry's `weight` is the tenant's share under contention).
pub fn tenant_jobs_key(tenant: &str) -> String {
    format!("tenant.{tenant}.jobs")
}

/// The id of a tenant's model-request limits in `lh_limits` (concurrent
/// requests, requests and tokens per minute of all the tenant's jobs,
/// across every provider).
pub fn tenant_model_key(tenant: &str) -> String {
    format!("tenant.{tenant}.model")
}

/// The tenant and what (`jobs` or `model`) a tenant key names.
pub fn tenant_of_key(id: &str) -> Option<(&str, &str)> {
    let rest = id.strip_prefix("tenant.")?;
    let (t, what) = rest.rsplit_once('.')?;
    matches!(what, "jobs" | "model").then_some((t, what))
}

/// A provider key's id and what it names: SHA-256 of the base URL (without
/// a trailing `/`), the model and a SHA-256 of the credential; the id is the
/// first 16 hex digits, safe as a KV key. The credential is never stored.
pub fn provider_key(
    base_url: &str,
    model: &str,
    credential: Option<&str>,
) -> (String, ProviderInfo) {
    use sha2::{Digest, Sha256};
    let base_url = base_url.trim_end_matches('/').to_string();
    let credential = match credential.filter(|c| !c.is_empty()) {
        Some(c) => {
            hex::encode(Sha256::digest(format!("leasehold credential\n{c}")))[..12].to_string()
        }
        None => "none".to_string(),
    };
    let id =
        hex::encode(Sha256::digest(format!("{base_url}\n{model}\n{credential}")))[..16].to_string();
    (
        id,
        ProviderInfo {
            base_url,
            model: model.to_string(),
            credential,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn want(r: f64, c: u64) -> Slice {
        Slice {
            requests_per_sec: r,
            tokens_per_sec: r * 100.0,
            concurrency: c,
        }
    }

    #[test]
    fn fair_is_water_filling() {
        assert_eq!(fair(10.0, &[2.0, 3.0], 4.0), 4.0);
        assert_eq!(fair(10.0, &[1.0, 20.0], 20.0), 4.5);
        assert_eq!(fair(10.0, &[20.0, 20.0, 20.0], 20.0), 2.5);
        assert_eq!(fair(10.0, &[20.0], 1.0), 1.0);
    }

    #[test]
    fn leases_never_exceed_the_limit_and_converge_to_fair_shares() {
        let limits = Limits {
            rpm: Some(600),
            tpm: Some(60_000),
            concurrency: Some(8),
        };
        let mut rec = LeaseRecord::default();
        // The first worker takes everything it wants (all of it).
        let a = rec.grant("a", &limits, want(100.0, 16), 0, 3000);
        assert_eq!(a.requests_per_sec, 10.0);
        assert_eq!(a.concurrency, 8);
        // The second finds nothing free until a renews.
        let b = rec.grant("b", &limits, want(100.0, 16), 100, 3100);
        assert_eq!((b.requests_per_sec, b.concurrency), (0.0, 0));
        let a = rec.grant("a", &limits, want(100.0, 16), 1000, 4000);
        assert_eq!((a.requests_per_sec, a.concurrency), (5.0, 4));
        let b = rec.grant("b", &limits, want(100.0, 16), 1100, 4100);
        assert_eq!((b.requests_per_sec, b.concurrency), (5.0, 4));
        let sum: f64 = rec.leases.values().map(|l| l.held.requests_per_sec).sum();
        assert!(sum <= 10.0);
        // One slot between two who want it: whoever finds it free holds it.
        let one = Limits {
            rpm: None,
            tpm: None,
            concurrency: Some(1),
        };
        let mut r1 = LeaseRecord::default();
        assert_eq!(r1.grant("x", &one, want(1.0, 1), 0, 3000).concurrency, 1);
        assert_eq!(r1.grant("y", &one, want(1.0, 1), 10, 3010).concurrency, 0);
        assert_eq!(r1.grant("x", &one, want(1.0, 1), 1000, 4000).concurrency, 1);
        assert_eq!(r1.grant("y", &one, want(1.0, 1), 3500, 6500).concurrency, 0);
        // x gone (its lease ended at 4000): y takes it.
        assert_eq!(r1.grant("y", &one, want(1.0, 1), 4001, 7001).concurrency, 1);
        // b stops renewing (killed): its slice is free once its lease ended.
        let a = rec.grant("a", &limits, want(100.0, 16), 4200, 7200);
        assert_eq!((a.requests_per_sec, a.concurrency), (10.0, 8));
        assert_eq!(rec.workers("a"), 1);
        // A zero want gives everything back.
        rec.grant("a", &limits, Slice::default(), 5000, 8000);
        assert!(rec.leases.is_empty());
    }

    #[test]
    fn limit_values_are_checked() {
        assert_eq!(Limits::parse_value("rpm", "60"), Ok(60));
        assert!(Limits::parse_value("rpm", "0")
            .unwrap_err()
            .contains("clear"));
        assert!(Limits::parse_value("tpm", "-3")
            .unwrap_err()
            .contains("whole number"));
        assert!(Limits::parse_value("tpm", "1.5")
            .unwrap_err()
            .contains("whole number"));
        assert!(serde_json::from_str::<Limits>(r#"{"rpm": 5, "rps": 1}"#).is_err());
    }
}
