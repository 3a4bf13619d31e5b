//! The worker service: `Worker::start(shutdown) -> Handle`.
//!
//! One claimed job passes through four concepts, one file each:
//! - [`pull`]: pull loops that never ask for more tickets than free slots.
//! - [`claim`]: a delivered ticket becomes a claim (a KV create or a
//!   revision-conditioned update decided by `machine::decide_claim`), a
//!   rejection, a settled ticket (the job is held by a live owner), or a NAK
//!   with exactly the remaining delay; and the reclaim at start of the jobs an
//!   earlier process of this identity held.
//! - [`attempt`]: one attempt: the `claimed` marker (the event fence), the
//!   handler, the index entry once the job outlives `--index-after`, the
//!   stops (cancel, lost ownership, hand-back, deadline), and the
//!   owner-checked outcome.
//! - [`session`]: the process's liveness: one session key renewed every
//!   `--session-renew` with a server-side TTL, the answers to pings and
//!   cancel notifications, and what to do when the session was lost.
//!
//! Tickets are wake-up calls, not hostages: a claimed job's ticket comes
//! back by itself one session timeout after the claim (a NAK with that
//! delay, or the consumer's ack wait when that is as long: no message at
//! all) only if the job neither finished nor was indexed by then; a job that
//! outlives `--index-after` is indexed under its owner and its ticket acked.
//! From then on the job's liveness is its owner's session alone, and a
//! ticket that reaches a worker while the owner lives is settled at once.
//! No progress acks, no per-job heartbeat writes, and recovery never waits
//! for the consumer's ack wait.
//!
//! Shutdown has three phases on the shutdown token: stop pulling (tickets
//! still arriving are NAKed at once), let in-flight jobs run for the drain
//! timeout, then hand the rest back; finally the session key is deleted, so
//! anything left is recovered at once rather than after the timeout. The
//! hand-back and the session's end together get `--hand-back-timeout`:
//! with NATS away or hanging, the worker stops then anyway, with an error
//! naming the jobs it could not hand back (its session's end or TTL
//! recovers them).

mod attempt;
pub(crate) mod claim;
mod pull;
mod refuse;
mod restart;
mod session;

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use crate::metrics::Metrics;
use anyhow::Context as _;
use leasehold_core::retry::RetryPolicy;
use leasehold_core::spec::Kinds;
use leasehold_core::time::human_duration;
use leasehold_store::dlq::Dlq;
use leasehold_store::events::Events;
use leasehold_store::index::Active;
use leasehold_store::recovery::{self, Recovery};
use leasehold_store::sessions::{SessionClock, Sessions};
use leasehold_store::work::Work;
use leasehold_store::{retry_unavailable, setup, Conn, Jobs};
use leasehold_telemetry::Readiness;
use tokio::sync::{Notify, Semaphore};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

use crate::handler::Handler;
use crate::Options;

pub(crate) use attempt::Stop;

/// Counters of one worker process that Prometheus does not carry. Claims,
/// rejections, outcomes and renewals are counted once, in the worker's
/// [`Metrics`] families: read them with [`Metrics::total`].
#[derive(Debug, Default)]
pub struct Stats {
    /// Tickets acked at once because a live owner held their job.
    pub settled: AtomicU64,
    /// Jobs entered in the index of active jobs by their owner.
    pub indexed: AtomicU64,
    /// Times the session key was found gone and written again.
    pub session_restored: AtomicU64,
}

/// A configured worker, not yet started.
pub struct Worker {
    opts: Options,
    handlers: HashMap<String, Arc<dyn Handler>>,
    kinds: Kinds,
    metrics: Metrics,
    readiness: Readiness,
}

/// A running worker.
pub struct Handle {
    pub worker_id: String,
    /// This process's session (incarnation).
    pub session: String,
    pub stats: Arc<Stats>,
    /// The Prometheus metrics this worker records into.
    pub metrics: Metrics,
    /// Ready once started; not ready while disconnected or draining.
    pub readiness: Readiness,
    shared: Arc<Shared>,
    join: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl Handle {
    /// Waits until the worker has shut down: `Ok` when every job finished
    /// or was handed back; a [`NotHandedBack`] error when the hand-back
    /// timeout passed first.
    pub async fn wait(self) -> anyhow::Result<()> {
        self.join.await.context("worker task panicked")?
    }

    /// What names, at any moment, the jobs this process holds and has not
    /// handed back: for the line a process cut short logs.
    pub fn unreturned(&self) -> impl Fn() -> Vec<String> + Send + Sync + 'static {
        let shared = self.shared.clone();
        move || unreturned(&shared)
    }
}

