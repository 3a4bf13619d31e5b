//! From a delivered ticket to a claim (or to nothing, at once).
//!
//! The claim is a KV create (a new job) or an update at the revision read,
//! decided by `machine::decide_claim` with what this worker knows of the
//! recorded owner: its session alive, ended, or unknown. A ticket whose job
//! a live owner holds is *settled*: the job is entered in the index (so its
//! recovery does not need the ticket) and the ticket acked, never NAKed, so
//! a live job never spends deliveries. A claim whose reply was lost is
//! recognised by its own claim token on the retry.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, AckKind};
use leasehold_core::machine::{self, ClaimDecision, Claimant, OwnerLiveness};
use leasehold_core::retry::Backoff;
use leasehold_core::spec::{self, Submission};
use leasehold_core::JobRecord;
use leasehold_store::events;
use leasehold_store::index::Key;
use leasehold_store::liveness::Verdict;
use leasehold_store::{timers, work};
use leasehold_store::{JobsError, Versioned};
use leasehold_telemetry::metrics::AttemptOutcome;
use leasehold_telemetry::{spans, trace};
use serde_json::json;
use tokio::sync::OwnedSemaphorePermit;

use super::{attempt, Shared};

fn header_id(msg: &jetstream::Message) -> Option<String> {
    work::ticket_job_id(msg.headers.as_ref())
}

/// The trace a job joins: the submitter's `traceparent` header, else (when
/// traces are exported) a new root `job` span's. Kept in the record, so
/// every attempt, on any worker, after any re-queue, joins the same trace.
pub(crate) fn job_traceparent(
    headers: Option<&async_nats::HeaderMap>,
    id: &str,
    kind: &str,
) -> Option<String> {
    let sent = headers
        .and_then(|h| h.get(trace::TRACEPARENT))
        .map(|v| v.as_str().trim().to_string())
        .filter(|tp| trace::span_context_from_traceparent(tp).is_some());
    sent.or_else(|| trace::traceparent_of(&spans::job_root(id, kind)))
}

impl Shared {
    /// A claimant of this worker for a ticket at `seq` (0: no ticket).
    pub(crate) fn claimant(&self, seq: u64, owner: OwnerLiveness) -> Claimant<'_> {
        self.claimant_of(seq, 1, owner)
    }

    /// A claimant for the `deliveries`-th delivery of the ticket at `seq`.
    pub(crate) fn claimant_of(
        &self,
        seq: u64,
        deliveries: u64,
        owner: OwnerLiveness,
    ) -> Claimant<'_> {
        Claimant {
            worker_id: &self.worker_id,
            session: &self.session.id,
            claim_token: uuid::Uuid::new_v4().to_string(),
            attempt_timeout: self.opts.attempt_timeout,
            skew: self.opts.clock_skew,
            now: SystemTime::now(),
            ticket_seq: seq,
            max_stale_reclaims: self.opts.max_stale_reclaims,
            owner,
            deliveries,
        }
    }

    /// What this worker knows of the owner a running record names.
    pub(crate) async fn owner_liveness(&self, rec: &JobRecord) -> OwnerLiveness {
        let Some(worker) = rec.worker_id.as_deref() else {
            return OwnerLiveness::Dead;
        };
        if worker == self.worker_id {
            // Our own identity: alive only if this very process runs it at
            // that epoch (an earlier process's job, or an attempt of ours
            // that ended without its write, is ours to take back now).
            let here = self
                .running
                .lock()
                .unwrap()
                .get(&rec.id)
                .is_some_and(|r| r.epoch == rec.epoch);
            return if rec.session.as_deref() == Some(self.session.id.as_str()) && here {
                OwnerLiveness::Live
            } else {
                OwnerLiveness::Dead
            };
        }
        // Everyone else's: the one liveness rule, asking the live process
        // whether it runs the job at that epoch.
        match self
            .recovery
            .liveness
            .owner(worker, rec.session.as_deref(), Some((&rec.id, rec.epoch)))
            .await
        {
            Verdict::Alive => OwnerLiveness::Live,
            Verdict::Gone(why) => {
                tracing::info!(job = %rec.id, owner = worker, why, "the record's owner is gone; reclaiming the job");
                OwnerLiveness::Dead
            }
            Verdict::Unknown(_) => OwnerLiveness::Unknown,
        }
    }
}

