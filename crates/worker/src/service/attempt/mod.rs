//! One attempt of a claimed job, from the `claimed` marker to the
//! owner-checked outcome.
//!
//! Beside the handler run small watchers, all ended with the attempt:
//! - the index task: once the job outlives `--index-after`, it is entered
//!   in the index under its owner and its (held) ticket acked;
//! - the stop watcher: shutdown hand-back, a cancel request seen by any
//!   owner write, the attempt deadline (`--attempt-timeout`).
//!
//! A cancel notification, lost ownership (seen by a write, a re-check after
//! the session was away, or a takeover of the identity) arrive as [`Stop`]s
//! through the attempt's channel. The handler is given its cancel token and
//! a moment to stop, then aborted; no task of an attempt outlives it.
//!
//! Every way out of an attempt writes the record (or finds ownership lost):
//! a panic anywhere in it requeues the job with the panic's message, so a
//! live session never holds a job nobody runs.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use crate::metrics::{AttemptOutcome, AttemptTimer};
use async_nats::jetstream::{self, AckKind};
use leasehold_core::machine::{End, Owner};
use leasehold_core::retry::Backoff;
use leasehold_core::JobRecord;
use leasehold_proto::JobResult;
use leasehold_store::events::{Fence, FenceError};
use leasehold_store::index::Key;
use leasehold_store::{Gate, Versioned};
use leasehold_telemetry::observe::Observer as _;
use leasehold_telemetry::{spans, trace};
use serde_json::{json, Value};
use tokio::sync::{mpsc, OwnedSemaphorePermit};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::Shared;
use crate::handler::JobCtx;

mod end;

pub(crate) use end::settle;
use end::{ownership_lost, still_ours};

/// The ticket slot of a running job: a redelivery of its ticket to this
/// process replaces the held message, so acks go to the live delivery.
pub(crate) type TicketSlot = Arc<StdMutex<Option<jetstream::Message>>>;

/// A job running in this process.
pub(crate) struct Running {
    pub(crate) epoch: u64,
    /// Stream sequence of the ticket this attempt was claimed on (0: none).
    pub(crate) ticket_seq: u64,
    pub(crate) ticket: TicketSlot,
    pub(crate) stop: mpsc::Sender<Stop>,
    /// The attempt's gate, once it has one (for re-checks of ownership).
    pub(crate) gate: Option<Gate>,
}

/// Why a running attempt must stop before its handler finished.
#[derive(Debug, Clone)]
pub(crate) enum Stop {
    Lost(String),
    Cancel,
    Handoff,
    Deadline,
}

/// How a claim came about.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Claimed {
    /// Taken from a previous owner.
    pub reclaim: bool,
    /// Entered in the index by the claim, before the attempt runs.
    pub indexed: bool,
}

/// Runs one claimed job to an owner-checked outcome. Never leaves the job
/// held by this process: a panic in the attempt requeues it.
pub(crate) async fn run_claimed(
    shared: Arc<Shared>,
    claimed: Versioned<JobRecord>,
    msg: Option<jetstream::Message>,
    permit: OwnedSemaphorePermit,
    how: Claimed,
    claiming: Option<super::claim::Claiming>,
) {
    let id = claimed.value.id.clone();
    let epoch = claimed.value.epoch;
    let msg_seq = msg
        .as_ref()
        .and_then(|m| m.info().ok().map(|i| i.stream_sequence))
        .unwrap_or(0);
    let ticket: TicketSlot = Arc::new(StdMutex::new(msg));
    let (stop_tx, stop_rx) = mpsc::channel::<Stop>(8);
    {
        let mut running = shared.running.lock().unwrap();
        if let Some(older) = running.get(&id) {
            if older.epoch >= epoch {
                // This process already runs this claim (or a newer one).
                return;
            }
            // An older attempt of ours is fenced off by this claim.
            let _ = older
                .stop
                .try_send(Stop::Lost(format!("reclaimed at epoch {epoch}")));
        }
        running.insert(
            id.clone(),
            Running {
                epoch,
                ticket_seq: msg_seq,
                ticket: ticket.clone(),
                stop: stop_tx.clone(),
                gate: None,
            },
        );
    }
    // Registered as running: the claim is no longer in flight.
    drop(claiming);
    let rec = claimed.value.clone();
    // The attempt's span: a child of the job's trace (kept in the record),
    // linked to the previous attempt once its claim marker is read.
    let span = spans::attempt(&id, &rec.kind, epoch, rec.attempts + 1, &shared.worker_id);
    if let Some(tp) = rec.traceparent.as_deref() {
        trace::set_parent_from_traceparent(&span, tp);
    }
    // Boxed, as the delivery's task: the attempt's state is large.
    let task = tokio::spawn(Box::pin(
        run_attempt(
            shared.clone(),
            claimed,
            ticket.clone(),
            how,
            (stop_tx.clone(), stop_rx),
        )
        .instrument(span),
    ));
    if let Err(e) = task.await {
        let why = if e.is_panic() {
            format!("internal error: the attempt panicked: {}", panic_text(e))
        } else {
            "internal error: the attempt was aborted".to_string()
        };
        tracing::error!(job = %id, epoch, "{why}; ending the attempt as a retryable failure");
        // The attempt's own state went with its task: the end is carried
        // out unfenced, by the same executor as every other end (the
        // retry budget, ticket first, then record, then index).
        let owner = Owner::of(&rec).expect("a claimed record is running");
        let a = Attempt {
            shared: shared.clone(),
            rec: rec.clone(),
            gate: Gate::new(shared.jobs.clone(), id.clone(), owner),
            fence: None,
            ticket: ticket.clone(),
            // It may have been indexed under this worker: the run key goes.
            indexed: Arc::new(AtomicBool::new(true)),
            started: tokio::time::Instant::now(),
            timer: StdMutex::new(None),
            span: tracing::Span::current(),
        };
        // Boxed: this rare path's state stays out of every attempt's.
        Box::pin(a.finish(End::retryable(why))).await;
    }
    {
        let mut running = shared.running.lock().unwrap();
        if running.get(&id).is_some_and(|r| r.epoch == epoch) {
            running.remove(&id);
        }
    }
    drop(stop_tx);
    drop(permit);
    shared.idle.notify_waiters();
}

