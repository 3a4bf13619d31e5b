//! How an attempt ends: completed, parked, cancelled, handed back, or
//! failed (retried with backoff, or for good), each persisted through the
//! owner's gate, its event published, its ticket settled and its index
//! entry changed in that order; and the stops that write nothing (the
//! claim lost).

use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::AckKind;
use leasehold_core::machine::{self, Owner, TransitionError};
use leasehold_core::retry::Backoff;
use leasehold_core::{JobError, JobRecord};
use leasehold_proto::JobResult;
use leasehold_store::events;
use leasehold_store::index::Key;
use leasehold_store::{Gate, JobsError, Versioned};
use leasehold_telemetry::metrics::AttemptOutcome;
use leasehold_telemetry::spans;
use serde_json::{json, Value};

use super::*;
use crate::handler::{ErrorClass, HandlerError};

impl Attempt {
    pub(super) fn run_key(&self) -> Key {
        Key::Run {
            worker: self.shared.worker_id.clone(),
            job: self.rec.id.clone(),
        }
    }

    /// Whether someone may have indexed this job: we did, or it lived long
    /// enough for its ticket's wake-up to reach a worker that settled it.
    pub(super) fn maybe_indexed(&self) -> bool {
        self.indexed.load(Ordering::Relaxed)
            || self.started.elapsed() + Duration::from_millis(200) >= self.shared.opts.wake_after()
    }

    /// After the record's new state is written: the index follows it.
    /// Whether it does (a failure is repaired by the reaper, or by the
    /// ticket a caller keeps for it).
    pub(super) async fn reindex(&self, rec: &JobRecord) -> bool {
        let stale = self.maybe_indexed().then(|| self.run_key());
        let needed = Key::of(rec).is_some();
        if !needed && stale.is_none() {
            return true;
        }
        match self.shared.active.sync(rec, stale.as_ref()).await {
            Ok(()) => true,
            Err(e) => {
                tracing::warn!(job = %rec.id, error = %e, "index not updated; the reaper repairs it");
                false
            }
        }
    }

    pub(super) async fn publish_event(&self, ty: &str, data: Value, dedupe: Option<String>) {
        let _ = self.try_publish_event(ty, data, dedupe.as_deref()).await;
    }