/// Registers a claim in flight for the duration of its write (see
/// `Shared::claiming`); dropped when the claim is settled either way.
pub(crate) struct Claiming {
    shared: Arc<Shared>,
    id: String,
}

impl Claiming {
    /// Registers a claim of `id`; `None` when this process is claiming it
    /// already (two tickets of one job, or a restart reclaim and a ticket):
    /// the second waits for the first instead of racing it.
    pub(crate) fn new(shared: &Arc<Shared>, id: &str) -> Option<Self> {
        let mut c = shared.claiming.lock().unwrap();
        if c.contains(id) {
            return None;
        }
        c.insert(id.to_string());
        Some(Claiming {
            shared: shared.clone(),
            id: id.to_string(),
        })
    }
}

impl Drop for Claiming {
    fn drop(&mut self) {
        self.shared.claiming.lock().unwrap().remove(&self.id);
        self.shared.idle.notify_waiters();
    }
}

/// Stale reclaims from which a job is a *suspect*: it lost a worker more
/// than once and may be what kills them. A worker runs at most one suspect
/// at a time (next to any number of other jobs), so one culprit's next
/// crash never takes another suspect with it: an innocent bystander's
/// stale reclaims rise once per *different* culprit it met, a culprit's on
/// every crash. A job that lost a worker once is no suspect yet: after a
/// kill -9 on a busy fleet, its jobs run again at once wherever a slot is
/// free.
pub(crate) const SUSPECT_AFTER: u32 = 2;

/// Whether a claim that leaves the job at `stale_reclaims` (the record as
/// the claim writes it: a reclaim from a gone owner counts that loss) makes
/// it a suspect.
pub(crate) fn is_suspect(stale_reclaims: u32) -> bool {
    stale_reclaims >= SUSPECT_AFTER
}

/// The one suspect this worker runs, held for the suspect's whole attempt.
pub(crate) struct SuspectSlot {
    shared: Arc<Shared>,
}

impl SuspectSlot {
    /// Takes the worker's suspect slot for `id`, without waiting: `None`
    /// when another suspect runs here.
    pub(crate) fn take(shared: &Arc<Shared>, id: &str) -> Option<Self> {
        let mut s = shared.suspect.lock().unwrap();
        if s.as_deref().is_some_and(|other| other != id) {
            return None;
        }
        *s = Some(id.to_string());
        Some(SuspectSlot {
            shared: shared.clone(),
        })
    }
}

impl Drop for SuspectSlot {
    fn drop(&mut self) {
        *self.shared.suspect.lock().unwrap() = None;
    }
}

/// Hands a redelivery of the ticket a job here runs on (its wake-up, come
/// back before the job was indexed) to that job, so acks go to the live
/// delivery. Any other ticket of the job (a retry's, racing its requeue)
/// goes through the claim path.
fn attach(shared: &Shared, id: &str, seq: u64, msg: &mut Option<jetstream::Message>) -> bool {
    let running = shared.running.lock().unwrap();
    if let Some(r) = running.get(id).filter(|r| r.ticket_seq == seq && seq != 0) {
        *r.ticket.lock().unwrap() = msg.take();
        return true;
    }
    false
}

