//! The console: time to first byte of the jobs page and of a job's
//! timeline with many active and finished jobs beside an empty fleet;
//! a section checkpoint's latency to an SSE client; 100 SSE clients on one
//! job (the console's RSS and CPU, and echo throughput with and without
//! them).

use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt;
use leasehold_core::machine::new_record;
use leasehold_harness::Proc;
use leasehold_store::events::{self, Events};
use leasehold_store::index::{Active, Key};
use leasehold_store::setup::SetupOptions;
use leasehold_store::work::Work;
use leasehold_store::{Conn, Jobs};
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

use crate::common::{self, pct, rss_mib, server, summary, wait_log};

async fn console(url: &str) -> anyhow::Result<(Proc, String)> {
    console_with(url, &[]).await
}

/// A console on `url` with `extra` environment besides the bench's own.
pub(crate) async fn console_with(
    url: &str,
    extra: &[(&'static str, String)],
) -> anyhow::Result<(Proc, String)> {
    let mut env: Vec<(&'static str, String)> = vec![
        ("NATS_URL", url.to_string()),
        ("LH_CONSOLE_HTTP_LISTEN", "127.0.0.1:0".into()),
        // Its clients are one caller (loopback, no auth): 100 streams.
        ("LH_CONSOLE_STREAMS_PER_CALLER", "1000".into()),
        (
            "RUST_LOG",
            std::env::var("LH_BENCH_CONSOLE_LOG")
                .unwrap_or_else(|_| "leasehold_console=info,warn".into()),
        ),
    ];
    env.extend(extra.iter().cloned());
    let p = Proc::spawn("leasehold-console", &[], &env);
    wait_log(&p, "console listening on http://", Duration::from_secs(30)).await?;
    let addr = p
        .output()
        .lines()
        .find_map(|l| l.split("console listening on http://").nth(1))
        .unwrap_or_default()
        .trim()
        .to_string();
    Ok((p, addr))
}

/// Time to the first byte of `GET path` (a fresh connection), in ms, and
/// the status line; the rest of the answer is read and dropped.
async fn ttfb(addr: &str, path: &str) -> anyhow::Result<(f64, String)> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    let t0 = Instant::now();
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut first = [0u8; 1];
    s.read_exact(&mut first).await?;
    let ms = t0.elapsed().as_secs_f64() * 1000.0;
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).await?;
    let head = String::from_utf8_lossy(&rest);
    Ok((ms, format!("H{}", head.lines().next().unwrap_or(""))))
}

pub(crate) async fn sample(addr: &str, path: &str, n: usize) -> anyhow::Result<Vec<f64>> {
    let mut v = Vec::new();
    for _ in 0..n {
        let (ms, status) = ttfb(addr, path).await?;
        if !status.contains(" 200") {
            // What the console said, for the report.
            let page = common::http_get_text(addr, path).await.unwrap_or_default();
            let said = page
                .split("<p class=\"error\">")
                .nth(1)
                .and_then(|t| t.split("</p>").next())
                .unwrap_or(&page);
            anyhow::bail!(
                "GET {path}: {status}: {}",
                said.chars().take(500).collect::<String>()
            );
        }
        v.push(ms);
    }
    Ok(v)
}

/// Running jobs `ids` (`seed-<i>`, on 8 workers) in the index, and with
/// their records when `records` (256 writes at a time).
pub async fn seed_running(
    conn: &Conn,
    ids: std::ops::Range<usize>,
    records: bool,
) -> anyhow::Result<()> {
    let jobs = Jobs::open(conn).await?;
    let index = Active::open(conn).await?;
    let now = SystemTime::now();
    let mut pending = futures::stream::FuturesUnordered::new();
    for i in ids {
        let (jobs, index) = (jobs.clone(), index.clone());
        pending.push(async move {
            let mut r = new_record(&format!("seed-{i}"), "echo", Default::default(), 0, now);
            r.status = "running".into();
            r.worker_id = Some(format!("w-{}", i % 8));
            r.epoch = 1;
            if records {
                jobs.create(&r).await?;
            }
            let key = Key::of(&r).expect("a running record has an index key");
            index.put(&key, &r).await?;
            anyhow::Ok(())
        });
        while pending.len() >= 256 {
            pending.next().await.transpose()?;
        }
    }
    while let Some(x) = pending.next().await {
        x?;
    }
    Ok(())
}

