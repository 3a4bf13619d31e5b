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
mod ops;
mod plan;
mod profile;
mod reoffer;
mod rng;
mod slots;
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
use crate::profile::{Knobs, Profile};

#[derive(Parser, Debug, Clone)]
#[command(
    name = "leasehold-soak",
    version,
    about = "Seeded chaos soak of leasehold: real processes and nats-servers, a realistic job mix, faults injected on a schedule drawn from the seed, invariants (lost, duplicate effects, stale writes, stuck, false re-offers) checked from outside",
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
        Profiles (--profile) put the fleet where users put it; each sets the defaults of the options \
        below (an option given on the command line wins):\n\
        - default: the above, exactly as before profiles (a seed replays the same plan).\n\
        - busy: long sleep jobs (20-60 s, or --long-jobs) sized to the fleet's slots (workers x concurrency, 10% more \
        lanes than slots) to keep slot use above 90% (measured and reported), worker 1 with 2 slots for \
        6 kinds (--concurrency 2,4), a few poison jobs (kind crash, which aborts its worker; the soak \
        starts a crashed worker again at once under its identity), the mix at 0.25/s, and the default's \
        faults with kill -9 of workers dealt twice as often, every 5-15 s; --max-stale-reclaims 5. A \
        planned poison job must end dead (class poison) within --quiesce-timeout, and any other job \
        ending dead fails the run.\n\
        - nats-restart: single node; the server stopped (SIGTERM, or kill -9) and kept down 2-3 session \
        timeouts before it starts again on its storage, every 8-20 s, with long jobs on 75% of the slots \
        and the mix at 0.5/s. No job may end dead.\n\
        - rolling: 3-node cluster; a rolling restart of the nodes one at a time (SIGTERM, its exit, \
        0.5-3 s down, start, wait until every stream has a leader and every replica is current), every \
        5-15 s, with long jobs on 75% of the slots and the mix at 0.5/s. No job may end dead.\n\
        - operators: the default's faults (the mix at 0.8/s, without deliver) while operators act with \
        the leasehold CLI: parked jobs resumed (review resume) and cancelled (a resume after the \
        cancel must be refused), rejected submissions replayed (refused as they are, then with \
        --spec FILE), the deliver kind added to the running fleet (setup --kinds, a job submitted \
        before its worker starts), ids of it reused after a 5 s retention and a 20 s dedupe window, \
        and the kind pruned (refused while a ticket of it is queued, then done; a later submission \
        refused). Nothing may be lost, resurrected, rejected or delivered with another incarnation's \
        document.\n\
        - scale: 3-node cluster; 100 worker processes with 2 slots each and 3 reapers splitting the \
        sweep by shard, the job mix at 1.5/s, the product's session timeout (10s), and kill -9 of \
        nodes (leaders and followers, twice as often), of workers and of a reaper, every 10-25 s. \
        Run it for 10 minutes (--minutes 10).\n\n\
        The seed is printed at start; --seed N (with the same --profile) replays the same plan (the jobs, \
        their times, the faults and their order). Then it stops injecting, restores everything, waits for every job to settle \
        and checks: lost (no record, or not terminal/parked-with-reason), duplicate effects at the sink, \
        stale writes (record revisions and events older than an accepted epoch), stuck (no live owner, \
        no ticket), wrong outcomes, and false re-offers: a job taken from its owner (a recoverer's \
        `recovered` progress event naming the worker, or a record whose stale_reclaims rose) while that \
        owner's process was alive, not killed, paused, partitioned or being stopped by the soak, and \
        stayed alive. It measures recovery after each fault (p50/p95), slot use, and counts the \
        spurious 10164 rejections the store retried.\n\n\
        Output: <out>/soak-<seed>.json, a table on stdout, process logs in <out>/soak-<seed>-logs/. \
        Exit 0: every invariant held; 1: an invariant failed (the offending jobs are printed); 2: the \
        run could not be carried out."
)]
struct Args {
    /// Seed of the plan; printed at start. Default: drawn from the clock.
    #[arg(long, env = "SOAK_SEED")]
    seed: Option<u64>,
    /// Which fleet, load and faults (described above).
    #[arg(long, value_enum, env = "SOAK_PROFILE", default_value = "default")]
    profile: Profile,
    /// Length of the injection phase in minutes (quiescence and checks come after).
    #[arg(long, env = "SOAK_MINUTES", conflicts_with = "seconds")]
    minutes: Option<f64>,
    /// Length of the injection phase in seconds.
    #[arg(long, env = "SOAK_SECONDS")]
    seconds: Option<u64>,
    /// Run on a 3-node JetStream cluster (every stream and bucket at R3)
    /// instead of a single server (rolling: always; nats-restart: never).
    #[arg(long)]
    cluster: bool,
    /// Where soak-<seed>.json and the log folder go.
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
    /// Worker processes [default: 4].
    #[arg(long)]
    workers: Option<usize>,
    /// How many of the workers sit behind fault proxies (partitionable)
    /// [default: 2].
    #[arg(long)]
    proxied: Option<usize>,
    /// Jobs each worker runs at once; a list (2,4) gives worker 1, 2, ...
    /// their own, the last value repeating [default: 8; busy: 2,4;
    /// nats-restart, rolling: 4].
    #[arg(long, value_delimiter = ',')]
    concurrency: Vec<usize>,
    /// Submissions per second of the job mix (exponential gaps)
    /// [default: 1.5; busy: 0.25; nats-restart, rolling: 0.5].
    #[arg(long)]
    rate: Option<f64>,
    /// The workers' session timeout (short, so a pause resolves within the
    /// run) [default: 3s].
    #[arg(long, value_parser = parse_duration)]
    session_timeout: Option<Duration>,
    /// Shortest quiet gap between two faults [default: 3s; busy, rolling:
    /// 5s; nats-restart: 8s].
    #[arg(long, value_parser = parse_duration)]
    gap_min: Option<Duration>,
    /// Longest quiet gap between two faults [default: 12s; busy, rolling:
    /// 15s; nats-restart: 20s].
    #[arg(long, value_parser = parse_duration)]
    gap_max: Option<Duration>,
    /// How long to wait for every job to settle after the last fault
    /// [default: 300s; other profiles: 180s].
    #[arg(long, value_parser = parse_duration)]
    quiesce_timeout: Option<Duration>,
    /// Share of model requests the simulator answers with a fault.
    #[arg(long, default_value_t = 0.1)]
    model_fault_rate: f64,
    /// Workers' and reapers' --max-stale-reclaims: a job interrupted this
    /// often is dead-lettered as poison (a valid, counted outcome in the
    /// default profile) [default: 6; busy: 10].
    #[arg(long)]
    max_stale_reclaims: Option<u32>,
    /// Inject only these fault kinds (comma-separated): kill9_worker_same_id,
    /// kill9_worker_new_id, sigstop_worker, sigterm_worker, kill9_reaper,
    /// partition_freeze, partition_cut (with --proxied > 0; operators:
    /// also partition_blip, a cut of 0.5-2 s), kill9_server
    /// (single node), kill9_node_leader, kill9_node_follower,
    /// leader_stepdown (--cluster); nats_restart_kill9,
    /// nats_restart_sigterm (nats-restart); rolling_restart (rolling).
    /// Default: all of the profile's.
    #[arg(long, value_delimiter = ',')]
    faults: Vec<String>,
    /// busy: how many poison jobs [default: 3 plus one per two minutes of
    /// run, at most 8]; 0 runs the busy fleet without them.
    #[arg(long)]
    poison_jobs: Option<usize>,
    /// Profiles with long jobs (busy, nats-restart, rolling): their length,
    /// uniform in MIN-MAX (`8s-20s`) [default: 20s-60s]. The last of them
    /// end at most half of MAX after the run (30 s by default), so shorter
    /// jobs settle sooner (`make soak-ci` runs the busy fleet with 8s-20s).
    #[arg(long, value_parser = parse_range, value_name = "MIN-MAX")]
    long_jobs: Option<(Duration, Duration)>,
    /// The fraction (0-1) of the mix's `sleep` jobs that are durable timers
    /// (`ctx.sleep`: they wait holding no worker, and must complete once,
    /// not before their time). 0 keeps a recorded seed's plan.
    #[arg(long, value_name = "P")]
    durable_sleeps: Option<f64>,
    /// The fraction (0-1) of the mix's `sleep` jobs that then wait for the
    /// signal `go` (`ctx.wait_for`), which the soak sends at a random time
    /// (before, during or after the wait): each must complete with its own
    /// signal, taken once. 0 keeps a recorded seed's plan.
    #[arg(long, value_name = "P")]
    signals: Option<f64>,
    /// One `fanout` parent, a fifth into the run, spawning this many echo
    /// children and joining them: each child must exist once (one spawn,
    /// each child naming its parent), every one must end, and the parent
    /// must be woken once per wait (its claims at most 2 plus its stale
    /// reclaims), whatever the faults do. 0: none.
    #[arg(long, value_name = "N")]
    fanout: Option<usize>,
    /// The fraction (0-1) of the mix's research jobs run with their experts
    /// as child jobs (`"expert_jobs": true`, kind `research-expert`): each
    /// completed one must have spawned once, one child per expert, each
    /// naming it and ended, and been woken at most once per wait. 0 keeps
    /// a recorded seed's plan.
    #[arg(long, value_name = "P")]
    expert_jobs: Option<f64>,
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

