//! The job state machine.
//!
//! Every transition is a pure function from the current [`JobRecord`] to the
//! next one; the store writes the result conditioned on the revision it read.
//! Owner-side transitions first prove ownership with [`check_owner`]: status
//! `running`, the same `worker_id`, `claim_token` and `epoch`.
//!
//! ```text
//! queued    -> running     claim (epoch+1, new claim_token)
//! running   -> running     heartbeat / checkpoint by the owner
//! running   -> running     reclaim of an expired lease (epoch+1, stale_reclaims+1)
//! running   -> queued      retryable error with budget left (next_run_at set), or handoff
//! running   -> failed      terminal error, or retry budget exhausted
//! running   -> completed   owner-checked completion
//! queued|running -> cancelled
//! running   -> parked      owner stops for human review
//! parked    -> queued|failed   a person resumes or fails it
//! queued|running -> dead   reaper: poison or max deliveries
//! ```

use std::time::{Duration, SystemTime};

use crate::status::Status;
use crate::time::{parse_rfc3339, rfc3339, until};
use crate::{JobError, JobRecord, JobSpec};

/// Who may write a running job: the identity proven by every owner-side write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Owner {
    pub worker_id: String,
    pub claim_token: String,
    pub epoch: u64,
}

impl Owner {
    /// The owner recorded in `rec`, if it is running.
    pub fn of(rec: &JobRecord) -> Option<Owner> {
        (rec.status == Status::Running.as_str()).then(|| Owner {
            worker_id: rec.worker_id.clone().unwrap_or_default(),
            claim_token: rec.claim_token.clone().unwrap_or_default(),
            epoch: rec.epoch,
        })
    }
}

/// A transition that the record's current state does not allow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    /// The writer is not (or no longer) the job's owner. Never retried.
    #[error("ownership lost: {0}")]
    OwnershipLost(String),
    /// The job is not in a status that allows this transition.
    #[error("job is {status}: {action} is only possible when it is {allowed}")]
    NotAllowed {
        status: String,
        action: &'static str,
        allowed: &'static str,
    },
}

/// Parses a record's status (an unknown status is treated as not runnable).
pub fn status_of(rec: &JobRecord) -> Option<Status> {
    rec.status.parse().ok()
}

/// Proves that `owner` still owns `rec`.
pub fn check_owner(rec: &JobRecord, owner: &Owner) -> Result<(), TransitionError> {
    if rec.status != Status::Running.as_str() {
        return Err(TransitionError::OwnershipLost(format!(
            "job is {}",
            rec.status
        )));
    }
    if rec.worker_id.as_deref() != Some(owner.worker_id.as_str()) {
        return Err(TransitionError::OwnershipLost(format!(
            "owned by worker {:?}",
            rec.worker_id.as_deref().unwrap_or("")
        )));
    }
    if rec.claim_token.as_deref() != Some(owner.claim_token.as_str()) || rec.epoch != owner.epoch {
        return Err(TransitionError::OwnershipLost(format!(
            "reclaimed: now epoch {} (ours {})",
            rec.epoch, owner.epoch
        )));
    }
    Ok(())
}

/// A fresh `queued` record for an accepted submission.
pub fn new_record(
    id: &str,
    kind: &str,
    spec: JobSpec,
    ticket_seq: u64,
    now: SystemTime,
) -> JobRecord {
    let at = rfc3339(now);
    JobRecord {
        id: id.into(),
        kind: kind.into(),
        status: Status::Queued.as_str().into(),
        created_at: at.clone(),
        updated_at: at,
        spec: Some(spec),
        ticket_seq,
        ..Default::default()
    }
}

/// A `rejected` record for a refused submission whose id is known.
pub fn rejected_record(
    id: &str,
    kind: &str,
    class: &str,
    message: &str,
    ticket_seq: u64,
    now: SystemTime,
) -> JobRecord {
    let at = rfc3339(now);
    JobRecord {
        id: id.into(),
        kind: kind.into(),
        status: Status::Rejected.as_str().into(),
        error: Some(JobError {
            class: class.into(),
            message: message.into(),
            at: at.clone(),
        }),
        created_at: at.clone(),
        updated_at: at,
        ticket_seq,
        ..Default::default()
    }
}

