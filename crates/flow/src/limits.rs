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
//! A lease's age is judged by each reader in its own clock ([`Renewals`]):
//! from when it saw the lease's renewal count change, never by the
//! writer's wall clock, so no two hosts' clocks are compared. The writer
//! stops using its slice a margin before the earliest moment any reader
//! can consider it ended.
//!
//! A slice below one request per second cannot hold a whole request in a
//! bucket of one second: such workers take turns on the fleet's request
//! [`Grid`] instead (one slot per request the fleet's limit allows, each
//! slot one worker's), so the fleet never fires together.
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
    /// When it ends, ms since the Unix epoch by the writer's clock: shown
    /// by `leasehold limits list`, never compared with another host's
    /// clock (readers judge a lease's age with [`Renewals`]).
    pub until_ms: u64,
    /// The writer's count of its writes: a reader sees the lease renewed
    /// when this changes.
    #[serde(default)]
    pub renewal: u64,
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
    /// Drops the leases whose writers' clocks say they ended by `now_ms`:
    /// an estimate for display (`leasehold limits list`) only; a worker
    /// decides with [`Renewals::expire`].
    pub fn expire_by_writers_clocks(&mut self, now_ms: u64) {
        self.leases.retain(|_, l| l.until_ms > now_ms);
    }

    /// Where `me`'s requests go on the fleet's request grid, by the leases'
    /// held rates (`None` without a request limit or a held rate): its
    /// share of the slots, and as offset the shares of the workers before
    /// it by id, so the live leases' ranges never overlap.
    pub fn grid(&self, me: &str, limits: &Limits) -> Option<Grid> {
        let total = limits.as_slice().requests_per_sec;
        if !total.is_finite() || total <= 0.0 {
            return None;
        }
        let share = |l: &Lease| (l.held.requests_per_sec / total).clamp(0.0, 1.0);
        let mine = share(self.leases.get(me)?);
        if mine <= 0.0 {
            return None;
        }
        let offset: f64 = self
            .leases
            .iter()
            .take_while(|(w, _)| w.as_str() < me)
            .map(|(_, l)| share(l))
            .sum();
        Some(Grid {
            rate: total,
            offset: offset.min(1.0),
            share: mine,
        })
    }

    /// The live workers' count (at least 1: the caller).
    pub fn workers(&self, me: &str) -> u64 {
        self.leases.len() as u64 + u64::from(!self.leases.contains_key(me))
    }

    /// Writes `me`'s lease for `want` under `limits`: what it may hold
    /// for the lease period (`until_ms` by its own clock, shown only;
    /// `renewal`, its write count). The caller drops the ended leases
    /// first ([`Renewals::expire`]). A zero want removes the lease.
    pub fn grant(
        &mut self,
        me: &str,
        limits: &Limits,
        want: Slice,
        until_ms: u64,
        renewal: u64,
    ) -> Slice {
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
                renewal,
            },
        );
        got
    }
}

/// One reader's view of the others' renewals, in its own clock: a lease
/// lives for the lease period from when this reader first saw its current
/// renewal count. The writer wrote it before that moment, and stops using
/// it a margin before its own write plus the period, so a reader never
/// takes a share its holder may still use, whatever the two hosts' wall
/// clocks say.
#[derive(Debug, Clone, Default)]
pub struct Renewals {
    /// By worker id: the renewal count seen and when it was first seen
    /// (ms of the reader's monotonic clock).
    seen: BTreeMap<String, (u64, u64)>,
}

impl Renewals {
    /// Notes `rec` as read at `now_ms` (the reader's monotonic clock, ms)
    /// and drops from it the leases, other than `me`'s, not renewed for
    /// `lease_ms` since this reader first saw them.
    pub fn expire(&mut self, rec: &mut LeaseRecord, me: &str, now_ms: u64, lease_ms: u64) {
        for (w, l) in &rec.leases {
            match self.seen.get_mut(w) {
                Some(s) if s.0 == l.renewal => {}
                Some(s) => *s = (l.renewal, now_ms),
                None => {
                    self.seen.insert(w.clone(), (l.renewal, now_ms));
                }
            }
        }
        self.seen.retain(|w, _| rec.leases.contains_key(w));
        let seen = &self.seen;
        rec.leases
            .retain(|w, _| w == me || seen.get(w).is_some_and(|s| now_ms < s.1 + lease_ms));
    }
}

