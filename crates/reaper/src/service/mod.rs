//! The reaper service: `Reaper::start(shutdown) -> Handle`.
//!
//! Five tasks share one connection:
//! 1. The prober, every `--probe-interval`: pings every live worker
//!    session. "No responders" twice in a row means the process's
//!    connection is gone (kill -9, OOM, node loss): its session key is
//!    ended at once (conditioned on the revision seen), which the session
//!    watcher turns into a re-offer of its jobs within about a second. A
//!    paused or partitioned process keeps its connection and is left to its
//!    session timeout.
//! 2. The session watcher (`leasehold_store::recovery`): the durable
//!    consumer of ended sessions, shared with every worker.
//! 3. The sweep, every `--interval`, over the reaper's live view of the
//!    index of active jobs (a watch: never the records, and no read of the
//!    index per sweep): running jobs whose session is not their worker's
//!    live one (one verdict per session), or whose attempt deadline passed,
//!    are recovered; waiting jobs past their due time by `--stranded-grace`
//!    get their ticket checked and replaced; index entries whose record
//!    disagrees are repaired; and a [`Metrics`] snapshot is published.
//! 4. The advisory loop: max-deliveries advisories captured in
//!    `LH_ADVISORIES`. A ticket past max deliveries whose job a live owner
//!    holds is only deleted (the job is alive and needs no ticket); a
//!    running job with a gone owner is recovered; a waiting one becomes
//!    `dead` (class `max_deliveries`).
//! 5. The metrics responder on `<prefix>.reaper.metrics`.
//!
//! The sweep and the prober act only on this reaper's shards: reapers
//! split the work by a stable hash of the job id (and of the worker id for
//! the probe), each shard owned by one of the reapers that answered the
//! last roll call (`members.rs`, [`leasehold_core::shard`]).
//!
//! A sixth task fires the recurring schedules' ticks, each at its time
//! (`crate::schedules`): exactly once per tick across replicas. A seventh
//! wakes waiting jobs whose ticket was released for their wait
//! (`leasehold_store::timers`, run by every worker too).
//!
//! Each loop has its file: `probe.rs` (1), `sweep.rs` (3), `advisories.rs`
//! (4), `schedules.rs` (the sixth), `members.rs` (the roll call); this one
//! starts them, and answers (5).
//!
//! Architecture invariant: every action is a revision-conditioned write of
//! the job record or a deduplicated publish, so any number of replicas may
//! run at once.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, consumer, AckKind};
use futures::StreamExt;
use leasehold_core::machine::{self, status_of};
use leasehold_core::retry::Backoff;
use leasehold_core::spec::{self, Kinds, Submission};
use leasehold_core::time::human_duration;
use leasehold_core::{JobRecord, Status};
use leasehold_store::index::view::{Owner, View};
use leasehold_store::index::Key;
use leasehold_store::liveness::Verdict;
use leasehold_store::recovery::{self, Action, Recovery};
use leasehold_store::sessions::{LiveSessions, Ping, Runs};
use leasehold_store::timers::{self, DueError};
use leasehold_store::work::{self, Ticket};
use leasehold_store::{retry_unavailable, setup, Conn, JobsError, StoreError};
use leasehold_telemetry::Readiness;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

mod advisories;
mod members;
mod probe;
mod schedules;
mod sweep;

pub use advisories::MaxDeliveries;
use advisories::{advisory_consumer_at_start, advisory_loop};
use probe::probe_loop;
use schedules::schedules_loop;
use sweep::{sweep_loop, Unclaimed};

use crate::decide::{self, RunningAction};
use crate::metrics::{FleetSnapshot, Metrics, Queue, ReaperMetrics, Stats, Tally};
use crate::Options;

/// How long start-up waits for an unavailable NATS before giving up.
const START_DEADLINE: Duration = Duration::from_secs(120);

/// Errors of the reaper.
#[derive(Debug, thiserror::Error)]
pub enum ReaperError {
    #[error("configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Jobs(#[from] JobsError),
    #[error("cannot use the advisory stream {stream}: {message} (run `leasehold setup`)")]
    Advisories { stream: String, message: String },
    #[error("reaper task failed: {0}")]
    Task(String),
    /// The stop's actions in progress outlived `--drain-timeout`.
    #[error("shutdown: the actions in progress did not finish within --drain-timeout ({}); another reaper or the next start does them again", human_duration(*.0))]
    Unfinished(Duration),
}

