//! The fleet's charts' memory: a ring of fixed length (one sample per
//! `--chart-interval`, 360 of them: an hour at the default 10 s) that the
//! one sampler task ([`crate::sampler`]) fills and every chart and
//! `/v1/fleet/charts` reads. Its size does not depend on how many jobs
//! there are: each sample holds counters, small maps (at most
//! [`KEYS_MAX`] keys each, the rest counted under `other`) and two
//! reservoirs of at most [`RESERVOIR`] durations for the percentiles.
//!
//! Everything here is pure (no I/O), so the ring's wraparound, the
//! per-interval bucketing and the percentiles are unit-tested.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, SystemTime};

use serde_json::{json, Value};

/// Samples the ring keeps.
pub const SAMPLES: usize = 360;
/// Keys a sample's map keeps (kinds, lanes, classes, provider keys);
/// further ones are counted under [`OTHER`].
pub const KEYS_MAX: usize = 24;
/// Where keys beyond [`KEYS_MAX`] are counted.
pub const OTHER: &str = "other";
/// Durations a reservoir keeps for its percentiles.
pub const RESERVOIR: usize = 200;

/// A fixed-size sample of durations (seconds): the first [`RESERVOIR`]
/// kept, later ones replacing a kept one with the chance a uniform sample
/// needs (reservoir sampling, with a fixed pseudo-random sequence).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Reservoir {
    seen: u64,
    values: Vec<f32>,
}

/// The p50 and p95 of a reservoir and how many values it saw.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Quantiles {
    pub p50: f64,
    pub p95: f64,
    pub n: u64,
}

/// A step of splitmix64: the reservoir's pseudo-random choice.
fn mix(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Reservoir {
    pub fn add(&mut self, secs: f64) {
        if !secs.is_finite() || secs < 0.0 {
            return;
        }
        self.seen += 1;
        if self.values.len() < RESERVOIR {
            self.values.push(secs as f32);
            return;
        }
        let j = (mix(self.seen) % self.seen) as usize;
        if j < RESERVOIR {
            self.values[j] = secs as f32;
        }
    }

    /// Both reservoirs' values as one (for a chart's column of several
    /// samples); still at most [`RESERVOIR`] kept, evenly from each.
    pub fn merge(&mut self, other: &Reservoir) {
        let seen = self.seen + other.seen;
        let mut all: Vec<f32> = self.values.iter().chain(&other.values).copied().collect();
        if all.len() > RESERVOIR {
            all.sort_by(|a, b| a.total_cmp(b));
            let step = all.len() as f64 / RESERVOIR as f64;
            all = (0..RESERVOIR)
                .map(|i| all[((i as f64 + 0.5) * step) as usize])
                .collect();
        }
        self.values = all;
        self.seen = seen;
    }

    /// p50 and p95 (nearest rank) of what is kept; `None` when empty.
    pub fn quantiles(&self) -> Option<Quantiles> {
        if self.values.is_empty() {
            return None;
        }
        let mut v = self.values.clone();
        v.sort_by(|a, b| a.total_cmp(b));
        Some(Quantiles {
            p50: rank(&v, 0.50),
            p95: rank(&v, 0.95),
            n: self.seen,
        })
    }
}

/// The nearest-rank quantile `q` of `sorted` (not empty).
fn rank(sorted: &[f32], q: f64) -> f64 {
    let n = sorted.len();
    let i = ((n as f64 * q).ceil() as usize).clamp(1, n) - 1;
    sorted[i] as f64
}

/// Adds `n` to `key` in `m`, or to [`OTHER`] when `m` has its
/// [`KEYS_MAX`] keys already.
pub fn bump(m: &mut BTreeMap<String, u64>, key: &str, n: u64) {
    let key = if m.contains_key(key) || m.len() < KEYS_MAX {
        key
    } else {
        OTHER
    };
    *m.entry(key.to_string()).or_default() += n;
}

/// `m` cut to [`KEYS_MAX`] keys: the largest kept, the rest summed under
/// [`OTHER`].
pub fn bounded(m: BTreeMap<String, u64>) -> BTreeMap<String, u64> {
    if m.len() <= KEYS_MAX {
        return m;
    }
    let mut v: Vec<(String, u64)> = m.into_iter().collect();
    v.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    let rest: u64 = v[KEYS_MAX - 1..].iter().map(|(_, n)| n).sum();
    v.truncate(KEYS_MAX - 1);
    let mut out: BTreeMap<String, u64> = v.into_iter().collect();
    *out.entry(OTHER.to_string()).or_default() += rest;
    out
}

/// What the sampler read at the end of an interval (absent in intervals
/// it did not sample: before the console started, or while NATS did not
/// answer).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Gauges {
    /// Tickets in the work stream per kind, and per lane
    /// (`kind` for the default lane, else `kind/tenant/priority`).
    pub queue_by_kind: BTreeMap<String, u64>,
    pub queue_by_lane: BTreeMap<String, u64>,
    /// Index entries per status (every kind); `None`: not known (the
    /// console keeps no view of the index, or its view is loading).
    pub index_by_status: Option<BTreeMap<String, u64>>,
    /// Live worker sessions, their slots, and jobs running on them.
    pub workers: u64,
    pub slots_total: u64,
    /// `None`: not known, as `index_by_status`.
    pub slots_in_use: Option<u64>,
    /// Provider keys cooling down now (after a 429 or a quota error):
    /// seconds left.
    pub cooling: BTreeMap<String, u64>,
}

