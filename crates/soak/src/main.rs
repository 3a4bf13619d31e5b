//! `leasehold-soak`: a seeded, reproducible chaos run (`make soak`).
//!
//! It starts a nats-server (or a 3-node JetStream cluster at R3),
//! `leasehold-sim` with model faults, worker processes (some behind fault
//! proxies, so they can be partitioned) and two reapers, all as real
//! processes. From outside, as any user would, it submits a mix of jobs
//! (JSON on `lh.submit.<kind>` with `Nats-Msg-Id`) and cancels some, while a
//! fault scheduler drawn from the seed kills, pauses, stops and partitions
//! workers, kills reapers and servers (or cluster nodes, leaders and
//! followers) and forces leader step-downs, and the effects sink misbehaves
//! now and then. At the end it stops injecting, restores everything, waits
//! for the jobs to settle and checks the invariants from the records, their
//! revisions, the events and the sink: nothing lost, no side effect twice,
//! no stale write accepted, nothing stuck. See `--help`, and the modules:
//! [`plan`] (the mix and the schedule), [`chaos`] (injection), [`check`]
//! (how each invariant is computed).
//!
//! Writes `<out>/soak-<seed>.json`, prints a table, keeps every process's
//! log in `<out>/soak-<seed>-logs/`, and exits 1 when an invariant failed
//! (2 when the run itself could not be carried out).

mod chaos;
mod check;
mod collect;
mod fleet;
mod plan;
mod rng;
mod submit;
mod track;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use anyhow::Context as _;
use clap::Parser;
use leasehold_core::time::parse_duration;
use leasehold_store::setup::{self, SetupOptions};
use leasehold_store::{Jobs, NatsArgs};
use serde_json::{json, Value};

use crate::fleet::{Fleet, Settings};

