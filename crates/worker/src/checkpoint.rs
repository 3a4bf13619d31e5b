//! The per-attempt checkpoint flusher: the single background path of a
//! kind's checkpoints (the research workload's sections, journal entries,
//! retry reports and progress; any SDK kind's through `Ctx::checkpoints`).
//!
//! Callers hand items to an unbounded channel and go on: a section
//! completion never waits on persistence. The flusher task takes everything
//! queued at once, publishes the events in order through the owner's fence,
//! coalesces all progress updates of the batch into one `progress` event and
//! one gate write of the record (`progress`, `resume_from`, `budget_used`),
//! and only then answers barriers.
//!
//! Transient failures (NATS did not answer, a KV conflict) are retried with
//! capped exponential backoff and jitter until the job's token fires. A fence
//! refusal ([`FenceError::Lost`]) or an ownership error of the gate means a
//! newer owner exists: the flusher cancels the job's token and drops
//! everything still queued, so a stale owner's checkpoints never land.
//!
//! What a crash can lose: the items queued and not yet published, i.e. at
//! most what completed since the last flush (typically milliseconds of work).
//! Recovery redoes exactly those.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use leasehold_core::machine::check_owner;
use leasehold_proto::{BudgetUsed, Progress};
use leasehold_store::events::{Fence, FenceError};
use leasehold_store::Gate;
use rand::Rng;
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, Mutex};
use tokio_util::sync::CancellationToken;

/// A progress snapshot (the record's `progress`, `resume_from` and
/// `budget_used`, and a `progress` event); the latest in a batch wins.
///
/// ```
/// let p = leasehold_worker::checkpoint::ProgressUpdate {
///     phase: "experts".into(),
///     sections_done: 3,
///     sections_total: 12,
///     ..Default::default()
/// };
/// assert_eq!(p.skipped, 0);
/// ```
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ProgressUpdate {
    /// What the job is doing (`outline`, `experts`, ...).
    pub phase: String,
    /// Units of work done (sections, steps).
    pub sections_done: u32,
    /// Units of work in all.
    pub sections_total: u32,
    /// Units given up (written as skipped).
    pub skipped: u32,
    /// Where a later attempt would resume (the record's `resume_from`).
    pub resume_from: String,
    /// The budget used so far (the record's `budget_used`).
    pub budget: BudgetUsed,
}

enum Item {
    Event { ty: &'static str, data: Value },
    Progress(ProgressUpdate),
    Barrier(oneshot::Sender<bool>),
}

/// Counters of the flusher (for the bench and logs).
#[derive(Debug, Default)]
pub struct FlushStats {
    /// Events made durable.
    pub events: AtomicU64,
    /// Progress snapshots queued.
    pub progress_updates: AtomicU64,
    /// Progress snapshots written (after coalescing).
    pub progress_writes: AtomicU64,
    /// Flush rounds.
    pub batches: AtomicU64,
    /// Per published event, microseconds from queued to durable (the
    /// server's ack): how long a completion stays losable. One entry per
    /// event of the attempt, so bounded by the job's size.
    pub latencies_us: std::sync::Mutex<Vec<u32>>,
    /// Retry reports queued by this attempt (for the recovery appendix).
    retries: std::sync::Mutex<Retries>,
    /// Bytes of the job's events this attempt read to resume.
    pub events_read_bytes: AtomicU64,
}

/// The retries an attempt reported, by scope.
#[derive(Debug, Default, Clone)]
pub struct Retries {
    /// Retries by their `scope` (`generation`, `warm`, `cold`, ...).
    pub by_scope: std::collections::BTreeMap<String, u32>,
    /// Retries the policy refused (`eligible: false`).
    pub refused: u32,
}

impl FlushStats {
    fn count_retry(&self, data: &Value) {
        let mut r = self.retries.lock().expect("retries lock");
        if data.get("eligible").and_then(Value::as_bool) == Some(false) {
            r.refused += 1;
        } else {
            let scope = data.get("scope").and_then(Value::as_str).unwrap_or("?");
            *r.by_scope.entry(scope.to_string()).or_default() += 1;
        }
    }

    /// The retries queued so far.
    pub fn retries(&self) -> Retries {
        self.retries.lock().expect("retries lock").clone()
    }

