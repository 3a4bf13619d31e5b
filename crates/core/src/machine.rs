//! The job state machine.
//!
//! Every transition is a pure function from the current [`JobRecord`] to the
//! next one; the store writes the result conditioned on the revision it read.
//! Owner-side transitions first prove ownership with [`check_owner`]: status
//! `running`, the same `worker_id`, `claim_token` and `epoch`.
//!
//! ```text
//! queued    -> running     claim (epoch+1, new claim_token, the owner's session)
//! running   -> running     checkpoint / progress by the owner
//! running   -> running     reclaim: the owner's session ended, or the attempt
//!                          deadline passed (epoch+1, stale_reclaims+1)
//! running   -> queued      re-offer after the owner's session ended (stale_reclaims+1)
//! running   -> queued      retryable error with budget left (next_run_at set), or handoff
//! running   -> failed      terminal error, or retry budget exhausted
//! running   -> completed   owner-checked completion
//! queued|running -> cancelled   (a cancel request is honoured by every claim,
//!                               requeue and hand-back: it is never undone)
//! running   -> parked      owner stops for human review
//! parked    -> queued|failed   a person resumes or fails it
//! queued|running -> dead   poison (stale reclaims over the limit) or max deliveries
//! ```
//!
//! Liveness is not decided here from clocks alone: a running job is alive as
//! long as its owner's *session* is (the store judges that with a
//! server-side TTL, no wall clocks compared). The only cross-host clock
//! comparison left is the attempt deadline (`lease_expires_at`), a second line
//! for an attempt that hangs inside a live process, and it is made with a
//! skew allowance ([`Claimant::skew`]).

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

/// A fresh `queued` record for an accepted submission; a delayed one (its
/// spec's resolved `run_at`) is due then (`next_run_at`), not before.
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
        next_run_at: spec.run_at.clone(),
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

fn cancelled(rec: &JobRecord, now: SystemTime, message: &str) -> JobRecord {
    let mut r = rec.clone();
    r.status = Status::Cancelled.as_str().into();
    r.error = Some(JobError {
        class: "cancelled".into(),
        message: message.into(),
        at: rfc3339(now),
    });
    release(&mut r);
    r.updated_at = rfc3339(now);
    r
}

/// What recovery does with a running job whose owner's session ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Reoffer {
    /// Write this record (`queued`, due now, the dead owner fenced off) and
    /// publish the new ticket it names.
    Queued(Box<JobRecord>),
    /// Write this record (`cancelled`): it was asked to stop anyway.
    Cancelled(Box<JobRecord>),
    /// It has lost too many owners: dead-letter it as poison.
    Poison,
    /// Nothing to do: not running, another owner, or its owner is alive.
    Nothing(String),
}

/// Re-offers a running job whose owner (`worker_id`, session `session`) is
/// gone: the claim is released at once, so every later write of the old
/// owner is refused even before anyone claims the job again.
pub fn reoffer(
    rec: &JobRecord,
    dead_worker: &str,
    live_session: Option<&str>,
    now: SystemTime,
    ticket_seq: u64,
    max_stale_reclaims: u32,
) -> Reoffer {
    reoffer_if(
        rec,
        dead_worker,
        live_session,
        None,
        now,
        ticket_seq,
        max_stale_reclaims,
    )
}

