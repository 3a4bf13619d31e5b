//! The plan: every stream, bucket and consumer setup wants, and their byte
//! bounds, fitted as a whole to the server's storage before anything is
//! created.

use super::*;

/// The work stream, with its bounds: one subject per kind and its lanes.
pub(super) fn work_plan(l: &crate::Layout, o: &SetupOptions, bounds: &Bounds) -> stream::Config {
    stream::Config {
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
    }
}

/// The streams but the work stream, each with its bounds: the events,
/// the dead letters, the max-deliveries advisories and the history.
pub(super) fn stream_plans(
    l: &crate::Layout,
    o: &SetupOptions,
    bounds: &Bounds,
) -> Vec<stream::Config> {
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
        (
            l.signals_stream(),
            l.signals_wildcard(),
            // Kept until their job takes them and goes (retention purges a
            // job's signals with it); a full stream refuses a new signal
            // (its sender is told), never drops one.
            Duration::ZERO,
            Duration::from_secs(3600),
            -1,
            bounds.get(Bound::Signals),
            stream::DiscardPolicy::New,
            "signals to jobs",
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
    streams
}

/// The KV buckets, each with its bounds.
pub(super) fn bucket_plans(
    l: &crate::Layout,
    o: &SetupOptions,
    bounds: &Bounds,
) -> Vec<kv::Config> {
    vec![
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
    ]
}

/// The durable consumers, (stream, config): one per kind on the work
/// stream, and the shared watcher of ended sessions.
pub(super) fn consumer_plans(
    l: &crate::Layout,
    o: &SetupOptions,
) -> Vec<(String, consumer::pull::Config)> {
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
    consumers.push((
        l.signals_stream(),
        consumer::pull::Config {
            durable_name: Some(l.signal_wake_consumer()),
            description: Some(
                "leasehold: signals sent, each looked at once by a worker or reaper, which wakes its job if it waits for it".into(),
            ),
            filter_subject: l.signals_wildcard(),
            ack_policy: consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(5),
            // The signal's data is the job's to read, not the waker's.
            headers_only: true,
            deliver_policy: consumer::DeliverPolicy::New,
            max_ack_pending: 10_000,
            max_waiting: o.max_waiting,
            ..Default::default()
        },
    ));
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
    consumers
}

/// Bytes of each flow-control bucket (fixed: a few small entries per
/// provider key).
pub(super) const FLOW_MAX_BYTES: i64 = 1 << 20;

/// The flags of every byte bound, for errors that send the operator there.
pub(super) const BOUND_FLAGS: &str = "--work-max-bytes, --events-max-bytes, --dlq-max-bytes, --jobs-max-bytes, --payloads-max-bytes, --active-max-bytes, --sessions-max-bytes, --effects-max-bytes, --artifacts-max-bytes, --schedules-max-bytes, --signals-max-bytes, --history-max-bytes";

/// The halvings tried when fitting the default bounds as a whole.
pub(super) const MAX_HALVINGS: u32 = 12;

/// One byte bound of the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Bound {
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
    Signals,
}

impl Bound {
    const ALL: [Bound; 11] = [
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
        Bound::Signals,
    ];

    pub(super) fn name(self) -> &'static str {
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
            Bound::Signals => "signals",
        }
    }

    pub(super) fn asked(self, o: &SetupOptions) -> (i64, bool) {
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
            Bound::Signals => (o.signals_max_bytes, f.signals),
        }
    }

    /// The stream that holds this bound.
    pub(super) fn stream(self, l: &crate::Layout) -> String {
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
            Bound::Signals => l.signals_stream(),
        }
    }

    pub(super) fn of_stream(l: &crate::Layout, name: &str) -> Option<Bound> {
        Bound::ALL.into_iter().find(|b| b.stream(l) == name)
    }
}

/// The byte bounds setup applies: as asked, or (defaults only) fitted.
#[derive(Debug, Clone)]
pub(super) struct Bounds {
    asked: [(i64, bool); Bound::ALL.len()],
    fitted: [i64; Bound::ALL.len()],
}

impl Bounds {
    pub(super) fn idx(b: Bound) -> usize {
        Bound::ALL
            .iter()
            .position(|x| *x == b)
            .expect("every bound listed")
    }
    pub(super) fn get(&self, b: Bound) -> i64 {
        self.fitted[Self::idx(b)]
    }
    pub(super) fn asked(&self, b: Bound) -> i64 {
        self.asked[Self::idx(b)].0
    }
    pub(super) fn fit(&self, b: Bound) -> bool {
        self.asked[Self::idx(b)].1
    }
}

/// A default bound after `k` halvings (never below [`FIT_FLOOR`], never
/// above what was asked); an explicit one as asked.
pub(super) fn fitted(asked: i64, fit: bool, k: u32) -> i64 {
    if fit {
        (asked >> k).max(FIT_FLOOR.min(asked))
    } else {
        asked
    }
}

/// The JetStream code of a create or update refused for lack of storage.
pub(super) const NO_ROOM: u64 = 10047;

/// Whether a failed create or update was refused for lack of storage.
pub(super) fn no_room(e: &(dyn std::error::Error + 'static)) -> bool {
    crate::server_error_code(e) == Some(NO_ROOM)
}

/// Works out every byte bound before anything is created. On a layout
/// not made yet (no work stream), the bytes it still has to reserve are
/// asked of the server at once, by creating the work stream alone with
/// that bound and deleting it again; when the server cannot hold them, the
/// default bounds are halved together until it can. When even their floor
/// does not fit, nothing is created and the error gives the numbers. An
/// existing layout keeps today's per-object fit.
pub(super) async fn plan_bounds(
    conn: &Conn,
    o: &SetupOptions,
    mode: Mode,
) -> Result<Bounds, StoreError> {
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
    let mut held = [0i64; Bound::ALL.len()];
    for (i, b) in Bound::ALL.into_iter().enumerate() {
        if b == Bound::Work {
            continue;
        }
        let name = b.stream(l);
        let unavailable = |w: &str, e: &(dyn std::error::Error + 'static)| {
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
pub(super) const ADVISORY_MAX_BYTES: i64 = 64 << 20;

/// The history stream: entries carry their job's retention as a
/// per-message TTL (the reapers' historian sets it), bytes are bounded with
/// the oldest out, and a duplicate window dedupes the historian's retries.
pub(super) fn history_config(l: &crate::Layout, o: &SetupOptions) -> stream::Config {
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
pub(super) async fn history_reservation(conn: &Conn, o: &SetupOptions) -> Result<i64, StoreError> {
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
pub(super) async fn can_reserve(
    conn: &Conn,
    bytes: i64,
    replicas: usize,
) -> Result<bool, StoreError> {
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
            conn.js
                .delete_stream(l.work_stream())
                .await
                .map_err(|e| setup_error("(removing the reservation probe)", &e))?;
            Ok(true)
        }
        Err(e) if no_room(&e) => Ok(false),
        Err(e) => Err(setup_error("(reserving storage)", &e)),
    }
}
