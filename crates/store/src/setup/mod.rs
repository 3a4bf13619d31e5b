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
//! | `LH_HISTORY` | stream, limits, per-message TTL | `lh.history.>`: one entry per finished job (`store::history`), each living its job's retention; bytes bound, oldest out |
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
    // Only wanted on (the history's); other streams leave it as they are.
    if want.allow_message_ttl {
        check(
            "allow_msg_ttl",
            cur.allow_message_ttl.to_string(),
            "true".into(),
        );
    }
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
                "setup {what}: the server's JetStream storage limit (max_file_store) is smaller than the bounds asked for; lower them ({BOUND_FLAGS}) or raise the server's limit ({text})"
            ))
        } else {
            StoreError::Nats(format!("setup {what}: {text}"))
        }
    };

    // The byte bounds, fitted as a whole before anything is created.
    let bounds = plan_bounds(conn, o, mode).await?;

    // Streams, each with its bounds; the work stream, which accepts
    // submissions, comes last (below), once everything else exists.
    let work = stream::Config {
        name: l.work_stream(),
        description: Some("leasehold work tickets (one per job until it is terminal)".into()),
        subjects: o
            .kinds
            .iter()
            .flat_map(|k| [l.submit_subject(k), l.lanes_filter(k)])
            .collect(),
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream::StorageType::File,
        num_replicas: o.replicas,
        duplicate_window: o.dedupe_window,
        max_messages: o.work_max_msgs,
        max_bytes: bounds.get(Bound::Work),
        discard: stream::DiscardPolicy::New,
        ..Default::default()
    };
    let mut streams = Vec::new();
    for (name, subject, age, dedupe, msgs, bytes, discard, what) in [
        (
            l.events_stream(),
            l.events_wildcard(),
            o.events_max_age,
            Duration::from_secs(120),
            -1,
            bounds.get(Bound::Events),
            stream::DiscardPolicy::New,
            "job events",
        ),
        (
            l.dlq_stream(),
            l.dlq_wildcard(),
            o.dlq_max_age,
            // The server wants the dedupe window no longer than max age.
            if o.dlq_max_age.is_zero() {
                Duration::from_secs(3600)
            } else {
                o.dlq_max_age.min(Duration::from_secs(3600))
            },
            o.dlq_max_msgs,
            bounds.get(Bound::Dlq),
            stream::DiscardPolicy::Old,
            "dead letters",
        ),
        (
            l.advisory_stream(),
            l.max_deliveries_advisories(),
            Duration::from_secs(7 * 86_400),
            Duration::from_secs(120),
            100_000,
            ADVISORY_MAX_BYTES,
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
    streams.push(history_config(l, o));
    for want in streams {
        report.push(apply_stream(js, l, o, &bounds, want, mode, &err).await?);
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
            max_bytes: bounds.get(Bound::Jobs),
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
            max_bytes: bounds.get(Bound::Sessions),
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
            max_bytes: bounds.get(Bound::Active),
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
            max_bytes: bounds.get(Bound::Payloads),
            ..Default::default()
        },
        // Schedules: a few entries, each rewritten at every tick it fires.
        kv::Config {
            bucket: l.schedules_bucket(),
            description: "leasehold recurring schedules (fired by the reapers)".into(),
            history: 1,
            storage: stream::StorageType::File,
            num_replicas: o.replicas,
            limit_markers: Some(Duration::from_secs(60)),
            max_bytes: bounds.get(Bound::Schedules),
            ..Default::default()
        },
        // Flow control: limits (a few entries, set by operators) and the
        // workers' leases and pauses (one write per worker per second at
        // most); small and fixed.
        kv::Config {
            bucket: l.limits_bucket(),
            description: "leasehold provider limits (leasehold limits set)".into(),
            history: 1,
            storage: stream::StorageType::File,
            num_replicas: o.replicas,
            limit_markers: Some(Duration::from_secs(60)),
            max_bytes: FLOW_MAX_BYTES,
            ..Default::default()
        },
        kv::Config {
            bucket: l.flow_bucket(),
            description: "leasehold flow control: quota leases and fleet-wide pauses".into(),
            history: 1,
            storage: stream::StorageType::File,
            num_replicas: o.replicas,
            limit_markers: Some(Duration::from_secs(60)),
            max_bytes: FLOW_MAX_BYTES,
            ..Default::default()
        },
        kv::Config {
            max_bytes: bounds.get(Bound::Effects),
            ..effects_config(l.effects_bucket(), o.effects_retention, o.replicas)
        },
    ];
    for cfg in buckets {
        report.push(apply_bucket(js, l, &bounds, cfg, mode, &err).await?);
    }

    // The artifacts' object store.
    report.push(apply_object_store(js, l, o, &bounds, mode, &err).await?);

    // Last, the work stream: a layout that failed half-way accepts no
    // submission.
    report.push(apply_stream(js, l, o, &bounds, work, mode, &err).await?);

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

    Ok(report)
}