    /// The counters and the flush latency's p50/p99/max, as JSON (the
    /// completed result's `output.checkpoints`, read by `make bench`).
    pub fn summary(&self) -> Value {
        let mut l = self
            .latencies_us
            .lock()
            .map(|v| v.clone())
            .unwrap_or_default();
        l.sort_unstable();
        let q = |q: f64| {
            l.get(((l.len().saturating_sub(1)) as f64 * q).round() as usize)
                .copied()
                .unwrap_or(0)
        };
        let updates = self.progress_updates.load(Ordering::Relaxed);
        let writes = self.progress_writes.load(Ordering::Relaxed);
        json!({
            "events": self.events.load(Ordering::Relaxed),
            "batches": self.batches.load(Ordering::Relaxed),
            "progress_updates": updates,
            "progress_writes": writes,
            "events_read_bytes": self.events_read_bytes.load(Ordering::Relaxed),
            "flush_latency_us": {"n": l.len(), "p50": q(0.5), "p99": q(0.99), "max": q(1.0)},
        })
    }
}

/// The sending side; cheap to clone, usable from sync code (hooks).
#[derive(Clone)]
pub struct Flusher {
    tx: mpsc::UnboundedSender<(u64, Instant, Item)>,
    queued: Arc<AtomicU64>,
    published: Arc<AtomicU64>,
    lost: Arc<AtomicBool>,
    refused: Arc<std::sync::Mutex<Option<String>>>,
    /// Event types `event` refuses (the runtime's own).
    reserved: &'static [&'static str],
    /// Its counters.
    pub stats: Arc<FlushStats>,
}

/// What the flusher's task shares with the senders, without a sender of its
/// own: once every [`Flusher`] is dropped the channel closes and the task
/// ends by itself (and [`Flusher::start`]'s handle aborts it when dropped).
struct Shared {
    published: Arc<AtomicU64>,
    lost: Arc<AtomicBool>,
    /// Why the event stream refused a checkpoint for good, if it did: the
    /// attempt stops (nothing after it may be persisted out of order).
    refused: Arc<std::sync::Mutex<Option<String>>>,
    stats: Arc<FlushStats>,
    /// Where each flush is counted.
    observer: Arc<dyn leasehold_telemetry::observe::Observer>,
}

impl Shared {
    fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }
    /// Lost, or a checkpoint refused: nothing more is persisted.
    fn is_stopped(&self) -> bool {
        self.is_lost() || self.refused.lock().map_or(true, |r| r.is_some())
    }
}

/// The flusher was told ownership is lost.
#[derive(Debug, Clone, Copy, thiserror::Error)]
#[error("ownership lost: checkpoints refused")]
pub struct Lost;

impl Flusher {
    /// Starts the task. `cancel` is the job's token, fired on lost ownership.
    /// The task never outlives its attempt: it ends when the last
    /// [`Flusher`] is dropped, and dropping the returned handle aborts it
    /// (an attempt aborted past its stop timeout drops both).
    pub fn start(
        fence: Arc<Mutex<Fence>>,
        gate: Gate,
        cancel: CancellationToken,
    ) -> (Flusher, tokio_util::task::AbortOnDropHandle<()>) {
        let none = leasehold_telemetry::observe::none();
        Self::start_checked(fence, gate, cancel, &[], none)
    }

