//! How an attempt ends: [`Attempt::finish`], the one executor of the
//! [`End`] a kind returned (completed, parked, failed, cancelled, handed
//! back), carrying out what the pure [`machine::end`] decided in the order
//! it gave; and the stop that writes nothing (the claim lost).

use std::sync::atomic::Ordering;
use std::time::{Duration, SystemTime};

use crate::metrics::AttemptOutcome;
use async_nats::jetstream::AckKind;
use leasehold_core::machine::{
    self, Effects, End, EndPolicy, Ended, Owner, Settle, Step, Ticket, TransitionError, KEEP_DELAY,
};
use leasehold_core::retry::Backoff;
use leasehold_core::JobRecord;
use leasehold_store::events;
use leasehold_store::index::Key;
use leasehold_store::work::ticket_first;
use leasehold_store::{Gate, JobsError, StoreError, Versioned};
use leasehold_telemetry::spans;
use serde_json::{json, Value};

use super::*;

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
            || self.started.elapsed() + Duration::from_millis(200)
                >= self.shared.ticket_return(&self.rec.kind).after
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

    /// Carries out an attempt's end: the one executor of what
    /// [`machine::end`] decided. It publishes what must go before the
    /// write (a retry's event, a fresh ticket), writes the record through
    /// the owner's gate, then takes the steps after the write in their
    /// order, stopping where a step that must not fail did (its ticket is
    /// then kept, so a claim or a recoverer finishes the end).
    pub(super) async fn finish(&self, end: End) {
        let retry = self.shared.retry.for_spec(self.rec.spec.as_ref());
        let policy = EndPolicy::drawn(&retry, self.rec.attempts, &mut rand::thread_rng());
        let owner = self.gate.owner.clone();
        let plan = match machine::end(&self.rec, &owner, SystemTime::now(), &end, &policy) {
            Ok((_, fx)) => fx,
            Err(e) => return self.lost(&e.to_string()).await,
        };
        if let Some(step) = &plan.before {
            self.take(&self.rec, std::slice::from_ref(step)).await;
        }
        let ticket = self.ticket_for(plan.ticket, policy);
        let write = async |policy: EndPolicy| {
            let effects = StdMutex::new(None);
            let write = |r: &JobRecord, o: &Owner, now: SystemTime| {
                machine::end(r, o, now, &end, &policy).map(|(n, fx)| {
                    *effects.lock().unwrap() = Some(fx);
                    n
                })
            };
            // A hand-back writes once: it runs while the process stops, and
            // a job it cannot give back is recovered by its session's end.
            let written = if matches!(end, End::HandedBack) {
                self.gate.write(write).await
            } else {
                persist(&self.shared, &self.gate, write).await
            };
            match written {
                Ok(v) => {
                    let fx = effects.into_inner().unwrap();
                    Ok(Some((v, fx.expect("a written end has its effects"))))
                }
                Err(e) if matches!(end, End::HandedBack) && !e.is_ownership_lost() => {
                    tracing::warn!(job = %self.rec.id, error = %e, "hand back failed; the session's end recovers it");
                    self.not_handed_back();
                    Err(())
                }
                Err(e) => {
                    self.refused(writing(plan.ended), e).await;
                    Err(())
                }
            }
        };
        let after = async |(v, fx): &(Versioned<JobRecord>, Effects)| {
            self.say(&end, &v.value, fx);
            self.take(&v.value, &fx.after).await;
            Ok(())
        };
        let _ = ticket_first(ticket, write, after).await;
    }

    /// The ticket an end needs before its write: none, or a fresh one (the
    /// policy then names it). `Err` when the end cannot go on without it.
    async fn ticket_for(&self, need: Ticket, policy: EndPolicy) -> Result<EndPolicy, ()> {
        let held = self.ticket.lock().unwrap().is_some();
        let why = match need {
            Ticket::Held => return Ok(policy),
            Ticket::Return(_) if held => return Ok(policy),
            Ticket::Fresh(why) | Ticket::Return(why) => why,
        };
        match self.fresh_ticket(why).await {
            Ok(seq) => Ok(policy.with_ticket(seq)),
            Err(e) if matches!(need, Ticket::Fresh(_)) => {
                tracing::warn!(job = %self.rec.id, error = %e, "cannot publish the {why}'s ticket; re-queueing the job without one (the reaper replaces a lost ticket after --stranded-grace)");
                Ok(policy)
            }
            Err(e) => {
                tracing::warn!(job = %self.rec.id, error = %e, "hand back failed (no ticket); the session's end recovers it");
                self.not_handed_back();
                Err(())
            }
        }
    }

    /// The attempt's one log line, its metrics and its span.
    fn say(&self, end: &End, rec: &JobRecord, fx: &Effects) {
        let outcome = match fx.ended {
            Ended::Completed => AttemptOutcome::Completed,
            Ended::Parked => AttemptOutcome::Parked,
            Ended::Waiting => AttemptOutcome::Waited,
            Ended::Cancelled => AttemptOutcome::Cancelled,
            Ended::Retried => AttemptOutcome::Retried,
            Ended::Failed => AttemptOutcome::Failed,
            Ended::HandedBack => AttemptOutcome::HandedBack,
        };
        let took = leasehold_core::time::human_duration(self.started.elapsed());
        match (end, &fx.failure) {
            (_, Some(class)) => {
                let message = rec.error.as_ref().map_or("", |e| e.message.as_str());
                tracing::warn!(outcome = outcome.as_str(), class = class.as_str(), error = message, took = %took, "attempt failed; {}", fx.next);
            }
            (
                End::Parked {
                    reason, message, ..
                },
                _,
            ) if fx.ended == Ended::Parked => {
                tracing::info!(outcome = outcome.as_str(), reason = %reason, why = %message, took = %took, "attempt ended: {}", fx.next);
            }
            _ => tracing::info!(outcome = outcome.as_str(), took = %took, "attempt ended"),
        }
        self.finished(outcome, fx.failure.as_deref());
    }

    /// Takes the steps that follow a write (`rec`, as written), in order.
    async fn take(&self, rec: &JobRecord, steps: &[Step]) {
        for step in steps {
            let kept = match step {
                Step::Event {
                    ty,
                    data,
                    terminal: false,
                } => {
                    self.publish_event(ty, data.clone(), None).await;
                    false
                }
                Step::Event {
                    ty,
                    data,
                    terminal: true,
                } => !self.terminal_event(rec, ty, data).await,
                Step::Index { required } => !self.reindex(rec).await && *required,
                Step::Wake => {
                    match leasehold_store::timers::set(&self.shared.recovery, rec).await {
                        Ok(()) => false,
                        Err(e) => {
                            tracing::warn!(job = %rec.id, error = %e, "cannot write the wake-up; the ticket comes back and its claim writes it");
                            true
                        }
                    }
                }
                Step::Recheck => {
                    match leasehold_store::timers::wake(&self.shared.recovery, &rec.id).await {
                        Ok(w) => {
                            tracing::debug!(job = %rec.id, woken = ?w, "looked for the signal the job waits for");
                            false
                        }
                        Err(e) => {
                            tracing::warn!(job = %rec.id, error = %e, "cannot look for the signal the job waits for; the ticket comes back and its claim looks");
                            true
                        }
                    }
                }
                Step::Settle(Settle::Ack) => {
                    settle(&self.ticket, AckKind::Ack).await;
                    false
                }
                Step::Settle(Settle::Nak(d)) => {
                    settle(&self.ticket, AckKind::Nak(*d)).await;
                    false
                }
            };
            if kept {
                settle(&self.ticket, AckKind::Nak(Some(KEEP_DELAY))).await;
                return;
            }
        }
    }

    /// A terminal event, retried (the only pointer a client's stream and
    /// retention have to the job's end). When it cannot be published, the
    /// ticket comes back and its claim, or the index entry's recoverer,
    /// publishes it from the record (`Recovery::finish_terminal_if_unfinished`,
    /// under the same dedupe id) before it lets go of the job. A kill -9
    /// between the write and the event leaves the same two pointers.
    async fn terminal_event(&self, rec: &JobRecord, ty: &str, data: &Value) -> bool {
        let id = events::terminal_event_id(rec, ty);
        let mut last = String::new();
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(2));
        for i in 0..TERMINAL_EVENT_TRIES {
            // A child's end reaches its parent before the event that
            // marks the end finished.
            let announced = self.shared.recovery.announce_end(rec).await;
            match announced.map_err(|e| e.to_string()) {
                Ok(()) => match self.try_publish_event(ty, data.clone(), Some(&id)).await {
                    Ok(()) => return true,
                    Err(e) => last = e,
                },
                Err(e) => last = e,
            }
            if i + 1 < TERMINAL_EVENT_TRIES {
                tokio::time::sleep(backoff.pause()).await;
            }
        }
        tracing::warn!(job = %rec.id, event = ty, error = %last, "the terminal event could not be published; the ticket and the index entry are kept, so a claim or a recoverer publishes it");
        false
    }

    /// A new ticket for the job, unless the one this attempt holds can
    /// serve (a hand-back NAKs it back). Published before the record names
    /// it, so a queued record never names a ticket that was not published.
    /// A full work queue (or NATS away) is waited out for a while
    /// ([`TICKET_PATIENCE`]; 10 s once shutdown hands jobs back); then the
    /// caller decides (a retry re-queues without a ticket, for the reaper
    /// to replace).
    pub(super) async fn fresh_ticket(&self, reason: &str) -> Result<u64, StoreError> {
        let mut pause = Backoff::new(Duration::from_millis(100), Duration::from_secs(5));
        let patience = tokio::time::Instant::now() + TICKET_PATIENCE;
        let mut give_up: Option<tokio::time::Instant> = None;
        loop {
            let e = match self
                .shared
                .work
                .reissue(&self.rec, reason, &self.rec.epoch.to_string())
                .await
            {
                Ok(p) => return Ok(p.seq),
                Err(e) if !e.is_transient() => return Err(e),
                Err(e) => e,
            };
            let now = tokio::time::Instant::now();
            let handing_back = self
                .shared
                .handoff
                .is_cancelled()
                .then(|| *give_up.get_or_insert(now + Duration::from_secs(10)));
            if now >= patience || handing_back.is_some_and(|end| now >= end) {
                return Err(e);
            }
            tracing::warn!(job = %self.rec.id, error = %e, "cannot publish the job's next ticket yet; retrying");
            tokio::time::sleep(pause.pause()).await;
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
}

/// The write an end is, as a refusal names it.
fn writing(ended: Ended) -> &'static str {
    match ended {
        Ended::Completed => "completion",
        Ended::Parked => "parking",
        Ended::Waiting => "wait",
        Ended::Cancelled => "cancellation",
        Ended::Retried => "requeue",
        Ended::Failed => "failure",
        Ended::HandedBack => "hand back",
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
    /// Stats, metrics and the span of an attempt that ended.
    pub(super) fn finished(&self, outcome: AttemptOutcome, error_type: Option<&str>) {
        if let Some(t) = self.timer.lock().unwrap().take() {
            t.finish(outcome);
        }
        spans::record_outcome(&self.span, outcome.as_str());
        if let Some(class) = error_type {
            spans::record_error(&self.span, class);
        }
    }

    pub(super) async fn lost(&self, why: &str) {
        tracing::info!(outcome = AttemptOutcome::OwnershipLost.as_str(), error = "ownership_lost", took = %leasehold_core::time::human_duration(self.started.elapsed()), "attempt ended");
        self.finished(AttemptOutcome::OwnershipLost, Some("ownership_lost"));
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