/// Like [`reoffer`]; with `skew` given, a job whose attempt deadline passed
/// (by more than the skew) is re-offered even though its owner's session
/// lives (an attempt hung inside a live process).
pub fn reoffer_if(
    rec: &JobRecord,
    dead_worker: &str,
    live_session: Option<&str>,
    deadline_skew: Option<Duration>,
    now: SystemTime,
    ticket_seq: u64,
    max_stale_reclaims: u32,
) -> Reoffer {
    if rec.status != Status::Running.as_str() {
        return Reoffer::Nothing(format!("job is {}", rec.status));
    }
    if rec.worker_id.as_deref() != Some(dead_worker) {
        return Reoffer::Nothing("owned by another worker".into());
    }
    let overdue = deadline_skew.is_some_and(|skew| deadline_passed(rec, now, skew));
    if !overdue && live_session.is_some() && live_session == rec.session.as_deref() {
        return Reoffer::Nothing("its owner's session is alive".into());
    }
    if rec.cancel_requested {
        return Reoffer::Cancelled(Box::new(cancelled(
            rec,
            now,
            "cancelled: its owner stopped before honouring the request",
        )));
    }
    if rec.stale_reclaims + 1 > max_stale_reclaims {
        return Reoffer::Poison;
    }
    let mut r = rec.clone();
    r.status = Status::Queued.as_str().into();
    r.stale_reclaims += 1;
    r.next_run_at = Some(rfc3339(now));
    // The new ticket is the job's ticket from now on, whatever older
    // sequence the record held (a restored stream numbers anew).
    if ticket_seq > 0 {
        r.ticket_seq = ticket_seq;
    }
    r.error = Some(JobError {
        class: "owner_lost".into(),
        message: format!("worker {dead_worker} stopped (its session ended); re-offered"),
        at: rfc3339(now),
    });
    release(&mut r);
    r.updated_at = rfc3339(now);
    Reoffer::Queued(Box::new(r))
}

fn owned(rec: &JobRecord, owner: &Owner, now: SystemTime) -> Result<JobRecord, TransitionError> {
    check_owner(rec, owner)?;
    let mut r = rec.clone();
    r.updated_at = rfc3339(now);
    Ok(r)
}

fn release(r: &mut JobRecord) {
    r.claim_token = None;
    r.session = None;
    r.lease_expires_at = None;
}

/// The owner proves it is still the owner with a conditioned write that
/// changes nothing but `last_heartbeat_at` (before a write effect, or a
/// progress write). The attempt deadline stays where the claim put it.
pub fn touch(
    rec: &JobRecord,
    owner: &Owner,
    now: SystemTime,
) -> Result<JobRecord, TransitionError> {
    let mut r = owned(rec, owner, now)?;
    // A recorded cancel stops every write effect still to come, even when
    // its notice never reached the owner: the proof is refused.
    if rec.cancel_requested {
        return Err(TransitionError::NotAllowed {
            status: "running, asked to be cancelled".into(),
            action: "a write effect",
            allowed: "not asked to be cancelled",
        });
    }
    r.last_heartbeat_at = Some(rfc3339(now));
    Ok(r)
}

/// Owner requeues after a retryable error: `attempts`+1, `next_run_at` =
/// now plus the delay. A job asked to be cancelled is cancelled instead: a
/// retry never undoes a cancel request.
pub fn requeue(
    rec: &JobRecord,
    owner: &Owner,
    now: SystemTime,
    error: JobError,
    delay: Duration,
) -> Result<JobRecord, TransitionError> {
    check_owner(rec, owner)?;
    if rec.cancel_requested {
        let mut r = cancelled(rec, now, "cancelled on request (instead of a retry)");
        r.attempts += 1;
        return Ok(r);
    }
    let mut r = owned(rec, owner, now)?;
    r.status = Status::Queued.as_str().into();
    r.attempts += 1;
    r.error = Some(error);
    r.next_run_at = Some(rfc3339(now + delay));
    release(&mut r);
    Ok(r)
}

