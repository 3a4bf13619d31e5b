//! Recovery: what happens to a job whose owner is gone, and to a job that
//! must die. Shared by workers and reapers, so recovery needs no reaper.
//!
//! - [`Recovery::recover_worker`] re-offers every job the index says a
//!   worker runs whose owner is gone by the one liveness rule
//!   ([`crate::liveness`]; an unknown owner is left for the next look): a new
//!   ticket is published, then the record is released (`running -> queued`,
//!   `stale_reclaims`+1, the new ticket's sequence) with a write conditioned
//!   on the revision read, so the old owner is fenced off at once and of two
//!   recoverers only one moves the job (the ticket's dedupe id comes from
//!   that revision, so both publish the same ticket).
//! - [`Recovery::kill`] dead-letters a job: the record CAS to `dead`, the dead
//!   letter, the ticket deletion, the `dead` event (the completion marker),
//!   the index entry removed; every step idempotent ([`death_id`]).
//! - [`watch_session_ends`]: the durable consumer of the sessions bucket's
//!   markers, shared by every worker and reaper process. Nobody is judged
//!   while our own connection settles after a reconnect; a process that
//!   answers as the same session only lost its key (the server was down past
//!   the timeout) and writes it again itself (looked at again, and counted
//!   gone at the third look); otherwise its jobs are re-offered. The end is
//!   acked only when every job of it was handled.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, AckKind};
use bytes::Bytes;
use leasehold_core::machine::{self, status_of, Reoffer};
use leasehold_core::{JobRecord, Status};
use leasehold_proto::JobEvent;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::dlq::Dlq;
use crate::events::{self, Events};
use crate::index::{Active, Filter, Key, Remover};
use crate::liveness::{Liveness, Unsure, Verdict};
use crate::sessions::Sessions;
use crate::work::{ticket_first, Ticket, Work};
use crate::{Conn, Jobs, JobsError, StoreError, Versioned};

/// How many of a job's latest events go into its dead letter.
const RECENT_EVENTS: usize = 20;

/// What recovery did with one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    Reoffered {
        ticket_seq: u64,
    },
    Cancelled,
    Poisoned,
    /// Nothing to recover; a stale index entry may have been repaired.
    Nothing(String),
    /// The owner's liveness is unknown now ([`Verdict::Unknown`]): nothing
    /// was done, ask again later.
    Unsure(String),
}

/// What a [`Recovery::kill`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Killed {
    /// This call wrote the death.
    Now,
    /// The job was dead already (its dead-lettering is finished now).
    Already,
    /// The condition no longer held: the job lives.
    No,
}

/// Counts of one recovery pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Report {
    pub reoffered: u64,
    pub cancelled: u64,
    pub poisoned: u64,
    pub untouched: u64,
}

impl Report {
    fn add(&mut self, a: &Action) {
        match a {
            Action::Reoffered { .. } => self.reoffered += 1,
            Action::Cancelled => self.cancelled += 1,
            Action::Poisoned => self.poisoned += 1,
            Action::Nothing(_) | Action::Unsure(_) => self.untouched += 1,
        }
    }
}

/// The handles recovery needs.
#[derive(Clone)]
pub struct Recovery {
    pub jobs: Jobs,
    pub active: Active,
    pub sessions: Sessions,
    pub work: Work,
    pub events: Events,
    pub dlq: Dlq,
    pub signals: crate::signals::Signals,
    /// Parents seen with a record lately ([`Recovery::announce_end`]).
    live_parents: crate::children::SeenParents,
    /// The one rule for "is this job's owner there?".
    pub liveness: Liveness,
    /// Who acts (`reaper r-..`, `worker w-..`), in events and logs.
    pub actor: String,
    pub max_stale_reclaims: u32,
}

/// What a re-offer of a running job was decided on.
struct Reoffering<'a> {
    worker: &'a str,
    live: Option<&'a str>,
    overdue: Option<Duration>,
    now: SystemTime,
    run_key: &'a Key,
}