/// A stop that ended before every job was handed back (NATS away or
/// hanging): the jobs, recovered when this session ends or its TTL passes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotHandedBack {
    pub jobs: Vec<String>,
    /// What cut the stop short (`--hand-back-timeout (15s) passed`, ...).
    pub why: String,
}

impl std::fmt::Display for NotHandedBack {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.jobs.is_empty() {
            write!(
                f,
                "shutdown: {}; every job was handed back but the session's end was not written (its TTL ends it)",
                self.why
            )
        } else {
            write!(
                f,
                "shutdown: {}; {} job(s) not handed back, recovered when this session ends or its TTL passes: {}",
                self.why,
                self.jobs.len(),
                self.jobs.join(", ")
            )
        }
    }
}

impl std::error::Error for NotHandedBack {}

/// The jobs this process holds and has not handed back: those still
/// running (or being claimed) and those whose hand-back failed.
fn unreturned(shared: &Shared) -> Vec<String> {
    let mut jobs: Vec<String> = shared.running.lock().unwrap().keys().cloned().collect();
    jobs.extend(shared.claiming.lock().unwrap().iter().cloned());
    jobs.extend(shared.unreturned.lock().unwrap().iter().cloned());
    jobs.sort();
    jobs.dedup();
    jobs
}

/// How long start-up waits for an unavailable NATS (a leader election, a
/// rolling restart) before giving up; a missing layout fails at once.
const START_DEADLINE: Duration = Duration::from_secs(120);

impl Worker {
    /// A worker with no handlers yet ([`Worker::with_handler`]; the SDK's
    /// worker gives one per kind, the built-in kinds included).
    pub fn new(opts: Options) -> Self {
        Worker {
            opts,
            handlers: HashMap::new(),
            kinds: Kinds::default(),
            metrics: Metrics::new(),
            readiness: Readiness::new(),
        }
    }

    /// Adds (or replaces) the handler of a kind. A kind the built-in
    /// registry does not know (a user's kind) is accepted with any input
    /// object: its handler validates it.
    pub fn with_handler(mut self, kind: &str, h: Arc<dyn Handler>) -> Self {
        self.kinds = std::mem::take(&mut self.kinds).with_open(kind);
        self.handlers.insert(kind.to_string(), h);
        self
    }

    /// The options it starts with.
    pub fn options(&self) -> &Options {
        &self.opts
    }

