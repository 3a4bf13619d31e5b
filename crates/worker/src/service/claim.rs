//! From a delivered ticket to a claim (or to nothing, at once).
//!
//! The claim is a KV create (a new job) or an update at the revision read,
//! decided by `machine::decide_claim` with what this worker knows of the
//! recorded owner: its session alive, ended, or unknown. A ticket whose job
//! a live owner holds is *settled*: the job is entered in the index (so its
//! recovery does not need the ticket) and the ticket acked, never NAKed, so
//! a live job never spends deliveries. A claim whose reply was lost is
//! recognised by its own claim token on the retry.
//!
//! [`handle_delivery`] in three steps: accept the ticket (attached to a
//! claim in flight, or rejected), claim (the loop: read, decide, write at
//! the revision read), act on a claim that landed (the ticket becomes a
//! wake-up call and the attempt runs). Tickets refused for good are
//! `refuse.rs`'s; a restart's reclaim is `restart.rs`'s.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use crate::metrics::AttemptOutcome;
use async_nats::jetstream::{self, AckKind};
use leasehold_core::machine::{self, ClaimDecision, Claimant, OwnerLiveness};
use leasehold_core::spec::{self, Submission};
use leasehold_core::JobRecord;
use leasehold_store::events;
use leasehold_store::index::Key;
use leasehold_store::liveness::Verdict;
use leasehold_store::{timers, work};
use leasehold_store::{JobsError, Versioned};
use leasehold_telemetry::{spans, trace};
use serde_json::json;
use tokio::sync::OwnedSemaphorePermit;

use super::refuse::{delivered, id_conflict, poison, reject};
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
            signalled: false,
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

/// Handles one delivered ticket: [`accept`] it (attached to a claim this
/// process has in flight, or rejected), then [`Delivery::claim`] its job in
/// a read-decide-CAS loop around the pure `machine::decide_claim`, and
/// [`Delivery::act`] on a claim that landed.
pub(crate) async fn handle_delivery(
    shared: Arc<Shared>,
    msg: jetstream::Message,
    permit: OwnedSemaphorePermit,
) {
    let Some(d) = accept(shared, msg).await else {
        return;
    };
    let Some(claiming) = Claiming::new(&d.shared, &d.accepted.id) else {
        tracing::debug!(job = %d.accepted.id, "this process is claiming the job already; the ticket waits for that claim");
        let _ = d
            .msg
            .ack_with(AckKind::Nak(Some(Duration::from_millis(500))))
            .await;
        return;
    };
    d.claim(permit, claiming).await;
}

/// A ticket accepted for a job this process may claim.
struct Delivery {
    shared: Arc<Shared>,
    msg: jetstream::Message,
    kind: String,
    /// The ticket's stream sequence.
    seq: u64,
    /// Its delivery count (1 the first time).
    deliveries: u64,
    accepted: spec::Accepted,
}

/// The ticket was settled (acked, NAKed or dead-lettered): nothing is left
/// to do with it.
struct Settled;

/// What one round of the claim loop came to.
enum Round {
    /// A claim (or the create of a claimed record) was written: its answer,
    /// and whether it is a reclaim.
    Wrote(Result<(u64, Box<JobRecord>), JobsError>, bool),
    /// Read the record and decide again.
    Again,
    /// The ticket was settled.
    Settled,
}

/// Reads a ticket: `None` when it is settled already (attached to this
/// process's claim in flight, or rejected as a submission).
async fn accept(shared: Arc<Shared>, msg: jetstream::Message) -> Option<Delivery> {
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
            return None;
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
            return None;
        }
    };
    let mut slot = Some(msg);
    if attach(&shared, &accepted.id, seq, &mut slot) {
        return None;
    }
    Some(Delivery {
        msg: slot.take().expect("set"),
        shared,
        kind,
        seq,
        deliveries,
        accepted,
    })
}

