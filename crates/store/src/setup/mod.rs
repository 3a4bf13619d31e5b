//! Creating (idempotently) and verifying the NATS layout.
//!
//! | name | kind | notes |
//! |---|---|---|
//! | `LH_WORK` | stream, work-queue retention, file | subjects `lh.submit.<kind>` of every configured kind; dedupe window |
//! | `lh_workers_<kind>` | durable pull consumer per kind | explicit ack, `ack_wait`, `max_deliver` |
//! | `lh_jobs` | KV bucket | job records, history kept for audits |
//! | `LH_EVENTS` | stream, limits | `lh.events.>`, direct get on (fencing reads) |
//! | `lh_effects` | KV bucket, per-message TTL allowed | idempotency ledger; entries are written with `Nats-TTL: never` and go with their job (`max_age`, the retention, only expires entries written without it) |
//! | `lh_artifacts` | object store | reports |
//! | `LH_DLQ` | stream, limits | `lh.dlq.>` |
//! | `LH_ADVISORIES` | stream, limits | the server's max-deliveries advisories of `LH_WORK`, kept for the reaper |
//! | `lh_sessions` | KV bucket, per-key TTL | worker sessions; the server removes a key when its renewals stop and leaves a marker |
//! | `lh_session_ends` | durable consumer of `KV_lh_sessions`, headers only | shared by workers and reapers: each ended session handled once |
//! | `LH_SIGNALS` | stream, limits, fixed bytes bound, discard new | `lh.signal.<job>.<name>`: signals sent to jobs, kept until their job goes (`store::signals`) |
//! | `lh_signal_wakes` | durable consumer of `LH_SIGNALS`, headers only | shared by workers and reapers: each signal looked at once, its job woken if it waits for it |
//! | `lh_active` | KV bucket | the index of active jobs (`run.<worker>.<job>`, `wait.<job>`, `park.<job>`) |
//! | `lh_payloads` | KV bucket | large inputs and outputs beside their records (`<job>.input`, `<job>.output`) |
//! | `LH_HISTORY` | stream, limits, per-message TTL | `lh.history.>`: one entry per finished job (`store::history`), each living its job's retention; bytes bound, oldest out |
//!
//! Every stream and bucket is bounded (see [`SetupOptions`]). Running setup
//! again migrates: it compares what the server has with what is wanted,
//! updates what differs and says so; [`Mode::Check`] only reports the drift.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv, object_store, stream};

use crate::{Conn, StoreError};

mod apply;
mod drift;
mod plan;

use apply::*;
use drift::*;
use plan::*;

