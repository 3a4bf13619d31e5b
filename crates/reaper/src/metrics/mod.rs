//! The reaper's exported metrics: one snapshot per sweep, logged, kept on the
//! [`crate::Handle`], and served as JSON on `<prefix>.reaper.metrics`
//! (`nats req lh.reaper.metrics ''`), and the same counters ([`Stats`])
//! scraped as Prometheus series ([`ReaperMetrics`], `prometheus.rs`). Fleet
//! figures come from the index of active jobs and the streams' own counts,
//! never from reading every record.

mod prometheus;

pub use prometheus::{FleetSnapshot, ReaperMetrics};

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::SystemTime;

use leasehold_core::time::rfc3339;
use leasehold_store::index::view::Counts;
use leasehold_store::recovery::Action;
use serde::{Deserialize, Serialize};

/// A snapshot of the fleet's health as one reaper saw it at its last sweep.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    pub reaper_id: String,
    /// When the snapshot was taken (RFC 3339).
    pub at: String,
    /// Sweeps this replica has completed.
    pub sweeps: u64,
    /// Active jobs indexed (running, waiting, parked).
    pub jobs: u64,
    /// Jobs indexed as running or waiting.
    pub in_flight: u64,
    /// Of which running.
    pub running: u64,
    /// Tickets waiting in the work stream, over every kind.
    pub queue_depth: u64,
    /// Bytes the work stream holds.
    #[serde(default)]
    pub queue_bytes: u64,
    /// The work stream's limits (submissions beyond are refused); 0: none.
    #[serde(default)]
    pub queue_max_msgs: u64,
    #[serde(default)]
    pub queue_max_bytes: u64,
    /// Age in seconds of the oldest running or waiting job (since its creation).
    pub oldest_in_flight_age_s: Option<f64>,
    pub oldest_in_flight_job: Option<String>,
    /// Jobs parked for a person (`leasehold review list`).
    pub parked: u64,
    /// Jobs waiting, holding no worker, for a time (a durable timer).
    #[serde(default)]
    pub waiting: u64,
    /// Worker sessions alive at the sweep.
    pub sessions: u64,
    /// Dead letters in the DLQ stream, by kind (its subjects).
    pub dead_letters_by_kind: BTreeMap<String, u64>,
    /// Jobs this replica dead-lettered since it started, by class.
    pub dead_letters_by_class: BTreeMap<String, u64>,
    /// Jobs this replica re-offered (ended sessions, hung attempts,
    /// stranded waits) since it started.
    pub recoveries: u64,
    /// Jobs this replica dead-lettered as poison since it started.
    pub poison_dead_lettered: u64,
    /// Jobs this replica dead-lettered after max deliveries since it started.
    pub max_deliveries_dead_lettered: u64,
    /// Sessions this replica ended after their process's connection closed.
    pub sessions_ended_fast: u64,
    /// Shards this replica owns (of `leasehold_core::shard::SHARDS`): its
    /// sweep and probe act on their jobs and workers only.
    #[serde(default)]
    pub shards: u32,
    /// Reapers that answered its last roll call, itself included.
    #[serde(default)]
    pub reapers: u32,
}

/// Accumulates one sweep's view of the index.
#[derive(Debug, Default)]
pub struct Tally {
    m: Metrics,
    oldest: Option<(String, f64)>,
}

impl Tally {
    /// The index's counts, from its live view.
    pub fn of(c: &Counts, now: SystemTime) -> Tally {
        let mut t = Tally::default();
        t.m.jobs = c.jobs;
        t.m.in_flight = c.in_flight;
        t.m.running = c.running;
        t.m.parked = c.parked;
        t.m.waiting = c.held;
        t.oldest = c.oldest_in_flight.as_ref().map(|(job, created)| {
            let age = now.duration_since(*created).unwrap_or_default();
            (job.clone(), age.as_secs_f64())
        });
        t
    }

