//! The reaper's decisions about one job record, as pure functions.
//!
//! The sweep reads every record and asks [`sweep_action`] what, if anything,
//! the record needs. Every action re-reads the record and decides again
//! inside a revision-conditioned write, so a stale sweep snapshot can only
//! cause a wasted read, never a wrong write.

use std::time::{Duration, SystemTime};

use leasehold_core::machine::{lease_expired_for, status_of};
use leasehold_core::time::parse_rfc3339;
use leasehold_core::{JobRecord, Status};

/// A dead record whose dead-lettering is older than this is taken as
/// finished without looking: dead letters are deduplicated by the DLQ's
/// one-hour window, so finishing later could publish a second letter.
pub const FINISH_WINDOW: Duration = Duration::from_secs(50 * 60);

/// What the sweep does with one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SweepAction {
    Nothing,
    /// Running, lease expired, stale reclaims at the limit: dead, class `poison`.
    Poison,
    /// Running past its lease by the grace, or queued untouched for the
    /// grace: re-enqueue it if its work ticket is gone.
    CheckTicket,
    /// Dead recently: make sure the dead letter, the ticket deletion and the
    /// `dead` event all happened (a reaper may have stopped half-way).
    FinishDead,
}

/// Decides what one record needs.
pub fn sweep_action(
    rec: &JobRecord,
    now: SystemTime,
    max_stale_reclaims: u32,
    grace: Duration,
) -> SweepAction {
    match status_of(rec) {
        Some(Status::Running) => match lease_expired_for(rec, now) {
            Some(_) if rec.stale_reclaims >= max_stale_reclaims => SweepAction::Poison,
            Some(past) if past >= grace => SweepAction::CheckTicket,
            _ => SweepAction::Nothing,
        },
        Some(Status::Queued) if since(&rec.updated_at, now) >= grace => SweepAction::CheckTicket,
        Some(Status::Dead) if since(&rec.updated_at, now) < FINISH_WINDOW => {
            SweepAction::FinishDead
        }
        _ => SweepAction::Nothing,
    }
}

/// Still eligible for poison at the moment of the write.
pub fn is_poison(rec: &JobRecord, now: SystemTime, max_stale_reclaims: u32) -> bool {
    lease_expired_for(rec, now).is_some() && rec.stale_reclaims >= max_stale_reclaims
}

/// Whether a dead-lettering is complete: the job's last `dead` event
/// belongs to this death (same epoch, and the `marked_at` it carries is the
/// record's `error.at`, so a replayed job that dies again at the same epoch
/// is not mistaken for its earlier death; no clocks are compared).
pub fn dead_event_covers(rec: &JobRecord, event_epoch: u64, event_marked_at: Option<&str>) -> bool {
    let marked = rec.error.as_ref().map(|e| e.at.as_str());
    event_epoch == rec.epoch && (event_marked_at.is_none() || event_marked_at == marked)
}

/// The id shared by every publication of one death (dead event), so
/// replicas finishing the same death publish once.
pub fn death_id(rec: &JobRecord) -> String {
    let marked = rec.error.as_ref().map(|e| e.at.as_str()).unwrap_or("");
    format!("{}:dead:{}:{marked}", rec.id, rec.epoch)
}

/// Time since an RFC 3339 timestamp (zero when it is in the future or unreadable).
pub fn since(at: &str, now: SystemTime) -> Duration {
    parse_rfc3339(at)
        .and_then(|t| now.duration_since(t).ok())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;
    use leasehold_core::machine::new_record;
    use leasehold_core::time::rfc3339;
    use leasehold_core::{JobError, JobSpec};

    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + s)
    }

    fn running(lease_expires: u64, stale: u32) -> JobRecord {
        let mut r = new_record("j", "echo", JobSpec::default(), 1, t(0));
        r.status = "running".into();
        r.lease_expires_at = Some(rfc3339(t(lease_expires)));
        r.stale_reclaims = stale;
        r
    }

    const GRACE: Duration = Duration::from_secs(60);

    #[test]
    fn poison_needs_an_expired_lease_and_the_limit() {
        assert_eq!(
            sweep_action(&running(100, 3), t(50), 3, GRACE),
            SweepAction::Nothing
        );
        assert_eq!(
            sweep_action(&running(100, 3), t(101), 3, GRACE),
            SweepAction::Poison
        );
        assert_eq!(
            sweep_action(&running(100, 2), t(101), 3, GRACE),
            SweepAction::Nothing
        );
        assert!(is_poison(&running(100, 4), t(101), 3));
        assert!(!is_poison(&running(100, 4), t(99), 3));
    }

    #[test]
    fn stranded_checks_wait_for_the_grace() {
        assert_eq!(
            sweep_action(&running(100, 0), t(159), 3, GRACE),
            SweepAction::Nothing
        );
        assert_eq!(
            sweep_action(&running(100, 0), t(160), 3, GRACE),
            SweepAction::CheckTicket
        );
        let q = new_record("j", "echo", JobSpec::default(), 1, t(0));
        assert_eq!(sweep_action(&q, t(30), 3, GRACE), SweepAction::Nothing);
        assert_eq!(sweep_action(&q, t(61), 3, GRACE), SweepAction::CheckTicket);
    }

    #[test]
    fn recent_dead_records_are_checked_for_completion() {
        let mut d = new_record("j", "echo", JobSpec::default(), 1, t(0));
        d.status = "dead".into();
        d.epoch = 4;
        d.error = Some(JobError {
            class: "poison".into(),
            message: "m".into(),
            at: rfc3339(t(10)),
        });
        assert_eq!(sweep_action(&d, t(20), 3, GRACE), SweepAction::FinishDead);
        assert_eq!(sweep_action(&d, t(10_000), 3, GRACE), SweepAction::Nothing);
        assert!(dead_event_covers(&d, 4, Some(&rfc3339(t(10)))));
        assert!(!dead_event_covers(&d, 3, Some(&rfc3339(t(10)))));
        // A dead event of an earlier death at the same epoch (a replay that
        // was never claimed) does not cover this one.
        assert!(!dead_event_covers(&d, 4, Some(&rfc3339(t(5)))));
        assert_ne!(death_id(&d), {
            let mut e = d.clone();
            e.error.as_mut().unwrap().at = rfc3339(t(5));
            death_id(&e)
        });
    }

    #[test]
    fn terminal_and_parked_records_are_left_alone() {
        for s in ["completed", "failed", "cancelled", "rejected", "parked"] {
            let mut r = running(0, 9);
            r.status = s.into();
            assert_eq!(
                sweep_action(&r, t(1000), 3, GRACE),
                SweepAction::Nothing,
                "{s}"
            );
        }
    }
}
