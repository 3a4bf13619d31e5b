//! The job KV bucket (`lh_jobs`): every write is conditioned on the revision
//! it read.
//!
//! Reads can be stale (KV reads give no read-after-write guarantee, least of
//! all on replicas), so no decision is ever trusted because of a read alone:
//! [`Jobs::transition`] reads, decides with a pure function, and writes
//! conditioned on the revision it read; a conflict re-reads and decides again.
//! A spurious cluster rejection (10164) is a conflict like any other, so it
//! re-reads and retries and is never mistaken for lost ownership.
//!
//! [`Gate`] is the one door of owner-side writes: every transition it makes
//! first proves `status == running`, `worker_id`, `claim_token` and `epoch`
//! (see `leasehold_core::machine::check_owner`).

use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use async_nats::jetstream::kv;
use bytes::Bytes;
use futures::StreamExt;
use leasehold_core::machine::{self, Owner, TransitionError};
use leasehold_core::{JobRecord, JobSpec};
use serde_json::json;

use crate::{server_error_code, Conn, StoreError, WRONG_LAST_SEQUENCE_CONSTANT};

/// A value together with the KV revision it was read at.
#[derive(Debug, Clone, PartialEq)]
pub struct Versioned<T> {
    pub value: T,
    pub revision: u64,
}