fn panic_text(e: tokio::task::JoinError) -> String {
    let p = e.into_panic();
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "(no message)".into())
}

/// How long an owner keeps trying to publish its job's next ticket.
const TICKET_PATIENCE: Duration = Duration::from_secs(30);

/// What the outcome paths of one attempt share.
struct Attempt {
    shared: Arc<Shared>,
    rec: JobRecord,
    gate: Gate,
    /// `None` when the claim marker could not be published (NATS away):
    /// then the attempt only hands the job back, with unfenced events.
    fence: Option<Arc<tokio::sync::Mutex<Fence>>>,
    ticket: TicketSlot,
    indexed: Arc<AtomicBool>,
    started: tokio::time::Instant,
    /// Times the attempt for the metrics; taken by its outcome.
    timer: StdMutex<Option<AttemptTimer>>,
    /// The attempt's span (the current one while the attempt runs).
    span: tracing::Span,
}

/// One attempt of a tenant's job in `leasehold_tenant_jobs_running`.
struct TenantRunning(String, crate::metrics::Metrics);

impl TenantRunning {
    fn start(tenant: String, metrics: &crate::metrics::Metrics) -> TenantRunning {
        metrics.tenant_running(&tenant, 1);
        TenantRunning(tenant, metrics.clone())
    }
}

impl Drop for TenantRunning {
    fn drop(&mut self) {
        self.1.tenant_running(&self.0, -1);
    }
}