/// Bytes of each flow-control bucket (fixed: a few small entries per
/// provider key).
const FLOW_MAX_BYTES: i64 = 1 << 20;

/// The flags of every byte bound, for errors that send the operator there.
const BOUND_FLAGS: &str = "--work-max-bytes, --events-max-bytes, --dlq-max-bytes, --jobs-max-bytes, --payloads-max-bytes, --active-max-bytes, --sessions-max-bytes, --effects-max-bytes, --artifacts-max-bytes, --schedules-max-bytes, --history-max-bytes";

/// The halvings tried when fitting the default bounds as a whole.
const MAX_HALVINGS: u32 = 12;

/// One byte bound of the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Bound {
    Work,
    Events,
    Dlq,
    Jobs,
    Payloads,
    Active,
    Sessions,
    Effects,
    Artifacts,
    Schedules,
}

impl Bound {
    const ALL: [Bound; 10] = [
        Bound::Work,
        Bound::Events,
        Bound::Dlq,
        Bound::Jobs,
        Bound::Payloads,
        Bound::Active,
        Bound::Sessions,
        Bound::Effects,
        Bound::Artifacts,
        Bound::Schedules,
    ];

    fn name(self) -> &'static str {
        match self {
            Bound::Work => "work",
            Bound::Events => "events",
            Bound::Dlq => "dlq",
            Bound::Jobs => "jobs",
            Bound::Payloads => "payloads",
            Bound::Active => "active",
            Bound::Sessions => "sessions",
            Bound::Effects => "effects",
            Bound::Artifacts => "artifacts",
            Bound::Schedules => "schedules",
        }
    }

    fn asked(self, o: &SetupOptions) -> (i64, bool) {
        let f = &o.fit;
        match self {
            Bound::Work => (o.work_max_bytes, f.work),
            Bound::Events => (o.events_max_bytes, f.events),
            Bound::Dlq => (o.dlq_max_bytes, f.dlq),
            Bound::Jobs => (o.jobs_max_bytes, f.jobs),
            Bound::Payloads => (o.payloads_max_bytes, f.payloads),
            Bound::Active => (o.active_max_bytes, f.active),
            Bound::Sessions => (o.sessions_max_bytes, f.sessions),
            Bound::Effects => (o.effects_max_bytes, f.effects),
            Bound::Artifacts => (o.artifacts_max_bytes, f.artifacts),
            Bound::Schedules => (o.schedules_max_bytes, f.schedules),
        }
    }

    /// The stream that holds this bound.
    fn stream(self, l: &crate::Layout) -> String {
        match self {
            Bound::Work => l.work_stream(),
            Bound::Events => l.events_stream(),
            Bound::Dlq => l.dlq_stream(),
            Bound::Jobs => format!("KV_{}", l.jobs_bucket()),
            Bound::Payloads => format!("KV_{}", l.payloads_bucket()),
            Bound::Active => format!("KV_{}", l.active_bucket()),
            Bound::Sessions => format!("KV_{}", l.sessions_bucket()),
            Bound::Effects => format!("KV_{}", l.effects_bucket()),
            Bound::Artifacts => format!("OBJ_{}", l.artifacts_bucket()),
            Bound::Schedules => format!("KV_{}", l.schedules_bucket()),
        }
    }

    fn of_stream(l: &crate::Layout, name: &str) -> Option<Bound> {
        Bound::ALL.into_iter().find(|b| b.stream(l) == name)
    }
}

/// The byte bounds setup applies: as asked, or (defaults only) fitted.
#[derive(Debug, Clone)]
struct Bounds {
    asked: [(i64, bool); 10],
    fitted: [i64; 10],
}

impl Bounds {
    fn idx(b: Bound) -> usize {
        Bound::ALL
            .iter()
            .position(|x| *x == b)
            .expect("every bound listed")
    }
    fn get(&self, b: Bound) -> i64 {
        self.fitted[Self::idx(b)]
    }
    fn asked(&self, b: Bound) -> i64 {
        self.asked[Self::idx(b)].0
    }
    fn fit(&self, b: Bound) -> bool {
        self.asked[Self::idx(b)].1
    }
}

