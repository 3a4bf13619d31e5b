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

/// What a waiting job waits for: its step, and a time, a signal, a signal
/// with a timeout, or its children's ends (made by [`Wait::time`],
/// [`Wait::for_signal`] and [`Wait::for_children`], so never nothing).
#[derive(Debug, Clone, PartialEq)]
pub struct Wait {
    step: String,
    until: Option<SystemTime>,
    signal: Option<SignalWait>,
    children: Option<u64>,
}

/// The signal a waiting job waits for: the next one of its name.
#[derive(Debug, Clone, PartialEq)]
pub struct SignalWait {
    /// The signal's name (`approval`).
    pub name: String,
    /// The stream sequence of the last signal of this name the job's run
    /// already took (0: none): only a newer one wakes it.
    pub after: u64,
}

/// What a waiting job waits for, as every view says it
/// ([`wait_in_words`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitingFor<'a> {
    /// Its time (a durable timer).
    Time,
    /// The signal of this name.
    Signal(&'a str),
    /// Its children's ends: this many announced wake it.
    Children(u64),
}

impl Wait {
    /// A durable timer of step `step`, due at `until`.
    pub fn time(step: impl Into<String>, until: SystemTime) -> Wait {
        Wait {
            step: step.into(),
            until: Some(until),
            signal: None,
            children: None,
        }
    }

    /// A wait of step `step` for the next signal `name` newer than
    /// `after`, until `timeout` if one is given.
    pub fn for_signal(
        step: impl Into<String>,
        name: impl Into<String>,
        after: u64,
        timeout: Option<SystemTime>,
    ) -> Wait {
        Wait {
            step: step.into(),
            until: timeout,
            signal: Some(SignalWait {
                name: name.into(),
                after,
            }),
            children: None,
        }
    }

    /// A wait of step `step` (a join) for its children: it wakes once
    /// `ends` child ends were announced to the job in all (see
    /// [`CHILDREN`]).
    pub fn for_children(step: impl Into<String>, ends: u64) -> Wait {
        Wait {
            step: step.into(),
            until: None,
            signal: None,
            children: Some(ends),
        }
    }

    /// The step that waits (`sleep#0`, `wait:approval#0`, `join#0`).
    pub fn step(&self) -> &str {
        &self.step
    }

    /// When it wakes whatever else happens: a timer's time, a signal's
    /// timeout. `None`: only its signal, or its children, wake it.
    pub fn until(&self) -> Option<SystemTime> {
        self.until
    }

    /// The signal that wakes it, if any.
    pub fn signal(&self) -> Option<&SignalWait> {
        self.signal.as_ref()
    }

    /// The number of announced child ends that wakes it, if it waits for
    /// children.
    pub fn children(&self) -> Option<u64> {
        self.children
    }

    /// What it waits for.
    pub fn what(&self) -> WaitingFor<'_> {
        match (&self.signal, self.children) {
            (Some(s), _) => WaitingFor::Signal(&s.name),
            (None, Some(n)) => WaitingFor::Children(n),
            (None, None) => WaitingFor::Time,
        }
    }

    /// What the record's `waiting_for` says: `time`, `signal:<name>` or
    /// `children`.
    pub fn waiting_for(&self) -> String {
        match self.what() {
            WaitingFor::Signal(name) => format!("{SIGNAL_PREFIX}{name}"),
            WaitingFor::Children(_) => CHILDREN.into(),
            WaitingFor::Time => "time".into(),
        }
    }
}

/// The prefix of a signal wait's `waiting_for` (`signal:<name>`).
pub const SIGNAL_PREFIX: &str = "signal:";

/// A join's `waiting_for`: the job waits for its children's ends.
pub const CHILDREN: &str = "children";

/// Owner ends the attempt to wait (`w`: a durable timer, a signal): the
/// job is `waiting`, held by nobody, with no ticket (its wake-up gives it
/// one at its time, a signal's waker when the signal comes); no attempt is
/// spent.
pub fn wait(
    rec: &JobRecord,
    owner: &Owner,
    now: SystemTime,
    w: &Wait,
) -> Result<JobRecord, TransitionError> {
    let mut r = owned(rec, owner, now)?;
    if rec.cancel_requested {
        return Ok(cancelled(
            &r,
            now,
            "cancelled on request (instead of waiting)",
        ));
    }
    r.status = Status::Waiting.as_str().into();
    r.next_run_at = w.until.map(rfc3339);
    r.waiting_for = Some(w.waiting_for());
    r.waiting_step = Some(w.step.clone());
    r.waiting_until = r.next_run_at.clone();
    r.waiting_after = match (&w.signal, w.children) {
        (Some(s), _) => s.after,
        (None, Some(n)) => n,
        (None, None) => 0,
    };
    r.ticket_seq = 0;
    release(&mut r);
    Ok(r)
}

/// The signal a `waiting` record waits for: its name and the sequence a
/// newer signal must pass (`None`: it waits for no signal).
pub fn signal_of(rec: &JobRecord) -> Option<(&str, u64)> {
    if status_of(rec) != Some(Status::Waiting) {
        return None;
    }
    let name = rec.waiting_for.as_deref()?.strip_prefix(SIGNAL_PREFIX)?;
    Some((name, rec.waiting_after))
}