async fn run_attempt(
    shared: Arc<Shared>,
    claimed: Versioned<JobRecord>,
    ticket: TicketSlot,
    Claimed { reclaim, indexed }: Claimed,
    (stop_tx, mut stop_rx): (mpsc::Sender<Stop>, mpsc::Receiver<Stop>),
) {
    let started = tokio::time::Instant::now();
    let timer = shared.metrics.attempt_started(&claimed.value.kind);
    let rec = claimed.value.clone();
    let id = rec.id.clone();
    let owner = Owner::of(&rec).expect("a claimed record is running");
    let gate = Gate::claimed(shared.jobs.clone(), claimed, owner).with_session(shared.clock());
    if let Some(r) = shared.running.lock().unwrap().get_mut(&id) {
        if r.epoch == rec.epoch {
            r.gate = Some(gate.clone());
        }
    }
    let fence = match claim_marker(&shared, &rec, reclaim).await {
        Marker::Fenced(f) => Some(*f),
        // A newer owner's marker is already there: this claim is stale
        // (the process was paused between its claim and this publish).
        Marker::Stale(e) => {
            timer.finish(AttemptOutcome::OwnershipLost);
            spans::record_error(&tracing::Span::current(), "ownership_lost");
            ownership_lost(&shared, &rec, &e.to_string()).await;
            return;
        }
        Marker::Unpublished => None,
    };
    let indexed = Arc::new(AtomicBool::new(indexed));
    let span = tracing::Span::current();
    let timer = StdMutex::new(Some(timer));
    let Some(fence) = fence else {
        // Without a fence the owner cannot checkpoint safely: give it back.
        let a = Attempt {
            shared: shared.clone(),
            rec,
            gate,
            fence: None,
            ticket,
            indexed,
            started,
            timer,
            span,
        };
        a.finish(End::HandedBack).await;
        return;
    };
    // A reclaim or a retry: the previous attempt's span, one trace.
    if let Some(tp) = fence
        .previous_claim()
        .and_then(|c| c.data_map().get("traceparent").cloned())
        .and_then(|v| v.as_str().map(str::to_string))
    {
        trace::link_to_traceparent(&span, &tp);
    }
    let fence = Arc::new(tokio::sync::Mutex::new(fence));
    let a = Attempt {
        shared: shared.clone(),
        rec: rec.clone(),
        gate: gate.clone(),
        fence: Some(fence.clone()),
        ticket: ticket.clone(),
        indexed: indexed.clone(),
        started,
        timer,
        span,
    };
    // An input kept beside the record (over 16 KiB) that is gone fails the
    // job with the reason: it never runs on an empty value. The payload is
    // read from its stream's leader (`Jobs::get`), so a miss is not a
    // replica lagging behind (review G6) but the payload really gone; and a
    // retry could not help: its fresh ticket would carry the empty input.
    if rec.input_beside && rec.spec.as_ref().is_none_or(|s| s.input.is_empty()) {
        a.finish(End::terminal(
            "the job's input (over 16 KiB, kept beside its record in the payloads bucket) is gone; it is not run on an empty value",
        ))
        .await;
        return;
    }
    let input: Value = rec
        .spec
        .as_ref()
        .and_then(|s| serde_json::from_str(&s.input).ok())
        .unwrap_or(Value::Null);
    let cancel = CancellationToken::new();
    let done = CancellationToken::new();
    let mut watchers = spawn_watchers(&a, stop_tx, &done);

    let Some(handler) = shared.handlers.get(&rec.kind).cloned() else {
        // The claim path never claims a kind this worker does not serve;
        // a record that says otherwise is handed back, never run.
        done.cancel();
        watchers.abort_all();
        tracing::error!(job = %id, kind = %rec.kind, "no handler for this kind here; handing it back");
        a.finish(End::HandedBack).await;
        return;
    };
    let cancel_asked = Arc::new(AtomicBool::new(false));
    let ctx = JobCtx {
        record: rec.clone(),
        input,
        cancel: cancel.clone(),
        cancel_asked: cancel_asked.clone(),
        gate: gate.clone(),
        fence: fence.clone(),
        conn: shared.conn.clone(),
        flow: shared.flow.clone(),
        observer: Arc::new(shared.metrics.clone()),
    };
    // The job's model requests count against its tenant's limits too.
    let tenant =
        leasehold_core::lane::Lane::of(rec.spec.as_ref().unwrap_or(&Default::default())).tenant;
    let _running = TenantRunning::start(tenant.clone(), &shared.metrics);
    let task = tokio::spawn(
        leasehold_flow::with_tenant(tenant, async move { handler.run(ctx).await })
            .instrument(tracing::Span::current()),
    );
    let result = match until_stopped(task, &mut stop_rx, &cancel, &cancel_asked).await {
        Ok(r) => r,
        Err((stop, partial)) => {
            done.cancel();
            watchers.abort_all();
            match stop {
                Stop::Lost(why) => a.lost(&why).await,
                Stop::Cancel => a.finish(End::Cancelled { partial }).await,
                Stop::Handoff => a.finish(End::HandedBack).await,
                Stop::Deadline => {
                    let end = End::retryable(format!(
                        "the attempt ran past --attempt-timeout ({})",
                        leasehold_core::time::format_duration(shared.opts.attempt_timeout)
                    ));
                    a.finish(end).await;
                }
            }
            return;
        }
    };
    done.cancel();
    cancel.cancel();
    watchers.abort_all();
    a.finish(result).await;
}

/// What publishing an attempt's claim marker came to.
enum Marker {
    /// Published: the attempt's fence.
    Fenced(Box<Fence>),
    /// A newer owner's marker is there: the claim is stale.
    Stale(FenceError),
    /// Not published after a few tries (NATS away): the job is handed back.
    Unpublished,
}