/// A default bound after `k` halvings (never below [`FIT_FLOOR`], never
/// above what was asked); an explicit one as asked.
fn fitted(asked: i64, fit: bool, k: u32) -> i64 {
    if fit {
        (asked >> k).max(FIT_FLOOR.min(asked))
    } else {
        asked
    }
}

/// Whether a failed create or update was refused for lack of storage (10047).
fn no_room(e: &(dyn std::error::Error + 'static)) -> bool {
    let t = e.to_string();
    crate::server_error_code(e) == Some(10047)
        || t.contains("10047")
        || t.contains("insufficient storage")
}

/// Works out every byte bound before anything is created. On a layout
/// not made yet (no work stream), the bytes it still has to reserve are
/// asked of the server at once, by creating the work stream alone with
/// that bound and deleting it again; when the server cannot hold them, the
/// default bounds are halved together until it can. When even their floor
/// does not fit, nothing is created and the error gives the numbers. An
/// existing layout keeps today's per-object fit.
async fn plan_bounds(conn: &Conn, o: &SetupOptions, mode: Mode) -> Result<Bounds, StoreError> {
    let l = &conn.layout;
    let js = &conn.js;
    let asked = Bound::ALL.map(|b| b.asked(o));
    let mut bounds = Bounds {
        asked,
        fitted: asked.map(|(a, _)| a),
    };
    if mode == Mode::Check {
        return Ok(bounds);
    }
    match js.get_stream(l.work_stream()).await {
        Ok(_) => return Ok(bounds),
        Err(e) if crate::is_not_found(&e) => {}
        Err(e) => {
            return Err(crate::lookup_error(
                format!("stream {}", l.work_stream()),
                &e,
            ))
        }
    }
    // What each bound's stream reserves already (a half layout left by an
    // earlier run that failed).
    let mut held = [0i64; 9];
    for (i, b) in Bound::ALL.into_iter().enumerate() {
        if b == Bound::Work {
            continue;
        }
        let name = b.stream(l);
        let unavailable = |w: &str, e: &dyn std::fmt::Display| {
            StoreError::Unavailable(format!("stream {w}: {e}"))
        };
        if let Some(c) = current_config(js, &name, &format!("stream {name}"), &unavailable).await? {
            held[i] = c.max_bytes.max(0);
        }
    }
    let advisories = match js.get_stream(l.advisory_stream()).await {
        Ok(_) => 0,
        Err(e) if crate::is_not_found(&e) => ADVISORY_MAX_BYTES,
        Err(e) => {
            return Err(crate::lookup_error(
                format!("stream {}", l.advisory_stream()),
                &e,
            ))
        }
    };
    let advisories = advisories + history_reservation(conn, o).await?;
    let mut last_total = 0;
    for k in 0..=MAX_HALVINGS {
        let sizes = asked.map(|(a, fit)| fitted(a, fit, k));
        let total: i64 = advisories
            + sizes
                .iter()
                .zip(held)
                .map(|(want, h)| (want - h).max(0))
                .sum::<i64>();
        if total == 0 || can_reserve(conn, total, o.replicas).await? {
            bounds.fitted = sizes;
            return Ok(bounds);
        }
        last_total = total;
        let at_floor = asked
            .iter()
            .zip(sizes)
            .all(|((a, fit), sz)| !fit || sz == FIT_FLOOR.min(*a));
        if at_floor {
            break;
        }
    }
    let parts: Vec<String> = Bound::ALL
        .into_iter()
        .zip(asked)
        .map(|(b, (a, fit))| {
            let sz = fitted(a, fit, MAX_HALVINGS);
            if fit {
                format!("{} {}", b.name(), human_bytes(sz))
            } else {
                format!("{} {} (as asked)", b.name(), human_bytes(sz))
            }
        })
        .collect();
    Err(StoreError::Config(format!(
        "setup cannot reserve this layout's storage: it needs at least {} more ({}, advisories {}; the defaults at their lowest fit), and the server's JetStream storage limit (max_file_store) holds less. Nothing was created. Lower the bounds ({BOUND_FLAGS}) or raise the server's limit",
        human_bytes(last_total),
        parts.join(", "),
        human_bytes(ADVISORY_MAX_BYTES)
    )))
}

/// The advisory stream's fixed bound.
const ADVISORY_MAX_BYTES: i64 = 64 << 20;

/// The history stream: entries carry their job's retention as a
/// per-message TTL (the reapers' historian sets it), bytes are bounded with
/// the oldest out, and a duplicate window dedupes the historian's retries.
fn history_config(l: &crate::Layout, o: &SetupOptions) -> stream::Config {
    stream::Config {
        name: l.history_stream(),
        description: Some("leasehold history of finished jobs".into()),
        subjects: vec![l.history_wildcard()],
        retention: stream::RetentionPolicy::Limits,
        storage: stream::StorageType::File,
        num_replicas: o.replicas,
        max_bytes: o.history_max_bytes,
        discard: stream::DiscardPolicy::Old,
        duplicate_window: Duration::from_secs(120),
        allow_direct: true,
        allow_message_ttl: true,
        compression: Some(stream::Compression::S2),
        ..Default::default()
    }
}

/// What the history stream adds to a new layout's reservation (nothing
/// when it exists already).
async fn history_reservation(conn: &Conn, o: &SetupOptions) -> Result<i64, StoreError> {
    let name = conn.layout.history_stream();
    match conn.js.get_stream(&name).await {
        Ok(_) => Ok(0),
        Err(e) if crate::is_not_found(&e) => Ok(o.history_max_bytes.max(0)),
        Err(e) => Err(crate::lookup_error(format!("stream {name}"), &e)),
    }
}

/// Whether the server can reserve `bytes` more: the work stream (not made
/// yet) is created alone with that bound and a subject of its own, then
/// deleted.
async fn can_reserve(conn: &Conn, bytes: i64, replicas: usize) -> Result<bool, StoreError> {
    let l = &conn.layout;
    let probe = stream::Config {
        name: l.work_stream(),
        description: Some(
            "leasehold setup: reserving the layout's storage (deleted at once)".into(),
        ),
        subjects: vec![format!("{}.setup-probe", l.prefix)],
        storage: stream::StorageType::File,
        num_replicas: replicas,
        max_bytes: bytes,
        discard: stream::DiscardPolicy::New,
        ..Default::default()
    };
    match conn.js.create_stream(probe).await {
        Ok(_) => {
            conn.js.delete_stream(l.work_stream()).await.map_err(|e| {
                StoreError::Nats(format!("setup: removing the reservation probe: {e}"))
            })?;
            Ok(true)
        }
        Err(e) if no_room(&e) => Ok(false),
        Err(e) => Err(StoreError::Nats(format!("setup: reserving storage: {e}"))),
    }
}

/// The config of stream `name` as the server has it (`None`: not there).
async fn current_config(
    js: &jetstream::Context,
    name: &str,
    object: &str,
    err: &(dyn Fn(&str, &dyn std::fmt::Display) -> StoreError + Sync),
) -> Result<Option<stream::Config>, StoreError> {
    match js.get_stream(name).await {
        Ok(mut s) => Ok(Some(
            s.info().await.map_err(|e| err(name, &e))?.config.clone(),
        )),
        Err(e) if crate::is_not_found(&e) => Ok(None),
        Err(e) => Err(crate::lookup_error(object.to_string(), &e)),
    }
}

/// The byte bound to want: a default bound an earlier setup fitted to this
/// server stays as it is (setup is idempotent; an explicit bound grows it).
fn keep_fitted(cur: Option<&stream::Config>, fit: bool, asked: i64, want: i64) -> i64 {
    match cur {
        Some(c) if fit && is_fitted(c.max_bytes, asked) => c.max_bytes,
        _ => want,
    }
}

/// Creates or updates one stream (or, checking, compares it); a default
/// byte bound the server cannot hold is halved and tried again.
async fn apply_stream(
    js: &jetstream::Context,
    l: &crate::Layout,
    _o: &SetupOptions,
    bounds: &Bounds,
    mut want: stream::Config,
    mode: Mode,
    err: &(dyn Fn(&str, &dyn std::fmt::Display) -> StoreError + Sync),
) -> Result<Change, StoreError> {
    let object = format!("stream {}", want.name);
    let bound = Bound::of_stream(l, &want.name);
    let fit = bound.is_some_and(|b| bounds.fit(b));
    let asked = bound.map_or(want.max_bytes, |b| bounds.asked(b));
    let cur = current_config(js, &want.name, &object, err).await?;
    want.max_bytes = keep_fitted(cur.as_ref(), fit, asked, want.max_bytes);
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
            (ChangeState::Created, Mode::Apply) => js.create_stream(want.clone()).await.map(drop),
            _ => Ok(()),
        };
        match applied {
            Ok(()) => break state,
            // Too big for the server's storage limit: a default bound
            // is halved and tried again.
            Err(e) if fit && want.max_bytes / 2 >= FIT_FLOOR && no_room(&e) => {
                want.max_bytes /= 2;
            }
            Err(e) => return Err(err(&want.name, &e)),
        }
    };
    Ok(Change {
        object,
        state,
        note: fitted_note(want.max_bytes, asked),
    })
}