impl From<DueError> for ReaperError {
    fn from(e: DueError) -> Self {
        match e {
            DueError::Store(e) => ReaperError::Store(e),
            DueError::Jobs(e) => ReaperError::Jobs(e),
        }
    }
}

impl ReaperError {
    /// Worth trying again at the next sweep or redelivery.
    pub fn is_transient(&self) -> bool {
        match self {
            ReaperError::Store(e) => e.is_transient(),
            ReaperError::Jobs(e) => e.is_transient(),
            _ => false,
        }
    }
}

/// A configured reaper, not yet started.
pub struct Reaper {
    opts: Options,
    prom: Option<ReaperMetrics>,
    readiness: Readiness,
}

/// A running reaper.
pub struct Handle {
    pub reaper_id: String,
    pub stats: Arc<Stats>,
    metrics: watch::Receiver<Metrics>,
    /// This replica's Prometheus metrics.
    pub prom: ReaperMetrics,
    /// Ready once started; not ready while disconnected or draining.
    pub readiness: Readiness,
    join: tokio::task::JoinHandle<Result<(), ReaperError>>,
}

impl Handle {
    /// The snapshot of the last sweep (default values before the first).
    pub fn metrics(&self) -> Metrics {
        self.metrics.borrow().clone()
    }

    /// A receiver that changes at every sweep.
    pub fn metrics_watch(&self) -> watch::Receiver<Metrics> {
        self.metrics.clone()
    }

    /// Waits until the reaper has shut down.
    pub async fn wait(self) -> Result<(), ReaperError> {
        self.join
            .await
            .map_err(|e| ReaperError::Task(e.to_string()))?
    }
}

impl Reaper {
    pub fn new(opts: Options) -> Self {
        Reaper {
            opts,
            prom: None,
            readiness: Readiness::new(),
        }
    }

    /// Records into `metrics` (the binary serves them on `/metrics`);
    /// otherwise the reaper keeps its own, labelled with its id.
    pub fn with_metrics(mut self, metrics: ReaperMetrics) -> Self {
        self.prom = Some(metrics);
        self
    }

    /// Reports readiness to `readiness` (the binary serves it on `/readyz`).
    pub fn with_readiness(mut self, readiness: Readiness) -> Self {
        self.readiness = readiness;
        self
    }