impl Recovery {
    pub async fn open(
        conn: &Conn,
        actor: String,
        max_stale_reclaims: u32,
    ) -> Result<Self, StoreError> {
        let sessions = Sessions::open(conn).await?;
        Ok(Recovery {
            jobs: Jobs::open(conn).await?,
            active: Active::open(conn).await?,
            liveness: Liveness::new(sessions.clone(), conn.link.clone()),
            sessions,
            work: Work::new(conn),
            events: Events::new(conn),
            dlq: Dlq::new(conn),
            signals: crate::signals::Signals::new(conn),
            live_parents: Default::default(),
            actor,
            max_stale_reclaims,
        })
    }

    /// Re-offers every job indexed as run by `worker` whose owner is gone
    /// by the one liveness rule ([`Liveness::owner`]). `Err` unless every
    /// job was handled (re-offered, cancelled, dead-lettered, or found
    /// alive or moved on): a session end is acked only then, so nothing is
    /// left behind when no reaper runs. With `lost_key_is_gone`, a process
    /// that answers pings as the recorded session although its key ended
    /// (and it has not written it again since the last look) counts as gone.
    pub async fn recover_worker(
        &self,
        worker: &str,
        lost_key_is_gone: bool,
    ) -> Result<Report, StoreError> {
        let mut report = Report::default();
        let mut verdicts = Verdicts::ask(lost_key_is_gone);
        let mut failed = Vec::new();
        for (key, _) in self.active.list(Filter::RunningBy(worker)).await? {
            match self
                .recover_job_at(worker, key.job(), &mut verdicts, None, None)
                .await
            {
                Ok(Action::Unsure(why)) => failed.push(format!("{}: {why}", key.job())),
                Ok(a) => report.add(&a),
                Err(e) => failed.push(format!("{}: {e}", key.job())),
            }
        }
        if report.reoffered + report.cancelled + report.poisoned > 0 {
            tracing::warn!(worker, actor = %self.actor, reoffered = report.reoffered, cancelled = report.cancelled, poisoned = report.poisoned, "recovered the jobs of an ended session");
        }
        if !failed.is_empty() {
            return Err(StoreError::failed(format!(
                "{} job(s) of worker {worker} not recovered yet: {}",
                failed.len(),
                failed.join("; ")
            )));
        }
        Ok(report)
    }

    /// Recovers one job that `worker` ran if its owner is gone by the one
    /// liveness rule; with `overdue` given, also when its owner lives but
    /// its attempt deadline passed by more than that skew allowance.
    pub async fn recover_job(
        &self,
        worker: &str,
        job: &str,
        overdue: Option<Duration>,
    ) -> Result<Action, StoreError> {
        self.recover_job_at(worker, job, &mut Verdicts::ask(false), overdue, None)
            .await
    }

    /// Re-offers `job` that `worker` holds at `epoch` although its process
    /// (alive) said it does not run it: an attempt that ended without its
    /// outcome written. A newer claim (another epoch) is left alone.
    pub async fn recover_unrun(
        &self,
        worker: &str,
        job: &str,
        epoch: u64,
    ) -> Result<Action, StoreError> {
        let said = Verdict::Gone("its live process says it does not run the job".into());
        self.recover_job_at(worker, job, &mut Verdicts::known(said), None, Some(epoch))
            .await
    }