#[derive(Parser, Debug, Clone)]
#[command(
    name = "leasehold-soak",
    version,
    about = "Seeded chaos soak of leasehold: real processes and nats-servers, a realistic job mix, faults injected on a schedule drawn from the seed, invariants (lost, duplicate effects, stale writes, stuck) checked from outside",
    long_about = "Seeded chaos soak of leasehold.\n\n\
        Starts a nats-server (or, with --cluster, a 3-node JetStream cluster with every stream at R3), \
        leasehold-sim (model faults at --model-fault-rate: truncated streams, error events, 429 with \
        Retry-After, 5xx, malformed tool arguments; effects-sink faults: timeout before commit, commit \
        then 5xx, commit then timeout), --workers worker processes (--proxied of them behind fault \
        proxies) and two reapers, all from target/debug (run `cargo build --workspace --bins` first).\n\n\
        It submits echo, sleep, fail, deliver and research jobs as a NATS client would, cancels some \
        (request/reply and `leasehold cancel`), and injects one fault at a time: kill -9 of a worker \
        (restarted under its identity or a new one), SIGSTOP past the session timeout, SIGTERM and \
        restart, a partition of a proxied worker (freeze, or cut and refuse reconnects), kill -9 of a \
        reaper, and kill -9 of the server (single node) or of a stream leader or follower node and \
        leader step-downs (cluster).\n\n\
        The seed is printed at start; --seed N replays the same plan (the jobs, their times, the faults \
        and their order). Then it stops injecting, restores everything, waits for every job to settle \
        and checks: lost (no record, or not terminal/parked-with-reason), duplicate effects at the sink, \
        stale writes (record revisions and events older than an accepted epoch), stuck (no live owner, \
        no ticket), wrong outcomes; it measures recovery after each fault (p50/p95) and counts the \
        spurious 10164 rejections the store retried.\n\n\
        Output: <out>/soak-<seed>.json, a table on stdout, process logs in <out>/soak-<seed>-logs/. \
        Exit 0: every invariant held; 1: an invariant failed (the offending jobs are printed); 2: the \
        run could not be carried out."
)]
struct Args {
    /// Seed of the plan; printed at start. Default: drawn from the clock.
    #[arg(long, env = "SOAK_SEED")]
    seed: Option<u64>,
    /// Length of the injection phase in minutes (quiescence and checks come after).
    #[arg(long, env = "SOAK_MINUTES", conflicts_with = "seconds")]
    minutes: Option<f64>,
    /// Length of the injection phase in seconds.
    #[arg(long, env = "SOAK_SECONDS")]
    seconds: Option<u64>,
    /// Run on a 3-node JetStream cluster (every stream and bucket at R3)
    /// instead of a single server.
    #[arg(long)]
    cluster: bool,
    /// Where soak-<seed>.json and the log folder go.
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
    /// Worker processes.
    #[arg(long, default_value_t = 4)]
    workers: usize,
    /// How many of the workers sit behind fault proxies (partitionable).
    #[arg(long, default_value_t = 2)]
    proxied: usize,
    /// Jobs each worker runs at once.
    #[arg(long, default_value_t = 8)]
    concurrency: usize,
    /// Submissions per second (exponential gaps).
    #[arg(long, default_value_t = 1.5)]
    rate: f64,
    /// The workers' session timeout (short, so a pause resolves within the run).
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    session_timeout: Duration,
    /// Shortest quiet gap between two faults.
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    gap_min: Duration,
    /// Longest quiet gap between two faults.
    #[arg(long, default_value = "12s", value_parser = parse_duration)]
    gap_max: Duration,
    /// How long to wait for every job to settle after the last fault.
    #[arg(long, default_value = "300s", value_parser = parse_duration)]
    quiesce_timeout: Duration,
    /// Share of model requests the simulator answers with a fault.
    #[arg(long, default_value_t = 0.1)]
    model_fault_rate: f64,
    /// Workers' and reapers' --max-stale-reclaims: a job interrupted this
    /// often is dead-lettered as poison (a valid, counted outcome).
    #[arg(long, default_value_t = 6)]
    max_stale_reclaims: u32,
    /// Inject only these fault kinds (comma-separated): kill9_worker_same_id,
    /// kill9_worker_new_id, sigstop_worker, sigterm_worker, kill9_reaper,
    /// partition_freeze, partition_cut (with --proxied > 0), kill9_server
    /// (single node), kill9_node_leader, kill9_node_follower,
    /// leader_stepdown (--cluster). Default: all of the topology's.
    #[arg(long, value_delimiter = ',')]
    faults: Vec<String>,
    /// Print the plan for the seed as JSON and exit.
    #[arg(long)]
    print_plan: bool,
}

impl Args {
    fn run_length(&self) -> Duration {
        match (self.minutes, self.seconds) {
            (Some(m), _) => Duration::from_secs_f64(m * 60.0),
            (None, Some(s)) => Duration::from_secs(s),
            (None, None) => Duration::from_secs(180),
        }
    }
}

fn say(s: impl AsRef<str>) {
    eprintln!("soak: {}", s.as_ref());
}

#[tokio::main]
async fn main() {
    let a = Args::parse();
    match run(a).await {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("soak error: {e:#}");
            std::process::exit(2);
        }
    }
}

fn shape(a: &Args) -> plan::Shape {
    let streams = if a.cluster {
        vec![
            "LH_WORK".to_string(),
            "LH_EVENTS".into(),
            "KV_lh_jobs".into(),
            "KV_lh_sessions".into(),
            "KV_lh_active".into(),
        ]
    } else {
        Vec::new()
    };
    plan::Shape {
        cluster: a.cluster,
        workers: a.workers,
        proxied: (a.workers.saturating_sub(a.proxied)..a.workers).collect(),
        reapers: 2,
        session_ms: a.session_timeout.as_millis() as u64,
        streams: if streams.is_empty() {
            vec!["LH_WORK".into()]
        } else {
            streams
        },
        gap_ms: (
            a.gap_min.as_millis() as u64,
            a.gap_max.as_millis().max(a.gap_min.as_millis()) as u64,
        ),
        only: (!a.faults.is_empty()).then(|| a.faults.clone()),
    }
}

