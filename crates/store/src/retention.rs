//! Retention of finished jobs: what is kept, and how it goes.
//!
//! A finished job (completed, failed, cancelled, rejected, dead) is kept for
//! its retention after its terminal write, then everything of it goes, in
//! an order that survives a crash at any step: its artifact, its
//! effects-ledger entries, its large payloads, its signals, any index entry, the record
//! (conditioned on the revision read, so a job replayed meanwhile is left
//! alone), and its events last, up to the last event published before the
//! pass read its record (those after its terminal event too: a stale
//! owner's `heartbeat_lost`, an operator's `action`): the terminal event is
//! the pass's only pointer to the job, so a pass that stops half-way leaves
//! it for the next one, and a job that reuses the id meanwhile keeps its
//! own events. A job id reused afterwards starts fresh.
//!
//! Nothing scans the history to find what is due: the terminal events are
//! read in stream order, lagging by the retention, from a cursor kept in
//! the index bucket (`gc.<retention seconds>`), one cursor per retention
//! class. Every step is idempotent, so replicas may overlap; the cursor is
//! advanced with a conditioned write.
//!
//! A dead job is kept at least as long as its dead letter lives (the DLQ's
//! `max_age`), from its own cursor (`gd.<seconds>`): a late replay finds
//! its payloads and its effects ledger, and never repeats an effect.
//!
//! Transcripts (a job's `journal` and `tool` events: every model message
//! and tool result) may go sooner than the rest, from their own cursor
//! (`tx.<seconds>`), when keeping full transcripts is not wanted.

use std::time::{Duration, SystemTime};

use async_nats::jetstream::{self, consumer, kv};
use futures::StreamExt;
use leasehold_core::machine::status_of;
use leasehold_core::time::parse_rfc3339;
use leasehold_proto::JobEvent;

use crate::{Conn, Jobs, Layout, StoreError};

/// Event types that end a job.
pub const TERMINAL_EVENTS: [&str; 5] = ["completed", "failed", "cancelled", "dead", "rejected"];

/// Event types that make up a job's transcript: the journal (every model
/// response and tool result of a run) and tool-call records. A finished job
/// needs neither to be read or resumed from its checkpoints.
pub const TRANSCRIPT_EVENTS: [&str; 2] = ["journal", "tool"];

/// What a pass does to each finished job that is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Action {
    /// Everything of the job goes (cursor `gc.<secs>`), dead jobs aside.
    Forget,
    /// Everything of a dead job goes (cursor `gd.<secs>`), no sooner than
    /// its dead letter may still be replayed.
    ForgetDead,
    /// Only its transcript events go (cursor `tx.<secs>`).
    Transcripts,
}

/// How long removed records' markers stay before they vanish: long enough
/// for a watcher to see the removal, short enough that what retention
/// removes stops taking room within a minute.
pub const MARKER_TTL: Duration = Duration::from_secs(60);

/// Jobs removed side by side in one pass.
const FORGET_CONCURRENCY: usize = 32;

/// What one pass removed.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Pass {
    /// Terminal events read.
    pub seen: u64,
    /// Jobs removed.
    pub forgotten: u64,
    /// Jobs skipped (replayed since, or of another retention class).
    pub skipped: u64,
}

/// Removes a finished job's effects-ledger entries (and the business keys
/// they own): the tools crate knows the ledger's format.
pub type PurgeEffects = std::sync::Arc<
    dyn Fn(String) -> futures::future::BoxFuture<'static, Result<(), String>> + Send + Sync,
>;

/// The handles retention needs.
#[derive(Clone)]
pub struct Retention {
    js: jetstream::Context,
    layout: Layout,
    jobs: Jobs,
    index: kv::Store,
    effects: Option<PurgeEffects>,
    /// How long a dead letter lives (the DLQ's `max_age`; zero: no age
    /// limit): a dead job's data is kept at least this long, since its
    /// letter's replay needs its payloads and its effects ledger.
    dead_floor: Duration,
}

impl Retention {
    pub async fn open(conn: &Conn) -> Result<Self, StoreError> {
        let dead_floor = match conn.js.get_stream(conn.layout.dlq_stream()).await {
            Ok(mut s) => s
                .info()
                .await
                .map(|i| i.config.max_age)
                .map_err(|e| StoreError::nats("dead letters' stream", e))?,
            Err(e) => {
                return Err(crate::lookup_error(
                    format!("stream {}", conn.layout.dlq_stream()),
                    &e,
                ))
            }
        };
        Ok(Retention {
            js: conn.js.clone(),
            layout: conn.layout.clone(),
            jobs: Jobs::open(conn).await?,
            index: crate::open_kv(conn, &conn.layout.active_bucket()).await?,
            effects: None,
            dead_floor,
        })
    }