/// A worker's place on the fleet's request grid: time is cut into slots of
/// `1 / rate` seconds (the fleet's request limit) counted from the Unix
/// epoch, and slot `k` belongs to the worker whose range
/// `[offset, offset + share)` holds `k * phi mod 1` (phi the golden ratio's
/// fraction: any share's slots are spread evenly, and each slot is one
/// worker's). A worker whose slice is below one request per second sends
/// only in its own slots, so the fleet sends at most one request per slot
/// and never all at once, after a pause as anywhere else. Each worker reads
/// its own wall clock: a skew between hosts shifts their slots (timing
/// only: each still keeps its own rate).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Grid {
    /// The fleet's requests per second (slots per second).
    pub rate: f64,
    /// Where this worker's range starts, in `[0, 1)`.
    pub offset: f64,
    /// Its width: this worker's share of the fleet's rate.
    pub share: f64,
}

impl Grid {
    /// The slot at `secs` since the Unix epoch.
    pub fn slot_at(&self, secs: f64) -> i64 {
        (secs * self.rate).floor() as i64
    }

    /// When slot `k` starts, in seconds since the Unix epoch.
    pub fn start_of(&self, k: i64) -> f64 {
        k as f64 / self.rate
    }

    /// Whether slot `k` is this worker's.
    pub fn owns(&self, k: i64) -> bool {
        // 2^64 / phi: the slots' positions k * phi mod 1, in fixed point.
        const PHI: u64 = 0x9E37_79B9_7F4A_7C15;
        let at = (k as u64).wrapping_mul(PHI);
        let fixed = |f: f64| (f.clamp(0.0, 1.0) * 2f64.powi(64)) as u64;
        let width = if self.share >= 1.0 {
            u64::MAX
        } else {
            fixed(self.share)
        };
        at.wrapping_sub(fixed(self.offset)) < width
    }

    /// This worker's first slot from `k` on (`None` within a million).
    pub fn next_from(&self, k: i64) -> Option<i64> {
        (k..k.saturating_add(1_000_000)).find(|&s| self.owns(s))
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

/// A concurrency a provider key was found to serve at most (`lh_flow` key
/// `learned.<id>`): a worker saw the provider cut a stream for another
/// request again and again (a server that runs one generation at a time
/// and interrupts the one in flight, as llama-cpp-python's server does by
/// default). Every worker applies it like a limit set by hand, and the
/// leases split it, unless a limit is set by hand (`leasehold limits set
/// --concurrency`, `LH_MODEL_CONCURRENCY`): what a person sets wins. It
/// stays until cleared (`leasehold limits clear ID --concurrency`): how
/// many requests a server serves at once is its configuration.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Learned {
    /// Requests the provider serves at once.
    pub concurrency: u64,
    /// What was seen.
    pub reason: String,
    /// The worker that saw it.
    pub by: String,
    /// When, ms since the Unix epoch by that worker's clock (shown only).
    pub at_ms: u64,
    #[serde(default)]
    pub provider: ProviderInfo,
}

/// Where a provider key's concurrency comes from, most binding first: a
/// limit set for the fleet (`leasehold limits set --concurrency`), this
/// process's setting (`LH_MODEL_CONCURRENCY`), then what the fleet learned.
/// `None`: unlimited.
pub fn concurrency_of(
    set: Option<u64>,
    configured: Option<u64>,
    learned: Option<u64>,
) -> Option<(u64, ConcurrencySource)> {
    set.map(|c| (c, ConcurrencySource::Set))
        .or(configured.map(|c| (c, ConcurrencySource::Configured)))
        .or(learned.map(|c| (c, ConcurrencySource::Learned)))
}

/// See [`concurrency_of`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ConcurrencySource {
    /// `leasehold limits set --concurrency`.
    Set,
    /// `LH_MODEL_CONCURRENCY`.
    Configured,
    /// [`Learned`].
    Learned,
}

