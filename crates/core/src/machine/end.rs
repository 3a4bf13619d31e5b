//! How an attempt ends.
//!
//! [`End`] is the one vocabulary every kind ends an attempt with (built-in,
//! SDK, research and remote kinds alike), and [`end`] the one pure
//! transition from the running record and an end to the next record and
//! what must follow the write ([`Effects`]), in the one safe order. "A
//! cancel request wins" is decided here, once: every end but a completion
//! of a job asked to be cancelled ends it cancelled instead. The worker's
//! executor (`Attempt::finish`) carries the effects out; it decides nothing.
//!
//! The orders, and why:
//! - a terminal end (completed, failed, cancelled): the record, then its
//!   event (the only pointer a client's stream and retention have to the
//!   end), then the ticket acked, then the index entry removed. An event
//!   that cannot be published keeps the ticket and the entry: the claim or
//!   the recoverer that finds the ended record publishes it.
//! - parked: the record, then the parked index entry (a parked job is
//!   always listed: when the entry cannot be written the ticket is kept, and
//!   its claim indexes the job), then the event, then the ack.
//! - a retry: its event, a fresh ticket, the record naming that ticket, the
//!   index, then the held ticket acked (the fresh one is the job's now). The
//!   event goes first: once the record is queued, a new owner's events may
//!   follow at once.
//! - a hand-back: a ticket first (the held delivery, or a fresh one), the
//!   record, the index, then the held delivery NAKed back.
//! - waiting (a durable timer): the record (no ticket, no owner), its index
//!   entry, its wake-up, then the event, then the ack. The entry and the
//!   wake-up are required: when either cannot be written the ticket is
//!   kept, and its claim (which finds the job waiting) writes the wake-up.
//!   A wait for a signal looks once more after the write: a signal sent
//!   between its step's look and the write found the job still running,
//!   and its waker left it; the look wakes it (required as well).

use std::time::{Duration, SystemTime};

use leasehold_proto::JobResult;
use serde_json::{json, Value};

use super::{
    cancel_owned, complete, fail, hand_back, park, requeue, wait, Owner, TransitionError, Wait,
    WaitingFor,
};
use crate::retry::RetryPolicy;
use crate::status::Status;
use crate::time::{human_duration, rfc3339};
use crate::{JobError, JobRecord};

/// Why a failed attempt failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// Worth another attempt (with backoff) while the retry budget lasts.
    Retryable,
    /// Never retried.
    Terminal,
    /// A budget of the job (steps, tokens, cost, wall time) ran out: never
    /// retried; what the attempt produced is kept as partial.
    Budget,
}

impl Failure {
    /// The class as the record's `error.class` and a span's `error.type` say it.
    pub fn as_str(self) -> &'static str {
        match self {
            Failure::Retryable => "retryable",
            Failure::Terminal => "terminal",
            Failure::Budget => "budget_exhausted",
        }
    }
}

/// How one attempt of a job ended.
///
/// ```
/// use leasehold_core::machine::{End, Failure};
/// let e = End::budget_exhausted("tokens ran out");
/// assert!(matches!(e, End::Failed { class: Failure::Budget, .. }));
/// ```
#[derive(Debug, Clone, PartialEq)]
pub enum End {
    /// The job's result (its output JSON, a report's artifact and digest).
    Completed(JobResult),
    /// Stop for a person: a refusal, an uncertain effect, a question.
    Parked {
        /// A short word (`approval`, `uncertain_effect`): the record's `parked_reason`.
        reason: String,
        /// What a person needs to know.
        message: String,
        /// The step that asked the person (`ctx.park`, a remote kind's
        /// `park` op), written into the `parked` event: an answer names it.
        step: Option<String>,
    },
    /// The attempt failed.
    Failed {
        class: Failure,
        message: String,
        /// What the attempt produced before it stopped, kept as the
        /// record's `result` (with `partial: true`) when the job ends.
        partial: Option<Box<JobResult>>,
        /// The least delay before the next attempt of a retryable failure
        /// (the job's backoff stands when it is longer).
        retry_after: Option<Duration>,
    },
    /// The attempt stopped on a cancel request (or its kind said so).
    Cancelled { partial: Option<Box<JobResult>> },
    /// Given back unfinished (shutdown, no fence, a kind not served here):
    /// runnable at once, no attempt spent.
    HandedBack,
    /// Wait, holding no worker, for a time (a durable timer), a signal, or
    /// a signal until a timeout; no attempt spent. The job runs again when
    /// its wait is over, on any worker, and its step takes the wait as done.
    Waiting(Wait),
}