/// `active` running jobs in the index and records (a create and an index
/// write each, 256 at a time), `finished` completed records with their
/// terminal events (written directly, in batches of asynchronous
/// publishes: a million in a few minutes), and one job `measured` with 60
/// events of a research-like timeline, written last (so its completion is
/// the newest terminal event).
async fn seed(conn: &Conn, active: usize, finished: usize) -> anyhow::Result<()> {
    seed_running(conn, 0..active, true).await?;
    let jobs = Jobs::open(conn).await?;
    let ev = Events::new(conn);
    let now = SystemTime::now();
    const BATCH: usize = 5000;
    let t0 = Instant::now();
    let mut i = active;
    while i < active + finished {
        let end = (i + BATCH).min(active + finished);
        let recs: Vec<_> = (i..end)
            .map(|i| {
                let mut r = new_record(&format!("seed-{i}"), "echo", Default::default(), 0, now);
                r.status = "completed".into();
                r.epoch = 1;
                r
            })
            .collect();
        let evs: Vec<_> = recs
            .iter()
            .map(|r| events::event(&r.id, 1, "completed", None, json!({"kind": "echo"})))
            .collect();
        jobs.seed(&conn.js, &recs).await?;
        ev.seed(&evs).await?;
        i = end;
        if (i - active) % 100_000 < BATCH {
            eprintln!(
                "console bench: {} finished jobs written ({:.0}/s)",
                i - active,
                (i - active) as f64 / t0.elapsed().as_secs_f64()
            );
        }
    }
    timeline(conn, "measured").await
}

async fn timeline(conn: &Conn, id: &str) -> anyhow::Result<()> {
    let jobs = Jobs::open(conn).await?;
    let ev = Events::new(conn);
    let mut r = new_record(id, "research", Default::default(), 0, SystemTime::now());
    r.status = "completed".into();
    jobs.create(&r).await?;
    for i in 0..60u64 {
        let (ty, data) = match i % 4 {
            0 => (
                "section",
                json!({"payload": {"expert": i % 3, "index": i / 3, "title": "A section", "status": "completed", "content": "text ".repeat(200)}}),
            ),
            1 => (
                "journal",
                json!({"expert": 0, "index": i, "entry": {"generation": 0, "message": {"role": "assistant", "content": "an answer"}}}),
            ),
            2 => (
                "tool",
                json!({"kind": "finished", "tool": "search", "key": "k", "step_id": "s", "ok": true}),
            ),
            _ => (
                "progress",
                json!({"phase": "experts", "sections_done": i, "sections_total": 60}),
            ),
        };
        ev.publish(&events::event(id, 1, ty, Some("w-0"), data), None)
            .await?;
    }
    ev.publish(
        &events::event(id, 1, "completed", Some("w-0"), json!({"kind": "research"})),
        None,
    )
    .await?;
    Ok(())
}

/// TTFB of `/jobs` and `/jobs/measured`: an empty fleet, then one with
/// `active` active and `finished` finished jobs.
pub async fn pages(active: usize, finished: usize, samples: usize) -> anyhow::Result<Value> {
    let mut out = serde_json::Map::new();
    // `page`: one page's worth of each (50 active, 50 finished), so the
    // growth with the fleet's size shows apart from rendering a full page.
    for (name, a, f) in [
        ("empty", 0, 0),
        ("page", 50, 50),
        ("busy", active, finished),
    ] {
        let (s, conn) = server(SetupOptions::default()).await?;
        seed(&conn, a, f).await?;
        let (c, addr) = console(&s.url()).await?;
        // Let the console's feed read the index and the last hour's
        // terminal events: `measured` finished last.
        let t0 = Instant::now();
        loop {
            let page = common::http_get_text(&addr, "/jobs").await?;
            if page.contains("/jobs/measured")
                && (a == 0 || page.contains(&format!("{a} matching")))
            {
                break;
            }
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(900),
                "the console did not show the seeded jobs within 900s"
            );
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
        eprintln!(
            "console bench: {name}: the console caught up in {:.1}s",
            t0.elapsed().as_secs_f64()
        );
        sample(&addr, "/jobs", 3).await?;
        let jobs = sample(&addr, "/jobs", samples).await?;
        let tl = sample(&addr, "/jobs/measured", samples).await?;
        if let Ok(dir) = std::env::var("LH_BENCH_CONSOLE_LOG_DIR") {
            let _ = std::fs::write(format!("{dir}/console-{name}.log"), c.output());
        }
        out.insert(
            name.into(),
            json!({"active": a, "finished": f, "jobs_page_ttfb_ms": summary(&jobs), "timeline_ttfb_ms": summary(&tl)}),
        );
        drop(s);
    }
    let ratio = |base: &str, k: &str| {
        common::f64_of(&out["busy"][k]["p50"]) / common::f64_of(&out[base][k]["p50"]).max(0.001)
    };
    let (rj, rt) = (
        ratio("empty", "jobs_page_ttfb_ms"),
        ratio("empty", "timeline_ttfb_ms"),
    );
    out.insert(
        "jobs_page_ratio_to_one_page".into(),
        json!(ratio("page", "jobs_page_ttfb_ms")),
    );
    let p95_ok = |k: &str| common::f64_of(&out["busy"][k]["p95"]) <= 100.0;
    let jobs_met = rj <= 1.2 && p95_ok("jobs_page_ttfb_ms");
    let timeline_met = rt <= 1.2 && p95_ok("timeline_ttfb_ms");
    out.insert("jobs_page_ratio".into(), json!(rj));
    out.insert("timeline_ratio".into(), json!(rt));
    out.insert("jobs_page_met".into(), json!(jobs_met));
    out.insert("timeline_met".into(), json!(timeline_met));
    Ok(Value::Object(out))
}