    pub(super) async fn try_publish_event(
        &self,
        ty: &str,
        mut data: Value,
        dedupe: Option<&str>,
    ) -> Result<(), String> {
        // Terminal events name the kind: retention reads them without the record.
        if let Value::Object(m) = &mut data {
            if leasehold_store::retention::TERMINAL_EVENTS.contains(&ty) {
                m.insert("kind".into(), Value::String(self.rec.kind.clone()));
            }
        }
        let ev = events::event(
            &self.rec.id,
            self.rec.epoch,
            ty,
            Some(&self.shared.worker_id),
            data,
        );
        match &self.fence {
            Some(f) => f
                .lock()
                .await
                .publish_event(&ev, dedupe)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
            None => self
                .shared
                .events
                .publish(&ev, dedupe)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string()),
        }
    }

    /// After a terminal write (`rec`, as written): its event, retried (the
    /// only pointer a client's stream and retention have to the job's
    /// end), then the ticket and the index entry. When the event cannot be
    /// published, both are kept: the ticket comes back and its claim, or
    /// the index entry's recoverer, publishes the event from the record
    /// (`Recovery::finish_terminal_if_unfinished`, under the same dedupe
    /// id) before it lets go of the job. A kill -9 between the write and
    /// the event leaves the same two pointers.
    pub(super) async fn ended_with(&self, rec: &JobRecord, ty: &str, data: Value) {
        let id = events::terminal_event_id(rec, ty);
        let mut last = String::new();
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(2));
        for i in 0..TERMINAL_EVENT_TRIES {
            match self.try_publish_event(ty, data.clone(), Some(&id)).await {
                Ok(()) => {
                    settle(&self.ticket, AckKind::Ack).await;
                    self.reindex(rec).await;
                    return;
                }
                Err(e) => last = e,
            }
            if i + 1 < TERMINAL_EVENT_TRIES {
                tokio::time::sleep(backoff.pause()).await;
            }
        }
        tracing::warn!(job = %rec.id, event = ty, error = %last, "the terminal event could not be published; the ticket and the index entry are kept, so a claim or a recoverer publishes it");
        settle(&self.ticket, AckKind::Nak(Some(Duration::from_secs(1)))).await;
    }

    pub(super) async fn complete(&self, res: JobResult) {
        // An output that is not JSON would make the record unwritable: fail
        // the attempt with a clear error instead.
        if !res.output.is_empty() && serde_json::from_str::<Value>(&res.output).is_err() {
            let err = HandlerError::terminal(format!(
                "the handler's result is not JSON ({} bytes); nothing was recorded",
                res.output.len()
            ));
            return self.error(err).await;
        }
        let out = res.clone();
        match persist(&self.shared, &self.gate, move |r, o, now| {
            machine::complete(r, o, now, out.clone())
        })
        .await
        {
            Ok(v) => {
                self.ended(AttemptOutcome::Completed, None);
                self.ended_with(
                    &v.value,
                    "completed",
                    json!({"partial": res.partial, "artifact": res.artifact, "digest": res.digest}),
                )
                .await;
            }
            Err(e) => self.refused("completion", e).await,
        }
    }

    pub(super) async fn park(&self, reason: String, message: String, step: Option<String>) {
        let (r2, m2) = (reason.clone(), message.clone());
        match persist(&self.shared, &self.gate, move |r, o, now| {
            machine::park(r, o, now, &r2, &m2)
        })
        .await
        {
            Ok(v) if v.value.status == "cancelled" => {
                self.cancelled_instead(&v.value, "park").await
            }
            Ok(v) => {
                tracing::info!(
                    outcome = AttemptOutcome::Parked.as_str(),
                    reason = %reason,
                    why = %message,
                    took = %leasehold_core::time::human_duration(self.started.elapsed()),
                    "attempt ended: parked for review (`leasehold review list`)"
                );
                self.finished(AttemptOutcome::Parked, None);
                // The parked entry before the ticket goes: a parked job is
                // always listed. When it cannot be written, the ticket is
                // kept: it comes back, and its claim indexes the parked
                // job before it settles it.
                let indexed = self.reindex(&v.value).await;
                self.publish_event(
                    "parked",
                    json!({"reason": reason, "message": message, "step": step}),
                    None,
                )
                .await;
                let keep = if indexed {
                    AckKind::Ack
                } else {
                    AckKind::Nak(Some(Duration::from_secs(1)))
                };
                settle(&self.ticket, keep).await;
            }
            Err(e) => self.refused("parking", e).await,
        }
    }

    /// The owner's outcome write found a cancel request and ended the job
    /// cancelled instead (the machine's rule: cancel is final).
    pub(super) async fn cancelled_instead(&self, rec: &JobRecord, instead_of: &str) {
        self.ended(AttemptOutcome::Cancelled, None);
        self.ended_with(rec, "cancelled", json!({"instead_of": instead_of}))
            .await;
    }

    pub(super) async fn cancel(&self, partial: Option<Box<leasehold_proto::JobResult>>) {
        let end = move |r: &JobRecord, o: &machine::Owner, now: SystemTime| {
            machine::cancel_owned(r, o, now).map(|mut n| {
                if let Some(p) = &partial {
                    n.result = Some((**p).clone());
                }
                n
            })
        };
        match persist(&self.shared, &self.gate, end).await {
            Ok(v) => {
                self.ended(AttemptOutcome::Cancelled, None);
                self.ended_with(&v.value, "cancelled", json!({})).await;
            }
            Err(e) => self.refused("cancellation", e).await,
        }
    }

    /// A new ticket for the job, unless the one this attempt holds can
    /// serve (a hand-back NAKs it back). Published before the record names
    /// it, so a queued record never names a ticket that was not published.
    /// A full work queue (or NATS away) is waited out for a while
    /// ([`TICKET_PATIENCE`]; 10 s once shutdown hands jobs back); then the
    /// caller decides (a retry re-queues without a ticket, for the reaper
    /// to replace).
    pub(super) async fn fresh_ticket(&self, reason: &str) -> Result<u64, JobsError> {
        let mut pause = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let patience = tokio::time::Instant::now() + TICKET_PATIENCE;
        let mut give_up: Option<tokio::time::Instant> = None;
        loop {
            if tokio::time::Instant::now() >= patience {
                return Err(JobsError::Nats(format!(
                    "no ticket could be published in {TICKET_PATIENCE:?}"
                )));
            }
            match self
                .shared
                .work
                .reissue(&self.rec, reason, &self.rec.epoch.to_string())
                .await
            {
                Ok(p) => return Ok(p.seq),
                Err(e) if e.is_transient() => {
                    if self.shared.handoff.is_cancelled() {
                        let end = *give_up
                            .get_or_insert(tokio::time::Instant::now() + Duration::from_secs(10));
                        if tokio::time::Instant::now() >= end {
                            return Err(JobsError::Nats(e.to_string()));
                        }
                    }
                    tracing::warn!(job = %self.rec.id, error = %e, "cannot publish the job's next ticket yet; retrying");
                    tokio::time::sleep(pause.pause()).await;
                }
                Err(e) => return Err(JobsError::Nats(e.to_string())),
            }
        }
    }

    pub(super) async fn hand_back(&self) {
        let held = self.ticket.lock().unwrap().is_some();
        let seq = if held {
            0
        } else {
            match self.fresh_ticket("handback").await {
                Ok(s) => s,
                Err(e) => {
                    tracing::warn!(job = %self.rec.id, error = %e, "hand back failed (no ticket); the session's end recovers it");
                    self.not_handed_back();
                    return;
                }
            }
        };
        let res = self
            .gate
            .write(move |r, o, now| {
                machine::hand_back(r, o, now).map(|mut n| {
                    if seq > 0 {
                        n.ticket_seq = seq;
                    }
                    n
                })
            })
            .await;
        match res {
            Ok(v) if v.value.status == "cancelled" => {
                self.ended(AttemptOutcome::Cancelled, None);
                self.ended_with(&v.value, "cancelled", json!({"while": "hand_back"}))
                    .await;
            }
            Ok(v) => {
                self.ended(AttemptOutcome::HandedBack, None);
                tracing::info!(job = %self.rec.id, "handed back");
                self.reindex(&v.value).await;
                settle(&self.ticket, AckKind::Nak(None)).await;
            }
            Err(e) if e.is_ownership_lost() => {
                self.ended(AttemptOutcome::OwnershipLost, Some("ownership_lost"));
                tracing::info!(job = %self.rec.id, "not handed back: ownership already lost")
            }
            Err(e) => {
                tracing::warn!(job = %self.rec.id, error = %e, "hand back failed; the session's end recovers it");
                self.not_handed_back();
            }
        }
    }

    /// Named in the error the stop ends with.
    pub(super) fn not_handed_back(&self) {
        self.shared
            .unreturned
            .lock()
            .unwrap()
            .push(self.rec.id.clone());
    }

    /// A failed attempt: requeue with backoff while the budget lasts, else fail.
    pub(super) async fn error(&self, err: HandlerError) {
        let shared = &self.shared;
        let rec = &self.rec;
        let policy = shared.retry.for_spec(rec.spec.as_ref());
        let failed = rec.attempts + 1;
        let at = leasehold_core::time::rfc3339(SystemTime::now());
        let retry = err.class == ErrorClass::Retryable && policy.allows_another(failed);
        if retry {
            // A delay the handler asked for (a remote kind's `retry` op) is
            // the least one; the backoff stands when it is longer.
            let delay = policy
                .delay(rec.attempts, &mut rand::thread_rng())
                .max(err.retry_after.unwrap_or_default());
            self.publish_event(
                "retry",
                json!({"scope": "job", "reason": err.message, "eligible": true, "retained": "completed checkpoints", "attempt": failed, "budget_left": policy.max_attempts - failed, "delay_ms": delay.as_millis() as u64, "asked_delay_ms": err.retry_after.map(|d| d.as_millis() as u64)}),
                None,
            )
            .await;
            // Each retry gets a fresh ticket: retries never spend the
            // deliveries of one ticket, so --max-attempts cannot run into
            // the consumer's max deliveries.
            // Without one (the publish failed for good), the job is still
            // re-queued: a waiting job whose ticket is gone gets a fresh
            // one from the reaper after --stranded-grace. Leaving it
            // running under this live session would strand it.
            let seq = match self.fresh_ticket("retry").await {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::warn!(job = %rec.id, error = %e, "cannot publish the retry's ticket; re-queueing the job without one (the reaper replaces a lost ticket after --stranded-grace)");
                    None
                }
            };
            let error = JobError {
                class: "retryable".into(),
                message: err.message.clone(),
                at,
            };
            match persist(shared, &self.gate, move |r, o, now| {
                machine::requeue(r, o, now, error.clone(), delay).map(|mut n| {
                    if let Some(seq) = seq {
                        n.ticket_seq = seq;
                    }
                    n
                })
            })
            .await
            {
                Ok(v) if v.value.status == "cancelled" => {
                    self.ended(AttemptOutcome::Cancelled, None);
                    self.ended_with(&v.value, "cancelled", json!({"while": "retry"}))
                        .await;
                }
                Ok(v) => {
                    self.failed_attempt(
                        AttemptOutcome::Retried,
                        "retryable",
                        &err.message,
                        &format!(
                            "retrying in {} ({} of {} attempts failed)",
                            leasehold_core::time::human_duration(delay),
                            failed,
                            policy.max_attempts
                        ),
                    );
                    self.reindex(&v.value).await;
                    // The fresh ticket is the job's now.
                    settle(&self.ticket, AckKind::Ack).await;
                }
                Err(e) => self.refused("requeue", e).await,
            }
        } else {
            let (class, message) = match err.class {
                ErrorClass::Retryable => (
                    "exhausted".to_string(),
                    format!(
                        "{} (retry budget of {} attempts exhausted)",
                        err.message, policy.max_attempts
                    ),
                ),
                _ => (err.class_name().to_string(), err.message.clone()),
            };
            let error = JobError {
                class: class.clone(),
                message: message.clone(),
                at,
            };
            let partial = err.partial.clone();
            match persist(shared, &self.gate, move |r, o, now| {
                machine::fail(r, o, now, error.clone()).map(|mut n| {
                    if let Some(p) = &partial {
                        n.result = Some((**p).clone());
                    }
                    n
                })
            })
            .await
            {
                Ok(v) if v.value.status == "cancelled" => {
                    self.cancelled_instead(&v.value, "failure").await
                }
                Ok(v) => {
                    self.failed_attempt(AttemptOutcome::Failed, &class, &message, "the job failed");
                    self.ended_with(
                        &v.value,
                        "failed",
                        json!({"class": class, "message": message, "attempts": failed}),
                    )
                    .await;
                }
                Err(e) => self.refused("failure", e).await,
            }
        }
    }
}

