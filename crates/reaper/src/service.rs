//! The reaper service: `Reaper::start(shutdown) -> Handle`.
//!
//! Three tasks share one connection:
//! 1. The sweep, every `--interval`: reads every job record and, through
//!    [`crate::decide::sweep_action`], dead-letters poison jobs, re-enqueues
//!    stranded runs, finishes dead-lettering a replica left half-done, and
//!    publishes a [`Metrics`] snapshot.
//! 2. The advisory loop: a durable pull consumer (`<prefix>_reaper`) on the
//!    stream that captures the server's max-deliveries advisories of the
//!    work consumers. Each advisory names a ticket by stream sequence; the
//!    ticket's job is dead-lettered (class `max_deliveries`) and the ticket
//!    deleted (past max deliveries it would otherwise stay for ever). The
//!    advisory is acked only after that, so a reaper dying mid-way leaves it
//!    to be redelivered.
//! 3. The metrics responder on `<prefix>.reaper.metrics`.
//!
//! Architecture invariant: every action is a revision-conditioned write of
//! the job record or a deduplicated publish, so any number of replicas may
//! run at once. Killing a job is always, in this order: the record CAS to
//! `dead`, the dead letter (deduplicated by `<job>:dead:<epoch>:<marked_at>`), the
//! ticket deletion, the `dead` event (same id). The `dead` event is the
//! completion marker: the sweep finishes recently dead records that lack it.
//!
//! Shutdown: on the token each task stops taking new work, finishes the
//! action it is in (none is interrupted half-way), and the connection is
//! flushed so buffered acks reach the server.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, consumer, AckKind};
use bytes::Bytes;
use futures::StreamExt;
use leasehold_core::machine::{self, status_of};
use leasehold_core::spec::{self, Kinds, Submission};
use leasehold_core::time::rfc3339;
use leasehold_core::{JobRecord, Status};
use leasehold_store::dlq::Dlq;
use leasehold_store::events::{self, Events};
use leasehold_store::work::{self, Ticket, Work};
use leasehold_store::{setup, Conn, Jobs, JobsError, StoreError};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::decide::{self, SweepAction};
use crate::metrics::{Counters, Metrics, Tally};
use crate::Options;

/// How many of a job's latest events go into its dead letter.
const RECENT_EVENTS: usize = 20;

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
}

impl ReaperError {
    /// Worth trying again at the next sweep or redelivery.
    pub fn is_transient(&self) -> bool {
        match self {
            ReaperError::Store(StoreError::Nats(_)) => true,
            ReaperError::Jobs(e) => e.is_transient(),
            _ => false,
        }
    }
}

/// Counters of one reaper process (for tests, metrics and logs).
#[derive(Debug, Default)]
pub struct Stats {
    pub sweeps: AtomicU64,
    /// Jobs this replica turned `dead` as poison (its CAS won).
    pub poison: AtomicU64,
    /// Jobs this replica turned `dead` after max deliveries (its CAS won).
    pub max_deliveries: AtomicU64,
    /// Stranded jobs this replica re-enqueued (its ticket was the new one).
    pub recoveries: AtomicU64,
    /// Advisories processed and acked.
    pub advisories: AtomicU64,
    /// Dead-letterings completed (including finishing another replica's).
    pub finished: AtomicU64,
}

impl Stats {
    fn counters(&self) -> Counters {
        Counters {
            sweeps: self.sweeps.load(Ordering::Relaxed),
            recoveries: self.recoveries.load(Ordering::Relaxed),
            poison: self.poison.load(Ordering::Relaxed),
            max_deliveries: self.max_deliveries.load(Ordering::Relaxed),
        }
    }
}

/// A configured reaper, not yet started.
pub struct Reaper {
    opts: Options,
}

