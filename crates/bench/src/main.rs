//! `leasehold-bench`: whole-system figures on one fresh nats-server, each
//! compared with a baseline measured in the same run (the machine is noisy).
//!
//! 1. Ceiling: revision-conditioned KV updates per second (64 writers on
//!    distinct keys), the raw rate leasehold's writes are made of.
//! 2. Trivial (`echo`) jobs completed per second through 1, 2 and 4 worker
//!    processes, with KV writes and stream publishes per job, against
//!    ceiling ÷ KV writes per job.
//! 3. Recovery latency after SIGKILL of the owner (p50/p95) against the lease.
//! 4. Handoff latency after SIGTERM (p50/p95).
//! 5. 1,000 in-flight `sleep` jobs on one worker process with a short lease:
//!    lease expiries of live jobs (must be zero) and the worker's peak RSS.
//!
//! Writes `<out>/bench.json` and prints a table.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use futures::StreamExt;
use leasehold_harness::{wait_for_jetstream, NatsServer, Proc};
use leasehold_store::setup::{self, SetupOptions};
use leasehold_store::work::Work;
use leasehold_store::{Conn, Jobs, NatsArgs};
use serde_json::{json, Value};

#[derive(Parser, Debug)]
#[command(
    name = "leasehold-bench",
    about = "leasehold benchmarks: CAS ceiling, throughput, recovery, handoff, 1,000 in flight"
)]
struct Args {
    /// Output directory for bench.json.
    #[arg(long, default_value = "bench-results")]
    out: PathBuf,
    /// Trivial jobs per throughput run.
    #[arg(long, default_value_t = 2000)]
    jobs: usize,
    /// Kill -9 / SIGTERM repetitions for the latency figures.
    #[arg(long, default_value_t = 8)]
    reps: usize,
    /// In-flight sleep jobs on one worker.
    #[arg(long, default_value_t = 1000)]
    inflight: usize,
}

const LEASE_MS: u64 = 2000;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    std::fs::create_dir_all(&a.out)?;
    let mut report = serde_json::Map::new();

    let ceiling = cas_ceiling().await?;
    eprintln!("ceiling: {ceiling:.0} CAS updates/s");
    report.insert("kv_cas_ceiling_per_s".into(), json!(ceiling));

    let mut tp = Vec::new();
    for workers in [1usize, 2, 4] {
        let r = throughput(workers, a.jobs).await?;
        eprintln!("throughput with {workers} worker(s): {:.0} jobs/s ({:.1} KV writes, {:.1} event publishes per job)", r["jobs_per_s"].as_f64().unwrap(), r["kv_writes_per_job"].as_f64().unwrap(), r["event_publishes_per_job"].as_f64().unwrap());
        tp.push(r);
    }
    let w4 = &tp[2];
    let writes = w4["kv_writes_per_job"].as_f64().unwrap_or(1.0).max(1.0);
    let target = 0.4 * ceiling / writes;
    report.insert("throughput".into(), Value::Array(tp.clone()));
    report.insert(
        "throughput_target_4_workers".into(),
        json!({"jobs_per_s_min": target, "met": w4["jobs_per_s"].as_f64().unwrap() >= target}),
    );

    let rec = recovery(a.reps).await?;
    eprintln!("recovery after kill -9: {rec}");
    report.insert("recovery_after_kill9_ms".into(), rec);
    let ho = handoff(a.reps).await?;
    eprintln!("handoff after SIGTERM: {ho}");
    report.insert("handoff_after_sigterm_ms".into(), ho);
    let inf = inflight(a.inflight).await?;
    eprintln!("in flight: {inf}");
    report.insert("inflight".into(), inf);

    let path = a.out.join("bench.json");
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&Value::Object(report.clone()))?,
    )?;
    println!("{:<44} {:>14}", "figure", "value");
    println!(
        "{:<44} {:>14.0}",
        "KV CAS ceiling (updates/s, 64 writers)", ceiling
    );
    for r in &tp {
        println!(
            "{:<44} {:>14.0}",
            format!("echo jobs/s, {} worker(s)", r["workers"]),
            r["jobs_per_s"].as_f64().unwrap()
        );
    }
    println!("{:<44} {:>14.1}", "KV writes per job", writes);
    println!(
        "{:<44} {:>14.1}",
        "event publishes per job",
        w4["event_publishes_per_job"].as_f64().unwrap()
    );
    println!(
        "{:<44} {:>14.0}",
        "target 4-worker jobs/s (40% of ceiling/writes)", target
    );
    for (k, name) in [
        ("recovery_after_kill9_ms", "recovery after kill -9"),
        ("handoff_after_sigterm_ms", "handoff after SIGTERM"),
    ] {
        println!(
            "{:<44} {:>14}",
            format!("{name} p50/p95 ms"),
            format!("{}/{}", report[k]["p50"], report[k]["p95"])
        );
    }
    println!(
        "{:<44} {:>14}",
        "lease expiries at 1,000 in flight", report["inflight"]["lease_expiries"]
    );
    println!(
        "{:<44} {:>14}",
        "worker peak RSS MiB at 1,000 in flight", report["inflight"]["peak_rss_mib"]
    );
    println!("results: {}", path.display());
    Ok(())
}