/// One interval: what happened in it (from the events) and what the
/// sampler read at its end.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Sample {
    /// The interval's number: it starts `slot * interval` after the epoch.
    pub slot: u64,
    pub completed: u64,
    /// Failed, dead, cancelled or rejected.
    pub failed: u64,
    /// Failed and dead jobs per error class (the event's `class`, else
    /// its type).
    pub failures: BTreeMap<String, u64>,
    /// Retries of a model call the provider answered 429 (`retry` events
    /// of class `rate_limited`).
    pub rate_limited: u64,
    /// Cooldowns started per provider key.
    pub cooldowns: BTreeMap<String, u64>,
    /// Submission to first claim, and claim to end, in seconds.
    pub submit_start: Reservoir,
    pub run_time: Reservoir,
    pub gauges: Option<Gauges>,
}

/// The ring: samples of consecutive intervals, oldest first, at most
/// `cap` of them.
#[derive(Debug, Clone)]
pub struct Ring {
    interval: u64,
    cap: usize,
    samples: VecDeque<Sample>,
}

impl Ring {
    /// A ring of `cap` intervals of `interval` (whole seconds, at least 1).
    pub fn new(interval: Duration, cap: usize) -> Ring {
        Ring {
            interval: interval.as_secs().max(1),
            cap: cap.max(1),
            samples: VecDeque::with_capacity(cap.max(1)),
        }
    }

    pub fn interval(&self) -> Duration {
        Duration::from_secs(self.interval)
    }

    pub fn cap(&self) -> usize {
        self.cap
    }

    /// The interval `t` falls in.
    pub fn slot_of(&self, t: SystemTime) -> u64 {
        t.duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs()
            / self.interval
    }

    /// When interval `slot` starts.
    pub fn start_of(&self, slot: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(slot * self.interval)
    }

    /// The sample of the interval `t` falls in, the ring moved on to it
    /// when it is newer than the newest (the oldest samples dropped);
    /// `None` when it is older than the ring keeps. From its first use on
    /// the ring holds its `cap` intervals ending at the newest.
    pub fn at(&mut self, t: SystemTime) -> Option<&mut Sample> {
        let s = self.slot_of(t);
        let newest = self.samples.back().map(|x| x.slot);
        match newest {
            Some(n) if s <= n => {
                let first = self.samples.front().map_or(n, |x| x.slot);
                if s < first {
                    return None;
                }
                self.samples.get_mut((s - first) as usize)
            }
            _ => {
                let from = match newest {
                    Some(n) if s - n < self.cap as u64 => n + 1,
                    _ => {
                        self.samples.clear();
                        s + 1 - (self.cap as u64).min(s + 1)
                    }
                };
                for slot in from..=s {
                    self.samples.push_back(Sample {
                        slot,
                        ..Default::default()
                    });
                }
                while self.samples.len() > self.cap {
                    self.samples.pop_front();
                }
                self.samples.back_mut()
            }
        }
    }

    /// The samples, oldest first.
    pub fn samples(&self) -> impl DoubleEndedIterator<Item = &Sample> + ExactSizeIterator {
        self.samples.iter()
    }

    /// The ring as JSON (`GET /v1/fleet/charts`).
    pub fn json(&self) -> Value {
        let points: Vec<Value> = self.samples.iter().map(|s| self.point(s)).collect();
        json!({
            "interval_s": self.interval,
            "capacity": self.cap,
            "window_s": self.interval * self.cap as u64,
            "samples": points,
        })
    }

    fn point(&self, s: &Sample) -> Value {
        let q = |r: &Reservoir| {
            r.quantiles()
                .map(|q| json!({"p50_s": q.p50, "p95_s": q.p95, "n": q.n}))
        };
        let mut v = json!({
            "at": leasehold_core::time::rfc3339(self.start_of(s.slot)),
            "completed": s.completed,
            "failed": s.failed,
            "failures_by_class": s.failures,
            "rate_limited": s.rate_limited,
            "cooldowns_started": s.cooldowns,
            "submit_to_start": q(&s.submit_start),
            "run_time": q(&s.run_time),
            "gauges": null,
        });
        if let Some(g) = &s.gauges {
            v["gauges"] = json!({
                "queue_by_kind": g.queue_by_kind,
                "queue_by_lane": g.queue_by_lane,
                "index_by_status": g.index_by_status,
                "workers": g.workers,
                "slots_total": g.slots_total,
                "slots_in_use": g.slots_in_use,
                "cooling_s": g.cooling,
            });
        }
        v
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
    }