/// A running reaper.
pub struct Handle {
    pub reaper_id: String,
    pub stats: Arc<Stats>,
    metrics: watch::Receiver<Metrics>,
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
        Reaper { opts }
    }

    /// Connects, verifies the layout, creates the advisory consumer, and
    /// starts the three tasks. Stops when `shutdown` fires.
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
        setup::ping(&conn.js).await?;
        setup::verify(&conn, &[]).await?;
        let advisories = advisory_consumer(&conn).await?;
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
            interval = ?opts.interval,
            stranded_grace = ?opts.stranded_grace,
            nats = %opts.nats.url,
            prefix = %opts.nats.prefix,
            "reaper starting"
        );
        let (metrics_tx, metrics_rx) = watch::channel(Metrics {
            reaper_id: reaper_id.clone(),
            ..Default::default()
        });
        let inner = Arc::new(Inner {
            jobs: Jobs::open(&conn).await?,
            events: Events::new(&conn),
            work: Work::new(&conn),
            dlq: Dlq::new(&conn),
            conn,
            id: reaper_id.clone(),
            stats: Arc::new(Stats::default()),
            metrics: metrics_tx,
            kinds: Kinds::default(),
            opts,
        });
        let stats = inner.stats.clone();
        let join = tokio::spawn(run(inner, advisories, metrics_sub, shutdown));
        Ok(Handle {
            reaper_id,
            stats,
            metrics: metrics_rx,
            join,
        })
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
    jobs: Jobs,
    events: Events,
    work: Work,
    dlq: Dlq,
    kinds: Kinds,
    stats: Arc<Stats>,
    metrics: watch::Sender<Metrics>,
}

async fn run(
    inner: Arc<Inner>,
    advisories: consumer::PullConsumer,
    metrics_sub: async_nats::Subscriber,
    shutdown: CancellationToken,
) -> Result<(), ReaperError> {
    // All three are awaited at shutdown: each finishes its current action first.
    let sweep = tokio::spawn(sweep_loop(inner.clone(), shutdown.clone()));
    let adv = tokio::spawn(advisory_loop(inner.clone(), advisories, shutdown.clone()));
    let srv = tokio::spawn(metrics_responder(
        inner.clone(),
        metrics_sub,
        shutdown.clone(),
    ));
    shutdown.cancelled().await;
    tracing::info!(reaper_id = %inner.id, "shutdown: finishing the actions in progress");
    for t in [sweep, adv, srv] {
        if let Err(e) = t.await {
            tracing::error!(error = %e, "reaper task panicked");
        }
    }
    // Advisory acks are buffered publishes: flush before the client goes.
    let _ = inner.conn.client.flush().await;
    tracing::info!(reaper_id = %inner.id, "reaper stopped");
    Ok(())
}

