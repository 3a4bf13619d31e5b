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
//! 3. The sweep, every `--interval`, over the index of active jobs (never
//!    the records): running jobs whose session is not their worker's live
//!    one, or whose attempt deadline passed, are recovered; waiting jobs
//!    past their due time by `--stranded-grace` get their ticket checked
//!    and replaced; index entries whose record disagrees are repaired; and
//!    a [`Metrics`] snapshot is published.
//! 4. The advisory loop: max-deliveries advisories captured in
//!    `LH_ADVISORIES`. A ticket past max deliveries whose job a live owner
//!    holds is only deleted (the job is alive and needs no ticket); a
//!    running job with a gone owner is recovered; a waiting one becomes
//!    `dead` (class `max_deliveries`).
//! 5. The metrics responder on `<prefix>.reaper.metrics`.
//!
//! A sixth task fires the recurring schedules' ticks, each at its time
//! (`crate::schedules`): exactly once per tick across replicas. A seventh
//! wakes waiting jobs whose ticket was released for their wait
//! (`leasehold_store::timers`, run by every worker too).
//!
//! Architecture invariant: every action is a revision-conditioned write of
//! the job record or a deduplicated publish, so any number of replicas may
//! run at once.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, consumer, kv, AckKind};
use futures::StreamExt;
use leasehold_core::machine::{self, status_of};
use leasehold_core::retry::Backoff;
use leasehold_core::spec::{self, Kinds, Submission};
use leasehold_core::time::human_duration;
use leasehold_core::{JobRecord, Status};
use leasehold_store::index::{Filter, Key};
use leasehold_store::liveness::Verdict;
use leasehold_store::recovery::{self, Action, Recovery};
use leasehold_store::sessions::{Ping, Runs, SessionInfo};
use leasehold_store::timers::{self, DueError};
use leasehold_store::work::{self, Ticket};
use leasehold_store::{retry_unavailable, setup, Conn, JobsError, StoreError};
use leasehold_telemetry::metrics::{FleetSnapshot, ReaperMetrics};
use leasehold_telemetry::Readiness;
use serde::Deserialize;
use serde_json::json;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::decide::{self, RunningAction};
use crate::metrics::{Counters, Metrics, Queue, Tally};
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

/// Counters of one reaper process (for tests, metrics and logs).
#[derive(Debug, Default)]
pub struct Stats {
    pub sweeps: AtomicU64,
    /// Jobs this replica dead-lettered as poison.
    pub poison: AtomicU64,
    /// Jobs this replica turned `dead` after max deliveries (its CAS won).
    pub max_deliveries: AtomicU64,
    /// Jobs this replica re-offered (its write won).
    pub recoveries: AtomicU64,
    /// Advisories processed and acked.
    pub advisories: AtomicU64,
    /// Sessions this replica ended after "no responders".
    pub sessions_ended_fast: AtomicU64,
    /// Index entries whose record disagreed, repaired.
    pub index_repairs: AtomicU64,
    /// Waiting jobs whose ticket was lost or stuck, given a fresh one.
    pub tickets_replaced: AtomicU64,
    /// Finished jobs removed after their retention.
    pub forgotten: AtomicU64,
}

impl Stats {
    fn counters(&self) -> Counters {
        Counters {
            sweeps: self.sweeps.load(Ordering::Relaxed),
            recoveries: self.recoveries.load(Ordering::Relaxed),
            poison: self.poison.load(Ordering::Relaxed),
            max_deliveries: self.max_deliveries.load(Ordering::Relaxed),
            sessions_ended_fast: self.sessions_ended_fast.load(Ordering::Relaxed),
        }
    }