async fn run(a: Args) -> anyhow::Result<bool> {
    anyhow::ensure!(a.workers >= 2, "--workers must be at least 2");
    anyhow::ensure!(
        a.proxied <= a.workers,
        "--proxied must not exceed --workers"
    );
    let kinds = plan::fault_kinds(a.cluster, a.proxied > 0);
    for f in &a.faults {
        anyhow::ensure!(
            kinds.contains(&f.as_str()),
            "--faults: {f:?} is not a fault of this topology; choose from {}",
            kinds.join(", ")
        );
    }
    let seed = a.seed.unwrap_or_else(|| {
        SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64 % 1_000_000_000)
            .unwrap_or(1)
    });
    let run_len = a.run_length();
    let shape = shape(&a);
    let jobs_plan = plan::jobs(seed, run_len, a.rate);
    let fault_plan = plan::faults(seed, run_len, &shape);
    let sink_plan = plan::sink_faults(seed, run_len);
    if a.print_plan {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &json!({"seed": seed, "jobs": jobs_plan, "faults": fault_plan, "sink_faults": sink_plan})
            )?
        );
        return Ok(true);
    }
    let topology = if a.cluster {
        "3-node cluster (R3)"
    } else {
        "single node"
    };
    println!(
        "leasehold-soak: seed {seed} ({topology}, {:.0}s of faults); replay with: leasehold-soak --seed {seed}{}{}",
        run_len.as_secs_f64(),
        if a.cluster { " --cluster" } else { "" },
        match (a.minutes, a.seconds) {
            (Some(m), _) => format!(" --minutes {m}"),
            (None, Some(s)) => format!(" --seconds {s}"),
            _ => String::new(),
        }
    );
    std::fs::create_dir_all(&a.out)?;
    let logs = fleet::log_dir(&a.out, seed)?;
    std::fs::write(
        logs.join("plan.json"),
        serde_json::to_vec_pretty(
            &json!({"seed": seed, "jobs": jobs_plan, "faults": fault_plan, "sink_faults": sink_plan}),
        )?,
    )?;
    say(format!("logs in {}", logs.display()));
    let wall = Instant::now();

    let settings = Settings {
        seed,
        session_timeout: a.session_timeout,
        concurrency: a.concurrency,
        model_fault_rate: a.model_fault_rate,
        max_stale_reclaims: a.max_stale_reclaims,
    };
    let mut fleet = Fleet::servers(settings, &logs, a.cluster).await?;
    say(format!("nats at {}", fleet.url));
    let conn = NatsArgs::local(fleet.url.clone(), "lh")
        .connect("leasehold-soak")
        .await?;
    let replicas = if a.cluster { 3 } else { 1 };
    let opts = SetupOptions {
        replicas,
        kinds: plan::KINDS.iter().map(|k| k.to_string()).collect(),
        job_history: 64,
        ..SetupOptions::default()
    };
    let mut tries = 0;
    loop {
        match setup::ensure(&conn, &opts).await {
            Ok(_) => break,
            Err(e) if tries < 10 => {
                tries += 1;
                say(format!("setup: {e}; retrying"));
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            Err(e) => return Err(e).context("leasehold setup"),
        }
    }
    collect::create_audit(&conn, replicas).await?;
    fleet.start_sim().await?;
    say(format!("leasehold-sim at {}", fleet.sim_url));
    fleet.add_reapers(2);
    fleet.add_workers(a.workers, &shape.proxied).await?;
    for w in &fleet.workers {
        if let Some(p) = &w.proc {
            fleet::wait_for_log(p, "worker starting", Duration::from_secs(120)).await?;
        }
    }
    say(format!(
        "{} workers ({} behind fault proxies), 2 reapers; {} jobs planned, {} faults drawn",
        a.workers,
        a.proxied,
        jobs_plan
            .iter()
            .filter(|j| j.at_ms < run_len.as_millis() as u64)
            .count(),
        fault_plan.len()
    ));

    let jobs = Jobs::open(&conn).await?;
    let start = Instant::now();
    let submitter = submit::Submitter::new(&conn, jobs.clone(), seed, start, &fleet.url);
    let sim_url = fleet.sim_url.clone();
    let sink = async {
        let http = reqwest::Client::new();
        let mut armed = 0u64;
        for s in &sink_plan {
            tokio::time::sleep_until((start + Duration::from_millis(s.at_ms)).into()).await;
            let r = http
                .post(format!("{sim_url}/effects/faults"))
                .json(&json!({"mode": s.mode, "times": 1}))
                .send()
                .await;
            if r.is_ok() {
                armed += 1;
            }
        }
        armed
    };
    let tracker = track::Tracker::start(jobs.clone());
    let mut chaos = chaos::Chaos {
        fleet: &mut fleet,
        conn: &conn,
        submitter: &submitter,
        tracker: &tracker,
        start,
        streams: shape.streams.clone(),
    };
    let (_, sink_armed, injected) = tokio::join!(
        submitter.run(&jobs_plan, run_len),
        sink,
        chaos.run(&fault_plan, run_len)
    );
    say(format!(
        "injection over after {:.0}s: {} faults; restoring everything",
        start.elapsed().as_secs_f64(),
        injected.len()
    ));
    let restore_notes = chaos.restore_all().await;
    for n in &restore_notes {
        say(n);
    }
    submitter.finish().await;
    let subs = submitter.submissions();
    let accepted: Vec<(String, u64)> = subs
        .iter()
        .filter(|s| s.accepted)
        .map(|s| (s.id.clone(), s.seq))
        .collect();
    say(format!(
        "{} submissions ({} accepted); waiting up to {:?} for every job to settle",
        subs.len(),
        accepted.len(),
        a.quiesce_timeout
    ));
    let quiet_after = quiesce(&jobs, &accepted, a.quiesce_timeout).await;
    // Let index removals and the audit mirror catch up.
    tokio::time::sleep(Duration::from_secs(3)).await;

    let c = collect::collect(&conn, &jobs, &accepted, &fleet.sim_url, &logs).await?;
    let verdict = check::verdict(&subs, &c);
    let per_fault = check::recovery(&injected, &c, &submitter.canaries());
    let summary = check::recovery_summary(&per_fault);
    fleet.stop_all().await;
    save_timelines(&logs, &c, &verdict, &per_fault);

    let report = report(ReportIn {
        a: &a,
        seed,
        topology,
        run_len,
        wall: wall.elapsed(),
        quiet_after,
        subs: &subs,
        cancels: submitter.cancels(),
        injected: &injected,
        sink_armed,
        c: &c,
        verdict: &verdict,
        per_fault: &per_fault,
        summary: &summary,
        restore_notes: &restore_notes,
        logs: &logs,
    });
    let path = a.out.join(format!("soak-{seed}.json"));
    std::fs::write(&path, serde_json::to_vec_pretty(&report)?)?;
    print_table(&report);
    println!("report: {}", path.display());
    if verdict.passed() {
        println!("invariants: OK");
    } else {
        println!("invariants FAILED (process logs in {}):", logs.display());
        for (name, list) in [
            ("lost", &verdict.lost),
            ("duplicate effect", &verdict.duplicate_effects),
            ("stale write", &verdict.stale_writes),
            ("stuck", &verdict.stuck),
            ("wrong outcome", &verdict.wrong_outcomes),
        ] {
            for x in list {
                println!("  {name}: {}: {}", x.job, x.reason);
            }
        }
        println!(
            "replay: leasehold-soak --seed {seed}{}",
            if a.cluster { " --cluster" } else { "" }
        );
    }
    Ok(verdict.passed())
}