    /// The profile's settings with the command line's overrides.
    fn knobs(&self) -> anyhow::Result<Knobs> {
        let mut k = self.profile.knobs(self.cluster)?;
        k.workers = self.workers.unwrap_or(k.workers);
        k.proxied = self.proxied.unwrap_or(k.proxied);
        if !self.concurrency.is_empty() {
            k.concurrency = self.concurrency.clone();
        }
        k.rate = self.rate.unwrap_or(k.rate);
        k.session_timeout = self.session_timeout.unwrap_or(k.session_timeout);
        k.gap = (
            self.gap_min.unwrap_or(k.gap.0),
            self.gap_max.unwrap_or(k.gap.1),
        );
        k.quiesce_timeout = self.quiesce_timeout.unwrap_or(k.quiesce_timeout);
        k.max_stale_reclaims = self.max_stale_reclaims.unwrap_or(k.max_stale_reclaims);
        if let Some(p) = self.durable_sleeps {
            anyhow::ensure!(
                (0.0..=1.0).contains(&p),
                "--durable-sleeps: a fraction from 0 to 1, not {p}"
            );
            k.durable_sleeps = p;
        }
        if let Some(n) = self.fanout {
            anyhow::ensure!(
                n <= leasehold_core::spec::MAX_CHILDREN,
                "--fanout: at most {} children in one spawn, not {n}",
                leasehold_core::spec::MAX_CHILDREN
            );
            k.fanout = n;
        }
        if let Some(p) = self.signals {
            anyhow::ensure!(
                (0.0..=1.0).contains(&p),
                "--signals: a fraction from 0 to 1, not {p}"
            );
            k.signals = p;
        }
        if let Some(p) = self.expert_jobs {
            anyhow::ensure!(
                (0.0..=1.0).contains(&p),
                "--expert-jobs: a fraction from 0 to 1, not {p}"
            );
            k.expert_jobs = p;
        }
        anyhow::ensure!(
            k.poison || self.poison_jobs.is_none(),
            "--poison-jobs: only the busy profile plans poison jobs"
        );
        k.poison_jobs = self.poison_jobs.or(k.poison_jobs);
        if let Some((min, max)) = self.long_jobs {
            let Some(long) = k.long.as_mut() else {
                anyhow::bail!("--long-jobs: only busy, nats-restart and rolling plan long jobs");
            };
            long.ms = (min.as_millis() as u64, max.as_millis() as u64);
            long.tail_ms = long.ms.1 / 2;
        }
        Ok(k)
    }

