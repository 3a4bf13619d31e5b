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
//! | `lh_payloads` | KV bucket | large inputs and outputs beside their records (`<job>.input`, `<job>.output`) |
//!
//! Every stream and bucket is bounded (see [`SetupOptions`]). Running setup
//! again migrates: it compares what the server has with what is wanted,
//! updates what differs and says so; [`Mode::Check`] only reports the drift.

use std::time::Duration;

use async_nats::jetstream::{self, consumer, kv, object_store, stream};

use crate::{Conn, StoreError};

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
    /// their job (`EffectsLedger::purge_job`), never while it may resume.
    pub effects_retention: Duration,
    /// KV history kept per job record (default 8 revisions).
    pub job_history: i64,
    /// Dead letters: kept at most this long (default 30 days), this many
    /// (default 100,000) and this many bytes (default 1 GiB); the oldest go first.
    pub dlq_max_age: Duration,
    pub dlq_max_msgs: i64,
    pub dlq_max_bytes: i64,
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
}

impl Fit {
    /// Every bound as given: none is lowered.
    pub const EXACT: Fit = Fit {
        work: false,
        events: false,
        dlq: false,
    };
    /// Every bound a default that may be lowered.
    pub const DEFAULTS: Fit = Fit {
        work: true,
        events: true,
        dlq: true,
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
}

fn dur(d: Duration) -> String {
    if d.is_zero() {
        "none".into()
    } else {
        leasehold_core::time::format_duration(d)
    }
}

/// A limit as the server shows it; 0 and -1 both mean "none" (the server
/// stores an unset limit as -1).
fn num(n: i64) -> String {
    if n <= 0 {
        "none".into()
    } else {
        n.to_string()
    }
}

/// Whether `cur` is what fitting `asked` to a small server gives: `asked`
/// halved one or more times, not below [`FIT_FLOOR`].
fn is_fitted(cur: i64, asked: i64) -> bool {
    let mut b = asked;
    while b / 2 >= FIT_FLOOR {
        b /= 2;
        if b == cur {
            return true;
        }
    }
    false
}

/// Bytes for an operator: `2 GiB`, `640 MiB`.
fn human_bytes(b: i64) -> String {
    if b >= 1 << 30 && b % (1 << 30) == 0 {
        format!("{} GiB", b >> 30)
    } else if b >= 1 << 30 {
        format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64)
    } else {
        format!("{} MiB", b >> 20)
    }
}

/// The fields of a stream this setup decides, compared.
fn stream_drift(cur: &stream::Config, want: &stream::Config) -> Vec<(String, String, String)> {
    let mut d = Vec::new();
    let mut check = |f: &str, a: String, b: String| {
        if a != b {
            d.push((f.to_string(), a, b));
        }
    };
    let mut subj_cur = cur.subjects.clone();
    let mut subj_want = want.subjects.clone();
    subj_cur.sort();
    subj_want.sort();
    check("subjects", subj_cur.join(","), subj_want.join(","));
    check(
        "replicas",
        cur.num_replicas.to_string(),
        want.num_replicas.to_string(),
    );
    check("max_age", dur(cur.max_age), dur(want.max_age));
    check("max_msgs", num(cur.max_messages), num(want.max_messages));
    check("max_bytes", num(cur.max_bytes), num(want.max_bytes));
    check(
        "max_msg_size",
        num(cur.max_message_size as i64),
        num(want.max_message_size as i64),
    );
    check(
        "max_msgs_per_subject",
        num(cur.max_messages_per_subject),
        num(want.max_messages_per_subject),
    );
    check(
        "discard",
        format!("{:?}", cur.discard),
        format!("{:?}", want.discard),
    );
    check(
        "dedupe_window",
        dur(cur.duplicate_window),
        dur(want.duplicate_window),
    );
    check(
        "compression",
        format!(
            "{:?}",
            cur.compression.clone().unwrap_or(stream::Compression::None)
        ),
        format!(
            "{:?}",
            want.compression
                .clone()
                .unwrap_or(stream::Compression::None)
        ),
    );
    check(
        "marker_ttl",
        dur(cur.subject_delete_marker_ttl.unwrap_or_default()),
        dur(want.subject_delete_marker_ttl.unwrap_or_default()),
    );
    d
}