/// Owner hands the job back at shutdown: runnable at once, no attempt spent
/// (or `cancelled`, when a cancel request is pending).
pub fn hand_back(
    rec: &JobRecord,
    owner: &Owner,
    now: SystemTime,
) -> Result<JobRecord, TransitionError> {
    check_owner(rec, owner)?;
    if rec.cancel_requested {
        return Ok(cancelled(
            rec,
            now,
            "cancelled on request (instead of a hand-back)",
        ));
    }
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
    r.attempts += 1;
    // Cancel is final: a job asked to be cancelled ends cancelled.
    if rec.cancel_requested {
        let mut c = cancelled(&r, now, "cancelled on request (instead of failing)");
        c.attempts = r.attempts;
        return Ok(c);
    }
    r.status = Status::Failed.as_str().into();
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
    // Cancel is final: nobody would resume a job asked to be cancelled.
    if rec.cancel_requested {
        return Ok(cancelled(
            &r,
            now,
            "cancelled on request (instead of parking)",
        ));
    }
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

/// A waiting job whose ticket this worker cannot accept (configuration or
/// version skew: too large here, a field it does not know) is parked for a
/// person with the reason, instead of bouncing between re-enqueues.
pub fn park_waiting(
    rec: &JobRecord,
    now: SystemTime,
    reason: &str,
    message: &str,
) -> Result<JobRecord, TransitionError> {
    if status_of(rec) != Some(Status::Queued) {
        return Err(TransitionError::NotAllowed {
            status: rec.status.clone(),
            action: "park a waiting job",
            allowed: "queued",
        });
    }
    let mut r = rec.clone();
    r.status = Status::Parked.as_str().into();
    r.parked_reason = Some(reason.into());
    r.error = Some(JobError {
        class: reason.into(),
        message: message.into(),
        at: rfc3339(now),
    });
    release(&mut r);
    r.updated_at = rfc3339(now);
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
        Some(s @ (Status::Queued | Status::Parked)) => {
            let mut r = rec.clone();
            r.status = Status::Cancelled.as_str().into();
            r.cancel_requested = true;
            r.parked_reason = None;
            r.error = Some(JobError {
                class: "cancelled".into(),
                message: format!("cancelled while {s}"),
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
            allowed: "queued, parked or running",
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
            session: "s1",
            claim_token: token.into(),
            attempt_timeout: Duration::from_secs(100),
            skew: Duration::from_secs(2),
            now,
            ticket_seq: 1,
            max_stale_reclaims: 3,
            owner: OwnerLiveness::Live,
            deliveries: 1,
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
        assert_eq!(a.session.as_deref(), Some("s1"));
        // The same worker reclaiming its own job after its session ended
        // fences its older task.
        let mut c = claimant("w", "t2", t(11));
        c.owner = OwnerLiveness::Dead;
        let b = claim(&a, &c);
        assert_eq!((b.epoch, b.stale_reclaims), (2, 1));
        let old = Owner {
            worker_id: "w".into(),
            claim_token: "t1".into(),
            epoch: 1,
        };
        assert!(matches!(
            touch(&b, &old, t(12)),
            Err(TransitionError::OwnershipLost(_))
        ));
        assert!(touch(&b, &Owner::of(&b).unwrap(), t(12)).is_ok());
    }

    #[test]
    fn cancel_is_final_through_park_failure_effects_and_a_dead_owner() {
        let mut a = claim(&fresh(), &claimant("a", "t1", t(0)));
        a.cancel_requested = true;
        let o = Owner::of(&a).unwrap();
        assert!(matches!(
            touch(&a, &o, t(1)),
            Err(TransitionError::NotAllowed {
                action: "a write effect",
                ..
            })
        ));
        assert_eq!(
            park(&a, &o, t(1), "uncertain_effect", "m").unwrap().status,
            "cancelled"
        );
        let e = JobError {
            class: "terminal".into(),
            message: "m".into(),
            at: rfc3339(t(1)),
        };
        let f = fail(&a, &o, t(1), e).unwrap();
        assert_eq!((f.status.as_str(), f.attempts), ("cancelled", 1));
        // A poison-level job whose owner died: the claim cancels it, as
        // recovery does, instead of dead-lettering it.
        a.stale_reclaims = 9;
        let mut c = claimant("b", "t2", t(2));
        c.owner = OwnerLiveness::Dead;
        assert!(matches!(decide_claim(&a, &c), ClaimDecision::Cancel(_)));
        assert!(matches!(
            reoffer_if(&a, "a", None, None, t(2), 0, 3),
            Reoffer::Cancelled(_)
        ));
    }

    #[test]
    fn a_newer_ticket_of_a_requeueable_job_waits_for_the_requeue_then_goes() {
        let mut dead = fresh();
        dead.status = "dead".into();
        let mut c = claimant("b", "t2", t(4));
        c.ticket_seq = 7;
        assert_eq!(
            decide_claim(&dead, &c),
            ClaimDecision::Wait(NEWER_TICKET_WAIT)
        );
        c.deliveries = NEWER_TICKET_PATIENCE;
        assert!(matches!(decide_claim(&dead, &c), ClaimDecision::Drop(_)));
        // The record's own ticket, or an older one, goes at once; so does
        // any ticket of a completed job (a duplicate submission).
        c.deliveries = 1;
        c.ticket_seq = 1;
        assert!(matches!(decide_claim(&dead, &c), ClaimDecision::Drop(_)));
        let mut done = fresh();
        done.status = "completed".into();
        c.ticket_seq = 7;
        assert!(matches!(decide_claim(&done, &c), ClaimDecision::Drop(_)));
    }

    #[test]
    fn a_live_owner_keeps_its_job_and_the_ticket_is_settled_not_nacked() {
        let a = claim(&fresh(), &claimant("a", "t1", t(0)));
        assert!(matches!(
            decide_claim(&a, &claimant("b", "t2", t(4))),
            ClaimDecision::Settle(_)
        ));
        // Unknown liveness waits; a dead owner's job is reclaimed at once,
        // whatever its attempt deadline says.
        let mut c = claimant("b", "t2", t(4));
        c.owner = OwnerLiveness::Unknown;
        assert!(matches!(decide_claim(&a, &c), ClaimDecision::Wait(_)));
        c.owner = OwnerLiveness::Dead;
        assert!(matches!(
            decide_claim(&a, &c),
            ClaimDecision::Claim { reclaim: true, .. }
        ));
    }

    #[test]
    fn a_newer_ticket_of_a_live_job_waits_for_the_requeue_it_may_precede() {
        let a = claim(&fresh(), &claimant("a", "t1", t(0)));
        let mut c = claimant("b", "t2", t(1));
        c.ticket_seq = 9;
        assert_eq!(decide_claim(&a, &c), ClaimDecision::Wait(NEWER_TICKET_WAIT));
        // A duplicate that keeps coming back is settled, not NAKed for ever.
        c.deliveries = NEWER_TICKET_PATIENCE;
        assert!(matches!(decide_claim(&a, &c), ClaimDecision::Settle(_)));
    }

    #[test]
    fn the_attempt_deadline_is_trusted_only_past_the_skew_allowance() {
        let a = claim(&fresh(), &claimant("a", "t1", t(0)));
        // Deadline t(100); skew 2 s: at t(101) the claim still stands.
        assert!(matches!(
            decide_claim(&a, &claimant("b", "t2", t(101))),
            ClaimDecision::Settle(_)
        ));
        assert!(!deadline_passed(&a, t(102), Duration::from_secs(2)));
        assert!(matches!(
            decide_claim(&a, &claimant("b", "t2", t(103))),
            ClaimDecision::Claim { reclaim: true, .. }
        ));
    }

    #[test]
    fn a_ticket_far_ahead_of_its_due_time_is_released_not_held() {
        let a = claim(&fresh(), &claimant("a", "t1", t(0)));
        let owner = Owner::of(&a).unwrap();
        let q = requeue(
            &a,
            &owner,
            t(5),
            JobError::default(),
            Duration::from_secs(600),
        )
        .unwrap();
        assert_eq!(
            decide_claim(&q, &claimant("b", "t2", t(6))),
            ClaimDecision::Release
        );
        // Within the hold, the ticket waits out the rest itself.
        let left = HOLD_TICKET_AT_MOST.as_secs();
        assert_eq!(
            decide_claim(&q, &claimant("b", "t2", t(605 - left))),
            ClaimDecision::Wait(HOLD_TICKET_AT_MOST)
        );
    }

    #[test]
    fn future_run_time_waits_exactly_the_remaining_time() {
        let a = claim(&fresh(), &claimant("a", "t1", t(0)));
        let owner = Owner::of(&a).unwrap();
        let q = requeue(
            &a,
            &owner,
            t(5),
            JobError::default(),
            Duration::from_secs(30),
        )
        .unwrap();
        assert_eq!((q.attempts, q.session.as_deref()), (1, None));
        assert_eq!(
            decide_claim(&q, &claimant("b", "t2", t(32))),
            ClaimDecision::Wait(Duration::from_secs(3))
        );
        let c = claim(&q, &claimant("b", "t2", t(35)));
        assert_eq!((c.epoch, c.stale_reclaims), (2, 0));
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
            let mut c = claimant("b", &format!("x{i}"), t(10 * (i + 1)));
            c.owner = OwnerLiveness::Dead;
            r = claim(&r, &c);
        }
        assert_eq!(r.stale_reclaims, 3);
        let mut c = claimant("c", "y", t(1000));
        c.owner = OwnerLiveness::Dead;
        assert!(matches!(decide_claim(&r, &c), ClaimDecision::Poison(_)));
        assert_eq!(reoffer(&r, "b", None, t(1000), 9, 3), Reoffer::Poison);
    }

    #[test]
    fn reoffer_fences_the_dead_owner_and_queues_the_job() {
        let a = claim(&fresh(), &claimant("a", "t1", t(0)));
        assert!(matches!(
            reoffer(&a, "a", Some("s1"), t(1), 7, 3),
            Reoffer::Nothing(_)
        ));
        assert!(matches!(
            reoffer(&a, "b", None, t(1), 7, 3),
            Reoffer::Nothing(_)
        ));
        // The identity restarted: a new session of "a" does not keep s1's job.
        let Reoffer::Queued(q) = reoffer(&a, "a", Some("s2"), t(1), 7, 3) else {
            panic!("expected a re-offer")
        };
        assert_eq!(
            (q.status.as_str(), q.stale_reclaims, q.ticket_seq, q.epoch),
            ("queued", 1, 7, 1)
        );
        assert!(touch(&q, &Owner::of(&a).unwrap(), t(2)).is_err());
        // The old ticket is superseded by the re-offer's; the new one claims.
        assert!(matches!(
            decide_claim(&q, &claimant("b", "t2", t(2))),
            ClaimDecision::Drop(_)
        ));
        let mut c = claimant("b", "t2", t(2));
        c.ticket_seq = 7;
        assert_eq!(claim(&q, &c).epoch, 2);
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
    fn a_cancel_request_survives_requeue_hand_back_reclaim_and_reoffer() {
        let a = claim(&fresh(), &claimant("a", "t1", t(0)));
        let CancelOutcome::Requested(r) = request_cancel(&a, t(1)).unwrap() else {
            panic!()
        };
        let owner = Owner::of(&a).unwrap();
        let e = JobError::default();
        let rq = requeue(&r, &owner, t(2), e, Duration::from_secs(1)).unwrap();
        assert_eq!((rq.status.as_str(), rq.attempts), ("cancelled", 1));
        assert_eq!(hand_back(&r, &owner, t(2)).unwrap().status, "cancelled");
        let mut c = claimant("b", "t2", t(3));
        c.owner = OwnerLiveness::Dead;
        assert!(
            matches!(decide_claim(&r, &c), ClaimDecision::Cancel(x) if x.status == "cancelled")
        );
        assert!(matches!(
            reoffer(&r, "a", None, t(3), 2, 3),
            Reoffer::Cancelled(_)
        ));
        // A queued job with a pending request (set by an older binary, or
        // racing a requeue) is cancelled by the claim instead of running.
        let mut q = fresh();
        q.cancel_requested = true;
        assert!(matches!(
            decide_claim(&q, &claimant("b", "t", t(1))),
            ClaimDecision::Cancel(_)
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

    #[test]
    fn transient_retries_back_off_with_deliveries_up_to_five_seconds() {
        let d: Vec<u64> = (1..=6)
            .map(|n| transient_retry_delay(n).as_secs())
            .collect();
        assert_eq!(d, vec![1, 2, 4, 5, 5, 5]);
        assert_eq!(transient_retry_delay(0), Duration::from_secs(1));
    }
}