/// Reads one SSE stream (`GET path`) and calls `f` with each message's data.
async fn sse(addr: &str, path: &str, mut f: impl FnMut(&Value) -> bool) -> anyhow::Result<()> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nAccept: text/event-stream\r\n\r\n")
            .as_bytes(),
    )
    .await?;
    let mut r = BufReader::new(s);
    let mut line = String::new();
    loop {
        line.clear();
        if r.read_line(&mut line).await? == 0 {
            return Ok(());
        }
        // Chunked framing lines and SSE fields: only `data:` lines matter.
        if let Some(d) = line.trim_end().strip_prefix("data:") {
            if let Ok(v) = serde_json::from_str::<Value>(d.trim()) {
                if f(&v) {
                    return Ok(());
                }
            }
        }
    }
}

fn sim_env(sim: &str) -> Vec<(&'static str, String)> {
    vec![
        ("LH_KINDS", "research,echo,sleep".into()),
        ("LH_MODEL_BASE_URL", format!("{sim}/v1")),
        ("LH_SEARCH_URL", sim.to_string()),
        ("LH_PUBLISH_URL", format!("{sim}/effects")),
        ("LH_FETCH_ALLOW", "127.0.0.1".into()),
    ]
}

async fn sim() -> anyhow::Result<(Proc, String)> {
    let p = Proc::spawn(
        "leasehold-sim",
        &["--listen", "127.0.0.1:0"],
        &[
            ("LH_SIM_TOKEN_DELAY_MS", "2".into()),
            ("RUST_LOG", "warn".into()),
        ],
    );
    wait_log(&p, "listening on ", Duration::from_secs(15)).await?;
    let addr = p
        .output()
        .lines()
        .find_map(|l| l.strip_prefix("listening on "))
        .unwrap_or_default()
        .trim()
        .to_string();
    Ok((p, format!("http://{addr}")))
}