    /// The snapshot, completed with the streams' counts and this replica's counters.
    pub fn finish(mut self, reaper_id: &str, now: SystemTime, c: Counters) -> Metrics {
        self.m.reaper_id = reaper_id.to_string();
        self.m.at = rfc3339(now);
        if let Some((id, age)) = self.oldest {
            self.m.oldest_in_flight_job = Some(id);
            self.m.oldest_in_flight_age_s = Some((age * 1000.0).round() / 1000.0);
        }
        self.m.sweeps = c.sweeps;
        self.m.recoveries = c.recoveries;
        self.m.poison_dead_lettered = c.poison;
        self.m.max_deliveries_dead_lettered = c.max_deliveries;
        self.m.sessions_ended_fast = c.sessions_ended_fast;
        if c.poison > 0 {
            self.m
                .dead_letters_by_class
                .insert("poison".into(), c.poison);
        }
        if c.max_deliveries > 0 {
            self.m
                .dead_letters_by_class
                .insert("max_deliveries".into(), c.max_deliveries);
        }
        self.m
    }

    pub fn set_queue(&mut self, q: Queue, sessions: u64, dlq_by_kind: BTreeMap<String, u64>) {
        self.m.queue_depth = q.messages;
        self.m.queue_bytes = q.bytes;
        self.m.queue_max_msgs = q.max_msgs;
        self.m.queue_max_bytes = q.max_bytes;
        self.m.sessions = sessions;
        self.m.dead_letters_by_kind = dlq_by_kind;
    }
}

/// The work stream's fill and limits.
#[derive(Debug, Clone, Copy, Default)]
pub struct Queue {
    pub messages: u64,
    pub bytes: u64,
    pub max_msgs: u64,
    pub max_bytes: u64,
}

/// Counters of one reaper process: what its JSON snapshot, its Prometheus
/// scrape ([`ReaperMetrics`]), its logs and tests read. Counted once, here.
#[derive(Debug, Default)]
pub struct Stats {
    pub sweeps: AtomicU64,
    /// Sweeps this replica could not complete.
    pub sweep_failures: AtomicU64,
    /// Jobs this replica dead-lettered as poison.
    pub poison: AtomicU64,
    /// Jobs this replica turned `dead` after max deliveries (its CAS won).
    pub max_deliveries: AtomicU64,
    /// Jobs this replica re-offered (its write won).
    pub recoveries: AtomicU64,
    /// Advisories processed and acked.
    pub advisories: AtomicU64,
    /// Sessions this replica ended after "no responders".
    pub sessions_ended_fast: AtomicU64,
    /// Index entries whose record disagreed, repaired.
    pub index_repairs: AtomicU64,
    /// Waiting jobs whose ticket was lost or stuck, given a fresh one.
    pub tickets_replaced: AtomicU64,
    /// Finished jobs removed after their retention.
    pub forgotten: AtomicU64,
}

impl Stats {
    pub(crate) fn counters(&self) -> Counters {
        Counters {
            sweeps: self.sweeps.load(Ordering::Relaxed),
            recoveries: self.recoveries.load(Ordering::Relaxed),
            poison: self.poison.load(Ordering::Relaxed),
            max_deliveries: self.max_deliveries.load(Ordering::Relaxed),
            sessions_ended_fast: self.sessions_ended_fast.load(Ordering::Relaxed),
        }
    }

    /// Counts a recovery action.
    pub(crate) fn count(&self, a: &Action) {
        match a {
            Action::Reoffered { .. } | Action::Cancelled => {
                self.recoveries.fetch_add(1, Ordering::Relaxed);
            }
            Action::Poisoned => {
                self.poison.fetch_add(1, Ordering::Relaxed);
            }
            Action::Nothing(_) | Action::Unsure(_) => {}
        }
    }
}

/// This replica's counters at one moment.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counters {
    pub sweeps: u64,
    pub recoveries: u64,
    pub poison: u64,
    pub max_deliveries: u64,
    pub sessions_ended_fast: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn tally_takes_the_view_counts_and_the_oldest_age() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let counts = Counts {
            jobs: 3,
            running: 1,
            in_flight: 2,
            parked: 1,
            held: 0,
            oldest_in_flight: Some(("old".into(), t0)),
        };
        let t = Tally::of(&counts, t0 + Duration::from_secs(100));
        let m = t.finish(
            "r1",
            t0,
            Counters {
                recoveries: 2,
                poison: 1,
                ..Default::default()
            },
        );
        assert_eq!(
            (m.jobs, m.in_flight, m.running, m.parked, m.recoveries),
            (3, 2, 1, 1, 2)
        );
        assert_eq!(m.oldest_in_flight_job.as_deref(), Some("old"));
        assert_eq!(m.oldest_in_flight_age_s, Some(100.0));
        assert_eq!(m.dead_letters_by_class.get("poison"), Some(&1));
    }
}
