//! Claims: what a worker does with a delivered ticket ([`decide_claim`]),
//! and the record a claim writes.

use std::time::{Duration, SystemTime};

use super::{cancelled, lease_expired_for, status_of};
use crate::status::Status;
use crate::time::{rfc3339, until};
use crate::JobRecord;

/// What the claimer knows of a running record's owner.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OwnerLiveness {
    /// The owner's session (the one recorded in the job) is alive.
    Live,
    /// The owner's session ended, or another process of that identity took
    /// its place: the job has no live owner.
    Dead,
    /// Could not tell (the sessions bucket did not answer): decide later.
    Unknown,
}

/// The worker asking to claim a job on the delivery of its ticket.
#[derive(Debug, Clone)]
pub struct Claimant<'a> {
    pub worker_id: &'a str,
    /// The claimer's session: recorded in the job, which lives as long as it.
    pub session: &'a str,
    /// Fresh per claim (a UUID).
    pub claim_token: String,
    /// The attempt deadline: how long this claim may run at most, even while
    /// the session lives (`lease_expires_at` = now + this).
    pub attempt_timeout: Duration,
    /// How far apart two hosts' clocks may be: the deadline of someone
    /// else's claim is only trusted as passed this long after it.
    pub skew: Duration,
    pub now: SystemTime,
    /// Stream sequence of the delivered ticket (0: no ticket, e.g. a restart reclaim).
    pub ticket_seq: u64,
    /// A job whose stale reclaims already reached this is left to recovery as poison.
    pub max_stale_reclaims: u32,
    /// Liveness of the recorded owner of a running record.
    pub owner: OwnerLiveness,
    /// How many times this ticket has been delivered (this delivery included).
    pub deliveries: u64,
    /// A record that waits for a signal: the claimer found that signal
    /// there (it reads it only for such a record).
    pub signalled: bool,
}

/// A ticket newer than the one a live job's record names may be that job's
/// next ticket, published by its owner just before the requeue or hand-back
/// that names it: it waits this long, for at most [`NEWER_TICKET_PATIENCE`]
/// deliveries, instead of being settled away.
pub const NEWER_TICKET_WAIT: Duration = Duration::from_millis(500);
/// Deliveries a newer ticket of a live job waits before it is settled (a
/// duplicate submission of a running job, not its next ticket).
pub const NEWER_TICKET_PATIENCE: u64 = 5;

/// What to do with a delivered ticket.
#[derive(Debug, Clone, PartialEq)]
pub enum ClaimDecision {
    /// Write this record (revision-conditioned) and run the job.
    Claim {
        record: Box<JobRecord>,
        reclaim: bool,
    },
    /// Not runnable yet (`next_run_at` ahead, or the owner's liveness
    /// unknown): NAK with this delay, never busy-poll.
    Wait(Duration),
    /// The ticket has nothing left to do (terminal, parked, superseded): ack it.
    Drop(String),
    /// A waiting job not due for longer than [`HOLD_TICKET_AT_MOST`]: its
    /// ticket is not held for the wait (it would count against the
    /// consumer's `max_ack_pending` all along). Set its due-time wake-up,
    /// record that it has no ticket, then ack the ticket; the wake-up gives
    /// it a fresh one when it is due.
    Release,
    /// A live owner holds the job: this ticket is not needed (the job's
    /// liveness is its owner's session). Make sure the job is in the index
    /// of active jobs, then ack the ticket at once: never NAK it (each NAK
    /// would spend a delivery of a job that is alive).
    Settle(String),
    /// The job was asked to be cancelled while it waited: write this record
    /// (`cancelled`) instead of running it.
    Cancel(Box<JobRecord>),
    /// Its owner is gone and its stale reclaims reached the limit: recovery
    /// dead-letters it. Ack nothing; NAK with this delay meanwhile.
    Poison(Duration),
}

/// The longest a delivered ticket is held (NAKed with the remaining wait)
/// for a job not due yet; a longer wait releases it
/// ([`ClaimDecision::Release`]). Short waits (backoffs, a clock a little
/// ahead) stay on the ticket, which costs one NAK and no writes.
pub const HOLD_TICKET_AT_MOST: Duration = Duration::from_secs(5);