/// What `leasehold setup` creates. Durations, counts and sizes have the
/// defaults documented on each field; every stream and bucket is bounded.
#[derive(Debug, Clone)]
pub struct SetupOptions {
    /// Replicas of every stream and bucket (1 on a single server, 3 in a cluster).
    pub replicas: usize,
    /// Kinds that get a subject and a consumer.
    pub kinds: Vec<String>,
    /// Consumer ack wait: how long a delivered ticket that nobody claimed
    /// (its worker stopped before the claim) waits before it is redelivered
    /// (default 10 s, the default session timeout: such a job comes back no
    /// later than a claimed one). A claimed job never depends on it.
    pub ack_wait: Duration,
    /// Deliveries of one ticket before the server gives up and advises (default 20).
    pub max_deliver: i64,
    /// Dedupe window of submissions by `Nats-Msg-Id` (default 1 h); the job
    /// record's existence dedupes beyond it.
    pub dedupe_window: Duration,
    /// Tickets the work stream holds at most (default 1,000,000); a
    /// submission beyond is refused with "maximum messages exceeded",
    /// nothing is dropped.
    pub work_max_msgs: i64,
    /// Bytes the work stream holds at most (default 2 GiB), refused beyond.
    pub work_max_bytes: i64,
    /// Pull requests waiting on one work consumer (default 4096: one per
    /// idle kind per worker process, so size it above the fleet).
    pub max_waiting: i64,
    /// How long events are kept at most (default 0: until their job's
    /// retention ends, when the reaper removes them with the record).
    pub events_max_age: Duration,
    /// Bytes the event stream holds at most (default 10 GiB), a safety net:
    /// beyond it new events are refused (the jobs wait) rather than old
    /// checkpoints of running jobs being dropped.
    pub events_max_bytes: i64,
    /// Largest event stored (default 1 MiB); larger payloads go beside.
    pub events_max_msg_size: i32,
    /// The effects bucket's `max_age` (default 7 days). Ledger entries are
    /// written with `Nats-TTL: never` and outlive it: they are removed with
    /// their job (`effects::purge_job`), never while it may resume.
    pub effects_retention: Duration,
    /// KV history kept per job record (default 8 revisions).
    pub job_history: i64,
    /// Dead letters: kept at most this long (default 30 days), this many
    /// (default 100,000) and this many bytes (default 1 GiB); the oldest go first.
    pub dlq_max_age: Duration,
    pub dlq_max_msgs: i64,
    pub dlq_max_bytes: i64,
    /// Byte bounds of the buckets: job records (default 2 GiB), large inputs
    /// and outputs (2 GiB), the index of active jobs (256 MiB), sessions
    /// (64 MiB), the effects ledger (1 GiB) and artifacts (4 GiB). Reserved
    /// like the streams'; a full bucket refuses writes, it never drops.
    pub jobs_max_bytes: i64,
    pub payloads_max_bytes: i64,
    pub active_max_bytes: i64,
    pub sessions_max_bytes: i64,
    pub effects_max_bytes: i64,
    pub artifacts_max_bytes: i64,
    /// Byte bound of the recurring schedules' bucket (default 64 MiB).
    pub schedules_max_bytes: i64,
    /// Bytes of the signal stream `LH_SIGNALS` (default 16 MiB, some
    /// 80,000 small signals; a full stream refuses a send, its sender told).
    pub signals_max_bytes: i64,
    /// Byte bound of the history of finished jobs (default 256 MiB, about
    /// a million entries); the oldest entries go first beyond it. Not
    /// fitted to a small server: pass a smaller bound there.
    pub history_max_bytes: i64,
    /// Which byte bounds are defaults rather than asked for: a server whose
    /// JetStream storage limit (`max_file_store`) cannot reserve them gets
    /// them halved until they fit (never below [`FIT_FLOOR`]), and the
    /// change says so. An explicit bound is never lowered: it fails with a
    /// clear error instead.
    pub fit: Fit,
}

/// Byte bounds that may be lowered to fit the server (see [`SetupOptions::fit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fit {
    pub work: bool,
    pub events: bool,
    pub dlq: bool,
    pub jobs: bool,
    pub payloads: bool,
    pub active: bool,
    pub sessions: bool,
    pub effects: bool,
    pub artifacts: bool,
    pub schedules: bool,
    pub signals: bool,
}

impl Fit {
    /// Every bound as given: none is lowered.
    pub const EXACT: Fit = Fit {
        work: false,
        events: false,
        dlq: false,
        jobs: false,
        payloads: false,
        active: false,
        sessions: false,
        effects: false,
        artifacts: false,
        schedules: false,
        signals: false,
    };
    /// Every bound a default that may be lowered.
    pub const DEFAULTS: Fit = Fit {
        work: true,
        events: true,
        dlq: true,
        jobs: true,
        payloads: true,
        active: true,
        sessions: true,
        effects: true,
        artifacts: true,
        schedules: true,
        signals: true,
    };
}

/// The smallest a default byte bound is lowered to when fitting a server.
pub const FIT_FLOOR: i64 = 64 << 20;

impl Default for SetupOptions {
    fn default() -> Self {
        SetupOptions {
            replicas: 1,
            kinds: leasehold_core::spec::Kinds::default()
                .names()
                .iter()
                .map(|s| s.to_string())
                .collect(),
            ack_wait: Duration::from_secs(10),
            max_deliver: 20,
            dedupe_window: Duration::from_secs(3600),
            work_max_msgs: 1_000_000,
            work_max_bytes: 2 << 30,
            max_waiting: 4096,
            events_max_age: Duration::ZERO,
            events_max_bytes: 10 << 30,
            events_max_msg_size: 1 << 20,
            effects_retention: Duration::from_secs(7 * 86_400),
            job_history: 8,
            dlq_max_age: Duration::from_secs(30 * 86_400),
            dlq_max_msgs: 100_000,
            dlq_max_bytes: 1 << 30,
            jobs_max_bytes: 2 << 30,
            payloads_max_bytes: 2 << 30,
            active_max_bytes: 256 << 20,
            sessions_max_bytes: 64 << 20,
            effects_max_bytes: 1 << 30,
            artifacts_max_bytes: 4 << 30,
            schedules_max_bytes: 64 << 20,
            signals_max_bytes: 16 << 20,
            history_max_bytes: 256 << 20,
            fit: Fit::DEFAULTS,
        }
    }
}