    /// The flags that replay this run's plan.
    fn replay(&self, seed: u64, k: &Knobs) -> String {
        let mut s = format!("leasehold-soak --seed {seed}");
        if k.profile != Profile::Default {
            s.push_str(&format!(" --profile {}", k.profile.name()));
        }
        if self.cluster {
            s.push_str(" --cluster");
        }
        match (self.minutes, self.seconds) {
            (Some(m), _) => s.push_str(&format!(" --minutes {m}")),
            (None, Some(x)) => s.push_str(&format!(" --seconds {x}")),
            _ => {}
        }
        if let Some((min, max)) = self.long_jobs {
            s.push_str(&format!(
                " --long-jobs {}-{}",
                leasehold_core::time::format_duration(min),
                leasehold_core::time::format_duration(max)
            ));
        }
        if k.durable_sleeps > 0.0 {
            s.push_str(&format!(" --durable-sleeps {}", k.durable_sleeps));
        }
        if k.signals > 0.0 {
            s.push_str(&format!(" --signals {}", k.signals));
        }
        if k.fanout > 0 {
            s.push_str(&format!(" --fanout {}", k.fanout));
        }
        if k.expert_jobs > 0.0 {
            s.push_str(&format!(" --expert-jobs {}", k.expert_jobs));
        }
        s
    }
}

/// `8s-20s`: two durations, the first not above the second, the first at
/// least a second.
fn parse_range(s: &str) -> Result<(Duration, Duration), String> {
    let (a, b) = s
        .split_once('-')
        .ok_or_else(|| format!("{s:?}: write MIN-MAX, like 8s-20s"))?;
    let (min, max) = (parse_duration(a)?, parse_duration(b)?);
    if min < Duration::from_secs(1) || min > max {
        return Err(format!("{s:?}: MIN must be at least 1s and not above MAX"));
    }
    Ok((min, max))
}

fn say(s: impl AsRef<str>) {
    eprintln!("soak: {}", s.as_ref());
}

#[tokio::main]
async fn main() {
    let a = Args::parse();
    stop_children_on_signal();
    match run(a).await {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("soak error: {e:#}");
            std::process::exit(2);
        }
    }
}

/// A soak stopped by SIGTERM or SIGINT stops what it started: every
/// server, worker, reaper, sim and service process (no destructor runs on
/// a signal, so the harness's registry of children is what ends them),
/// then exits with 128 + the signal's number.
fn stop_children_on_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler");
    tokio::spawn(async move {
        let (name, code) = tokio::select! {
            _ = term.recv() => ("SIGTERM", 143),
            _ = int.recv() => ("SIGINT", 130),
        };
        say(format!("{name}: stopping every process this soak started"));
        leasehold_harness::kill_children();
        std::process::exit(code);
    });
}

fn shape(k: &Knobs, only: &[String]) -> plan::Shape {
    let streams = if k.cluster {
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
        workers: k.workers,
        proxied: (k.workers.saturating_sub(k.proxied)..k.workers).collect(),
        reapers: k.reapers,
        session_ms: k.session_timeout.as_millis() as u64,
        streams: if streams.is_empty() {
            vec!["LH_WORK".into()]
        } else {
            streams
        },
        gap_ms: (
            k.gap.0.as_millis() as u64,
            k.gap.1.as_millis().max(k.gap.0.as_millis()) as u64,
        ),
        kinds: k.deck(),
        only: (!only.is_empty()).then(|| only.to_vec()),
    }
}