    async fn recover_job_at(
        &self,
        worker: &str,
        job: &str,
        verdicts: &mut Verdicts,
        overdue: Option<Duration>,
        epoch: Option<u64>,
    ) -> Result<Action, StoreError> {
        let run_key = Key::Run {
            worker: worker.into(),
            job: job.into(),
        };
        for _ in 0..8 {
            let Some(cur) = self.jobs.get(job).await.map_err(StoreError::from_jobs)? else {
                // No record, so no epoch to judge by but the one we were asked about.
                let by = epoch.map_or(Remover::Anyone, Remover::Epoch);
                self.active.remove(&run_key, by).await?;
                return Ok(Action::Nothing("no record".into()));
            };
            if epoch.is_some_and(|e| e != cur.value.epoch) {
                return Ok(Action::Nothing("claimed again".into()));
            }
            // Only a running job of this worker needs its owner judged.
            let live = if cur.value.status == Status::Running.as_str()
                && cur.value.worker_id.as_deref() == Some(worker)
            {
                match verdicts
                    .of(&self.liveness, worker, cur.value.session.as_deref())
                    .await
                {
                    Verdict::Alive => cur.value.session.clone(),
                    Verdict::Gone(_) => None,
                    Verdict::Unknown(why) => {
                        return Ok(Action::Unsure(Verdict::Unknown(why).to_string()))
                    }
                }
            } else {
                None
            };
            let live = live.as_deref();
            let now = SystemTime::now();
            let decision = machine::reoffer_if(
                &cur.value,
                worker,
                live,
                overdue,
                now,
                0,
                self.max_stale_reclaims,
            );
            match decision {
                Reoffer::Nothing(why) => {
                    // Not (any more) this worker's running job: make the
                    // index agree with the record.
                    if Key::of(&cur.value).as_ref() != Some(&run_key) {
                        self.repair_moved_on(&cur.value, &run_key).await?;
                    }
                    return Ok(Action::Nothing(why));
                }
                Reoffer::Poison => {
                    let reason = format!(
                        "poison: its worker stopped {} times while running it (limit {}); the job keeps killing or stalling its workers",
                        cur.value.stale_reclaims + 1,
                        self.max_stale_reclaims
                    );
                    let w = worker.to_string();
                    let l = live.map(str::to_string);
                    let max = self.max_stale_reclaims;
                    let killed = self
                        .kill(job, "poison", &reason, move |r| {
                            matches!(
                                machine::reoffer_if(
                                    r,
                                    &w,
                                    l.as_deref(),
                                    overdue,
                                    SystemTime::now(),
                                    0,
                                    max
                                ),
                                Reoffer::Poison
                            )
                        })
                        .await?;
                    return Ok(match killed {
                        Killed::Now => Action::Poisoned,
                        Killed::Already => Action::Nothing("dead already".into()),
                        Killed::No => Action::Nothing("changed meanwhile".into()),
                    });
                }
                Reoffer::Cancelled(r) => match self.jobs.update(&r, cur.revision).await {
                    Ok(_) => {
                        // Not announced: the index entry stays, and its
                        // repair finishes the end (`repair_moved_on`).
                        self.announce_end(&r).await?;
                        let ev = events::event(
                            job,
                            r.epoch,
                            "cancelled",
                            None,
                            json!({"while": "owner_lost", "by": self.actor, "kind": r.kind}),
                        );
                        let _ = self
                            .events
                            .publish(&ev, Some(&events::terminal_event_id(&r, "cancelled")))
                            .await;
                        self.active.sync(&r, Some(&run_key)).await?;
                        return Ok(Action::Cancelled);
                    }
                    Err(JobsError::Conflict(_)) => continue,
                    Err(e) => return Err(StoreError::from_jobs(e)),
                },
                Reoffer::Queued(_) => {
                    let at = Reoffering {
                        worker,
                        live,
                        overdue,
                        now,
                        run_key: &run_key,
                    };
                    match self.reoffer_queued(job, &cur, at).await? {
                        Some(ticket_seq) => return Ok(Action::Reoffered { ticket_seq }),
                        None => continue,
                    }
                }
            }
        }
        Err(StoreError::failed(format!("job {job} keeps changing")))
    }

    /// Re-offers the running job `cur` whose owner is gone, its ticket
    /// first. `None`: the record changed meanwhile (read it again).
    async fn reoffer_queued(
        &self,
        job: &str,
        cur: &Versioned<JobRecord>,
        Reoffering {
            worker,
            live,
            overdue,
            now,
            run_key,
        }: Reoffering<'_>,
    ) -> Result<Option<u64>, StoreError> {
        let nonce = format!("r{}", cur.revision);
        let ticket = async {
            self.work
                .reissue(&cur.value, "reoffer", &nonce)
                .await
                .map(|p| p.seq)
        };
        let write = async |seq: u64| {
            let Reoffer::Queued(r) = machine::reoffer_if(
                &cur.value,
                worker,
                live,
                overdue,
                now,
                seq,
                self.max_stale_reclaims,
            ) else {
                unreachable!("same record, same decision")
            };
            match self.jobs.update(&r, cur.revision).await {
                Ok(_) => {}
                Err(JobsError::Conflict(_)) => return Ok(None),
                Err(e) => return Err(StoreError::from_jobs(e)),
            }
            // The notice before the index: it is lost if the
            // index write fails and this returns.
            let ev = events::event(
                job,
                r.epoch,
                "progress",
                None,
                json!({"phase": "recovered", "recovered": true, "reason": "owner_lost", "worker": worker, "ticket_seq": seq, "by": self.actor}),
            );
            let _ = self
                .events
                .publish(&ev, Some(&format!("{job}:recovered:{seq}")))
                .await;
            Ok(Some(*r))
        };
        let index = async |r: &JobRecord| self.active.sync(r, Some(run_key)).await;
        Ok(ticket_first(ticket, write, index)
            .await?
            .map(|r| r.ticket_seq))
    }