/// One delivered ticket.
pub(crate) async fn handle_delivery(
    shared: Arc<Shared>,
    msg: jetstream::Message,
    permit: OwnedSemaphorePermit,
) {
    let mut slot = Some(msg);
    let msg = slot.as_ref().expect("set");
    let kind = shared
        .conn
        .layout
        .kind_of_submit_subject(&msg.subject)
        .unwrap_or_default()
        .to_string();
    let (seq, deliveries, stored_at) = msg
        .info()
        .map(|i| {
            (
                i.stream_sequence,
                i.delivered.max(1) as u64,
                SystemTime::from(i.published),
            )
        })
        .unwrap_or((0, 1, SystemTime::now()));
    let hint = header_id(msg);
    if let Some(id) = &hint {
        if attach(&shared, id, seq, &mut slot) {
            return;
        }
    }
    let msg = slot.take().expect("set");
    let ct = work::content_type(msg.headers.as_ref());
    let sub = Submission {
        kind: &kind,
        payload: &msg.payload,
        msg_id: hint.as_deref(),
        content_type: ct.as_deref(),
        stream_seq: seq,
        received_at: stored_at,
    };
    let accepted = match work::decode_ticket(
        &shared.conn.layout,
        &msg.subject,
        sub,
        &shared.kinds,
        shared.opts.max_submission_bytes,
    ) {
        Ok(a) => a,
        Err(rej) => {
            reject(&shared, &kind, seq, &msg, rej).await;
            return;
        }
    };
    let mut slot = Some(msg);
    if attach(&shared, &accepted.id, seq, &mut slot) {
        return;
    }
    let msg = slot.take().expect("set");
    // The token of our own claim, kept across rounds: a claim whose reply
    // was lost is recognised on the next read as ours.
    let mut mine: Option<String> = None;
    let Some(claiming) = Claiming::new(&shared, &accepted.id) else {
        tracing::debug!(job = %accepted.id, "this process is claiming the job already; the ticket waits for that claim");
        let _ = msg
            .ack_with(AckKind::Nak(Some(Duration::from_millis(500))))
            .await;
        return;
    };
    // Held for a suspect's whole attempt (see SUSPECT_AFTER).
    let mut suspect: Option<SuspectSlot> = None;
    // Set when a claim write failed without a definite answer: the next
    // rounds read the record until it says whether the claim landed.
    let mut unsure = 0u32;
    for round in 0..16 {
        if unsure > 0 {
            tokio::time::sleep(Duration::from_millis(200) * unsure.min(10)).await;
        }
        // Most tickets are new jobs: try the create first and read only
        // when the record turns out to exist.
        let current = if round == 0 {
            None
        } else {
            match shared.jobs.get(&accepted.id).await {
                Ok(c) => c,
                Err(JobsError::Corrupt { id, message }) => {
                    tracing::error!(job = %id, error = %message, "the job's record cannot be read; leaving the ticket for an operator (leasehold list --corrupt)");
                    let _ = msg
                        .ack_with(AckKind::Nak(Some(Duration::from_secs(30))))
                        .await;
                    return;
                }
                Err(e) => {
                    let d = machine::transient_retry_delay(deliveries);
                    tracing::warn!(job = %accepted.id, error = %e, retry_in_ms = d.as_millis() as u64, "cannot read the record; the ticket comes back later");
                    let _ = msg.ack_with(AckKind::Nak(Some(d))).await;
                    return;
                }
            }
        };
        let (write, reclaim) = match &current {
            // A delayed job not due yet: its queued record (due at
            // `next_run_at`), as the gateway would write it; the next round
            // decides on it (a short wait NAKs the ticket with the rest, a
            // long one releases the ticket to the job's wake-up).
            None if !machine::due(accepted.spec.run_at.as_deref(), SystemTime::now()) => {
                let rec = machine::new_record(
                    &accepted.id,
                    &kind,
                    accepted.spec.clone(),
                    seq,
                    SystemTime::now(),
                );
                match shared.jobs.create(&rec).await {
                    Ok(_) => {
                        if let Some(key) = Key::of(&rec) {
                            if let Err(e) = shared.active.put(&key, &rec).await {
                                tracing::debug!(job = %rec.id, error = %e, "delayed record not indexed; its ticket covers it");
                            }
                        }
                        tracing::debug!(job = %rec.id, due = ?rec.next_run_at, "delayed job recorded");
                        continue;
                    }
                    // Recorded already (the gateway): its record decides.
                    Err(JobsError::Exists(_) | JobsError::Conflict(_)) => continue,
                    Err(e) => {
                        let d = machine::transient_retry_delay(deliveries);
                        tracing::warn!(job = %accepted.id, error = %e, retry_in_ms = d.as_millis() as u64, "cannot record the delayed job; the ticket comes back later");
                        let _ = msg.ack_with(AckKind::Nak(Some(d))).await;
                        return;
                    }
                }
            }
            None => {
                let c = shared.claimant(seq, OwnerLiveness::Dead);
                let mut record = machine::claim_new(
                    machine::new_record(&accepted.id, &kind, accepted.spec.clone(), seq, c.now),
                    &c,
                );
                record.traceparent = job_traceparent(msg.headers.as_ref(), &accepted.id, &kind);
                mine = record.claim_token.clone();
                (
                    shared.jobs.create(&record).await.map(|r| (r, record)),
                    false,
                )
            }
            // Our own claim landed although its reply was lost.
            Some(v) if mine.is_some() && v.value.claim_token == mine => (
                Ok((v.revision, v.value.clone())),
                v.value.stale_reclaims > 0,
            ),
            Some(Versioned { value, revision }) => {
                if value.kind != kind {
                    // An id reused by a submission of another kind: never
                    // run a job under a handler that is not its own.
                    id_conflict(&shared, &kind, seq, &msg, value).await;
                    return;
                }
                let owner = if value.status == "running" {
                    shared.owner_liveness(value).await
                } else {
                    OwnerLiveness::Dead
                };
                let c = shared.claimant_of(seq, deliveries, owner);
                match machine::decide_claim(value, &c) {
                    // A suspect may be what kills workers: at most one runs
                    // here at a time. Another worker, or this one once its
                    // suspect ended, takes it; waiting costs it nothing (a
                    // waiting job is never dead-lettered for deliveries).
                    // (Judged on the claim as it would be written: a reclaim
                    // from a gone owner counts that loss too.)
                    ClaimDecision::Claim { ref record, .. }
                        if is_suspect(record.stale_reclaims) && suspect.is_none() =>
                    {
                        match SuspectSlot::take(&shared, &accepted.id) {
                            Some(s) => {
                                suspect = Some(s);
                                continue;
                            }
                            None => {
                                tracing::debug!(job = %accepted.id, stale_reclaims = record.stale_reclaims, "a suspect runs here already; handing this suspect to another worker");
                                let _ = msg
                                    .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                                    .await;
                                return;
                            }
                        }
                    }
                    ClaimDecision::Claim {
                        mut record,
                        reclaim,
                    } => {
                        if record.traceparent.is_none() {
                            record.traceparent =
                                job_traceparent(msg.headers.as_ref(), &accepted.id, &kind);
                        }
                        mine = record.claim_token.clone();
                        (
                            shared
                                .jobs
                                .update(&record, *revision)
                                .await
                                .map(|r| (r, *record)),
                            reclaim,
                        )
                    }
                    ClaimDecision::Wait(d) => {
                        tracing::debug!(job = %accepted.id, delay = ?d, "not runnable yet; NAK with the remaining delay");
                        let _ = msg
                            .ack_with(AckKind::Nak(Some(d + Duration::from_millis(20))))
                            .await;
                        return;
                    }
                    ClaimDecision::Release => {
                        match timers::release(&shared.recovery, value, *revision).await {
                            Ok(()) => {
                                tracing::debug!(job = %accepted.id, due = ?value.next_run_at, "not due for a while: ticket released to the job's wake-up");
                                let _ = msg.ack().await;
                                return;
                            }
                            Err(timers::DueError::Jobs(JobsError::Conflict(_))) => continue,
                            Err(e) => {
                                let d = machine::transient_retry_delay(deliveries);
                                tracing::warn!(job = %accepted.id, error = %e, retry_in_ms = d.as_millis() as u64, "cannot release the ticket of a delayed job; it comes back later");
                                let _ = msg.ack_with(AckKind::Nak(Some(d))).await;
                                return;
                            }
                        }
                    }
                    ClaimDecision::Settle(why) => {
                        if settle_live(&shared, value, &msg, &why).await {
                            return;
                        }
                        // The owner's session ended while the job was
                        // being indexed: decide again, as for a gone owner.
                        continue;
                    }
                    ClaimDecision::Cancel(record) => {
                        match shared.jobs.update(&record, *revision).await {
                            Ok(_) => {
                                cancelled_unclaimed(&shared, &record).await;
                                let _ = msg.ack().await;
                                return;
                            }
                            Err(JobsError::Conflict(_)) => continue,
                            Err(e) => {
                                let d = machine::transient_retry_delay(deliveries);
                                tracing::warn!(job = %accepted.id, error = %e, retry_in_ms = d.as_millis() as u64, "cannot record the cancellation; the ticket comes back later");
                                let _ = msg.ack_with(AckKind::Nak(Some(d))).await;
                                return;
                            }
                        }
                    }
                    ClaimDecision::Poison(d) => {
                        poison(&shared, value, &msg, d).await;
                        return;
                    }
                    ClaimDecision::Drop(why) => {
                        // A finished job's ticket that is still here may be
                        // the one its owner kept because its terminal event
                        // was not published (or the owner died between the
                        // two): the event first, then the ack.
                        if let Err(e) = shared.recovery.finish_terminal_if_unfinished(value).await {
                            tracing::warn!(job = %accepted.id, error = %e, "cannot publish the finished job's terminal event; the ticket comes back");
                            let _ = msg
                                .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                                .await;
                            return;
                        }
                        tracing::debug!(job = %accepted.id, why, "ticket has nothing left to do; acking");
                        let _ = msg.ack().await;
                        return;
                    }
                }
            }
        };
        match write {
            Ok((revision, record)) => {
                // The job's previous index entry (waiting, or an earlier
                // owner's) goes; its running entry comes with --index-after.
                if let Some((old, prev)) = current
                    .as_ref()
                    .and_then(|v| Key::of(&v.value).map(|k| (k, v.value.clone())))
                {
                    let active = shared.active.clone();
                    tokio::spawn(async move {
                        if let Err(e) = active.remove(&old, &prev).await {
                            tracing::debug!(key = %old.as_string(), error = %e, "old index entry left for the reaper");
                        }
                    });
                }
                shared.count_claim(&kind, reclaim);
                // A suspect may kill this process at once, and a reclaim's
                // ticket may still be acked by its previous owner's late
                // index task: index either before it runs, so the end of
                // this session recovers (or dead-letters) it even without
                // its ticket's wake-up.
                let indexed = suspect.is_some() || reclaim;
                if indexed {
                    index_now(&shared, &record).await;
                }
                // The ticket becomes a wake-up call: it comes back by itself
                // one session timeout from now, unless the job finished or
                // was indexed (then it is acked first).
                let _ = msg
                    .ack_with(AckKind::Nak(Some(shared.opts.wake_after())))
                    .await;
                let claimed = Versioned {
                    value: record,
                    revision,
                };
                attempt::run_claimed(
                    shared.clone(),
                    claimed,
                    Some(msg),
                    permit,
                    attempt::Claimed { reclaim, indexed },
                    Some(claiming),
                )
                .await;
                drop(suspect);
                return;
            }
            Err(JobsError::Exists(_) | JobsError::Conflict(_)) => continue,
            Err(e) => {
                // The write may have landed with its reply lost: read the
                // record until it says (our own token means it did).
                tracing::warn!(job = %accepted.id, error = %e, "claim write unanswered; reading the record to see whether it landed");
                unsure += 1;
                continue;
            }
        }
    }
    let _ = msg
        .ack_with(AckKind::Nak(Some(machine::transient_retry_delay(
            deliveries,
        ))))
        .await;
}