    /// Connects, verifies the layout (waiting out an unavailable NATS),
    /// binds the advisory consumer, and starts the tasks. Stops when
    /// `shutdown` fires.
    pub async fn start(self, shutdown: CancellationToken) -> Result<Handle, ReaperError> {
        let opts = self.opts;
        opts.validate().map_err(ReaperError::Config)?;
        let reaper_id = opts
            .reaper_id
            .clone()
            .unwrap_or_else(|| format!("r-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]));
        let conn = opts
            .nats
            .connect(&format!("leasehold-reaper {reaper_id}"))
            .await?;
        retry_unavailable("JetStream", START_DEADLINE, || setup::ping(&conn.js)).await?;
        retry_unavailable("layout", START_DEADLINE, || setup::verify(&conn, &[])).await?;
        let advisories = advisory_consumer_at_start(&conn).await?;
        let recovery = retry_unavailable("buckets", START_DEADLINE, || {
            Recovery::open(
                &conn,
                format!("reaper {reaper_id}"),
                opts.max_stale_reclaims,
            )
        })
        .await?;
        let metrics_sub = conn
            .client
            .subscribe(conn.layout.reaper_metrics_subject())
            .await
            .map_err(|e| StoreError::nats("subscribe to metrics requests", e))?;
        let roll_sub = conn
            .client
            .subscribe(conn.layout.reaper_roll_subject())
            .await
            .map_err(|e| StoreError::nats("subscribe to the roll call", e))?;
        conn.client
            .flush()
            .await
            .map_err(|e| StoreError::nats("flush", e))?;
        tracing::info!(
            reaper_id,
            max_stale_reclaims = opts.max_stale_reclaims,
            interval = %human_duration(opts.interval),
            stranded_grace = %human_duration(opts.stranded_grace),
            probe_interval = %human_duration(opts.probe_interval),
            retention = %human_duration(opts.retention),
            retention_kind = %retention_by_kind(&opts.retention_kind),
            nats = %opts.nats.url_for_logs(),
            prefix = %opts.nats.prefix,
            "reaper starting"
        );
        let (metrics_tx, metrics_rx) = watch::channel(Metrics {
            reaper_id: reaper_id.clone(),
            ..Default::default()
        });
        // Users' kinds in the layout are accepted with any input (their
        // workers validate it), so their schedules fire and their dead
        // records keep their specs.
        let kinds = leasehold_store::setup::kinds_set_up(&conn)
            .await
            .ok()
            .flatten()
            .unwrap_or_default()
            .iter()
            .fold(Kinds::default(), |k, name| k.with_open(name));
        let prom = self
            .prom
            .clone()
            .unwrap_or_else(|| ReaperMetrics::new(&reaper_id));
        let view = View::follow(recovery.active.clone(), conn.link.clone(), shutdown.clone());
        let live = recovery
            .sessions
            .follow(conn.link.clone(), shutdown.clone());
        let (shards, _) = watch::channel(leasehold_core::shard::Shards::new(&reaper_id, []));
        let inner = Arc::new(Inner {
            view,
            live,
            shards,
            recovery: Arc::new(recovery),
            conn,
            id: reaper_id.clone(),
            stats: prom.stats(),
            metrics: metrics_tx,
            prom,
            readiness: self.readiness.clone(),
            kinds,
            verify_cursor: std::sync::Mutex::new(None),
            unclaimed: std::sync::Mutex::default(),
            opts,
        });
        let stats = inner.stats.clone();
        let prom = inner.prom.clone();
        inner.readiness.set_layout_ok(true);

        let join = tokio::spawn(run(inner, advisories, metrics_sub, roll_sub, shutdown));
        Ok(Handle {
            reaper_id,
            stats,
            metrics: metrics_rx,
            prom,
            readiness: self.readiness,
            join,
        })
    }
}

struct Inner {
    opts: Options,
    id: String,
    conn: Conn,
    recovery: Arc<Recovery>,
    kinds: Kinds,
    stats: Arc<Stats>,
    metrics: watch::Sender<Metrics>,
    /// This replica's Prometheus metrics (`/metrics`).
    prom: ReaperMetrics,
    /// Ready while connected; not ready once draining.
    readiness: Readiness,
    /// The live view of the index the sweep follows.
    view: View,
    /// The live sessions, which the probe pings and the sweep counts.
    live: LiveSessions,
    /// This reaper's share of the shards, from the last roll call
    /// (`members.rs`): the sweep and the probe act on its shards only.
    shards: watch::Sender<leasehold_core::shard::Shards>,
    /// Where the rotating check of running entries against their records
    /// goes on at the next sweep (the last key checked).
    verify_cursor: std::sync::Mutex<Option<Key>>,
    /// Waiting jobs whose ticket (job, ticket) its lane delivered but the
    /// job was still not claimed: at the last sweep, and at this one.
    unclaimed: std::sync::Mutex<Unclaimed>,
}

async fn run(
    inner: Arc<Inner>,
    advisories: consumer::PullConsumer,
    metrics_sub: async_nats::Subscriber,
    roll_sub: async_nats::Subscriber,
    shutdown: CancellationToken,
) -> Result<(), ReaperError> {
    // All are awaited at shutdown: each finishes its current action first.
    let roll = tokio::spawn(members::roll_loop(inner.clone(), shutdown.clone()));
    let answer = tokio::spawn(members::answer_roll(
        inner.clone(),
        roll_sub,
        shutdown.clone(),
    ));
    let sweep = tokio::spawn(sweep_loop(inner.clone(), shutdown.clone()));
    let adv = tokio::spawn(advisory_loop(inner.clone(), advisories, shutdown.clone()));
    let srv = tokio::spawn(metrics_responder(
        inner.clone(),
        metrics_sub,
        shutdown.clone(),
    ));
    let ends = tokio::spawn(recovery::watch_session_ends(
        inner.conn.clone(),
        inner.recovery.clone(),
        recovery::WatchOptions::default(),
        shutdown.clone(),
    ));
    let probe = tokio::spawn(probe_loop(inner.clone(), shutdown.clone()));
    let schedules = tokio::spawn(schedules_loop(inner.clone(), shutdown.clone()));
    let wakeups = tokio::spawn(leasehold_store::timers::run(
        inner.recovery.clone(),
        None,
        shutdown.clone(),
    ));
    let signal_wakes = tokio::spawn(leasehold_store::signals::run(
        inner.conn.clone(),
        inner.recovery.clone(),
        shutdown.clone(),
    ));
    let retention = match open_retention(&inner.conn).await {
        Ok(r) => tokio::spawn(crate::retention::run(
            r,
            crate::retention::classes(&inner.opts),
            inner.opts.transcript_retention,
            inner.opts.interval,
            inner.stats.clone(),
            shutdown.clone(),
        )),
        Err(e) => {
            tracing::error!(error = %e, "retention cannot run; finished jobs are kept");
            tokio::spawn(async {})
        }
    };
    let historian = tokio::spawn(crate::historian::run(
        inner.conn.clone(),
        inner.recovery.jobs.clone(),
        crate::retention::classes(&inner.opts),
        shutdown.clone(),
    ));
    let link = {
        let (inner, stop) = (inner.clone(), shutdown.clone());
        tokio::spawn(async move {
            let link = inner.conn.link.clone();
            inner
                .readiness
                .follow_connection(|| link.is_connected(), stop.cancelled())
                .await
        })
    };
    shutdown.cancelled().await;
    inner.readiness.set_draining();
    let _ = link.await;
    let drain = inner.opts.drain_timeout;
    tracing::info!(
        reaper_id = %inner.id,
        "shutdown: finishing the actions in progress for up to {}",
        human_duration(drain)
    );
    let finish = async {
        for t in [
            roll,
            answer,
            sweep,
            adv,
            srv,
            ends,
            probe,
            schedules,
            wakeups,
            signal_wakes,
            retention,
            historian,
        ] {
            if let Err(e) = t.await {
                tracing::error!(error = %e, "reaper task panicked");
            }
        }
        // Advisory acks are buffered publishes: flush before the client goes.
        let _ = inner.conn.client.flush().await;
    };
    // With NATS away or hanging, an action (or the flush) can wait for ever.
    if tokio::time::timeout(drain, finish).await.is_err() {
        return Err(ReaperError::Unfinished(drain));
    }
    tracing::info!(reaper_id = %inner.id, "reaper stopped");
    Ok(())
}

/// Retention, with the effects ledger's own purge (its business keys too).
async fn open_retention(conn: &Conn) -> Result<leasehold_store::retention::Retention, String> {
    let r = leasehold_store::retention::Retention::open(conn)
        .await
        .map_err(|e| e.to_string())?;
    let ledger = leasehold_store::effects::open(&conn.js, &conn.layout.effects_bucket())
        .await
        .map_err(|e| e.to_string())?;
    let js = conn.js.clone();
    Ok(r.with_effects(Arc::new(move |job: String| {
        let (js, ledger) = (js.clone(), ledger.clone());
        Box::pin(async move {
            leasehold_store::effects::purge_job(&js, &ledger, &job)
                .await
                .map(|_| ())
                .map_err(|e| e.to_string())
        })
    })))
}

/// `echo=1h,research=30d` for the log, `none` when no kind has its own.
fn retention_by_kind(kinds: &[(String, Duration)]) -> String {
    if kinds.is_empty() {
        return "none".into();
    }
    kinds
        .iter()
        .map(|(k, d)| format!("{k}={}", human_duration(*d)))
        .collect::<Vec<_>>()
        .join(",")
}

/// Answers each request on `sub` with `body()` until `shutdown` (`what`
/// names the answer in logs): the metrics responder and the roll call.
async fn answer_requests(
    inner: Arc<Inner>,
    mut sub: async_nats::Subscriber,
    shutdown: CancellationToken,
    what: &'static str,
    body: impl Fn(&Inner) -> Option<bytes::Bytes>,
) {
    loop {
        let msg = tokio::select! {
            m = sub.next() => match m { Some(m) => m, None => return },
            _ = shutdown.cancelled() => return,
        };
        let Some(reply) = msg.reply else { continue };
        let Some(body) = body(&inner) else { continue };
        if let Err(e) = inner.conn.client.publish(reply, body).await {
            tracing::debug!(error = %e, "{what} reply failed");
        }
    }
}

async fn metrics_responder(
    inner: Arc<Inner>,
    sub: async_nats::Subscriber,
    shutdown: CancellationToken,
) {
    answer_requests(inner, sub, shutdown, "metrics", |i| {
        Some(
            serde_json::to_vec(&*i.metrics.borrow())
                .expect("metrics serialize")
                .into(),
        )
    })
    .await
}
