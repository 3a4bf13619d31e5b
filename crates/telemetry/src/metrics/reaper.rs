//! A reaper replica's metrics ([`ReaperMetrics`]): its sweeps and recoveries,
//! and the fleet-wide view each sweep saw ([`FleetSnapshot`]).

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::{Registry, Unit};

use super::{build_info, encode, sweep_buckets, ClassLabel, KindLabel};

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
    sweeps: Counter,
    sweep_failures: Counter,
    sweep_duration: Histogram,
    recoveries: Counter,
    dead_lettered: Family<ClassLabel, Counter>,
    advisories: Counter,
    jobs: Gauge,
    queue_depth: Gauge,
    queue_bytes: Gauge,
    queue_max_msgs: Gauge,
    queue_max_bytes: Gauge,
    in_flight: Gauge,
    parked: Gauge,
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
        let sweeps = Counter::default();
        r.register(
            "leasehold_reaper_sweeps",
            "Sweeps this replica completed",
            sweeps.clone(),
        );
        let sweep_failures = Counter::default();
        r.register(
            "leasehold_reaper_sweep_failures",
            "Sweeps this replica could not complete",
            sweep_failures.clone(),
        );
        let sweep_duration = sweep_buckets();
        r.register_with_unit(
            "leasehold_reaper_sweep_duration",
            "Duration of this replica's sweeps",
            Unit::Seconds,
            sweep_duration.clone(),
        );
        let recoveries = Counter::default();
        r.register(
            "leasehold_reaper_recoveries",
            "Stranded jobs this replica re-offered (a new ticket)",
            recoveries.clone(),
        );
        let dead_lettered = Family::<ClassLabel, Counter>::default();
        r.register(
            "leasehold_reaper_dead_lettered",
            "Jobs this replica dead-lettered, by class (poison, max_deliveries)",
            dead_lettered.clone(),
        );
        let advisories = Counter::default();
        r.register(
            "leasehold_reaper_advisories",
            "Max-deliveries advisories this replica processed",
            advisories.clone(),
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
                sweeps,
                sweep_failures,
                sweep_duration,
                recoveries,
                dead_lettered,
                advisories,
                jobs,
                queue_depth,
                queue_bytes,
                queue_max_msgs,
                queue_max_bytes,
                in_flight,
                parked,
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

    /// A sweep completed in `elapsed`.
    pub fn sweep_finished(&self, elapsed: Duration) {
        self.inner.sweeps.inc();
        self.inner.sweep_duration.observe(elapsed.as_secs_f64());
    }

    pub fn sweep_failed(&self) {
        self.inner.sweep_failures.inc();
    }

    /// `n` stranded jobs re-offered by this replica.
    pub fn recovered(&self, n: u64) {
        self.inner.recoveries.inc_by(n);
    }

    /// `n` jobs dead-lettered by this replica with `class`.
    pub fn dead_lettered(&self, class: &str, n: u64) {
        self.inner
            .dead_lettered
            .get_or_create(&ClassLabel {
                class: class.to_string(),
            })
            .inc_by(n);
    }

    /// `n` max-deliveries advisories processed and acked.
    pub fn advisories(&self, n: u64) {
        self.inner.advisories.inc_by(n);
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