/// Section checkpoints of `jobs` research jobs: the event's own time to
/// its arrival at an SSE client of the console (same host clock).
pub async fn live_latency(jobs: usize) -> anyhow::Result<Value> {
    let (s, conn) = server(SetupOptions {
        kinds: vec!["research".into(), "echo".into(), "sleep".into()],
        ..SetupOptions::default()
    })
    .await?;
    let (_sim, sim) = sim().await?;
    let mut env = sim_env(&sim);
    env.push(("LH_WORKER_ID", "bench-live".into()));
    let w = common::worker(&s.url(), &env);
    common::wait_session(&conn, "bench-live").await?;
    let (_c, addr) = console(&s.url()).await?;
    let work = Work::new(&conn);
    let mut lat = Vec::new();
    for j in 0..jobs {
        let id = format!("live-{j}");
        let spec = json!({"input": {"topic": "leases", "experts": 2, "sections": 3}});
        work.submit("research", spec.to_string().into(), Some(&id), None)
            .await?;
        let path = format!("/v1/jobs/{id}/events");
        // The record exists once a worker took the ticket.
        let jobs_kv = Jobs::open(&conn).await?;
        let t0 = Instant::now();
        while jobs_kv.get(&id).await?.is_none() {
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(20),
                "job {id} never recorded"
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let mut mine = Vec::new();
        tokio::time::timeout(
            Duration::from_secs(120),
            sse(&addr, &path, |v| {
                if v["type"] == "section" {
                    if let Some(at) = v["at"]
                        .as_str()
                        .and_then(leasehold_core::time::parse_rfc3339)
                    {
                        let d = SystemTime::now().duration_since(at).unwrap_or_default();
                        mine.push(d.as_secs_f64() * 1000.0);
                    }
                }
                v["status"] == "completed" || v["type"] == "completed"
            }),
        )
        .await??;
        lat.extend(mine);
    }
    drop(w);
    drop(s);
    let p95 = pct(&lat, 0.95);
    Ok(json!({"section_to_sse_ms": summary(&lat), "met": p95 <= 500.0}))
}

fn cpu_ticks(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            let after = s.rsplit_once(')')?.1.split_whitespace().collect::<Vec<_>>();
            Some(after.get(11)?.parse::<u64>().ok()? + after.get(12)?.parse::<u64>().ok()?)
        })
        .unwrap_or(0)
}

/// Echo throughput (`n` jobs, one worker) with the console idle, then
/// with `clients` SSE clients following one long job's page; the
/// console's RSS and CPU meanwhile.
pub async fn many_clients(clients: usize, n: usize) -> anyhow::Result<Value> {
    let (s, conn) = server(SetupOptions::default()).await?;
    let w = common::worker(
        &s.url(),
        &[
            ("LH_CONCURRENCY", "64".into()),
            ("LH_WORKER_ID", "bench-many".into()),
        ],
    );
    common::wait_session(&conn, "bench-many").await?;
    let (c, addr) = console(&s.url()).await?;
    let work = Work::new(&conn);
    work.submit(
        "sleep",
        json!({"input": {"ms": 600_000}}).to_string().into(),
        Some("watched"),
        None,
    )
    .await?;
    let jobs = Jobs::open(&conn).await?;
    let t0 = Instant::now();
    while jobs
        .get("watched")
        .await?
        .is_none_or(|v| v.value.status != "running")
    {
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(20),
            "the watched job never ran"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    async fn round(work: &Work, jobs: &Jobs, tag: &str, n: usize) -> anyhow::Result<f64> {
        let t0 = Instant::now();
        for i in 0..n {
            work.submit(
                "echo",
                json!({"input": {"i": i}}).to_string().into(),
                Some(&format!("{tag}-{i}")),
                None,
            )
            .await?;
        }
        let last = format!("{tag}-{}", n - 1);
        loop {
            let done = match jobs.get(&last).await? {
                Some(v) => v.value.status == "completed",
                None => false,
            };
            if done {
                break;
            }
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(300),
                "round {tag} did not finish"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        Ok(n as f64 / t0.elapsed().as_secs_f64())
    }
    let idle = round(&work, &jobs, "idle", n).await?;
    let rss_idle = rss_mib(c.pid());
    let mut handles = Vec::new();
    for _ in 0..clients {
        let addr = addr.clone();
        handles.push(tokio::spawn(async move {
            let _ = sse(&addr, "/jobs/watched/live", |_| false).await;
        }));
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    let (cpu0, t_cpu) = (cpu_ticks(c.pid()), Instant::now());
    let busy = round(&work, &jobs, "watched-by-many", n).await?;
    let ticks = cpu_ticks(c.pid()) - cpu0;
    let cpu_pct = ticks as f64 / 100.0 / t_cpu.elapsed().as_secs_f64() * 100.0;
    let rss = rss_mib(c.pid());
    for h in handles {
        h.abort();
    }
    drop(w);
    drop(s);
    let ratio = busy / idle;
    Ok(json!({
        "clients": clients, "echo_jobs": n,
        "jobs_per_s_console_idle": idle, "jobs_per_s_with_clients": busy, "ratio": ratio,
        "console_rss_mib_idle": rss_idle, "console_rss_mib_with_clients": rss,
        "console_cpu_percent_with_clients": cpu_pct,
        "met": ratio >= 0.95,
    }))
}