    /// Marks `id` dead (class `class`) if `still` holds for its record at
    /// the moment of the write, then finishes the dead-lettering (also when
    /// an earlier call wrote the death and stopped half-way).
    pub async fn kill<F>(
        &self,
        id: &str,
        class: &str,
        reason: &str,
        still: F,
    ) -> Result<Killed, StoreError>
    where
        F: Fn(&JobRecord) -> bool,
    {
        let mut wrote = false;
        let v = self
            .jobs
            .transition(id, |cur| {
                wrote = false;
                if !still(cur) {
                    return Ok(None);
                }
                wrote = true;
                machine::mark_dead(cur, SystemTime::now(), class, reason).map(Some)
            })
            .await
            .map_err(StoreError::from_jobs)?;
        if v.value.status != Status::Dead.as_str() {
            return Ok(Killed::No);
        }
        if wrote {
            tracing::warn!(job = %id, class, epoch = v.value.epoch, actor = %self.actor, "job marked dead");
            self.finish(&v.value, None, None).await?;
            Ok(Killed::Now)
        } else {
            self.finish_if_unfinished(&v.value).await?;
            Ok(Killed::Already)
        }
    }

    /// Finishes the dead-lettering of a dead record if its `dead` event is
    /// missing (a recoverer stopped half-way; its index entry, removed
    /// last, is what brings the job back here).
    pub async fn finish_if_unfinished(&self, rec: &JobRecord) -> Result<(), StoreError> {
        let last = self.events.last_of_type(&rec.id, "dead").await?;
        let covered = last.is_some_and(|(_, ev)| {
            let marked = ev
                .data_map()
                .get("marked_at")
                .and_then(|v| v.as_str().map(str::to_string));
            dead_event_covers(rec, ev.epoch, marked.as_deref())
        });
        if covered {
            for k in self.active.keys_of(&rec.id).await? {
                self.active.remove(&k, rec).await?;
            }
            return Ok(());
        }
        tracing::info!(job = %rec.id, "finishing an interrupted dead-lettering");
        self.finish(rec, None, None).await.map(|_| ())
    }

    /// Makes the index agree with a record that moved on from its entry
    /// `key`, once what the record's end left undone is done: a kill
    /// between a death and its dead letter, or between an owner's terminal
    /// write and its terminal event, is finished here, and the entry (the
    /// only pointer left to such a job) goes only after that.
    pub async fn repair_moved_on(&self, rec: &JobRecord, key: &Key) -> Result<(), StoreError> {
        if rec.status == Status::Dead.as_str() {
            self.finish_if_unfinished(rec).await?;
        }
        self.finish_terminal_if_unfinished(rec).await?;
        self.active.sync(rec, Some(key)).await
    }

    /// Announces the end of `rec` to its parent, if it is a child
    /// ([`crate::children::announce_end`]): every path that ends a job
    /// does, before its terminal event (the end's completion marker), so
    /// an end whose event is missing is announced when it is finished.
    /// A parent seen with a record a moment ago is not read again (a
    /// thousand children ending are not a thousand reads of it).
    pub async fn announce_end(&self, rec: &JobRecord) -> Result<(), StoreError> {
        crate::children::announce_end_seen(&self.jobs, &self.signals, &self.live_parents, rec).await
    }