    /// [`Flusher::start`], refusing events of the `reserved` types and
    /// counting its flushes in `observer` (the worker's metrics: `JobCtx::observer`).
    pub fn start_checked(
        fence: Arc<Mutex<Fence>>,
        gate: Gate,
        cancel: CancellationToken,
        reserved: &'static [&'static str],
        observer: Arc<dyn leasehold_telemetry::observe::Observer>,
    ) -> (Flusher, tokio_util::task::AbortOnDropHandle<()>) {
        let (tx, rx) = mpsc::unbounded_channel();
        let f = Flusher {
            tx,
            queued: Arc::new(AtomicU64::new(0)),
            published: Arc::new(AtomicU64::new(0)),
            lost: Arc::new(AtomicBool::new(false)),
            refused: Arc::default(),
            reserved,
            stats: Arc::new(FlushStats::default()),
        };
        let shared = Shared {
            published: f.published.clone(),
            lost: f.lost.clone(),
            refused: f.refused.clone(),
            stats: f.stats.clone(),
            observer,
        };
        let task = tokio::spawn(run(shared, rx, fence, gate, cancel));
        (f, tokio_util::task::AbortOnDropHandle::new(task))
    }

    fn push(&self, item: Item) -> u64 {
        let n = self.queued.fetch_add(1, Ordering::SeqCst) + 1;
        // A closed channel means the job is over; nothing left to persist.
        let _ = self.tx.send((n, Instant::now(), item));
        n
    }

    /// Queues an event; returns its ticket (see [`Flusher::published`]).
    /// An event of a reserved type is dropped with an error log.
    ///
    /// ```no_run
    /// # fn f(cp: &leasehold_worker::checkpoint::Flusher) {
    /// let ticket = cp.event("chapter", serde_json::json!({"n": 1}));
    /// # }
    /// ```
    pub fn event(&self, ty: &'static str, data: Value) -> u64 {
        if self.reserved.contains(&ty) {
            tracing::error!(
                ty,
                "checkpoint of a type the runtime writes itself: dropped (use a name of your own)"
            );
            return self.queued.load(Ordering::SeqCst);
        }
        if ty == "retry" {
            self.stats.count_retry(&data);
        }
        self.push(Item::Event { ty, data })
    }

    /// Queues a progress snapshot (coalesced with the others of its batch).
    ///
    /// ```no_run
    /// # fn f(cp: &leasehold_worker::checkpoint::Flusher) {
    /// cp.progress(leasehold_worker::checkpoint::ProgressUpdate {
    ///     phase: "chapters".into(), sections_done: 1, sections_total: 4, ..Default::default()
    /// });
    /// # }
    /// ```
    pub fn progress(&self, p: ProgressUpdate) {
        self.stats.progress_updates.fetch_add(1, Ordering::Relaxed);
        self.push(Item::Progress(p));
    }

    /// Why the event stream refused a checkpoint for good, if it did.
    pub fn refused(&self) -> Option<String> {
        self.refused.lock().ok().and_then(|r| r.clone())
    }

    /// The highest ticket whose item is durable.
    pub fn published(&self) -> u64 {
        self.published.load(Ordering::SeqCst)
    }

    /// Whether a newer owner refused a checkpoint (the job's token fired).
    pub fn is_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    /// Waits until everything queued before it is durable; `Err(Lost)` when
    /// a newer owner refused a checkpoint (stop: nothing more lands).
    ///
    /// ```no_run
    /// # async fn f(cp: &leasehold_worker::checkpoint::Flusher) -> Result<(), leasehold_worker::checkpoint::Lost> {
    /// cp.event("chapter", serde_json::json!({"n": 1}));
    /// cp.barrier().await?; // chapter 1 is durable
    /// # Ok(()) }
    /// ```
    pub async fn barrier(&self) -> Result<(), Lost> {
        let (tx, rx) = oneshot::channel();
        self.push(Item::Barrier(tx));
        match rx.await {
            Ok(true) => Ok(()),
            _ => Err(Lost),
        }
    }

    /// Blocks the calling thread until ticket `n` is durable (crash hooks in
    /// sync callbacks only; needs the multi-threaded runtime).
    pub fn block_until_published(&self, n: u64, timeout: Duration) {
        let deadline = std::time::Instant::now() + timeout;
        let wait = || {
            while self.published() < n
                && !self.is_lost()
                && self.refused().is_none()
                && std::time::Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(2));
            }
        };
        if tokio::runtime::Handle::try_current()
            .map(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread)
            .unwrap_or(false)
        {
            tokio::task::block_in_place(wait);
        } else {
            wait();
        }
    }
}

fn backoff(attempt: u32) -> Duration {
    let ceiling = leasehold_core::retry::capped_exponential(
        Duration::from_millis(50),
        Duration::from_millis(2000),
        attempt,
    )
    .as_millis() as u64;
    Duration::from_millis(rand::thread_rng().gen_range(ceiling / 2..=ceiling))
}