/// The worker asking to claim a job on the delivery of its ticket.
#[derive(Debug, Clone)]
pub struct Claimant<'a> {
    pub worker_id: &'a str,
    /// Fresh per claim (a UUID).
    pub claim_token: String,
    pub lease: Duration,
    pub now: SystemTime,
    /// Stream sequence of the delivered ticket.
    pub ticket_seq: u64,
    /// A job whose stale reclaims already reached this is left to the reaper.
    pub max_stale_reclaims: u32,
    /// The record was owned by this worker's stable identity in an earlier
    /// process: take it now without waiting for the lease.
    pub restart_reclaim: bool,
}

/// What to do with a delivered ticket.
#[derive(Debug, Clone, PartialEq)]
pub enum ClaimDecision {
    /// Write this record (revision-conditioned) and run the job.
    Claim {
        record: Box<JobRecord>,
        reclaim: bool,
    },
    /// Not runnable yet (lease live elsewhere, or `next_run_at` ahead): NAK
    /// with this delay, never busy-poll.
    Wait(Duration),
    /// The ticket has nothing left to do (terminal, parked, superseded): ack it.
    Drop(String),
    /// Stale reclaims reached the limit: the reaper dead-letters it; NAK with
    /// this delay meanwhile.
    Poison(Duration),
}

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
    match status {
        s if s.is_terminal() => ClaimDecision::Drop(format!("job is {s}")),
        Status::Parked => ClaimDecision::Drop("job is parked for review".into()),
        Status::Queued => {
            let wait = until(c.now, rec.next_run_at.as_deref());
            if wait > Duration::ZERO {
                return ClaimDecision::Wait(wait);
            }
            ClaimDecision::Claim {
                record: Box::new(claimed(rec, c, false)),
                reclaim: false,
            }
        }
        Status::Running => {
            let own_restart = c.restart_reclaim && rec.worker_id.as_deref() == Some(c.worker_id);
            let remaining = until(c.now, rec.lease_expires_at.as_deref());
            if remaining > Duration::ZERO && !own_restart {
                return ClaimDecision::Wait(remaining);
            }
            if rec.stale_reclaims >= c.max_stale_reclaims {
                return ClaimDecision::Poison(c.lease);
            }
            ClaimDecision::Claim {
                record: Box::new(claimed(rec, c, true)),
                reclaim: true,
            }
        }
        _ => unreachable!("all statuses handled"),
    }
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
    r.claim_token = Some(c.claim_token.clone());
    r.epoch += 1;
    if reclaim {
        r.stale_reclaims += 1;
    }
    if c.ticket_seq > r.ticket_seq {
        r.ticket_seq = c.ticket_seq;
    }
    r.last_heartbeat_at = Some(at.clone());
    r.lease_expires_at = Some(rfc3339(c.now + c.lease));
    r.next_run_at = None;
    r.updated_at = at;
    r
}

fn owned(rec: &JobRecord, owner: &Owner, now: SystemTime) -> Result<JobRecord, TransitionError> {
    check_owner(rec, owner)?;
    let mut r = rec.clone();
    r.updated_at = rfc3339(now);
    Ok(r)
}

fn release(r: &mut JobRecord) {
    r.claim_token = None;
    r.lease_expires_at = None;
}

/// Owner extends its lease.
pub fn heartbeat(
    rec: &JobRecord,
    owner: &Owner,
    now: SystemTime,
    lease: Duration,
) -> Result<JobRecord, TransitionError> {
    let mut r = owned(rec, owner, now)?;
    r.last_heartbeat_at = Some(rfc3339(now));
    r.lease_expires_at = Some(rfc3339(now + lease));
    Ok(r)
}

/// Owner requeues after a retryable error: `attempts`+1, `next_run_at` = now + delay.
pub fn requeue(
    rec: &JobRecord,
    owner: &Owner,
    now: SystemTime,
    error: JobError,
    delay: Duration,
) -> Result<JobRecord, TransitionError> {
    let mut r = owned(rec, owner, now)?;
    r.status = Status::Queued.as_str().into();
    r.attempts += 1;
    r.error = Some(error);
    r.next_run_at = Some(rfc3339(now + delay));
    release(&mut r);
    Ok(r)
}