impl End {
    fn failed(class: Failure, m: impl Into<String>) -> End {
        End::Failed {
            class,
            message: m.into(),
            partial: None,
            retry_after: None,
        }
    }
    /// A failure worth another attempt.
    pub fn retryable(m: impl Into<String>) -> End {
        End::failed(Failure::Retryable, m)
    }
    /// A failure retrying cannot fix.
    pub fn terminal(m: impl Into<String>) -> End {
        End::failed(Failure::Terminal, m)
    }
    /// A budget ran out.
    pub fn budget_exhausted(m: impl Into<String>) -> End {
        End::failed(Failure::Budget, m)
    }
    /// Cancelled, with nothing kept.
    pub fn cancelled() -> End {
        End::Cancelled { partial: None }
    }
    /// A stop for a person no step asked an answer for.
    pub fn parked(reason: impl Into<String>, message: impl Into<String>) -> End {
        End::Parked {
            reason: reason.into(),
            message: message.into(),
            step: None,
        }
    }
    /// The same end, keeping what the attempt produced (a failure or a cancel).
    pub fn with_partial(mut self, p: Option<Box<JobResult>>) -> End {
        if let End::Failed { partial, .. } | End::Cancelled { partial } = &mut self {
            *partial = p;
        }
        self
    }
    /// The same failure, retried not before `after`.
    pub fn with_retry_after(mut self, after: Duration) -> End {
        if let End::Failed { retry_after, .. } = &mut self {
            *retry_after = Some(after);
        }
        self
    }
    /// What the attempt produced before it stopped, when it kept any.
    pub fn into_partial(self) -> Option<Box<JobResult>> {
        match self {
            End::Failed { partial, .. } | End::Cancelled { partial } => partial,
            _ => None,
        }
    }
}

/// What the job's policy says about this end: the retry budget, the
/// backoff drawn for a retry (the one random part, drawn by the caller),
/// and the ticket published for it, which the record names.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EndPolicy {
    /// Attempts in all (the first included) before the job fails.
    pub max_attempts: u32,
    /// The delay before the next attempt of a retryable failure.
    pub backoff: Duration,
    /// The fresh ticket published for this end ([`Ticket::Fresh`],
    /// [`Ticket::Return`] when none was held): the record names it.
    pub ticket: Option<u64>,
}

impl EndPolicy {
    /// The policy for the next attempt of a job that has run `attempts` times.
    pub fn drawn(p: &RetryPolicy, attempts: u32, rng: &mut impl rand::Rng) -> EndPolicy {
        EndPolicy {
            max_attempts: p.max_attempts,
            backoff: p.delay(attempts, rng),
            ticket: None,
        }
    }
    /// The same policy, the record naming ticket `seq`.
    pub fn with_ticket(self, seq: u64) -> EndPolicy {
        EndPolicy {
            ticket: Some(seq),
            ..self
        }
    }
}

/// How the attempt ended, as its metrics and its one log line say it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    Completed,
    Parked,
    Waiting,
    Cancelled,
    Retried,
    Failed,
    HandedBack,
}