    /// Records into `metrics` (the binary serves them on `/metrics`).
    pub fn with_metrics(mut self, metrics: Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Reports readiness to `readiness` (the binary serves it on `/readyz`).
    pub fn with_readiness(mut self, readiness: Readiness) -> Self {
        self.readiness = readiness;
        self
    }

    /// Connects, verifies the layout, opens the session, and starts pulling.
    /// Stops when `shutdown` fires (see the module docs for the phases).
    pub async fn start(self, shutdown: CancellationToken) -> anyhow::Result<Handle> {
        let opts = self.opts;
        opts.validate().map_err(anyhow::Error::msg)?;
        for (var, instead) in Options::retired_variables() {
            tracing::warn!(var, "{var} is set but no longer used: {instead}");
        }
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
        let session_id = uuid::Uuid::new_v4().simple().to_string();
        let conn = opts
            .nats
            .connect(&format!("leasehold-worker {worker_id}"))
            .await?;
        retry_unavailable("JetStream", START_DEADLINE, || setup::ping(&conn.js)).await?;
        retry_unavailable("layout", START_DEADLINE, || setup::verify(&conn, &served)).await?;
        let work = Work::new(&conn);
        let recovery = retry_unavailable("buckets", START_DEADLINE, || {
            Recovery::open(
                &conn,
                format!("worker {worker_id}"),
                opts.max_stale_reclaims,
            )
        })
        .await?;
        let renew = opts.renew_every();
        tracing::info!(
            worker_id,
            session = %session_id,
            kinds = %served.join(","),
            concurrency = opts.concurrency,
            session_timeout = %human_duration(opts.session_timeout),
            session_renew = %human_duration(renew),
            attempt_timeout = %human_duration(opts.attempt_timeout),
            index_after = %human_duration(opts.index_after),
            drain_timeout = %human_duration(opts.drain_timeout),
            pull_expires = %human_duration(opts.pull_expires),
            max_stale_reclaims = opts.max_stale_reclaims,
            retry = %opts.retry_policy(),
            nats = %opts.nats.url_for_logs(),
            prefix = %opts.nats.prefix,
            "worker starting"
        );
        let shared = Arc::new(Shared {
            flow: Arc::new(leasehold_flow::Flow::observed(Arc::new(
                self.metrics.clone(),
            ))),
            jobs: recovery.jobs.clone(),
            events: Events::new(&conn),
            dlq: Dlq::new(&conn),
            active: recovery.active.clone(),
            sessions: recovery.sessions.clone(),
            recovery: Arc::new(recovery),
            work,
            conn,
            slots: Arc::new(Semaphore::new(opts.concurrency)),
            handlers: self.handlers,
            kinds: self.kinds,
            retry: opts.retry_policy(),
            worker_id: worker_id.clone(),
            session: session::SessionState::new(
                &worker_id,
                &session_id,
                &served,
                opts.session_timeout,
                renew,
            )
            .with_slots(opts.concurrency),
            running: StdMutex::new(HashMap::new()),
            claiming: StdMutex::new(Default::default()),
            idle: Notify::new(),
            handoff: CancellationToken::new(),
            unreturned: StdMutex::new(Vec::new()),
            suspect: StdMutex::new(None),
            ack_waits: StdMutex::new(HashMap::new()),
            stats: Arc::new(Stats::default()),
            metrics: self.metrics.clone(),
            readiness: self.readiness.clone(),
            shutdown: shutdown.clone(),
            opts,
        });
        // The session before anything else: a job claimed from here on
        // names it. Its responder is subscribed first, so a recoverer that
        // pings this identity as soon as the key appears gets an answer.
        let responder = session::begin(&shared).await?;
        let gateway = crate::gateway::subscribe(&shared.conn).await?;
        let stats = shared.stats.clone();
        shared.readiness.set_layout_ok(true);
        shared
            .readiness
            .set_connected(shared.conn.link.is_connected());
        let join = tokio::spawn(run(shared.clone(), served, gateway, responder, shutdown));
        Ok(Handle {
            worker_id,
            session: session_id,
            stats,
            metrics: self.metrics,
            readiness: self.readiness,
            shared,
            join,
        })
    }
}

pub(crate) struct Shared {
    pub(crate) opts: Options,
    pub(crate) conn: Conn,
    pub(crate) jobs: Jobs,
    pub(crate) events: Events,
    pub(crate) work: Work,
    pub(crate) dlq: Dlq,
    pub(crate) active: Active,
    pub(crate) sessions: Sessions,
    pub(crate) recovery: Arc<Recovery>,
    pub(crate) handlers: HashMap<String, Arc<dyn Handler>>,
    pub(crate) kinds: Kinds,
    pub(crate) retry: RetryPolicy,
    pub(crate) worker_id: String,
    pub(crate) session: session::SessionState,
    pub(crate) slots: Arc<Semaphore>,
    /// Jobs running in this process, by id.
    pub(crate) running: StdMutex<HashMap<String, attempt::Running>>,
    /// Jobs whose claim write this process has sent and not yet settled
    /// (a claim in flight at shutdown is waited for; asked whether it runs
    /// such a job, the process says yes).
    pub(crate) claiming: StdMutex<std::collections::HashSet<String>>,
    pub(crate) idle: Notify,
    /// Phase 3 of shutdown: hand every running job back.
    pub(crate) handoff: CancellationToken,
    /// Jobs whose hand-back failed (NATS away): named when the stop ends.
    pub(crate) unreturned: StdMutex<Vec<String>>,
    /// The one suspect job this process runs, if any (see `claim::SUSPECT_AFTER`).
    pub(crate) suspect: StdMutex<Option<String>>,
    /// Each kind's consumer's first redelivery, as its pull loop found it
    /// (see [`Shared::ticket_return`]).
    pub(crate) ack_waits: StdMutex<HashMap<String, Duration>>,
    pub(crate) stats: Arc<Stats>,
    pub(crate) metrics: Metrics,
    pub(crate) readiness: Readiness,
    /// This worker's flow control (every model request and limited job is
    /// admitted by it), fed by the coordinator in `crate::flow`.
    pub(crate) flow: Arc<leasehold_flow::Flow>,
    /// The process's shutdown (fired by the session when another process
    /// took over this identity).
    pub(crate) shutdown: CancellationToken,
}

impl Shared {
    /// When a claimed ticket of `kind` comes back by itself, and whether
    /// its claim sets a wake-up for it (`Options::ticket_return`).
    pub(crate) fn ticket_return(&self, kind: &str) -> crate::config::TicketReturn {
        let w = self.ack_waits.lock().unwrap().get(kind).copied();
        self.opts.ticket_return(w)
    }