/// Tries at publishing a terminal event before the ticket and the index
/// entry are left for a claim or a recoverer to finish the job's end.
const TERMINAL_EVENT_TRIES: u32 = 4;

/// How long an owner keeps retrying a write whose record reads as missing.
const MISSING_PATIENCE: Duration = Duration::from_secs(30);

/// Writes through the gate, retrying transient NATS errors while this
/// process may still own the job: the owner's duty is to write its
/// outcome, since a live session keeps the job from anyone else. It stops
/// at a definite answer, or once the hand-back phase of shutdown is over.
pub(super) async fn persist<F>(
    shared: &Shared,
    gate: &Gate,
    f: F,
) -> Result<Versioned<JobRecord>, JobsError>
where
    F: Fn(&JobRecord, &Owner, SystemTime) -> Result<JobRecord, TransitionError>,
{
    let mut pause = Backoff::new(Duration::from_millis(50), Duration::from_secs(2));
    let mut give_up: Option<tokio::time::Instant> = None;
    // The owner knows its record exists: "no such record" is a read that
    // has not caught up (a replica, a cluster changing leaders), for a while.
    let missing_until = tokio::time::Instant::now() + MISSING_PATIENCE;
    loop {
        match gate.write(&f).await {
            Err(JobsError::NotFound(_)) if tokio::time::Instant::now() < missing_until => {
                tracing::warn!(job = %gate.id, "own record read as missing; retrying");
                tokio::time::sleep(pause.pause()).await;
            }
            Err(e) if e.is_transient() => {
                if shared.handoff.is_cancelled() {
                    let end = *give_up
                        .get_or_insert(tokio::time::Instant::now() + Duration::from_secs(10));
                    if tokio::time::Instant::now() >= end {
                        return Err(e);
                    }
                }
                tracing::warn!(job = %gate.id, error = %e, "owner write failed; retrying");
                tokio::time::sleep(pause.pause()).await;
            }
            other => return other,
        }
    }
}

