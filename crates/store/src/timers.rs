//! Due-time wake-ups: a job that waits for a time holds no ticket.
//!
//! A ticket delivered long before its job is due (a `run_at`/`delay`, a
//! long backoff) would sit in its consumer's pending set, and against its
//! `max_ack_pending`, for the whole wait. Instead the worker *releases* it
//! ([`release`]): the wake-up key `due.<job>` in `lh_active` first (its
//! value is the job's index [`Entry`], with the due time), then the record
//! says it has no ticket (`ticket_seq` 0, conditioned on the revision
//! read), then the ticket is acked. The key covers the job from then on:
//! every active job stays covered by its index entry or a ticket.
//!
//! Every worker (for its kinds) and every reaper keeps the wake-up keys in
//! memory ([`run`]: a watch of `due.>`, initial values then changes) and
//! sleeps until the earliest. At its time [`wake`] gives the job its ticket
//! through [`reticket`], the one way a waiting job gets a fresh ticket (the
//! reaper's stranded-wait check uses it too): published first with a dedupe
//! id from the record's revision, so any number of wakers publish one
//! ticket, then the record pointed at it, conditioned. The key is removed
//! last, conditioned on the revision judged, so a later release's key is
//! kept. A waker stopped half-way leaves the key, and the next waker (any
//! process, after a restart too) finishes.
//!
//! The keys and the loop know nothing about why a job waits: a delayed
//! job (`queued`, its ticket released), a durable timer (`waiting`, a
//! step that sleeps) and a signal's timeout are woken alike; a waiting job
//! becomes `queued` on its fresh ticket (`machine::wake`). A job that waits
//! for a signal is woken by the signal's waker (`crate::signals`) through
//! the same [`wake`].

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, SystemTime};

use async_nats::jetstream::kv;
use futures::StreamExt;
use leasehold_core::time::{parse_rfc3339, rfc3339};
use leasehold_core::{machine, JobRecord, Status};
use tokio_util::sync::CancellationToken;

use crate::index::{Entry, Key};
use crate::recovery::Recovery;
use crate::work::{ticket_first, Published};
use crate::{JobsError, StoreError};

/// How long the marker of a removed wake-up key stays.
const REMOVED_MARKER_TTL: Duration = Duration::from_secs(60);

/// How long a waker waits before it tries a failed wake-up again.
const RETRY: Duration = Duration::from_secs(1);

/// The reason in a re-issued ticket's dedupe id ([`crate::work::reissue_id`]):
/// the same for every path that gives a waiting job a fresh ticket, so two
/// of them acting on one revision publish one ticket.
const RETICKET: &str = "stranded";

/// Why a wake-up did not finish.
#[derive(Debug, thiserror::Error)]
pub enum DueError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error(transparent)]
    Jobs(#[from] JobsError),
}

/// What [`wake`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Woken {
    /// The job got its ticket (this call's, or another waker's same one).
    Ticketed(u64),
    /// Nothing to do: the job is gone, not waiting, or has a ticket.
    Nothing,
    /// Not due yet: wake it at this time.
    Later(SystemTime),
}

/// The wake-up key of `job`.
pub fn key(job: &str) -> String {
    format!("due.{job}")
}

/// The due time of a wake-up entry (its record's `next_run_at`).
pub fn due_at(e: &Entry) -> SystemTime {
    e.next_run_at
        .as_deref()
        .and_then(parse_rfc3339)
        .unwrap_or(SystemTime::UNIX_EPOCH)
}

/// Writes the wake-up key of waiting job `rec` (due at its `next_run_at`).
pub async fn set(r: &Recovery, rec: &JobRecord) -> Result<(), StoreError> {
    let value = serde_json::to_vec(&Entry::of(rec)).expect("entry serializes");
    r.active
        .kv()
        .put(key(&rec.id), value.into())
        .await
        .map(|_| ())
        .map_err(|e| StoreError::nats("wake-up put", e))
}