async fn sweep_loop(inner: Arc<Inner>, shutdown: CancellationToken) {
    loop {
        match inner.sweep().await {
            Ok(m) => {
                tracing::info!(
                    reaper_id = %m.reaper_id,
                    jobs = m.jobs,
                    in_flight = m.in_flight,
                    oldest_in_flight_age_s = ?m.oldest_in_flight_age_s,
                    parked = m.parked,
                    dead_letters = ?m.dead_letters_by_class,
                    recoveries = m.recoveries,
                    "sweep"
                );
                inner.metrics.send_replace(m);
            }
            Err(e) => tracing::warn!(error = %e, "sweep failed; trying again at the next interval"),
        }
        tokio::select! {
            _ = tokio::time::sleep(inner.opts.interval) => {}
            _ = shutdown.cancelled() => return,
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
    /// One sweep over every record; returns the metrics snapshot.
    async fn sweep(&self) -> Result<Metrics, ReaperError> {
        let records = self.jobs.all().await?;
        let now = SystemTime::now();
        let mut tally = Tally::default();
        for v in &records {
            let rec = &v.value;
            tally.observe(rec, now);
            let res = match decide::sweep_action(
                rec,
                now,
                self.opts.max_stale_reclaims,
                self.opts.stranded_grace,
            ) {
                SweepAction::Nothing => Ok(()),
                SweepAction::Poison => self.poison(&rec.id).await,
                SweepAction::CheckTicket => self.recover_if_stranded(&rec.id).await,
                SweepAction::FinishDead => self.finish_if_unfinished(rec).await,
            };
            if let Err(e) = res {
                tracing::warn!(job = %rec.id, error = %e, "reaper action failed; retrying at the next sweep");
            }
        }
        self.stats.sweeps.fetch_add(1, Ordering::Relaxed);
        Ok(tally.finish(&self.id, now, self.stats.counters()))
    }

    /// Dead-letters a poison job: the lease expired after the stale-reclaim limit.
    async fn poison(&self, id: &str) -> Result<(), ReaperError> {
        let max = self.opts.max_stale_reclaims;
        let mut wrote = false;
        let v = self
            .jobs
            .transition(id, |cur| {
                wrote = false;
                let now = SystemTime::now();
                if !decide::is_poison(cur, now, max) {
                    return Ok(None);
                }
                let reason = format!(
                    "poison: the lease expired after {} stale reclaims (limit {max}); the job keeps killing or stalling its workers",
                    cur.stale_reclaims
                );
                wrote = true;
                machine::mark_dead(cur, now, "poison", &reason).map(Some)
            })
            .await?;
        if wrote {
            self.stats.poison.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(job = %id, epoch = v.value.epoch, stale_reclaims = v.value.stale_reclaims, "poison job marked dead");
        }
        if v.value.status == Status::Dead.as_str() {
            self.finish(&v.value, None, None).await?;
        }
        Ok(())
    }

    /// Finishes the dead-lettering of a dead record if its `dead` event is missing.
    async fn finish_if_unfinished(&self, rec: &JobRecord) -> Result<(), ReaperError> {
        let last = self.events.last_of_type(&rec.id, "dead").await?;
        let covered = last.is_some_and(|(_, ev)| {
            let marked = ev
                .data_map()
                .get("marked_at")
                .and_then(|v| v.as_str().map(str::to_string));
            decide::dead_event_covers(rec, ev.epoch, marked.as_deref())
        });
        if covered {
            return Ok(());
        }
        tracing::info!(job = %rec.id, "finishing an interrupted dead-lettering");
        self.finish(rec, None, None).await
    }

    /// The steps after a record became dead, each idempotent: the dead letter
    /// and the `dead` event are both deduplicated by the death's id
    /// (`<job>:dead:<epoch>:<marked_at>`); the event is published last, as
    /// the completion marker, after the ticket deletion.
    async fn finish(
        &self,
        rec: &JobRecord,
        ticket: Option<&Ticket>,
        extra_seq: Option<u64>,
    ) -> Result<(), ReaperError> {
        let (class, reason) = rec
            .error
            .as_ref()
            .map(|e| (e.class.clone(), e.message.clone()))
            .unwrap_or_else(|| ("dead".into(), "dead-lettered by the reaper".into()));
        let payload: Option<Bytes> = match ticket {
            Some(t) => Some(t.payload.clone()),
            None if rec.ticket_seq > 0 => self.work.get(rec.ticket_seq).await?.map(|t| t.payload),
            None => None,
        };
        // The spec is in the record, so a lost ticket still leaves a replayable letter.
        let payload = payload.or_else(|| {
            rec.spec
                .as_ref()
                .and_then(|s| serde_json::to_vec(s).ok())
                .map(Bytes::from)
        });
        let recent = match self.events.read(&rec.id).await {
            Ok(evs) => {
                let skip = evs.len().saturating_sub(RECENT_EVENTS);
                evs.into_iter().skip(skip).map(|(_, e)| e).collect()
            }
            Err(e) => {
                tracing::warn!(job = %rec.id, error = %e, "cannot read the job's events; dead-lettering without them");
                Vec::new()
            }
        };
        let dlq_seq = self
            .dlq
            .dead_with_id(
                rec,
                &class,
                &reason,
                recent,
                payload,
                &decide::death_id(rec),
            )
            .await?;
        for seq in [Some(rec.ticket_seq), extra_seq]
            .into_iter()
            .flatten()
            .filter(|s| *s > 0)
        {
            self.work.delete(seq).await?;
        }
        let ev = events::event(
            &rec.id,
            rec.epoch,
            "dead",
            None,
            json!({"class": class, "reason": reason, "dlq_seq": dlq_seq, "marked_at": rec.error.as_ref().map(|e| e.at.clone()), "reaper_id": self.id}),
        );
        self.events
            .publish(&ev, Some(&decide::death_id(rec)))
            .await?;
        self.stats.finished.fetch_add(1, Ordering::Relaxed);
        tracing::info!(job = %rec.id, class, dlq_seq, "dead-lettered");
        Ok(())
    }

    /// Whether the ticket at `seq` is still in the work stream.
    async fn ticket_exists(&self, seq: u64) -> Result<bool, ReaperError> {
        Ok(seq > 0 && self.work.get(seq).await?.is_some())
    }

    /// Re-enqueues a stranded job: running long past its lease, or queued,
    /// with no work ticket left.
    async fn recover_if_stranded(&self, id: &str) -> Result<(), ReaperError> {
        let Some(cur) = self.jobs.get(id).await? else {
            return Ok(());
        };
        let rec = cur.value;
        let now = SystemTime::now();
        if decide::sweep_action(
            &rec,
            now,
            self.opts.max_stale_reclaims,
            self.opts.stranded_grace,
        ) != SweepAction::CheckTicket
        {
            return Ok(());
        }
        if self.ticket_exists(rec.ticket_seq).await? {
            return Ok(());
        }
        // First mark the lost ticket as lost (ticket_seq 0): a worker drops a
        // ticket older than the record's `ticket_seq` as superseded, and a
        // restored stream can number new tickets below the lost one. The
        // write is conditioned on the record as read, so of two replicas only
        // one goes on from here.
        let (status, epoch, lost) = (rec.status.clone(), rec.epoch, rec.ticket_seq);
        let same = |r: &JobRecord| r.status == status && r.epoch == epoch;
        let marked = if lost > 0 {
            let mut wrote = false;
            let v = self
                .jobs
                .transition(id, |r| {
                    wrote = false;
                    if !same(r) || r.ticket_seq != lost {
                        return Ok(None);
                    }
                    let mut n = r.clone();
                    n.ticket_seq = 0;
                    n.updated_at = rfc3339(SystemTime::now());
                    wrote = true;
                    Ok(Some(n))
                })
                .await?;
            if !wrote {
                return Ok(());
            }
            v.revision
        } else {
            cur.revision
        };
        // The nonce is the revision of the record that says "no ticket": every
        // replica that sees that record publishes the same deduplicated
        // ticket, while a later stranding of the job gets a new one.
        let nonce = format!("r{marked}");
        let published = self.work.reissue(&rec, "recover", &nonce).await?;
        // Best effort: a worker claiming the new ticket first adopts its
        // sequence itself.
        self.jobs
            .transition(id, |r| {
                if r.ticket_seq != 0 || !same(r) {
                    return Ok(None);
                }
                let mut n = r.clone();
                n.ticket_seq = published.seq;
                n.updated_at = rfc3339(SystemTime::now());
                Ok(Some(n))
            })
            .await?;
        if !published.duplicate {
            self.stats.recoveries.fetch_add(1, Ordering::Relaxed);
            let why = if status == Status::Running.as_str() {
                "running past its lease without a work ticket"
            } else {
                "queued without a work ticket"
            };
            tracing::warn!(job = %id, status, lost_ticket = lost, new_ticket = published.seq, "stranded job re-enqueued: {why}");
            let ev = events::event(
                id,
                epoch,
                "progress",
                None,
                json!({"phase": "recovered", "recovered": true, "reason": why, "ticket_seq": published.seq, "lost_ticket_seq": lost, "reaper_id": self.id}),
            );
            self.events
                .publish(&ev, Some(&format!("{id}:recovered:{}", published.seq)))
                .await?;
        }
        Ok(())
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

    /// A ticket reached max deliveries: its job becomes `dead` (class
    /// `max_deliveries`), is dead-lettered with the ticket's payload, and the
    /// ticket is deleted.
    async fn max_deliveries(&self, adv: &MaxDeliveries) -> Result<(), ReaperError> {
        let seq = adv.stream_seq;
        let Some(ticket) = self.work.get(seq).await? else {
            tracing::debug!(seq, "ticket already gone; nothing to do");
            return Ok(());
        };
        let Some(id) = self.job_of(&ticket).await? else {
            // Nothing names a job: keep the raw bytes, as for a rejection.
            tracing::warn!(
                seq,
                "a ticket past max deliveries names no job; dead-lettering its raw bytes"
            );
            let message = format!(
                "{} deliveries to consumer {} without an ack",
                adv.deliveries, adv.consumer
            );
            self.dlq
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
            self.work.delete(seq).await?;
            return Ok(());
        };
        let reason = format!(
            "max deliveries: ticket {seq} was delivered {} times to {} without an ack",
            adv.deliveries, adv.consumer
        );
        for _ in 0..4 {
            let Some(cur) = self.jobs.get(&id).await? else {
                // The ticket was never claimed: record the job as dead so it
                // is visible and replayable like any other.
                match self
                    .dead_record_for_unclaimed(&id, &ticket, &reason)
                    .await?
                {
                    Some(rec) => {
                        self.stats.max_deliveries.fetch_add(1, Ordering::Relaxed);
                        return self.finish(&rec, Some(&ticket), Some(seq)).await;
                    }
                    None => continue,
                }
            };
            let rec = cur.value;
            if rec.ticket_seq > seq {
                tracing::info!(job = %id, seq, current = rec.ticket_seq, "superseded ticket past max deliveries; deleting it");
                self.work.delete(seq).await?;
                return Ok(());
            }
            return match status_of(&rec) {
                Some(Status::Queued | Status::Running) => {
                    let mut wrote = false;
                    let v = self
                        .jobs
                        .transition(&id, |r| {
                            wrote = false;
                            if r.ticket_seq > seq
                                || !matches!(status_of(r), Some(Status::Queued | Status::Running))
                            {
                                return Ok(None);
                            }
                            wrote = true;
                            machine::mark_dead(r, SystemTime::now(), "max_deliveries", &reason)
                                .map(Some)
                        })
                        .await?;
                    if wrote {
                        self.stats.max_deliveries.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(job = %id, seq, deliveries = adv.deliveries, "job past max deliveries marked dead");
                    }
                    if v.value.status == Status::Dead.as_str() {
                        self.finish(&v.value, Some(&ticket), Some(seq)).await
                    } else {
                        self.work.delete(seq).await.map(|_| ()).map_err(Into::into)
                    }
                }
                Some(Status::Dead) => self.finish(&rec, Some(&ticket), Some(seq)).await,
                // Terminal or parked: the ticket has nothing left to do.
                _ => self.work.delete(seq).await.map(|_| ()).map_err(Into::into),
            };
        }
        Err(ReaperError::Jobs(JobsError::Conflict(id)))
    }

    /// Creates a dead record for a ticket whose job was never recorded;
    /// `None` when a record appeared meanwhile (decide again).
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
        };
        let spec = spec::decode(sub, &self.kinds, usize::MAX)
            .map(|a| a.spec)
            .unwrap_or_default();
        let fresh = machine::new_record(id, &ticket.kind, spec, ticket.seq, now);
        let dead = machine::mark_dead(&fresh, now, "max_deliveries", reason)
            .expect("a queued record can die");
        match self.jobs.create(&dead).await {
            Ok(_) => Ok(Some(dead)),
            Err(JobsError::Exists(_) | JobsError::Conflict(_)) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// The job a ticket belongs to: its `Lh-Job-Id` or `Nats-Msg-Id`
    /// header, else the id its payload gives (spec `id`, else `seq-<n>`),
    /// else the record whose `ticket_seq` is this ticket.
    async fn job_of(&self, ticket: &Ticket) -> Result<Option<String>, ReaperError> {
        if let Some(id) = work::ticket_job_id(Some(&ticket.headers)) {
            return Ok(Some(id));
        }
        let ct = work::content_type(Some(&ticket.headers));
        let sub = Submission {
            kind: &ticket.kind,
            payload: &ticket.payload,
            msg_id: None,
            content_type: ct.as_deref(),
            stream_seq: ticket.seq,
        };
        let decoded = match spec::decode(sub, &self.kinds, usize::MAX) {
            Ok(a) => Some(a.id),
            Err(r) => r.id,
        };
        if decoded.is_some() {
            return Ok(decoded);
        }
        let all = self.jobs.all().await?;
        Ok(all
            .into_iter()
            .find(|v| v.value.ticket_seq == ticket.seq)
            .map(|v| v.value.id))
    }
}