impl ConcurrencySource {
    /// A person chose it (never moved by what is learned).
    pub fn by_hand(self) -> bool {
        !matches!(self, ConcurrencySource::Learned)
    }

    /// The setting that names it.
    pub fn setting(self) -> &'static str {
        match self {
            ConcurrencySource::Set => "`leasehold limits set --concurrency`",
            ConcurrencySource::Configured => "LH_MODEL_CONCURRENCY",
            ConcurrencySource::Learned => "the learned limit",
        }
    }
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
        let a = rec.grant("a", &limits, want(100.0, 16), 3000, 1);
        assert_eq!(a.requests_per_sec, 10.0);
        assert_eq!(a.concurrency, 8);
        // The second finds nothing free until a renews.
        let b = rec.grant("b", &limits, want(100.0, 16), 3100, 1);
        assert_eq!((b.requests_per_sec, b.concurrency), (0.0, 0));
        let a = rec.grant("a", &limits, want(100.0, 16), 4000, 2);
        assert_eq!((a.requests_per_sec, a.concurrency), (5.0, 4));
        let b = rec.grant("b", &limits, want(100.0, 16), 4100, 2);
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
        assert_eq!(r1.grant("x", &one, want(1.0, 1), 3000, 1).concurrency, 1);
        assert_eq!(r1.grant("y", &one, want(1.0, 1), 3010, 1).concurrency, 0);
        assert_eq!(r1.grant("x", &one, want(1.0, 1), 4000, 2).concurrency, 1);
        // y, by its own clock, sees x's renewal 2 at 1000: x's lease lives
        // until 4000 of y's clock.
        let mut seen_by_y = Renewals::default();
        seen_by_y.expire(&mut r1, "y", 1000, 3000);
        assert_eq!(r1.grant("y", &one, want(1.0, 1), 6500, 2).concurrency, 0);
        seen_by_y.expire(&mut r1, "y", 3999, 3000);
        assert_eq!(r1.grant("y", &one, want(1.0, 1), 6999, 3).concurrency, 0);
        // x gone (not renewed for 3000 of y's clock): y takes it.
        seen_by_y.expire(&mut r1, "y", 4000, 3000);
        assert_eq!(r1.grant("y", &one, want(1.0, 1), 7000, 4).concurrency, 1);
        // b stops renewing (killed): its slice is free once its lease ended
        // for a, who saw b's last renewal at 1100.
        let mut seen_by_a = Renewals::default();
        seen_by_a.expire(&mut rec, "a", 1100, 3000);
        seen_by_a.expire(&mut rec, "a", 4100, 3000);
        let a = rec.grant("a", &limits, want(100.0, 16), 7200, 3);
        assert_eq!((a.requests_per_sec, a.concurrency), (10.0, 8));
        assert_eq!(rec.workers("a"), 1);
        // A zero want gives everything back.
        rec.grant("a", &limits, Slice::default(), 8000, 4);
        assert!(rec.leases.is_empty());
    }

    /// G11: a writer whose wall clock is far behind (its `until_ms` long
    /// past by the reader's clock) keeps its lease while it renews, and
    /// loses it only a lease period of the reader's own clock after its
    /// last renewal.
    #[test]
    fn a_lease_lives_by_the_readers_clock_not_the_writers() {
        let limits = Limits {
            rpm: None,
            tpm: None,
            concurrency: Some(2),
        };
        let mut rec = LeaseRecord::default();
        let mut seen = Renewals::default();
        // "slow" writes until_ms = 5 (its clock is behind by decades).
        rec.grant("slow", &limits, want(1.0, 1), 5, 1);
        for (now, renewal) in [(1_000_000, 1), (1_001_000, 2), (1_002_000, 3)] {
            rec.leases.get_mut("slow").unwrap().renewal = renewal;
            seen.expire(&mut rec, "me", now, 3000);
            assert!(rec.leases.contains_key("slow"), "renewing: live at {now}");
            assert_eq!(rec.grant("me", &limits, want(1.0, 2), 0, 1).concurrency, 1);
        }
        // It stops renewing: ended 3 s (of this reader) after renewal 3.
        seen.expire(&mut rec, "me", 1_004_999, 3000);
        assert!(rec.leases.contains_key("slow"));
        seen.expire(&mut rec, "me", 1_005_000, 3000);
        assert!(!rec.leases.contains_key("slow"));
        assert_eq!(rec.grant("me", &limits, want(1.0, 2), 0, 1).concurrency, 2);
    }

    fn holding(rps: &[(&str, f64)]) -> LeaseRecord {
        let mut rec = LeaseRecord::default();
        for (id, r) in rps {
            rec.leases.insert(
                id.to_string(),
                Lease {
                    held: Slice {
                        requests_per_sec: *r,
                        ..Slice::default()
                    },
                    want: Slice::default(),
                    until_ms: 0,
                    renewal: 1,
                },
            );
        }
        rec
    }

    /// The grid: every slot is at most one live lease's, each worker's
    /// slots match its share, spread evenly.
    #[test]
    fn the_grid_gives_each_slot_to_one_worker_by_share() {
        let limits = Limits {
            rpm: Some(120),
            tpm: None,
            concurrency: None,
        };
        for n in [2usize, 4, 5, 16] {
            let ids: Vec<String> = (0..n).map(|i| format!("w{i:02}")).collect();
            let rec = holding(
                &ids.iter()
                    .map(|i| (i.as_str(), 2.0 / n as f64))
                    .collect::<Vec<_>>(),
            );
            let grids: Vec<Grid> = ids.iter().map(|i| rec.grid(i, &limits).unwrap()).collect();
            let start = 1_764_000_000 * 2;
            let slots = 20_000;
            let mut count = vec![0u64; n];
            let mut last = vec![None::<i64>; n];
            for k in start..start + slots {
                let owners: Vec<usize> = (0..n).filter(|&i| grids[i].owns(k)).collect();
                assert_eq!(owners.len(), 1, "slot {k}: {owners:?} of {n}");
                let o = owners[0];
                count[o] += 1;
                // Evenly spread: never more than three times the mean gap.
                if let Some(l) = last[o] {
                    assert!(k - l <= 3 * n as i64, "gap {} of {n}", k - l);
                }
                last[o] = Some(k);
            }
            let expect = slots as f64 / n as f64;
            for c in &count {
                assert!((*c as f64 - expect).abs() < expect * 0.02, "{count:?}");
            }
            let g = grids[0];
            let next = g.next_from(start).unwrap();
            assert!(g.owns(next) && (start..next).all(|k| !g.owns(k)));
            assert_eq!(g.slot_at(g.start_of(next) + 0.1 / g.rate), next);
        }
        // Unequal shares, some unused: still one worker a slot at most.
        let rec = holding(&[("a", 1.2), ("b", 0.3), ("c", 0.1)]);
        let g: Vec<Grid> = ["a", "b", "c"]
            .iter()
            .map(|i| rec.grid(i, &limits).unwrap())
            .collect();
        for k in 0..10_000 {
            assert!(g.iter().filter(|x| x.owns(k)).count() <= 1);
        }
        assert!(rec.grid("nobody", &limits).is_none());
    }

    #[test]
    fn a_concurrency_set_by_hand_wins_over_the_learned_one() {
        use ConcurrencySource::*;
        assert_eq!(concurrency_of(None, None, None), None);
        assert_eq!(concurrency_of(None, None, Some(1)), Some((1, Learned)));
        assert_eq!(
            concurrency_of(None, Some(4), Some(1)),
            Some((4, Configured))
        );
        assert_eq!(concurrency_of(Some(2), Some(4), Some(1)), Some((2, Set)));
        assert!(Set.by_hand() && Configured.by_hand() && !Learned.by_hand());
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