/// The ticket this end needs before its record is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ticket {
    /// None: the ticket the attempt holds (if any) is settled after the write.
    Held,
    /// A fresh ticket, for `why` (`retry`): each retry gets one, so retries
    /// never spend the deliveries of one ticket. When it cannot be
    /// published the record is written all the same (a waiting job whose
    /// ticket is gone gets one from the reaper after `--stranded-grace`).
    Fresh(&'static str),
    /// The held delivery comes back (NAKed); an attempt holding none
    /// publishes a fresh one for `why` first, and without it writes nothing
    /// (its session's end recovers the job).
    Return(&'static str),
}

/// What settles the held delivery of the job's ticket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    Ack,
    /// Back to the queue, after the delay when there is one.
    Nak(Option<Duration>),
}

/// One thing that follows the write, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum Step {
    /// A fenced event of the owner. `terminal`: the job's last word,
    /// published under the record's dedupe id and retried; when it cannot
    /// be published the ticket is kept (NAKed with [`KEEP_DELAY`]) and the
    /// steps after it are left to whoever finds the ended record.
    Event {
        ty: &'static str,
        data: Value,
        terminal: bool,
    },
    /// The index follows the record. `required`: when it cannot be
    /// written the ticket is kept (NAKed with [`KEEP_DELAY`]), so that its
    /// claim indexes the job, and the steps after it are not taken.
    Index {
        required: bool,
    },
    Settle(Settle),
    /// The job's wake-up at its `next_run_at` (the `due.<job>` key every
    /// worker and reaper watches). Required, as a required index entry is.
    Wake,
    /// A job that waits for a signal wakes now if its signal is already
    /// there (sent after its step looked, before the record said
    /// `waiting`: the signal's waker found it still running). Required:
    /// when it cannot be looked at, the ticket is kept and its claim looks.
    Recheck,
}

/// How long a kept ticket waits before it comes back.
pub const KEEP_DELAY: Duration = Duration::from_secs(1);

/// What must follow an end's write.
#[derive(Debug, Clone, PartialEq)]
pub struct Effects {
    pub ended: Ended,
    /// The class of a failed attempt (`retryable`, `exhausted`, `terminal`,
    /// `budget_exhausted`): its span's `error.type`.
    pub failure: Option<String>,
    /// The ticket needed before the write.
    pub ticket: Ticket,
    /// Published before the write (a retry's announcement).
    pub before: Option<Step>,
    /// After the write, in order.
    pub after: Vec<Step>,
    /// What happens next, for the attempt's log line.
    pub next: String,
}

impl Effects {
    fn terminal(ended: Ended, ty: &'static str, data: Value, next: &str) -> Effects {
        Effects {
            ended,
            failure: None,
            ticket: Ticket::Held,
            before: None,
            after: vec![
                Step::Event {
                    ty,
                    data,
                    terminal: true,
                },
                Step::Settle(Settle::Ack),
                Step::Index { required: false },
            ],
            next: next.into(),
        }
    }
}