    /// Counts a recovery action here and in the replica's metrics.
    fn count(&self, a: &Action, prom: &ReaperMetrics) {
        match a {
            Action::Reoffered { .. } | Action::Cancelled => {
                self.recoveries.fetch_add(1, Ordering::Relaxed);
                prom.recovered(1);
            }
            Action::Poisoned => {
                self.poison.fetch_add(1, Ordering::Relaxed);
                prom.dead_lettered("poison", 1);
            }
            Action::Nothing(_) | Action::Unsure(_) => {}
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
            .map_err(|e| StoreError::Nats(format!("subscribe to metrics requests: {e}")))?;
        conn.client
            .flush()
            .await
            .map_err(|e| StoreError::Nats(format!("flush: {e}")))?;
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
        let inner = Arc::new(Inner {
            recovery: Arc::new(recovery),
            conn,
            id: reaper_id.clone(),
            stats: Arc::new(Stats::default()),
            metrics: metrics_tx,
            prom: self
                .prom
                .clone()
                .unwrap_or_else(|| ReaperMetrics::new(&reaper_id)),
            readiness: self.readiness.clone(),
            kinds,
            verify_cursor: std::sync::Mutex::new(String::new()),
            unclaimed: std::sync::Mutex::default(),
            opts,
        });
        let stats = inner.stats.clone();
        let prom = inner.prom.clone();
        inner.readiness.set_layout_ok(true);

        let join = tokio::spawn(run(inner, advisories, metrics_sub, shutdown));
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

/// [`advisory_consumer`] at start: the layout was verified, so a failure
/// now is the advisory stream electing a leader (a node restarting), waited
/// out up to [`START_DEADLINE`].
async fn advisory_consumer_at_start(conn: &Conn) -> Result<consumer::PullConsumer, ReaperError> {
    let end = tokio::time::Instant::now() + START_DEADLINE;
    let mut backoff = Backoff::new(Duration::from_millis(100), Duration::from_secs(1));
    loop {
        let pause = backoff.pause();
        match advisory_consumer(conn).await {
            Err(e) if tokio::time::Instant::now() + pause < end => {
                tracing::warn!(error = %e, retry_in_ms = pause.as_millis() as u64, "advisory consumer not available yet; retrying");
                tokio::time::sleep(pause).await;
            }
            other => return other,
        }
    }
}

/// Creates (or binds to) the replicas' shared durable consumer of advisories.
async fn advisory_consumer(conn: &Conn) -> Result<consumer::PullConsumer, ReaperError> {
    let l = &conn.layout;
    let fail = |e: &dyn std::fmt::Display| ReaperError::Advisories {
        stream: l.advisory_stream(),
        message: e.to_string(),
    };
    let stream = conn
        .js
        .get_stream(l.advisory_stream())
        .await
        .map_err(|e| fail(&e))?;
    let name = l.reaper_consumer();
    stream
        .get_or_create_consumer(
            &name,
            consumer::pull::Config {
                durable_name: Some(name.clone()),
                description: Some(
                    "leasehold reapers: max-deliveries advisories of the work consumers".into(),
                ),
                ack_policy: consumer::AckPolicy::Explicit,
                ack_wait: Duration::from_secs(60),
                deliver_policy: consumer::DeliverPolicy::All,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| fail(&e))
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
    /// Where the rotating check of running entries against their records
    /// goes on at the next sweep (a job id).
    verify_cursor: std::sync::Mutex<String>,
    /// Waiting jobs whose ticket (job, ticket) its lane delivered but the
    /// job was still not claimed: at the last sweep, and at this one.
    unclaimed: std::sync::Mutex<Unclaimed>,
}

/// Tickets seen delivered but unclaimed, by sweep: a ticket is stuck only
/// when two sweeps saw it so, since one look may land in the milliseconds
/// between a worker's delivery and its claim.
#[derive(Default)]
struct Unclaimed {
    last: std::collections::HashSet<(String, u64)>,
    this: std::collections::HashSet<(String, u64)>,
}

impl Unclaimed {
    /// Notes `ticket` of `job` as delivered and unclaimed now; whether the
    /// last sweep saw it so too.
    fn seen_again(&mut self, job: &str, ticket: u64) -> bool {
        let k = (job.to_string(), ticket);
        let again = self.last.contains(&k);
        self.this.insert(k);
        again
    }

    /// A sweep ended: what it saw is what the next compares with.
    fn next_sweep(&mut self) {
        self.last = std::mem::take(&mut self.this);
    }
}

/// How many running entries with a live owner each sweep compares with
/// their records (a rotating window: stale entries are found within a few
/// sweeps without reading every record every time).
const VERIFY_PER_SWEEP: usize = 256;

async fn run(
    inner: Arc<Inner>,
    advisories: consumer::PullConsumer,
    metrics_sub: async_nats::Subscriber,
    shutdown: CancellationToken,
) -> Result<(), ReaperError> {
    // All are awaited at shutdown: each finishes its current action first.
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
            sweep, adv, srv, ends, probe, schedules, wakeups, retention, historian,
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

/// What a sweep log line tells: logged at info when it changed since the
/// last sweep (an idle reaper is quiet), else at debug.
fn sweep_summary(m: &Metrics) -> (u64, u64, u64, u64, u64, u64) {
    (
        m.jobs,
        m.running,
        m.parked,
        m.sessions,
        m.recoveries,
        m.queue_depth,
    )
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

async fn sweep_loop(inner: Arc<Inner>, shutdown: CancellationToken) {
    // A sweep is logged at info only when its summary changed; the first
    // is compared with an idle fleet (all zeros), so an idle reaper is
    // quiet at info from its start (every sweep is logged at debug).
    let mut last = (0, 0, 0, 0, 0, 0);
    loop {
        let started = tokio::time::Instant::now();
        match inner.sweep().await {
            Ok(m) => {
                let now = sweep_summary(&m);
                let changed = last != now;
                last = now;
                macro_rules! sweep_log {
                    ($lvl:ident) => {
                        tracing::$lvl!(
                            reaper_id = %m.reaper_id,
                            jobs = m.jobs,
                            running = m.running,
                            in_flight = m.in_flight,
                            queue_depth = m.queue_depth,
                            oldest_in_flight_age = %m
                                .oldest_in_flight_age_s
                                .map(|a| human_duration(Duration::from_secs_f64(a.max(0.0))))
                                .unwrap_or_else(|| "-".into()),
                            parked = m.parked,
                            sessions = m.sessions,
                            recoveries = m.recoveries,
                            took = %human_duration(started.elapsed()),
                            "sweep"
                        )
                    };
                }
                if changed {
                    sweep_log!(info);
                } else {
                    sweep_log!(debug);
                }
                inner.prom.sweep_finished(started.elapsed());
                inner.prom.fleet(&FleetSnapshot {
                    jobs: m.jobs,
                    queued: Some(m.queue_depth),
                    queue_bytes: m.queue_bytes,
                    queue_max_msgs: m.queue_max_msgs,
                    queue_max_bytes: m.queue_max_bytes,
                    in_flight: m.in_flight,
                    parked: m.parked,
                    oldest_in_flight_age: m
                        .oldest_in_flight_age_s
                        .map(|a| Duration::from_secs_f64(a.max(0.0))),
                    dead_letters: m.dead_letters_by_kind.clone(),
                });
                inner.metrics.send_replace(m);
            }
            Err(e) => {
                inner.prom.sweep_failed();
                tracing::warn!(error = %e, "sweep failed; trying again at the next interval")
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(inner.opts.interval) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}

/// How long after a tick the schedules loop wakes for it: ticks are whole
/// seconds, and a timer never fires early, so this only absorbs the
/// difference between the wall clock and the timer's.
const TICK_SLACK: Duration = Duration::from_millis(2);

/// The recurring schedules, on their own clock: wakes at the next tick of
/// any schedule, and at once when a schedule is added or changed (at least
/// every `--interval` while the schedules cannot be watched), and fires
/// what is due, so a tick fires at its time whatever a sweep costs.
async fn schedules_loop(inner: Arc<Inner>, shutdown: CancellationToken) {
    let mut dedupe = None;
    let mut changes = None;
    loop {
        if changes.is_none() {
            changes = crate::schedules::watch(&inner.conn).await;
        }
        let window = match dedupe {
            Some(d) => d,
            None => {
                let d = crate::schedules::dedupe_window(&inner.conn).await;
                if !d.is_zero() {
                    dedupe = Some(d);
                }
                d
            }
        };
        let next = match crate::schedules::fire_due(
            &inner.conn,
            &inner.recovery,
            &inner.kinds,
            &inner.opts,
            window,
        )
        .await
        {
            Ok(c) => c.next,
            Err(e) => {
                tracing::warn!(error = %e, "schedules not checked; trying again at the next interval");
                None
            }
        };
        let wait = next
            .map(|t| t.duration_since(SystemTime::now()).unwrap_or_default() + TICK_SLACK)
            .unwrap_or(inner.opts.interval)
            .min(inner.opts.interval);
        let changed = async {
            match changes.as_mut() {
                Some(w) => w.next().await.map(|c| c.is_ok()).unwrap_or(false),
                None => std::future::pending().await,
            }
        };
        let watching = tokio::select! {
            _ = tokio::time::sleep(wait) => true,
            ok = changed => ok,
            _ = shutdown.cancelled() => return,
        };
        if !watching {
            // The watch ended (a reconnect, a leader change): watch anew.
            changes = None;
        }
    }
}

async fn metrics_responder(
    inner: Arc<Inner>,
    mut sub: async_nats::Subscriber,
    shutdown: CancellationToken,
) {
    loop {
        let msg = tokio::select! {
            m = sub.next() => match m { Some(m) => m, None => return },
            _ = shutdown.cancelled() => return,
        };
        let Some(reply) = msg.reply else { continue };
        let body = serde_json::to_vec(&*inner.metrics.borrow()).expect("metrics serialize");
        if let Err(e) = inner.conn.client.publish(reply, body.into()).await {
            tracing::debug!(error = %e, "metrics reply failed");
        }
    }
}

/// Pings every live session; ends those whose process's connection is gone.
async fn probe_loop(inner: Arc<Inner>, shutdown: CancellationToken) {
    if inner.opts.probe_interval.is_zero() {
        return;
    }
    let sessions = inner.recovery.sessions.clone();
    // Live sessions as the watch shows them: worker -> (session, revision,
    // session timeout).
    let mut live: HashMap<String, (String, u64, Duration)> = HashMap::new();
    let mut suspects: HashMap<String, (u64, u32)> = HashMap::new();
    let mut watch: Option<kv::Watch> = None;
    let mut tick = tokio::time::interval(inner.opts.probe_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        if watch.is_none() {
            match sessions.kv().watch_with_history(">").await {
                Ok(w) => {
                    live.clear();
                    watch = Some(w);
                }
                Err(e) => {
                    tracing::debug!(error = %e, "cannot watch sessions; retrying");
                    tokio::select! { _ = tokio::time::sleep(Duration::from_secs(1)) => continue, _ = shutdown.cancelled() => return }
                }
            }
        }
        let w = watch.as_mut().expect("set above");
        tokio::select! {
            _ = shutdown.cancelled() => return,
            e = w.next() => match e {
                Some(Ok(e)) if e.operation == kv::Operation::Put => {
                    let info: SessionInfo = serde_json::from_slice(&e.value).unwrap_or_default();
                    let timeout = Duration::from_millis(info.timeout_ms);
                    live.insert(e.key.clone(), (info.session, e.revision, timeout));
                }
                Some(Ok(e)) => { live.remove(&e.key); suspects.remove(&e.key); }
                _ => { watch = None; }
            },
            _ = tick.tick() => {
                // Our own view of the server must have settled first: right
                // after a reconnect every worker may still be reconnecting
                // (the one settle rule, `leasehold_store::liveness`).
                if inner.recovery.liveness.settling().is_some() {
                    suspects.clear();
                    continue;
                }
                let timeout = inner.opts.probe_interval.max(Duration::from_millis(200));
                let pings = futures::future::join_all(live.iter().map(|(w, (_, rev, ttl))| {
                    let (s, w, rev, ttl) = (sessions.clone(), w.clone(), *rev, *ttl);
                    async move { (w.clone(), rev, ttl, s.ping(&w, timeout).await) }
                }))
                .await;
                for (worker, rev, ttl, ping) in pings {
                    if ping != Ping::NoResponders {
                        suspects.remove(&worker);
                        continue;
                    }
                    let seen = suspects.entry(worker.clone()).or_insert((rev, 0));
                    if seen.0 != rev {
                        *seen = (rev, 0);
                    }
                    seen.1 += 1;
                    if seen.1 < 2 {
                        continue;
                    }
                    suspects.remove(&worker);
                    // Marked as the probe's: a process that is only
                    // reconnecting gets a settle time before its jobs move.
                    match sessions.end_by_probe(&worker, rev, ttl).await {
                        Ok(true) => {
                            inner.stats.sessions_ended_fast.fetch_add(1, Ordering::Relaxed);
                            tracing::warn!(worker, reaper_id = %inner.id, "worker's connection is gone (no responders): ended its session");
                        }
                        Ok(false) => {}
                        Err(e) => tracing::debug!(worker, error = %e, "ending a session failed"),
                    }
                }
            }
        }
    }
}

/// The advisory payload fields the reaper uses.
#[derive(Debug, Deserialize)]
pub struct MaxDeliveries {
    pub stream: String,
    #[serde(default)]
    pub consumer: String,
    pub stream_seq: u64,
    #[serde(default)]
    pub deliveries: u64,
}

async fn advisory_loop(
    inner: Arc<Inner>,
    mut consumer: consumer::PullConsumer,
    shutdown: CancellationToken,
) {
    let pause = Duration::from_secs(1);
    while !shutdown.is_cancelled() {
        let mut msgs = match consumer.messages().await {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!(error = %e, "cannot pull advisories; retrying");
                tokio::select! { _ = tokio::time::sleep(pause) => {}, _ = shutdown.cancelled() => return }
                // The consumer may have been deleted: bind to it (or create it) again.
                match advisory_consumer(&inner.conn).await {
                    Ok(c) => consumer = c,
                    Err(e) => tracing::warn!(error = %e, "advisory consumer unavailable"),
                }
                continue;
            }
        };
        loop {
            let next = tokio::select! {
                m = msgs.next() => m,
                _ = shutdown.cancelled() => return,
            };
            match next {
                Some(Ok(msg)) => inner.on_advisory(msg).await,
                Some(Err(e)) => {
                    // Missed heartbeats, a restarted server: pull anew after a pause.
                    tracing::warn!(error = %e, "advisory pull interrupted; pulling again");
                    tokio::select! { _ = tokio::time::sleep(pause) => {}, _ = shutdown.cancelled() => return }
                    break;
                }
                None => break,
            }
        }
    }
}

impl Inner {
    /// One sweep over the index of active jobs; returns the metrics snapshot.
    async fn sweep(&self) -> Result<Metrics, ReaperError> {
        let r = &self.recovery;
        let entries = r.active.list(Filter::All).await?;
        let now = SystemTime::now();
        let mut tally = Tally::default();
        // One verdict per recorded session in a sweep (a worker's jobs share it).
        let mut verdicts: HashMap<(String, Option<String>), Verdict> = HashMap::new();
        let mut to_verify: Vec<(String, String)> = Vec::new();
        for (key, entry) in &entries {
            tally.observe(key, entry, now);
            let res: Result<(), ReaperError> = match key {
                Key::Run { worker, job } => {
                    let k = (worker.clone(), entry.session.clone());
                    let verdict = match verdicts.get(&k) {
                        Some(v) => v.clone(),
                        None => {
                            let v = r
                                .liveness
                                .owner(worker, entry.session.as_deref(), None)
                                .await;
                            verdicts.insert(k, v.clone());
                            v
                        }
                    };
                    match decide::running_action(entry, &verdict, now, self.opts.clock_skew) {
                        RunningAction::Nothing => {
                            to_verify.push((worker.clone(), job.clone()));
                            Ok(())
                        }
                        RunningAction::Unsure => {
                            tracing::debug!(job, worker, %verdict, "owner's liveness unknown; the next sweep asks again");
                            Ok(())
                        }
                        RunningAction::OwnerGone => r
                            .recover_job(worker, job, None)
                            .await
                            .map(|a| self.stats.count(&a, &self.prom))
                            .map_err(Into::into),
                        RunningAction::Overdue => {
                            tracing::warn!(
                                job,
                                worker,
                                "attempt past its deadline while its worker lives; re-offering it"
                            );
                            r.recover_job(worker, job, Some(self.opts.clock_skew))
                                .await
                                .map(|a| self.stats.count(&a, &self.prom))
                                .map_err(Into::into)
                        }
                    }
                }
                Key::Wait { job }
                    if decide::waiting_is_stranded(entry, now, self.opts.stranded_grace) =>
                {
                    self.check_waiting(job, key).await
                }
                _ => Ok(()),
            };
            if let Err(e) = res {
                tracing::warn!(key = %key.as_string(), error = %e, "reaper action failed; retrying at the next sweep");
            }
        }
        self.unclaimed.lock().unwrap().next_sweep();
        self.verify_some(to_verify).await;
        let depth = self.queue_depth().await;
        let dlq = self.dlq_by_kind().await;
        let live_workers: std::collections::HashSet<&String> = verdicts
            .iter()
            .filter(|(_, v)| v.is_alive())
            .map(|((w, _), _)| w)
            .collect();
        tally.set_queue(depth, live_workers.len() as u64, dlq);
        self.stats.sweeps.fetch_add(1, Ordering::Relaxed);
        let mut m = tally.finish(&self.id, now, self.stats.counters());
        m.sessions = self.count_sessions().await.unwrap_or(m.sessions);
        Ok(m)
    }

    /// Compares a rotating window of running entries (live owners) with
    /// their records: an entry left behind by a crash between a record
    /// write and its index write is repaired.
    async fn verify_some(&self, mut run: Vec<(String, String)>) {
        if run.is_empty() {
            return;
        }
        run.sort_by(|a, b| a.1.cmp(&b.1));
        let cursor = self.verify_cursor.lock().unwrap().clone();
        let start = run.iter().position(|(_, j)| *j > cursor).unwrap_or(0);
        let window: Vec<_> = run
            .iter()
            .cycle()
            .skip(start)
            .take(VERIFY_PER_SWEEP.min(run.len()))
            .cloned()
            .collect();
        if let Some((_, last)) = window.last() {
            *self.verify_cursor.lock().unwrap() = last.clone();
        }
        let mut held = Vec::new();
        for (worker, job) in window {
            let key = Key::Run {
                worker: worker.clone(),
                job: job.clone(),
            };
            match self.recovery.jobs.get(&job).await {
                Ok(Some(v)) if Key::of(&v.value).as_ref() == Some(&key) => {
                    held.push((worker, job, v.value.epoch));
                }
                Ok(Some(v)) => match self.recovery.repair_moved_on(&v.value, &key).await {
                    Ok(()) => {
                        self.stats.index_repairs.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        tracing::debug!(job, error = %e, "verify: entry kept until the job's end is finished")
                    }
                },
                Ok(None) => {
                    if self
                        .recovery
                        .active
                        .remove(&key, leasehold_store::index::Remover::Anyone)
                        .await
                        .is_ok()
                    {
                        self.stats.index_repairs.fetch_add(1, Ordering::Relaxed);
                    }
                }
                Err(e) => tracing::debug!(job, error = %e, "verify: record unreadable"),
            }
        }
        self.ask_owners(held).await;
    }

    /// Asks each live owner whether it really runs the job its record and
    /// index say it does. One that says no (an attempt that ended without
    /// its outcome written, so nothing would ever move the job while the
    /// process lives) has the job re-offered at that epoch.
    async fn ask_owners(&self, held: Vec<(String, String, u64)>) {
        let r = &self.recovery;
        let answers: Vec<_> = futures::stream::iter(held)
            .map(|(worker, job, epoch)| async move {
                let runs = r
                    .sessions
                    .runs(&worker, &job, epoch, Duration::from_secs(1))
                    .await;
                (worker, job, epoch, runs)
            })
            .buffer_unordered(16)
            .collect()
            .await;
        for (worker, job, epoch, runs) in answers {
            if runs != Runs::No {
                continue;
            }
            match r.recover_unrun(&worker, &job, epoch).await {
                Ok(a) => {
                    if matches!(a, Action::Reoffered { .. }) {
                        tracing::warn!(
                            job,
                            worker,
                            epoch,
                            "its live owner does not run it; re-offered"
                        );
                    }
                    self.stats.count(&a, &self.prom)
                }
                Err(e) => tracing::warn!(job, error = %e, "cannot re-offer an unrun job"),
            }
        }
    }

    /// A waiting job past its due time by the grace: repair the index if
    /// the record moved on; otherwise make sure it has a ticket that a
    /// worker will actually be given.
    async fn check_waiting(&self, job: &str, key: &Key) -> Result<(), ReaperError> {
        let r = &self.recovery;
        let Some(cur) = r.jobs.get(job).await? else {
            r.active
                .remove(key, leasehold_store::index::Remover::Anyone)
                .await?;
            return Ok(());
        };
        let rec = cur.value;
        if Key::of(&rec).as_ref() != Some(key) {
            if rec.status == Status::Dead.as_str() {
                r.finish_if_unfinished(&rec).await?;
            }
            r.active.sync(&rec, Some(key)).await?;
            self.stats.index_repairs.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        if rec.cancel_requested {
            return self.cancel_waiting(job, Some(key)).await;
        }
        // A ticket is stuck when it is gone, or was delivered already and
        // still not claimed long past its due time (past max deliveries with
        // its advisory lost, or held by a worker that stopped before
        // claiming). One not yet delivered is only waiting in a backlog.
        let ticket = if rec.ticket_seq > 0 {
            r.work.get(rec.ticket_seq).await?
        } else {
            None
        };
        if let Some(t) = &ticket {
            // Judged by the ticket's own lane: another lane's deliveries
            // say nothing of a ticket waiting behind its lane's backlog.
            let delivered = r
                .work
                .delivered_seq(&rec.kind, &t.lane)
                .await
                .ok()
                .flatten();
            if delivered.is_none_or(|d| rec.ticket_seq > d) {
                return Ok(());
            }
            if !self
                .unclaimed
                .lock()
                .unwrap()
                .seen_again(job, rec.ticket_seq)
            {
                return Ok(());
            }
        }
        let why = if ticket.is_some() {
            "its ticket was delivered but never claimed"
        } else if rec.ticket_seq == 0 {
            "its ticket was released for its wait and no wake-up gave it a new one"
        } else {
            "its ticket was gone"
        };
        self.replace_ticket(&rec, cur.revision, rec.ticket_seq, ticket.is_some(), why)
            .await
    }

    /// Cancels a waiting job whose cancel was requested (a claim would
    /// honour it, but nothing is claiming it), and makes the index agree;
    /// `stale` is its index key when known.
    async fn cancel_waiting(&self, job: &str, stale: Option<&Key>) -> Result<(), ReaperError> {
        let r = &self.recovery;
        let v = r
            .jobs
            .transition(job, |c| {
                match machine::request_cancel(c, SystemTime::now())? {
                    machine::CancelOutcome::Cancelled(n) => Ok(Some(n)),
                    _ => Ok(None),
                }
            })
            .await?;
        r.active.sync(&v.value, stale).await?;
        Ok(())
    }

    /// Gives waiting job `rec` (read at `revision`) a fresh ticket in place
    /// of `lost` (0: a released ticket, whose wake-up did not come):
    /// [`timers::reticket`] (publish first, deduplicated by the revision, so
    /// replicas and wake-ups publish one; then the record, conditioned),
    /// then delete the old one. A job is never dead-lettered for how often its ticket
    /// was delivered: only its stale reclaims make it poison.
    async fn replace_ticket(
        &self,
        rec: &JobRecord,
        revision: u64,
        lost: u64,
        had_ticket: bool,
        why: &str,
    ) -> Result<(), ReaperError> {
        let r = &self.recovery;
        let job = rec.id.as_str();
        let published = timers::reticket(r, rec, revision, lost).await?;
        if let Some(published) = published.filter(|p| !p.duplicate) {
            if had_ticket && lost > 0 {
                r.work.delete(lost).await?;
            }
            self.stats.tickets_replaced.fetch_add(1, Ordering::Relaxed);
            self.stats.recoveries.fetch_add(1, Ordering::Relaxed);
            self.prom.recovered(1);
            tracing::warn!(
                job,
                lost_ticket = lost,
                new_ticket = published.seq,
                "waiting job given a fresh ticket: {why}"
            );
            let ev = leasehold_store::events::event(
                job,
                rec.epoch,
                "progress",
                None,
                json!({"phase": "recovered", "recovered": true, "reason": why, "ticket_seq": published.seq, "lost_ticket_seq": lost, "reaper_id": self.id}),
            );
            r.events
                .publish(&ev, Some(&format!("{job}:recovered:{}", published.seq)))
                .await?;
        }
        Ok(())
    }

    /// Tickets in the work stream (waiting or in progress).
    async fn queue_depth(&self) -> Queue {
        let name = self.conn.layout.work_stream();
        let limit = |v: i64| u64::try_from(v).unwrap_or(0);
        match self.conn.js.get_stream(&name).await {
            Ok(mut s) => s
                .info()
                .await
                .map(|i| Queue {
                    messages: i.state.messages,
                    bytes: i.state.bytes,
                    max_msgs: limit(i.config.max_messages),
                    max_bytes: limit(i.config.max_bytes),
                })
                .unwrap_or_default(),
            Err(_) => Queue::default(),
        }
    }

    async fn dlq_by_kind(&self) -> BTreeMap<String, u64> {
        let l = &self.conn.layout;
        let mut out = BTreeMap::new();
        if let Ok(s) = self.conn.js.get_stream(l.dlq_stream()).await {
            if let Ok(info) = s.info_with_subjects(l.dlq_wildcard()).await {
                let mut subjects = info;
                while let Some(Ok((subject, n))) = subjects.next().await {
                    let kind = subject.rsplit('.').next().unwrap_or_default().to_string();
                    *out.entry(kind).or_default() += n as u64;
                }
            }
        }
        out
    }

    async fn count_sessions(&self) -> Option<u64> {
        let mut keys = self.recovery.sessions.kv().keys().await.ok()?;
        let mut n = 0;
        while let Some(Ok(_)) = keys.next().await {
            n += 1;
        }
        Some(n)
    }

    /// Handles one captured advisory; acks it once handled, NAKs it on a
    /// transient failure, and acks (with a warning) what it cannot parse.
    async fn on_advisory(&self, msg: jetstream::Message) {
        let adv: MaxDeliveries = match serde_json::from_slice(&msg.payload) {
            Ok(a) => a,
            Err(e) => {
                tracing::warn!(subject = %msg.subject, error = %e, "unreadable advisory; dropping it");
                let _ = msg.ack().await;
                return;
            }
        };
        if adv.stream != self.conn.layout.work_stream() {
            let _ = msg.ack().await;
            return;
        }
        match self.max_deliveries(&adv).await {
            Ok(()) => {
                self.stats.advisories.fetch_add(1, Ordering::Relaxed);
                self.prom.advisories(1);
                let _ = msg.ack().await;
            }
            Err(e) => {
                tracing::warn!(seq = adv.stream_seq, error = %e, "max-deliveries advisory not handled yet; retrying in 1s");
                let _ = msg
                    .ack_with(AckKind::Nak(Some(Duration::from_secs(1))))
                    .await;
            }
        }
    }

    /// A ticket reached max deliveries. A live job is never killed for it:
    /// a running job with a live owner needs no ticket (it is only
    /// deleted), one whose owner is gone is recovered; a waiting job becomes
    /// `dead` (class `max_deliveries`) with the ticket's payload.
    async fn max_deliveries(&self, adv: &MaxDeliveries) -> Result<(), ReaperError> {
        let r = &self.recovery;
        let seq = adv.stream_seq;
        let Some(ticket) = r.work.get(seq).await? else {
            tracing::debug!(seq, "ticket already gone; nothing to do");
            return Ok(());
        };
        let Some(id) = self.job_of(&ticket) else {
            // Nothing names a job: keep the raw bytes, as for a rejection.
            tracing::warn!(
                seq,
                "a ticket past max deliveries names no job; dead-lettering its raw bytes"
            );
            let message = format!(
                "{} deliveries to consumer {} without an ack",
                adv.deliveries, adv.consumer
            );
            r.dlq
                .reject(
                    &ticket.kind,
                    None,
                    "max_deliveries",
                    &message,
                    ticket.payload.clone(),
                    Some(&ticket.headers),
                    &format!("max_deliveries:{seq}"),
                )
                .await?;
            r.work.delete(seq).await?;
            return Ok(());
        };
        let reason = format!(
            "max deliveries: ticket {seq} was delivered {} times to {} without an ack",
            adv.deliveries, adv.consumer
        );
        let Some(cur) = r.jobs.get(&id).await? else {
            // The ticket was never claimed: record the job as dead so it
            // is visible and replayable like any other.
            if let Some(rec) = self
                .dead_record_for_unclaimed(&id, &ticket, &reason)
                .await?
            {
                self.stats.max_deliveries.fetch_add(1, Ordering::Relaxed);
                self.prom.dead_lettered("max_deliveries", 1);
                r.finish(&rec, Some(&ticket), Some(seq)).await?;
            }
            return Ok(());
        };
        let rec = cur.value;
        if rec.ticket_seq > seq {
            tracing::info!(job = %id, seq, current = rec.ticket_seq, "superseded ticket past max deliveries; deleting it");
            r.work.delete(seq).await?;
            return Ok(());
        }
        match status_of(&rec) {
            Some(Status::Running) => {
                let worker = rec.worker_id.clone().unwrap_or_default();
                let a = r.recover_job(&worker, &id, None).await?;
                if let Action::Unsure(why) = &a {
                    return Err(ReaperError::Store(StoreError::Nats(format!(
                        "job {id}: {why}"
                    ))));
                }
                if matches!(a, Action::Nothing(_)) {
                    // The ticket may be the job's only cover (not indexed
                    // yet): index it under its owner before the ticket goes.
                    if let Some(now) = r.jobs.get(&id).await? {
                        r.active.sync(&now.value, None).await?;
                    }
                    tracing::info!(job = %id, seq, worker, "ticket past max deliveries of a job its live owner runs: indexed under its owner and deleted, the job goes on");
                }
                self.stats.count(&a, &self.prom);
                r.work.delete(seq).await?;
                Ok(())
            }
            // A waiting job is never dead-lettered for its deliveries (they
            // count refusals and transient errors, not what the job did):
            // it gets a fresh ticket instead.
            Some(Status::Queued) => {
                if rec.cancel_requested {
                    self.cancel_waiting(&id, None).await?;
                    r.work.delete(seq).await?;
                    return Ok(());
                }
                tracing::info!(job = %id, seq, deliveries = adv.deliveries, "waiting job's ticket past max deliveries; giving it a fresh one");
                self.replace_ticket(
                    &rec,
                    cur.revision,
                    seq,
                    true,
                    "its ticket reached max deliveries",
                )
                .await
            }
            Some(Status::Dead) => {
                r.finish(&rec, Some(&ticket), Some(seq)).await?;
                Ok(())
            }
            // Terminal or parked: the ticket has nothing left to do.
            _ => r.work.delete(seq).await.map(|_| ()).map_err(Into::into),
        }
    }

    /// Creates a dead record for a ticket whose job was never recorded;
    /// `None` when a record appeared meanwhile.
    async fn dead_record_for_unclaimed(
        &self,
        id: &str,
        ticket: &Ticket,
        reason: &str,
    ) -> Result<Option<JobRecord>, ReaperError> {
        let now = SystemTime::now();
        let ct = work::content_type(Some(&ticket.headers));
        let sub = Submission {
            kind: &ticket.kind,
            payload: &ticket.payload,
            msg_id: Some(id),
            content_type: ct.as_deref(),
            stream_seq: ticket.seq,
            received_at: ticket.stored_at,
        };
        let spec = spec::decode(sub, &self.kinds, usize::MAX)
            .map(|a| a.spec)
            .unwrap_or_default();
        let fresh = machine::new_record(id, &ticket.kind, spec, ticket.seq, now);
        let dead = machine::mark_dead(&fresh, now, "max_deliveries", reason)
            .expect("a queued record can die");
        match self.recovery.jobs.create(&dead).await {
            Ok(_) => Ok(Some(dead)),
            Err(JobsError::Exists(_) | JobsError::Conflict(_)) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The job a ticket belongs to: its `Lh-Job-Id` or `Nats-Msg-Id`
    /// header, else the id its payload gives (spec `id`, else `seq-<n>`).
    fn job_of(&self, ticket: &Ticket) -> Option<String> {
        if let Some(id) = work::ticket_job_id(Some(&ticket.headers)) {
            return Some(id);
        }
        let ct = work::content_type(Some(&ticket.headers));
        let sub = Submission {
            kind: &ticket.kind,
            payload: &ticket.payload,
            msg_id: None,
            content_type: ct.as_deref(),
            stream_seq: ticket.seq,
            received_at: ticket.stored_at,
        };
        match spec::decode(sub, &self.kinds, usize::MAX) {
            Ok(a) => Some(a.id),
            Err(r) => r.id,
        }
    }
}