/// A ticket of a job a live owner holds: make sure the job is indexed
/// under its owner (its liveness no longer needs the ticket), then ack.
/// Whether it did: `false` when the owner's session ended meanwhile.
///
/// The index entry is written *before* the owner is looked at again: the
/// end of that session is handled by listing the owner's index entries
/// after the end, so either that listing sees this entry (and recovers the
/// job), or this look sees the session gone (and the ticket is not acked:
/// the caller decides again). Acking on the first look alone could drop
/// the ticket of a job whose session ended in between, leaving it to a
/// reaper's sweep, or to nobody without a reaper.
async fn settle_live(
    shared: &Shared,
    rec: &JobRecord,
    msg: &jetstream::Message,
    why: &str,
) -> bool {
    let key = Key::of(rec).expect("a running or parked record has a key");
    match shared.active.put(&key, rec).await {
        Ok(())
            if rec.status == "running"
                && shared.owner_liveness(rec).await != OwnerLiveness::Live =>
        {
            tracing::info!(job = %rec.id, owner = ?rec.worker_id, "the owner's session ended while its job was indexed; deciding again");
            false
        }
        Ok(()) => {
            shared.stats.settled.fetch_add(1, Ordering::Relaxed);
            tracing::debug!(job = %rec.id, owner = ?rec.worker_id, why, "ticket settled: the job is indexed and needs no ticket");
            let _ = msg.ack().await;
            true
        }
        Err(e) => {
            let d = machine::transient_retry_delay(delivered(msg));
            tracing::warn!(job = %rec.id, error = %e, retry_in_ms = d.as_millis() as u64, "cannot index the job; the ticket comes back later");
            let _ = msg.ack_with(AckKind::Nak(Some(d))).await;
            true
        }
    }
}

