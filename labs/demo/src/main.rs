//! `leasehold-demo`: the offline demo behind `make demo`.
//!
//! Starts a local nats-server (unless `NATS_URL` answers) with its storage
//! under `.demo/`, the simulated model `leasehold-sim` (model faults at a few
//! percent), the reaper, and three `leasehold-worker` processes; submits six
//! research jobs; then injects the faults the system exists for: one worker is
//! killed with SIGKILL in the middle of an expert's sections (and restarted
//! under the same identity), another is frozen with SIGSTOP past its session
//! timeout and resumed. It shows live progress per job, prints a summary,
//! checks the invariants, saves each job's report under
//! `<state-dir>/reports/<id>.md` (the local server stops with the demo),
//! tears down only what it started, and exits non-zero if an invariant
//! failed.
//!
//! Rework is counted from the job's events: a section checkpointed twice is a
//! repeated section; a model response journaled twice (the simulator is
//! deterministic, so a repeated call returns the same message) or a phase
//! result checkpointed twice is a repeated model call.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use clap::Parser;
use futures::StreamExt;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};
use leasehold_core::JobRecord;
use leasehold_harness::{bin_dir, NatsServer, Proc};
use leasehold_store::events::Events;
use leasehold_store::setup::{self, SetupOptions};
use leasehold_store::work::Work;
use leasehold_store::{Jobs, NatsArgs};
use serde_json::{json, Value};
use sha2::Digest;

mod screenshots;

#[derive(Parser, Debug)]
#[command(
    name = "leasehold-demo",
    version,
    about = "Run leasehold's offline demo: research jobs on a local NATS server and the simulated model, a worker fleet, an injected crash and pause, checked invariants"
)]
struct Args {
    /// Research jobs to submit.
    #[arg(long, default_value_t = 6)]
    jobs: usize,
    /// Worker processes.
    #[arg(long, default_value_t = 3)]
    workers: usize,
    /// Where the local server's storage, the logs and the saved reports go.
    #[arg(long, default_value = ".demo")]
    state_dir: PathBuf,
    /// Session timeout of the demo workers (short, so a paused worker's
    /// jobs move within seconds; a killed one's move at once).
    #[arg(long, default_value = "3s", value_parser = leasehold_core::time::parse_duration)]
    session_timeout: Duration,
    /// Model fault rate of the simulator (0 to 1).
    #[arg(long, default_value_t = 0.03)]
    fault_rate: f64,
    /// Give up waiting for the jobs after this long.
    #[arg(long, default_value = "150s", value_parser = leasehold_core::time::parse_duration)]
    timeout: Duration,
    /// Where the console serves while the demo runs (loopback: no auth).
    #[arg(long, default_value = "127.0.0.1:8090")]
    console_listen: String,
    /// After the jobs, keep the fleet and the console up this long (to
    /// look around in the console); 0 ends at once.
    #[arg(long, default_value = "0s", value_parser = leasehold_core::time::parse_duration)]
    linger: Duration,
    /// After the jobs, photograph the console's pages into this directory
    /// (`make screenshots` writes docs/screenshots/); needs Chromium.
    #[arg(long, value_name = "DIR")]
    screenshots: Option<PathBuf>,
}

const TOPICS: [&str; 6] = [
    "lease-based ownership in distributed systems",
    "idempotency keys for side-effecting APIs",
    "checkpointing long-running agent workflows",
    "exponential backoff with jitter",
    "work-queue delivery semantics in NATS JetStream",
    "transcript repair for tool-calling language models",
];

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

/// Live per-job counts from `lh.events.>`.
#[derive(Default, Clone)]
struct Live {
    retries: u32,
}