/// The KV configuration of the effects ledger: only the latest state of a
/// key matters (history 1). Per-message TTLs are allowed (`limit_markers`
/// sets `allow_msg_ttl`), so entries written with `Nats-TTL: never` are
/// exempt from `max_age` (the retention): a job's entries stay until the
/// job is purged (see `crate::effects`). Markers of expired or removed keys
/// stay a day.
pub fn effects_config(bucket: String, retention: Duration, replicas: usize) -> kv::Config {
    kv::Config {
        bucket,
        description: "leasehold idempotency ledger of side-effecting tool calls".into(),
        history: 1,
        max_age: retention,
        storage: stream::StorageType::File,
        num_replicas: replicas,
        limit_markers: Some(Duration::from_secs(86_400)),
        ..Default::default()
    }
}

/// Apply the layout, or only report how the server's differs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Apply,
    Check,
}

/// What setup found (and did) for one object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    /// `stream LH_WORK`, `consumer lh_workers_echo`, `kv lh_jobs`, ...
    pub object: String,
    pub state: ChangeState,
    /// What the operator should know beside the state (a bound lowered to
    /// fit the server).
    pub note: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChangeState {
    Unchanged,
    /// Created (Apply), or missing (Check).
    Created,
    /// Field, server's value, wanted value: updated (Apply) or drifted (Check).
    Updated(Vec<(String, String, String)>),
}

impl Change {
    /// One line for an operator: `ok`, `created`/`missing`, `updated`/`drift`.
    pub fn line(&self, mode: Mode) -> String {
        let line = self.state_line(mode);
        match &self.note {
            Some(n) => format!("{line} ({n})"),
            None => line,
        }
    }