/// The owner's end of an attempt: the next record and what must follow
/// its write. Refused (like every owner write) when `owner` no longer owns
/// the record.
pub fn end(
    rec: &JobRecord,
    owner: &Owner,
    now: SystemTime,
    end: &End,
    policy: &EndPolicy,
) -> Result<(JobRecord, Effects), TransitionError> {
    let with_partial = |mut r: JobRecord, p: &Option<Box<JobResult>>| {
        if let Some(p) = p {
            r.result = Some((**p).clone());
        }
        r
    };
    let cancelled_instead = |r: JobRecord, why: Value| {
        let fx = Effects::terminal(Ended::Cancelled, "cancelled", why, "the job was cancelled");
        (r, fx)
    };
    let is_cancelled = |r: &JobRecord| r.status == Status::Cancelled.as_str();
    match end {
        End::Completed(res) => {
            // An output that is not JSON would make the record unreadable:
            // the attempt fails with a clear error instead.
            if !res.output.is_empty() && serde_json::from_str::<Value>(&res.output).is_err() {
                let e = End::terminal(format!(
                    "the handler's result is not JSON ({} bytes); nothing was recorded",
                    res.output.len()
                ));
                return self::end(rec, owner, now, &e, policy);
            }
            let r = complete(rec, owner, now, res.clone())?;
            let data =
                json!({"partial": res.partial, "artifact": res.artifact, "digest": res.digest});
            Ok((
                r,
                Effects::terminal(Ended::Completed, "completed", data, "the job completed"),
            ))
        }
        End::Parked {
            reason,
            message,
            step,
        } => {
            let r = park(rec, owner, now, reason, message)?;
            if is_cancelled(&r) {
                return Ok(cancelled_instead(r, json!({"instead_of": "park"})));
            }
            let fx = Effects {
                ended: Ended::Parked,
                failure: None,
                ticket: Ticket::Held,
                before: None,
                after: vec![
                    Step::Index { required: true },
                    Step::Event {
                        ty: "parked",
                        data: json!({"reason": reason, "message": message, "step": step}),
                        terminal: false,
                    },
                    Step::Settle(Settle::Ack),
                ],
                next: "parked for review (`leasehold review list`)".into(),
            };
            Ok((r, fx))
        }
        End::Waiting(w) => {
            let r = wait(rec, owner, now, w)?;
            if is_cancelled(&r) {
                return Ok(cancelled_instead(r, json!({"instead_of": "wait"})));
            }
            let step = w.step();
            let until = w.until().map(rfc3339);
            let mut after = vec![Step::Index { required: true }];
            // A time (a timer's, a signal's timeout): its wake-up.
            if until.is_some() {
                after.push(Step::Wake);
            }
            let (data, next) = match w.what() {
                WaitingFor::Signal(name) => {
                    let timeout = until
                        .as_deref()
                        .map(|t| format!(" or until {t}"))
                        .unwrap_or_default();
                    (
                        json!({"for": "signal", "name": name, "until": until, "step": step}),
                        format!("waiting for signal `{name}`{timeout} ({step}); no worker holds it meanwhile"),
                    )
                }
                WaitingFor::Children(ends) => (
                    json!({"for": "children", "ends": ends, "step": step}),
                    format!("waiting for its children ({step}); no worker holds it meanwhile"),
                ),
                WaitingFor::Time => {
                    let at = until.clone().unwrap_or_default();
                    (
                        json!({"for": "time", "until": at, "step": step}),
                        format!("waiting until {at} ({step}); no worker holds it meanwhile"),
                    )
                }
            };
            after.push(Step::Event {
                ty: "waiting",
                data,
                terminal: false,
            });
            // A signal, or a child's end, that came while the attempt ended
            // (after its step looked) wakes it, once its event is out.
            if w.what() != WaitingFor::Time {
                after.push(Step::Recheck);
            }
            after.push(Step::Settle(Settle::Ack));
            let fx = Effects {
                ended: Ended::Waiting,
                failure: None,
                ticket: Ticket::Held,
                before: None,
                after,
                next,
            };
            Ok((r, fx))
        }
        End::Cancelled { partial } => {
            let r = with_partial(cancel_owned(rec, owner, now)?, partial);
            Ok(cancelled_instead(r, json!({})))
        }
        End::HandedBack => {
            let mut r = hand_back(rec, owner, now)?;
            if let Some(seq) = policy.ticket {
                r.ticket_seq = seq;
            }
            if is_cancelled(&r) {
                return Ok(cancelled_instead(r, json!({"while": "hand_back"})));
            }
            let fx = Effects {
                ended: Ended::HandedBack,
                failure: None,
                ticket: Ticket::Return("handback"),
                before: None,
                after: vec![
                    Step::Index { required: false },
                    Step::Settle(Settle::Nak(None)),
                ],
                next: "handed back".into(),
            };
            Ok((r, fx))
        }
        End::Failed {
            class,
            message,
            partial,
            retry_after,
        } => failed(
            rec,
            owner,
            now,
            (*class, message, partial, *retry_after),
            policy,
        ),
    }
}