    /// A claim won.
    pub(crate) fn count_claim(&self, kind: &str, reclaim: bool) {
        self.metrics.claimed(kind);
        if reclaim {
            self.metrics.reclaimed(kind);
        }
    }

    /// The session clock attempts check before write effects.
    pub(crate) fn clock(&self) -> SessionClock {
        self.session.clock.clone()
    }
}

async fn run(
    shared: Arc<Shared>,
    kinds: Vec<String>,
    gateway: crate::gateway::Subscriptions,
    responder: async_nats::Subscriber,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let mut loops = JoinSet::new();
    for kind in &kinds {
        loops.spawn(pull::pull_loop(
            shared.clone(),
            kind.clone(),
            shutdown.clone(),
        ));
    }
    let gw = crate::gateway::Gateway {
        conn: shared.conn.clone(),
        jobs: shared.jobs.clone(),
        events: shared.events.clone(),
        dlq: shared.dlq.clone(),
        work: shared.work.clone(),
        active: shared.active.clone(),
        kinds: shared.kinds.clone(),
        max_submission_bytes: shared.opts.max_submission_bytes,
    };
    let gw = tokio::spawn(crate::gateway::run(gw, gateway, shutdown.clone()));
    // The session outlives the drain and the hand-back: it stops last.
    let session_stop = CancellationToken::new();
    let renewals = tokio::spawn(session::renew_loop(shared.clone(), session_stop.clone()));
    let answers = tokio::spawn(session::respond(
        shared.clone(),
        responder,
        session_stop.clone(),
    ));
    let ends = tokio::spawn(recovery::watch_session_ends(
        shared.conn.clone(),
        shared.recovery.clone(),
        recovery::WatchOptions::default(),
        shutdown.clone(),
    ));
    // Delayed jobs of our kinds get their tickets at their time, with or
    // without a reaper.
    let wakeups = tokio::spawn(leasehold_store::timers::run(
        shared.recovery.clone(),
        Some(kinds.clone()),
        shutdown.clone(),
    ));
    // Jobs that wait for a signal are woken when it comes, with or
    // without a reaper.
    let signal_wakes = tokio::spawn(leasehold_store::signals::run(
        shared.conn.clone(),
        shared.recovery.clone(),
        shutdown.clone(),
    ));
    if shared.opts.worker_id.is_some() {
        let s = shared.clone();
        tokio::spawn(restart::restart_reclaim_all(s));
    }
    // Flow control outlives the drain (the jobs still call models) and
    // gives its quota leases back after it.
    let flow_stop = CancellationToken::new();
    let flow = crate::flow::start(
        shared.flow.clone(),
        shared.conn.clone(),
        shared.worker_id.clone(),
        shared.opts.flow_local_share,
        flow_stop.clone(),
    );

    let link = {
        let (s, stop) = (shared.clone(), shutdown.clone());
        tokio::spawn(async move {
            let link = s.conn.link.clone();
            s.readiness
                .follow_connection(|| link.is_connected(), stop.cancelled())
                .await
        })
    };

    shutdown.cancelled().await;
    shared.readiness.set_draining();
    let _ = link.await;
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
    // The hand-back and everything after it share one bound: with NATS
    // away or hanging, any of these waits could last for ever.
    let hand_back = shared.opts.hand_back_timeout;
    let rest = async {
        wait_idle(&shared).await;
        while loops.join_next().await.is_some() {}
        let _ = gw.await;
        let _ = ends.await;
        let _ = wakeups.await;
        let _ = signal_wakes.await;
        flow_stop.cancel();
        let _ = flow.await;
        session_stop.cancel();
        let _ = renewals.await;
        let _ = answers.await;
        session::end(&shared).await;
        // Plain acks and NAKs are buffered publishes: flush before the client goes.
        let _ = shared.conn.client.flush().await;
    };
    let finished = tokio::time::timeout(hand_back, rest).await.is_ok();
    let jobs = unreturned(&shared);
    if finished && jobs.is_empty() {
        tracing::info!("worker stopped");
        return Ok(());
    }
    let why = if finished {
        "hand-back failed".to_string()
    } else {
        format!("--hand-back-timeout ({}) passed", human_duration(hand_back))
    };
    Err(NotHandedBack { jobs, why }.into())
}

/// Waits until no job runs here and no claim is in flight.
pub(crate) async fn wait_idle(shared: &Shared) {
    loop {
        let notified = shared.idle.notified();
        if shared.running.lock().unwrap().is_empty() && shared.claiming.lock().unwrap().is_empty() {
            return;
        }
        notified.await;
    }
}