/// Owner hands the job back at shutdown: runnable at once, no attempt spent.
pub fn hand_back(
    rec: &JobRecord,
    owner: &Owner,
    now: SystemTime,
) -> Result<JobRecord, TransitionError> {
    let mut r = owned(rec, owner, now)?;
    r.status = Status::Queued.as_str().into();
    r.next_run_at = Some(rfc3339(now));
    release(&mut r);
    Ok(r)
}

/// Owner fails the job (terminal error, or retries exhausted; `attempts`+1).
pub fn fail(
    rec: &JobRecord,
    owner: &Owner,
    now: SystemTime,
    error: JobError,
) -> Result<JobRecord, TransitionError> {
    let mut r = owned(rec, owner, now)?;
    r.status = Status::Failed.as_str().into();
    r.attempts += 1;
    r.error = Some(error);
    release(&mut r);
    Ok(r)
}

/// Owner completes the job with its result.
pub fn complete(
    rec: &JobRecord,
    owner: &Owner,
    now: SystemTime,
    result: leasehold_proto::JobResult,
) -> Result<JobRecord, TransitionError> {
    let mut r = owned(rec, owner, now)?;
    r.status = Status::Completed.as_str().into();
    r.result = Some(result);
    r.error = None;
    release(&mut r);
    Ok(r)
}

/// Owner honours a cancellation request.
pub fn cancel_owned(
    rec: &JobRecord,
    owner: &Owner,
    now: SystemTime,
) -> Result<JobRecord, TransitionError> {
    let mut r = owned(rec, owner, now)?;
    r.status = Status::Cancelled.as_str().into();
    r.error = Some(JobError {
        class: "cancelled".into(),
        message: "cancelled on request".into(),
        at: rfc3339(now),
    });
    release(&mut r);
    Ok(r)
}

/// Owner parks the job for a person (refusal, uncertain effect, loop).
pub fn park(
    rec: &JobRecord,
    owner: &Owner,
    now: SystemTime,
    reason: &str,
    message: &str,
) -> Result<JobRecord, TransitionError> {
    let mut r = owned(rec, owner, now)?;
    r.status = Status::Parked.as_str().into();
    r.parked_reason = Some(reason.into());
    r.error = Some(JobError {
        class: reason.into(),
        message: message.into(),
        at: rfc3339(now),
    });
    release(&mut r);
    Ok(r)
}

/// Outcome of a cancellation request by anyone.
#[derive(Debug, Clone, PartialEq)]
pub enum CancelOutcome {
    /// Was queued: now cancelled.
    Cancelled(JobRecord),
    /// Is running: `cancel_requested` set; the owner stops within one heartbeat.
    Requested(JobRecord),
    /// Already requested, or already terminal: nothing to write.
    Unchanged(String),
}

/// A cancellation request (not owner-side: anyone may ask).
pub fn request_cancel(rec: &JobRecord, now: SystemTime) -> Result<CancelOutcome, TransitionError> {
    match status_of(rec) {
        Some(Status::Queued) => {
            let mut r = rec.clone();
            r.status = Status::Cancelled.as_str().into();
            r.cancel_requested = true;
            r.error = Some(JobError {
                class: "cancelled".into(),
                message: "cancelled while queued".into(),
                at: rfc3339(now),
            });
            r.updated_at = rfc3339(now);
            Ok(CancelOutcome::Cancelled(r))
        }
        Some(Status::Running) if rec.cancel_requested => Ok(CancelOutcome::Unchanged(
            "cancellation already requested".into(),
        )),
        Some(Status::Running) => {
            let mut r = rec.clone();
            r.cancel_requested = true;
            r.updated_at = rfc3339(now);
            Ok(CancelOutcome::Requested(r))
        }
        Some(s) if s.is_terminal() => Ok(CancelOutcome::Unchanged(format!("job is already {s}"))),
        _ => Err(TransitionError::NotAllowed {
            status: rec.status.clone(),
            action: "cancel",
            allowed: "queued or running (a parked job is ended with `leasehold review fail`)",
        }),
    }
}