/// The note of a default bound lowered to fit the server.
fn fitted_note(got: i64, asked: i64) -> Option<String> {
    (got != asked).then(|| {
        format!(
            "max_bytes {} instead of the default {}: the server's JetStream storage limit (max_file_store) holds no more; raise it, or pass the bound explicitly",
            human_bytes(got),
            human_bytes(asked)
        )
    })
}

/// Creates or updates one KV bucket (or, checking, compares its stream).
async fn apply_bucket(
    js: &jetstream::Context,
    l: &crate::Layout,
    bounds: &Bounds,
    mut cfg: kv::Config,
    mode: Mode,
    err: &(dyn Fn(&str, &dyn std::fmt::Display) -> StoreError + Sync),
) -> Result<Change, StoreError> {
    let object = format!("kv {}", cfg.bucket);
    let stream_name = format!("KV_{}", cfg.bucket);
    let bound = Bound::of_stream(l, &stream_name);
    let fit = bound.is_some_and(|b| bounds.fit(b));
    let asked = bound.map_or(cfg.max_bytes, |b| bounds.asked(b));
    let cur = current_config(js, &stream_name, &object, err).await?;
    cfg.max_bytes = keep_fitted(cur.as_ref(), fit, asked, cfg.max_bytes);
    let state = loop {
        let state = match &cur {
            Some(c) => {
                let mut d = stream_drift(c, &kv_stream_want(&cfg));
                // The bucket's own subjects and dedupe window are the client's business.
                d.retain(|(f, _, _)| {
                    f != "subjects" && f != "dedupe_window" && f != "discard" && f != "max_msg_size"
                });
                if d.is_empty() {
                    ChangeState::Unchanged
                } else {
                    ChangeState::Updated(d)
                }
            }
            None => ChangeState::Created,
        };
        let applied = match (&state, mode) {
            (ChangeState::Unchanged, _) | (_, Mode::Check) => Ok(()),
            _ => js.create_or_update_key_value(cfg.clone()).await.map(drop),
        };
        match applied {
            Ok(()) => break state,
            Err(e) if fit && cfg.max_bytes / 2 >= FIT_FLOOR && no_room(&e) => {
                cfg.max_bytes /= 2;
            }
            Err(e) => return Err(err(&cfg.bucket, &e)),
        }
    };
    Ok(Change {
        object,
        state,
        note: fitted_note(cfg.max_bytes, asked),
    })
}