    fn state_line(&self, mode: Mode) -> String {
        match (&self.state, mode) {
            (ChangeState::Unchanged, _) => format!("ok       {}", self.object),
            (ChangeState::Created, Mode::Apply) => format!("created  {}", self.object),
            (ChangeState::Created, Mode::Check) => format!("missing  {}", self.object),
            (ChangeState::Updated(d), m) => format!(
                "{}  {}: {}",
                if m == Mode::Apply {
                    "updated"
                } else {
                    "drift  "
                },
                self.object,
                d.iter()
                    .map(|(f, from, to)| format!("{f} {from} -> {to}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        }
    }

    pub fn changed(&self) -> bool {
        self.state != ChangeState::Unchanged
    }

    /// The same as one JSON object: `object`, `state` (`ok`, `created`,
    /// `missing`, `updated`, `drift`), `fields` (`field`, `from`, `to`)
    /// and `note`.
    pub fn json(&self, mode: Mode) -> serde_json::Value {
        let (state, fields) = match (&self.state, mode) {
            (ChangeState::Unchanged, _) => ("ok", Vec::new()),
            (ChangeState::Created, Mode::Apply) => ("created", Vec::new()),
            (ChangeState::Created, Mode::Check) => ("missing", Vec::new()),
            (ChangeState::Updated(d), m) => (
                if m == Mode::Apply { "updated" } else { "drift" },
                d.iter()
                    .map(|(f, from, to)| serde_json::json!({"field": f, "from": from, "to": to}))
                    .collect(),
            ),
        };
        serde_json::json!({"object": self.object, "state": state, "fields": fields, "note": self.note})
    }
}

/// Creates or updates everything (or, with [`Mode::Check`], only compares);
/// returns one [`Change`] per object. The order is the safe one: the
/// streams, the buckets and the object store first, the work stream (which
/// accepts submissions) once everything else exists, its consumers last.
///
/// A server that does not answer (a request timed out, JetStream has no
/// leader yet) is waited for up to [`SETUP_PATIENCE`], the whole setup
/// tried again: each step reads what is there first, so a write that
/// landed before its answer was lost is found, not made twice. A definite
/// refusal stops at once.
pub async fn ensure_with(
    conn: &Conn,
    o: &SetupOptions,
    mode: Mode,
) -> Result<Vec<Change>, StoreError> {
    crate::retry_unavailable("setup", SETUP_PATIENCE, || ensure_once(conn, o, mode)).await
}

/// How long setup waits for a server that does not answer.
pub const SETUP_PATIENCE: Duration = Duration::from_secs(30);

async fn ensure_once(conn: &Conn, o: &SetupOptions, mode: Mode) -> Result<Vec<Change>, StoreError> {
    let (l, js) = (&conn.layout, &conn.js);
    let err = setup_error;
    // The byte bounds, fitted as a whole before anything is created.
    let bounds = plan_bounds(conn, o, mode).await?;
    let mut report = Vec::new();
    for want in stream_plans(l, o, &bounds) {
        report.push(apply_fitted(js, l, &bounds, stream_target(js, want), mode, &err).await?);
    }
    for cfg in bucket_plans(l, o, &bounds) {
        report.push(apply_fitted(js, l, &bounds, bucket_target(js, cfg), mode, &err).await?);
    }
    let artifacts = object_store_target(js, l, o, &bounds);
    report.push(apply_fitted(js, l, &bounds, artifacts, mode, &err).await?);
    // Last, the work stream: a layout that failed half-way accepts no
    // submission.
    let work = stream_target(js, work_plan(l, o, &bounds));
    report.push(apply_fitted(js, l, &bounds, work, mode, &err).await?);
    for (stream_name, cfg) in consumer_plans(l, o) {
        report.push(apply_consumer(js, &stream_name, cfg, mode, &err).await?);
    }
    Ok(report)
}

/// Creates or updates everything; returns one line per object.
pub async fn ensure(conn: &Conn, o: &SetupOptions) -> Result<Vec<String>, StoreError> {
    Ok(ensure_with(conn, o, Mode::Apply)
        .await?
        .iter()
        .map(|c| c.line(Mode::Apply))
        .collect())
}

/// The kinds set up now: those whose submit subject the work stream
/// captures (`None`: no work stream yet).
pub async fn kinds_set_up(conn: &Conn) -> Result<Option<Vec<String>>, StoreError> {
    let l = &conn.layout;
    let mut s = match conn.js.get_stream(l.work_stream()).await {
        Ok(s) => s,
        Err(e) => {
            return match crate::lookup_error(format!("stream {}", l.work_stream()), &e) {
                StoreError::Missing(_) => Ok(None),
                other => Err(other),
            }
        }
    };
    let info = s
        .info()
        .await
        .map_err(|e| StoreError::Unavailable(format!("stream {}: {e}", l.work_stream())))?;
    Ok(Some(
        info.config
            .subjects
            .iter()
            .filter_map(|subj| l.kind_of_submit_subject(subj).map(str::to_string))
            .collect(),
    ))
}

/// The settings of the layout on the server that `leasehold setup` decides
/// besides the kinds and the byte bounds, each `None` when its object is
/// not there: a setup that is not asked to change one keeps it (an operator
/// adding a kind must not, say, take a cluster's streams down to one
/// replica).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SetUp {
    pub replicas: Option<usize>,
    pub dedupe_window: Option<Duration>,
    pub work_max_msgs: Option<i64>,
    pub ack_wait: Option<Duration>,
    pub max_deliver: Option<i64>,
    pub max_waiting: Option<i64>,
    pub events_max_age: Option<Duration>,
    pub effects_retention: Option<Duration>,
    pub job_history: Option<i64>,
    pub dlq_max_age: Option<Duration>,
    pub dlq_max_msgs: Option<i64>,
}

/// Reads [`SetUp`] from the server (one stream info per object, and the
/// first work consumer's config).
pub async fn settings_set_up(conn: &Conn) -> Result<SetUp, StoreError> {
    let l = &conn.layout;
    let err = |name: &str, e: &(dyn std::error::Error + 'static)| {
        StoreError::Unavailable(format!("stream {name}: {e}"))
    };
    let js = &conn.js;
    let work = current_config(js, &l.work_stream(), "work stream", &err).await?;
    let events = current_config(js, &l.events_stream(), "event stream", &err).await?;
    let dlq = current_config(js, &l.dlq_stream(), "dead-letter stream", &err).await?;
    let jobs = current_config(js, &format!("KV_{}", l.jobs_bucket()), "jobs bucket", &err).await?;
    let effects = current_config(
        js,
        &format!("KV_{}", l.effects_bucket()),
        "effects bucket",
        &err,
    )
    .await?;
    let mut s = SetUp {
        replicas: work.as_ref().map(|c| c.num_replicas.max(1)),
        dedupe_window: work.as_ref().map(|c| c.duplicate_window),
        // An unbounded count (an earlier release's) is not kept: it gets
        // the default bound.
        work_max_msgs: work.as_ref().map(|c| c.max_messages).filter(|m| *m > 0),
        events_max_age: events.as_ref().map(|c| c.max_age),
        effects_retention: effects.as_ref().map(|c| c.max_age),
        job_history: jobs.as_ref().map(|c| c.max_messages_per_subject),
        dlq_max_age: dlq.as_ref().map(|c| c.max_age),
        dlq_max_msgs: dlq.as_ref().map(|c| c.max_messages).filter(|m| *m > 0),
        ..SetUp::default()
    };
    let kinds = work
        .as_ref()
        .map(|c| {
            c.subjects
                .iter()
                .filter_map(|subj| l.kind_of_submit_subject(subj).map(str::to_string))
                .collect::<Vec<_>>()
        })
        .unwrap_or_default();
    if let Some(kind) = kinds.first() {
        let stream = js
            .get_stream_no_info(l.work_stream())
            .await
            .map_err(|e| StoreError::nats("work stream", e))?;
        match stream.consumer_info(l.work_consumer(kind)).await {
            Ok(info) => {
                s.ack_wait = Some(info.config.ack_wait);
                s.max_deliver = Some(info.config.max_deliver);
                s.max_waiting = Some(info.config.max_waiting);
            }
            Err(e) if crate::is_not_found(&e) => {}
            Err(e) => return Err(StoreError::nats("work consumer", e)),
        }
    }
    Ok(s)
}

/// Tickets of `kind` in the work stream now, in every lane (waiting or
/// held by a worker).
pub async fn tickets_of_kind(conn: &Conn, kind: &str) -> Result<u64, StoreError> {
    let l = &conn.layout;
    let s = conn
        .js
        .get_stream_no_info(l.work_stream())
        .await
        .map_err(|e| StoreError::nats("work stream", e))?;
    let mut n = 0;
    for filter in [l.submit_subject(kind), l.lanes_filter(kind)] {
        let mut info = s
            .info_with_subjects(filter)
            .await
            .map_err(|e| StoreError::nats("work stream subjects", e))?;
        while let Some(x) = futures::StreamExt::next(&mut info).await {
            let (subj, count) = x.map_err(|e| StoreError::nats("work stream subjects", e))?;
            if l.kind_of_submit_subject(&subj) == Some(kind) {
                n += count as u64;
            }
        }
    }
    Ok(n)
}

/// Removes `kind`'s work consumer and its lanes' (after its subjects left
/// the work stream).
pub async fn remove_kind_consumer(conn: &Conn, kind: &str) -> Result<bool, StoreError> {
    let l = &conn.layout;
    let s = conn
        .js
        .get_stream_no_info(l.work_stream())
        .await
        .map_err(|e| StoreError::nats("work stream", e))?;
    let lanes = l.lane_consumers_prefix(kind);
    let mut names = s.consumer_names();
    let mut lane_consumers = Vec::new();
    while let Some(n) = futures::StreamExt::next(&mut names).await {
        let n = n.map_err(|e| StoreError::nats("list consumers", e))?;
        if n.starts_with(&lanes) {
            lane_consumers.push(n);
        }
    }
    for n in lane_consumers {
        match s.delete_consumer(&n).await {
            Ok(_) => {}
            Err(e) if crate::is_not_found(&e) => {}
            Err(e) => return Err(StoreError::nats("delete consumer", e)),
        }
    }
    match s.delete_consumer(&l.work_consumer(kind)).await {
        Ok(_) => Ok(true),
        Err(e) if crate::is_not_found(&e) => Ok(false),
        Err(e) => Err(StoreError::nats("delete consumer", e)),
    }
}

/// Checks that what `kinds` need exists; the error lists exactly what is
/// missing. A lookup the server did not answer is
/// [`StoreError::Unavailable`], never "missing": callers retry it (see
/// [`crate::retry_unavailable`]) instead of sending the operator to re-run
/// setup during a leader election.
pub async fn verify(conn: &Conn, kinds: &[String]) -> Result<(), StoreError> {
    let l = &conn.layout;
    let js = &conn.js;
    let mut missing = Vec::new();
    // Not found is collected; anything else stops the check as unavailable.
    let mut note = |r: Result<(), StoreError>| -> Result<(), StoreError> {
        match r {
            Ok(()) => Ok(()),
            Err(StoreError::Missing(m)) => {
                missing.extend(m);
                Ok(())
            }
            Err(e) => Err(e),
        }
    };
    let work = js
        .get_stream(l.work_stream())
        .await
        .map_err(|e| crate::lookup_error(format!("stream {}", l.work_stream()), &e));
    match work {
        Ok(mut s) => {
            let subjects = s
                .info()
                .await
                .map(|i| i.config.subjects.clone())
                .map_err(|e| StoreError::Unavailable(format!("stream {}: {e}", l.work_stream())))?;
            for kind in kinds {
                for subj in [l.submit_subject(kind), l.lanes_filter(kind)] {
                    if !subjects.contains(&subj) {
                        note(Err(StoreError::Missing(vec![format!(
                            "subject {subj} on stream {}",
                            l.work_stream()
                        )])))?;
                    }
                }
                let name = l.work_consumer(kind);
                note(
                    s.consumer_info(&name)
                        .await
                        .map(|_| ())
                        .map_err(|e| crate::lookup_error(format!("consumer {name}"), &e)),
                )?;
            }
        }
        Err(e) => note(Err(e))?,
    }
    for name in [
        l.events_stream(),
        l.dlq_stream(),
        l.advisory_stream(),
        l.signals_stream(),
    ] {
        note(
            js.get_stream(&name)
                .await
                .map(|_| ())
                .map_err(|e| crate::lookup_error(format!("stream {name}"), &e)),
        )?;
    }
    for b in [
        l.jobs_bucket(),
        l.effects_bucket(),
        l.sessions_bucket(),
        l.active_bucket(),
        l.payloads_bucket(),
    ] {
        match crate::open_kv(conn, &b).await {
            // A ledger made by an earlier release lets its entries expire:
            // the layout is not usable until setup upgrades it.
            Ok(kv) if b == l.effects_bucket() && !crate::effects::allows_pinned(&kv) => {
                note(Err(StoreError::Missing(vec![format!(
                    "per-message TTLs on KV bucket {b} (an earlier release's ledger)"
                )])))?
            }
            Ok(_) => {}
            Err(e) => note(Err(e))?,
        }
    }
    let watch = l.session_watch_consumer();
    if let Ok(ss) = js
        .get_stream_no_info(format!("KV_{}", l.sessions_bucket()))
        .await
    {
        note(
            ss.consumer_info(&watch)
                .await
                .map(|_| ())
                .map_err(|e| crate::lookup_error(format!("consumer {watch}"), &e)),
        )?;
    }
    let wakes = l.signal_wake_consumer();
    if let Ok(ss) = js.get_stream_no_info(l.signals_stream()).await {
        note(
            ss.consumer_info(&wakes)
                .await
                .map(|_| ())
                .map_err(|e| crate::lookup_error(format!("consumer {wakes}"), &e)),
        )?;
    }
    let obj = l.artifacts_bucket();
    note(
        js.get_object_store(&obj)
            .await
            .map(|_| ())
            .map_err(|e| crate::lookup_error(format!("object store {obj}"), &e)),
    )?;
    if missing.is_empty() {
        Ok(())
    } else {
        Err(StoreError::Missing(missing))
    }
}

/// The server's JetStream API is reachable (used to give a clear error early).
pub async fn ping(js: &jetstream::Context) -> Result<(), StoreError> {
    use async_nats::jetstream::context::AccountErrorKind;
    match js.query_account().await {
        Ok(_) => Ok(()),
        // Nobody serves the JetStream API here: it is not enabled.
        Err(e) if e.kind() == AccountErrorKind::JetStreamUnavailable => Err(StoreError::failed(
            format!("JetStream is not available on this server ({e}); start nats-server with -js"),
        )),
        // A timeout or an error during a leader election: try again.
        Err(e) => Err(StoreError::Unavailable(format!(
            "JetStream did not answer ({e})"
        ))),
    }
}