/// Releases the ticket of waiting job `rec` (read at `revision`), which is
/// not due for a while: the wake-up key (a job that waits only for a
/// signal has no time, and no key: the signal's waker wakes it), then the
/// record without a ticket (conditioned), then the index entry. The caller
/// acks the ticket after `Ok`. `Err(JobsError::Conflict)`: the record
/// changed; decide again.
pub async fn release(r: &Recovery, rec: &JobRecord, revision: u64) -> Result<(), DueError> {
    if rec.next_run_at.is_some() {
        set(r, rec).await?;
    }
    if rec.ticket_seq == 0 {
        return Ok(());
    }
    let mut next = rec.clone();
    next.ticket_seq = 0;
    next.updated_at = rfc3339(SystemTime::now());
    r.jobs.update(&next, revision).await?;
    if let Some(k) = Key::of(&next) {
        if let Err(e) = r.active.put(&k, &next).await {
            tracing::debug!(job = %next.id, error = %e, "released job's index entry not updated; its record decides");
        }
    }
    Ok(())
}

/// Gives waiting job `rec` (read at `revision`) a fresh ticket in place of
/// ticket `lost` (0: it has none): published first (deduplicated by the
/// revision, so every caller acting on it publishes one), then the record
/// pointed at it, conditioned (not when it moved on, or has a newer ticket
/// meanwhile). `Some` when the record now names this ticket.
pub async fn reticket(
    r: &Recovery,
    rec: &JobRecord,
    revision: u64,
    lost: u64,
) -> Result<Option<Published>, DueError> {
    let nonce = format!("r{revision}");
    let ticket = async { Ok::<_, DueError>(r.work.reissue(rec, RETICKET, &nonce).await?) };
    let write = async |published: Published| {
        let now = r
            .jobs
            .transition(&rec.id, |c| {
                if c.status == Status::Waiting.as_str() {
                    return Ok(machine::wake(c, SystemTime::now(), published.seq));
                }
                if c.status != Status::Queued.as_str() || c.ticket_seq > lost {
                    return Ok(None);
                }
                let mut n = c.clone();
                n.ticket_seq = published.seq;
                n.updated_at = rfc3339(SystemTime::now());
                Ok(Some(n))
            })
            .await?;
        Ok((now.value.ticket_seq == published.seq).then_some((now.value, published)))
    };
    // A woken job's `hold` entry gives way to its `wait` entry.
    let held = (rec.status == Status::Waiting.as_str()).then(|| Key::Hold {
        job: rec.id.clone(),
    });
    let index = async |(now, _): &(JobRecord, Published)| {
        if let Err(e) = r.active.sync(now, held.as_ref()).await {
            tracing::debug!(job = %rec.id, error = %e, "re-ticketed job's index entry not updated; its record decides");
        }
        Ok(())
    };
    Ok(ticket_first(ticket, write, index).await?.map(|(_, p)| p))
}

/// Wakes `job` if its wait is over (its time came, or the signal it waits
/// for is there: [`machine::wait_over`]) and it is still without a ticket.
/// The one wake of the wake-up loop, the signal waker and an owner's look
/// after its `waiting` write.
pub async fn wake(r: &Recovery, job: &str) -> Result<Woken, DueError> {
    let Some(cur) = r.jobs.get(job).await? else {
        return Ok(Woken::Nothing);
    };
    let rec = &cur.value;
    let waits = rec.status == Status::Waiting.as_str()
        || (rec.status == Status::Queued.as_str() && rec.ticket_seq == 0);
    if !waits {
        return Ok(Woken::Nothing);
    }
    let signalled = r.signals.arrived(rec).await?;
    if !machine::wait_over(rec, SystemTime::now(), signalled) {
        let at = rec.next_run_at.as_deref().and_then(parse_rfc3339);
        return Ok(at.map_or(Woken::Nothing, Woken::Later));
    }
    Ok(match reticket(r, rec, cur.revision, 0).await? {
        Some(p) => Woken::Ticketed(p.seq),
        None => Woken::Nothing,
    })
}

/// Removes the wake-up key of `job` if it is still at `revision`.
async fn clear(r: &Recovery, job: &str, revision: u64) -> Result<(), StoreError> {
    match r
        .active
        .kv()
        .purge_expect_revision_with_ttl(key(job), revision, REMOVED_MARKER_TTL)
        .await
    {
        Ok(()) => Ok(()),
        // Set again meanwhile (a later release): that key is kept.
        Err(e) if e.kind() == kv::PurgeErrorKind::WrongLastRevision => Ok(()),
        Err(e) => Err(StoreError::nats("wake-up remove", e)),
    }
}