type Failed<'a> = (
    Failure,
    &'a String,
    &'a Option<Box<JobResult>>,
    Option<Duration>,
);

fn failed(
    rec: &JobRecord,
    owner: &Owner,
    now: SystemTime,
    (class, message, partial, retry_after): Failed<'_>,
    policy: &EndPolicy,
) -> Result<(JobRecord, Effects), TransitionError> {
    let failed = rec.attempts + 1;
    let at = rfc3339(now);
    if class == Failure::Retryable && failed < policy.max_attempts {
        // A delay the kind asked for is the least one.
        let delay = policy.backoff.max(retry_after.unwrap_or_default());
        let error = JobError {
            class: "retryable".into(),
            message: message.clone(),
            at,
        };
        let mut r = requeue(rec, owner, now, error, delay)?;
        if let Some(seq) = policy.ticket {
            r.ticket_seq = seq;
        }
        let announce = Step::Event {
            ty: "retry",
            data: json!({"scope": "job", "reason": message, "eligible": true, "retained": "completed checkpoints", "attempt": failed, "budget_left": policy.max_attempts - failed, "delay_ms": delay.as_millis() as u64, "asked_delay_ms": retry_after.map(|d| d.as_millis() as u64)}),
            terminal: false,
        };
        if r.status == Status::Cancelled.as_str() {
            let mut fx = Effects::terminal(
                Ended::Cancelled,
                "cancelled",
                json!({"while": "retry"}),
                "the job was cancelled",
            );
            fx.ticket = Ticket::Fresh("retry");
            fx.before = Some(announce);
            return Ok((r, fx));
        }
        let fx = Effects {
            ended: Ended::Retried,
            failure: Some("retryable".into()),
            ticket: Ticket::Fresh("retry"),
            before: Some(announce),
            after: vec![
                Step::Index { required: false },
                // The fresh ticket is the job's now.
                Step::Settle(Settle::Ack),
            ],
            next: format!(
                "retrying in {} ({failed} of {} attempts failed)",
                human_duration(delay),
                policy.max_attempts
            ),
        };
        return Ok((r, fx));
    }
    let (class, message) = match class {
        Failure::Retryable => (
            "exhausted".to_string(),
            format!(
                "{message} (retry budget of {} attempts exhausted)",
                policy.max_attempts
            ),
        ),
        c => (c.as_str().to_string(), message.clone()),
    };
    let error = JobError {
        class: class.clone(),
        message: message.clone(),
        at,
    };
    let mut r = fail(rec, owner, now, error)?;
    if let Some(p) = partial {
        r.result = Some((**p).clone());
    }
    if r.status == Status::Cancelled.as_str() {
        let fx = Effects::terminal(
            Ended::Cancelled,
            "cancelled",
            json!({"instead_of": "failure"}),
            "the job was cancelled",
        );
        return Ok((r, fx));
    }
    let data = json!({"class": class, "message": message, "attempts": failed});
    let mut fx = Effects::terminal(Ended::Failed, "failed", data, "the job failed");
    fx.failure = Some(class);
    Ok((r, fx))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::machine::{claim_new, new_record, Claimant, OwnerLiveness};

    fn now() -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000)
    }

    fn running(attempts: u32, cancel_requested: bool) -> (JobRecord, Owner) {
        let fresh = new_record("j1", "echo", Default::default(), 1, now());
        let c = Claimant {
            worker_id: "w1",
            session: "s1",
            claim_token: "t1".into(),
            attempt_timeout: Duration::from_secs(60),
            skew: Duration::from_secs(1),
            now: now(),
            ticket_seq: 1,
            max_stale_reclaims: 3,
            owner: OwnerLiveness::Live,
            deliveries: 1,
            signalled: false,
        };
        let mut r = claim_new(fresh, &c);
        r.attempts = attempts;
        r.cancel_requested = cancel_requested;
        let o = Owner::of(&r).unwrap();
        (r, o)
    }

    fn policy() -> EndPolicy {
        EndPolicy {
            max_attempts: 3,
            backoff: Duration::from_secs(2),
            ticket: Some(42),
        }
    }

    fn done(output: &str) -> End {
        End::Completed(JobResult {
            output: output.into(),
            ..Default::default()
        })
    }

    /// What a row of the table checks: the status written, how the attempt
    /// ended, the ticket needed, and the steps after the write by name.
    fn shape(fx: &Effects) -> Vec<String> {
        fx.after
            .iter()
            .map(|s| match s {
                Step::Event { ty, terminal, .. } => {
                    format!("{ty}{}", if *terminal { "!" } else { "" })
                }
                Step::Index { required } => format!("index{}", if *required { "!" } else { "" }),
                Step::Settle(Settle::Ack) => "ack".into(),
                Step::Settle(Settle::Nak(_)) => "nak".into(),
                Step::Wake => "wake!".into(),
                Step::Recheck => "recheck!".into(),
            })
            .collect()
    }

    /// (attempts so far, cancel requested, end) -> (status, ended, ticket, steps).
    type Row = (
        u32,
        bool,
        End,
        &'static str,
        Ended,
        Ticket,
        &'static [&'static str],
    );

    #[test]
    fn every_end_on_every_record_has_one_next_record_and_one_order() {
        // A terminal end: its event, the ack, then the index.
        let completed: &[&str] = &["completed!", "ack", "index"];
        let failed: &[&str] = &["failed!", "ack", "index"];
        let cancelled: &[&str] = &["cancelled!", "ack", "index"];
        use {Ended as E, Ticket as T};
        #[rustfmt::skip]
        let table: Vec<Row> = vec![
            (0, false, done("{\"a\":1}"),                 "completed", E::Completed,  T::Held,             completed),
            (0, false, done("not json"),                  "failed",    E::Failed,     T::Held,             failed),
            (0, true,  done("1"),                         "completed", E::Completed,  T::Held,             completed),
            (0, false, End::parked("approval", "ok?"),    "parked",    E::Parked,     T::Held,             &["index!", "parked", "ack"]),
            (0, true,  End::parked("approval", "ok?"),    "cancelled", E::Cancelled,  T::Held,             cancelled),
            (0, false, End::retryable("503"),             "queued",    E::Retried,    T::Fresh("retry"),   &["index", "ack"]),
            (0, true,  End::retryable("503"),             "cancelled", E::Cancelled,  T::Fresh("retry"),   cancelled),
            (2, false, End::retryable("503"),             "failed",    E::Failed,     T::Held,             failed),
            (0, false, End::terminal("bad"),              "failed",    E::Failed,     T::Held,             failed),
            (0, true,  End::terminal("bad"),              "cancelled", E::Cancelled,  T::Held,             cancelled),
            (0, false, End::budget_exhausted("tokens"),   "failed",    E::Failed,     T::Held,             failed),
            (0, false, End::cancelled(),                  "cancelled", E::Cancelled,  T::Held,             cancelled),
            (0, false, End::HandedBack,                   "queued",    E::HandedBack, T::Return("handback"), &["index", "nak"]),
            (0, true,  End::HandedBack,                   "cancelled", E::Cancelled,  T::Held,             cancelled),
            (0, false, nap(),                             "waiting",   E::Waiting,    T::Held,             &["index!", "wake!", "waiting", "ack"]),
            (0, true,  nap(),                             "cancelled", E::Cancelled,  T::Held,             cancelled),
            (0, false, hark(None),                        "waiting",   E::Waiting,    T::Held,             &["index!", "waiting", "recheck!", "ack"]),
            (0, false, hark(Some(60)),                    "waiting",   E::Waiting,    T::Held,             &["index!", "wake!", "waiting", "recheck!", "ack"]),
            (0, true,  hark(None),                        "cancelled", E::Cancelled,  T::Held,             cancelled),
        ];
        for (i, (attempts, cancel, e, status, ended, ticket, steps)) in
            table.into_iter().enumerate()
        {
            let (rec, owner) = running(attempts, cancel);
            let (r, fx) = end(&rec, &owner, now(), &e, &policy()).unwrap();
            let row = format!("row {i}: {e:?} (attempts {attempts}, cancel asked {cancel})");
            assert_eq!(r.status, status, "{row}");
            assert_eq!(fx.ended, ended, "{row}");
            assert_eq!(fx.ticket, ticket, "{row}");
            assert_eq!(shape(&fx), steps, "{row}");
            assert!(
                r.claim_token.is_none() && r.session.is_none(),
                "{row}: released"
            );
            // A retry's announcement goes before the write, and only a retry has one.
            assert_eq!(
                fx.before.is_some(),
                ticket == Ticket::Fresh("retry"),
                "{row}"
            );
        }
    }

    fn nap() -> End {
        End::Waiting(Wait::time("sleep#0", now() + Duration::from_secs(3600)))
    }

    /// A wait for signal `approval` after sequence 9, with a timeout in
    /// `timeout` seconds.
    fn hark(timeout: Option<u64>) -> End {
        End::Waiting(Wait::for_signal(
            "wait:approval#1",
            "approval",
            9,
            timeout.map(|s| now() + Duration::from_secs(s)),
        ))
    }

    #[test]
    fn a_signal_wait_names_its_signal_the_sequence_to_pass_and_its_timeout() {
        let (rec, owner) = running(1, false);
        let (r, fx) = end(&rec, &owner, now(), &hark(None), &policy()).unwrap();
        assert_eq!((r.status.as_str(), r.ticket_seq), ("waiting", 0));
        assert_eq!(r.waiting_for.as_deref(), Some("signal:approval"));
        assert_eq!(r.waiting_after, 9);
        assert_eq!(r.next_run_at, None, "no timeout: no time wakes it");
        assert_eq!(crate::machine::signal_of(&r), Some(("approval", 9)));
        assert_eq!(
            crate::machine::waits_for(&r),
            "for signal `approval` (wait:approval#1)"
        );
        // Only its signal ends the wait; a time never does.
        let later = now() + Duration::from_secs(86_400 * 365);
        assert!(!crate::machine::wait_over(&r, later, false));
        assert!(crate::machine::wait_over(&r, now(), true));
        let Some(Step::Event { data, .. }) = fx.after.get(1) else {
            panic!("the waiting event")
        };
        assert_eq!(
            data,
            &json!({"for": "signal", "name": "approval", "until": null, "step": "wait:approval#1"})
        );
        // With a timeout: its time ends the wait too.
        let (r, _) = end(&rec, &owner, now(), &hark(Some(60)), &policy()).unwrap();
        // Woken by its signal before the timeout: due at once, the
        // timeout kept for the step.
        let woken = crate::machine::wake(&r, now(), 5).unwrap();
        assert_eq!(woken.next_run_at, None, "runnable now, not at its timeout");
        assert!(crate::machine::wait_over(&woken, now(), false));
        let at = rfc3339(now() + Duration::from_secs(60));
        assert_eq!(r.next_run_at.as_deref(), Some(at.as_str()));
        assert_eq!(r.waiting_until.as_deref(), Some(at.as_str()));
        assert!(!crate::machine::wait_over(&r, now(), false));
        assert!(crate::machine::wait_over(
            &r,
            now() + Duration::from_secs(60),
            false
        ));
        // A timer is no signal wait; a queued job released for a delay
        // without a time is due at once.
        let (t, _) = end(&rec, &owner, now(), &nap(), &policy()).unwrap();
        assert_eq!(crate::machine::signal_of(&t), None);
        let mut q = rec.clone();
        q.status = "queued".into();
        q.next_run_at = None;
        assert!(crate::machine::wait_over(&q, now(), false));
    }

    #[test]
    fn a_wait_holds_no_ticket_spends_no_attempt_and_names_its_step_and_time() {
        let (rec, owner) = running(1, false);
        let (r, fx) = end(&rec, &owner, now(), &nap(), &policy()).unwrap();
        assert_eq!(r.status, "waiting");
        assert_eq!((r.attempts, r.ticket_seq), (1, 0));
        let at = rfc3339(now() + Duration::from_secs(3600));
        assert_eq!(r.next_run_at.as_deref(), Some(at.as_str()));
        assert_eq!(r.waiting_for.as_deref(), Some("time"));
        assert_eq!(r.waiting_step.as_deref(), Some("sleep#0"));
        assert_eq!(r.waiting_until.as_deref(), Some(at.as_str()));
        let Some(Step::Event { data, .. }) = fx.after.get(2) else {
            panic!("the waiting event")
        };
        assert_eq!(
            data,
            &json!({"for": "time", "until": at, "step": "sleep#0"})
        );
        // Its time comes: queued on the waker's ticket, the wait forgotten.
        let woken = crate::machine::wake(&r, now(), 77).unwrap();
        assert_eq!((woken.status.as_str(), woken.ticket_seq), ("queued", 77));
        // What it waited for is over; which step waited, and until when,
        // stays for the next attempt's step.
        assert_eq!(woken.waiting_for, None);
        assert_eq!(woken.waiting_step.as_deref(), Some("sleep#0"));
        assert_eq!(woken.waiting_until.as_deref(), Some(at.as_str()));
        assert_eq!(woken.epoch, r.epoch);
        assert!(
            crate::machine::wake(&woken, now(), 78).is_none(),
            "woken once"
        );
    }

    #[test]
    fn a_retry_names_its_fresh_ticket_waits_the_longer_delay_and_spends_an_attempt() {
        let (rec, owner) = running(0, false);
        let e = End::retryable("rate limited").with_retry_after(Duration::from_secs(30));
        let (r, fx) = end(&rec, &owner, now(), &e, &policy()).unwrap();
        assert_eq!(r.ticket_seq, 42);
        assert_eq!(r.attempts, 1);
        assert_eq!(
            r.next_run_at.as_deref(),
            Some(rfc3339(now() + Duration::from_secs(30)).as_str())
        );
        assert_eq!(fx.next, "retrying in 30s (1 of 3 attempts failed)");
        let Some(Step::Event {
            ty: "retry", data, ..
        }) = fx.before
        else {
            panic!("announced")
        };
        assert_eq!(data["delay_ms"], 30_000);
        assert_eq!(data["asked_delay_ms"], 30_000);
    }

    #[test]
    fn an_exhausted_retry_budget_and_a_budget_keep_their_class_and_the_partial() {
        let (rec, owner) = running(2, false);
        let (r, fx) = end(&rec, &owner, now(), &End::retryable("503"), &policy()).unwrap();
        assert_eq!(r.error.unwrap().class, "exhausted");
        assert_eq!(fx.failure.as_deref(), Some("exhausted"));
        let partial = Some(Box::new(JobResult {
            partial: true,
            output: "{}".into(),
            ..Default::default()
        }));
        let (rec, owner) = running(0, false);
        let e = End::budget_exhausted("cost").with_partial(partial.clone());
        let (r, fx) = end(&rec, &owner, now(), &e, &policy()).unwrap();
        assert_eq!(r.error.unwrap().class, "budget_exhausted");
        assert_eq!(fx.failure.as_deref(), Some("budget_exhausted"));
        assert_eq!(r.result, partial.map(|p| *p));
    }

    #[test]
    fn an_end_by_someone_who_no_longer_owns_the_job_is_refused() {
        let (rec, mut owner) = running(0, false);
        owner.epoch += 1;
        for e in [
            done("1"),
            End::retryable("x"),
            End::HandedBack,
            End::cancelled(),
            nap(),
        ] {
            assert!(end(&rec, &owner, now(), &e, &policy()).is_err(), "{e:?}");
        }
    }
}