impl Attempt {
    /// The attempt's outcome: stats, metrics (duration by outcome) and its
    /// span (`error_type` marks it failed).
    pub(super) fn ended(&self, outcome: AttemptOutcome, error_type: Option<&str>) {
        // One line per attempt, inside its span (job id, epoch).
        tracing::info!(
            outcome = outcome.as_str(),
            error = error_type,
            took = %leasehold_core::time::human_duration(self.started.elapsed()),
            "attempt ended"
        );
        self.finished(outcome, error_type);
    }

    /// A failed attempt's end: its one WARN line, carrying the cause (class
    /// and message) and what happens next, then the same bookkeeping as
    /// [`Attempt::ended`].
    pub(super) fn failed_attempt(
        &self,
        outcome: AttemptOutcome,
        class: &str,
        message: &str,
        next: &str,
    ) {
        tracing::warn!(
            outcome = outcome.as_str(),
            class,
            error = message,
            took = %leasehold_core::time::human_duration(self.started.elapsed()),
            "attempt failed; {next}"
        );
        self.finished(outcome, Some(class));
    }

    /// Stats, metrics and the span of an attempt that ended.
    pub(super) fn finished(&self, outcome: AttemptOutcome, error_type: Option<&str>) {
        self.shared.count(outcome);
        if let Some(t) = self.timer.lock().unwrap().take() {
            t.finish(outcome);
        }
        spans::record_outcome(&self.span, outcome.as_str());
        if let Some(class) = error_type {
            spans::record_error(&self.span, class);
        }
    }