/// Errors of job-record reads and writes.
#[derive(Debug, thiserror::Error)]
pub enum JobsError {
    /// The record changed since it was read (server 10071, or the spurious
    /// 10164): re-read and decide again.
    #[error("revision conflict on job {0}")]
    Conflict(String),
    /// `create` found the key already present.
    #[error("job {0} already exists")]
    Exists(String),
    #[error("no job {0}")]
    NotFound(String),
    /// The state machine refused the transition (including ownership lost).
    #[error(transparent)]
    Transition(#[from] TransitionError),
    #[error("job {id} has an unreadable record: {message}")]
    Corrupt { id: String, message: String },
    /// NATS did not answer or failed: transient, retry later. The cause
    /// is kept as the error's source.
    #[error("NATS: {context}: {source}")]
    Nats {
        /// What was being done (`read job j1`).
        context: String,
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The owner's session was not confirmed recently enough to act on it
    /// (the process was paused, or cut off from NATS): wait for a renewal.
    #[error("this worker's session was last confirmed {0:?} ago; not acting until it is renewed")]
    SessionStale(std::time::Duration),
}

impl JobsError {
    /// NATS failed while doing `context`, for the reason `source`.
    pub fn nats(
        context: impl Into<String>,
        source: impl Into<Box<dyn std::error::Error + Send + Sync>>,
    ) -> JobsError {
        JobsError::Nats {
            context: context.into(),
            source: source.into(),
        }
    }

    pub fn is_ownership_lost(&self) -> bool {
        matches!(
            self,
            JobsError::Transition(TransitionError::OwnershipLost(_))
        )
    }

    /// Worth retrying the same operation after a pause.
    pub fn is_transient(&self) -> bool {
        matches!(
            self,
            JobsError::Nats { .. } | JobsError::Conflict(_) | JobsError::SessionStale(_)
        )
    }
}

/// Whether the stored record `read` is the write `tried` (the flags of
/// values kept beside it aside: the stored form sets them).
fn same_write(tried: &JobRecord, read: &JobRecord) -> bool {
    let norm = |r: &JobRecord| {
        let mut r = r.clone();
        r.input_beside = false;
        r.output_beside = false;
        r
    };
    norm(tried) == norm(read)
}

/// A write error, with what to do when it is the bucket's byte bound (a
/// full bucket refuses writes; nothing is dropped, and the writer retries).
fn full_hint(e: &(dyn std::error::Error + 'static)) -> String {
    match server_error_code(e) {
        Some(crate::STREAM_FULL_BYTES | crate::STREAM_FULL_MSGS) => format!(
            "the job records' bucket is full ({e}): writes wait until there is room; raise its bound (`leasehold setup --jobs-max-bytes`) or let retention remove finished jobs"
        ),
        _ => e.to_string(),
    }
}

/// Inputs and outputs larger than this live beside the record (in the
/// payloads bucket), so the record every owner write rewrites stays small.
pub const INLINE_MAX: usize = 16 * 1024;

/// The payloads key of `rec`'s input when it is kept beside the record:
/// `<id>.input`, or the key a replaced spec named.
pub fn input_key(rec: &JobRecord) -> String {
    rec.input_key
        .clone()
        .unwrap_or_else(|| format!("{}.input", rec.id))
}

/// Gives `rec` the corrected `spec` (a `dlq replay --spec`): its input is
/// kept in the record or, when large, beside it under a key of its own,
/// `<id>.input.<SHA-256 of the input>`. The original's `<id>.input` is
/// create-if-absent, so writing the new input there would keep the old
/// one; a key named by the content is the same for every writer of the
/// same input, so create-if-absent stays right for it.
pub fn replace_spec(rec: &mut JobRecord, spec: &JobSpec) {
    use sha2::Digest;
    rec.input_beside = false;
    rec.input_key = (spec.input.len() > INLINE_MAX).then(|| {
        let digest = sha2::Sha256::digest(spec.input.as_bytes());
        let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
        format!("{}.input.{hex}", rec.id)
    });
    rec.spec = Some(spec.clone());
}

/// The job-record bucket (and the payloads kept beside its records).
#[derive(Clone)]
pub struct Jobs {
    /// Shared, not copied: a `kv::Store` carries its stream's whole info,
    /// and every attempt's gate holds a `Jobs` (a clone per job was a tenth
    /// of a worker's time per echo job).
    kv: Arc<kv::Store>,
    payloads: Arc<kv::Store>,
    /// Writes lost with a leader are asked again at its successor's
    /// election ([`crate::failover`]).
    elections: crate::failover::Elections,
}

/// How many times a read-decide-write loop re-reads after conflicts before
/// reporting the conflict (a record written this often in a row is contended
/// by something broken).
const MAX_CONFLICTS: usize = 32;

impl Jobs {
    pub async fn open(conn: &Conn) -> Result<Self, StoreError> {
        let kv = crate::open_kv(conn, &conn.layout.jobs_bucket()).await?;
        let payloads = crate::open_kv(conn, &conn.layout.payloads_bucket()).await?;
        Ok(Jobs {
            kv: Arc::new(kv),
            payloads: Arc::new(payloads),
            elections: conn.elections(),
        })
    }

    /// Moves a large input (and output) of `rec` beside it, once: the
    /// payload is written, the flag set; `rec` keeps its full values in
    /// memory (only the stored form leaves them out).
    pub async fn externalize(&self, rec: &mut JobRecord) -> Result<(), JobsError> {
        if !rec.input_beside {
            if let Some(spec) = rec.spec.as_ref().filter(|s| s.input.len() > INLINE_MAX) {
                let key = input_key(rec);
                // Create-if-absent: an id reused by another submission must
                // never replace the input of the job that holds the id (a
                // replaced spec names a key of its own, see `replace_spec`).
                match self.payloads.create(&key, spec.input.clone().into()).await {
                    Ok(_) => {}
                    Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {}
                    Err(e) => return Err(JobsError::nats(format!("store input of {}", rec.id), e)),
                }
                rec.input_beside = true;
            }
        }
        if !rec.output_beside {
            if let Some(out) = rec.result.as_ref().filter(|r| r.output.len() > INLINE_MAX) {
                let key = format!("{}.output.{}", rec.id, rec.epoch);
                self.payloads
                    .put(&key, out.output.clone().into())
                    .await
                    .map_err(|e| JobsError::nats(format!("store output of {}", rec.id), e))?;
                rec.output_beside = true;
            }
        }
        Ok(())
    }

    /// Fills in what [`Jobs::externalize`] moved beside the record, read
    /// from the payloads stream's leader like the record itself: a direct
    /// get may be answered by a replica still catching up, whose "no such
    /// key" for a payload written seconds before would fail the job for an
    /// input it has, or serve an empty result. A payload the leader lacks
    /// is left empty; the caller decides what that means.
    async fn internalize(&self, rec: &mut JobRecord) -> Result<(), JobsError> {
        let fetch = |key: String| async move {
            match crate::from_leader(&self.payloads, &key).await {
                Ok(v) => Ok(v.map(|(_, p)| String::from_utf8_lossy(&p).into_owned())),
                Err(e) => Err(JobsError::nats(format!("read {key}"), e)),
            }
        };
        if rec.input_beside {
            let key = input_key(rec);
            if let Some(spec) = rec.spec.as_mut().filter(|s| s.input.is_empty()) {
                spec.input = fetch(key).await?.unwrap_or_default();
            }
        }
        if rec.output_beside {
            let key = format!("{}.output.{}", rec.id, rec.epoch);
            if let Some(res) = rec.result.as_mut().filter(|r| r.output.is_empty()) {
                res.output = fetch(key).await?.unwrap_or_default();
            }
        }
        Ok(())
    }

    /// The stored form: large values beside, flags set.
    async fn stored(&self, rec: &JobRecord) -> Result<Bytes, JobsError> {
        let mut r = rec.clone();
        self.externalize(&mut r).await?;
        if r.input_beside {
            if let Some(spec) = r.spec.as_mut() {
                spec.input.clear();
            }
        }
        if r.output_beside {
            if let Some(res) = r.result.as_mut() {
                res.output.clear();
            }
        }
        encode(&r)
    }

    pub fn kv(&self) -> &kv::Store {
        &self.kv
    }

    /// The record and its revision, if it exists, as the bucket's stream
    /// leader has it. Every decision reads here, so no read is older than
    /// the last write acknowledged: a direct get may be answered by any
    /// replica (on R3 a restarted node still catching up answers "no such
    /// key" for a record written seconds before), and a decision taken on
    /// such a read (an index entry removed, a write given up as "no job")
    /// can strand a job. Watches stay as they are (they follow, never decide).
    pub async fn get(&self, id: &str) -> Result<Option<Versioned<JobRecord>>, JobsError> {
        let Some((revision, payload)) = crate::from_leader(&self.kv, id)
            .await
            .map_err(|e| JobsError::nats(format!("read job {id}"), e))?
        else {
            return Ok(None);
        };
        let mut value = decode(id, &payload)?;
        if value.input_beside || value.output_beside {
            self.internalize(&mut value).await?;
        }
        Ok(Some(Versioned { value, revision }))
    }

    /// Creates the record only if the key is absent.
    pub async fn create(&self, rec: &JobRecord) -> Result<u64, JobsError> {
        let stored = self.stored(rec).await?;
        let create = || self.kv.create(&rec.id, stored.clone());
        match self.elections.reissue("create a job record", create).await {
            Ok(rev) => Ok(rev),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => {
                Err(JobsError::Exists(rec.id.clone()))
            }
            Err(e) if server_error_code(&e) == Some(WRONG_LAST_SEQUENCE_CONSTANT) => {
                Err(JobsError::Conflict(rec.id.clone()))
            }
            Err(e) => Err(JobsError::nats(
                format!("create job {}", rec.id),
                full_hint(&e),
            )),
        }
    }

    /// Writes `recs` without any revision check, as asynchronous publishes
    /// whose acks are awaited together: only for seeding a bench's bucket
    /// with many records fast, never for a live job's record.
    pub async fn seed(
        &self,
        js: &async_nats::jetstream::Context,
        recs: &[JobRecord],
    ) -> Result<(), JobsError> {
        let prefix = self
            .kv
            .put_prefix
            .clone()
            .unwrap_or_else(|| self.kv.prefix.clone());
        let nats =
            |e: async_nats::jetstream::context::PublishError| JobsError::nats("seed records", e);
        let mut acks = Vec::with_capacity(recs.len());
        for r in recs {
            acks.push(
                js.publish(format!("{prefix}{}", r.id), encode(r)?)
                    .await
                    .map_err(nats)?,
            );
        }
        for a in acks {
            a.await.map_err(nats)?;
        }
        Ok(())
    }

    /// Writes `rec` only if the record is still at `expected` revision.
    pub async fn update(&self, rec: &JobRecord, expected: u64) -> Result<u64, JobsError> {
        let stored = self.stored(rec).await?;
        let update = || self.kv.update(&rec.id, stored.clone(), expected);
        match self.elections.reissue("update a job record", update).await {
            Ok(rev) => Ok(rev),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => {
                Err(JobsError::Conflict(rec.id.clone()))
            }
            Err(e) if server_error_code(&e) == Some(WRONG_LAST_SEQUENCE_CONSTANT) => {
                tracing::debug!(job = %rec.id, "spurious 10164 on update; re-reading");
                Err(JobsError::Conflict(rec.id.clone()))
            }
            Err(e) => Err(JobsError::nats(
                format!("update job {}", rec.id),
                full_hint(&e),
            )),
        }
    }

    /// Read, decide, write conditioned on the revision read; on a conflict
    /// read again and decide again. `decide` returns `Ok(None)` when there is
    /// nothing to write (the current record is returned then).
    pub async fn transition<F>(
        &self,
        id: &str,
        mut decide: F,
    ) -> Result<Versioned<JobRecord>, JobsError>
    where
        F: FnMut(&JobRecord) -> Result<Option<JobRecord>, TransitionError>,
    {
        for _ in 0..MAX_CONFLICTS {
            let cur = self
                .get(id)
                .await?
                .ok_or_else(|| JobsError::NotFound(id.to_string()))?;
            let Some(next) = decide(&cur.value)? else {
                return Ok(cur);
            };
            match self.update(&next, cur.revision).await {
                Ok(revision) => {
                    return Ok(Versioned {
                        value: next,
                        revision,
                    })
                }
                Err(JobsError::Conflict(_)) => continue,
                Err(e) => return Err(e),
            }
        }
        Err(JobsError::Conflict(id.to_string()))
    }

    /// Every job id in the bucket.
    pub async fn ids(&self) -> Result<Vec<String>, JobsError> {
        let mut keys = self
            .kv
            .keys()
            .await
            .map_err(|e| JobsError::nats("list jobs", e))?;
        // A key updated while the listing runs can be delivered twice.
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::new();
        while let Some(k) = keys.next().await {
            let k = k.map_err(|e| JobsError::nats("list jobs", e))?;
            if seen.insert(k.clone()) {
                out.push(k);
            }
        }
        Ok(out)
    }

    /// Every record (a scan of the whole history: only `leasehold list
    /// --all` uses it; everything periodic reads the index of active jobs).
    /// An unreadable record is skipped and reported in `corrupt`, never
    /// aborting the listing.
    pub async fn all(&self) -> Result<Listing, JobsError> {
        let mut out = Listing::default();
        for id in self.ids().await? {
            match self.get(&id).await {
                Ok(Some(v)) => out.records.push(v),
                Ok(None) => {}
                Err(JobsError::Corrupt { id, message }) => {
                    tracing::warn!(job = %id, error = %message, "unreadable job record skipped");
                    out.corrupt.push((id, message));
                }
                Err(e) => return Err(e),
            }
        }
        Ok(out)
    }

    /// The record's revisions, oldest first (as many as the bucket keeps).
    pub async fn history(&self, id: &str) -> Result<Vec<Versioned<JobRecord>>, JobsError> {
        let mut h = self
            .kv
            .history(id)
            .await
            .map_err(|e| JobsError::nats(format!("history of {id}"), e))?;
        let mut out = Vec::new();
        while let Some(e) = h.next().await {
            let e = e.map_err(|e| JobsError::nats(format!("history of {id}"), e))?;
            if e.operation == kv::Operation::Put {
                out.push(Versioned {
                    value: decode(id, &e.value)?,
                    revision: e.revision,
                });
            }
        }
        Ok(out)
    }

    /// The last sequence of the bucket's stream when it was opened: where
    /// to follow a record from that does not exist yet (its key may have
    /// the markers of a removed job of the same id before it).
    pub fn opened_at(&self) -> u64 {
        self.kv.stream.cached_info().state.last_sequence
    }

    /// The first revision of the record written after stream sequence
    /// `after`, read with a direct get: no
    /// consumer is created, so a user allowed only to read records (a
    /// submitter) can follow a job. `None` when there is none yet; a delete
    /// or purge marker comes as its sequence without a record.
    pub async fn revision_after(
        &self,
        id: &str,
        after: u64,
    ) -> Result<Option<(u64, Option<JobRecord>)>, JobsError> {
        let subject = format!("$KV.{}.{id}", self.kv.name);
        let m = match self
            .kv
            .stream
            .direct_get_next_for_subject(&subject, Some(after + 1))
            .await
        {
            Ok(m) => m,
            Err(e) if e.kind() == async_nats::jetstream::stream::DirectGetErrorKind::NotFound => {
                return Ok(None)
            }
            Err(e) => return Err(JobsError::nats(format!("read job {id}"), e)),
        };
        if crate::is_removal(&m.headers) {
            return Ok(Some((m.sequence, None)));
        }
        let mut rec = decode(id, &m.payload)?;
        if rec.input_beside || rec.output_beside {
            self.internalize(&mut rec).await?;
        }
        Ok(Some((m.sequence, Some(rec))))
    }

    /// A watch of every record change (for `leasehold watch` and tests).
    pub async fn watch(&self, id: &str) -> Result<kv::Watch, JobsError> {
        self.kv
            .watch_with_history(id)
            .await
            .map_err(|e| JobsError::nats(format!("watch {id}"), e))
    }

    /// A watch of every record written from now on (not the bucket's
    /// current contents): what a live view of many jobs follows.
    pub async fn watch_new(&self) -> Result<kv::Watch, JobsError> {
        self.kv
            .watch(">")
            .await
            .map_err(|e| JobsError::nats("watch jobs", e))
    }

    /// A watch of every change to any record.
    pub async fn watch_all(&self) -> Result<kv::Watch, JobsError> {
        self.kv
            .watch_all()
            .await
            .map_err(|e| JobsError::nats("watch jobs", e))
    }
}

/// A listing of records, with the ones that could not be read.
#[derive(Debug, Default)]
pub struct Listing {
    pub records: Vec<Versioned<JobRecord>>,
    /// `(id, error)` of each record that did not decode.
    pub corrupt: Vec<(String, String)>,
}

/// Decodes a KV value as a job record.
pub fn decode(id: &str, bytes: &[u8]) -> Result<JobRecord, JobsError> {
    serde_json::from_slice(bytes).map_err(|e| JobsError::Corrupt {
        id: id.into(),
        message: e.to_string(),
    })
}

/// The JSON of a record; a record that cannot be written (a result that is
/// not JSON) is an error, never a panic.
fn encode(rec: &JobRecord) -> Result<Bytes, JobsError> {
    serde_json::to_vec(rec)
        .map(Bytes::from)
        .map_err(|e| JobsError::Corrupt {
            id: rec.id.clone(),
            message: format!("the record cannot be written: {e}"),
        })
}

/// The door of every owner-side write of one claimed job.
///
/// Architecture invariant: no code path sets a terminal state of a running
/// job except through a `Gate` (the reaper's `dead` and a canceller's
/// queued→cancelled are not owner-side and go through [`Jobs::transition`]).
#[derive(Clone)]
pub struct Gate {
    jobs: Jobs,
    pub id: String,
    pub owner: Owner,
    /// The record as this owner last wrote it. A write is first tried at
    /// its revision, saving a read; any change by someone else (a cancel
    /// request, a reclaim) makes that write conflict, and the slow path
    /// re-reads and decides on the fresh record.
    last: Arc<Mutex<Option<Versioned<JobRecord>>>>,
    /// The writes this owner tried since its last answered one (a reply
    /// lost, a timeout): one found in the record landed, and is ours.
    tried: Arc<Mutex<Vec<JobRecord>>>,
    /// Fires once any record this gate reads or writes carries
    /// `cancel_requested`: every owner write doubles as a cancellation check.
    cancel_seen: tokio_util::sync::CancellationToken,
    /// The owner process's session, checked before [`Gate::touch`].
    session: Option<crate::sessions::SessionClock>,
}

impl Gate {
    pub fn new(jobs: Jobs, id: impl Into<String>, owner: Owner) -> Self {
        Gate {
            jobs,
            id: id.into(),
            owner,
            last: Arc::default(),
            tried: Arc::default(),
            cancel_seen: tokio_util::sync::CancellationToken::new(),
            session: None,
        }
    }

    /// This gate's [`Gate::touch`] also requires a recently confirmed session.
    pub fn with_session(mut self, clock: crate::sessions::SessionClock) -> Self {
        self.session = Some(clock);
        self
    }

    /// Fires when a record read or written by this gate says the job was
    /// asked to be cancelled.
    pub fn cancel_seen(&self) -> tokio_util::sync::CancellationToken {
        self.cancel_seen.clone()
    }

    /// A gate that starts from the record the claim wrote.
    pub fn claimed(jobs: Jobs, claimed: Versioned<JobRecord>, owner: Owner) -> Self {
        let g = Gate::new(jobs, claimed.value.id.clone(), owner);
        *g.last.lock().expect("gate cache") = Some(claimed);
        g
    }

    /// An owner-checked transition; `f` is one of the machine's owner-side
    /// transitions (each proves ownership on the record it is given).
    pub async fn write<F>(&self, mut f: F) -> Result<Versioned<JobRecord>, JobsError>
    where
        F: FnMut(&JobRecord, &Owner, SystemTime) -> Result<JobRecord, TransitionError>,
    {
        let owner = self.owner.clone();
        let cached = self.last.lock().expect("gate cache").clone();
        if let Some(cur) = cached {
            if let Ok(next) = f(&cur.value, &owner, SystemTime::now()) {
                self.tried.lock().expect("gate tried").push(next.clone());
                match self.jobs.update(&next, cur.revision).await {
                    Ok(revision) => {
                        return Ok(self.remember(Versioned {
                            value: next,
                            revision,
                        }))
                    }
                    Err(JobsError::Conflict(_)) => {}
                    Err(e) => return Err(e),
                }
            }
        }
        // Every record read here doubles as a cancellation check, even one
        // whose transition `f` refuses (a write effect's proof).
        let seen = self.cancel_seen.clone();
        let tried = self.tried.clone();
        let v = self
            .jobs
            .transition(&self.id, |rec| {
                if rec.cancel_requested {
                    seen.cancel();
                }
                // Our own write whose answer was lost landed: it is ours,
                // not a sign that someone else took the job.
                if tried
                    .lock()
                    .expect("gate tried")
                    .iter()
                    .any(|t| same_write(t, rec))
                {
                    return Ok(None);
                }
                let next = f(rec, &owner, SystemTime::now())?;
                tried.lock().expect("gate tried").push(next.clone());
                Ok(Some(next))
            })
            .await?;
        Ok(self.remember(v))
    }

    fn remember(&self, v: Versioned<JobRecord>) -> Versioned<JobRecord> {
        self.tried.lock().expect("gate tried").clear();
        if v.value.cancel_requested {
            self.cancel_seen.cancel();
        }
        *self.last.lock().expect("gate cache") = Some(v.clone());
        v
    }

    /// Proves ownership with a conditioned write (the record's
    /// `last_heartbeat_at`): refused once anyone else changed the job's
    /// ownership. Called right before every write effect, where a read
    /// would prove nothing (it can be stale, and the owner can pause between
    /// the read and the effect).
    pub async fn touch(&self) -> Result<Versioned<JobRecord>, JobsError> {
        if let Some(c) = self.session.as_ref().filter(|c| !c.is_fresh()) {
            return Err(JobsError::SessionStale(c.age()));
        }
        self.write(machine::touch).await
    }

    /// Reads the record and proves ownership without writing.
    pub async fn check(&self) -> Result<Versioned<JobRecord>, JobsError> {
        let cur = self
            .jobs
            .get(&self.id)
            .await?
            .ok_or_else(|| JobsError::NotFound(self.id.clone()))?;
        machine::check_owner(&cur.value, &self.owner)?;
        if cur.value.cancel_requested {
            self.cancel_seen.cancel();
        }
        Ok(cur)
    }
}

/// Records a cancellation request; the JSON reply says whether it was
/// recorded, and the owners to notify (`(job, worker)`: the job's own
/// when it runs, and its running children's). A recorded request is
/// carried to the job's children that its spawns did not detach
/// (`crate::children::cascading`), and to theirs: a cancelled parent
/// leaves none of them running for nobody.
pub async fn cancel(
    jobs: &Jobs,
    events: &crate::events::Events,
    signals: &crate::signals::Signals,
    id: &str,
) -> (serde_json::Value, Vec<(String, String)>) {
    let mut outcome = None;
    let mut was = String::new();
    let res = jobs
        .transition(id, |rec| {
            was = rec.status.clone();
            match machine::request_cancel(rec, SystemTime::now())? {
                machine::CancelOutcome::Cancelled(r) => {
                    outcome = Some("cancelled");
                    Ok(Some(r))
                }
                machine::CancelOutcome::Requested(r) => {
                    outcome = Some("requested");
                    Ok(Some(r))
                }
                machine::CancelOutcome::AlreadyRequested => {
                    outcome = Some("already_requested");
                    Ok(None)
                }
                machine::CancelOutcome::Unchanged(_) => {
                    outcome = Some("unchanged");
                    Ok(None)
                }
            }
        })
        .await;
    match res {
        Ok(v) => {
            let what = outcome.unwrap_or("unchanged");
            if what == "cancelled" {
                // Announced first: a failure leaves the end without its
                // event, and its index entry's repair announces it.
                if crate::children::announce_end(jobs, signals, &v.value)
                    .await
                    .is_ok()
                {
                    let ev = crate::events::event(
                        id,
                        v.value.epoch,
                        "cancelled",
                        None,
                        json!({"while": was, "kind": v.value.kind}),
                    );
                    let _ = events
                        .publish(
                            &ev,
                            Some(&crate::events::terminal_event_id(&v.value, "cancelled")),
                        )
                        .await;
                }
            }
            let mut owners: Vec<(String, String)> = (v.value.status == "running")
                .then(|| v.value.worker_id.clone().map(|w| (id.to_string(), w)))
                .flatten()
                .into_iter()
                .collect();
            if matches!(what, "cancelled" | "requested") {
                for (child, kind) in crate::children::cascading(events, id)
                    .await
                    .unwrap_or_default()
                {
                    let (reply, more) = Box::pin(cancel(jobs, events, signals, &child)).await;
                    owners.extend(more);
                    // Its ticket not taken yet: recorded cancelled now, so
                    // its claim runs nothing; a claim that created it
                    // meanwhile made a record to cancel, again.
                    if reply["outcome"] == "not_found"
                        && crate::children::cancel_unborn(jobs, events, &child, &kind, id).await
                    {
                        let (_, more) = Box::pin(cancel(jobs, events, signals, &child)).await;
                        owners.extend(more);
                    }
                }
            }
            (
                json!({"id": id, "recorded": matches!(what, "cancelled" | "requested" | "already_requested"), "outcome": what, "status": v.value.status}),
                owners,
            )
        }
        Err(JobsError::NotFound(_)) => (
            json!({"id": id, "recorded": false, "outcome": "not_found", "error": format!("no job {id}")}),
            Vec::new(),
        ),
        Err(e) => (
            json!({"id": id, "recorded": false, "outcome": "error", "error": e.to_string()}),
            Vec::new(),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::JobsError;

    #[test]
    fn a_nats_failure_keeps_its_cause_as_the_source_and_stays_transient() {
        let cause = std::io::Error::new(std::io::ErrorKind::TimedOut, "timed out");
        let e = JobsError::nats("read job j1", cause);
        assert_eq!(e.to_string(), "NATS: read job j1: timed out");
        assert!(e.is_transient());
        let source = std::error::Error::source(&e).expect("the cause is kept");
        let io = source
            .downcast_ref::<std::io::Error>()
            .expect("as the error it was");
        assert_eq!(io.kind(), std::io::ErrorKind::TimedOut);
    }
}