    /// How long a dead job of a class with `retention` is kept: no less
    /// than its dead letter lives (with no age limit on letters, the class's
    /// retention: the letter then carries what a replay needs, as far as
    /// it can).
    pub fn dead_retention(&self, retention: Duration) -> Duration {
        // A margin past the letter's expiry (a tenth, at most an hour): a
        // replay that read the letter just before it expired finds the
        // job's data.
        let margin = (self.dead_floor / 10).min(Duration::from_secs(3600));
        retention.max(self.dead_floor + margin)
    }

    /// How a job's effects are removed (else its ledger keys are purged by
    /// prefix, without the business keys they own).
    pub fn with_effects(mut self, purge: PurgeEffects) -> Self {
        self.effects = Some(purge);
        self
    }

    /// One pass of the class `retention`: jobs whose kind `belongs` to it
    /// and whose terminal event is older than `retention` are forgotten, at
    /// most `max` terminal events read.
    pub async fn pass<F>(
        &self,
        retention: Duration,
        belongs: F,
        max: usize,
    ) -> Result<Pass, StoreError>
    where
        F: Fn(&str) -> bool,
    {
        let a = self.scan(Action::Forget, retention, &belongs, max).await?;
        let d = self
            .scan(
                Action::ForgetDead,
                self.dead_retention(retention),
                &belongs,
                max,
            )
            .await?;
        Ok(Pass {
            seen: a.seen.max(d.seen),
            forgotten: a.forgotten + d.forgotten,
            skipped: a.skipped + d.skipped,
        })
    }

    /// One pass removing the transcripts ([`TRANSCRIPT_EVENTS`]) of jobs
    /// finished more than `after` ago, keeping their record, checkpoints,
    /// terminal event and artifact until their retention. `forgotten`
    /// counts the jobs whose transcripts went.
    pub async fn transcripts_pass(&self, after: Duration, max: usize) -> Result<Pass, StoreError> {
        self.scan(Action::Transcripts, after, |_| true, max).await
    }