/// Publishes the attempt's `claimed` marker, which opens its fence: a few
/// tries, backing off.
async fn claim_marker(shared: &Shared, rec: &JobRecord, reclaim: bool) -> Marker {
    let claimed_data = json!({
        "reclaim": reclaim,
        "attempts": rec.attempts,
        "stale_reclaims": rec.stale_reclaims,
        "ticket_seq": rec.ticket_seq,
        "session": shared.session.id,
        "traceparent": trace::traceparent_of_current_span(),
    });
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(2));
    for _ in 0..5u32 {
        match shared
            .events
            .claim_marker(&rec.id, rec.epoch, &shared.worker_id, claimed_data.clone())
            .await
        {
            Ok(f) => return Marker::Fenced(Box::new(f)),
            Err(e @ FenceError::Lost { .. }) => return Marker::Stale(e),
            Err(e) => {
                tracing::warn!(job = %rec.id, error = %e, "cannot publish the claim marker; retrying");
                tokio::time::sleep(backoff.pause()).await;
            }
        }
    }
    Marker::Unpublished
}

/// Waits for the kind's handler to end, or for a stop. On a stop the
/// handler is cancelled and given 10 s to reach a safe point, then
/// aborted; what it produced before it stopped (a partial report) comes
/// with the stop, for a cancelled job's end.
async fn until_stopped(
    mut task: tokio::task::JoinHandle<End>,
    stop_rx: &mut mpsc::Receiver<Stop>,
    cancel: &CancellationToken,
    cancel_asked: &AtomicBool,
) -> Result<End, (Stop, Option<Box<JobResult>>)> {
    let stop = tokio::select! {
        r = &mut task => return Ok(r.unwrap_or_else(|e| End::retryable(format!("handler panicked: {e}")))),
        s = stop_rx.recv() => s.unwrap_or(Stop::Lost("the attempt's stop channel closed".into())),
    };
    if matches!(stop, Stop::Cancel) {
        cancel_asked.store(true, Ordering::SeqCst);
    }
    cancel.cancel();
    let partial = match tokio::time::timeout(Duration::from_secs(10), &mut task).await {
        Ok(Ok(end)) => end.into_partial(),
        Ok(_) => None,
        Err(_) => {
            task.abort();
            let _ = (&mut task).await;
            None
        }
    };
    Err((stop, partial))
}

/// The index task and the stop watcher of one attempt.
fn spawn_watchers(
    a: &Attempt,
    stop_tx: mpsc::Sender<Stop>,
    done: &CancellationToken,
) -> tokio::task::JoinSet<()> {
    let mut set = tokio::task::JoinSet::new();
    // Index the job once it outlives --index-after, then settle its ticket.
    {
        let (shared, rec, ticket, indexed, done) = (
            a.shared.clone(),
            a.rec.clone(),
            a.ticket.clone(),
            a.indexed.clone(),
            done.clone(),
        );
        set.spawn(async move {
            tokio::select! { _ = tokio::time::sleep(shared.opts.index_after) => {}, _ = done.cancelled() => return }
            let key = Key::of(&rec).expect("running");
            loop {
                match shared.active.put(&key, &rec).await {
                    Ok(()) => break,
                    Err(e) => {
                        tracing::warn!(job = %rec.id, error = %e, "cannot index the job; retrying (its ticket still covers it)");
                        tokio::select! { _ = tokio::time::sleep(Duration::from_secs(1)) => {}, _ = done.cancelled() => return }
                    }
                }
            }
            indexed.store(true, Ordering::Relaxed);
            shared.stats.indexed.fetch_add(1, Ordering::Relaxed);
            // The ticket is acked only while the job is still ours: a task
            // that ran late (a paused process, a slow index write) may hold
            // a delivery that is a new owner's wake-up by now.
            match shared.jobs.get(&rec.id).await {
                Ok(Some(v)) if still_ours(&v.value, &rec) => settle(&ticket, AckKind::Ack).await,
                Ok(_) => {
                    tracing::info!(job = %rec.id, epoch = rec.epoch, "the job moved on before its index write; its ticket is left to the new state");
                    ticket.lock().unwrap().take();
                    let _ = shared.active.remove(&key, &rec).await;
                }
                Err(e) => {
                    tracing::debug!(job = %rec.id, error = %e, "cannot read the record after indexing; the ticket's wake-up settles it");
                }
            }
        });
    }
    // Stops that come from outside the handler.
    {
        let (handoff, cancel_seen, done) =
            (a.shared.handoff.clone(), a.gate.cancel_seen(), done.clone());
        let deadline = a.started + a.shared.opts.attempt_timeout;
        set.spawn(async move {
            let stop = tokio::select! {
                _ = handoff.cancelled() => Stop::Handoff,
                _ = cancel_seen.cancelled() => Stop::Cancel,
                _ = tokio::time::sleep_until(deadline) => Stop::Deadline,
                _ = done.cancelled() => return,
            };
            let _ = stop_tx.send(stop).await;
        });
    }
    set
}
