//! A reaper replica's Prometheus metrics ([`ReaperMetrics`]): its counters,
//! read at each scrape from the one [`Stats`] the replica counts in (the
//! same atomics its JSON snapshot reads), its sweeps' durations, and the
//! fleet-wide view each sweep saw ([`FleetSnapshot`]).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use leasehold_telemetry::metrics::{build_info, encode};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use super::Stats;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: String,
}

/// 1 ms to 5 min: one reaper sweep over the active index.
fn sweep_buckets() -> Histogram {
    Histogram::new([
        0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0,
    ])
}

/// What one sweep saw across the whole fleet (every replica sees the same
/// records, so every replica exports the same values within one interval).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct FleetSnapshot {
    /// Job records seen.
    pub jobs: u64,
    /// Jobs waiting to run (`queued`), when the sweep can tell them apart
    /// from running ones; `None` leaves the gauge as it was.
    pub queued: Option<u64>,
    /// Bytes held by the work stream, and its limits (0: none): a
    /// submission beyond a limit is refused with "queue full".
    pub queue_bytes: u64,
    pub queue_max_msgs: u64,
    pub queue_max_bytes: u64,
    /// Jobs queued or running.
    pub in_flight: u64,
    pub parked: u64,
    /// Jobs waiting, holding no worker, for a time.
    pub waiting: u64,
    /// Age of the oldest queued or running job (zero when there is none).
    pub oldest_in_flight_age: Option<Duration>,
    /// Dead letters held in the dead-letter stream, by job kind.
    pub dead_letters: BTreeMap<String, u64>,
}

/// A reaper replica's metrics. Every series carries the `replica` label
/// (the reaper id): counters are this replica's own actions, to be summed
/// across replicas; the `leasehold_fleet_*` gauges are the same fleet-wide
/// view from each replica, to be combined with `max without (replica)`.
#[derive(Clone, Debug)]
pub struct ReaperMetrics {
    inner: Arc<ReaperInner>,
}

#[derive(Debug)]
struct ReaperInner {
    registry: Arc<Registry>,
    stats: Arc<Stats>,
    sweep_duration: Histogram,
    jobs: Gauge,
    queue_depth: Gauge,
    queue_bytes: Gauge,
    queue_max_msgs: Gauge,
    queue_max_bytes: Gauge,
    in_flight: Gauge,
    parked: Gauge,
    waiting: Gauge,
    oldest_age: Gauge<f64, AtomicU64>,
    dead_letters: Family<KindLabel, Gauge>,
    last_sweep: Gauge<f64, AtomicU64>,
}