async fn run(a: Args) -> anyhow::Result<bool> {
    let logs = a.state_dir.join("logs");
    std::fs::create_dir_all(&logs)?;
    // Use the user's NATS when it answers; otherwise start our own.
    let mut server = None;
    let url = match std::env::var("NATS_URL").ok() {
        Some(u) if async_nats::connect(u.as_str()).await.is_ok() => {
            say(format!("using the NATS server at {u}"));
            u
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
            // The Python invoice agent (examples/invoice-python) runs beside research.
            kinds: SetupOptions::default()
                .kinds
                .into_iter()
                .chain(["invoice".to_string()])
                .collect(),
            ..SetupOptions::default()
        },
    )
    .await
    .context("leasehold setup")?;
    say("layout ready (streams LH_WORK, LH_EVENTS, LH_DLQ; buckets lh_jobs, lh_effects; object store lh_artifacts)");

    let sim = Proc::spawn_logged(
        "leasehold-sim",
        &["--listen", "127.0.0.1:0"],
        &[
            ("LH_SIM_FAULT_RATE", a.fault_rate.to_string()),
            ("LH_SIM_TOKEN_DELAY_MS", "1".into()),
            ("RUST_LOG", "warn".into()),
        ],
        Some(logs.join("sim.log")),
    );
    let sim_addr = sim
        .wait_for_line("listening on ", Duration::from_secs(15))
        .await
        .map_err(anyhow::Error::msg)?;
    let sim_url = format!("http://{sim_addr}");
    say(format!(
        "started leasehold-sim at {sim_url} (model faults at {:.0}%)",
        a.fault_rate * 100.0
    ));

    // The Python kind's service (the Python SDK serving the invoice agent,
    // the sim as its accounting system), when python3 is here.
    let python = python_service(&sim_url, &logs).await;
    let remote = python
        .as_ref()
        .map(|(_, u)| format!("invoice={u}"))
        .unwrap_or_default();
    let session_ms = a.session_timeout.as_millis();
    let env = |id: &str| -> Vec<(&'static str, String)> {
        vec![
            ("NATS_URL", url.clone()),
            ("LH_WORKER_ID", id.to_string()),
            ("LH_SESSION_TIMEOUT", format!("{session_ms}ms")),
            ("LH_PULL_EXPIRES", "500ms".into()),
            ("LH_DRAIN_TIMEOUT", "1s".into()),
            ("LH_CONCURRENCY", "4".into()),
            ("LH_KINDS", "research".into()),
            ("LH_MODEL_BASE_URL", format!("{sim_url}/v1")),
            ("LH_SEARCH_URL", sim_url.clone()),
            ("LH_PUBLISH_URL", format!("{sim_url}/effects")),
            ("LH_FETCH_ALLOW", "127.0.0.1".into()),
            ("LH_REMOTE_KINDS", remote.clone()),
            ("RUST_LOG", "info".into()),
        ]
    };
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
    // The console, on loopback (auth off there): its URL is printed.
    let mut console = None;
    if bin_dir().join("leasehold-console").is_file() {
        let p = Proc::spawn_logged(
            "leasehold-console",
            &[],
            &[
                ("NATS_URL", url.clone()),
                ("LH_CONSOLE_HTTP_LISTEN", a.console_listen.clone()),
                ("RUST_LOG", "info".into()),
            ],
            Some(logs.join("console.log")),
        );
        match p
            .wait_for_line("console listening on ", Duration::from_secs(20))
            .await
        {
            Ok(addr) => say(format!("console: {addr}/jobs (fleet: {addr}/fleet)")),
            Err(e) => say(format!("the console did not start: {e}")),
        }
        console = Some(p);
    }
    let mut procs = Vec::new();
    for i in 1..=a.workers {
        let id = format!("demo-w{i}");
        procs.push(Proc::spawn_logged(
            "leasehold-worker",
            &[],
            &env(&id),
            Some(logs.join(format!("{id}.log"))),
        ));
    }
    say(format!(
        "started {} workers (session timeout {:?}; logs in {})",
        a.workers,
        a.session_timeout,
        logs.display()
    ));

    // Live retry counts per job from the event subjects.
    let live: Arc<Mutex<HashMap<String, Live>>> = Arc::default();
    {
        let mut sub = conn.client.subscribe("lh.events.*.retry").await?;
        let live = live.clone();
        tokio::spawn(async move {
            while let Some(m) = sub.next().await {
                if let Some(job) = m.subject.split('.').nth(2) {
                    live.lock()
                        .unwrap()
                        .entry(job.to_string())
                        .or_default()
                        .retries += 1;
                }
            }
        });
    }

    let run_id = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_secs();
    let work = Work::new(&conn);
    let jobs = Jobs::open(&conn).await?;
    let mut ids = Vec::new();
    for n in 0..a.jobs {
        let id = format!("research-{run_id}-{n}");
        let spec =
            json!({"input": {"topic": TOPICS[n % TOPICS.len()], "experts": 3, "sections": 3}});
        work.submit("research", spec.to_string().into(), Some(&id), None)
            .await?;
        ids.push(id);
    }
    say(format!(
        "submitted {} research jobs (3 experts x 3 sections each)",
        ids.len()
    ));
    let invoice_id = format!("invoice-{run_id}");
    if python.is_some() {
        let spec = json!({"input": {"email": {"from": "billing@acme.example", "body": format!("Invoice F-{run_id} from ACME: 1,200.00 EUR")}}});
        work.submit("invoice", spec.to_string().into(), Some(&invoice_id), None)
            .await?;
        say(format!(
            "submitted {invoice_id} to the Python kind `invoice` (served by the Python SDK, every write by the workers)"
        ));
    }

    let multi = MultiProgress::new();
    let style = ProgressStyle::with_template("{prefix:<26} [{bar:24}] {pos:>2}/{len:<2} {msg}")?
        .progress_chars("=> ");
    let bars: Vec<ProgressBar> = ids
        .iter()
        .map(|id| {
            let b = multi.add(ProgressBar::new(1));
            b.set_style(style.clone());
            b.set_prefix(id.clone());
            b
        })
        .collect();
    let start = Instant::now();
    let mut killed = None;
    let mut paused: Option<Instant> = None;
    let mut resumed = false;
    loop {
        let recs = snapshot(&jobs, &ids).await?;
        let counts = live.lock().unwrap().clone();
        for (id, bar) in ids.iter().zip(&bars) {
            let r = &recs[id];
            let p = r.progress.clone().unwrap_or_default();
            bar.set_length(u64::from(p.sections_total.max(1)));
            bar.set_position(u64::from(p.sections_done));
            bar.set_message(format!(
                "{:<9} {:<12} retries={} reclaims={} {}",
                r.status,
                if p.phase.is_empty() {
                    "-"
                } else {
                    p.phase.as_str()
                },
                counts.get(id).map_or(0, |l| l.retries),
                r.stale_reclaims,
                r.worker_id.clone().unwrap_or_default()
            ));
        }
        // Fault 1: SIGKILL a worker in the middle of an expert's sections,
        // then restart it under the same identity (it reclaims at once).
        if killed.is_none() {
            if let Some(r) = recs.values().find(|r| {
                r.status == "running"
                    && r.worker_id.as_deref() == Some("demo-w1")
                    && r.progress
                        .as_ref()
                        .is_some_and(|p| p.phase == "experts" && p.sections_done >= 2)
            }) {
                procs[0].kill9();
                multi.println(format!(
                    "fault: SIGKILL demo-w1 mid-expert in {} ({} sections done)",
                    r.id,
                    r.progress.clone().unwrap_or_default().sections_done
                ))?;
                killed = Some(r.id.clone());
                procs[0] = Proc::spawn_logged(
                    "leasehold-worker",
                    &[],
                    &env("demo-w1"),
                    Some(logs.join("demo-w1.restarted.log")),
                );
                multi.println("fault: restarted demo-w1 under the same identity: it reclaims its jobs at once, without waiting for its old session to time out")?;
            }
        }
        // Fault 2: freeze another worker past its session timeout, then resume it.
        if paused.is_none() && a.workers > 1 {
            if let Some(r) = recs
                .values()
                .find(|r| r.status == "running" && r.worker_id.as_deref() == Some("demo-w2"))
            {
                procs[1].stop();
                multi.println(format!(
                    "fault: SIGSTOP demo-w2 while it runs {} (for its session timeout + 2s)",
                    r.id
                ))?;
                paused = Some(Instant::now());
            }
        }
        if let Some(at) = paused {
            if !resumed && at.elapsed() > a.session_timeout + Duration::from_secs(2) {
                procs[1].cont();
                resumed = true;
                multi.println("fault: SIGCONT demo-w2: every write it attempts for reclaimed jobs must be refused")?;
            }
        }
        let done = recs.values().filter(|r| terminal(r)).count();
        if done == ids.len() && (paused.is_none() || resumed) {
            break;
        }
        if start.elapsed() > a.timeout {
            multi.println("timeout: not every job finished")?;
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    for b in &bars {
        b.finish();
    }

    // Summary and invariants.
    let recs = snapshot(&jobs, &ids).await?;
    let events = Events::new(&conn);
    let deliveries = deliveries_by_job(&sim_url).await.unwrap_or_default();
    let store = conn.js.get_object_store("lh_artifacts").await?;
    let mut failures = Vec::new();
    println!();
    println!(
        "{:<26} {:<10} {:<7} {:>8} {:>8} {:>5} {:>5} {:>5} {:>9} {:>9} {:>10}",
        "JOB",
        "STATUS",
        "PARTIAL",
        "ATTEMPTS",
        "RECLAIMS",
        "GEN",
        "WARM",
        "COLD",
        "SECT.REP",
        "CALLS.REP",
        "DELIVERED"
    );
    let mut total_reclaims = 0;
    let reports = a.state_dir.join("reports");
    std::fs::create_dir_all(&reports)?;
    let mut saved: Vec<PathBuf> = Vec::new();
    for id in &ids {
        let r = &recs[id];
        total_reclaims += r.stale_reclaims;
        let evs: Vec<_> = events.read(id).await?.into_iter().map(|(_, e)| e).collect();
        let rework = Rework::of(&evs);
        let delivered = deliveries.get(id.as_str()).copied().unwrap_or(0);
        let res = r.result.clone().unwrap_or_default();
        println!(
            "{:<26} {:<10} {:<7} {:>8} {:>8} {:>5} {:>5} {:>5} {:>9} {:>9} {:>10}",
            id,
            r.status,
            res.partial,
            r.attempts,
            r.stale_reclaims,
            rework.generation,
            rework.warm,
            rework.cold,
            rework.sections,
            rework.calls,
            delivered
        );
        if r.status != "completed" {
            failures.push(format!("{id} ended {} ({:?})", r.status, r.error));
            continue;
        }
        if delivered != 1 {
            failures.push(format!(
                "{id}: {delivered} deliveries at the sink (must be exactly 1)"
            ));
        }
        match (&res.artifact, &res.digest) {
            (Some(name), Some(digest)) => match store.get(name).await {
                Ok(mut obj) => {
                    use tokio::io::AsyncReadExt;
                    let mut body = Vec::new();
                    obj.read_to_end(&mut body).await?;
                    let got = hex::encode(sha2::Sha256::digest(&body));
                    if &got != digest {
                        failures.push(format!(
                            "{id}: the artifact's digest differs from the record's"
                        ));
                    }
                    // The demo's server stops with it: keep the report on disk.
                    let path = reports.join(format!("{id}.md"));
                    std::fs::write(&path, &body)
                        .with_context(|| format!("writing {}", path.display()))?;
                    saved.push(path);
                }
                Err(e) => {
                    failures.push(format!("{id}: completed without its artifact {name}: {e}"))
                }
            },
            _ => failures.push(format!("{id}: completed without artifact and digest")),
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
    let stats: Value = reqwest::get(format!("{sim_url}/stats"))
        .await?
        .json()
        .await
        .unwrap_or_default();
    println!();
    println!(
        "jobs: {}  completed: {}  reclaims: {total_reclaims}  model requests: {}  model faults injected: {}  time: {:.1}s",
        ids.len(),
        recs.values().filter(|r| r.status == "completed").count(),
        stats["chat_requests"],
        stats["faults_total"],
        start.elapsed().as_secs_f64()
    );
    println!("GEN/WARM/COLD: retries by scope; SECT.REP / CALLS.REP: sections and model calls repeated after recoveries.");
    match saved.first() {
        Some(first) => println!(
            "reports saved in {}/ (one per completed job); read one with: less {}",
            reports.display(),
            first.display()
        ),
        None => println!("no report was saved (no job completed)"),
    }
    if server.is_none() {
        // The user's own server keeps running, and with it the artifacts.
        println!(
            "or from NATS: NATS_URL={url} target/debug/leasehold result {}",
            ids[0]
        );
    }
    if python.is_some() {
        let deadline = Instant::now() + Duration::from_secs(30);
        let rec = loop {
            let r = jobs.get(&invoice_id).await?.map(|e| e.value);
            match r {
                Some(r) if terminal(&r) || Instant::now() > deadline => break Some(r),
                None if Instant::now() > deadline => break None,
                _ => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        };
        let booked: Value = reqwest::get(format!("{sim_url}/accounting/invoices/count"))
            .await?
            .json()
            .await
            .unwrap_or_default();
        let status = rec
            .as_ref()
            .map_or("missing".to_string(), |r| r.status.clone());
        println!(
            "python kind: {invoice_id} {status}; invoices booked in the accounting system: {}",
            booked["count"]
        );
        if status != "completed" {
            failures.push(format!("{invoice_id} (the Python kind) ended {status}"));
        }
        if booked["count"] != 1 {
            failures.push(format!(
                "{} invoices booked for {invoice_id} (must be exactly 1)",
                booked["count"]
            ));
        }
    }
    if killed.is_none() {
        failures.push("the kill fault never fired (no job ran mid-expert on demo-w1)".into());
    }
    if total_reclaims == 0 {
        failures.push("no job was reclaimed: the faults did not exercise recovery".into());
    }

    if let (Some(dir), Some(id)) = (&a.screenshots, &killed) {
        let base = format!("http://{}", a.console_listen);
        match console
            .as_ref()
            .context("the console is not built")
            .and_then(|_| screenshots::take(dir, &base, &screenshots::docs_shots(id)))
        {
            Ok(files) => say(format!("{} screenshots in {}", files.len(), dir.display())),
            Err(e) => failures.push(format!("screenshots: {e:#}")),
        }
    }
    if !a.linger.is_zero() && console.is_some() {
        say(format!(
            "the fleet and the console stay up for {:?} (--linger; Ctrl-C ends the demo)",
            a.linger
        ));
        tokio::select! {
            _ = tokio::time::sleep(a.linger) => {}
            _ = tokio::signal::ctrl_c() => {}
        }
    }
    // Tear down only what we started.
    if let Some(c) = console.take() {
        c.term();
    }
    for p in procs.iter_mut() {
        p.cont();
        p.term();
    }
    for p in procs.iter_mut() {
        if p.wait_timeout(Duration::from_secs(10)).is_none() {
            p.kill9();
        }
    }
    if let Some(mut r) = reaper {
        r.term();
        let _ = r.wait_timeout(Duration::from_secs(5));
    }
    drop(python);
    drop(sim);
    drop(server);
    if failures.is_empty() {
        println!("invariants: OK (every job completed once, with its artifact, delivered exactly once; no stale write landed)");
        Ok(true)
    } else {
        println!("invariants FAILED:");
        for f in &failures {
            println!("  - {f}");
        }
        Ok(false)
    }
}

/// The Python SDK serving `examples/invoice-python` (run from the
/// checkout, as `make demo` does), with the sim as its accounting system;
/// `None` (the demo goes on without it) when python3 or the example is
/// missing.
async fn python_service(sim_url: &str, logs: &std::path::Path) -> Option<(Proc, String)> {
    let root = std::env::current_dir().ok()?;
    let app = root.join("examples/invoice-python");
    if !app.join("app.py").is_file() {
        say("no examples/invoice-python here: the demo runs without the Python kind");
        return None;
    }
    let python = std::env::var("LH_PYTHON").unwrap_or_else(|_| "python3".into());
    let port = leasehold_harness::free_port();
    let p = Proc::spawn_path(
        std::path::Path::new(&python),
        &[
            "-m",
            "leasehold",
            "serve",
            "app:app",
            "--port",
            &port.to_string(),
        ],
        &[
            (
                "PYTHONPATH",
                format!(
                    "{}:{}",
                    root.join("sdks/python/src").display(),
                    app.display()
                ),
            ),
            ("INVOICE_ACCOUNTING_URL", sim_url.to_string()),
            ("PYTHONUNBUFFERED", "1".into()),
        ],
        Some(logs.join("python-invoice.log")),
    );
    match p
        .wait_for_line("listening on ", Duration::from_secs(15))
        .await
    {
        Ok(_) => {
            let url = format!("http://127.0.0.1:{port}/");
            say(format!(
                "started the Python kind `invoice` at {url} (sdks/python, examples/invoice-python)"
            ));
            Some((p, url))
        }
        Err(e) => {
            say(format!(
                "the Python kind did not start ({e}): the demo runs without it"
            ));
            None
        }
    }
}

/// Retries and repeated work of one job, from its events.
#[derive(Default)]
struct Rework {
    generation: u32,
    warm: u32,
    cold: u32,
    sections: u32,
    calls: u32,
}

impl Rework {
    fn of(evs: &[leasehold_proto::JobEvent]) -> Self {
        let mut r = Rework::default();
        let mut sections = HashSet::new();
        let mut responses = HashSet::new();
        let mut phases = HashSet::new();
        for e in evs {
            let d = e.data_map();
            match e.r#type.as_str() {
                "retry" => match d.get("scope").and_then(Value::as_str) {
                    Some("generation") => r.generation += 1,
                    Some("warm") => r.warm += 1,
                    Some("cold") => r.cold += 1,
                    _ => {}
                },
                "section" => {
                    let p = &d["payload"];
                    if !sections.insert((p["expert"].as_u64(), p["index"].as_u64())) {
                        r.sections += 1;
                    }
                }
                "journal" => {
                    let m = &d["entry"]["message"];
                    if m["role"] == "assistant"
                        && !responses.insert((
                            d["expert"].as_u64(),
                            d["index"].as_u64(),
                            m.to_string(),
                        ))
                    {
                        r.calls += 1;
                    }
                }
                "phase" => {
                    let key = (
                        d["phase"].as_str().unwrap_or_default().to_string(),
                        d["payload"]["index"].as_u64(),
                    );
                    let model_phase =
                        matches!(key.0.as_str(), "outline" | "perspectives" | "final");
                    if model_phase && !phases.insert(key) {
                        r.calls += 1;
                    }
                }
                _ => {}
            }
        }
        r
    }
}

/// Deliveries recorded at the simulator's effects sink, by job.
async fn deliveries_by_job(sim: &str) -> anyhow::Result<HashMap<String, u32>> {
    let all: Value = reqwest::get(format!("{sim}/effects")).await?.json().await?;
    let mut out = HashMap::new();
    for e in all.as_array().cloned().unwrap_or_default() {
        if let Some(job) = e["body"]["job_id"].as_str() {
            *out.entry(job.to_string()).or_default() += 1;
        }
    }
    Ok(out)
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