/// The wake-ups a process holds: by due time, and by job.
#[derive(Default)]
struct Pending {
    by_time: BTreeSet<(SystemTime, String)>,
    /// Per job: its due time and the key's revision.
    jobs: HashMap<String, (SystemTime, u64)>,
}

impl Pending {
    fn insert(&mut self, job: &str, at: SystemTime, revision: u64) {
        self.remove(job);
        self.by_time.insert((at, job.to_string()));
        self.jobs.insert(job.to_string(), (at, revision));
    }

    fn remove(&mut self, job: &str) {
        if let Some((at, _)) = self.jobs.remove(job) {
            self.by_time.remove(&(at, job.to_string()));
        }
    }

    fn next(&self) -> Option<SystemTime> {
        self.by_time.first().map(|(t, _)| *t)
    }

    /// Takes the wake-ups due at `now`: (job, key revision).
    fn take_due(&mut self, now: SystemTime) -> Vec<(String, u64)> {
        let mut out = Vec::new();
        while let Some((at, job)) = self.by_time.first().cloned() {
            if at > now {
                break;
            }
            self.by_time.pop_first();
            if let Some((_, rev)) = self.jobs.remove(&job) {
                out.push((job, rev));
            }
        }
        out
    }
}

/// Wakes the waiting jobs of `kinds` (`None`: every kind) at their due
/// times, until `shutdown`. Shared by workers and reapers, so a delayed job
/// runs at its time without a reaper.
pub async fn run(
    r: std::sync::Arc<Recovery>,
    kinds: Option<Vec<String>>,
    shutdown: CancellationToken,
) {
    let ours = |kind: &str| kinds.as_ref().is_none_or(|k| k.iter().any(|x| x == kind));
    'watch: loop {
        let mut watch = match r.active.kv().watch_with_history("due.>").await {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(error = %e, "cannot watch the wake-ups; retrying");
                tokio::select! {
                    _ = tokio::time::sleep(RETRY) => continue 'watch,
                    _ = shutdown.cancelled() => return,
                }
            }
        };
        let mut pending = Pending::default();
        loop {
            let sleep = pending
                .next()
                .map(|t| t.duration_since(SystemTime::now()).unwrap_or_default())
                .unwrap_or(Duration::from_secs(3600));
            tokio::select! {
                change = watch.next() => match change {
                    Some(Ok(e)) => {
                        let Some(job) = e.key.strip_prefix("due.") else { continue };
                        if e.operation != kv::Operation::Put {
                            pending.remove(job);
                            continue;
                        }
                        match serde_json::from_slice::<Entry>(&e.value) {
                            Ok(entry) if ours(&entry.kind) => {
                                pending.insert(job, due_at(&entry), e.revision)
                            }
                            Ok(_) => {}
                            Err(err) => tracing::warn!(key = %e.key, error = %err, "unreadable wake-up; skipped"),
                        }
                    }
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "wake-up watch interrupted; watching again");
                        continue 'watch;
                    }
                    None => continue 'watch,
                },
                _ = tokio::time::sleep(sleep) => {
                    for (job, revision) in pending.take_due(SystemTime::now()) {
                        match wake(&r, &job).await {
                            Ok(Woken::Later(at)) => pending.insert(&job, at, revision),
                            Ok(w) => {
                                if let Woken::Ticketed(seq) = w {
                                    tracing::debug!(job, ticket = seq, "due: ticket re-issued");
                                }
                                if let Err(e) = clear(&r, &job, revision).await {
                                    tracing::debug!(job, error = %e, "wake-up key left; the next waker removes it");
                                }
                            }
                            Err(e) => {
                                tracing::warn!(job, error = %e, "wake-up failed; trying again shortly");
                                pending.insert(&job, SystemTime::now() + RETRY, revision);
                            }
                        }
                    }
                }
                // A server that restarted lost the watch's consumer: watch
                // again at once rather than after its missed heartbeats.
                _ = r.liveness.link().reconnected() => continue 'watch,
                _ = shutdown.cancelled() => return,
            }
        }
    }
}