    /// Publishes the terminal event of a finished (`completed`, `failed`,
    /// `cancelled`) record whose owner wrote the record but not the event
    /// (killed between the two, or LH_EVENTS refused it): without it the
    /// job's end is never seen by a client's stream, and retention, which
    /// reads terminal events, keeps the job for ever. Built from the record,
    /// under the owner's dedupe id ([`events::terminal_event_id`]), so an
    /// owner that was only slow publishes the same event. Nothing for
    /// another state, or when the event of this epoch is there.
    pub async fn finish_terminal_if_unfinished(&self, rec: &JobRecord) -> Result<(), StoreError> {
        let Some(ev) = terminal_event_of(rec, &self.actor) else {
            return Ok(());
        };
        let last = self
            .events
            .last_of_type_from_leader(&rec.id, &ev.r#type)
            .await?;
        if last.is_some_and(|(_, e)| e.epoch == rec.epoch) {
            return Ok(());
        }
        tracing::warn!(job = %rec.id, status = %rec.status, epoch = rec.epoch, actor = %self.actor, "finished job without its terminal event; publishing it");
        self.announce_end(rec).await?;
        self.events
            .publish(&ev, Some(&events::terminal_event_id(rec, &ev.r#type)))
            .await
            .map(|_| ())
    }

    /// The steps after a record became dead, each idempotent: the dead letter
    /// and the `dead` event are both deduplicated by the death's id; the
    /// event is published last, as the completion marker, after the ticket
    /// deletion; the index entries go last of all.
    pub async fn finish(
        &self,
        rec: &JobRecord,
        ticket: Option<&Ticket>,
        extra_seq: Option<u64>,
    ) -> Result<u64, StoreError> {
        let (class, reason) = rec
            .error
            .as_ref()
            .map(|e| (e.class.clone(), e.message.clone()))
            .unwrap_or_else(|| ("dead".into(), "dead-lettered".into()));
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
            .dead_with_id(rec, &class, &reason, recent, payload, &death_id(rec))
            .await?;
        for seq in [Some(rec.ticket_seq), extra_seq]
            .into_iter()
            .flatten()
            .filter(|s| *s > 0)
        {
            self.work.delete(seq).await?;
        }
        self.announce_end(rec).await?;
        let ev = events::event(
            &rec.id,
            rec.epoch,
            "dead",
            None,
            json!({"class": class, "reason": reason, "dlq_seq": dlq_seq, "marked_at": rec.error.as_ref().map(|e| e.at.clone()), "by": self.actor, "kind": rec.kind}),
        );
        self.events.publish(&ev, Some(&death_id(rec))).await?;
        for k in self.active.keys_of(&rec.id).await? {
            self.active.remove(&k, rec).await?;
        }
        tracing::info!(job = %rec.id, class, dlq_seq, "dead-lettered");
        Ok(dlq_seq)
    }
}

/// The verdicts of one recovery pass, one per recorded session (a worker's
/// jobs share it, so a pass asks once), or one given by the caller.
struct Verdicts {
    known: Option<Verdict>,
    lost_key_is_gone: bool,
    seen: std::collections::HashMap<Option<String>, Verdict>,
}

impl Verdicts {
    fn ask(lost_key_is_gone: bool) -> Self {
        Verdicts {
            known: None,
            lost_key_is_gone,
            seen: Default::default(),
        }
    }

    fn known(v: Verdict) -> Self {
        Verdicts {
            known: Some(v),
            lost_key_is_gone: false,
            seen: Default::default(),
        }
    }

    async fn of(&mut self, l: &Liveness, worker: &str, session: Option<&str>) -> Verdict {
        if let Some(v) = &self.known {
            return v.clone();
        }
        let k = session.map(str::to_string);
        if let Some(v) = self.seen.get(&k) {
            return v.clone();
        }
        let mut v = l.owner(worker, session, None).await;
        if self.lost_key_is_gone && v == Verdict::Unknown(Unsure::KeyLostButAnswers) {
            v = Verdict::Gone("it answers pings but did not write its session key again".into());
        }
        self.seen.insert(k, v.clone());
        v
    }
}

/// The terminal event a finished record stands for (`None` for any other
/// state, and for `dead` and `rejected`, which have their own finishers),
/// with what its owner would have said that the record keeps.
pub fn terminal_event_of(rec: &JobRecord, actor: &str) -> Option<JobEvent> {
    let status = status_of(rec)?;
    let mut data = match status {
        Status::Completed => {
            let r = rec.result.clone().unwrap_or_default();
            json!({"partial": r.partial, "artifact": r.artifact, "digest": r.digest})
        }
        Status::Failed => {
            let e = rec.error.clone().unwrap_or_default();
            json!({"class": e.class, "message": e.message, "attempts": rec.attempts})
        }
        Status::Cancelled => json!({}),
        _ => return None,
    };
    data["kind"] = json!(rec.kind);
    data["recovered_by"] = json!(actor);
    Some(events::event(
        &rec.id,
        rec.epoch,
        status.as_str(),
        rec.worker_id.as_deref(),
        data,
    ))
}

/// The id shared by every publication of one death (dead letter and `dead`
/// event), so recoverers finishing the same death publish once.
pub fn death_id(rec: &JobRecord) -> String {
    let marked = rec.error.as_ref().map(|e| e.at.as_str()).unwrap_or("");
    format!("{}:dead:{}:{marked}", rec.id, rec.epoch)
}

/// Whether a dead-lettering is complete: the job's last `dead` event
/// belongs to this death (same epoch, and the `marked_at` it carries is the
/// record's `error.at`, so a replayed job that dies again at the same epoch
/// is not mistaken for its earlier death; no clocks are compared).
pub fn dead_event_covers(rec: &JobRecord, event_epoch: u64, event_marked_at: Option<&str>) -> bool {
    let marked = rec.error.as_ref().map(|e| e.at.as_str());
    event_epoch == rec.epoch && (event_marked_at.is_none() || event_marked_at == marked)
}

/// Settings of the session-ends watcher.
#[derive(Debug, Clone)]
pub struct WatchOptions {
    /// How many looks a process that answers pings but does not write its
    /// session key again gets before its jobs are re-offered anyway.
    pub looks_at_a_lost_key: u64,
    /// The pause between two looks at such a process.
    pub look_again_after: Duration,
}

impl Default for WatchOptions {
    fn default() -> Self {
        WatchOptions {
            looks_at_a_lost_key: 3,
            look_again_after: Duration::from_secs(3),
        }
    }
}

/// Handles ended sessions until `shutdown`: one durable consumer shared by
/// every worker and reaper process, so each end is handled once, and by
/// someone even when no reaper runs.
pub async fn watch_session_ends(
    conn: Conn,
    recovery: Arc<Recovery>,
    opts: WatchOptions,
    shutdown: CancellationToken,
) {
    let stream = format!("KV_{}", conn.layout.sessions_bucket());
    let consumer = conn.layout.session_watch_consumer();
    crate::shared::consume(
        &conn,
        &stream,
        &consumer,
        4,
        "session ends",
        &shutdown,
        |m| on_session_message(&conn, &recovery, &opts, m),
    )
    .await
}

async fn on_session_message(
    conn: &Conn,
    recovery: &Recovery,
    opts: &WatchOptions,
    m: jetstream::Message,
) {
    if !m.headers.as_ref().is_some_and(crate::is_removal) {
        let _ = m.ack().await;
        return;
    }
    let prefix = format!("$KV.{}.", conn.layout.sessions_bucket());
    let Some(worker) = m.subject.strip_prefix(&prefix).map(str::to_string) else {
        let _ = m.ack().await;
        return;
    };
    let deliveries = m.info().map(|i| i.delivered.max(1) as u64).unwrap_or(1);
    // Keep the end while working on it: the consumer's ack wait is short,
    // shorter than the settle time after a reconnect.
    let progress = {
        let m = m.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_secs(1)).await;
                let _ = m.ack_with(AckKind::Progress).await;
            }
        })
    };
    // A server restart ends every session at once: after our own connection
    // came back, nobody is judged until the others had time to reconnect.
    while let Some(up) = recovery.liveness.settling() {
        let left = recovery.liveness.settle().saturating_sub(up);
        tokio::time::sleep(left.max(Duration::from_millis(50))).await;
    }
    let last_look = deliveries >= opts.looks_at_a_lost_key;
    let res = recovery.recover_worker(&worker, last_look).await;
    progress.abort();
    match res {
        Ok(_) => {
            let _ = m.ack().await;
        }
        Err(e) => {
            tracing::info!(worker, error = %e, actor = %recovery.actor, "an ended session's jobs are not all recovered; looking again");
            let _ = m.ack_with(AckKind::Nak(Some(opts.look_again_after))).await;
        }
    }
}