impl Delivery {
    /// The claim loop: read the record (not in the first round: most
    /// tickets are new jobs, so the create is tried first), decide, write
    /// at the revision read; a conflict or an unanswered write reads again.
    async fn claim(self, permit: OwnedSemaphorePermit, claiming: Claiming) {
        // The token of our own claim, kept across rounds: a claim whose reply
        // was lost is recognised on the next read as ours.
        let mut mine: Option<String> = None;
        // Held for a suspect's whole attempt (see SUSPECT_AFTER).
        let mut suspect: Option<SuspectSlot> = None;
        // Set when a claim write failed without a definite answer: the next
        // rounds read the record until it says whether the claim landed.
        let mut unsure = 0u32;
        for round in 0..16 {
            if unsure > 0 {
                tokio::time::sleep(Duration::from_millis(200) * unsure.min(10)).await;
            }
            let current = if round == 0 {
                None
            } else {
                match self.read().await {
                    Ok(c) => c,
                    Err(Settled) => return,
                }
            };
            let now = SystemTime::now();
            let r = match &current {
                None if !machine::due(self.accepted.spec.run_at.as_deref(), now) => {
                    self.record_delayed().await
                }
                None => self.create_claimed(&mut mine).await,
                // Our own claim landed although its reply was lost.
                Some(v) if mine.is_some() && v.value.claim_token == mine => Round::Wrote(
                    Ok((v.revision, Box::new(v.value.clone()))),
                    v.value.stale_reclaims > 0,
                ),
                Some(v) => self.decide(v, &mut mine, &mut suspect).await,
            };
            match r {
                Round::Settled => return,
                Round::Again
                | Round::Wrote(Err(JobsError::Exists(_) | JobsError::Conflict(_)), _) => {}
                Round::Wrote(Ok((revision, record)), reclaim) => {
                    let claimed = Versioned {
                        value: *record,
                        revision,
                    };
                    self.act(current, claimed, reclaim, suspect, permit, claiming)
                        .await;
                    return;
                }
                Round::Wrote(Err(e), _) => {
                    // The write may have landed with its reply lost: read the
                    // record until it says (our own token means it did).
                    tracing::warn!(job = %self.accepted.id, error = %e, "claim write unanswered; reading the record to see whether it landed");
                    unsure += 1;
                }
            }
        }
        let _ = self
            .msg
            .ack_with(AckKind::Nak(Some(machine::transient_retry_delay(
                self.deliveries,
            ))))
            .await;
    }

    /// NAKs the ticket for a transient failure (it comes back later, after
    /// a delay growing with its deliveries), saying what failed.
    async fn later(&self, e: &(dyn std::fmt::Display + Sync), what: &str) -> Round {
        let d = machine::transient_retry_delay(self.deliveries);
        tracing::warn!(job = %self.accepted.id, error = %e, retry_in_ms = d.as_millis() as u64, "{what}; the ticket comes back later");
        let _ = self.msg.ack_with(AckKind::Nak(Some(d))).await;
        Round::Settled
    }

    /// NAKs the ticket to come back after `d`.
    async fn nak(&self, d: Duration) -> Round {
        let _ = self.msg.ack_with(AckKind::Nak(Some(d))).await;
        Round::Settled
    }

    /// Acks the ticket.
    async fn ack(&self) -> Round {
        let _ = self.msg.ack().await;
        Round::Settled
    }

    /// The job's record as it is now.
    async fn read(&self) -> Result<Option<Versioned<JobRecord>>, Settled> {
        match self.shared.jobs.get(&self.accepted.id).await {
            Ok(c) => Ok(c),
            Err(JobsError::Corrupt { id, message }) => {
                tracing::error!(job = %id, error = %message, "the job's record cannot be read; leaving the ticket for an operator (leasehold list --corrupt)");
                self.nak(Duration::from_secs(30)).await;
                Err(Settled)
            }
            Err(e) => {
                self.later(&e, "cannot read the record").await;
                Err(Settled)
            }
        }
    }