/// Creates the artifacts' object store, or brings its bound to the wanted one.
async fn apply_object_store(
    js: &jetstream::Context,
    l: &crate::Layout,
    o: &SetupOptions,
    bounds: &Bounds,
    mode: Mode,
    err: &(dyn Fn(&str, &dyn std::fmt::Display) -> StoreError + Sync),
) -> Result<Change, StoreError> {
    let bucket = l.artifacts_bucket();
    let object = format!("object store {bucket}");
    let stream_name = format!("OBJ_{bucket}");
    let fit = bounds.fit(Bound::Artifacts);
    let asked = bounds.asked(Bound::Artifacts);
    let mut want = bounds.get(Bound::Artifacts);
    let cur = current_config(js, &stream_name, &object, err).await?;
    want = keep_fitted(cur.as_ref(), fit, asked, want);
    let state = loop {
        let state = match &cur {
            Some(c) if c.max_bytes == want => ChangeState::Unchanged,
            Some(c) => {
                ChangeState::Updated(vec![("max_bytes".into(), num(c.max_bytes), num(want))])
            }
            None => ChangeState::Created,
        };
        let applied: Result<(), Box<dyn std::error::Error + Send + Sync>> = match (&state, mode) {
            (ChangeState::Updated(_), Mode::Apply) => {
                let mut c = cur.clone().expect("updated means it exists");
                c.max_bytes = want;
                js.update_stream(c).await.map(drop).map_err(Into::into)
            }
            (ChangeState::Created, Mode::Apply) => js
                .create_object_store(object_store::Config {
                    bucket: bucket.clone(),
                    description: Some("leasehold artifacts (reports)".into()),
                    storage: stream::StorageType::File,
                    num_replicas: o.replicas,
                    max_bytes: want,
                    ..Default::default()
                })
                .await
                .map(drop)
                .map_err(Into::into),
            _ => Ok(()),
        };
        match applied {
            Ok(()) => break state,
            Err(e) if fit && want / 2 >= FIT_FLOOR && no_room(&*e) => want /= 2,
            Err(e) => return Err(err("artifacts", &e)),
        }
    };
    Ok(Change {
        object,
        state,
        note: fitted_note(want, asked),
    })
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
    let err = |name: &str, e: &dyn std::fmt::Display| {
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
