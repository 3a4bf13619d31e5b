//! `leasehold setup`: create the streams, buckets and consumers, or bring
//! an existing layout to the wanted limits (it says what it changed);
//! `--check` only reports how the server's layout differs. A kind set up is
//! never removed silently: without `--kinds` the kinds set up are kept, and
//! leaving one out needs `--prune`, refused while it has queued tickets.

use std::time::Duration;

use leasehold_core::time::parse_duration;
use leasehold_store::setup::{self, Fit, Mode, SetupOptions};
use leasehold_store::NatsArgs;

/// Sizes like `4GiB`, `512MiB`, `1000000` (bytes).
fn parse_bytes(s: &str) -> Result<i64, String> {
    let t = s.trim();
    let (num, mult) = [
        ("GiB", 1i64 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
        ("GB", 1_000_000_000),
        ("MB", 1_000_000),
        ("KB", 1_000),
        ("B", 1),
    ]
    .iter()
    .find_map(|(suf, m)| t.strip_suffix(suf).map(|n| (n.trim(), *m)))
    .unwrap_or((t, 1));
    num.parse::<i64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .filter(|n| *n > 0)
        .ok_or_else(|| format!("{s:?}: write a size like 4GiB, 512MiB or 1000000"))
}

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Only compare the server's layout with the wanted one and list the
    /// differences; change nothing (exit 1 when anything differs).
    #[arg(long)]
    check: bool,
    /// One JSON object per object (and per kind pruned) instead of lines.
    #[arg(long)]
    json: bool,
    /// Replicas of every stream and bucket (3 on a 3-node cluster)
    /// [default: 1 on a new layout; as set up otherwise].
    #[arg(long, env = "LH_REPLICAS")]
    replicas: Option<usize>,
    /// Kinds that get a submit subject and a consumer, comma-separated.
    /// Without it: the kinds set up now (research on a fresh server). A
    /// list that leaves out a kind set up now is refused unless --prune.
    /// The test kinds (echo, sleep, fail, crash, deliver) are for dev setups:
    /// list them here and start workers with --dev-kinds.
    #[arg(long, env = "LH_KINDS", value_delimiter = ',')]
    kinds: Option<Vec<String>>,
    /// Remove the kinds set up now that --kinds leaves out (their subject
    /// and consumer); refused while such a kind has tickets in the queue.
    #[arg(long, requires = "kinds")]
    prune: bool,
    /// Ack wait of the work consumers: how long a ticket delivered to a
    /// worker that stopped before claiming it waits before redelivery (a
    /// claimed job's recovery never depends on it). The default matches the
    /// default session timeout, so such a job comes back no later than a
    /// claimed one [default: 10s on a new layout; as set up otherwise].
    #[arg(long, env = "LH_ACK_WAIT", value_parser = parse_duration)]
    ack_wait: Option<Duration>,
    /// Deliveries of one ticket before the server gives up on it (the reaper
    /// then dead-letters a waiting job; a running one is never killed for it)
    /// [default: 20 on a new layout; as set up otherwise].
    #[arg(long, env = "LH_MAX_DELIVER")]
    max_deliver: Option<i64>,
    /// Dedupe window of submissions by Nats-Msg-Id [default: 1h on a new
    /// layout; as set up otherwise].
    #[arg(long, env = "LH_DEDUPE_WINDOW", value_parser = parse_duration)]
    dedupe_window: Option<Duration>,
    /// Tickets the work queue holds at most; beyond, submissions are refused
    /// with "maximum messages exceeded" (nothing is dropped) [default:
    /// 1000000 on a new layout; as set up otherwise].
    #[arg(long, env = "LH_WORK_MAX_MSGS")]
    work_max_msgs: Option<i64>,
    /// Bytes the work queue holds at most (refused beyond). Default 2GiB,
    /// halved until it fits a server whose JetStream storage limit
    /// (max_file_store) is smaller (setup says so); a value given here is
    /// never lowered.
    #[arg(long, env = "LH_WORK_MAX_BYTES", value_parser = parse_bytes)]
    work_max_bytes: Option<i64>,
    /// Pull requests waiting on one work consumer (one per idle kind per
    /// worker process: size it above the fleet) [default: 4096 on a new
    /// layout; as set up otherwise].
    #[arg(long, env = "LH_MAX_WAITING")]
    max_waiting: Option<i64>,
    /// The effects bucket's max age. Ledger entries of jobs never expire by it
    /// (written with Nats-TTL: never); they are removed with their job
    /// [default: 7d on a new layout; as set up otherwise].
    #[arg(long, env = "LH_EFFECTS_RETENTION", value_parser = parse_duration)]
    effects_retention: Option<Duration>,
    /// The longest any event is kept (0: until its job's retention ends,
    /// when the reaper removes it with the record) [default: 0s on a new
    /// layout; as set up otherwise].
    #[arg(long, env = "LH_EVENTS_MAX_AGE", value_parser = parse_duration)]
    events_max_age: Option<Duration>,
    /// Bytes the event stream holds at most: a safety net; beyond, new
    /// events are refused (jobs wait) rather than running jobs' checkpoints
    /// dropped. Default 10GiB, fitted to the server like --work-max-bytes.
    #[arg(long, env = "LH_EVENTS_MAX_BYTES", value_parser = parse_bytes)]
    events_max_bytes: Option<i64>,
    /// Revisions kept per job record [default: 8 on a new layout; as set
    /// up otherwise].
    #[arg(long, env = "LH_JOB_HISTORY")]
    job_history: Option<i64>,
    /// Dead letters are kept at most this long... [default: 30d on a new
    /// layout; as set up otherwise]
    #[arg(long, env = "LH_DLQ_MAX_AGE", value_parser = parse_duration)]
    dlq_max_age: Option<Duration>,
    /// ...at most this many... [default: 100000 on a new layout; as set up
    /// otherwise]
    #[arg(long, env = "LH_DLQ_MAX_MSGS")]
    dlq_max_msgs: Option<i64>,
    /// ...and at most this many bytes (the oldest go first). Default 1GiB,
    /// fitted to the server like --work-max-bytes.
    #[arg(long, env = "LH_DLQ_MAX_BYTES", value_parser = parse_bytes)]
    dlq_max_bytes: Option<i64>,
    /// Bytes of job records at most (default 2GiB; a full bucket refuses
    /// new jobs' records, their tickets wait). Every bucket's default is
    /// fitted to the server like --work-max-bytes.
    #[arg(long, env = "LH_JOBS_MAX_BYTES", value_parser = parse_bytes)]
    jobs_max_bytes: Option<i64>,
    /// Bytes of large inputs and outputs kept beside their records (default 2GiB).
    #[arg(long, env = "LH_PAYLOADS_MAX_BYTES", value_parser = parse_bytes)]
    payloads_max_bytes: Option<i64>,
    /// Bytes of the index of active jobs (default 256MiB).
    #[arg(long, env = "LH_ACTIVE_MAX_BYTES", value_parser = parse_bytes)]
    active_max_bytes: Option<i64>,
    /// Bytes of worker sessions (default 64MiB).
    #[arg(long, env = "LH_SESSIONS_MAX_BYTES", value_parser = parse_bytes)]
    sessions_max_bytes: Option<i64>,
    /// Bytes of the effects ledger (default 1GiB; a full ledger holds write
    /// effects back, it never forgets one).
    #[arg(long, env = "LH_EFFECTS_MAX_BYTES", value_parser = parse_bytes)]
    effects_max_bytes: Option<i64>,
    /// Bytes of artifacts (reports; default 4GiB).
    #[arg(long, env = "LH_ARTIFACTS_MAX_BYTES", value_parser = parse_bytes)]
    artifacts_max_bytes: Option<i64>,
    /// Bytes of recurring schedules (default 64MiB).
    #[arg(long, env = "LH_SCHEDULES_MAX_BYTES", value_parser = parse_bytes)]
    schedules_max_bytes: Option<i64>,
    /// Bytes of the signals sent to jobs and not yet taken with their job
    /// (default 16MiB, some 80,000 small signals; a full stream refuses a
    /// send, its sender told).
    #[arg(long, env = "LH_SIGNALS_MAX_BYTES", value_parser = parse_bytes)]
    signals_max_bytes: Option<i64>,
    /// Bytes of the history of finished jobs (`leasehold list --finished`;
    /// default 256MiB, about a million entries; the oldest go first).
    #[arg(long, env = "LH_HISTORY_MAX_BYTES", value_parser = parse_bytes)]
    history_max_bytes: Option<i64>,
}