async fn server(o: SetupOptions) -> anyhow::Result<(NatsServer, Conn)> {
    let s = NatsServer::start();
    wait_for_jetstream(&s.url(), Duration::from_secs(10)).await;
    let conn = NatsArgs::local(s.url(), "lh").connect("bench").await?;
    setup::ensure(&conn, &o).await?;
    Ok((s, conn))
}

async fn cas_ceiling() -> anyhow::Result<f64> {
    let (_s, conn) = server(SetupOptions::default()).await?;
    let kv = conn.js.get_key_value("lh_jobs").await?;
    let mut tasks = Vec::new();
    let dur = Duration::from_secs(3);
    for t in 0..64 {
        let kv = kv.clone();
        tasks.push(tokio::spawn(async move {
            let key = format!("cas-{t}");
            let mut rev = kv.put(&key, "0".into()).await.unwrap();
            let t0 = Instant::now();
            let mut n = 0u64;
            while t0.elapsed() < dur {
                rev = kv.update(&key, "x".into(), rev).await.unwrap();
                n += 1;
            }
            n
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await?;
    }
    Ok(total as f64 / dur.as_secs_f64())
}

fn worker_env(url: &str, extra: &[(&'static str, String)]) -> Vec<(&'static str, String)> {
    let mut e = vec![
        ("NATS_URL", url.to_string()),
        ("LH_LEASE", format!("{LEASE_MS}ms")),
        ("LH_HEARTBEAT", "600ms".into()),
        ("LH_PULL_EXPIRES", "250ms".into()),
        ("LH_DRAIN_TIMEOUT", "0s".into()),
        ("LH_KINDS", "echo,sleep".into()),
        ("RUST_LOG", "warn".into()),
    ];
    e.extend(extra.iter().cloned());
    e
}

async fn stream_msgs(conn: &Conn, name: &str) -> anyhow::Result<u64> {
    Ok(conn.js.get_stream(name).await?.info().await?.state.messages)
}

/// Publishes `n` echo jobs and waits until all are completed (on a KV watch).
async fn run_batch(conn: &Conn, n: usize, tag: &str) -> anyhow::Result<Duration> {
    let jobs = Jobs::open(conn).await?;
    let mut watch = jobs.watch_all().await?;
    let work = Work::new(conn);
    let t0 = Instant::now();
    let js = conn.js.clone();
    let mut acks = Vec::with_capacity(n);
    for i in 0..n {
        let id = format!("{tag}-{i}");
        let m = async_nats::jetstream::message::PublishMessage::build()
            .payload(r#"{"input":{}}"#.into())
            .message_id(id);
        acks.push(js.send_publish("lh.submit.echo", m).await?);
    }
    for a in acks {
        a.await?;
    }
    drop(work);
    let mut done = std::collections::HashSet::new();
    while done.len() < n {
        let e = tokio::time::timeout(Duration::from_secs(120), watch.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("watch ended"))??;
        if e.key.starts_with(tag)
            && std::str::from_utf8(&e.value).is_ok_and(|v| v.contains("\"status\":\"completed\""))
        {
            done.insert(e.key.clone());
        }
    }
    Ok(t0.elapsed())
}

async fn throughput(workers: usize, n: usize) -> anyhow::Result<Value> {
    let (s, conn) = server(SetupOptions {
        ack_wait: Duration::from_secs(5),
        ..SetupOptions::default()
    })
    .await?;
    let procs: Vec<Proc> = (0..workers)
        .map(|_| {
            Proc::spawn(
                "leasehold-worker",
                &[],
                &worker_env(&s.url(), &[("LH_CONCURRENCY", "64".into())]),
            )
        })
        .collect();
    // Warm up: the workers are connected and pulling once one job completes.
    run_batch(&conn, workers * 4, "warm").await?;
    let kv0 = stream_msgs(&conn, "KV_lh_jobs").await?;
    let ev0 = stream_msgs(&conn, "LH_EVENTS").await?;
    let took = run_batch(&conn, n, "tp").await?;
    let kv1 = stream_msgs(&conn, "KV_lh_jobs").await?;
    let ev1 = stream_msgs(&conn, "LH_EVENTS").await?;
    drop(procs);
    Ok(json!({
        "workers": workers,
        "jobs": n,
        "seconds": took.as_secs_f64(),
        "jobs_per_s": n as f64 / took.as_secs_f64(),
        "kv_writes_per_job": (kv1 - kv0) as f64 / n as f64,
        "event_publishes_per_job": (ev1 - ev0) as f64 / n as f64,
    }))
}

fn percentiles(mut v: Vec<f64>) -> Value {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let p = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    json!({"n": v.len(), "p50": p(0.5).round(), "p95": p(0.95).round(), "max": v.last().copied().unwrap_or(0.0).round(), "lease_ms": LEASE_MS})
}

/// Waits until the job's record satisfies `pred`; returns when it was seen.
async fn wait_record(
    jobs: &Jobs,
    id: &str,
    pred: impl Fn(&leasehold_core::JobRecord) -> bool,
) -> anyhow::Result<Instant> {
    let mut w = jobs.watch(id).await?;
    loop {
        let e = tokio::time::timeout(Duration::from_secs(60), w.next())
            .await?
            .ok_or_else(|| anyhow::anyhow!("watch ended"))??;
        if let Ok(r) = leasehold_store::jobs::decode(id, &e.value) {
            if pred(&r) {
                return Ok(Instant::now());
            }
        }
    }
}

/// Kill -9 (or SIGTERM) the owner of a running job; time until another worker owns it.
async fn takeover(reps: usize, term: bool) -> anyhow::Result<Value> {
    let (s, conn) = server(SetupOptions {
        ack_wait: Duration::from_secs(1),
        ..SetupOptions::default()
    })
    .await?;
    let jobs = Jobs::open(&conn).await?;
    let work = Work::new(&conn);
    let mut samples = Vec::new();
    for i in 0..reps {
        let mut a = Proc::spawn(
            "leasehold-worker",
            &[],
            &worker_env(
                &s.url(),
                &[
                    ("LH_WORKER_ID", format!("victim-{i}")),
                    ("LH_KINDS", "sleep".into()),
                ],
            ),
        );
        let id = format!("take-{i}");
        // Only the victim runs until it holds the job; then the rescuer starts.
        work.submit(
            "sleep",
            json!({"input": {"ms": 60000}}).to_string().into(),
            Some(&id),
            None,
        )
        .await?;
        let victim = format!("victim-{i}");
        wait_record(&jobs, &id, |r| {
            r.status == "running" && r.worker_id.as_deref() == Some(victim.as_str())
        })
        .await?;
        let mut c = Proc::spawn(
            "leasehold-worker",
            &[],
            &worker_env(
                &s.url(),
                &[
                    ("LH_WORKER_ID", format!("rescuer-{i}")),
                    ("LH_KINDS", "sleep".into()),
                ],
            ),
        );
        tokio::time::sleep(Duration::from_millis(300)).await; // let the rescuer connect before the fault
        let t0 = Instant::now();
        if term {
            a.term();
        } else {
            a.kill9();
        }
        let rescuer = format!("rescuer-{i}");
        let t1 = wait_record(&jobs, &id, |r| {
            r.status == "running" && r.worker_id.as_deref() == Some(rescuer.as_str())
        })
        .await?;
        samples.push((t1 - t0).as_secs_f64() * 1000.0);
        c.kill9();
        let _ = a.wait_timeout(Duration::from_secs(5));
    }
    Ok(percentiles(samples))
}

async fn recovery(reps: usize) -> anyhow::Result<Value> {
    takeover(reps, false).await
}

async fn handoff(reps: usize) -> anyhow::Result<Value> {
    takeover(reps, true).await
}

fn rss_mib(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

async fn inflight(n: usize) -> anyhow::Result<Value> {
    let (s, conn) = server(SetupOptions {
        ack_wait: Duration::from_secs(3),
        ..SetupOptions::default()
    })
    .await?;
    let w = Proc::spawn(
        "leasehold-worker",
        &[],
        &worker_env(
            &s.url(),
            &[
                ("LH_CONCURRENCY", n.to_string()),
                ("LH_LEASE", "3s".into()),
                ("LH_HEARTBEAT", "1s".into()),
            ],
        ),
    );
    let jobs = Jobs::open(&conn).await?;
    let js = conn.js.clone();
    let mut acks = Vec::new();
    for i in 0..n {
        let m = async_nats::jetstream::message::PublishMessage::build()
            .payload(r#"{"input":{"ms":10000}}"#.into())
            .message_id(format!("inf-{i}"));
        acks.push(js.send_publish("lh.submit.sleep", m).await?);
    }
    for a in acks {
        a.await?;
    }
    let t0 = Instant::now();
    let mut peak_running = 0usize;
    // Sample while they run: every job must stay at epoch 1 (no lease expired).
    let mut completed = 0;
    while t0.elapsed() < Duration::from_secs(60) {
        let all = jobs.all().await?;
        let running = all.iter().filter(|v| v.value.status == "running").count();
        completed = all.iter().filter(|v| v.value.status == "completed").count();
        peak_running = peak_running.max(running);
        if completed == n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let all = jobs.all().await?;
    let expiries = all
        .iter()
        .filter(|v| v.value.stale_reclaims > 0 || v.value.epoch > 1)
        .count();
    let rss = rss_mib(w.pid());
    let budget = 64.0 + 64.0 * n as f64 / 1024.0;
    Ok(json!({
        "jobs": n,
        "completed": completed,
        "peak_running": peak_running,
        "lease_expiries": expiries,
        "peak_rss_mib": (rss * 10.0).round() / 10.0,
        "rss_budget_mib": budget,
        "rss_met": rss <= budget,
        "seconds": t0.elapsed().as_secs_f64(),
    }))
}