/// Reaper: the job becomes `dead` (poison or max deliveries).
pub fn mark_dead(
    rec: &JobRecord,
    now: SystemTime,
    class: &str,
    message: &str,
) -> Result<JobRecord, TransitionError> {
    match status_of(rec) {
        Some(Status::Queued | Status::Running) => {
            let mut r = rec.clone();
            r.status = Status::Dead.as_str().into();
            r.error = Some(JobError {
                class: class.into(),
                message: message.into(),
                at: rfc3339(now),
            });
            release(&mut r);
            r.updated_at = rfc3339(now);
            Ok(r)
        }
        _ => Err(TransitionError::NotAllowed {
            status: rec.status.clone(),
            action: "dead-letter",
            allowed: "queued or running",
        }),
    }
}

/// A person resumes a parked job, or an operator replays a dead letter: the
/// job is queued again with a fresh attempt budget; its history stays in the
/// KV revisions and the events.
pub fn requeue_fresh(
    rec: &JobRecord,
    now: SystemTime,
    ticket_seq: u64,
) -> Result<JobRecord, TransitionError> {
    match status_of(rec) {
        Some(
            Status::Parked
            | Status::Failed
            | Status::Dead
            | Status::Rejected
            | Status::Cancelled
            | Status::Queued,
        ) => {
            let mut r = rec.clone();
            r.status = Status::Queued.as_str().into();
            r.attempts = 0;
            r.stale_reclaims = 0;
            r.cancel_requested = false;
            r.parked_reason = None;
            r.next_run_at = Some(rfc3339(now));
            r.ticket_seq = r.ticket_seq.max(ticket_seq);
            release(&mut r);
            r.updated_at = rfc3339(now);
            Ok(r)
        }
        _ => Err(TransitionError::NotAllowed {
            status: rec.status.clone(),
            action: "requeue",
            allowed: "parked, failed, dead, rejected or cancelled",
        }),
    }
}

/// A person fails a parked job with a reason.
pub fn fail_parked(
    rec: &JobRecord,
    now: SystemTime,
    reason: &str,
) -> Result<JobRecord, TransitionError> {
    if status_of(rec) != Some(Status::Parked) {
        return Err(TransitionError::NotAllowed {
            status: rec.status.clone(),
            action: "fail from review",
            allowed: "parked",
        });
    }
    let mut r = rec.clone();
    r.status = Status::Failed.as_str().into();
    r.error = Some(JobError {
        class: "review".into(),
        message: reason.into(),
        at: rfc3339(now),
    });
    r.updated_at = rfc3339(now);
    Ok(r)
}

