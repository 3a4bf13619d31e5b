//! The worker service: `Worker::start(shutdown) -> Handle`.
//!
//! Data flow of one ticket:
//! 1. A pull loop per kind reserves free slots first and pulls at most that
//!    many tickets, with a short pull expiry, so a paused worker's pull
//!    cannot hold work hostage for more than one ack wait.
//! 2. The ticket is decoded; a bad one is rejected (record when the id is
//!    known, raw bytes to the DLQ, ticket acked).
//! 3. The claim is a KV create (new job) or a revision-conditioned update
//!    decided by `leasehold_core::machine::decide_claim`; a job that is not
//!    runnable yet is NAKed with exactly the remaining delay.
//! 4. The runner publishes the `claimed` marker (the event fence), then runs
//!    the handler beside a heartbeat task (lease extension through the gate)
//!    and a progress-ack task (keeps the ticket from being redelivered).
//! 5. The outcome is written through the gate; only then is the ticket acked
//!    or NAKed. After ownership is lost the ticket is never touched again.
//!
//! Shutdown has three phases on the shutdown token: stop pulling (tickets
//! still arriving are NAKed at once), let in-flight jobs run for the drain
//! timeout, then hand the rest back (lease released, ticket NAKed without
//! delay) and flush the connection.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::{Duration, SystemTime};