fn gauge_of(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl ReaperMetrics {
    pub fn new(replica: &str) -> Self {
        let mut r = Registry::with_labels(std::iter::once((
            Cow::Borrowed("replica"),
            Cow::Owned(replica.to_string()),
        )));
        build_info(&mut r, "leasehold-reaper");
        let stats = Arc::new(Stats::default());
        r.register_collector(Box::new(Counted(stats.clone())));
        let sweep_duration = sweep_buckets();
        r.register_with_unit(
            "leasehold_reaper_sweep_duration",
            "Duration of this replica's sweeps",
            Unit::Seconds,
            sweep_duration.clone(),
        );
        let jobs = Gauge::default();
        r.register(
            "leasehold_fleet_jobs",
            "Job records seen by the last sweep",
            jobs.clone(),
        );
        let queue_depth = Gauge::default();
        r.register(
            "leasehold_fleet_queue_depth",
            "Jobs waiting to run (queued)",
            queue_depth.clone(),
        );
        let queue_bytes = Gauge::default();
        r.register_with_unit(
            "leasehold_fleet_queue",
            "Bytes held by the work stream",
            Unit::Bytes,
            queue_bytes.clone(),
        );
        let queue_max_msgs = Gauge::default();
        r.register(
            "leasehold_fleet_queue_limit_messages",
            "The work stream's message limit; submissions beyond are refused (0: none)",
            queue_max_msgs.clone(),
        );
        let queue_max_bytes = Gauge::default();
        r.register_with_unit(
            "leasehold_fleet_queue_limit",
            "The work stream's byte limit; submissions beyond are refused (0: none)",
            Unit::Bytes,
            queue_max_bytes.clone(),
        );
        let in_flight = Gauge::default();
        r.register(
            "leasehold_fleet_jobs_in_flight",
            "Jobs queued or running",
            in_flight.clone(),
        );
        let parked = Gauge::default();
        r.register(
            "leasehold_fleet_jobs_parked",
            "Jobs parked for a person",
            parked.clone(),
        );
        let waiting = Gauge::default();
        r.register(
            "leasehold_fleet_jobs_waiting",
            "Jobs waiting, holding no worker, for a time (a durable timer)",
            waiting.clone(),
        );
        let oldest_age = Gauge::<f64, AtomicU64>::default();
        r.register_with_unit(
            "leasehold_fleet_oldest_in_flight_age",
            "Age of the oldest queued or running job (0 when there is none)",
            Unit::Seconds,
            oldest_age.clone(),
        );
        let dead_letters = Family::<KindLabel, Gauge>::default();
        r.register(
            "leasehold_fleet_dead_letters",
            "Dead letters held in the dead-letter stream, by kind",
            dead_letters.clone(),
        );
        let last_sweep = Gauge::<f64, AtomicU64>::default();
        r.register(
            "leasehold_fleet_last_sweep_timestamp_seconds",
            "Unix time of the sweep the fleet gauges come from",
            last_sweep.clone(),
        );
        ReaperMetrics {
            inner: Arc::new(ReaperInner {
                registry: Arc::new(r),
                stats,
                sweep_duration,
                jobs,
                queue_depth,
                queue_bytes,
                queue_max_msgs,
                queue_max_bytes,
                in_flight,
                parked,
                waiting,
                oldest_age,
                dead_letters,
                last_sweep,
            }),
        }
    }

    pub fn registry(&self) -> Arc<Registry> {
        self.inner.registry.clone()
    }

    pub fn encode(&self) -> String {
        encode(&self.inner.registry)
    }

    /// The replica's counters: what it counts in is what a scrape and its
    /// JSON snapshot read.
    pub fn stats(&self) -> Arc<Stats> {
        self.inner.stats.clone()
    }

    /// A sweep (counted in [`Stats::sweeps`] by the sweep) took `elapsed`.
    pub fn sweep_finished(&self, elapsed: Duration) {
        self.inner.sweep_duration.observe(elapsed.as_secs_f64());
    }

    /// Sets the fleet gauges from one sweep.
    pub fn fleet(&self, s: &FleetSnapshot) {
        let i = &self.inner;
        i.jobs.set(gauge_of(s.jobs));
        if let Some(q) = s.queued {
            i.queue_depth.set(gauge_of(q));
        }
        i.queue_bytes.set(gauge_of(s.queue_bytes));
        i.queue_max_msgs.set(gauge_of(s.queue_max_msgs));
        i.queue_max_bytes.set(gauge_of(s.queue_max_bytes));
        i.in_flight.set(gauge_of(s.in_flight));
        i.parked.set(gauge_of(s.parked));
        i.waiting.set(gauge_of(s.waiting));
        i.oldest_age
            .set(s.oldest_in_flight_age.unwrap_or_default().as_secs_f64());
        // Kinds that disappeared (purged) disappear from the export too.
        i.dead_letters.clear();
        for (kind, n) in &s.dead_letters {
            i.dead_letters
                .get_or_create(&KindLabel { kind: kind.clone() })
                .set(gauge_of(*n));
        }
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        i.last_sweep.set(now.as_secs_f64());
    }
}

/// The counters of [`Stats`], encoded at each scrape.
#[derive(Debug)]
struct Counted(Arc<Stats>);

impl Collector for Counted {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let s = &self.0;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        for (name, help, value) in [
            (
                "leasehold_reaper_sweeps",
                "Sweeps this replica completed",
                load(&s.sweeps),
            ),
            (
                "leasehold_reaper_sweep_failures",
                "Sweeps this replica could not complete",
                load(&s.sweep_failures),
            ),
            (
                "leasehold_reaper_recoveries",
                "Stranded jobs this replica re-offered (a new ticket)",
                load(&s.recoveries),
            ),
            (
                "leasehold_reaper_advisories",
                "Max-deliveries advisories this replica processed",
                load(&s.advisories),
            ),
        ] {
            let c = ConstCounter::new(value);
            c.encode(encoder.encode_descriptor(name, help, None, c.metric_type())?)?;
        }
        let c = ConstCounter::new(0u64);
        let mut family = encoder.encode_descriptor(
            "leasehold_reaper_dead_lettered",
            "Jobs this replica dead-lettered, by class (poison, max_deliveries)",
            None,
            c.metric_type(),
        )?;
        for (class, n) in [
            ("poison", load(&s.poison)),
            ("max_deliveries", load(&s.max_deliveries)),
        ] {
            if n > 0 {
                let labels = [("class", class)];
                ConstCounter::new(n).encode(family.encode_family(&labels)?)?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! The reaper's series as a scrape shows them.
    use super::*;
    use leasehold_telemetry::metrics::value_of as sample;

    #[test]
    fn reaper_series_carry_the_replica_label() {
        let m = ReaperMetrics::new("r-1");
        // What the replica counts in its Stats is what a scrape reads.
        let stats = m.stats();
        stats.sweeps.fetch_add(1, Ordering::Relaxed);
        m.sweep_finished(Duration::from_millis(12));
        stats.recoveries.fetch_add(2, Ordering::Relaxed);
        stats.poison.fetch_add(1, Ordering::Relaxed);
        stats.advisories.fetch_add(3, Ordering::Relaxed);
        let mut s = FleetSnapshot {
            jobs: 10,
            queued: Some(4),
            queue_bytes: 2048,
            queue_max_msgs: 1000,
            queue_max_bytes: 1 << 20,
            in_flight: 6,
            parked: 1,
            waiting: 2,
            oldest_in_flight_age: Some(Duration::from_secs(90)),
            dead_letters: BTreeMap::from([("research".into(), 2), ("echo".into(), 1)]),
        };
        m.fleet(&s);
        let text = m.encode();
        for (prefix, v) in [
            ("leasehold_reaper_sweeps_total{replica=\"r-1\"}", 1.0),
            (
                "leasehold_reaper_sweep_duration_seconds_count{replica=\"r-1\"}",
                1.0,
            ),
            ("leasehold_reaper_recoveries_total{replica=\"r-1\"}", 2.0),
            (
                "leasehold_reaper_dead_lettered_total{replica=\"r-1\",class=\"poison\"}",
                1.0,
            ),
            ("leasehold_reaper_advisories_total{replica=\"r-1\"}", 3.0),
            ("leasehold_fleet_jobs{replica=\"r-1\"}", 10.0),
            ("leasehold_fleet_queue_depth{replica=\"r-1\"}", 4.0),
            ("leasehold_fleet_queue_bytes{replica=\"r-1\"}", 2048.0),
            (
                "leasehold_fleet_queue_limit_messages{replica=\"r-1\"}",
                1000.0,
            ),
            (
                "leasehold_fleet_queue_limit_bytes{replica=\"r-1\"}",
                1048576.0,
            ),
            ("leasehold_fleet_jobs_in_flight{replica=\"r-1\"}", 6.0),
            ("leasehold_fleet_jobs_parked{replica=\"r-1\"}", 1.0),
            ("leasehold_fleet_jobs_waiting{replica=\"r-1\"}", 2.0),
            (
                "leasehold_fleet_oldest_in_flight_age_seconds{replica=\"r-1\"}",
                90.0,
            ),
            (
                "leasehold_fleet_dead_letters{replica=\"r-1\",kind=\"echo\"}",
                1.0,
            ),
        ] {
            assert_eq!(sample(&text, prefix), Some(v), "{prefix}\n{text}");
        }
        // A purged kind goes away; an unknown queue depth is left alone.
        s.dead_letters.remove("echo");
        s.queued = None;
        m.fleet(&s);
        let text = m.encode();
        assert!(!text.contains("kind=\"echo\""), "{text}");
        assert_eq!(
            sample(&text, "leasehold_fleet_queue_depth{replica=\"r-1\"}"),
            Some(4.0)
        );
    }
}