async fn run(a: Args) -> anyhow::Result<bool> {
    let k = a.knobs()?;
    anyhow::ensure!(k.workers >= 2, "--workers must be at least 2");
    anyhow::ensure!(
        k.proxied <= k.workers,
        "--proxied must not exceed --workers"
    );
    anyhow::ensure!(
        k.concurrency.iter().all(|c| *c > 0),
        "--concurrency must be at least 1"
    );
    let mut kinds: Vec<&str> = Vec::new();
    for x in k.deck() {
        if !kinds.contains(&x) {
            kinds.push(x);
        }
    }
    for f in &a.faults {
        anyhow::ensure!(
            kinds.contains(&f.as_str()),
            "--faults: {f:?} is not a fault of this profile and topology; choose from {}",
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
    let shape = shape(&k, &a.faults);
    let jobs_plan = plan::plan_jobs(seed, run_len, &k);
    let fault_plan = plan::faults(seed, run_len, &shape);
    let sink_plan = plan::sink_faults(seed, run_len);
    let ops_plan = k.ops.then(|| ops::plan(seed, run_len));
    let mut plan_doc = plan_doc(seed, &k, &jobs_plan, &fault_plan, &sink_plan);
    if let Some(p) = &ops_plan {
        plan_doc["operators"] = json!(p);
    }
    if a.print_plan {
        println!("{}", serde_json::to_string_pretty(&plan_doc)?);
        return Ok(true);
    }
    let topology = if k.cluster {
        "3-node cluster (R3)"
    } else {
        "single node"
    };
    println!(
        "leasehold-soak: seed {seed} (profile {}, {topology}, {:.0}s of faults); replay with: {}",
        k.profile.name(),
        run_len.as_secs_f64(),
        a.replay(seed, &k)
    );
    std::fs::create_dir_all(&a.out)?;
    let logs = fleet::log_dir(&a.out, seed)?;
    std::fs::write(
        logs.join("plan.json"),
        serde_json::to_vec_pretty(&plan_doc)?,
    )?;
    say(format!("logs in {}", logs.display()));
    let wall = Instant::now();

    let concurrency: Vec<usize> = (0..k.workers).map(|i| k.concurrency_of(i)).collect();
    let settings = Settings {
        seed,
        session_timeout: k.session_timeout,
        concurrency: concurrency.clone(),
        kinds: k.kinds(),
        model_fault_rate: a.model_fault_rate,
        max_stale_reclaims: k.max_stale_reclaims,
        retention_kind: if k.ops {
            ops::RETENTION.into()
        } else {
            String::new()
        },
        reaper_interval: reaper_interval(&k).into(),
    };
    let mut fleet = Fleet::servers(settings.clone(), &logs, k.cluster).await?;
    say(format!("nats at {}", fleet.url));
    let conn = NatsArgs::local(fleet.url.clone(), "lh")
        .connect("leasehold-soak")
        .await?;
    let replicas = if k.cluster { 3 } else { 1 };
    let mut set_up = k.kinds();
    if k.ops {
        // The doors' kinds (served by their own workers, not the fleet's).
        set_up.extend(ops::doors::KINDS.map(String::from));
    }
    let opts = SetupOptions {
        replicas,
        kinds: set_up,
        job_history: 64,
        dedupe_window: if k.ops {
            ops::DEDUPE_WINDOW
        } else {
            SetupOptions::default().dedupe_window
        },
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
    fleet.add_reapers(k.reapers);
    fleet.add_workers(k.workers, &shape.proxied).await?;
    for w in &fleet.workers {
        if let Some(p) = &w.proc {
            fleet::wait_for_log(p, "worker starting", Duration::from_secs(120)).await?;
        }
    }
    let planned = jobs_plan
        .iter()
        .filter(|j| j.at_ms < run_len.as_millis() as u64)
        .count();
    say(format!(
        "{} workers ({} behind fault proxies, {} slots), {} reapers; {planned} jobs planned, {} faults drawn",
        k.workers,
        k.proxied,
        k.slots(),
        k.reapers,
        fault_plan.len()
    ));

    let jobs = Jobs::open(&conn).await?;
    let start = Instant::now();
    let start_wall = SystemTime::now();
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
    let operators = ops_plan.as_ref().map(|p| {
        let o = ops::Ops::new(ops::OpsIn {
            conn: &conn,
            jobs: jobs.clone(),
            seed,
            start,
            url: fleet.url.clone(),
            sim_url: fleet.sim_url.clone(),
            settings: settings.clone(),
            replicas,
            logs: logs.clone(),
        });
        o.start(p);
        o
    });
    let tracker = track::Tracker::start(jobs.clone());
    let mut chaos = chaos::Chaos::new(
        &mut fleet,
        &conn,
        &submitter,
        &tracker,
        start,
        shape.streams.clone(),
        k.poison,
    );
    let (_, sink_armed, mut injected) = tokio::join!(
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
    chaos.during(submitter.finish()).await;
    if let Some(o) = &operators {
        say("waiting for the operators' flows to end");
        chaos.during(o.finish()).await;
    }
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
        k.quiesce_timeout
    ));
    let quiet_after = chaos
        .during(quiesce(&jobs, &accepted, k.quiesce_timeout))
        .await;
    // Let index removals and the audit mirror catch up.
    chaos
        .during(tokio::time::sleep(Duration::from_secs(3)))
        .await;

    let c = chaos
        .during(collect::collect(&conn, &jobs, &accepted, &sim_url, &logs))
        .await?;
    let crashed = chaos.crashed.clone();
    let reachable = chaos.reachable();
    drop(chaos);
    for f in &mut injected {
        f.reachable_ms = reachable
            .get(&f.n)
            .map(|t| f.at_ms + t.duration_since(f.at).unwrap_or_default().as_millis() as u64);
    }
    let ops_log = operators.as_ref().map(|o| o.log());
    if let Some((_, _, procs)) = &ops_log {
        fleet.incarnations.extend(procs.iter().cloned());
    }
    fleet.read_sessions();
    let mut verdict = check::verdict(
        &subs,
        &c,
        check::Rules {
            dead_fails: k.dead_fails,
            reused: ops_log
                .iter()
                .flat_map(|(flows, _, _)| flows)
                .filter(|f| f.what == "reuse")
                .map(|f| f.id.clone())
                .collect(),
        },
    );
    if let (Some((flows, _, _)), Some(o)) = (&ops_log, &operators) {
        verdict.operators = ops::check(flows, &c);
        verdict
            .operators
            .extend(o.check_doors(&c, &server_down(&injected)));
    }
    let mut reoffers = reoffer::find(&c);
    reoffer::judge(
        &mut reoffers,
        &fleet.incarnations,
        &reoffer::disturbances(&injected),
    );
    for r in &reoffers {
        *verdict
            .info
            .entry(format!("reoffers.{}", r.judged))
            .or_default() += 1;
        if r.judged == "false" {
            verdict.false_reoffers.push(check::Finding {
                job: r.job.clone(),
                reason: format!(
                    "epoch {} of {} re-offered at {} by {} (seen in {}): {}",
                    r.epoch,
                    r.owner,
                    r.at,
                    r.by.as_deref().unwrap_or("?"),
                    r.seen_in.join(" and "),
                    r.why
                ),
            });
        }
    }
    let slot_use = slots::measure(
        &c,
        &fleet.incarnations,
        (
            start_wall + SLOT_USE_RAMP.min(run_len),
            start_wall + run_len,
        ),
        &concurrency,
        k.slot_use_target,
    );
    let per_fault = check::recovery(&injected, &c, &submitter.canaries());
    let summary = check::recovery_summary(&per_fault);
    fleet.stop_all().await;
    save_timelines(&logs, &c, &verdict, &per_fault);

    let mut report = report(ReportIn {
        k: &k,
        a: &a,
        seed,
        topology,
        run_len,
        wall: wall.elapsed(),
        quiet_after,
        subs: &subs,
        cancels: submitter.cancels(),
        signals: submitter.signals(),
        injected: &injected,
        sink_armed,
        c: &c,
        verdict: &verdict,
        per_fault: &per_fault,
        summary: &summary,
        restore_notes: &restore_notes,
        logs: &logs,
        reoffers: &reoffers,
        slot_use: &slot_use,
        fleet: &fleet,
        crashed: &crashed,
    });
    if let (Some(p), Some((flows, actions, _))) = (&ops_plan, &ops_log) {
        report["operators"] = json!({
            "plan": p,
            "flows": flows,
            "actions": actions,
            "findings": verdict.operators.len(),
            "doors": operators.as_ref().map(|o| o.doors_seen()),
            "invariants": door_invariants(&verdict.operators),
        });
        let mut by: BTreeMap<&str, (usize, usize)> = BTreeMap::new();
        for f in flows {
            let e = by.entry(f.what).or_default();
            e.0 += 1;
            e.1 += usize::from(f.done && f.problems.is_empty());
        }
        let line: Vec<String> = by
            .iter()
            .map(|(w, (n, ok))| format!("{w} {ok}/{n}"))
            .collect();
        say(format!(
            "operators: {} commands; flows ended clean: {}",
            actions.len(),
            line.join(", ")
        ));
    }
    let path = a.out.join(format!("soak-{seed}.json"));
    std::fs::write(&path, serde_json::to_vec_pretty(&report)?)?;
    print_table(&report);
    println!("report: {}", path.display());
    if let Some(t) = slot_use.target.filter(|t| slot_use.share < *t) {
        println!(
            "note: slot use {:.1}% is below the {:.0}% this profile's load is sized for",
            slot_use.share * 100.0,
            t * 100.0
        );
    }
    if verdict.passed() {
        println!("invariants: OK");
    } else {
        println!("invariants FAILED (process logs in {}):", logs.display());
        for (name, list) in verdict.lists() {
            for x in list {
                println!("  {name}: {}: {}", x.job, x.reason);
            }
        }
        println!("replay: {}", a.replay(seed, &k));
    }
    Ok(verdict.passed())
}

/// The plan as `--print-plan` prints it and `plan.json` keeps it (the
/// default profile's exactly as before profiles).
fn plan_doc(
    seed: u64,
    k: &Knobs,
    jobs: &[plan::JobPlan],
    faults: &[plan::Step],
    sink: &[plan::SinkFault],
) -> Value {
    let mut doc = json!({"seed": seed, "jobs": jobs, "faults": faults, "sink_faults": sink});
    if k.profile != Profile::Default {
        doc["profile"] = json!(k.profile);
        doc["slots"] = json!(k.slots());
    }
    doc
}

/// The reapers' sweep interval: 1 s; 2 s for the operators, so their
/// every-second schedule ticks finer than the reapers sweep.
fn reaper_interval(k: &Knobs) -> &'static str {
    if k.ops {
        "2s"
    } else {
        "1s"
    }
}

/// When the soak's faults had the server or a node down (to 3 s after it
/// was restored): a schedule's ticks then are the reapers' to skip.
fn server_down(injected: &[chaos::Injected]) -> Vec<ops::doors::Down> {
    injected
        .iter()
        .filter(|f| {
            matches!(
                f.fault,
                plan::Fault::RestartServer { .. }
                    | plan::Fault::KillNode { .. }
                    | plan::Fault::NatsRestart { .. }
                    | plan::Fault::RollingRestart { .. }
            )
        })
        .map(|f| (f.at, f.restored_at + Duration::from_secs(3)))
        .collect()
}

/// The operators' findings counted by the invariant they name (the
/// prefix of their reason before `: `, after the flow's name).
fn door_invariants(findings: &[check::Finding]) -> Value {
    let mut by: BTreeMap<&str, Vec<&check::Finding>> = ops::doors::INVARIANTS
        .iter()
        .map(|n| (*n, Vec::new()))
        .collect();
    for f in findings {
        if let Some(n) = ops::doors::INVARIANTS
            .iter()
            .find(|n| f.reason.contains(&format!("{n}: ")))
        {
            by.entry(n).or_default().push(f);
        }
    }
    json!(by
        .into_iter()
        .map(|(n, l)| (n, json!({"count": l.len(), "jobs": l})))
        .collect::<BTreeMap<_, _>>())
}

/// Slot use is measured from this long after the first submissions (the
/// fleet's slots fill within the first seconds).
const SLOT_USE_RAMP: Duration = Duration::from_secs(5);

/// Saves, for every job with a finding and every slow recovery, its record
/// revisions and its events in `<logs>/jobs/<id>.json`: the evidence a
/// post-mortem starts from (the servers are gone by then).
fn save_timelines(
    logs: &std::path::Path,
    c: &collect::Collected,
    v: &check::Verdict,
    per_fault: &[check::FaultRecovery],
) {
    let mut ids: std::collections::BTreeSet<String> = v
        .lists()
        .into_iter()
        .flat_map(|(_, l)| l.iter())
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
    k: &'a Knobs,
    a: &'a Args,
    seed: u64,
    topology: &'a str,
    run_len: Duration,
    wall: Duration,
    quiet_after: Option<Duration>,
    subs: &'a [submit::Submission],
    cancels: BTreeMap<String, submit::CancelResult>,
    signals: BTreeMap<String, submit::SignalResult>,
    injected: &'a [chaos::Injected],
    sink_armed: u64,
    c: &'a collect::Collected,
    verdict: &'a check::Verdict,
    per_fault: &'a [check::FaultRecovery],
    summary: &'a Value,
    restore_notes: &'a [String],
    logs: &'a std::path::Path,
    reoffers: &'a [reoffer::Reoffer],
    slot_use: &'a slots::SlotUse,
    fleet: &'a Fleet,
    crashed: &'a [chaos::Crashed],
}

/// A long job of a profile (`soak-<seed>-L<n>-sleep`).
fn long_job(id: &str) -> bool {
    id.ends_with("-sleep") && id.rsplit('-').nth(1).is_some_and(|x| x.starts_with('L'))
}

fn report(r: ReportIn<'_>) -> Value {
    let mut by_kind: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    for s in r.subs.iter().filter(|s| s.accepted) {
        let st =
            r.c.records
                .get(&s.id)
                .and_then(|x| x.as_ref())
                .map_or("no record".to_string(), |x| x.status.clone());
        let kind = if s.canary {
            "canary"
        } else if long_job(&s.id) {
            "long sleep"
        } else {
            s.kind.as_str()
        };
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
    let k = r.k;
    let uniform = k.concurrency.len() == 1;
    let poison: Vec<Value> = r
        .subs
        .iter()
        .filter(|s| s.expect == plan::Expect::Poison)
        .map(|s| {
            let rec = r.c.records.get(&s.id).and_then(|x| x.as_ref());
            json!({
                "job": s.id,
                "accepted": s.accepted,
                "status": rec.map(|x| x.status.clone()),
                "class": rec.and_then(|x| x.error.as_ref().map(|e| e.class.clone())),
                "stale_reclaims": rec.map(|x| x.stale_reclaims),
                "ended_at": rec.map(|x| x.updated_at.clone()),
            })
        })
        .collect();
    let mut judged: BTreeMap<&str, u64> = BTreeMap::new();
    for x in r.reoffers {
        *judged.entry(x.judged).or_default() += 1;
    }
    json!({
        "seed": r.seed,
        "profile": k.profile,
        "topology": r.topology,
        "injection_s": r.run_len.as_secs_f64(),
        "wall_s": r.wall.as_secs_f64(),
        "settled_after_s": r.quiet_after.map(|d| d.as_secs_f64()),
        "passed": r.verdict.passed(),
        "settings": {
            "workers": k.workers, "proxied": k.proxied,
            "concurrency": if uniform { json!(k.concurrency[0]) } else { json!((0..k.workers).map(|i| k.concurrency_of(i)).collect::<Vec<_>>()) },
            "slots": k.slots(), "kinds": k.kinds(),
            "rate_per_s": k.rate, "session_timeout_ms": k.session_timeout.as_millis() as u64,
            "gap_ms": [k.gap.0.as_millis() as u64, k.gap.1.as_millis() as u64],
            "model_fault_rate": r.a.model_fault_rate, "max_stale_reclaims": k.max_stale_reclaims,
            "quiesce_timeout_s": k.quiesce_timeout.as_secs_f64(),
            "long_jobs": k.long, "poison_jobs": r.subs.iter().filter(|s| s.expect == plan::Expect::Poison).count(),
            "reapers": 2, "reaper_interval": reaper_interval(k),
        },
        "jobs": {
            "submitted": r.subs.len(),
            "accepted": r.subs.iter().filter(|s| s.accepted).count(),
            "canaries": r.subs.iter().filter(|s| s.canary).count(),
            "by_kind_and_status": by_kind,
            "cancel_requests": r.cancels.len(),
            "cancel_requests_recorded": recorded_cancels,
            "cancels": r.cancels,
            "signals_sent": r.signals.values().filter(|s| s.seq.is_some()).count(),
            "signals_not_sent": r.signals.iter().filter(|(_, s)| s.seq.is_none()).map(|(id, s)| json!({"id": id, "error": s.error, "tries": s.tries})).collect::<Vec<_>>(),
        },
        "faults": {
            "injected": r.injected.len(),
            "sigterm_not_done_in_30s": r.injected.iter().filter(|f| f.name == "sigterm_worker" && f.notes.iter().any(|n| n.contains("after SIGTERM"))).count(),
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
            "false_reoffers": list(&r.verdict.false_reoffers),
            "unexpected_dead": if k.dead_fails { list(&r.verdict.unexpected_dead) } else { json!("not checked in this profile (its faults may poison a job)") },
            "poison_not_dead": list(&r.verdict.poison_not_dead),
        },
        "info": r.verdict.info,
        "reoffers": {
            "total": r.reoffers.len(),
            "by_judgement": judged,
            "grace_ms": reoffer::GRACE.as_millis() as u64,
            "method": "a recoverer's `progress` event with recovered=true naming the worker, or a record revision whose stale_reclaims rose (the owner: the last running revision before it), one per job and owner epoch; judged against the owner's process (by the session the record names) and the faults the soak injected: owner_gone (it had ended, or ended within grace_ms), fault (a fault of the soak held it, until grace_ms after it was lifted or it answered a ping again), false (alive, undisturbed, stayed alive), unattributed (no such process)",
            "list": r.reoffers,
        },
        "slot_use": r.slot_use,
        "poison": poison,
        "workers": {
            "crashed_and_restarted": r.crashed,
            "processes": r.fleet.incarnations,
        },
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
            "seed / profile / topology".into(),
            format!(
                "{} / {} / {}",
                r["seed"],
                r["profile"].as_str().unwrap_or(""),
                r["topology"].as_str().unwrap_or("")
            ),
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
            "false re-offers (of re-offers seen)".into(),
            format!(
                "{} ({})",
                inv["false_reoffers"]["count"], r["reoffers"]["total"]
            ),
        ),
        (
            "dead, not a poison job".into(),
            match inv["unexpected_dead"]["count"].as_u64() {
                Some(n) => n.to_string(),
                None => "not checked".into(),
            },
        ),
        (
            "poison jobs not dead as poison (planned)".into(),
            format!(
                "{} ({})",
                inv["poison_not_dead"]["count"],
                r["poison"].as_array().map_or(0, Vec::len)
            ),
        ),
        (
            "slot use % of all / of live slots (target)".into(),
            format!(
                "{:.1} / {:.1} ({})",
                r["slot_use"]["share"].as_f64().unwrap_or(0.0) * 100.0,
                r["slot_use"]["share_of_live"].as_f64().unwrap_or(0.0) * 100.0,
                r["slot_use"]["target"]
                    .as_f64()
                    .map_or("-".into(), |t| format!("{:.0}", t * 100.0))
            ),
        ),
        (
            "slot use % per worker (its slots)".into(),
            r["slot_use"]["per_worker"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|w| {
                    format!(
                        "{}:{:.0} ({})",
                        w["slot"].as_u64().unwrap_or(0) + 1,
                        w["share"].as_f64().unwrap_or(0.0) * 100.0,
                        w["concurrency"]
                    )
                })
                .collect::<Vec<_>>()
                .join(", "),
        ),
        (
            "worker processes that exited by themselves".into(),
            r["workers"]["crashed_and_restarted"]
                .as_array()
                .map_or(0, Vec::len)
                .to_string(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Expect, Fault};

    fn knobs(args: &[&str]) -> Knobs {
        let mut v = vec!["leasehold-soak"];
        v.extend(args);
        Args::parse_from(v).knobs().unwrap()
    }

    fn doc(seed: u64, run: Duration, k: &Knobs, only: &[String]) -> String {
        let jobs = plan::plan_jobs(seed, run, k);
        let faults = plan::faults(seed, run, &shape(k, only));
        let sink = plan::sink_faults(seed, run);
        serde_json::to_string_pretty(&plan_doc(seed, k, &jobs, &faults, &sink)).unwrap()
    }

    fn fnv(s: &str) -> u64 {
        s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
        })
    }

    /// Pinned from the `--print-plan` output of the soak before profiles
    /// existed (make soak-ci's two legs): a recorded seed keeps its plan.
    #[test]
    fn signals_change_only_which_sleeps_wait_for_one_and_when_it_is_sent() {
        let run = Duration::from_secs(300);
        let before = plan::plan_jobs(7, run, &knobs(&[]));
        let after = plan::plan_jobs(7, run, &knobs(&["--signals", "0.5"]));
        assert_eq!(before.len(), after.len());
        let mut waits = 0;
        for (b, a) in before.iter().zip(&after) {
            assert_eq!((b.id.as_str(), b.at_ms), (a.id.as_str(), a.at_ms));
            if a.spec["input"]["signal"] == "go" {
                assert_eq!(a.kind, "sleep");
                assert!(a.signal_after_ms.is_some());
                waits += 1;
            } else {
                assert_eq!((&a.spec, a.signal_after_ms), (&b.spec, None));
            }
        }
        let sleeps = after.iter().filter(|j| j.kind == "sleep").count();
        assert!(waits > 0 && waits < sleeps, "{waits} of {sleeps}");
        assert!(Args::try_parse_from(["leasehold-soak", "--signals", "1.5"])
            .unwrap()
            .knobs()
            .is_err());
    }

    #[test]
    fn durable_sleeps_change_only_which_sleeps_are_timers() {
        let run = Duration::from_secs(300);
        let before = plan::plan_jobs(7, run, &knobs(&[]));
        let after = plan::plan_jobs(7, run, &knobs(&["--durable-sleeps", "0.5"]));
        assert_eq!(before.len(), after.len());
        let mut durable = 0;
        for (b, a) in before.iter().zip(&after) {
            assert_eq!((b.id.as_str(), b.at_ms), (a.id.as_str(), a.at_ms));
            if a.spec["input"]["durable"] == true {
                assert_eq!(a.kind, "sleep");
                durable += 1;
            } else {
                assert_eq!(a.spec, b.spec);
            }
        }
        let sleeps = after.iter().filter(|j| j.kind == "sleep").count();
        assert!(durable > 0 && durable < sleeps, "{durable} of {sleeps}");
        assert!(
            Args::try_parse_from(["leasehold-soak", "--durable-sleeps", "2"])
                .unwrap()
                .knobs()
                .is_err()
        );
    }

    #[test]
    fn the_default_profile_replays_the_plans_recorded_before_profiles() {
        let k = knobs(&[]);
        let d = doc(20260501, Duration::from_secs(75), &k, &[]);
        assert_eq!((d.len(), fnv(&d)), (36374, 0x2186_9226_da44_d913));
        let only: Vec<String> = "kill9_node_leader,kill9_node_follower,leader_stepdown,partition_freeze,kill9_worker_new_id"
            .split(',')
            .map(String::from)
            .collect();
        let k = knobs(&[
            "--cluster",
            "--rate",
            "0.8",
            "--gap-min",
            "2s",
            "--gap-max",
            "6s",
        ]);
        let d = doc(20260502, Duration::from_secs(50), &k, &only);
        assert_eq!((d.len(), fnv(&d)), (14992, 0xbf80_47d3_c013_8fa4));
    }

    #[test]
    fn every_profile_replays_its_seed() {
        let run = Duration::from_secs(120);
        for p in ["busy", "nats-restart", "rolling"] {
            let k = knobs(&["--profile", p]);
            assert_eq!(doc(7, run, &k, &[]), doc(7, run, &k, &[]), "{p}");
            assert_ne!(doc(7, run, &k, &[]), doc(8, run, &k, &[]), "{p}");
        }
    }

    /// Checks a plan's long jobs: each is `ms` long and ends at most
    /// `tail_ms` after the run, and at every second of the run at least as
    /// many are planned to be in flight as the fleet has slots.
    fn long_jobs_fill_every_slot(
        plan: &[plan::JobPlan],
        run: Duration,
        k: &Knobs,
        ms: std::ops::RangeInclusive<u64>,
        tail_ms: u64,
    ) {
        let long: Vec<(u64, u64)> = plan
            .iter()
            .filter(|j| long_job(&j.id))
            .map(|j| (j.at_ms, j.spec["input"]["ms"].as_u64().unwrap()))
            .collect();
        let end = run.as_millis() as u64;
        for &(at, len) in &long {
            assert!(ms.contains(&len), "{len}");
            assert!(at + len <= end + tail_ms, "{at} + {len}");
        }
        for t in (2_000..end).step_by(1000) {
            let n = long
                .iter()
                .filter(|(at, len)| *at <= t && t < at + len)
                .count();
            assert!(n >= k.slots(), "{n} long jobs at {t} ms");
        }
    }

    #[test]
    fn long_jobs_can_be_shortened_and_still_fill_every_slot() {
        let k = knobs(&["--profile", "busy", "--long-jobs", "8s-20s"]);
        let run = Duration::from_secs(60);
        let plan = plan::plan_jobs(20260503, run, &k);
        // The last end within half of the longest.
        long_jobs_fill_every_slot(&plan, run, &k, 8_000..=20_000, 10_000);
        for bad in ["20s-8s", "500ms-2s", "8s", "8-20"] {
            assert!(parse_range(bad).is_err(), "{bad}");
        }
        let default = Args::try_parse_from(["soak", "--long-jobs", "8s-20s"]).unwrap();
        assert!(
            default.knobs().is_err(),
            "the default profile plans no long jobs"
        );
    }

    #[test]
    fn busy_fills_every_slot_with_long_jobs_and_plans_a_few_poison_jobs() {
        let k = knobs(&["--profile", "busy"]);
        let run = Duration::from_secs(70);
        let plan = plan::plan_jobs(20260503, run, &k);
        assert!(plan.windows(2).all(|w| w[0].at_ms <= w[1].at_ms));
        assert_eq!(k.slots(), 14);
        long_jobs_fill_every_slot(&plan, run, &k, 20_000..=60_000, 30_000);
        let poison: Vec<_> = plan.iter().filter(|j| j.kind == "crash").collect();
        assert_eq!(poison.len(), 2);
        assert!(poison
            .iter()
            .all(|j| j.expect == Expect::Poison && (5_000..=35_000).contains(&j.at_ms)));
        // The mix is there, at its lower rate.
        assert!(plan.iter().any(|j| j.kind == "research"));
        // Kill -9 of workers especially.
        let faults = plan::faults(20260503, Duration::from_secs(600), &shape(&k, &[]));
        let first: Vec<&str> = faults.iter().take(10).map(|s| s.fault.name()).collect();
        let kills = first
            .iter()
            .filter(|n| n.starts_with("kill9_worker"))
            .count();
        assert_eq!(kills, 4, "{first:?}");
        assert!(faults.iter().all(|s| (5_000..=15_000).contains(&s.gap_ms)));
    }

    #[test]
    fn nats_restart_keeps_the_server_down_past_the_session_timeout() {
        let k = knobs(&["--profile", "nats-restart"]);
        let faults = plan::faults(11, Duration::from_secs(300), &shape(&k, &[]));
        assert!(faults.len() > 5);
        let mut kinds = std::collections::BTreeSet::new();
        for s in &faults {
            let Fault::NatsRestart { graceful, down_ms } = s.fault else {
                panic!("{:?}", s.fault);
            };
            kinds.insert(graceful);
            assert!((6_000..=9_000).contains(&down_ms), "{down_ms}");
        }
        assert_eq!(kinds.len(), 2);
        assert!(!k.cluster);
        let plan = plan::plan_jobs(11, Duration::from_secs(300), &k);
        assert!(plan.iter().any(|j| long_job(&j.id)));
        assert!(!plan.iter().any(|j| j.kind == "crash"));
    }

    #[test]
    fn rolling_restarts_every_node_once_per_fault() {
        let k = knobs(&["--profile", "rolling"]);
        assert!(k.cluster);
        let faults = plan::faults(12, Duration::from_secs(300), &shape(&k, &[]));
        assert!(!faults.is_empty());
        for s in &faults {
            let Fault::RollingRestart { nodes, .. } = &s.fault else {
                panic!("{:?}", s.fault);
            };
            let mut n = nodes.clone();
            n.sort_unstable();
            assert_eq!(n, vec![0, 1, 2]);
        }
    }

    #[test]
    fn the_command_line_wins_over_the_profile() {
        let k = knobs(&["--profile", "busy", "--concurrency", "3", "--workers", "5"]);
        assert_eq!(k.slots(), 15);
        assert!(k.poison);
        assert!(
            Args::parse_from(["leasehold-soak", "--profile", "nats-restart", "--cluster"])
                .knobs()
                .is_err()
        );
    }
}
