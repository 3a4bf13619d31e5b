//! The reaper's decisions about one index entry, as pure functions.
//!
//! The sweep follows the index of active jobs (never the records) and asks
//! [`running_action`] what a running entry needs, and [`stranded_before`]
//! which waiting ones to look at. Every
//! action re-reads the record and decides again inside a
//! revision-conditioned write, so a stale entry can only cause a wasted
//! read, never a wrong write.

use std::time::{Duration, SystemTime};

use leasehold_core::time::parse_rfc3339;
#[cfg(test)]
use leasehold_store::index::view::wait_due;
#[cfg(test)]
use leasehold_store::index::Entry;
use leasehold_store::liveness::Verdict;

/// What the sweep does with a running job's entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunningAction {
    Nothing,
    /// The owner is gone by the liveness rule: re-offer (recovery decides
    /// again on the record).
    OwnerGone,
    /// The owner's liveness is unknown now: leave it for the next sweep.
    Unsure,
    /// The owner lives but the attempt deadline passed (by more than the
    /// skew allowance): the attempt hangs; re-offer it anyway.
    Overdue,
}

/// Decides what a `run.<worker>.<job>` entry needs (its attempt's
/// deadline), given the verdict of the one liveness rule on the session the
/// entry names.
pub fn running_action(
    deadline: Option<SystemTime>,
    owner: &Verdict,
    now: SystemTime,
    skew: Duration,
) -> RunningAction {
    match owner {
        Verdict::Gone(_) => return RunningAction::OwnerGone,
        // Unknown never re-offers: the next sweep asks again.
        Verdict::Unknown(_) => return RunningAction::Unsure,
        Verdict::Alive => {}
    }
    let overdue = deadline
        .and_then(|d| now.duration_since(d).ok())
        .is_some_and(|past| past > skew);
    if overdue {
        RunningAction::Overdue
    } else {
        RunningAction::Nothing
    }
}

/// A waiting job should have run by now when it was due (its
/// `next_run_at`, or its last write: [`wait_due`]) at or before this time.
pub fn stranded_before(now: SystemTime, grace: Duration) -> SystemTime {
    now.checked_sub(grace).unwrap_or(SystemTime::UNIX_EPOCH)
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
    use leasehold_core::time::rfc3339;
    use leasehold_store::liveness::Unsure;

    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + s)
    }

    fn running(deadline: u64) -> Option<SystemTime> {
        Some(t(deadline))
    }

    const SKEW: Duration = Duration::from_secs(2);

    #[test]
    fn a_running_entry_is_recovered_only_when_its_owner_is_gone() {
        let e = running(100);
        assert_eq!(
            running_action(e, &Verdict::Alive, t(10), SKEW),
            RunningAction::Nothing
        );
        assert_eq!(
            running_action(e, &Verdict::Gone("ended".into()), t(10), SKEW),
            RunningAction::OwnerGone
        );
        // Even past its deadline, an unknown owner is left alone.
        assert_eq!(
            running_action(
                e,
                &Verdict::Unknown(Unsure::Settling(Duration::ZERO)),
                t(200),
                SKEW
            ),
            RunningAction::Unsure
        );
    }

    #[test]
    fn a_deadline_counts_only_past_the_skew_allowance() {
        let e = running(100);
        assert_eq!(
            running_action(e, &Verdict::Alive, t(102), SKEW),
            RunningAction::Nothing
        );
        assert_eq!(
            running_action(e, &Verdict::Alive, t(103), SKEW),
            RunningAction::Overdue
        );
    }

    #[test]
    fn waiting_entries_are_stranded_after_the_grace_past_their_due_time() {
        let mut e = Entry {
            next_run_at: Some(rfc3339(t(100))),
            updated_at: rfc3339(t(0)),
            ..Default::default()
        };
        let g = Duration::from_secs(60);
        let stranded = |e: &Entry, now| wait_due(e).unwrap() <= stranded_before(now, g);
        assert!(!stranded(&e, t(159)));
        assert!(stranded(&e, t(160)));
        e.next_run_at = None;
        assert!(stranded(&e, t(60)));
    }
}