/// Saves, for every job with a finding and every slow recovery, its record
/// revisions and its events in `<logs>/jobs/<id>.json`: the evidence a
/// post-mortem starts from (the servers are gone by then).
fn save_timelines(
    logs: &std::path::Path,
    c: &collect::Collected,
    v: &check::Verdict,
    per_fault: &[check::FaultRecovery],
) {
    let mut ids: std::collections::BTreeSet<String> = [
        &v.lost,
        &v.duplicate_effects,
        &v.stale_writes,
        &v.stuck,
        &v.wrong_outcomes,
    ]
    .into_iter()
    .flatten()
    .map(|x| x.job.clone())
    .collect();
    ids.extend(
        per_fault
            .iter()
            .flat_map(|f| f.slow.iter().map(|(j, _)| j.clone())),
    );
    ids.extend(per_fault.iter().flat_map(|f| f.unrecovered.iter().cloned()));
    let dir = logs.join("jobs");
    if ids.is_empty() || std::fs::create_dir_all(&dir).is_err() {
        return;
    }
    for id in ids {
        let revisions: Vec<Value> = c
            .audit
            .get(&id)
            .into_iter()
            .flatten()
            .map(|r| json!({"seq": r.seq, "record": r.rec}))
            .collect();
        let events: Vec<Value> = c
            .events
            .get(&id)
            .into_iter()
            .flatten()
            .map(|(seq, e)| json!({"seq": seq, "event": e}))
            .collect();
        let effects: Vec<&Value> = c
            .effects
            .iter()
            .filter(|e| e["body"]["job_id"].as_str() == Some(id.as_str()))
            .collect();
        let doc = json!({"job": id, "revisions": revisions, "events": events, "effects": effects});
        let _ = std::fs::write(
            dir.join(format!("{id}.json")),
            serde_json::to_vec_pretty(&doc).unwrap_or_default(),
        );
    }
}

