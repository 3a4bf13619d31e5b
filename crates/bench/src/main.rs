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
//! 6. Research jobs against `leasehold-sim` with an instant model (no token
//!    delay): expert sections per second through one worker process; the
//!    flusher's checkpoint latency (queued → acked by the server, p50/p99)
//!    and coalescing (progress updates per durable progress write), read from
//!    each completed record's `result.output.checkpoints`; and rework per
//!    crash: model calls (counted at the simulator) a crashed job makes beyond
//!    a clean run of the same input, after an abort at a section checkpoint
//!    and after a kill -9 at an arbitrary point mid-expert, against the seed's
//!    baseline of restarting the in-flight section (its model calls).
//!
//! Writes `<out>/bench.json` and prints a table. `--only` runs some parts.

use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::Parser;
use futures::StreamExt;
use leasehold_core::JobRecord;
use leasehold_harness::{wait_for_jetstream, NatsServer, Proc};
use leasehold_store::events::Events;
use leasehold_store::setup::{self, SetupOptions};
use leasehold_store::work::Work;
use leasehold_store::{Conn, Jobs, NatsArgs};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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
    /// Research jobs in the sections-per-second batch.
    #[arg(long, default_value_t = 8)]
    research_jobs: usize,
    /// Crashes of each kind (abort at a checkpoint, kill -9) for rework.
    #[arg(long, default_value_t = 4)]
    crash_reps: usize,
    /// kill -9 crashes against a paced model (`--paced-token-ms` per
    /// streamed token), where model calls take real time.
    #[arg(long, default_value_t = 3)]
    paced_reps: usize,
    /// The paced model's delay per streamed token (the simulator's default).
    #[arg(long, default_value_t = 2)]
    paced_token_ms: u64,
    /// Run only these parts (comma-separated): ceiling, throughput,
    /// recovery, handoff, inflight, research. All by default.
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
}

impl Args {
    fn runs(&self, part: &str) -> bool {
        self.only.is_empty() || self.only.iter().any(|p| p == part)
    }
}

/// The research input of every research job here: small, so a crash run
/// stays a few seconds, but with several sections per expert so a crash can
/// land mid-expert.
const EXPERTS: u64 = 3;
const SECTIONS: u64 = 4;