async fn run(
    f: Shared,
    mut rx: mpsc::UnboundedReceiver<(u64, Instant, Item)>,
    fence: Arc<Mutex<Fence>>,
    gate: Gate,
    cancel: CancellationToken,
) {
    let mut last_written: Option<ProgressUpdate> = None;
    while let Some(first) = rx.recv().await {
        let mut batch = vec![first];
        while let Ok(more) = rx.try_recv() {
            batch.push(more);
        }
        f.stats.batches.fetch_add(1, Ordering::Relaxed);
        let started = Instant::now();
        let mut durable = 0usize;
        let mut wrote = false;
        let top = batch.last().map_or(0, |(n, _, _)| *n);
        let mut progress: Option<ProgressUpdate> = None;
        let mut barriers = Vec::new();
        for (n, queued, item) in batch {
            match item {
                Item::Barrier(tx) => barriers.push(tx),
                Item::Progress(p) => progress = Some(p),
                Item::Event { ty, data } => {
                    if !f.is_stopped() && publish(&f, &fence, &cancel, ty, &data).await {
                        f.stats.events.fetch_add(1, Ordering::Relaxed);
                        durable += 1;
                        let us = u32::try_from(queued.elapsed().as_micros()).unwrap_or(u32::MAX);
                        if let Ok(mut l) = f.stats.latencies_us.lock() {
                            l.push(us);
                        }
                        f.published.fetch_max(n, Ordering::SeqCst);
                    }
                }
            }
        }
        if let Some(p) = progress.filter(|p| Some(p) != last_written.as_ref()) {
            if !f.is_stopped() {
                write_progress(&f, &fence, &gate, &cancel, &p).await;
                last_written = Some(p);
                wrote = true;
            }
        }
        // Only what was persisted counts as published: waiters on a dropped
        // item see the loss or the refusal instead.
        let ok = !f.is_stopped();
        if ok {
            f.published.fetch_max(top, Ordering::SeqCst);
        }
        if ok && (durable > 0 || wrote) {
            f.observer.checkpoint_flush(started.elapsed(), durable);
        }
        for b in barriers {
            let _ = b.send(ok);
        }
    }
}

fn mark_lost(f: &Shared, cancel: &CancellationToken, why: &str) {
    if !f.lost.swap(true, Ordering::SeqCst) {
        tracing::warn!(why, "checkpoint refused: ownership lost, stopping the job");
    }
    cancel.cancel();
}

/// Publishes one event under the fence, retrying what may pass later;
/// whether it was persisted.
async fn publish(
    f: &Shared,
    fence: &Mutex<Fence>,
    cancel: &CancellationToken,
    ty: &str,
    data: &Value,
) -> bool {
    let mut attempt = 0;
    loop {
        let res = fence.lock().await.publish(ty, data.clone()).await;
        match res {
            Ok(_) => return true,
            Err(FenceError::Lost { .. }) => {
                mark_lost(f, cancel, "fence");
                return false;
            }
            Err(FenceError::Refused(e)) => {
                // Retrying cannot help; the attempt stops and the job is
                // retried later (by then the stream may have room).
                tracing::warn!(ty, error = %e, "checkpoint refused by the event stream; stopping the attempt");
                if let Ok(mut r) = f.refused.lock() {
                    r.get_or_insert(e);
                }
                cancel.cancel();
                return false;
            }
            Err(FenceError::Nats(e)) => {
                attempt += 1;
                tracing::warn!(ty, attempt, error = %e, "checkpoint publish failed; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(backoff(attempt)) => {}
                    // The job is over (cancelled, handed back): give up.
                    _ = cancel.cancelled() => return false,
                }
            }
        }
    }
}

async fn write_progress(
    f: &Shared,
    fence: &Mutex<Fence>,
    gate: &Gate,
    cancel: &CancellationToken,
    p: &ProgressUpdate,
) {
    publish(
        f,
        fence,
        cancel,
        "progress",
        &json!({"phase": p.phase, "sections_done": p.sections_done, "sections_total": p.sections_total, "skipped": p.skipped}),
    )
    .await;
    if f.is_lost() {
        return;
    }
    let mut attempt = 0;
    loop {
        let res = gate
            .write(|rec, owner, _now| {
                check_owner(rec, owner)?;
                let mut r = rec.clone();
                r.progress = Some(Progress {
                    phase: p.phase.clone(),
                    sections_done: p.sections_done,
                    sections_total: p.sections_total,
                    skipped: p.skipped,
                });
                r.resume_from = Some(p.resume_from.clone());
                r.budget_used = Some(p.budget);
                Ok(r)
            })
            .await;
        match res {
            Ok(_) => {
                f.stats.progress_writes.fetch_add(1, Ordering::Relaxed);
                return;
            }
            Err(e) if e.is_ownership_lost() => return mark_lost(f, cancel, "record"),
            Err(e) => {
                attempt += 1;
                if attempt > 5 {
                    // The record is advisory for resume; events are the truth.
                    tracing::warn!(error = %e, "progress write failed; keeping the next one");
                    return;
                }
                tokio::select! {
                    _ = tokio::time::sleep(backoff(attempt)) => {}
                    _ = cancel.cancelled() => return,
                }
            }
        }
    }
}
