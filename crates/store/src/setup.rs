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
//! | `lh_active` | KV bucket | the index of active jobs (`run.<worker>.<job>`, `wait.<job>`, `park.<job>`) |

use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv, object_store, stream};

use crate::{Conn, StoreError};

/// What `leasehold setup` creates. Durations and counts have the defaults
/// documented on each field.
#[derive(Debug, Clone)]
pub struct SetupOptions {
    /// Replicas of every stream and bucket (1 on a single server, 3 in a cluster).
    pub replicas: usize,
    /// Kinds that get a subject and a consumer.
    pub kinds: Vec<String>,
    /// Consumer ack wait: how long a delivered ticket waits for an ack or a
    /// progress ack before it is redelivered (default 30 s). Workers send
    /// progress acks every third of it.
    pub ack_wait: Duration,
    /// Deliveries of one ticket before the server gives up and advises (default 20).
    pub max_deliver: i64,
    /// Dedupe window of submissions by `Nats-Msg-Id` (default 1 h); the job
    /// record's existence dedupes beyond it.
    pub dedupe_window: Duration,
    /// How long events are kept (default 30 days).
    pub events_max_age: Duration,
    /// The effects bucket's `max_age` (default 7 days). Ledger entries are
    /// written with `Nats-TTL: never` and outlive it: they are removed with
    /// their job (`EffectsLedger::purge_job`), never while it may resume.
    pub effects_retention: Duration,
    /// KV history kept per job record (default 64 revisions).
    pub job_history: i64,
}