/// A job cancelled by its claim (the request came before it could run).
async fn cancelled_unclaimed(shared: &Shared, rec: &JobRecord) {
    shared.count(AttemptOutcome::Cancelled);
    let ev = events::event(
        &rec.id,
        rec.epoch,
        "cancelled",
        Some(&shared.worker_id),
        json!({"while": "waiting", "kind": rec.kind}),
    );
    let _ = shared
        .events
        .publish(&ev, Some(&events::terminal_event_id(rec, "cancelled")))
        .await;
    if let Ok(keys) = shared.active.keys_of(&rec.id).await {
        for k in keys {
            let _ = shared.active.remove(&k, rec).await;
        }
    }
}

/// A job whose owner is gone after too many stale reclaims: dead-letter it
/// here (the recovery of its owner's session may not know it: it was never
/// indexed).
async fn poison(shared: &Shared, rec: &JobRecord, msg: &jetstream::Message, retry: Duration) {
    let max = shared.opts.max_stale_reclaims;
    let reason = format!(
        "poison: its worker stopped {} times while running it (limit {max}); the job keeps killing or stalling its workers",
        rec.stale_reclaims
    );
    let (epoch, worker) = (rec.epoch, rec.worker_id.clone());
    let killed = shared
        .recovery
        .kill(&rec.id, "poison", &reason, |r| {
            r.status == "running" && r.epoch == epoch && r.worker_id == worker
        })
        .await;
    match killed {
        Ok(_) => {
            let _ = msg.ack().await;
        }
        Err(e) => {
            tracing::warn!(job = %rec.id, error = %e, "cannot dead-letter a poison job yet; retrying");
            let _ = msg.ack_with(AckKind::Nak(Some(retry))).await;
        }
    }
}