    /// A delayed job not due yet: its queued record (due at `next_run_at`),
    /// as the gateway would write it; the next round decides on it (a short
    /// wait NAKs the ticket with the rest, a long one releases the ticket to
    /// the job's wake-up).
    async fn record_delayed(&self) -> Round {
        let (id, kind) = (&self.accepted.id, &self.kind);
        let tp = job_traceparent(self.msg.headers.as_ref(), id, kind);
        match work::create_queued(
            &self.shared.jobs,
            &self.shared.active,
            self.accepted.clone(),
            kind,
            self.seq,
            tp,
        )
        .await
        {
            Ok(rec) => {
                tracing::debug!(job = %rec.id, due = ?rec.next_run_at, "delayed job recorded");
                Round::Again
            }
            // Recorded already (the gateway): its record decides.
            Err(JobsError::Exists(_) | JobsError::Conflict(_)) => Round::Again,
            Err(e) => self.later(&e, "cannot record the delayed job").await,
        }
    }

    /// A new job: its record created claimed by this worker.
    async fn create_claimed(&self, mine: &mut Option<String>) -> Round {
        let (id, kind) = (&self.accepted.id, &self.kind);
        let c = self.shared.claimant(self.seq, OwnerLiveness::Dead);
        let mut record = machine::claim_new(
            machine::new_record(id, kind, self.accepted.spec.clone(), self.seq, c.now),
            &c,
        );
        record.traceparent = job_traceparent(self.msg.headers.as_ref(), id, kind);
        mine.clone_from(&record.claim_token);
        Round::Wrote(
            self.shared
                .jobs
                .create(&record)
                .await
                .map(|r| (r, Box::new(record))),
            false,
        )
    }