const LEASE_MS: u64 = 2000;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a = Args::parse();
    std::fs::create_dir_all(&a.out)?;
    let mut report = serde_json::Map::new();
    // (figure, value) rows of the printed table, in run order.
    let mut rows: Vec<(String, String)> = Vec::new();

    let mut ceiling = None;
    if a.runs("ceiling") {
        let c = cas_ceiling().await?;
        eprintln!("ceiling: {c:.0} CAS updates/s");
        report.insert("kv_cas_ceiling_per_s".into(), json!(c));
        rows.push((
            "KV CAS ceiling (updates/s, 64 writers)".into(),
            format!("{c:.0}"),
        ));
        ceiling = Some(c);
    }

    if a.runs("throughput") {
        let mut tp = Vec::new();
        for workers in [1usize, 2, 4] {
            let r = throughput(workers, a.jobs).await?;
            eprintln!("throughput with {workers} worker(s): {:.0} jobs/s ({:.1} KV writes, {:.1} event publishes per job)", r["jobs_per_s"].as_f64().unwrap(), r["kv_writes_per_job"].as_f64().unwrap(), r["event_publishes_per_job"].as_f64().unwrap());
            rows.push((
                format!("echo jobs/s, {workers} worker(s)"),
                format!("{:.0}", r["jobs_per_s"].as_f64().unwrap()),
            ));
            tp.push(r);
        }
        let w4 = &tp[2];
        let writes = w4["kv_writes_per_job"].as_f64().unwrap_or(1.0).max(1.0);
        rows.push(("KV writes per job".into(), format!("{writes:.1}")));
        rows.push((
            "event publishes per job".into(),
            format!("{:.1}", w4["event_publishes_per_job"].as_f64().unwrap()),
        ));
        if let Some(c) = ceiling {
            let target = 0.4 * c / writes;
            report.insert(
                "throughput_target_4_workers".into(),
                json!({"jobs_per_s_min": target, "met": w4["jobs_per_s"].as_f64().unwrap() >= target}),
            );
            rows.push((
                "target 4-worker jobs/s (40% of ceiling/writes)".into(),
                format!("{target:.0}"),
            ));
        }
        report.insert("throughput".into(), Value::Array(tp));
    }

    for (part, key, name, term) in [
        (
            "recovery",
            "recovery_after_kill9_ms",
            "recovery after kill -9",
            false,
        ),
        (
            "handoff",
            "handoff_after_sigterm_ms",
            "handoff after SIGTERM",
            true,
        ),
    ] {
        if a.runs(part) {
            let v = takeover(a.reps, term).await?;
            eprintln!("{name}: {v}");
            rows.push((
                format!("{name} p50/p95 ms"),
                format!("{}/{}", v["p50"], v["p95"]),
            ));
            report.insert(key.into(), v);
        }
    }

    if a.runs("inflight") {
        let inf = inflight(a.inflight).await?;
        eprintln!("in flight: {inf}");
        rows.push((
            format!("lease expiries at {} in flight", a.inflight),
            inf["lease_expiries"].to_string(),
        ));
        rows.push((
            format!("worker peak RSS MiB at {} in flight", a.inflight),
            inf["peak_rss_mib"].to_string(),
        ));
        report.insert("inflight".into(), inf);
    }

    if a.runs("research") {
        let r = research(&a).await?;
        eprintln!("research: {r}");
        rows.extend(research_rows(&r));
        report.insert("research".into(), r);
    }

    let path = a.out.join("bench.json");
    std::fs::write(&path, serde_json::to_string_pretty(&Value::Object(report))?)?;
    let w = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0).max(44);
    println!("{:<w$} {:>14}", "figure", "value");
    for (k, v) in rows {
        println!("{k:<w$} {v:>14}");
    }
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
        ("LH_SESSION_TIMEOUT", format!("{LEASE_MS}ms")),
        ("LH_PULL_EXPIRES", "250ms".into()),
        ("LH_DRAIN_TIMEOUT", "0s".into()),
        ("LH_KINDS", "echo,sleep".into()),
        // The bench's kinds are test kinds: served only when allowed.
        ("LH_DEV_KINDS", "1".into()),
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
    pred: impl Fn(&JobRecord) -> bool,
) -> anyhow::Result<Instant> {
    Ok(wait_rec(jobs, id, pred).await?.0)
}