/// The stream behind a KV bucket as this setup wants it (the fields it decides).
fn kv_stream_want(cfg: &kv::Config) -> stream::Config {
    stream::Config {
        subjects: vec![format!("$KV.{}.>", cfg.bucket)],
        num_replicas: cfg.num_replicas.max(1),
        max_age: cfg.max_age,
        max_messages: -1,
        max_bytes: if cfg.max_bytes == 0 {
            -1
        } else {
            cfg.max_bytes
        },
        max_message_size: if cfg.max_value_size == 0 {
            -1
        } else {
            cfg.max_value_size
        },
        max_messages_per_subject: cfg.history,
        discard: stream::DiscardPolicy::New,
        duplicate_window: if cfg.max_age.is_zero() || cfg.max_age > Duration::from_secs(120) {
            Duration::from_secs(120)
        } else {
            cfg.max_age
        },
        subject_delete_marker_ttl: cfg.limit_markers,
        ..Default::default()
    }
}

/// Creates or updates everything (or, with [`Mode::Check`], only compares);
/// returns one [`Change`] per object.
pub async fn ensure_with(
    conn: &Conn,
    o: &SetupOptions,
    mode: Mode,
) -> Result<Vec<Change>, StoreError> {
    let l = &conn.layout;
    let js = &conn.js;
    let mut report = Vec::new();
    let err = |what: &str, e: &dyn std::fmt::Display| {
        let text = e.to_string();
        if text.contains("10047") {
            StoreError::Config(format!(
                "setup {what}: the server's JetStream storage limit (max_file_store) is smaller than the bounds asked for; lower them (--work-max-bytes, --events-max-bytes, --dlq-max-bytes) or raise the server's limit ({text})"
            ))
        } else {
            StoreError::Nats(format!("setup {what}: {text}"))
        }
    };

    // Streams, each with its bounds.
    let mut streams = vec![stream::Config {
        name: l.work_stream(),
        description: Some("leasehold work tickets (one per job until it is terminal)".into()),
        subjects: o.kinds.iter().map(|k| l.submit_subject(k)).collect(),
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream::StorageType::File,
        num_replicas: o.replicas,
        duplicate_window: o.dedupe_window,
        max_messages: o.work_max_msgs,
        max_bytes: o.work_max_bytes,
        discard: stream::DiscardPolicy::New,
        ..Default::default()
    }];
    for (name, subject, age, dedupe, msgs, bytes, discard, what) in [
        (
            l.events_stream(),
            l.events_wildcard(),
            o.events_max_age,
            Duration::from_secs(120),
            -1,
            o.events_max_bytes,
            stream::DiscardPolicy::New,
            "job events",
        ),
        (
            l.dlq_stream(),
            l.dlq_wildcard(),
            o.dlq_max_age,
            Duration::from_secs(3600),
            o.dlq_max_msgs,
            o.dlq_max_bytes,
            stream::DiscardPolicy::Old,
            "dead letters",
        ),
        (
            l.advisory_stream(),
            l.max_deliveries_advisories(),
            Duration::from_secs(7 * 86_400),
            Duration::from_secs(120),
            100_000,
            64 << 20,
            stream::DiscardPolicy::Old,
            "max-deliveries advisories",
        ),
    ] {
        streams.push(stream::Config {
            name: name.clone(),
            description: Some(format!("leasehold {what}")),
            subjects: vec![subject.clone()],
            retention: stream::RetentionPolicy::Limits,
            storage: stream::StorageType::File,
            num_replicas: o.replicas,
            max_age: age,
            max_messages: msgs,
            max_bytes: bytes,
            discard,
            duplicate_window: dedupe,
            allow_direct: true,
            max_message_size: if name == l.events_stream() {
                o.events_max_msg_size
            } else {
                -1
            },
            compression: (name != l.advisory_stream()).then_some(stream::Compression::S2),
            ..Default::default()
        });
    }
    for mut want in streams {
        let object = format!("stream {}", want.name);
        let fit = (want.name == l.work_stream() && o.fit.work)
            || (want.name == l.events_stream() && o.fit.events)
            || (want.name == l.dlq_stream() && o.fit.dlq);
        let asked = want.max_bytes;
        let cur = match js.get_stream(&want.name).await {
            Ok(mut s) => Some(
                s.info()
                    .await
                    .map_err(|e| err(&want.name, &e))?
                    .config
                    .clone(),
            ),
            Err(e) if crate::is_not_found(&e) => None,
            Err(e) => return Err(crate::lookup_error(object, &e)),
        };
        // A default bound an earlier setup already fitted to this server
        // stays as it is when only checking.
        if let (Some(c), Mode::Check, true) = (&cur, mode, fit) {
            if is_fitted(c.max_bytes, asked) {
                want.max_bytes = c.max_bytes;
            }
        }
        let state = loop {
            let state = match &cur {
                Some(c) => match stream_drift(c, &want) {
                    d if d.is_empty() => ChangeState::Unchanged,
                    d => ChangeState::Updated(d),
                },
                None => ChangeState::Created,
            };
            let applied = match (&state, mode) {
                (ChangeState::Updated(_), Mode::Apply) => {
                    js.update_stream(want.clone()).await.map(drop)
                }
                (ChangeState::Created, Mode::Apply) => {
                    js.create_stream(want.clone()).await.map(drop)
                }
                _ => Ok(()),
            };
            match applied {
                Ok(()) => break state,
                // Too big for the server's storage limit: a default bound
                // is halved and tried again.
                Err(e)
                    if fit
                        && want.max_bytes / 2 >= FIT_FLOOR
                        && e.to_string().contains("10047") =>
                {
                    want.max_bytes /= 2;
                }
                Err(e) => return Err(err(&want.name, &e)),
            }
        };
        let note = (want.max_bytes != asked).then(|| {
            format!(
                "max_bytes {} instead of the default {}: the server's JetStream storage limit (max_file_store) holds no more; raise it, or pass the bound explicitly",
                human_bytes(want.max_bytes),
                human_bytes(asked)
            )
        });
        report.push(Change {
            object,
            state,
            note,
        });
    }

    // Consumers: one per kind on the work stream, and the shared watcher of
    // ended sessions (on the sessions bucket's stream, made below).
    let mut consumers: Vec<(String, consumer::pull::Config)> = o
        .kinds
        .iter()
        .map(|kind| {
            let name = l.work_consumer(kind);
            (
                l.work_stream(),
                consumer::pull::Config {
                    durable_name: Some(name),
                    description: Some(format!("leasehold workers of kind {kind}")),
                    filter_subject: l.submit_subject(kind),
                    ack_policy: consumer::AckPolicy::Explicit,
                    ack_wait: o.ack_wait,
                    max_deliver: o.max_deliver,
                    max_ack_pending: 100_000,
                    max_waiting: o.max_waiting,
                    ..Default::default()
                },
            )
        })
        .collect();

    // KV buckets.
    let buckets = [
        kv::Config {
            bucket: l.jobs_bucket(),
            description: "leasehold job records (authoritative state)".into(),
            history: o.job_history,
            storage: stream::StorageType::File,
            num_replicas: o.replicas,
            // Records removed at the end of their retention leave a marker
            // that expires on its own (the server gives a purge marker this
            // TTL whatever the purge asks): a minute, so retention's
            // leftovers stop taking room within one.
            limit_markers: Some(crate::retention::MARKER_TTL),
            ..Default::default()
        },
        // Sessions: per-key TTL with markers, so an ended session is an
        // event. A marker stays a day: long enough for a recoverer to come back.
        kv::Config {
            bucket: l.sessions_bucket(),
            description: "leasehold worker sessions (one key per live worker process)".into(),
            history: 1,
            storage: stream::StorageType::File,
            num_replicas: o.replicas,
            limit_markers: Some(Duration::from_secs(86_400)),
            ..Default::default()
        },
        kv::Config {
            bucket: l.active_bucket(),
            description: "leasehold index of active jobs (running by owner, waiting, parked)"
                .into(),
            history: 1,
            storage: stream::StorageType::File,
            num_replicas: o.replicas,
            limit_markers: Some(Duration::from_secs(60)),
            ..Default::default()
        },
        kv::Config {
            bucket: l.payloads_bucket(),
            description: "leasehold large job inputs and outputs, beside their small records"
                .into(),
            history: 1,
            storage: stream::StorageType::File,
            num_replicas: o.replicas,
            limit_markers: Some(Duration::from_secs(60)),
            ..Default::default()
        },
        effects_config(l.effects_bucket(), o.effects_retention, o.replicas),
    ];
    for cfg in buckets {
        let object = format!("kv {}", cfg.bucket);
        let stream_name = format!("KV_{}", cfg.bucket);
        let want = kv_stream_want(&cfg);
        let state = match js.get_stream(&stream_name).await {
            Ok(mut s) => {
                let cur = s
                    .info()
                    .await
                    .map_err(|e| err(&stream_name, &e))?
                    .config
                    .clone();
                let mut d = stream_drift(&cur, &want);
                // The bucket's own subjects and dedupe window are the client's business.
                d.retain(|(f, _, _)| {
                    f != "subjects" && f != "dedupe_window" && f != "discard" && f != "max_msg_size"
                });
                if d.is_empty() {
                    ChangeState::Unchanged
                } else {
                    if mode == Mode::Apply {
                        js.create_or_update_key_value(cfg.clone())
                            .await
                            .map_err(|e| err(&cfg.bucket, &e))?;
                    }
                    ChangeState::Updated(d)
                }
            }
            Err(e) if crate::is_not_found(&e) => {
                if mode == Mode::Apply {
                    js.create_or_update_key_value(cfg.clone())
                        .await
                        .map_err(|e| err(&cfg.bucket, &e))?;
                }
                ChangeState::Created
            }
            Err(e) => return Err(crate::lookup_error(object, &e)),
        };
        report.push(Change {
            object,
            state,
            note: None,
        });
    }

    consumers.push((
        format!("KV_{}", l.sessions_bucket()),
        consumer::pull::Config {
            durable_name: Some(l.session_watch_consumer()),
            description: Some(
                "leasehold: ended worker sessions, handled by any worker or reaper".into(),
            ),
            filter_subject: format!("$KV.{}.>", l.sessions_bucket()),
            ack_policy: consumer::AckPolicy::Explicit,
            // Short: a member that stops (paused, partitioned) while it
            // holds an end gives it up within seconds; a member working on
            // one keeps it with progress acks.
            ack_wait: Duration::from_secs(3),
            headers_only: true,
            deliver_policy: consumer::DeliverPolicy::New,
            max_ack_pending: 10_000,
            // Every worker and reaper long-polls it.
            max_waiting: o.max_waiting,
            ..Default::default()
        },
    ));
    for (stream_name, cfg) in consumers {
        let name = cfg.durable_name.clone().expect("durable");
        let object = format!("consumer {name}");
        let mut note = None;
        let s = match js.get_stream_no_info(&stream_name).await {
            Ok(s) => s,
            Err(e) => return Err(crate::lookup_error(format!("stream {stream_name}"), &e)),
        };
        let state = match s.consumer_info(&name).await {
            Ok(info) => {
                let c = &info.config;
                let mut d = Vec::new();
                for (f, a, b) in [
                    ("ack_wait", dur(c.ack_wait), dur(cfg.ack_wait)),
                    ("max_deliver", num(c.max_deliver), num(cfg.max_deliver)),
                    (
                        "max_ack_pending",
                        num(c.max_ack_pending),
                        num(cfg.max_ack_pending),
                    ),
                    ("max_waiting", num(c.max_waiting), num(cfg.max_waiting)),
                    (
                        "filter_subject",
                        c.filter_subject.clone(),
                        cfg.filter_subject.clone(),
                    ),
                ] {
                    if a != b {
                        d.push((f.to_string(), a, b));
                    }
                }
                if d.is_empty() {
                    ChangeState::Unchanged
                } else {
                    if mode == Mode::Apply {
                        match s.update_consumer(cfg.clone()).await {
                            Ok(_) => {}
                            // Some fields (max_waiting) cannot change in
                            // place: the consumer is made again. Its
                            // tickets stay in the work queue; those not yet
                            // acknowledged are delivered again, which a
                            // claim tells apart from new work.
                            Err(e) if e.to_string().contains("can not be updated") => {
                                s.delete_consumer(&name).await.map_err(|e| err(&name, &e))?;
                                s.create_consumer(cfg.clone())
                                    .await
                                    .map_err(|e| err(&name, &e))?;
                                note = Some(
                                    "made again: the server cannot change this in place; unacknowledged tickets are delivered again".to_string(),
                                );
                            }
                            Err(e) => return Err(err(&name, &e)),
                        }
                    }
                    ChangeState::Updated(d)
                }
            }
            Err(e) if crate::is_not_found(&e) => {
                if mode == Mode::Apply {
                    s.create_consumer(cfg.clone())
                        .await
                        .map_err(|e| err(&name, &e))?;
                }
                ChangeState::Created
            }
            Err(e) => return Err(crate::lookup_error(object, &e)),
        };
        report.push(Change {
            object,
            state,
            note,
        });
    }

    let object = format!("object store {}", l.artifacts_bucket());
    let state = match js.get_object_store(l.artifacts_bucket()).await {
        Ok(_) => ChangeState::Unchanged,
        Err(e) if crate::is_not_found(&e) => {
            if mode == Mode::Apply {
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
            ChangeState::Created
        }
        Err(e) => return Err(crate::lookup_error(object, &e)),
    };
    report.push(Change {
        object,
        state,
        note: None,
    });
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

/// Tickets of `kind` in the work stream now (waiting or held by a worker).
pub async fn tickets_of_kind(conn: &Conn, kind: &str) -> Result<u64, StoreError> {
    let l = &conn.layout;
    let s = conn
        .js
        .get_stream_no_info(l.work_stream())
        .await
        .map_err(|e| StoreError::nats("work stream", e))?;
    let subject = l.submit_subject(kind);
    let mut info = s
        .info_with_subjects(subject.clone())
        .await
        .map_err(|e| StoreError::nats("work stream subjects", e))?;
    let mut n = 0;
    while let Some(x) = futures::StreamExt::next(&mut info).await {
        let (subj, count) = x.map_err(|e| StoreError::nats("work stream subjects", e))?;
        if subj == subject {
            n += count as u64;
        }
    }
    Ok(n)
}

/// Removes `kind`'s work consumer (after its subject left the work stream).
pub async fn remove_kind_consumer(conn: &Conn, kind: &str) -> Result<bool, StoreError> {
    let l = &conn.layout;
    let s = conn
        .js
        .get_stream_no_info(l.work_stream())
        .await
        .map_err(|e| StoreError::nats("work stream", e))?;
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
        Err(e) if e.kind() == AccountErrorKind::JetStreamUnavailable => Err(StoreError::Nats(
            format!("JetStream is not available on this server ({e}); start nats-server with -js"),
        )),
        // A timeout or an error during a leader election: try again.
        Err(e) => Err(StoreError::Unavailable(format!(
            "JetStream did not answer ({e})"
        ))),
    }
}