use anyhow::Context as _;
use async_nats::jetstream::{self, AckKind};
use futures::StreamExt;
use leasehold_core::machine::{self, ClaimDecision, Claimant, Owner, TransitionError};
use leasehold_core::retry::RetryPolicy;
use leasehold_core::spec::{self, Kinds, Submission};
use leasehold_core::{JobError, JobRecord};
use leasehold_store::dlq::Dlq;
use leasehold_store::events::{self, Events, Fence, FenceError};
use leasehold_store::work::{self, Work};
use leasehold_store::{setup, Conn, Gate, Jobs, JobsError, Versioned};
use serde_json::{json, Value};
use tokio::sync::{Notify, OwnedSemaphorePermit, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::handler::{self, ErrorClass, Handler, HandlerError, JobCtx, Outcome};
use crate::Options;

/// Counters of one worker process (for tests, the demo and benchmarks).
#[derive(Debug, Default)]
pub struct Stats {
    pub claimed: AtomicU64,
    pub reclaimed: AtomicU64,
    pub completed: AtomicU64,
    pub failed: AtomicU64,
    pub requeued: AtomicU64,
    pub rejected: AtomicU64,
    pub ownership_lost: AtomicU64,
    pub handed_back: AtomicU64,
    pub cancelled: AtomicU64,
}

/// A configured worker, not yet started.
pub struct Worker {
    opts: Options,
    handlers: HashMap<String, Arc<dyn Handler>>,
    kinds: Kinds,
}

/// A running worker.
pub struct Handle {
    pub worker_id: String,
    pub stats: Arc<Stats>,
    join: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Handle {
    /// Waits until the worker has shut down.
    pub async fn wait(self) -> anyhow::Result<()> {
        self.join.await.context("worker task panicked")?
    }
}

impl Worker {
    /// A worker with the built-in handlers.
    pub fn new(opts: Options) -> Self {
        let mut w = Worker {
            opts,
            handlers: HashMap::new(),
            kinds: Kinds::default(),
        };
        for (k, h) in handler::builtins() {
            w.handlers.insert(k, h);
        }
        w
    }

    /// Adds (or replaces) the handler of a kind.
    pub fn with_handler(mut self, kind: &str, h: Arc<dyn Handler>) -> Self {
        self.handlers.insert(kind.to_string(), h);
        self
    }

    /// Connects, verifies the layout, and starts pulling. Stops when
    /// `shutdown` fires (see the module docs for the phases).
    pub async fn start(self, shutdown: CancellationToken) -> anyhow::Result<Handle> {
        let opts = self.opts;
        opts.validate().map_err(anyhow::Error::msg)?;
        let served: Vec<String> = opts
            .kinds
            .iter()
            .filter(|k| self.handlers.contains_key(*k))
            .cloned()
            .collect();
        let unserved: Vec<&String> = opts
            .kinds
            .iter()
            .filter(|k| !self.handlers.contains_key(*k))
            .collect();
        if !unserved.is_empty() {
            tracing::warn!(
                ?unserved,
                "no handler for these kinds in this worker; not serving them"
            );
        }
        anyhow::ensure!(
            !served.is_empty(),
            "none of the kinds {:?} has a handler in this worker",
            opts.kinds
        );
        if opts.concurrency < served.len() {
            tracing::warn!(
                concurrency = opts.concurrency,
                kinds = served.len(),
                "each idle kind keeps one slot for its pending pull: set --concurrency above the number of kinds"
            );
        }
        let worker_id = opts
            .worker_id
            .clone()
            .unwrap_or_else(|| format!("w-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]));
        let incarnation = uuid::Uuid::new_v4().simple().to_string();
        let conn = opts
            .nats
            .connect(&format!("leasehold-worker {worker_id}"))
            .await?;
        setup::ping(&conn.js).await?;
        setup::verify(&conn, &served).await?;
        let work = Work::new(&conn);
        let mut ack_wait = HashMap::new();
        for k in &served {
            ack_wait.insert(k.clone(), work.ack_wait(k).await?);
        }
        tracing::info!(
            worker_id,
            incarnation = %incarnation,
            kinds = ?served,
            concurrency = opts.concurrency,
            lease = ?opts.lease,
            heartbeat = ?opts.heartbeat,
            drain_timeout = ?opts.drain_timeout,
            pull_expires = ?opts.pull_expires,
            max_stale_reclaims = opts.max_stale_reclaims,
            retry = ?opts.retry_policy(),
            ?ack_wait,
            nats = %opts.nats.url,
            prefix = %opts.nats.prefix,
            "worker starting"
        );
        let shared = Arc::new(Shared {
            jobs: Jobs::open(&conn).await?,
            events: Events::new(&conn),
            dlq: Dlq::new(&conn),
            work,
            conn,
            slots: Arc::new(Semaphore::new(opts.concurrency)),
            handlers: self.handlers,
            kinds: self.kinds,
            retry: opts.retry_policy(),
            worker_id: worker_id.clone(),
            incarnation,
            running: StdMutex::new(HashMap::new()),
            idle: Notify::new(),
            handoff: CancellationToken::new(),
            solo: tokio::sync::Mutex::new(()),
            stats: Arc::new(Stats::default()),
            ack_wait,
            opts,
        });
        let stats = shared.stats.clone();
        let gateway = crate::gateway::subscribe(&shared.conn).await?;
        let join = tokio::spawn(run(shared, served, gateway, shutdown));
        Ok(Handle {
            worker_id,
            stats,
            join,
        })
    }
}

struct Shared {
    opts: Options,
    conn: Conn,
    jobs: Jobs,
    events: Events,
    work: Work,
    dlq: Dlq,
    handlers: HashMap<String, Arc<dyn Handler>>,
    kinds: Kinds,
    retry: RetryPolicy,
    worker_id: String,
    /// Unique per process, even under a stable `--worker-id`: recorded in
    /// every claim marker so an operator can tell two processes of one
    /// identity apart (the claim token is what fences them).
    incarnation: String,
    slots: Arc<Semaphore>,
    /// Jobs running in this process, by id.
    running: StdMutex<HashMap<String, Running>>,
    idle: Notify,
    /// Phase 3 of shutdown: hand every running job back.
    handoff: CancellationToken,
    /// One suspect at a time may wait to run alone (see [`go_solo`]).
    solo: tokio::sync::Mutex<()>,
    stats: Arc<Stats>,
    ack_wait: HashMap<String, Duration>,
}

impl Shared {
    /// How often a held ticket gets a progress ack: a third of its
    /// consumer's ack wait, so two can be lost before it is redelivered.
    fn progress_every(&self, kind: &str) -> Duration {
        self.ack_wait
            .get(kind)
            .copied()
            .unwrap_or(Duration::from_secs(30))
            / 3
    }
}

/// The ticket slot of a running job: a redelivery of its ticket to this
/// process replaces the held message, so acks go to the live delivery.
type TicketSlot = Arc<StdMutex<Option<jetstream::Message>>>;

struct Running {
    ticket: TicketSlot,
}

async fn run(
    shared: Arc<Shared>,
    kinds: Vec<String>,
    gateway: crate::gateway::Subscriptions,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let mut loops = JoinSet::new();
    for kind in &kinds {
        loops.spawn(pull_loop(shared.clone(), kind.clone(), shutdown.clone()));
    }
    let gw = crate::gateway::Gateway {
        conn: shared.conn.clone(),
        jobs: shared.jobs.clone(),
        events: shared.events.clone(),
        dlq: shared.dlq.clone(),
        kinds: shared.kinds.clone(),
    };
    let gw = tokio::spawn(crate::gateway::run(gw, gateway, shutdown.clone()));
    if shared.opts.worker_id.is_some() {
        let s = shared.clone();
        tokio::spawn(async move {
            if let Err(e) = restart_reclaim(s).await {
                tracing::warn!(error = %e, "reclaiming this identity's earlier jobs failed; they will be reclaimed after their leases");
            }
        });
    }

    shutdown.cancelled().await;
    tracing::info!(
        "shutdown: stop pulling; draining in-flight jobs for up to {:?}",
        shared.opts.drain_timeout
    );
    let drained = tokio::time::timeout(shared.opts.drain_timeout, wait_idle(&shared))
        .await
        .is_ok();
    if !drained {
        let n = shared.running.lock().unwrap().len();
        tracing::info!(
            jobs = n,
            "shutdown: drain timeout passed; handing jobs back"
        );
    }
    shared.handoff.cancel();
    if tokio::time::timeout(Duration::from_secs(15), wait_idle(&shared))
        .await
        .is_err()
    {
        tracing::warn!("shutdown: some jobs did not hand back in 15s; their leases will expire");
    }
    while loops.join_next().await.is_some() {}
    let _ = gw.await;
    // Plain acks and NAKs are buffered publishes: flush before the client goes.
    let _ = shared.conn.client.flush().await;
    tracing::info!("worker stopped");
    Ok(())
}

async fn wait_idle(shared: &Shared) {
    loop {
        let notified = shared.idle.notified();
        if shared.running.lock().unwrap().is_empty() {
            return;
        }
        notified.await;
    }
}

/// Pulls tickets of one kind, never more than free slots.
///
/// An idle kind keeps one slot reserved for one long poll (expiring after
/// `--pull-expires`); once a ticket arrives, the loop tops up with
/// immediate fetches sized to the slots that are free at that moment, until
/// the queue is drained or the slots are full. So a busy kind fills the
/// worker and each idle kind holds at most one slot.
async fn pull_loop(shared: Arc<Shared>, kind: String, shutdown: CancellationToken) {
    const MAX_BATCH: usize = 64;
    let mut consumer = None;
    while !shutdown.is_cancelled() {
        if consumer.is_none() {
            match shared.work.consumer(&kind).await {
                Ok(c) => consumer = Some(c),
                Err(e) => {
                    tracing::warn!(kind, error = %e, "consumer unavailable; retrying");
                    tokio::select! { _ = tokio::time::sleep(Duration::from_secs(1)) => continue, _ = shutdown.cancelled() => break }
                }
            }
        }
        let c = consumer.as_ref().expect("set above");
        // Reserve the slot before asking: backpressure is explicit.
        let first = tokio::select! {
            p = shared.slots.clone().acquire_owned() => p.expect("semaphore open"),
            _ = shutdown.cancelled() => break,
        };
        let mut permits = vec![first];
        let got = match c
            .batch()
            .max_messages(1)
            .expires(shared.opts.pull_expires)
            .messages()
            .await
        {
            Ok(batch) => take(&shared, batch, &mut permits, &shutdown).await,
            Err(e) => {
                tracing::warn!(kind, error = %e, "pull failed; retrying");
                consumer = None;
                drop(permits);
                tokio::select! { _ = tokio::time::sleep(Duration::from_millis(500)) => continue, _ = shutdown.cancelled() => break }
            }
        };
        if got == 0 {
            continue;
        }
        // Busy: fetch what is queued, as much as free slots allow.
        while !shutdown.is_cancelled() {
            let mut permits = Vec::new();
            while permits.len() < MAX_BATCH {
                match shared.slots.clone().try_acquire_owned() {
                    Ok(p) => permits.push(p),
                    Err(_) => break,
                }
            }
            let want = permits.len();
            if want == 0 {
                break;
            }
            let Ok(batch) = c.fetch().max_messages(want).messages().await else {
                break;
            };
            if take(&shared, batch, &mut permits, &shutdown).await < want {
                break;
            }
        }
    }
}

/// Dispatches the messages of one pull, one reserved slot each; returns how
/// many arrived. After shutdown began, tickets are handed back at once.
async fn take(
    shared: &Arc<Shared>,
    mut batch: async_nats::jetstream::consumer::pull::Batch,
    permits: &mut Vec<OwnedSemaphorePermit>,
    shutdown: &CancellationToken,
) -> usize {
    let mut n = 0;
    while let Some(m) = batch.next().await {
        let Ok(msg) = m else { break };
        n += 1;
        if shutdown.is_cancelled() {
            let _ = msg.ack_with(AckKind::Nak(None)).await;
            continue;
        }
        let permit = permits
            .pop()
            .expect("never more messages than reserved slots");
        tokio::spawn(handle_delivery(shared.clone(), msg, permit));
    }
    n
}

fn header_id(msg: &jetstream::Message) -> Option<String> {
    work::ticket_job_id(msg.headers.as_ref())
}

/// Hands a redelivered ticket to the job already running here, if it is.
fn attach(shared: &Shared, id: &str, msg: &mut Option<jetstream::Message>) -> bool {
    let running = shared.running.lock().unwrap();
    if let Some(r) = running.get(id) {
        *r.ticket.lock().unwrap() = msg.take();
        return true;
    }
    false
}

async fn handle_delivery(
    shared: Arc<Shared>,
    msg: jetstream::Message,
    mut permit: OwnedSemaphorePermit,
) {
    let mut slot = Some(msg);
    let msg = slot.as_ref().expect("set");
    let kind = shared
        .conn
        .layout
        .kind_of_submit_subject(&msg.subject)
        .unwrap_or_default()
        .to_string();
    let seq = msg.info().map(|i| i.stream_sequence).unwrap_or(0);
    let hint = header_id(msg);
    if let Some(id) = &hint {
        if attach(&shared, id, &mut slot) {
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
    };
    let accepted = match spec::decode(sub, &shared.kinds, shared.opts.max_submission_bytes) {
        Ok(a) => a,
        Err(rej) => {
            reject(&shared, &kind, seq, &msg, rej).await;
            return;
        }
    };
    let mut slot = Some(msg);
    if attach(&shared, &accepted.id, &mut slot) {
        return;
    }
    let msg = slot.take().expect("set");
    let mut claimant = Claimant {
        worker_id: &shared.worker_id,
        claim_token: uuid::Uuid::new_v4().to_string(),
        lease: shared.opts.lease,
        now: SystemTime::now(),
        ticket_seq: seq,
        max_stale_reclaims: shared.opts.max_stale_reclaims,
        restart_reclaim: false,
    };
    let mut alone = shared.opts.concurrency <= 1;
    for round in 0..16 {
        claimant.now = SystemTime::now();
        let now = claimant.now;
        // Most tickets are new jobs: try the create first and read only
        // when the record turns out to exist.
        let current = match if round == 0 {
            Ok(None)
        } else {
            shared.jobs.get(&accepted.id).await
        } {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(job = %accepted.id, error = %e, "cannot read the record; retrying the ticket in 1s");
                let _ = msg
                    .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                    .await;
                return;
            }
        };
        let (write, reclaim) = match &current {
            None => {
                let record = machine::claim_new(
                    machine::new_record(&accepted.id, &kind, accepted.spec.clone(), seq, now),
                    &claimant,
                );
                (
                    shared.jobs.create(&record).await.map(|r| (r, record)),
                    false,
                )
            }
            Some(Versioned { value, revision }) => match machine::decide_claim(value, &claimant) {
                // A job that already lost a worker may be what kills workers:
                // run it alone, so its next crash takes no bystander down
                // (whose stale reclaims would otherwise climb with it).
                ClaimDecision::Claim { .. } if value.stale_reclaims >= 1 && !alone => {
                    if go_solo(&shared, &mut permit, &msg, &kind).await {
                        alone = true;
                        continue;
                    }
                    let _ = msg.ack_with(AckKind::Nak(None)).await;
                    return;
                }
                ClaimDecision::Claim { record, reclaim } => (
                    shared
                        .jobs
                        .update(&record, *revision)
                        .await
                        .map(|r| (r, *record)),
                    reclaim,
                ),
                ClaimDecision::Wait(d) => {
                    tracing::debug!(job = %accepted.id, delay = ?d, "not runnable yet; NAK with the remaining delay");
                    let _ = msg
                        .ack_with(AckKind::Nak(Some(d + Duration::from_millis(20))))
                        .await;
                    return;
                }
                ClaimDecision::Poison(d) => {
                    tracing::warn!(job = %accepted.id, stale_reclaims = value.stale_reclaims, "poison job: left to the reaper");
                    let _ = msg.ack_with(AckKind::Nak(Some(d))).await;
                    return;
                }
                ClaimDecision::Drop(why) => {
                    tracing::debug!(job = %accepted.id, why, "ticket has nothing left to do; acking");
                    let _ = msg.ack().await;
                    return;
                }
            },
        };
        match write {
            Ok((revision, record)) => {
                shared.stats.claimed.fetch_add(1, Ordering::Relaxed);
                if reclaim {
                    shared.stats.reclaimed.fetch_add(1, Ordering::Relaxed);
                }
                let claimed = Versioned {
                    value: record,
                    revision,
                };
                run_claimed(shared.clone(), claimed, Some(msg), permit, reclaim).await;
                return;
            }
            Err(JobsError::Exists(_) | JobsError::Conflict(_)) => continue,
            Err(e) => {
                tracing::warn!(job = %accepted.id, error = %e, "claim write failed; retrying the ticket in 1s");
                let _ = msg
                    .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                    .await;
                return;
            }
        }
    }
    let _ = msg
        .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
        .await;
}

/// Takes every slot of this worker for a suspect job (one that already
/// lost a worker), waiting up to one lease for the running jobs to finish
/// while keeping the suspect's ticket from being redelivered. `false` when
/// another suspect is waiting already or the slots did not free up in time:
/// the caller hands the ticket back for another worker.
async fn go_solo(
    shared: &Shared,
    permit: &mut OwnedSemaphorePermit,
    msg: &jetstream::Message,
    kind: &str,
) -> bool {
    let Ok(_one_at_a_time) = shared.solo.try_lock() else {
        return false;
    };
    let want = (shared.opts.concurrency - 1) as u32;
    let every = shared.progress_every(kind);
    let acquire = shared.slots.clone().acquire_many_owned(want);
    tokio::pin!(acquire);
    let deadline = tokio::time::Instant::now() + shared.opts.lease;
    loop {
        tokio::select! {
            p = &mut acquire => {
                let Ok(p) = p else { return false };
                permit.merge(p);
                tracing::info!(subject = %msg.subject, "suspect job: running it alone");
                return true;
            }
            _ = tokio::time::sleep(every) => {
                if tokio::time::Instant::now() >= deadline {
                    return false;
                }
                let _ = msg.ack_with(AckKind::Progress).await;
            }
        }
    }
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
    let message = rej.error.to_string();
    tracing::info!(kind, seq, id = ?rej.id, error = %message, "rejected submission");
    if let Some(id) = &rej.id {
        let rec = machine::rejected_record(id, kind, "rejected", &message, seq, SystemTime::now());
        match shared.jobs.create(&rec).await {
            Ok(_) => {
                let ev = events::event(
                    id,
                    0,
                    "rejected",
                    Some(&shared.worker_id),
                    json!({"error": message, "code": rej.error.code()}),
                );
                let _ = shared
                    .events
                    .publish(&ev, Some(&format!("{id}:rejected:{seq}")))
                    .await;
            }
            // An existing job keeps its record: a bad duplicate must not clobber it.
            Err(JobsError::Exists(_)) => {
                tracing::info!(job = %id, "a job with this id exists; its record is left alone")
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot record the rejection; retrying the ticket");
                let _ = msg
                    .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
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
            &format!("rejected:{kind}:{seq}"),
        )
        .await
    {
        Ok(_) => {
            let _ = msg.ack().await;
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot dead-letter the rejected submission; retrying");
            let _ = msg
                .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                .await;
        }
    }
}

/// At start with a stable identity: take back the jobs an earlier process
/// of this identity held, without waiting for their leases.
async fn restart_reclaim(shared: Arc<Shared>) -> anyhow::Result<()> {
    let mine: Vec<JobRecord> = shared
        .jobs
        .all()
        .await?
        .into_iter()
        .map(|v| v.value)
        .filter(|r| {
            r.status == "running"
                && r.worker_id.as_deref() == Some(shared.worker_id.as_str())
                && shared.handlers.contains_key(&r.kind)
        })
        .collect();
    for rec in mine {
        if shared.running.lock().unwrap().contains_key(&rec.id) {
            continue;
        }
        // A job that already lost a worker before runs alone (see go_solo).
        let slots = if rec.stale_reclaims >= 1 {
            shared.opts.concurrency as u32
        } else {
            1
        };
        let permit = shared.slots.clone().acquire_many_owned(slots).await?;
        let claimant = Claimant {
            worker_id: &shared.worker_id,
            claim_token: uuid::Uuid::new_v4().to_string(),
            lease: shared.opts.lease,
            now: SystemTime::now(),
            ticket_seq: 0,
            max_stale_reclaims: shared.opts.max_stale_reclaims,
            restart_reclaim: true,
        };
        let res = shared
            .jobs
            .transition(&rec.id, |cur| {
                if cur.worker_id.as_deref() != Some(shared.worker_id.as_str())
                    || cur.status != "running"
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
            Ok(v) if v.value.claim_token.as_deref() == Some(claimant.claim_token.as_str()) => {
                tracing::info!(job = %rec.id, epoch = v.value.epoch, "reclaimed at start from an earlier process of this identity");
                shared.stats.claimed.fetch_add(1, Ordering::Relaxed);
                shared.stats.reclaimed.fetch_add(1, Ordering::Relaxed);
                tokio::spawn(run_claimed(shared.clone(), v, None, permit, true));
            }
            Err(e) => tracing::warn!(job = %rec.id, error = %e, "restart reclaim failed"),
            _ => {}
        }
    }
    Ok(())
}

/// Why a running attempt must stop before its handler finished.
#[derive(Debug, Clone)]
enum Stop {
    Lost(String),
    Cancel,
    Handoff,
}

/// Runs one claimed job to an owner-checked outcome.
async fn run_claimed(
    shared: Arc<Shared>,
    claimed: Versioned<JobRecord>,
    msg: Option<jetstream::Message>,
    permit: OwnedSemaphorePermit,
    reclaim: bool,
) {
    let id = claimed.value.id.clone();
    let ticket: TicketSlot = Arc::new(StdMutex::new(msg));
    shared.running.lock().unwrap().insert(
        id.clone(),
        Running {
            ticket: ticket.clone(),
        },
    );
    run_attempt(&shared, claimed, ticket, reclaim).await;
    {
        let mut running = shared.running.lock().unwrap();
        running.remove(&id);
    }
    drop(permit);
    shared.idle.notify_waiters();
}

async fn run_attempt(
    shared: &Arc<Shared>,
    claimed: Versioned<JobRecord>,
    ticket: TicketSlot,
    reclaim: bool,
) {
    let rec = claimed.value.clone();
    let id = rec.id.clone();
    let owner = Owner::of(&rec).expect("a claimed record is running");
    let gate = Gate::claimed(shared.jobs.clone(), claimed, owner);
    let claimed_data = json!({
        "reclaim": reclaim,
        "attempts": rec.attempts,
        "stale_reclaims": rec.stale_reclaims,
        "ticket_seq": rec.ticket_seq,
        "incarnation": shared.incarnation,
    });
    let mut fence = None;
    for i in 0..5u32 {
        match shared
            .events
            .claim_marker(&id, rec.epoch, &shared.worker_id, claimed_data.clone())
            .await
        {
            Ok(f) => {
                fence = Some(f);
                break;
            }
            // A newer owner's marker is already there: this claim is stale
            // (the process was paused between its claim and this publish).
            Err(e @ FenceError::Lost { .. }) => {
                ownership_lost(shared, &rec, &e.to_string()).await;
                return;
            }
            Err(e) => {
                tracing::warn!(job = %id, error = %e, "cannot publish the claim marker; retrying");
                tokio::time::sleep(Duration::from_millis(100 << i)).await;
            }
        }
    }
    let Some(fence) = fence else {
        // Without a fence the owner cannot checkpoint safely: give it back.
        hand_back(shared, &gate, &ticket).await;
        return;
    };
    let fence = Arc::new(tokio::sync::Mutex::new(fence));
    let input: Value = rec
        .spec
        .as_ref()
        .and_then(|s| serde_json::from_str(&s.input).ok())
        .unwrap_or(Value::Null);
    let cancel = CancellationToken::new();
    let done = CancellationToken::new();
    let (stop_tx, mut stop_rx) = tokio::sync::mpsc::channel::<Stop>(4);

    // Heartbeat: extends the lease through the gate; notices cancellation
    // requests and lost ownership.
    {
        let (gate, done, stop_tx, lease, every) = (
            gate.clone(),
            done.clone(),
            stop_tx.clone(),
            shared.opts.lease,
            shared.opts.heartbeat,
        );
        tokio::spawn(async move {
            loop {
                tokio::select! { _ = tokio::time::sleep(every) => {}, _ = done.cancelled() => return }
                match gate.heartbeat(lease).await {
                    Ok(v) if v.value.cancel_requested => {
                        let _ = stop_tx.send(Stop::Cancel).await;
                        return;
                    }
                    Ok(_) => {}
                    Err(e) if e.is_ownership_lost() => {
                        let _ = stop_tx.send(Stop::Lost(e.to_string())).await;
                        return;
                    }
                    Err(e) => {
                        tracing::warn!(job = %gate.id, error = %e, "heartbeat failed; retrying at the next interval")
                    }
                }
            }
        });
    }
    // Progress acks: keep the ticket from being redelivered while we work.
    {
        let (ticket, done, client) = (ticket.clone(), done.clone(), shared.conn.client.clone());
        let every = shared.progress_every(&rec.kind);
        tokio::spawn(async move {
            loop {
                tokio::select! { _ = tokio::time::sleep(every) => {}, _ = done.cancelled() => return }
                let reply = ticket
                    .lock()
                    .unwrap()
                    .as_ref()
                    .and_then(|m| m.reply.clone());
                if let Some(reply) = reply {
                    // Fire-and-forget +WPI, as `ack_with(Progress)` does,
                    // without holding the slot's lock across an await.
                    let _ = client.publish(reply, "+WPI".into()).await;
                }
            }
        });
    }
    // Handoff at shutdown.
    {
        let (handoff, done, stop_tx) = (shared.handoff.clone(), done.clone(), stop_tx.clone());
        tokio::spawn(async move {
            tokio::select! { _ = handoff.cancelled() => { let _ = stop_tx.send(Stop::Handoff).await; }, _ = done.cancelled() => {} }
        });
    }
    drop(stop_tx);

    let handler = shared
        .handlers
        .get(&rec.kind)
        .cloned()
        .expect("served kinds have handlers");
    let ctx = JobCtx {
        record: rec.clone(),
        input,
        cancel: cancel.clone(),
        gate: gate.clone(),
        fence: fence.clone(),
        conn: shared.conn.clone(),
    };
    let mut task = tokio::spawn(async move { handler.run(ctx).await });
    let result = tokio::select! {
        r = &mut task => Ok(r.unwrap_or_else(|e| Err(HandlerError::retryable(format!("handler panicked: {e}"))))),
        s = stop_rx.recv() => Err(s.unwrap_or(Stop::Lost("heartbeat task ended".into()))),
    };
    let result = match result {
        Ok(r) => r,
        Err(stop) => {
            cancel.cancel();
            // Give the handler a moment to reach a safe point, then abort it.
            if tokio::time::timeout(Duration::from_secs(10), &mut task)
                .await
                .is_err()
            {
                task.abort();
            }
            done.cancel();
            match stop {
                Stop::Lost(why) => ownership_lost(shared, &rec, &why).await,
                Stop::Cancel => {
                    if persist(shared, &gate, machine::cancel_owned).await.is_ok() {
                        shared.stats.cancelled.fetch_add(1, Ordering::Relaxed);
                        let _ = fence.lock().await.publish("cancelled", json!({})).await;
                        settle(&ticket, AckKind::Ack).await;
                    }
                }
                Stop::Handoff => hand_back(shared, &gate, &ticket).await,
            }
            return;
        }
    };
    done.cancel();
    cancel.cancel();
    let fence = &fence;
    match result {
        Ok(Outcome::Completed(res)) => {
            let out = res.clone();
            match persist(shared, &gate, move |r, o, now| {
                machine::complete(r, o, now, out.clone())
            })
            .await
            {
                Ok(_) => {
                    shared.stats.completed.fetch_add(1, Ordering::Relaxed);
                    let ev = events::event(
                        &id,
                        rec.epoch,
                        "completed",
                        Some(&shared.worker_id),
                        json!({"partial": res.partial, "artifact": res.artifact, "digest": res.digest}),
                    );
                    let _ = fence
                        .lock()
                        .await
                        .publish_event(&ev, Some(&format!("{id}:completed")))
                        .await;
                    settle(&ticket, AckKind::Ack).await;
                }
                Err(e) => refused(shared, &rec, "completion", e).await,
            }
        }
        Ok(Outcome::Parked { reason, message }) => {
            let (r2, m2) = (reason.clone(), message.clone());
            match persist(shared, &gate, move |r, o, now| {
                machine::park(r, o, now, &r2, &m2)
            })
            .await
            {
                Ok(_) => {
                    let _ = fence
                        .lock()
                        .await
                        .publish("parked", json!({"reason": reason, "message": message}))
                        .await;
                    settle(&ticket, AckKind::Ack).await;
                }
                Err(e) => refused(shared, &rec, "parking", e).await,
            }
        }
        Err(err) => job_error(shared, &rec, &gate, fence, &ticket, err).await,
    }
}

/// A failed attempt: requeue with backoff while the budget lasts, else fail.
async fn job_error(
    shared: &Arc<Shared>,
    rec: &JobRecord,
    gate: &Gate,
    fence: &tokio::sync::Mutex<Fence>,
    ticket: &TicketSlot,
    err: HandlerError,
) {
    let policy = shared.retry.for_spec(rec.spec.as_ref());
    let failed = rec.attempts + 1;
    let now = SystemTime::now();
    let at = leasehold_core::time::rfc3339(now);
    let retry = err.class == ErrorClass::Retryable && policy.allows_another(failed);
    if retry {
        let delay = policy.delay(rec.attempts, &mut rand::thread_rng());
        let _ = fence
            .lock()
            .await
            .publish(
                "retry",
                json!({"scope": "job", "reason": err.message, "eligible": true, "retained": "completed checkpoints", "attempt": failed, "budget_left": policy.max_attempts - failed, "delay_ms": delay.as_millis() as u64}),
            )
            .await;
        let error = JobError {
            class: "retryable".into(),
            message: err.message.clone(),
            at,
        };
        match persist(shared, gate, move |r, o, now| {
            machine::requeue(r, o, now, error.clone(), delay)
        })
        .await
        {
            Ok(_) => {
                shared.stats.requeued.fetch_add(1, Ordering::Relaxed);
                settle(ticket, AckKind::Nak(Some(delay))).await;
            }
            Err(e) => refused(shared, rec, "requeue", e).await,
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
        match persist(shared, gate, move |r, o, now| {
            machine::fail(r, o, now, error.clone())
        })
        .await
        {
            Ok(_) => {
                shared.stats.failed.fetch_add(1, Ordering::Relaxed);
                let ev = events::event(
                    &rec.id,
                    rec.epoch,
                    "failed",
                    Some(&shared.worker_id),
                    json!({"class": class, "message": message, "attempts": failed}),
                );
                let _ = fence
                    .lock()
                    .await
                    .publish_event(&ev, Some(&format!("{}:failed", rec.id)))
                    .await;
                settle(ticket, AckKind::Ack).await;
            }
            Err(e) => refused(shared, rec, "failure", e).await,
        }
    }
}

/// Writes through the gate, retrying transient NATS errors for up to one
/// lease (after that another worker may own the job anyway).
async fn persist<F>(shared: &Shared, gate: &Gate, f: F) -> Result<Versioned<JobRecord>, JobsError>
where
    F: Fn(&JobRecord, &Owner, SystemTime) -> Result<JobRecord, TransitionError>,
{
    let deadline = tokio::time::Instant::now() + shared.opts.lease;
    let mut pause = Duration::from_millis(50);
    loop {
        match gate.write(&f).await {
            Err(e) if e.is_transient() && tokio::time::Instant::now() < deadline => {
                tracing::warn!(job = %gate.id, error = %e, "owner write failed; retrying");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            other => return other,
        }
    }
}

async fn refused(shared: &Shared, rec: &JobRecord, what: &str, e: JobsError) {
    if e.is_ownership_lost() {
        ownership_lost(shared, rec, &format!("{what} refused: {e}")).await;
    } else {
        tracing::error!(job = %rec.id, error = %e, "{what} could not be written; the lease will expire and another worker resumes");
    }
}

/// Ownership is gone: stop, say so, and never touch the ticket again.
async fn ownership_lost(shared: &Shared, rec: &JobRecord, why: &str) {
    shared.stats.ownership_lost.fetch_add(1, Ordering::Relaxed);
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

async fn hand_back(shared: &Shared, gate: &Gate, ticket: &TicketSlot) {
    match gate.write(machine::hand_back).await {
        Ok(_) => {
            shared.stats.handed_back.fetch_add(1, Ordering::Relaxed);
            tracing::info!(job = %gate.id, "handed back");
            settle(ticket, AckKind::Nak(None)).await;
        }
        Err(e) if e.is_ownership_lost() => {
            tracing::info!(job = %gate.id, "not handed back: ownership already lost")
        }
        Err(e) => {
            tracing::warn!(job = %gate.id, error = %e, "hand back failed; the lease will expire")
        }
    }
}

/// Acks or NAKs the live delivery of the ticket, if this process holds one.
async fn settle(ticket: &TicketSlot, kind: AckKind) {
    let m = ticket.lock().unwrap().take();
    if let Some(m) = m {
        if let Err(e) = m.ack_with(kind).await {
            tracing::warn!(error = %e, "ack failed; the ticket will be redelivered and dropped");
        }
    }
}