    pub(super) async fn lost(&self, why: &str) {
        self.ended(AttemptOutcome::OwnershipLost, Some("ownership_lost"));
        ownership_lost(&self.shared, &self.rec, why).await;
    }

    pub(super) async fn refused(&self, what: &str, e: JobsError) {
        if e.is_ownership_lost() {
            self.lost(&format!("{what} refused: {e}")).await;
        } else {
            tracing::error!(job = %self.rec.id, error = %e, "{what} could not be written; the job is re-offered once this process says it does not run it (reaper), or when its session ends");
        }
    }
}

/// Ownership is gone: stop, say so, and never touch the ticket again.
pub(super) async fn ownership_lost(shared: &Shared, rec: &JobRecord, why: &str) {
    tracing::warn!(job = %rec.id, epoch = rec.epoch, worker = %shared.worker_id, "ownership lost: {why}; task cancelled, ticket left alone");
    let ev = events::event(
        &rec.id,
        rec.epoch,
        "heartbeat_lost",
        Some(&shared.worker_id),
        json!({"reason": why}),
    );
    let _ = shared.events.publish(&ev, None).await;
}

/// Whether `now` (the record as read) is still the claim `ours` wrote: same
/// incarnation, same owner process, still running.
pub(super) fn still_ours(now: &JobRecord, ours: &JobRecord) -> bool {
    now.epoch == ours.epoch
        && now.worker_id == ours.worker_id
        && now.session == ours.session
        && now.status == leasehold_core::Status::Running.as_str()
}

/// Acks or NAKs the live delivery of the ticket, if this process holds one.
pub(crate) async fn settle(ticket: &TicketSlot, kind: AckKind) {
    let m = ticket.lock().unwrap().take();
    if let Some(m) = m {
        if let Err(e) = m.ack_with(kind).await {
            tracing::warn!(error = %e, "ack failed; the ticket will be redelivered and dropped");
        }
    }
}
