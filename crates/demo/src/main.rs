//! `leasehold-demo`: the offline demo behind `make demo`.
//!
//! Starts a local nats-server (unless `NATS_URL` answers) with its storage
//! under `.demo/`, creates the layout, starts a small fleet of
//! `leasehold-worker` processes (and `leasehold-reaper` when built), submits a
//! batch of jobs, then injects the faults the system exists for: one worker is
//! killed with SIGKILL mid-job (and restarted under the same identity), another
//! is frozen with SIGSTOP past its lease and then resumed. It shows live
//! progress, prints a summary, checks the invariants on the job records'
//! histories, tears down only what it started, and exits non-zero if an
//! invariant failed.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};
use leasehold_core::JobRecord;
use leasehold_harness::{bin_dir, NatsServer, Proc};
use leasehold_store::setup::{self, SetupOptions};
use leasehold_store::work::Work;
use leasehold_store::{Jobs, NatsArgs};
use serde_json::json;

#[derive(Parser, Debug)]
#[command(
    name = "leasehold-demo",
    version,
    about = "Run leasehold's offline demo: a local NATS server, a worker fleet, injected crashes and pauses, checked invariants"
)]
struct Args {
    /// Jobs to submit.
    #[arg(long, default_value_t = 24)]
    jobs: usize,
    /// Worker processes.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// Where the local server's storage and the logs go.
    #[arg(long, default_value = ".demo")]
    state_dir: PathBuf,
    /// Lease of the demo workers (short, so recoveries show within seconds).
    #[arg(long, default_value = "3s", value_parser = leasehold_core::time::parse_duration)]
    lease: Duration,
    /// Give up waiting for the jobs after this long.
    #[arg(long, default_value = "120s", value_parser = leasehold_core::time::parse_duration)]
    timeout: Duration,
}

struct Fleet {
    procs: Vec<Proc>,
}

#[tokio::main]
async fn main() {
    match run(Args::parse()).await {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("demo error: {e:#}");
            std::process::exit(2);
        }
    }
}

fn say(s: impl AsRef<str>) {
    eprintln!("demo: {}", s.as_ref());
}