    #[test]
    fn events_fall_in_their_interval_and_old_ones_are_refused() {
        let mut r = Ring::new(Duration::from_secs(10), 6);
        r.at(t(1000)).unwrap().completed += 1;
        r.at(t(1009)).unwrap().completed += 1;
        r.at(t(1010)).unwrap().failed += 1;
        r.at(t(1005)).unwrap().completed += 1;
        let s: Vec<(u64, u64, u64)> = r
            .samples()
            .map(|s| (s.slot, s.completed, s.failed))
            .collect();
        // The ring spans its whole window from the first sample on (an
        // event of the window's start, read after a later one, still fits).
        let zero = |slot| (slot, 0, 0);
        assert_eq!(
            s,
            vec![
                zero(96),
                zero(97),
                zero(98),
                zero(99),
                (100, 3, 0),
                (101, 0, 1)
            ]
        );
        // Six intervals later the first has gone.
        r.at(t(1065)).unwrap();
        assert_eq!(r.samples().len(), 6);
        assert_eq!(r.samples().next().unwrap().slot, 101);
        assert!(r.at(t(1001)).is_none(), "older than the ring");
        assert_eq!(r.at(t(1012)).unwrap().failed, 1);
    }

    #[test]
    fn the_ring_wraps_around_at_its_capacity_and_after_a_long_gap() {
        let mut r = Ring::new(Duration::from_secs(1), 4);
        for i in 0..10 {
            r.at(t(i)).unwrap().completed = i;
        }
        let kept: Vec<u64> = r.samples().map(|s| s.completed).collect();
        assert_eq!(kept, vec![6, 7, 8, 9]);
        // A gap longer than the ring: only empty intervals up to now.
        r.at(t(100)).unwrap().failed = 1;
        let s: Vec<(u64, u64)> = r.samples().map(|s| (s.slot, s.completed)).collect();
        assert_eq!(s, vec![(97, 0), (98, 0), (99, 0), (100, 0)]);
        // Near the epoch, no slot below zero.
        let mut r = Ring::new(Duration::from_secs(1), 4);
        r.at(t(1)).unwrap();
        assert_eq!(r.samples().map(|s| s.slot).collect::<Vec<_>>(), vec![0, 1]);
    }

    #[test]
    fn percentiles_are_nearest_rank_and_the_reservoir_stays_small() {
        let mut r = Reservoir::default();
        assert_eq!(r.quantiles(), None);
        for i in 1..=100 {
            r.add(i as f64);
        }
        let q = r.quantiles().unwrap();
        assert_eq!((q.p50, q.p95, q.n), (50.0, 95.0, 100));
        r.add(f64::NAN);
        r.add(-1.0);
        assert_eq!(r.quantiles().unwrap().n, 100, "no NaN or negative kept");
        let mut big = Reservoir::default();
        for i in 0..100_000 {
            big.add((i % 1000) as f64);
        }
        assert_eq!(big.values.len(), RESERVOIR);
        let q = big.quantiles().unwrap();
        assert!((350.0..650.0).contains(&q.p50), "{q:?}");
        assert!(q.p95 > 850.0, "{q:?}");
        let mut a = Reservoir::default();
        a.add(1.0);
        a.merge(&big);
        assert_eq!(a.values.len(), RESERVOIR);
        assert_eq!(a.quantiles().unwrap().n, 100_001);
    }

    #[test]
    fn maps_keep_at_most_their_bound_of_keys() {
        let mut m = BTreeMap::new();
        for i in 0..(KEYS_MAX + 10) {
            bump(&mut m, &format!("k{i:02}"), 1);
        }
        assert_eq!(m.len(), KEYS_MAX + 1);
        assert_eq!(m[OTHER], 10);
        let m: BTreeMap<String, u64> = (0..40).map(|i| (format!("k{i:02}"), i)).collect();
        let b = bounded(m);
        assert_eq!(b.len(), KEYS_MAX);
        assert_eq!(b[OTHER], (0..=16).sum::<u64>());
        assert_eq!(b["k39"], 39);
    }

    #[test]
    fn the_json_names_each_series() {
        let mut r = Ring::new(Duration::from_secs(10), 3);
        let s = r.at(t(100)).unwrap();
        s.completed = 2;
        s.submit_start.add(0.5);
        s.gauges = Some(Gauges {
            workers: 1,
            ..Default::default()
        });
        let j = r.json();
        assert_eq!(j["window_s"], 30);
        assert_eq!(j["samples"].as_array().unwrap().len(), 3);
        let p = &j["samples"][2];
        assert_eq!(p["completed"], 2);
        assert_eq!(p["submit_to_start"]["p50_s"], 0.5);
        assert_eq!(p["run_time"], Value::Null);
        assert_eq!(p["gauges"]["workers"], 1);
        assert_eq!(p["at"], "1970-01-01T00:01:40.000Z");
    }
}