    /// A recorded job: what `machine::decide_claim` says of it, with what
    /// this worker knows of its owner, carried out.
    async fn decide(
        &self,
        current: &Versioned<JobRecord>,
        mine: &mut Option<String>,
        suspect: &mut Option<SuspectSlot>,
    ) -> Round {
        let Versioned { value, revision } = current;
        let id = &self.accepted.id;
        if value.kind != self.kind {
            // An id reused by a submission of another kind: never
            // run a job under a handler that is not its own.
            id_conflict(&self.shared, &self.kind, self.seq, &self.msg, value).await;
            return Round::Settled;
        }
        let owner = if value.status == "running" {
            self.shared.owner_liveness(value).await
        } else {
            OwnerLiveness::Dead
        };
        let mut c = self.shared.claimant_of(self.seq, self.deliveries, owner);
        // A job waiting for a signal: whether it came decides the claim.
        c.signalled = match self.shared.recovery.signals.arrived(value).await {
            Ok(s) => s,
            Err(e) => {
                return self
                    .later(&e, "cannot look for the signal a waiting job waits for")
                    .await
            }
        };
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
                match SuspectSlot::take(&self.shared, id) {
                    Some(s) => {
                        *suspect = Some(s);
                        Round::Again
                    }
                    None => {
                        tracing::debug!(job = %id, stale_reclaims = record.stale_reclaims, "a suspect runs here already; handing this suspect to another worker");
                        self.nak(Duration::from_secs(1)).await
                    }
                }
            }
            ClaimDecision::Claim {
                mut record,
                reclaim,
            } => {
                if record.traceparent.is_none() {
                    record.traceparent = job_traceparent(self.msg.headers.as_ref(), id, &self.kind);
                }
                mine.clone_from(&record.claim_token);
                Round::Wrote(
                    self.shared
                        .jobs
                        .update(&record, *revision)
                        .await
                        .map(|r| (r, record)),
                    reclaim,
                )
            }
            ClaimDecision::Wait(d) => {
                tracing::debug!(job = %id, delay = ?d, "not runnable yet; NAK with the remaining delay");
                self.nak(d + Duration::from_millis(20)).await
            }
            ClaimDecision::Release => {
                match timers::release(&self.shared.recovery, value, *revision).await {
                    Ok(()) => {
                        tracing::debug!(job = %id, due = ?value.next_run_at, "not due for a while: ticket released to the job's wake-up");
                        self.ack().await
                    }
                    Err(timers::DueError::Jobs(JobsError::Conflict(_))) => Round::Again,
                    Err(e) => {
                        self.later(&e, "cannot release the ticket of a delayed job")
                            .await
                    }
                }
            }
            ClaimDecision::Settle(why) => {
                if settle_live(&self.shared, value, &self.msg, &why).await {
                    return Round::Settled;
                }
                // The owner's session ended while the job was
                // being indexed: decide again, as for a gone owner.
                Round::Again
            }
            ClaimDecision::Cancel(record) => {
                match self.shared.jobs.update(&record, *revision).await {
                    Ok(_) => {
                        cancelled_unclaimed(&self.shared, &record).await;
                        self.ack().await
                    }
                    Err(JobsError::Conflict(_)) => Round::Again,
                    Err(e) => self.later(&e, "cannot record the cancellation").await,
                }
            }
            ClaimDecision::Poison(d) => {
                poison(&self.shared, value, &self.msg, d).await;
                Round::Settled
            }
            ClaimDecision::Drop(why) => {
                // A finished job's ticket that is still here may be
                // the one its owner kept because its terminal event
                // was not published (or the owner died between the
                // two): the event first, then the ack.
                if let Err(e) = self
                    .shared
                    .recovery
                    .finish_terminal_if_unfinished(value)
                    .await
                {
                    tracing::warn!(job = %id, error = %e, "cannot publish the finished job's terminal event; the ticket comes back");
                    return self.nak(Duration::from_secs(1)).await;
                }
                tracing::debug!(job = %id, why, "ticket has nothing left to do; acking");
                self.ack().await
            }
        }
    }

    /// The claim landed: the job's earlier index entry goes, the ticket
    /// becomes a wake-up call, and the attempt runs.
    async fn act(
        self,
        current: Option<Versioned<JobRecord>>,
        claimed: Versioned<JobRecord>,
        reclaim: bool,
        suspect: Option<SuspectSlot>,
        permit: OwnedSemaphorePermit,
        claiming: Claiming,
    ) {
        let shared = self.shared;
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
        shared.count_claim(&self.kind, reclaim);
        // A suspect may kill this process at once, and a reclaim's
        // ticket may still be acked by its previous owner's late
        // index task: index either before it runs, so the end of
        // this session recovers (or dead-letters) it even without
        // its ticket's wake-up.
        let indexed = suspect.is_some() || reclaim;
        if indexed {
            index_now(&shared, &claimed.value).await;
        }
        // The ticket becomes a wake-up call: it comes back by itself one
        // session timeout from now (or at the consumer's ack wait, when
        // that is no later: then no NAK is needed), unless the job
        // finished or was indexed (then it is acked first).
        let back = shared.ticket_return(&self.kind);
        if back.set_wake_up {
            let _ = self.msg.ack_with(AckKind::Nak(Some(back.after))).await;
        }
        attempt::run_claimed(
            shared.clone(),
            claimed,
            Some(self.msg),
            permit,
            attempt::Claimed { reclaim, indexed },
            Some(claiming),
        )
        .await;
        drop(suspect);
    }
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
    shared.metrics.ended(&rec.kind, AttemptOutcome::Cancelled);
    // Not announced: the event and the index entry stay, and the entry's
    // repair finishes the end.
    if let Err(e) = shared.recovery.announce_end(rec).await {
        tracing::warn!(job = %rec.id, error = %e, "cannot announce a cancelled child's end to its parent; its index entry's repair will");
        return;
    }
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

/// Enters a freshly claimed job in the index at once (not after
/// `--index-after`), for a claim whose ticket may not cover it (a suspect,
/// a reclaim, a restart reclaim); on failure the ticket's wake-up, if any,
/// is its only cover (the write is retried by the index task).
pub(crate) async fn index_now(shared: &Shared, rec: &JobRecord) {
    let Some(key) = Key::of(rec) else { return };
    if let Err(e) = shared.active.put(&key, rec).await {
        tracing::warn!(job = %rec.id, error = %e, "cannot index a reclaimed job before it runs");
    }
}