async fn run(a: Args) -> anyhow::Result<bool> {
    let logs = a.state_dir.join("logs");
    std::fs::create_dir_all(&logs)?;
    // Use the user's NATS when it answers; otherwise start our own.
    let external = std::env::var("NATS_URL").ok();
    let mut server = None;
    let url = match &external {
        Some(u) if async_nats::connect(u.as_str()).await.is_ok() => {
            say(format!("using the NATS server at {u}"));
            u.clone()
        }
        _ => {
            let s = NatsServer::start_in(&a.state_dir.join("nats"));
            say(format!(
                "started nats-server at {} (storage {})",
                s.url(),
                a.state_dir.join("nats").display()
            ));
            let u = s.url();
            server = Some(s);
            u
        }
    };
    leasehold_harness::wait_for_jetstream(&url, Duration::from_secs(20)).await;
    let nats = NatsArgs {
        url: url.clone(),
        ..NatsArgs::default()
    };
    let conn = nats.connect("leasehold-demo").await?;
    setup::ensure(
        &conn,
        &SetupOptions {
            ack_wait: Duration::from_secs(2),
            ..SetupOptions::default()
        },
    )
    .await
    .context("leasehold setup")?;
    say("layout ready (streams LH_WORK, LH_EVENTS, LH_DLQ; buckets lh_jobs, lh_effects, lh_artifacts)");

    let lease_ms = a.lease.as_millis();
    let env = |id: &str| -> Vec<(&'static str, String)> {
        vec![
            ("NATS_URL", url.clone()),
            ("LH_WORKER_ID", id.to_string()),
            ("LH_LEASE", format!("{lease_ms}ms")),
            ("LH_HEARTBEAT", format!("{}ms", lease_ms / 3)),
            ("LH_PULL_EXPIRES", "500ms".into()),
            ("LH_DRAIN_TIMEOUT", "1s".into()),
            ("LH_CONCURRENCY", "4".into()),
            ("LH_KINDS", "echo,sleep,fail".into()),
            ("RUST_LOG", "info".into()),
        ]
    };
    let mut fleet = Fleet { procs: Vec::new() };
    let mut reaper = None;
    if bin_dir().join("leasehold-reaper").is_file() {
        reaper = Some(Proc::spawn_logged(
            "leasehold-reaper",
            &[],
            &[
                ("NATS_URL", url.clone()),
                ("LH_INTERVAL", "2s".into()),
                ("RUST_LOG", "info".into()),
            ],
            Some(logs.join("reaper.log")),
        ));
        say("started leasehold-reaper");
    }
    for i in 1..=a.workers {
        let id = format!("demo-w{i}");
        fleet.procs.push(Proc::spawn_logged(
            "leasehold-worker",
            &[],
            &env(&id),
            Some(logs.join(format!("{id}.log"))),
        ));
    }
    say(format!(
        "started {} workers (lease {:?}; logs in {})",
        a.workers,
        a.lease,
        logs.display()
    ));

    let run_id = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let work = Work::new(&conn);
    let jobs = Jobs::open(&conn).await?;
    let mut ids = Vec::new();
    for n in 0..a.jobs {
        let id = format!("demo-{run_id}-{n:02}");
        let (kind, spec) = match n % 4 {
            0 => ("echo", json!({"input": {"n": n}})),
            1 => ("fail", json!({"input": {"class": "retryable", "times": 1}})),
            _ => (
                "sleep",
                json!({"input": {"ms": 1500 + 250 * (n % 6) as u64}}),
            ),
        };
        work.submit(kind, spec.to_string().into(), Some(&id), None)
            .await?;
        ids.push(id);
    }
    say(format!(
        "submitted {} jobs (echo, sleep, fail-once)",
        ids.len()
    ));

    let bar = ProgressBar::new(ids.len() as u64);
    bar.set_style(
        ProgressStyle::with_template("{elapsed_precise} [{bar:30}] {pos}/{len} {msg}")?
            .progress_chars("=> "),
    );
    let start = Instant::now();
    let mut killed = None;
    let mut paused: Option<(usize, Instant)> = None;
    let mut resumed = false;
    loop {
        let recs = snapshot(&jobs, &ids).await?;
        let mut by: BTreeMap<&str, usize> = BTreeMap::new();
        for r in recs.values() {
            *by.entry(r.status.as_str()).or_default() += 1;
        }
        let done = recs.values().filter(|r| terminal(r)).count();
        let reclaims: u32 = recs.values().map(|r| r.stale_reclaims).sum();
        bar.set_position(done as u64);
        bar.set_message(format!("{by:?} reclaims={reclaims}"));
        // Fault 1: SIGKILL a worker while it runs a job, then restart it
        // under the same identity (it reclaims its jobs at once).
        if killed.is_none() {
            if let Some(r) = recs.values().find(|r| {
                r.status == "running"
                    && r.worker_id.as_deref() == Some("demo-w1")
                    && r.kind == "sleep"
            }) {
                fleet.procs[0].kill9();
                bar.println(format!("fault: SIGKILL demo-w1 while it ran {}", r.id));
                killed = Some(r.id.clone());
                fleet.procs[0] = Proc::spawn_logged(
                    "leasehold-worker",
                    &[],
                    &env("demo-w1"),
                    Some(logs.join("demo-w1.restarted.log")),
                );
                bar.println("fault: restarted demo-w1 (same identity: reclaims its jobs without waiting for the lease)");
            }
        }
        // Fault 2: freeze another worker past its lease, then resume it.
        if paused.is_none() && a.workers > 1 {
            if let Some(r) = recs
                .values()
                .find(|r| r.status == "running" && r.worker_id.as_deref() == Some("demo-w2"))
            {
                fleet.procs[1].stop();
                bar.println(format!(
                    "fault: SIGSTOP demo-w2 while it ran {} (for lease + 2s)",
                    r.id
                ));
                paused = Some((1, Instant::now()));
            }
        }
        if let Some((i, at)) = paused {
            if !resumed && at.elapsed() > a.lease + Duration::from_secs(2) {
                fleet.procs[i].cont();
                resumed = true;
                bar.println("fault: SIGCONT demo-w2; its stale writes must all be refused");
            }
        }
        if done == ids.len() && (paused.is_none() || resumed) {
            break;
        }
        if start.elapsed() > a.timeout {
            bar.println("timeout: not every job finished");
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    bar.finish_and_clear();

    // Summary and invariants.
    let recs = snapshot(&jobs, &ids).await?;
    let mut failures = Vec::new();
    println!(
        "{:<22} {:<6} {:<10} {:>8} {:>6} {:>8}  WORKER",
        "JOB", "KIND", "STATUS", "ATTEMPTS", "EPOCH", "RECLAIMS"
    );
    for id in &ids {
        let r = &recs[id];
        println!(
            "{:<22} {:<6} {:<10} {:>8} {:>6} {:>8}  {}",
            r.id,
            r.kind,
            r.status,
            r.attempts,
            r.epoch,
            r.stale_reclaims,
            r.worker_id.clone().unwrap_or_default()
        );
        if r.status != "completed" {
            failures.push(format!("{id} ended {} ({:?})", r.status, r.error));
        }
        let history = jobs.history(id).await?;
        let completions = history
            .iter()
            .filter(|v| v.value.status == "completed")
            .count();
        if completions != 1 {
            failures.push(format!(
                "{id}: {completions} completions in its history (must be exactly 1)"
            ));
        }
        let mut max_epoch = 0;
        for v in &history {
            if v.value.epoch < max_epoch {
                failures.push(format!(
                    "{id}: a write of epoch {} landed after epoch {max_epoch} claimed it",
                    v.value.epoch
                ));
            }
            max_epoch = max_epoch.max(v.value.epoch);
        }
    }
    let reclaims: u32 = recs.values().map(|r| r.stale_reclaims).sum();
    let retried = recs.values().filter(|r| r.attempts > 0).count();
    println!();
    println!("jobs: {}  completed: {}  reclaimed after a crash/pause: {reclaims}  job-level retries: {retried}  time: {:.1}s", ids.len(), recs.values().filter(|r| r.status == "completed").count(), start.elapsed().as_secs_f64());
    if killed.is_none() {
        failures.push("the kill fault never fired (no job ran on demo-w1)".into());
    }
    if reclaims == 0 {
        failures.push("no job was reclaimed: the faults did not exercise recovery".into());
    }
    println!("read any result with: target/debug/leasehold result <job id>   (NATS_URL={url})");

    // Tear down only what we started.
    for p in fleet.procs.iter_mut() {
        p.cont();
        p.term();
    }
    for p in fleet.procs.iter_mut() {
        if p.wait_timeout(Duration::from_secs(10)).is_none() {
            p.kill9();
        }
    }
    if let Some(mut r) = reaper {
        r.term();
        let _ = r.wait_timeout(Duration::from_secs(5));
    }
    drop(server);
    if failures.is_empty() {
        println!("invariants: OK (every job completed exactly once; no stale write landed)");
        Ok(true)
    } else {
        println!("invariants FAILED:");
        for f in &failures {
            println!("  - {f}");
        }
        Ok(false)
    }
}

fn terminal(r: &JobRecord) -> bool {
    r.status
        .parse::<leasehold_core::Status>()
        .is_ok_and(|s| s.is_terminal() || s == leasehold_core::Status::Parked)
}

async fn snapshot(jobs: &Jobs, ids: &[String]) -> anyhow::Result<BTreeMap<String, JobRecord>> {
    let mut out = BTreeMap::new();
    for id in ids {
        let r = jobs
            .get(id)
            .await?
            .map(|v| v.value)
            .unwrap_or_else(|| JobRecord {
                id: id.clone(),
                status: "submitted".into(),
                ..Default::default()
            });
        out.insert(id.clone(), r);
    }
    Ok(out)
}