    async fn scan<F>(
        &self,
        action: Action,
        retention: Duration,
        belongs: F,
        max: usize,
    ) -> Result<Pass, StoreError>
    where
        F: Fn(&str) -> bool,
    {
        let class = match action {
            Action::Forget => "gc",
            Action::ForgetDead => "gd",
            Action::Transcripts => "tx",
        };
        let cursor_key = format!("{class}.{}", retention.as_secs());
        let (after, rev) = match self
            .index
            .entry(&cursor_key)
            .await
            .map_err(|e| StoreError::nats("read retention cursor", e))?
        {
            Some(e) if e.operation == kv::Operation::Put => (
                std::str::from_utf8(&e.value)
                    .ok()
                    .and_then(|s| s.parse::<u64>().ok())
                    .unwrap_or(0),
                e.revision,
            ),
            Some(e) => (0, e.revision),
            None => (0, 0),
        };
        let stream = self
            .js
            .get_stream(self.layout.events_stream())
            .await
            .map_err(|e| StoreError::nats("events stream", e))?;
        // The stream's last sequence, read before any record of the pass:
        // every event of a job up to it was published before the record
        // read that finds the job finished (a reused id's events come after
        // its new record, so after that read), so it is this job's or an
        // earlier incarnation's, including events after its terminal event
        // (a stale owner's `heartbeat_lost`, an operator's `action`).
        let events_upto = stream.cached_info().state.last_sequence;
        let filters: Vec<String> = TERMINAL_EVENTS
            .iter()
            .filter(|t| match action {
                Action::Forget => **t != "dead",
                Action::ForgetDead => **t == "dead",
                Action::Transcripts => true,
            })
            .map(|t| format!("{}.events.*.{t}", self.layout.prefix))
            .collect();
        let consumer = stream
            .create_consumer(consumer::pull::OrderedConfig {
                filter_subjects: filters,
                deliver_policy: consumer::DeliverPolicy::ByStartSequence {
                    start_sequence: after + 1,
                },
                ..Default::default()
            })
            .await
            .map_err(|e| StoreError::nats("retention scan", e))?;
        let mut pending = consumer.cached_info().num_pending;
        let mut pass = Pass::default();
        let mut last = after;
        let mut due: Vec<(String, Option<String>, u64)> = Vec::new();
        if pending > 0 {
            let mut msgs = consumer
                .messages()
                .await
                .map_err(|e| StoreError::nats("retention scan", e))?;
            let now = SystemTime::now();
            while pending > 0 && (pass.seen as usize) < max {
                let next = tokio::time::timeout(Duration::from_secs(10), msgs.next()).await;
                let Ok(Some(Ok(m))) = next else {
                    break;
                };
                let Ok(info) = m.info() else { break };
                pending = info.pending;
                let published = SystemTime::UNIX_EPOCH
                    + Duration::from_nanos(info.published.unix_timestamp_nanos().max(0) as u64);
                if now.duration_since(published).unwrap_or_default() < retention {
                    // Everything after this one is younger still.
                    break;
                }
                pass.seen += 1;
                let seq = info.stream_sequence;
                let ev: JobEvent = serde_json::from_slice(&m.payload).unwrap_or_default();
                if !ev.job_id.is_empty() {
                    let kind = ev
                        .data_map()
                        .get("kind")
                        .and_then(|k| k.as_str().map(str::to_string));
                    due.push((ev.job_id, kind, seq));
                }
                last = seq;
            }
        }
        // The jobs of the pass are independent: removed side by side, so
        // retention keeps up with a fleet finishing hundreds of jobs a
        // second. Any failure leaves the cursor where it was; the next pass
        // does the same (idempotent) work again.
        let belongs = &belongs;
        let outcomes: Vec<Result<bool, StoreError>> = futures::stream::iter(due)
            .map(|(id, kind, seq)| async move {
                match action {
                    Action::Forget | Action::ForgetDead => {
                        self.forget_upto(&id, retention, kind, belongs, Some(events_upto.max(seq)))
                            .await
                    }
                    Action::Transcripts => self.forget_transcript(&id).await,
                }
            })
            .buffer_unordered(FORGET_CONCURRENCY)
            .collect()
            .await;
        for o in outcomes {
            match o? {
                true => pass.forgotten += 1,
                false => pass.skipped += 1,
            }
        }
        if last > after {
            let value = last.to_string().into();
            let res = if rev == 0 {
                self.index
                    .create(&cursor_key, value)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            } else {
                self.index
                    .update(&cursor_key, value, rev)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string())
            };
            if let Err(e) = res {
                // Another replica moved it: it did (or does) the same work.
                tracing::debug!(error = %e, "retention cursor moved by someone else");
            }
        }
        Ok(pass)
    }

    /// Forgets job `id` if it is finished, belongs to the class, and its
    /// last write is older than `retention`. `true` when it was removed.
    pub async fn forget<F>(
        &self,
        id: &str,
        retention: Duration,
        kind: Option<String>,
        belongs: &F,
    ) -> Result<bool, StoreError>
    where
        F: Fn(&str) -> bool,
    {
        self.forget_upto(id, retention, kind, belongs, None).await
    }

    /// [`Retention::forget`], where `events_upto` is a sequence of the
    /// events stream read before this call (at or after the terminal event
    /// that made the job due): its events are removed up to it only, so a
    /// job that reuses the id meanwhile keeps its own.
    async fn forget_upto<F>(
        &self,
        id: &str,
        retention: Duration,
        kind: Option<String>,
        belongs: &F,
        events_upto: Option<u64>,
    ) -> Result<bool, StoreError>
    where
        F: Fn(&str) -> bool,
    {
        if kind.as_deref().is_some_and(|k| !belongs(k)) {
            return Ok(false);
        }
        let cur = match self.jobs.get(id).await {
            Ok(c) => c,
            // An unreadable record is left for an operator.
            Err(crate::JobsError::Corrupt { .. }) => return Ok(false),
            Err(e) => return Err(StoreError::from_jobs(e)),
        };
        let Some(cur) = cur else {
            // No record (an earlier pass removed it and stopped before the
            // events): whatever is left of the job goes.
            self.purge_job_data(id, None).await?;
            self.purge_events(id, events_upto).await?;
            return Ok(true);
        };
        let rec = &cur.value;
        if !belongs(&rec.kind) {
            return Ok(false);
        }
        let finished = status_of(rec).is_some_and(|s| s.is_terminal());
        let age = parse_rfc3339(&rec.updated_at)
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .unwrap_or_default();
        // A dead job is kept while its dead letter may be replayed (the
        // pass of its `dead` event removes it).
        let retention = if rec.status == leasehold_core::Status::Dead.as_str() {
            self.dead_retention(retention)
        } else {
            retention
        };
        if !finished || age < retention {
            // Replayed, or finished again later: a later terminal event
            // brings it back when that one is due.
            return Ok(false);
        }
        self.purge_job_data(id, rec.result.as_ref().and_then(|r| r.artifact.clone()))
            .await?;
        match self
            .jobs
            .kv()
            .purge_expect_revision_with_ttl(id, cur.revision, MARKER_TTL)
            .await
        {
            Ok(()) => {}
            Err(e) if crate::server_error_code(&e) == Some(crate::WRONG_LAST_SEQUENCE) => {
                return Ok(false)
            }
            Err(e) => return Err(StoreError::nats("remove record", e)),
        }
        // The events last: the terminal event is this pass's only pointer
        // to the job, so a failure before here leaves it to the next pass.
        self.purge_events(id, events_upto).await?;
        Ok(true)
    }

    /// A job's events, up to the sequence `upto` (included) when known.
    async fn purge_events(&self, id: &str, upto: Option<u64>) -> Result<(), StoreError> {
        let l = &self.layout;
        let s = self
            .js
            .get_stream_no_info(l.events_stream())
            .await
            .map_err(|e| StoreError::nats("purge", e))?;
        let filter = l.job_events_filter(id);
        let res = match upto {
            // `sequence` purges below it: the terminal event is included.
            Some(seq) => s.purge().filter(filter).sequence(seq + 1).await,
            None => s.purge().filter(filter).await,
        };
        res.map(|_| ()).map_err(|e| StoreError::nats("purge", e))
    }

    /// Removes the transcript events of job `id` if it is finished. A job
    /// replayed later resumes from its checkpoints; sections that were in
    /// flight (a failed job's) restart from a clean thread.
    pub async fn forget_transcript(&self, id: &str) -> Result<bool, StoreError> {
        let finished = match self.jobs.get(id).await {
            Ok(Some(cur)) => status_of(&cur.value).is_some_and(|s| s.is_terminal()),
            Ok(None) | Err(crate::JobsError::Corrupt { .. }) => false,
            Err(e) => return Err(StoreError::from_jobs(e)),
        };
        if !finished {
            return Ok(false);
        }
        let l = &self.layout;
        for ty in TRANSCRIPT_EVENTS {
            self.purge_subject(&l.events_stream(), l.event_subject(id, ty))
                .await?;
        }
        Ok(true)
    }

    /// Everything of a job but its record and its events.
    async fn purge_job_data(&self, id: &str, artifact: Option<String>) -> Result<(), StoreError> {
        let l = &self.layout;
        // The artifact the result names, and those a job of this id
        // stores by convention (`<id>/report.md`, and `<id>/partial.md`
        // when cancelled or out of budget) whatever its end: a job whose
        // end was not written after storing one names none.
        let conventional = [format!("{id}/report.md"), format!("{id}/partial.md")];
        let mut names = conventional.to_vec();
        names.extend(artifact.filter(|a| !conventional.contains(a)));
        if let Ok(store) = self.js.get_object_store(l.artifacts_bucket()).await {
            for name in names {
                if let Err(e) = store.delete(&name).await {
                    tracing::debug!(job = id, artifact = %name, error = %e, "artifact not deleted (gone already?)");
                }
            }
        }
        match &self.effects {
            Some(purge) => purge(id.to_string()).await.map_err(StoreError::failed)?,
            None => {
                let b = l.effects_bucket();
                self.purge_subject(&format!("KV_{b}"), format!("$KV.{b}.{id}.>"))
                    .await?
            }
        }
        let b = l.payloads_bucket();
        self.purge_subject(&format!("KV_{b}"), format!("$KV.{b}.{id}.>"))
            .await?;
        // Signals sent to it that no wait took: they were this job's, never
        // a later one's of the same id.
        self.purge_subject(&l.signals_stream(), l.job_signals_filter(id))
            .await?;
        for pattern in [
            format!("run.*.{id}"),
            format!("wait.{id}"),
            format!("park.{id}"),
        ] {
            self.purge_subject(
                &format!("KV_{}", l.active_bucket()),
                format!("$KV.{}.{pattern}", l.active_bucket()),
            )
            .await?;
        }
        Ok(())
    }

    async fn purge_subject(&self, stream: &str, filter: String) -> Result<(), StoreError> {
        let s = self
            .js
            .get_stream_no_info(stream)
            .await
            .map_err(|e| StoreError::nats("purge", e))?;
        s.purge()
            .filter(filter)
            .await
            .map(|_| ())
            .map_err(|e| StoreError::nats("purge", e))
    }
}