/// A submission reusing the id of a job of another kind: dead-lettered, the
/// existing job left alone.
async fn id_conflict(
    shared: &Shared,
    kind: &str,
    seq: u64,
    msg: &jetstream::Message,
    rec: &JobRecord,
) {
    let message = format!(
        "job id {:?} already names a job of kind {:?}; a submission of kind {kind:?} cannot reuse it",
        rec.id, rec.kind
    );
    tracing::warn!(job = %rec.id, seq, "{message}");
    match shared
        .dlq
        .reject(
            kind,
            Some(&rec.id),
            "id_conflict",
            &message,
            msg.payload.clone(),
            msg.headers.as_ref(),
            &format!("rejected:{kind}:{seq}"),
        )
        .await
    {
        Ok(_) => {
            let _ = msg.ack().await;
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot dead-letter the conflicting submission; retrying");
            let _ = msg
                .ack_with(AckKind::Nak(Some(machine::transient_retry_delay(
                    delivered(msg),
                ))))
                .await;
        }
    }
}

/// Enters a freshly claimed job in the index at once (not after
/// `--index-after`), for a claim whose ticket may not cover it (a suspect,
/// a reclaim, a restart reclaim); on failure the ticket's wake-up, if any,
/// is its only cover (the write is retried by the index task).
async fn index_now(shared: &Shared, rec: &JobRecord) {
    let Some(key) = Key::of(rec) else { return };
    if let Err(e) = shared.active.put(&key, rec).await {
        tracing::warn!(job = %rec.id, error = %e, "cannot index a reclaimed job before it runs");
    }
}

