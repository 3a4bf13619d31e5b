//! The sweep, every `--interval`, over the index of active jobs (never the
//! records): stranded running jobs recovered, waiting jobs' tickets checked
//! and replaced, disagreeing entries repaired, and a [`Metrics`] snapshot
//! published.

use super::*;

/// Tickets seen delivered but unclaimed, by sweep: a ticket is stuck only
/// when two sweeps saw it so, since one look may land in the milliseconds
/// between a worker's delivery and its claim.
#[derive(Default)]
pub(super) struct Unclaimed {
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
pub(super) const VERIFY_PER_SWEEP: usize = 256;

/// What a sweep log line tells: logged at info when it changed since the
/// last sweep (an idle reaper is quiet), else at debug.
pub(super) fn sweep_summary(m: &Metrics) -> (u64, u64, u64, u64, u64, u64) {
    (
        m.jobs,
        m.running,
        m.parked,
        m.sessions,
        m.recoveries,
        m.queue_depth,
    )
}

pub(super) async fn sweep_loop(inner: Arc<Inner>, shutdown: CancellationToken) {
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
                    waiting: m.waiting,
                    oldest_in_flight_age: m
                        .oldest_in_flight_age_s
                        .map(|a| Duration::from_secs_f64(a.max(0.0))),
                    dead_letters: m.dead_letters_by_kind.clone(),
                });
                inner.metrics.send_replace(m);
            }
            Err(e) => {
                inner.stats.sweep_failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(error = %e, "sweep failed; trying again at the next interval")
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(inner.opts.interval) => {}
            _ = shutdown.cancelled() => return,
        }
    }
}

/// How long a sweep waits for the reaper's view of the index to be read
/// whole (at its start, or after its watch was interrupted).
const VIEW_LOAD_WAIT: Duration = Duration::from_secs(30);

/// How many owners' liveness a sweep asks at once.
const OWNERS_AT_ONCE: usize = 32;

/// What a look at a waiting job found.
pub(super) enum WaitCheck {
    /// Nothing stuck (or it was mended): the next look after the grace.
    Later,
    /// Its ticket was delivered and is not claimed yet: looked at again at
    /// the next sweep, which decides.
    Soon,
}

impl Inner {
    /// One sweep over the reaper's live view of the index (a watch of
    /// `lh_active`, so the sweep reads no entry): each owner named by a
    /// running entry is judged once, and only the jobs of gone owners,
    /// attempts past their deadline and waiting jobs past their due time
    /// are acted on. Returns the metrics snapshot.
    pub(super) async fn sweep(&self) -> Result<Metrics, ReaperError> {
        let r = &self.recovery;
        let view = &self.view;
        if !view.loaded(VIEW_LOAD_WAIT).await {
            return Err(StoreError::Unavailable(
                "the reaper's view of the index is still being read".into(),
            )
            .into());
        }
        let now = SystemTime::now();
        let skew = self.opts.clock_skew;
        let shards = self.shards.borrow().clone();
        // One verdict per owner (a worker's jobs share its session).
        let verdicts: HashMap<Owner, Verdict> = futures::stream::iter(view.owners())
            .map(|o| async move {
                let v = r.liveness.owner(&o.0, o.1.as_deref(), None).await;
                (o, v)
            })
            .buffer_unordered(OWNERS_AT_ONCE)
            .collect()
            .await;
        let log = |key: &Key, e: ReaperError| tracing::warn!(key = %key.as_string(), error = %e, "reaper action failed; retrying at the next sweep");
        for (owner, verdict) in &verdicts {
            match verdict {
                Verdict::Alive => continue,
                Verdict::Unknown(_) => {
                    tracing::debug!(worker = %owner.0, %verdict, "owner's liveness unknown; the next sweep asks again");
                    continue;
                }
                Verdict::Gone(_) => {}
            }
            for key in view.runs_of(owner) {
                if !shards.mine(key.job())
                    || decide::running_action(None, verdict, now, skew) != RunningAction::OwnerGone
                {
                    continue;
                }
                let Key::Run { worker, job } = &key else {
                    continue;
                };
                match r.recover_job(worker, job, None).await {
                    Ok(a) => self.stats.count(&a),
                    Err(e) => log(&key, e.into()),
                }
            }
        }
        for (key, owner, deadline) in view.deadlines_by(now.checked_sub(skew).unwrap_or(now)) {
            let Some(verdict) = verdicts.get(&owner) else {
                continue;
            };
            if decide::running_action(Some(deadline), verdict, now, skew) != RunningAction::Overdue
            {
                continue;
            }
            let Key::Run { worker, job } = &key else {
                continue;
            };
            tracing::warn!(
                job,
                worker,
                "attempt past its deadline while its worker lives; re-offering it"
            );
            match r.recover_job(worker, job, Some(skew)).await {
                Ok(a) => self.stats.count(&a),
                Err(e) => log(&key, e.into()),
            }
        }
        for key in view.waits_by(decide::stranded_before(now, self.opts.stranded_grace)) {
            let Key::Wait { job } = &key else { continue };
            if !shards.mine(job) {
                continue;
            }
            match self.check_waiting(job, &key).await {
                Ok(WaitCheck::Later) => view.put_off(&key, now + self.opts.stranded_grace),
                Ok(WaitCheck::Soon) => {}
                Err(e) => log(&key, e),
            }
        }
        self.unclaimed.lock().unwrap().next_sweep();
        self.verify_some(&verdicts, &shards).await;
        let depth = self.queue_depth().await;
        let dlq = self.dlq_by_kind().await;
        let live_workers: std::collections::HashSet<&Arc<str>> = verdicts
            .iter()
            .filter(|(_, v)| v.is_alive())
            .map(|((w, _), _)| w)
            .collect();
        let mut tally = Tally::of(&view.counts(), now);
        tally.set_queue(depth, live_workers.len() as u64, dlq);
        self.stats.sweeps.fetch_add(1, Ordering::Relaxed);
        let mut m = tally.finish(&self.id, now, self.stats.counters());
        m.sessions = self.count_sessions().await.unwrap_or(m.sessions);
        m.shards = shards.owned();
        m.reapers = shards.members().len() as u32;
        Ok(m)
    }