/// When a running record's lease expired (None when not running or unparsable).
pub fn lease_expired_for(rec: &JobRecord, now: SystemTime) -> Option<Duration> {
    if rec.status != Status::Running.as_str() {
        return None;
    }
    let exp = parse_rfc3339(rec.lease_expires_at.as_deref()?)?;
    now.duration_since(exp).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000 + s)
    }

    fn claimant<'a>(worker: &'a str, token: &str, now: SystemTime) -> Claimant<'a> {
        Claimant {
            worker_id: worker,
            claim_token: token.into(),
            lease: Duration::from_secs(10),
            now,
            ticket_seq: 1,
            max_stale_reclaims: 3,
            restart_reclaim: false,
        }
    }

    fn fresh() -> JobRecord {
        new_record("j", "echo", JobSpec::default(), 1, t(0))
    }

    fn claim(rec: &JobRecord, c: &Claimant<'_>) -> JobRecord {
        match decide_claim(rec, c) {
            ClaimDecision::Claim { record, .. } => *record,
            other => panic!("expected a claim, got {other:?}"),
        }
    }

    #[test]
    fn every_claim_bumps_epoch_and_mints_a_token() {
        let a = claim(&fresh(), &claimant("w", "t1", t(0)));
        assert_eq!((a.epoch, a.status.as_str()), (1, "running"));
        // The same worker reclaiming its own expired job fences its older task.
        let b = claim(&a, &claimant("w", "t2", t(11)));
        assert_eq!((b.epoch, b.stale_reclaims), (2, 1));
        let old = Owner {
            worker_id: "w".into(),
            claim_token: "t1".into(),
            epoch: 1,
        };
        assert!(matches!(
            heartbeat(&b, &old, t(12), Duration::from_secs(10)),
            Err(TransitionError::OwnershipLost(_))
        ));
        assert!(heartbeat(&b, &Owner::of(&b).unwrap(), t(12), Duration::from_secs(10)).is_ok());
    }

    #[test]
    fn live_lease_and_future_run_time_wait_exactly_the_remaining_time() {
        let a = claim(&fresh(), &claimant("a", "t1", t(0)));
        assert_eq!(
            decide_claim(&a, &claimant("b", "t2", t(4))),
            ClaimDecision::Wait(Duration::from_secs(6))
        );
        let owner = Owner::of(&a).unwrap();
        let q = requeue(
            &a,
            &owner,
            t(5),
            JobError::default(),
            Duration::from_secs(30),
        )
        .unwrap();
        assert_eq!(q.attempts, 1);
        assert_eq!(
            decide_claim(&q, &claimant("b", "t2", t(20))),
            ClaimDecision::Wait(Duration::from_secs(15))
        );
        let c = claim(&q, &claimant("b", "t2", t(35)));
        assert_eq!((c.epoch, c.stale_reclaims), (2, 0));
    }

    #[test]
    fn restart_reclaim_takes_own_job_at_once_but_not_others() {
        let a = claim(&fresh(), &claimant("pod-1", "t1", t(0)));
        let mut c = claimant("pod-1", "t2", t(1));
        c.restart_reclaim = true;
        assert!(matches!(
            decide_claim(&a, &c),
            ClaimDecision::Claim { reclaim: true, .. }
        ));
        c.worker_id = "pod-2";
        assert!(matches!(decide_claim(&a, &c), ClaimDecision::Wait(_)));
    }

    #[test]
    fn terminal_parked_and_superseded_tickets_are_dropped() {
        let a = claim(&fresh(), &claimant("a", "t1", t(0)));
        let done = complete(&a, &Owner::of(&a).unwrap(), t(1), Default::default()).unwrap();
        assert!(matches!(
            decide_claim(&done, &claimant("b", "t", t(2))),
            ClaimDecision::Drop(_)
        ));
        let mut newer = fresh();
        newer.ticket_seq = 5;
        let mut c = claimant("b", "t", t(2));
        c.ticket_seq = 3;
        assert!(
            matches!(decide_claim(&newer, &c), ClaimDecision::Drop(m) if m.contains("superseded"))
        );
        // A later ticket of the same job is adopted.
        c.ticket_seq = 9;
        assert_eq!(claim(&newer, &c).ticket_seq, 9);
    }

    #[test]
    fn poison_after_the_stale_reclaim_limit() {
        let mut r = claim(&fresh(), &claimant("a", "t1", t(0)));
        for i in 0..3 {
            r = claim(&r, &claimant("b", &format!("x{i}"), t(100 * (i + 1))));
        }
        assert_eq!(r.stale_reclaims, 3);
        assert!(matches!(
            decide_claim(&r, &claimant("c", "y", t(1000))),
            ClaimDecision::Poison(_)
        ));
    }

    #[test]
    fn cancellation_queued_running_terminal() {
        let q = fresh();
        assert!(
            matches!(request_cancel(&q, t(1)).unwrap(), CancelOutcome::Cancelled(r) if r.status == "cancelled")
        );
        let a = claim(&q, &claimant("a", "t1", t(0)));
        let CancelOutcome::Requested(r) = request_cancel(&a, t(1)).unwrap() else {
            panic!()
        };
        assert!(r.cancel_requested);
        // The owner is still the owner after a cancel request.
        let c = cancel_owned(&r, &Owner::of(&a).unwrap(), t(2)).unwrap();
        assert_eq!(c.status, "cancelled");
        assert!(matches!(
            request_cancel(&c, t(3)).unwrap(),
            CancelOutcome::Unchanged(_)
        ));
    }

    #[test]
    fn only_the_owner_can_end_a_job() {
        let a = claim(&fresh(), &claimant("a", "t1", t(0)));
        let stranger = Owner {
            worker_id: "b".into(),
            claim_token: "t1".into(),
            epoch: 1,
        };
        assert!(complete(&a, &stranger, t(1), Default::default()).is_err());
        assert!(fail(&a, &stranger, t(1), JobError::default()).is_err());
        assert!(park(&a, &stranger, t(1), "loop", "x").is_err());
        assert!(hand_back(&a, &stranger, t(1)).is_err());
    }
}