/// How often `msg` has been delivered (this delivery included).
fn delivered(msg: &jetstream::Message) -> u64 {
    msg.info().map(|i| i.delivered.max(1) as u64).unwrap_or(1)
}

/// A bad submission: never crashes the worker, never silently dropped.
async fn reject(
    shared: &Shared,
    kind: &str,
    seq: u64,
    msg: &jetstream::Message,
    rej: spec::Rejected,
) {
    shared.stats.rejected.fetch_add(1, Ordering::Relaxed);
    shared.metrics.rejected(kind);
    let message = rej.error.to_string();
    tracing::info!(kind, seq, id = rej.id.as_deref().unwrap_or("-"), error = %message, "rejected submission");
    if let Some(id) = &rej.id {
        let rec = machine::rejected_record(id, kind, "rejected", &message, seq, SystemTime::now());
        match shared.jobs.create(&rec).await {
            Ok(_) => {
                let ev = events::event(
                    id,
                    0,
                    "rejected",
                    Some(&shared.worker_id),
                    json!({"error": message, "code": rej.error.code(), "kind": kind}),
                );
                let _ = shared
                    .events
                    .publish(&ev, Some(&format!("{id}:rejected:{seq}")))
                    .await;
            }
            // An existing job keeps its record: a bad duplicate must not
            // clobber it. But a waiting job whose own ticket this worker
            // refuses (configuration or version skew) would bounce between
            // re-enqueues for ever: it is parked once, with the reason.
            Err(JobsError::Exists(_)) => {
                let code = rej.error.code();
                let parked = shared
                    .jobs
                    .transition(id, |cur| {
                        if cur.status != "queued" || (seq != 0 && cur.ticket_seq > seq) {
                            return Ok(None);
                        }
                        machine::park_waiting(
                            cur,
                            SystemTime::now(),
                            "rejected_ticket",
                            &format!(
                                "its ticket was refused by worker {}: {message}",
                                shared.worker_id
                            ),
                        )
                        .map(Some)
                    })
                    .await;
                match parked {
                    Ok(v) if v.value.status == "parked" => {
                        tracing::warn!(job = %id, code, "a waiting job's ticket was refused here; the job is parked for review");
                        let _ = shared.active.reconcile(&v.value).await;
                        let ev = events::event(
                            id,
                            v.value.epoch,
                            "parked",
                            Some(&shared.worker_id),
                            json!({"reason": "rejected_ticket", "message": message, "code": code}),
                        );
                        let _ = shared
                            .events
                            .publish(&ev, Some(&format!("{id}:parked:rejected:{code}")))
                            .await;
                    }
                    _ => {
                        tracing::info!(job = %id, "a job with this id exists; its record is left alone")
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot record the rejection; retrying the ticket");
                let _ = msg
                    .ack_with(AckKind::Nak(Some(machine::transient_retry_delay(
                        delivered(msg),
                    ))))
                    .await;
                return;
            }
        }
    }
    match shared
        .dlq
        .reject(
            kind,
            rej.id.as_deref(),
            rej.error.code(),
            &message,
            msg.payload.clone(),
            msg.headers.as_ref(),
            // One letter per job and reason, whatever ticket carried it.
            &match &rej.id {
                Some(id) => format!("rejected:{kind}:{id}:{}", rej.error.code()),
                None => format!("rejected:{kind}:{seq}"),
            },
        )
        .await
    {
        Ok(_) => {
            let _ = msg.ack().await;
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot dead-letter the rejected submission; retrying");
            let _ = msg
                .ack_with(AckKind::Nak(Some(machine::transient_retry_delay(
                    delivered(msg),
                ))))
                .await;
        }
    }
}

/// At start with a stable identity: take back, at once, the jobs an earlier
/// process of this identity held (listed by the index, never by a scan).
/// Such a takeover writes the session key anew and leaves no end marker for
/// the earlier process, so nobody else would recover its jobs before a
/// reaper's sweep: this retries until every one of them is handled.
pub(crate) async fn restart_reclaim_all(shared: Arc<Shared>) {
    let mut pause = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
    loop {
        match restart_reclaim(shared.clone()).await {
            Ok(0) => return,
            Ok(left) => tracing::warn!(left, "restart reclaim: jobs of an earlier process of this identity not handled yet; retrying"),
            Err(e) => tracing::warn!(error = %e, "restart reclaim failed; retrying"),
        }
        tokio::select! {
            _ = tokio::time::sleep(pause.pause()) => {}
            _ = shared.shutdown.cancelled() => return,
        }
    }
}

/// One pass of [`restart_reclaim_all`]: how many jobs are left for the next.
pub(crate) async fn restart_reclaim(shared: Arc<Shared>) -> anyhow::Result<usize> {
    let entries = shared
        .active
        .list(leasehold_store::index::Filter::RunningBy(&shared.worker_id))
        .await?;
    let mut left = 0;
    for (_, entry) in entries {
        if !shared.handlers.contains_key(&entry.kind) {
            continue;
        }
        let cur = match shared.jobs.get(&entry.job).await {
            Ok(Some(c)) => c,
            Ok(None) => continue,
            // One unreadable record never stops the others' reclaim.
            Err(e) => {
                tracing::warn!(job = %entry.job, error = %e, "restart reclaim skips this job for now");
                left += 1;
                continue;
            }
        };
        let rec = cur.value;
        if rec.status != "running"
            || rec.worker_id.as_deref() != Some(shared.worker_id.as_str())
            || rec.session.as_deref() == Some(shared.session.id.as_str())
        {
            continue;
        }
        // A ticket of the job is being claimed here right now: that claim
        // decides (it sees an earlier process's job, as this would).
        let Some(claiming) = Claiming::new(&shared, &rec.id) else {
            continue;
        };
        // A suspect runs here only if no other suspect does; otherwise it
        // is re-offered for another worker.
        // This claim counts the earlier process's loss too.
        let suspect = if is_suspect(rec.stale_reclaims + 1) {
            match SuspectSlot::take(&shared, &rec.id) {
                Some(s) => Some(s),
                None => {
                    drop(claiming);
                    match shared
                        .recovery
                        .recover_job(&shared.worker_id, &rec.id, None)
                        .await
                    {
                        Ok(leasehold_store::recovery::Action::Unsure(_)) | Err(_) => left += 1,
                        Ok(_) => {}
                    }
                    continue;
                }
            }
        } else {
            None
        };
        let permit = shared.slots.clone().acquire_owned().await?;
        let claimant = shared.claimant(0, OwnerLiveness::Dead);
        let token = claimant.claim_token.clone();
        let session = shared.session.id.clone();
        let res = shared
            .jobs
            .transition(&rec.id, |cur| {
                // Still an earlier process's job of this identity?
                if cur.worker_id.as_deref() != Some(shared.worker_id.as_str())
                    || cur.status != "running"
                    || cur.session.as_deref() == Some(session.as_str())
                {
                    return Ok(None);
                }
                match machine::decide_claim(cur, &claimant) {
                    ClaimDecision::Claim { record, .. } => Ok(Some(*record)),
                    _ => Ok(None),
                }
            })
            .await;
        match res {
            // Only our own fresh token proves the claim is ours.
            Ok(v) if v.value.claim_token.as_deref() == Some(token.as_str()) => {
                tracing::info!(job = %rec.id, epoch = v.value.epoch, "reclaimed at start from an earlier process of this identity");
                // No ticket covers it: the index must (run_claimed knows).
                index_now(&shared, &v.value).await;
                shared.count_claim(&v.value.kind, true);
                let s = shared.clone();
                tokio::spawn(async move {
                    let how = attempt::Claimed {
                        reclaim: true,
                        indexed: true,
                    };
                    attempt::run_claimed(s, v, None, permit, how, Some(claiming)).await;
                    drop(suspect);
                });
            }
            Err(e) => {
                tracing::warn!(job = %rec.id, error = %e, "restart reclaim of this job failed; retrying");
                left += 1;
            }
            _ => {}
        }
    }
    Ok(left)
}