/// Polls the records of jobs not yet settled until all are, or `timeout`.
/// Returns how long it took (`None`: timed out).
async fn quiesce(jobs: &Jobs, ids: &[(String, u64)], timeout: Duration) -> Option<Duration> {
    let t0 = Instant::now();
    let mut open: Vec<String> = ids.iter().map(|(id, _)| id.clone()).collect();
    let mut said = Instant::now();
    loop {
        let mut still = Vec::new();
        for id in open {
            let settled = matches!(
                tokio::time::timeout(Duration::from_secs(5), jobs.get(&id)).await,
                Ok(Ok(Some(v))) if collect::settled(&v.value)
            );
            if !settled {
                still.push(id);
            }
        }
        open = still;
        if open.is_empty() {
            say(format!("settled after {:.1}s", t0.elapsed().as_secs_f64()));
            return Some(t0.elapsed());
        }
        if t0.elapsed() > timeout {
            say(format!(
                "{} jobs still not settled; checking anyway",
                open.len()
            ));
            return None;
        }
        if said.elapsed() > Duration::from_secs(15) {
            say(format!(
                "{} jobs not settled yet (e.g. {})",
                open.len(),
                open.iter().take(3).cloned().collect::<Vec<_>>().join(", ")
            ));
            said = Instant::now();
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

struct ReportIn<'a> {
    a: &'a Args,
    seed: u64,
    topology: &'a str,
    run_len: Duration,
    wall: Duration,
    quiet_after: Option<Duration>,
    subs: &'a [submit::Submission],
    cancels: BTreeMap<String, submit::CancelResult>,
    injected: &'a [chaos::Injected],
    sink_armed: u64,
    c: &'a collect::Collected,
    verdict: &'a check::Verdict,
    per_fault: &'a [check::FaultRecovery],
    summary: &'a Value,
    restore_notes: &'a [String],
    logs: &'a std::path::Path,
}

fn report(r: ReportIn<'_>) -> Value {
    let mut by_kind: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    for s in r.subs.iter().filter(|s| s.accepted) {
        let st =
            r.c.records
                .get(&s.id)
                .and_then(|x| x.as_ref())
                .map_or("no record".to_string(), |x| x.status.clone());
        let kind = if s.canary { "canary" } else { s.kind.as_str() };
        *by_kind
            .entry(kind.to_string())
            .or_default()
            .entry(st)
            .or_default() += 1;
    }
    let mut faults_by_kind: BTreeMap<&str, u64> = BTreeMap::new();
    for f in r.injected {
        *faults_by_kind.entry(f.name).or_default() += 1;
    }
    let recorded_cancels = r
        .cancels
        .values()
        .filter(|c| c.recorded == Some(true))
        .count();
    let revisions: usize = r.c.audit.values().map(Vec::len).sum();
    let events: usize = r.c.events.values().map(Vec::len).sum();
    let spurious: u64 = r.c.spurious_10164.values().sum();
    let list = |v: &[check::Finding]| json!({"count": v.len(), "jobs": v});
    json!({
        "seed": r.seed,
        "topology": r.topology,
        "injection_s": r.run_len.as_secs_f64(),
        "wall_s": r.wall.as_secs_f64(),
        "settled_after_s": r.quiet_after.map(|d| d.as_secs_f64()),
        "passed": r.verdict.passed(),
        "settings": {
            "workers": r.a.workers, "proxied": r.a.proxied, "concurrency": r.a.concurrency,
            "rate_per_s": r.a.rate, "session_timeout_ms": r.a.session_timeout.as_millis() as u64,
            "gap_ms": [r.a.gap_min.as_millis() as u64, r.a.gap_max.as_millis() as u64],
            "model_fault_rate": r.a.model_fault_rate, "max_stale_reclaims": r.a.max_stale_reclaims,
            "reapers": 2, "reaper_interval": "1s",
        },
        "jobs": {
            "submitted": r.subs.len(),
            "accepted": r.subs.iter().filter(|s| s.accepted).count(),
            "canaries": r.subs.iter().filter(|s| s.canary).count(),
            "by_kind_and_status": by_kind,
            "cancel_requests": r.cancels.len(),
            "cancel_requests_recorded": recorded_cancels,
            "cancels": r.cancels,
        },
        "faults": {
            "injected": r.injected.len(),
            "sigterm_not_done_in_30s": r.injected.iter().filter(|f| f.notes.iter().any(|n| n.contains("after SIGTERM"))).count(),
            "by_kind": faults_by_kind,
            "sink_faults_armed": r.sink_armed,
            "list": r.injected,
        },
        "invariants": {
            "lost": list(&r.verdict.lost),
            "duplicate_effects": list(&r.verdict.duplicate_effects),
            "stale_writes": list(&r.verdict.stale_writes),
            "stuck": list(&r.verdict.stuck),
            "wrong_outcomes": list(&r.verdict.wrong_outcomes),
        },
        "info": r.verdict.info,
        "recovery": r.summary,
        "recovery_per_fault": r.per_fault,
        "spurious_10164": {
            "count": spurious,
            "by_log": r.c.spurious_10164,
            "record_writes": revisions,
            "method": "lines `spurious 10164 on update; re-reading` that leasehold_store logs at debug (the soak runs every worker and reaper with RUST_LOG=info,leasehold_store=debug) when a revision-conditioned record update is refused with 10164 and retried; record_writes is the number of record revisions accepted (the audit mirror). 10164s on record creates and on fenced event publishes are retried without a log line and are not counted.",
        },
        "audit": r.c.audit_state,
        "stale_record_reads_at_the_end": r.c.stale_reads,
        "record_revisions": revisions,
        "events": events,
        "effects_at_sink": r.c.effects.len(),
        "restore_notes": r.restore_notes,
        "logs": r.logs.display().to_string(),
    })
}

fn ms(v: &Value) -> String {
    v.as_u64().map_or("-".into(), |x| format!("{x}"))
}

fn print_table(r: &Value) {
    let inv = &r["invariants"];
    let rec = &r["recovery"];
    let rows: Vec<(String, String)> = vec![
        (
            "seed / topology".into(),
            format!("{} / {}", r["seed"], r["topology"].as_str().unwrap_or("")),
        ),
        (
            "injection / wall time (s)".into(),
            format!(
                "{:.0} / {:.0}",
                r["injection_s"].as_f64().unwrap_or(0.0),
                r["wall_s"].as_f64().unwrap_or(0.0)
            ),
        ),
        (
            "jobs submitted / accepted / canaries".into(),
            format!(
                "{} / {} / {}",
                r["jobs"]["submitted"], r["jobs"]["accepted"], r["jobs"]["canaries"]
            ),
        ),
        (
            "cancel requests (recorded)".into(),
            format!(
                "{} ({})",
                r["jobs"]["cancel_requests"], r["jobs"]["cancel_requests_recorded"]
            ),
        ),
        (
            "faults injected (sink faults armed)".into(),
            format!(
                "{} ({})",
                r["faults"]["injected"], r["faults"]["sink_faults_armed"]
            ),
        ),
        (
            "workers still running 30 s after SIGTERM (killed)".into(),
            r["faults"]["sigterm_not_done_in_30s"].to_string(),
        ),
        ("lost".into(), inv["lost"]["count"].to_string()),
        (
            "duplicate effects".into(),
            inv["duplicate_effects"]["count"].to_string(),
        ),
        (
            "stale writes".into(),
            inv["stale_writes"]["count"].to_string(),
        ),
        ("stuck".into(), inv["stuck"]["count"].to_string()),
        (
            "wrong outcomes".into(),
            inv["wrong_outcomes"]["count"].to_string(),
        ),
        (
            "reclaim after worker fault p50/p95 ms (n)".into(),
            format!(
                "{} / {} ({})",
                ms(&rec["worker_faults_reclaim"]["p50_ms"]),
                ms(&rec["worker_faults_reclaim"]["p95_ms"]),
                rec["worker_faults_reclaim"]["n"]
            ),
        ),
        (
            "research progress after server fault p50/p95 ms (n)".into(),
            format!(
                "{} / {} ({})",
                ms(&rec["server_faults_research_progress"]["p50_ms"]),
                ms(&rec["server_faults_research_progress"]["p95_ms"]),
                rec["server_faults_research_progress"]["n"]
            ),
        ),
        (
            "canary echo after any fault p50/p95 ms (n)".into(),
            format!(
                "{} / {} ({})",
                ms(&rec["canary"]["p50_ms"]),
                ms(&rec["canary"]["p95_ms"]),
                rec["canary"]["n"]
            ),
        ),
        (
            "spurious 10164 retried / record writes".into(),
            format!(
                "{} / {}",
                r["spurious_10164"]["count"], r["spurious_10164"]["record_writes"]
            ),
        ),
        (
            "events / effects at sink".into(),
            format!("{} / {}", r["events"], r["effects_at_sink"]),
        ),
        (
            "audit of record revisions complete".into(),
            r["audit"]["complete"].to_string(),
        ),
    ];
    println!();
    for (k, v) in rows {
        println!("{k:<52} {v}");
    }
    if let Some(by) = r["recovery"]["by_fault"].as_object() {
        println!();
        println!(
            "{:<22} {:>6} {:>8} {:>9} {:>9} {:>9} {:>5} {:>7} {:>9}",
            "FAULT",
            "COUNT",
            "AFFECTED",
            "RECLAIMED",
            "P50 ms",
            "P95 ms",
            "KEPT",
            "UNRECOV",
            "CANARY95"
        );
        for (k, v) in by {
            println!(
                "{:<22} {:>6} {:>8} {:>9} {:>9} {:>9} {:>5} {:>7} {:>9}",
                k,
                ms(&v["faults"]),
                ms(&v["affected_jobs"]),
                ms(&v["reclaimed"]),
                ms(&v["reclaim_p50_ms"]),
                ms(&v["reclaim_p95_ms"]),
                ms(&v["kept_by_owner"]),
                ms(&v["unrecovered"]),
                ms(&v["canary_p95_ms"]),
            );
        }
    }
    if let Some(by) = r["jobs"]["by_kind_and_status"].as_object() {
        println!();
        for (k, v) in by {
            let parts: Vec<String> = v
                .as_object()
                .into_iter()
                .flatten()
                .map(|(s, n)| format!("{s} {n}"))
                .collect();
            println!("{k:<10} {}", parts.join(", "));
        }
    }
    println!();
}