/// The kind a fresh server gets when `--kinds` is not given.
const FIRST_KINDS: &[&str] = &["research"];

/// The kinds to set up, and those to remove: `asked` (or, without it, the
/// kinds set up now), checked against the kinds set up now. Leaving out a
/// kind set up now needs `prune`.
fn plan_kinds(
    asked: Option<Vec<String>>,
    now: Option<Vec<String>>,
    prune: bool,
) -> anyhow::Result<(Vec<String>, Vec<String>)> {
    let now = now.unwrap_or_default();
    let Some(asked) = asked else {
        let keep = if now.is_empty() {
            FIRST_KINDS.iter().map(|k| k.to_string()).collect()
        } else {
            now
        };
        return Ok((keep, Vec::new()));
    };
    anyhow::ensure!(!asked.is_empty(), "--kinds must name at least one kind");
    let dropped: Vec<String> = now.into_iter().filter(|k| !asked.contains(k)).collect();
    anyhow::ensure!(
        dropped.is_empty() || prune,
        "--kinds leaves out {} set up now; list {} to keep {}, or pass --prune to remove {} (refused while tickets of {} are queued)",
        dropped.join(", "),
        if dropped.len() == 1 { "it" } else { "them" },
        if dropped.len() == 1 { "it" } else { "them" },
        if dropped.len() == 1 { "it" } else { "them" },
        if dropped.len() == 1 { "it" } else { "them" },
    );
    Ok((asked, dropped))
}