/// The number of announced child ends that wakes a `waiting` record that
/// waits for its children (`None`: it waits for something else).
pub fn children_of(rec: &JobRecord) -> Option<u64> {
    (status_of(rec) == Some(Status::Waiting) && rec.waiting_for.as_deref() == Some(CHILDREN))
        .then_some(rec.waiting_after)
}

/// What a `waiting` record waits for, in words, as every view says it:
/// `for time until T (sleep#0)`, `for signal `go` (wait:go#0)`, `for
/// signal `go` until T (wait:go#0)`, `for 3 children's ends (join#0)`.
pub fn waits_for(rec: &JobRecord) -> String {
    let what = match (signal_of(rec), children_of(rec)) {
        (Some((name, _)), _) => WaitingFor::Signal(name),
        (None, Some(n)) => WaitingFor::Children(n),
        (None, None) => WaitingFor::Time,
    };
    wait_in_words(
        what,
        rec.next_run_at.as_deref(),
        rec.waiting_step.as_deref().unwrap_or("?"),
    )
}

/// [`waits_for`] from its parts (a `waiting` event's `for`, `name`,
/// `count`, `until` and `step` say the same): what it waits for, until
/// when, and the step that waits.
pub fn wait_in_words(what: WaitingFor<'_>, until: Option<&str>, step: &str) -> String {
    let until = until
        .filter(|t| !t.is_empty())
        .map(|t| format!(" until {t}"))
        .unwrap_or_default();
    match what {
        WaitingFor::Signal(name) => format!("for signal `{name}`{until} ({step})"),
        WaitingFor::Children(_) => format!("for its children{until} ({step})"),
        WaitingFor::Time => format!("for time{until} ({step})"),
    }
}

/// Whether a job that waits without a ticket (`waiting`, or `queued` with
/// its ticket released for a delay) may run at `now`: its signal came
/// (`signalled`, which the caller read for a record [`signal_of`] names),
/// or its time did. A queued job without a time runs at once; a job that
/// waits only for a signal has no time. The one rule of the claim, the
/// wake-up loop and the signal waker.
pub fn wait_over(rec: &JobRecord, now: SystemTime, signalled: bool) -> bool {
    if signalled {
        return true;
    }
    match rec.next_run_at.as_deref() {
        Some(t) => until(now, Some(t)).is_zero(),
        None => status_of(rec) != Some(Status::Waiting),
    }
}

/// A waiting job whose wait is over (its time came, or its signal):
/// `queued` on ticket `ticket_seq` (which its waker published first), due
/// now, whatever time it would have woken at (a signal's timeout). `None`
/// when the job is not waiting (it moved on; nothing to write).
/// `waiting_step` and `waiting_until` stay: the next attempt's step reads
/// its wait as done, or its timeout, from the record it claims.
pub fn wake(rec: &JobRecord, now: SystemTime, ticket_seq: u64) -> Option<JobRecord> {
    if status_of(rec) != Some(Status::Waiting) {
        return None;
    }
    let mut r = rec.clone();
    r.status = Status::Queued.as_str().into();
    r.ticket_seq = ticket_seq;
    r.next_run_at = None;
    r.waiting_for = None;
    r.updated_at = rfc3339(now);
    Some(r)
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
    /// Running, and asked to be cancelled already: nothing to write.
    AlreadyRequested,
    /// Already terminal (the message says which): nothing to write.
    Unchanged(String),
}

/// A cancellation request (not owner-side: anyone may ask).
pub fn request_cancel(rec: &JobRecord, now: SystemTime) -> Result<CancelOutcome, TransitionError> {
    match status_of(rec) {
        Some(s @ (Status::Queued | Status::Parked | Status::Waiting)) => {
            let mut r = rec.clone();
            r.status = Status::Cancelled.as_str().into();
            r.cancel_requested = true;
            r.parked_reason = None;
            r.waiting_for = None;
            r.waiting_step = None;
            r.error = Some(JobError {
                class: "cancelled".into(),
                message: format!("cancelled while {s}"),
                at: rfc3339(now),
            });
            r.updated_at = rfc3339(now);
            Ok(CancelOutcome::Cancelled(r))
        }
        Some(Status::Running) if rec.cancel_requested => Ok(CancelOutcome::AlreadyRequested),
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
            allowed: "queued, parked, waiting or running",
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

mod claim;
mod end;
pub use claim::{
    claim_new, deadline_passed, decide_claim, due, transient_retry_delay, ClaimDecision, Claimant,
    OwnerLiveness, HOLD_TICKET_AT_MOST, NEWER_TICKET_PATIENCE, NEWER_TICKET_WAIT,
    TRANSIENT_RETRY_CAP,
};
pub use end::{end, Effects, End, EndPolicy, Ended, Failure, Settle, Step, Ticket, KEEP_DELAY};

#[cfg(test)]
mod tests;