    /// Compares a rotating window of running entries whose owners live
    /// with their records: an entry left behind by a crash between a record
    /// write and its index write is repaired (in this reaper's shards), and
    /// an entry whose record moved on leaves this reaper's view whatever its
    /// shard (its counts stay true even when the entry came from a replica
    /// that kept it after the leader removed it).
    pub(super) async fn verify_some(
        &self,
        verdicts: &HashMap<Owner, Verdict>,
        shards: &leasehold_core::shard::Shards,
    ) {
        let cursor = self.verify_cursor.lock().unwrap().clone();
        let window = self.view.runs_after(cursor.as_ref(), VERIFY_PER_SWEEP);
        if let Some((last, _)) = window.last() {
            *self.verify_cursor.lock().unwrap() = Some(last.clone());
        }
        let mut held = Vec::new();
        for (key, owner) in window {
            if !verdicts.get(&owner).is_some_and(Verdict::is_alive) {
                continue;
            }
            let Key::Run { worker, job } = &key else {
                continue;
            };
            let (worker, job) = (worker.clone(), job.clone());
            let mine = shards.mine(&job);
            match self.recovery.jobs.get(&job).await {
                Ok(Some(v)) if Key::of(&v.value).as_ref() == Some(&key) => {
                    if mine {
                        held.push((worker, job, v.value.epoch));
                    }
                }
                Ok(Some(v)) if !mine => self.view.forget(&key, v.value.epoch),
                Ok(Some(v)) => match self.recovery.repair_moved_on(&v.value, &key).await {
                    Ok(()) => {
                        self.stats.index_repairs.fetch_add(1, Ordering::Relaxed);
                        self.view.forget(&key, v.value.epoch);
                    }
                    Err(e) => {
                        tracing::debug!(job, error = %e, "verify: entry kept until the job's end is finished")
                    }
                },
                Ok(None) if !mine => {}
                Ok(None) => {
                    if self
                        .recovery
                        .active
                        .remove(&key, leasehold_store::index::Remover::Anyone)
                        .await
                        .is_ok()
                    {
                        self.stats.index_repairs.fetch_add(1, Ordering::Relaxed);
                        self.view.forget(&key, u64::MAX);
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
    pub(super) async fn ask_owners(&self, held: Vec<(String, String, u64)>) {
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
                    self.stats.count(&a)
                }
                Err(e) => tracing::warn!(job, error = %e, "cannot re-offer an unrun job"),
            }
        }
    }

    /// A waiting job past its due time by the grace: repair the index if
    /// the record moved on; otherwise make sure it has a ticket that a
    /// worker will actually be given.
    pub(super) async fn check_waiting(
        &self,
        job: &str,
        key: &Key,
    ) -> Result<WaitCheck, ReaperError> {
        let r = &self.recovery;
        let Some(cur) = r.jobs.get(job).await? else {
            r.active
                .remove(key, leasehold_store::index::Remover::Anyone)
                .await?;
            return Ok(WaitCheck::Later);
        };
        let rec = cur.value;
        if Key::of(&rec).as_ref() != Some(key) {
            if rec.status == Status::Dead.as_str() {
                r.finish_if_unfinished(&rec).await?;
            }
            r.active.sync(&rec, Some(key)).await?;
            self.stats.index_repairs.fetch_add(1, Ordering::Relaxed);
            return Ok(WaitCheck::Later);
        }
        if rec.cancel_requested {
            self.cancel_waiting(job, Some(key)).await?;
            return Ok(WaitCheck::Later);
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
                return Ok(WaitCheck::Later);
            }
            if !self
                .unclaimed
                .lock()
                .unwrap()
                .seen_again(job, rec.ticket_seq)
            {
                return Ok(WaitCheck::Soon);
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
            .await?;
        Ok(WaitCheck::Later)
    }

    /// Cancels a waiting job whose cancel was requested (a claim would
    /// honour it, but nothing is claiming it), and makes the index agree;
    /// `stale` is its index key when known.
    pub(super) async fn cancel_waiting(
        &self,
        job: &str,
        stale: Option<&Key>,
    ) -> Result<(), ReaperError> {
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
    pub(super) async fn replace_ticket(
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
    pub(super) async fn queue_depth(&self) -> Queue {
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

    pub(super) async fn dlq_by_kind(&self) -> BTreeMap<String, u64> {
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

    /// The live sessions: the view's count, or while it is being read a
    /// listing of the bucket.
    pub(super) async fn count_sessions(&self) -> Option<u64> {
        if let Some(n) = self.live.count() {
            return Some(n);
        }
        let mut keys = self.recovery.sessions.kv().keys().await.ok()?;
        let mut n = 0;
        while let Some(Ok(_)) = keys.next().await {
            n += 1;
        }
        Some(n)
    }
}