/// Decides a claim of `rec` (which exists) by `c`.
pub fn decide_claim(rec: &JobRecord, c: &Claimant<'_>) -> ClaimDecision {
    if c.ticket_seq != 0 && rec.ticket_seq > c.ticket_seq {
        return ClaimDecision::Drop(format!(
            "superseded ticket {} (current ticket is {})",
            c.ticket_seq, rec.ticket_seq
        ));
    }
    let Some(status) = status_of(rec) else {
        return ClaimDecision::Drop(format!("unknown status {:?}", rec.status));
    };
    // An operator's requeue (a dead letter's replay, a review's resume)
    // publishes its ticket first and then writes `queued`: a ticket newer
    // than the record's, of a job that can be requeued, waits a moment for
    // that write instead of being dropped (after NEWER_TICKET_PATIENCE
    // deliveries it is a duplicate, and goes).
    let requeueable = matches!(
        status,
        Status::Dead | Status::Failed | Status::Rejected | Status::Cancelled | Status::Parked
    );
    if requeueable && c.ticket_seq > rec.ticket_seq && c.deliveries < NEWER_TICKET_PATIENCE {
        return ClaimDecision::Wait(NEWER_TICKET_WAIT);
    }
    match status {
        s if s.is_terminal() => ClaimDecision::Drop(format!("job is {s}")),
        // Settled: its index entry is made sure of first (a park whose
        // index write failed kept its ticket for this), so `review list`
        // always shows it.
        Status::Parked => ClaimDecision::Settle("job is parked for review".into()),
        // Its wait is not over: a ticket kept by an owner that could not
        // write the wake-up or look for its signal (or died before its
        // ack). The wake-up is written, then the ticket acked; the job
        // runs at its time, or when its signal comes.
        Status::Waiting if !super::wait_over(rec, c.now, c.signalled) => ClaimDecision::Release,
        // Over: the ticket its waker published first (before the record
        // names it) reached a claimer first, or an owner's kept ticket came
        // back after the time or the signal. Either is the job's ticket
        // now: it is claimed, and the waker's own write finds it moved on.
        // (Released instead, the ticket would be acked and the record then
        // name it: a queued job whose ticket is gone.)
        Status::Waiting => {
            let woken = super::wake(rec, c.now, c.ticket_seq).expect("the job is waiting");
            ClaimDecision::Claim {
                record: Box::new(claimed(&woken, c, false)),
                reclaim: false,
            }
        }
        Status::Queued if rec.cancel_requested => {
            ClaimDecision::Cancel(Box::new(cancelled(rec, c.now, "cancelled before it ran")))
        }
        Status::Queued => {
            let wait = until(c.now, rec.next_run_at.as_deref());
            if wait > HOLD_TICKET_AT_MOST {
                return ClaimDecision::Release;
            }
            if wait > Duration::ZERO {
                return ClaimDecision::Wait(wait);
            }
            ClaimDecision::Claim {
                record: Box::new(claimed(rec, c, false)),
                reclaim: false,
            }
        }
        Status::Running => {
            let past_deadline = deadline_passed(rec, c.now, c.skew);
            match c.owner {
                OwnerLiveness::Live
                    if !past_deadline
                        && c.ticket_seq > rec.ticket_seq
                        && c.deliveries < NEWER_TICKET_PATIENCE =>
                {
                    ClaimDecision::Wait(NEWER_TICKET_WAIT)
                }
                OwnerLiveness::Live if !past_deadline => {
                    ClaimDecision::Settle("held by a live owner".into())
                }
                OwnerLiveness::Unknown if !past_deadline => {
                    ClaimDecision::Wait(Duration::from_secs(1))
                }
                _ => {
                    // As recovery decides (`reoffer_if`): a cancel request
                    // wins over poison, the job ends as its user asked.
                    if rec.cancel_requested {
                        return ClaimDecision::Cancel(Box::new(cancelled(
                            rec,
                            c.now,
                            "cancelled: its owner stopped before honouring the request",
                        )));
                    }
                    if rec.stale_reclaims >= c.max_stale_reclaims {
                        return ClaimDecision::Poison(Duration::from_secs(5));
                    }
                    ClaimDecision::Claim {
                        record: Box::new(claimed(rec, c, true)),
                        reclaim: true,
                    }
                }
            }
        }
        _ => unreachable!("all statuses handled"),
    }
}

/// Whether a job due at `run_at` (RFC 3339; `None`: at once) may run at `now`.
pub fn due(run_at: Option<&str>, now: SystemTime) -> bool {
    until(now, run_at) == Duration::ZERO
}

/// How long a ticket that met a transient failure (the store did not
/// answer) waits before its next delivery, by how often it was delivered:
/// 1 s, 2 s, 4 s, then 5 s. A leader election costs a job a few seconds at
/// most, an outage of a minute a dozen deliveries instead of sixty, and a
/// job with a record is never dead-lettered for its deliveries anyway.
pub fn transient_retry_delay(deliveries: u64) -> Duration {
    let exp = deliveries.saturating_sub(1).min(3) as u32;
    Duration::from_secs(1u64 << exp).min(TRANSIENT_RETRY_CAP)
}

/// The longest wait of [`transient_retry_delay`].
pub const TRANSIENT_RETRY_CAP: Duration = Duration::from_secs(5);

/// Whether a running record's attempt deadline passed, by more than the
/// clock skew allowance (another host wrote it with its own clock).
pub fn deadline_passed(rec: &JobRecord, now: SystemTime, skew: Duration) -> bool {
    lease_expired_for(rec, now).is_some_and(|past| past > skew)
}

/// The record of a brand-new job claimed on its first delivery.
pub fn claim_new(mut fresh: JobRecord, c: &Claimant<'_>) -> JobRecord {
    fresh.ticket_seq = c.ticket_seq;
    claimed(&fresh, c, false)
}

fn claimed(rec: &JobRecord, c: &Claimant<'_>, reclaim: bool) -> JobRecord {
    let mut r = rec.clone();
    let at = rfc3339(c.now);
    r.status = Status::Running.as_str().into();
    r.worker_id = Some(c.worker_id.to_string());
    r.session = Some(c.session.to_string());
    r.claim_token = Some(c.claim_token.clone());
    r.epoch += 1;
    if reclaim {
        r.stale_reclaims += 1;
    }
    if c.ticket_seq > r.ticket_seq {
        r.ticket_seq = c.ticket_seq;
    }
    r.last_heartbeat_at = Some(at.clone());
    r.lease_expires_at = Some(rfc3339(c.now + c.attempt_timeout));
    r.next_run_at = None;
    r.updated_at = at;
    r
}