pub async fn run(a: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    anyhow::ensure!(
        a.max_deliver.is_none_or(|m| m >= 2),
        "--max-deliver must be at least 2"
    );
    anyhow::ensure!(
        a.job_history.is_none_or(|h| (1..=64).contains(&h)),
        "--job-history must be 1 to 64"
    );
    anyhow::ensure!(
        a.work_max_msgs.is_none_or(|m| m > 0),
        "--work-max-msgs must be positive"
    );
    anyhow::ensure!(
        a.replicas.is_none_or(|r| (1..=5).contains(&r)),
        "--replicas must be 1 to 5"
    );
    let conn = nats.connect("leasehold-cli setup").await?;
    setup::ping(&conn.js).await?;
    // What is not asked for stays as set up (defaults are for new objects).
    let now = setup::settings_set_up(&conn).await?;
    let (kinds, pruned) = plan_kinds(a.kinds, setup::kinds_set_up(&conn).await?, a.prune)?;
    for k in &pruned {
        let n = setup::tickets_of_kind(&conn, k).await?;
        anyhow::ensure!(
            n == 0,
            "kind {k} has {n} ticket(s) queued: nothing changed; let its workers drain them (or cancel those jobs), then prune it"
        );
    }
    let d = SetupOptions::default();
    let o = SetupOptions {
        replicas: a.replicas.or(now.replicas).unwrap_or(d.replicas),
        kinds,
        ack_wait: a.ack_wait.or(now.ack_wait).unwrap_or(d.ack_wait),
        max_deliver: a.max_deliver.or(now.max_deliver).unwrap_or(d.max_deliver),
        dedupe_window: a
            .dedupe_window
            .or(now.dedupe_window)
            .unwrap_or(d.dedupe_window),
        work_max_msgs: a
            .work_max_msgs
            .or(now.work_max_msgs)
            .unwrap_or(d.work_max_msgs),
        work_max_bytes: a.work_max_bytes.unwrap_or(d.work_max_bytes),
        max_waiting: a.max_waiting.or(now.max_waiting).unwrap_or(d.max_waiting),
        events_max_age: a
            .events_max_age
            .or(now.events_max_age)
            .unwrap_or(d.events_max_age),
        events_max_bytes: a.events_max_bytes.unwrap_or(d.events_max_bytes),
        effects_retention: a
            .effects_retention
            .or(now.effects_retention)
            .unwrap_or(d.effects_retention),
        job_history: a.job_history.or(now.job_history).unwrap_or(d.job_history),
        dlq_max_age: a.dlq_max_age.or(now.dlq_max_age).unwrap_or(d.dlq_max_age),
        dlq_max_msgs: a
            .dlq_max_msgs
            .or(now.dlq_max_msgs)
            .unwrap_or(d.dlq_max_msgs),
        dlq_max_bytes: a.dlq_max_bytes.unwrap_or(d.dlq_max_bytes),
        jobs_max_bytes: a.jobs_max_bytes.unwrap_or(d.jobs_max_bytes),
        payloads_max_bytes: a.payloads_max_bytes.unwrap_or(d.payloads_max_bytes),
        active_max_bytes: a.active_max_bytes.unwrap_or(d.active_max_bytes),
        sessions_max_bytes: a.sessions_max_bytes.unwrap_or(d.sessions_max_bytes),
        effects_max_bytes: a.effects_max_bytes.unwrap_or(d.effects_max_bytes),
        artifacts_max_bytes: a.artifacts_max_bytes.unwrap_or(d.artifacts_max_bytes),
        schedules_max_bytes: a.schedules_max_bytes.unwrap_or(d.schedules_max_bytes),
        signals_max_bytes: a.signals_max_bytes.unwrap_or(d.signals_max_bytes),
        history_max_bytes: a.history_max_bytes.unwrap_or(d.history_max_bytes),
        fit: Fit {
            work: a.work_max_bytes.is_none(),
            events: a.events_max_bytes.is_none(),
            dlq: a.dlq_max_bytes.is_none(),
            jobs: a.jobs_max_bytes.is_none(),
            payloads: a.payloads_max_bytes.is_none(),
            active: a.active_max_bytes.is_none(),
            sessions: a.sessions_max_bytes.is_none(),
            effects: a.effects_max_bytes.is_none(),
            artifacts: a.artifacts_max_bytes.is_none(),
            schedules: a.schedules_max_bytes.is_none(),
            signals: a.signals_max_bytes.is_none(),
        },
        ..d
    };
    let mode = if a.check { Mode::Check } else { Mode::Apply };
    let changes = setup::ensure_with(&conn, &o, mode).await?;
    for c in &changes {
        if a.json {
            println!("{}", c.json(mode));
        } else {
            println!("{}", c.line(mode));
        }
    }
    for k in &pruned {
        let state = match mode {
            Mode::Apply => {
                setup::remove_kind_consumer(&conn, k).await?;
                "removed"
            }
            Mode::Check => "prune",
        };
        if a.json {
            println!(
                "{}",
                serde_json::json!({"object": format!("kind {k}"), "state": state, "fields": [], "note": null})
            );
        } else if mode == Mode::Apply {
            println!("removed  kind {k} (its subject and consumer)");
        } else {
            println!("prune    kind {k}");
        }
    }
    let changed = changes.iter().filter(|c| c.changed()).count();
    match mode {
        Mode::Apply if changed == 0 => eprintln!("the layout was already as wanted"),
        Mode::Apply => eprintln!("{changed} object(s) created or updated"),
        Mode::Check if changed == 0 => eprintln!("no drift: the layout is as wanted"),
        Mode::Check => {
            eprintln!(
                "{changed} object(s) differ; `leasehold setup` with the same options applies them"
            );
            return Ok(1);
        }
    }
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::{parse_bytes, plan_kinds};

    fn v(k: &[&str]) -> Vec<String> {
        k.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn kinds_set_up_are_kept_unless_pruned() {
        // Without --kinds: what is set up, or research on a fresh server.
        assert_eq!(
            plan_kinds(None, Some(v(&["echo", "sleep"])), false).unwrap(),
            (v(&["echo", "sleep"]), v(&[]))
        );
        assert_eq!(
            plan_kinds(None, None, false).unwrap(),
            (v(&["research"]), v(&[]))
        );
        // Adding is always fine; leaving one out needs --prune.
        assert_eq!(
            plan_kinds(Some(v(&["echo", "sleep"])), Some(v(&["echo"])), false)
                .unwrap()
                .1,
            v(&[])
        );
        let e = plan_kinds(
            Some(v(&["research"])),
            Some(v(&["echo", "research"])),
            false,
        )
        .unwrap_err();
        assert!(
            e.to_string().contains("leaves out echo") && e.to_string().contains("--prune"),
            "{e}"
        );
        assert_eq!(
            plan_kinds(Some(v(&["research"])), Some(v(&["echo", "research"])), true).unwrap(),
            (v(&["research"]), v(&["echo"]))
        );
        assert!(plan_kinds(Some(v(&[])), None, false).is_err());
    }

    #[test]
    fn sizes_read_with_their_units() {
        assert_eq!(parse_bytes("4GiB"), Ok(4 << 30));
        assert_eq!(parse_bytes("512 MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1000"), Ok(1000));
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("0").is_err());
    }
}
