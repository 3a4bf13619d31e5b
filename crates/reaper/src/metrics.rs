//! The reaper's exported metrics: one snapshot per sweep, logged, kept on the
//! [`crate::Handle`], and served as JSON on `<prefix>.reaper.metrics`
//! (`nats req lh.reaper.metrics ''`).

use std::collections::BTreeMap;
use std::time::SystemTime;

use leasehold_core::machine::status_of;
use leasehold_core::time::rfc3339;
use leasehold_core::{JobRecord, Status};
use serde::{Deserialize, Serialize};

use crate::decide::since;

/// A snapshot of the fleet's health as one reaper saw it at its last sweep.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Metrics {
    pub reaper_id: String,
    /// When the snapshot was taken (RFC 3339).
    pub at: String,
    /// Sweeps this replica has completed.
    pub sweeps: u64,
    /// Job records seen.
    pub jobs: u64,
    /// Jobs queued or running.
    pub in_flight: u64,
    /// Age in seconds of the oldest queued or running job (since its creation).
    pub oldest_in_flight_age_s: Option<f64>,
    pub oldest_in_flight_job: Option<String>,
    /// Jobs parked for a person (`leasehold review list`).
    pub parked: u64,
    /// Dead letters by class, counted from the job records: `dead` jobs by
    /// their error class (`poison`, `max_deliveries`) and `rejected` jobs.
    /// Rejected submissions whose id could not be determined have no record
    /// and are only in the DLQ stream (`leasehold dlq list`).
    pub dead_letters_by_class: BTreeMap<String, u64>,
    /// Stranded jobs this replica re-enqueued since it started.
    pub recoveries: u64,
    /// Jobs this replica dead-lettered as poison since it started.
    pub poison_dead_lettered: u64,
    /// Jobs this replica dead-lettered after max deliveries since it started.
    pub max_deliveries_dead_lettered: u64,
}

/// Accumulates one sweep's view of the records.
#[derive(Debug, Default)]
pub struct Tally {
    m: Metrics,
    oldest: Option<(String, f64)>,
}

impl Tally {
    pub fn observe(&mut self, rec: &JobRecord, now: SystemTime) {
        self.m.jobs += 1;
        match status_of(rec) {
            Some(Status::Queued | Status::Running) => {
                self.m.in_flight += 1;
                let age = since(&rec.created_at, now).as_secs_f64();
                if self.oldest.as_ref().is_none_or(|(_, a)| age > *a) {
                    self.oldest = Some((rec.id.clone(), age));
                }
            }
            Some(Status::Parked) => self.m.parked += 1,
            Some(Status::Dead) => {
                let class = rec
                    .error
                    .as_ref()
                    .map(|e| e.class.clone())
                    .filter(|c| !c.is_empty())
                    .unwrap_or_else(|| "dead".into());
                *self.m.dead_letters_by_class.entry(class).or_default() += 1;
            }
            Some(Status::Rejected) => {
                *self
                    .m
                    .dead_letters_by_class
                    .entry("rejected".into())
                    .or_default() += 1
            }
            _ => {}
        }
    }

    /// The snapshot, completed with this replica's counters.
    pub fn finish(mut self, reaper_id: &str, now: SystemTime, counters: Counters) -> Metrics {
        self.m.reaper_id = reaper_id.to_string();
        self.m.at = rfc3339(now);
        if let Some((id, age)) = self.oldest {
            self.m.oldest_in_flight_job = Some(id);
            self.m.oldest_in_flight_age_s = Some((age * 1000.0).round() / 1000.0);
        }
        self.m.sweeps = counters.sweeps;
        self.m.recoveries = counters.recoveries;
        self.m.poison_dead_lettered = counters.poison;
        self.m.max_deliveries_dead_lettered = counters.max_deliveries;
        self.m
    }
}

/// This replica's counters at one moment.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counters {
    pub sweeps: u64,
    pub recoveries: u64,
    pub poison: u64,
    pub max_deliveries: u64,
}

#[cfg(test)]
mod tests {
    use super::*;
    use leasehold_core::machine::new_record;
    use leasehold_core::{JobError, JobSpec};
    use std::time::Duration;

    #[test]
    fn tally_counts_by_status_and_class() {
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        let mut t = Tally::default();
        let old = new_record("old", "echo", JobSpec::default(), 1, t0);
        let young = new_record(
            "young",
            "echo",
            JobSpec::default(),
            2,
            t0 + Duration::from_secs(30),
        );
        let mut parked = young.clone();
        parked.status = "parked".into();
        let mut dead = young.clone();
        dead.status = "dead".into();
        dead.error = Some(JobError {
            class: "poison".into(),
            ..Default::default()
        });
        for r in [&old, &young, &parked, &dead, &dead] {
            t.observe(r, t0 + Duration::from_secs(100));
        }
        let m = t.finish(
            "r1",
            t0,
            Counters {
                recoveries: 2,
                ..Default::default()
            },
        );
        assert_eq!((m.jobs, m.in_flight, m.parked, m.recoveries), (5, 2, 1, 2));
        assert_eq!(m.oldest_in_flight_job.as_deref(), Some("old"));
        assert_eq!(m.oldest_in_flight_age_s, Some(100.0));
        assert_eq!(m.dead_letters_by_class.get("poison"), Some(&2));
    }
}