impl Default for SetupOptions {
    fn default() -> Self {
        SetupOptions {
            replicas: 1,
            kinds: leasehold_core::spec::Kinds::default()
                .names()
                .iter()
                .map(|s| s.to_string())
                .collect(),
            ack_wait: Duration::from_secs(30),
            max_deliver: 20,
            dedupe_window: Duration::from_secs(3600),
            events_max_age: Duration::from_secs(30 * 86_400),
            effects_retention: Duration::from_secs(7 * 86_400),
            job_history: 64,
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

/// Creates or updates everything; returns one line per object.
pub async fn ensure(conn: &Conn, o: &SetupOptions) -> Result<Vec<String>, StoreError> {
    let l = &conn.layout;
    let js = &conn.js;
    let mut report = Vec::new();
    let err =
        |what: &str, e: &dyn std::fmt::Display| StoreError::Nats(format!("setup {what}: {e}"));

    let work = stream::Config {
        name: l.work_stream(),
        description: Some("leasehold work tickets (one per job until it is terminal)".into()),
        subjects: o.kinds.iter().map(|k| l.submit_subject(k)).collect(),
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream::StorageType::File,
        num_replicas: o.replicas,
        duplicate_window: o.dedupe_window,
        ..Default::default()
    };
    js.create_or_update_stream(work)
        .await
        .map_err(|e| err("work stream", &e))?;
    report.push(format!(
        "stream {} (subjects {})",
        l.work_stream(),
        l.submit_wildcard()
    ));

    let ws = js
        .get_stream(l.work_stream())
        .await
        .map_err(|e| err("work stream", &e))?;
    for kind in &o.kinds {
        let name = l.work_consumer(kind);
        let cfg = consumer::pull::Config {
            durable_name: Some(name.clone()),
            description: Some(format!("leasehold workers of kind {kind}")),
            filter_subject: l.submit_subject(kind),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: o.ack_wait,
            max_deliver: o.max_deliver,
            max_ack_pending: 100_000,
            ..Default::default()
        };
        if ws.consumer_info(&name).await.is_ok() {
            ws.update_consumer(cfg).await.map_err(|e| err(&name, &e))?;
        } else {
            ws.create_consumer(cfg).await.map_err(|e| err(&name, &e))?;
        }
        report.push(format!(
            "consumer {name} (ack wait {:?}, max deliver {})",
            o.ack_wait, o.max_deliver
        ));
    }

    js.create_or_update_key_value(kv::Config {
        bucket: l.jobs_bucket(),
        description: "leasehold job records (authoritative state)".into(),
        history: o.job_history,
        storage: stream::StorageType::File,
        num_replicas: o.replicas,
        ..Default::default()
    })
    .await
    .map_err(|e| err("jobs bucket", &e))?;
    report.push(format!("kv {}", l.jobs_bucket()));

    // Sessions: per-key TTL with markers, so an ended session is an event.
    // A marker stays a day: long enough for a recoverer to come back.
    js.create_or_update_key_value(kv::Config {
        bucket: l.sessions_bucket(),
        description: "leasehold worker sessions (one key per live worker process)".into(),
        history: 1,
        storage: stream::StorageType::File,
        num_replicas: o.replicas,
        limit_markers: Some(Duration::from_secs(86_400)),
        ..Default::default()
    })
    .await
    .map_err(|e| err("sessions bucket", &e))?;
    report.push(format!("kv {}", l.sessions_bucket()));
    let ss = js
        .get_stream(format!("KV_{}", l.sessions_bucket()))
        .await
        .map_err(|e| err("sessions stream", &e))?;
    let watch = l.session_watch_consumer();
    let watch_cfg = consumer::pull::Config {
        durable_name: Some(watch.clone()),
        description: Some(
            "leasehold: ended worker sessions, handled by any worker or reaper".into(),
        ),
        filter_subject: format!("$KV.{}.>", l.sessions_bucket()),
        ack_policy: consumer::AckPolicy::Explicit,
        ack_wait: Duration::from_secs(30),
        headers_only: true,
        deliver_policy: consumer::DeliverPolicy::New,
        max_ack_pending: 10_000,
        ..Default::default()
    };
    if ss.consumer_info(&watch).await.is_ok() {
        ss.update_consumer(watch_cfg)
            .await
            .map_err(|e| err(&watch, &e))?;
    } else {
        ss.create_consumer(watch_cfg)
            .await
            .map_err(|e| err(&watch, &e))?;
    }
    report.push(format!("consumer {watch} (ended sessions)"));

    js.create_or_update_key_value(kv::Config {
        bucket: l.active_bucket(),
        description: "leasehold index of active jobs (running by owner, waiting, parked)".into(),
        history: 1,
        storage: stream::StorageType::File,
        num_replicas: o.replicas,
        limit_markers: Some(Duration::from_secs(60)),
        ..Default::default()
    })
    .await
    .map_err(|e| err("active index", &e))?;
    report.push(format!("kv {}", l.active_bucket()));

    js.create_or_update_key_value(effects_config(
        l.effects_bucket(),
        o.effects_retention,
        o.replicas,
    ))
    .await
    .map_err(|e| err("effects bucket", &e))?;
    report.push(format!("kv {}", l.effects_bucket()));

    if js.get_object_store(l.artifacts_bucket()).await.is_err() {
        js.create_object_store(object_store::Config {
            bucket: l.artifacts_bucket(),
            description: Some("leasehold artifacts (reports)".into()),
            storage: stream::StorageType::File,
            num_replicas: o.replicas,
            ..Default::default()
        })
        .await
        .map_err(|e| err("artifacts", &e))?;
    }
    report.push(format!("object store {}", l.artifacts_bucket()));

    for (name, subject, age, dedupe, what) in [
        (
            l.events_stream(),
            l.events_wildcard(),
            o.events_max_age,
            Duration::from_secs(120),
            "job events",
        ),
        (
            l.dlq_stream(),
            l.dlq_wildcard(),
            Duration::ZERO,
            Duration::from_secs(3600),
            "dead letters",
        ),
        (
            l.advisory_stream(),
            l.max_deliveries_advisories(),
            Duration::from_secs(7 * 86_400),
            Duration::from_secs(120),
            "max-deliveries advisories",
        ),
    ] {
        js.create_or_update_stream(stream::Config {
            name: name.clone(),
            description: Some(format!("leasehold {what}")),
            subjects: vec![subject.clone()],
            retention: stream::RetentionPolicy::Limits,
            storage: stream::StorageType::File,
            num_replicas: o.replicas,
            max_age: age,
            duplicate_window: dedupe,
            allow_direct: true,
            ..Default::default()
        })
        .await
        .map_err(|e| err(&name, &e))?;
        report.push(format!("stream {name} ({subject})"));
    }
    Ok(report)
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
                let subj = l.submit_subject(kind);
                if !subjects.contains(&subj) {
                    note(Err(StoreError::Missing(vec![format!(
                        "subject {subj} on stream {}",
                        l.work_stream()
                    )])))?;
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
    for name in [l.events_stream(), l.dlq_stream(), l.advisory_stream()] {
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
    ] {
        note(crate::open_kv(conn, &b).await.map(|_| ()))?;
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
    js.query_account().await.map(|_| ()).map_err(|e| {
        StoreError::Nats(format!(
            "JetStream is not available on this server ({e}); start nats-server with -js"
        ))
    })
}