/// Like [`wait_record`], also returning the record that satisfied `pred`.
async fn wait_rec(
    jobs: &Jobs,
    id: &str,
    pred: impl Fn(&JobRecord) -> bool,
) -> anyhow::Result<(Instant, JobRecord)> {
    let mut w = jobs.watch(id).await?;
    loop {
        let e = tokio::time::timeout(Duration::from_secs(60), w.next())
            .await
            .map_err(|_| anyhow::anyhow!("{id}: no awaited record change within 60 s"))?
            .ok_or_else(|| anyhow::anyhow!("watch ended"))??;
        if let Ok(r) = leasehold_store::jobs::decode(id, &e.value) {
            if pred(&r) {
                return Ok((Instant::now(), r));
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
    let events = Events::new(&conn);
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
        .await
        .map_err(|e| anyhow::anyhow!("{e}: victim never ran it; victim log:\n{}", a.output()))?;
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
        .await
        .map_err(|e| {
            anyhow::anyhow!("{e}: rescuer never took over; rescuer log:\n{}", c.output())
        })?;
        samples.push((t1 - t0).as_secs_f64() * 1000.0);
        // Leave nothing running: a job abandoned by this rescuer would lose a
        // second worker, and the next rep's workers would run that suspect
        // alone (all their slots) for its whole minute.
        leasehold_store::jobs::cancel(&jobs, &events, &id).await;
        wait_record(&jobs, &id, |r| terminal(&r.status)).await?;
        c.kill9();
        let _ = a.wait_timeout(Duration::from_secs(5));
    }
    Ok(percentiles(samples))
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
                ("LH_SESSION_TIMEOUT", "3s".into()),
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
        let all = jobs.all().await?.records;
        let running = all.iter().filter(|v| v.value.status == "running").count();
        completed = all.iter().filter(|v| v.value.status == "completed").count();
        peak_running = peak_running.max(running);
        if completed == n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let all = jobs.all().await?.records;
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

// ---------------------------------------------------------------- research

/// `leasehold-sim` (model, search, pages, effects sink on one address).
struct Sim {
    _proc: Proc,
    addr: String,
}

impl Sim {
    /// `token_ms` 0 is an instant model: the figures are then leasehold's.
    async fn start(token_ms: u64) -> anyhow::Result<Sim> {
        let p = Proc::spawn(
            "leasehold-sim",
            &["--listen", "127.0.0.1:0"],
            &[("LH_SIM_TOKEN_DELAY_MS", token_ms.to_string())],
        );
        // The bound port is only printed: poll the log (start-up, no other signal).
        let deadline = Instant::now() + Duration::from_secs(10);
        let addr = loop {
            let out = p.output();
            if let Some(a) = out
                .split("listening on ")
                .nth(1)
                .and_then(|s| s.split_whitespace().next())
            {
                break a.trim_start_matches("http://").to_string();
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "leasehold-sim did not start:\n{out}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        Ok(Sim { _proc: p, addr })
    }

    async fn get(&self, path: &str) -> anyhow::Result<Value> {
        let mut s = tokio::net::TcpStream::connect(&self.addr).await?;
        s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {}\r\n\r\n", self.addr).as_bytes())
            .await?;
        let mut buf = String::new();
        s.read_to_string(&mut buf).await?;
        let body = buf.split_once("\r\n\r\n").map_or("", |(_, b)| b);
        serde_json::from_str(body).map_err(|e| anyhow::anyhow!("GET {path}: {e}: {buf}"))
    }

    /// Model calls served so far (every attempt's, crashed or not).
    async fn chat_requests(&self) -> anyhow::Result<u64> {
        self.get("/stats").await?["chat_requests"]
            .as_u64()
            .ok_or_else(|| anyhow::anyhow!("sim /stats without chat_requests"))
    }

    /// A research worker against this simulator.
    fn worker(&self, nats: &str, extra: &[(&'static str, String)]) -> Proc {
        let mut e = vec![
            ("LH_KINDS", "research".to_string()),
            ("LH_MODEL_BASE_URL", format!("http://{}/v1", self.addr)),
            ("LH_SEARCH_URL", format!("http://{}", self.addr)),
            ("LH_PUBLISH_URL", format!("http://{}/effects", self.addr)),
            ("LH_FETCH_ALLOW", "127.0.0.1".into()),
            ("LH_RESEARCH_RETRY_BASE", "20ms".into()),
            ("LH_RESEARCH_RETRY_CAP", "200ms".into()),
        ];
        e.extend(extra.iter().cloned());
        Proc::spawn("leasehold-worker", &[], &worker_env(nats, &e))
    }
}

async fn submit_research(work: &Work, id: &str) -> anyhow::Result<()> {
    let spec = json!({"input": {"topic": "lease-based ownership in distributed systems", "experts": EXPERTS, "sections": SECTIONS}});
    work.submit("research", spec.to_string().into(), Some(id), None)
        .await?;
    Ok(())
}

fn terminal(status: &str) -> bool {
    matches!(
        status,
        "completed" | "failed" | "parked" | "dead" | "cancelled" | "rejected"
    )
}

/// Waits for the job's terminal record; anything but `completed` is an error.
async fn completed(jobs: &Jobs, id: &str) -> anyhow::Result<JobRecord> {
    let (_, r) = wait_rec(jobs, id, |r| terminal(&r.status)).await?;
    anyhow::ensure!(r.status == "completed", "research job {id} ended {r:?}");
    Ok(r)
}

/// The payloads of the job's expert-section checkpoints, all epochs.
async fn section_payloads(events: &Events, id: &str) -> anyhow::Result<Vec<Value>> {
    Ok(events
        .read(id)
        .await?
        .into_iter()
        .filter(|(_, e)| e.r#type == "section")
        .filter_map(|(_, e)| serde_json::from_str::<Value>(&e.data).ok())
        .map(|d| d["payload"].clone())
        .collect())
}

fn f64_of(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

/// Runs the research figures on one nats-server and one simulator.
async fn research(a: &Args) -> anyhow::Result<Value> {
    let (n, reps) = (a.research_jobs, a.crash_reps);
    // A short ack wait: a crashed worker's ticket comes back to the rescuer soon.
    let (s, conn) = server(SetupOptions {
        ack_wait: Duration::from_secs(1),
        ..SetupOptions::default()
    })
    .await?;
    let url = s.url();
    let sim = Sim::start(0).await?;
    let jobs = Jobs::open(&conn).await?;
    let work = Work::new(&conn);
    let events = Events::new(&conn);
    let sections_per_job = (EXPERTS * SECTIONS) as f64;

    // Sections per second through one worker, and the flusher's figures of
    // every job of that batch (the flusher under load, not idle).
    let w = sim.worker(&url, &[("LH_WORKER_ID", "rs-tp".into())]);
    // Warm up: the worker is connected and pulling once one job completed.
    submit_research(&work, "rs-warm").await?;
    completed(&jobs, "rs-warm").await?;
    let mut watch = jobs.watch_all().await?;
    let t0 = Instant::now();
    for i in 0..n {
        submit_research(&work, &format!("rs-tp-{i}")).await?;
    }
    let mut recs: BTreeMap<String, JobRecord> = BTreeMap::new();
    while recs.len() < n {
        let e = tokio::time::timeout(Duration::from_secs(120), watch.next())
            .await
            .map_err(|_| anyhow::anyhow!("research batch: no progress within 120 s"))?
            .ok_or_else(|| anyhow::anyhow!("watch ended"))??;
        if !e.key.starts_with("rs-tp-") {
            continue;
        }
        if let Ok(r) = leasehold_store::jobs::decode(&e.key, &e.value) {
            if terminal(&r.status) {
                anyhow::ensure!(r.status == "completed", "research job ended {r:?}");
                recs.insert(e.key.clone(), r);
            }
        }
    }
    let took = t0.elapsed().as_secs_f64();
    drop(w);
    let (mut events_n, mut batches, mut updates, mut writes) = (0u64, 0u64, 0u64, 0u64);
    let (mut p50s, mut p99s, mut max_us) = (Vec::new(), Vec::new(), 0u64);
    for r in recs.values() {
        let out: Value = r
            .result
            .as_ref()
            .map(|x| serde_json::from_str(&x.output))
            .transpose()?
            .unwrap_or(Value::Null);
        let c = &out["checkpoints"];
        anyhow::ensure!(
            c.is_object(),
            "{}: no result.output.checkpoints (worker older than the bench?)",
            r.id
        );
        let u = |k: &str| c[k].as_u64().unwrap_or(0);
        events_n += u("events");
        batches += u("batches");
        updates += u("progress_updates");
        writes += u("progress_writes");
        let l = &c["flush_latency_us"];
        p50s.push(l["p50"].as_f64().unwrap_or(0.0));
        p99s.push(l["p99"].as_f64().unwrap_or(0.0));
        max_us = max_us.max(l["max"].as_u64().unwrap_or(0));
    }
    p50s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let ms = |us: f64| (us / 100.0).round() / 10.0;
    let throughput = json!({
        "worker_processes": 1,
        "jobs": n,
        "expert_sections": n as f64 * sections_per_job,
        "seconds": took,
        "sections_per_s_per_worker": n as f64 * sections_per_job / took,
        "jobs_per_s": n as f64 / took,
    });
    let checkpoints = json!({
        "jobs": n,
        "events": events_n,
        "batches": batches,
        "events_per_batch": events_n as f64 / batches.max(1) as f64,
        "progress_updates": updates,
        "progress_writes": writes,
        "coalescing_ratio": updates as f64 / writes.max(1) as f64,
        // Queued -> acked by the server, per event. Pooled across jobs from
        // per-job summaries: p50 is the median job's, p99 the worst job's
        // (an upper bound of the pooled p99).
        "flush_latency_ms": {
            "p50": ms(p50s[p50s.len() / 2]),
            "p99": ms(p99s.iter().copied().fold(0.0, f64::max)),
            "max": ms(max_us as f64),
        },
    });

    // Rework: a clean run's model calls, then crashed runs of the same input.
    // One expert at a time, so a crash interrupts at most one section (the
    // unit of the seed's baseline).
    let one = ("LH_RESEARCH_EXPERT_CONCURRENCY", "1".to_string());
    let w = sim.worker(&url, &[("LH_WORKER_ID", "rs-clean".into()), one.clone()]);
    let c0 = sim.chat_requests().await?;
    submit_research(&work, "rs-clean").await?;
    let clean = completed(&jobs, "rs-clean").await?;
    let clean_calls = sim.chat_requests().await? - c0;
    // The same figures for one job alone on its worker (the flusher idle
    // but for it): exact percentiles of that job's events.
    let alone: Value = clean
        .result
        .as_ref()
        .map(|x| serde_json::from_str(&x.output))
        .transpose()?
        .unwrap_or(Value::Null);
    let alone = &alone["checkpoints"];
    drop(w);
    let per_section: Vec<f64> = section_payloads(&events, "rs-clean")
        .await?
        .iter()
        .map(|p| p["model_calls"].as_f64().unwrap_or(0.0))
        .collect();
    // The seed restarts the in-flight section: all its model calls again.
    let baseline = mean(&per_section);

    let summarize = |runs: &[Value]| {
        let crashed: Vec<&Value> = runs.iter().filter(|r| r["crashed"] == true).collect();
        let rep: Vec<f64> = crashed
            .iter()
            .map(|r| r["repeated_calls"].as_f64().unwrap_or(0.0))
            .collect();
        let lost: Vec<f64> = crashed
            .iter()
            .filter_map(|r| r["victim_results_not_durable"].as_f64())
            .collect();
        let max = rep.iter().copied().fold(0.0, f64::max);
        json!({
            "crashes": crashed.len(),
            "repeated_calls_mean": mean(&rep),
            "repeated_calls_max": max,
            // Issue 5's goal: at most one model call repeated per in-flight section.
            "at_most_one_repeated_met": max <= 1.0,
            "results_not_durable_mean": (!lost.is_empty()).then(|| mean(&lost)),
            "sections_repeated": crashed.iter().map(|r| r["sections_repeated"].as_u64().unwrap_or(0)).sum::<u64>(),
            "runs": runs,
        })
    };
    let mut aborts = Vec::new();
    let mut kills = Vec::new();
    for i in 0..reps {
        let k = 1 + (i as u64 * 5) % (EXPERTS * SECTIONS - 1);
        let crash = Crash {
            sim: &sim,
            jobs: &jobs,
            work: &work,
            events: &events,
            url: &url,
            clean_calls,
            kill_delay: Duration::ZERO,
        };
        aborts.push(crash.run(&format!("rs-abort-{i}"), k, false).await?);
        kills.push(crash.run(&format!("rs-kill-{i}"), k, true).await?);
    }
    // The same kill -9 against a model that takes real time per call (the
    // simulator's responses are the same, so is the clean count): the
    // flusher then keeps up, and the kill lands at various points of the
    // section in flight (after its k-th section, plus an offset).
    let mut paced = Vec::new();
    if a.paced_reps > 0 {
        let slow = Sim::start(a.paced_token_ms).await?;
        for i in 0..a.paced_reps {
            let crash = Crash {
                sim: &slow,
                jobs: &jobs,
                work: &work,
                events: &events,
                url: &url,
                clean_calls,
                kill_delay: Duration::from_millis(200 * i as u64),
            };
            let k = 1 + (i as u64 * 5) % (EXPERTS * SECTIONS - 1);
            paced.push(crash.run(&format!("rs-paced-kill-{i}"), k, true).await?);
        }
    }
    let lat = &alone["flush_latency_us"];
    let checkpoints_alone = json!({
        "events_per_batch": f64_of(&alone["events"]) / f64_of(&alone["batches"]).max(1.0),
        "coalescing_ratio": f64_of(&alone["progress_updates"]) / f64_of(&alone["progress_writes"]).max(1.0),
        "flush_latency_ms": {"p50": ms(f64_of(&lat["p50"])), "p99": ms(f64_of(&lat["p99"])), "max": ms(f64_of(&lat["max"]))},
        "raw": alone,
    });
    Ok(json!({
        "input": {"experts": EXPERTS, "sections": SECTIONS, "model": "leasehold-sim, LH_SIM_TOKEN_DELAY_MS=0"},
        "throughput": throughput,
        "checkpoints": checkpoints,
        "checkpoints_one_job_alone": checkpoints_alone,
        "rework": {
            "clean_model_calls": clean_calls,
            "model_calls_per_section": baseline,
            "seed_baseline_repeated_calls_per_crash": baseline,
            "abort_after_section_checkpoint": summarize(&aborts),
            "kill9_mid_expert": summarize(&kills),
            "kill9_mid_expert_paced_model": (!paced.is_empty()).then(|| {
                let mut v = summarize(&paced);
                v["token_delay_ms"] = json!(a.paced_token_ms);
                v
            }),
        },
    }))
}

/// One crashed research job: a victim worker runs it alone and dies, a
/// rescuer reclaims it after the lease and completes it.
struct Crash<'a> {
    sim: &'a Sim,
    jobs: &'a Jobs,
    work: &'a Work,
    events: &'a Events,
    url: &'a str,
    clean_calls: u64,
    /// How long after the `k`-th section's progress a kill -9 lands.
    kill_delay: Duration,
}

impl Crash<'_> {
    /// `kill9`: SIGKILL the victim as soon as its `k`-th section's progress
    /// is durable (the next section is then in flight, an arbitrary point
    /// in it). Otherwise the victim aborts itself right after its `k`-th
    /// section checkpoint is durable (`LH_RESEARCH_CRASH_AT=after_section:k`,
    /// armed only while the job has no stale reclaim, so the rescuer runs on).
    async fn run(&self, id: &str, k: u64, kill9: bool) -> anyhow::Result<Value> {
        let one = ("LH_RESEARCH_EXPERT_CONCURRENCY", "1".to_string());
        let victim_id = format!("{id}-victim");
        let mut env = vec![("LH_WORKER_ID", victim_id.clone()), one.clone()];
        if !kill9 {
            env.push(("LH_RESEARCH_CRASH_AT", format!("after_section:{k}")));
        }
        let c0 = self.sim.chat_requests().await?;
        let mut victim = self.sim.worker(self.url, &env);
        submit_research(self.work, id).await?;
        wait_record(self.jobs, id, |r| {
            r.worker_id.as_deref() == Some(victim_id.as_str()) || terminal(&r.status)
        })
        .await?;
        // Started only once the victim owns the job: it takes over, never starts it.
        let rescuer = self
            .sim
            .worker(self.url, &[("LH_WORKER_ID", format!("{id}-rescuer")), one]);
        if kill9 {
            wait_record(self.jobs, id, |r| {
                r.progress
                    .as_ref()
                    .is_some_and(|p| p.sections_done as u64 >= k)
                    || terminal(&r.status)
            })
            .await?;
            // A chosen fault time, not a wait for a condition.
            tokio::time::sleep(self.kill_delay).await;
            victim.kill9();
        }
        // The sim counts a call when it arrives, so this includes one in flight.
        let victim_calls = match kill9 {
            true => Some(self.sim.chat_requests().await? - c0),
            false => None,
        };
        let rec = completed(self.jobs, id).await?;
        let calls = self.sim.chat_requests().await? - c0;
        drop(rescuer);
        // The abort variant exited long ago (the rescuer waited out its lease).
        let _ = victim.wait_timeout(Duration::from_secs(5));
        // What of the victim's work was durable when it died: model results
        // (outline, perspectives and final sections as phase events, one call
        // each; section responses as journal entries) and tool results. Its
        // other calls were in flight or still queued in its flusher.
        let (mut durable, mut tool_results) = (0u64, 0u64);
        for (_, e) in self.events.read(id).await? {
            let Some(d) = (e.epoch == 1)
                .then(|| serde_json::from_str::<Value>(&e.data).ok())
                .flatten()
            else {
                continue;
            };
            let role = (d["entry"]["op"] == "message").then(|| &d["entry"]["message"]["role"]);
            match e.r#type.as_str() {
                "phase" => {
                    durable += u64::from(matches!(
                        d["phase"].as_str(),
                        Some("outline" | "perspectives" | "final")
                    ))
                }
                "journal" if role.is_some_and(|r| r == "assistant") => durable += 1,
                "journal" if role.is_some_and(|r| r == "tool") => tool_results += 1,
                _ => {}
            }
        }
        let mut per: HashMap<(u64, u64), u64> = HashMap::new();
        for p in section_payloads(self.events, id).await? {
            *per.entry((
                p["expert"].as_u64().unwrap_or(0),
                p["index"].as_u64().unwrap_or(0),
            ))
            .or_default() += 1;
        }
        Ok(json!({
            "id": id,
            "kill": if kill9 { "kill -9" } else { "abort after section checkpoint" },
            "after_sections": k,
            "crashed": rec.stale_reclaims > 0,
            "model_calls": calls,
            "repeated_calls": calls as i64 - self.clean_calls as i64,
            "sections_repeated": per.values().map(|n| n - 1).sum::<u64>(),
            "victim_model_calls": victim_calls,
            "victim_durable_model_results": durable,
            "victim_durable_tool_results": tool_results,
            // Calls whose result was not durable at the kill: one in flight
            // at most (one expert at a time), the rest completed but still
            // queued in the flusher. A durable tool proposal whose tool result
            // was not durable is asked again too (the repair drops it).
            "victim_results_not_durable": victim_calls.map(|v| v.saturating_sub(durable)),
        }))
    }
}

fn research_rows(r: &Value) -> Vec<(String, String)> {
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let tp = &r["throughput"];
    let ck = &r["checkpoints"];
    let rw = &r["rework"];
    let shape = format!("{EXPERTS}x{SECTIONS}");
    let mut rows = vec![
        (
            format!("research {shape}: expert sections/s, 1 worker (instant model)"),
            format!("{:.1}", f(&tp["sections_per_s_per_worker"])),
        ),
        (
            format!(
                "research: flush latency p50/p99 ms, {} jobs at once",
                tp["jobs"]
            ),
            format!(
                "{}/{}",
                ck["flush_latency_ms"]["p50"], ck["flush_latency_ms"]["p99"]
            ),
        ),
        (
            "research: flush latency p50/p99 ms, one job alone".into(),
            format!(
                "{}/{}",
                r["checkpoints_one_job_alone"]["flush_latency_ms"]["p50"],
                r["checkpoints_one_job_alone"]["flush_latency_ms"]["p99"]
            ),
        ),
        (
            "research: progress updates per durable write".into(),
            format!("{:.1}", f(&ck["coalescing_ratio"])),
        ),
        (
            "research: checkpoint events per flush batch".into(),
            format!("{:.1}", f(&ck["events_per_batch"])),
        ),
        (
            format!("research {shape}: model calls of a clean job"),
            rw["clean_model_calls"].to_string(),
        ),
        (
            "seed baseline: calls repeated per crash (1 section)".into(),
            format!("{:.1}", f(&rw["seed_baseline_repeated_calls_per_crash"])),
        ),
    ];
    for (k, name) in [
        (
            "abort_after_section_checkpoint",
            "abort at a section checkpoint",
        ),
        ("kill9_mid_expert", "kill -9 mid-expert"),
        ("kill9_mid_expert_paced_model", "kill -9, paced model"),
    ] {
        let x = &rw[k];
        if x.is_null() {
            continue;
        }
        rows.push((
            format!("calls repeated per {name}, mean/max (n={})", x["crashes"]),
            format!(
                "{:.1}/{}",
                f(&x["repeated_calls_mean"]),
                x["repeated_calls_max"]
            ),
        ));
        rows.push((
            format!("sections redone after {name} (n={})", x["crashes"]),
            x["sections_repeated"].to_string(),
        ));
        if let Some(lost) = x["results_not_durable_mean"].as_f64() {
            rows.push((
                format!("model results not yet durable at {name}, mean"),
                format!("{lost:.1}"),
            ));
        }
    }
    rows
}
