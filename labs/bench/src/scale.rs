//! `scale`: the control plane with many **active** jobs (the history part
//! measures finished ones). Two servers side by side, each with a reaper
//! sweeping every second and a worker running a handful of sleep jobs; one
//! also holds `--scale-active` more active jobs, the other
//! [`SMALL`]. The active jobs are written straight into the job bucket and
//! the index (pipelined puts, as the history part seeds), half of them
//! queued in backoff (`wait.<job>`, due in an hour) and half waiting on a
//! durable timer (`hold.<job>`); 2.5 s later, 40 more on both sides (the
//! newest jobs, as they come on a fleet whose jobs come over time).
//!
//! Measured in alternation on the two: the reaper's sweep (its own log),
//! `leasehold list --status queued --limit 10` (and `--sort oldest`, which
//! reads every entry of the status), a worker's start to its
//! session, a second reaper's start to its first sweep (it reads the index
//! whole into its view first), and the resident memory of the reaper, the
//! worker and the server; then a console on each: its start to a jobs page
//! that counts every active job, that page's time to first byte, and its
//! memory; and a console with `--index-view off` on each: its start to a
//! first jobs page, a page of 10 read from the index's end, its memory.
//! Targets (issue 34): each within 1.5x of the small side, and a
//! sweep of at most 100 ms.
//!
//! Then the same on a three-node cluster with the layout at R3
//! (`--scale-cluster-active`, 0 to skip): one cluster, measured with 1,000
//! active jobs, then again once the seeding brought it to the large count.

use std::time::{Duration, Instant, SystemTime};

use leasehold_core::time::rfc3339;
use leasehold_harness::Proc;
use leasehold_store::index::{Active, Key};
use leasehold_store::{Conn, Jobs};
use serde_json::{json, Value};

use crate::common::*;
use crate::history::{
    med, reaper_env, sleeping_on, sleeping_side, start_worker, sweeps, timed_list,
};

/// Active jobs on the small side.
pub const SMALL: usize = 1_000;
/// Within this factor of the small side.
pub const TARGET_RATIO: f64 = 1.5;
/// The absolute target of a sweep, ms.
pub const TARGET_SWEEP_MS: f64 = 100.0;
/// Running sleep jobs on both sides.
const LIVE: usize = 5;
/// Active jobs created on both sides 2.5 s after the seeded ones.
const LATE: usize = 40;
/// The page the console without its view of the index is timed on: 10
/// rows, as `list` above.
const OFF_PAGE: &str = "/jobs?limit=10";
/// Seeding falls back to this many jobs when the asked-for number would
/// not fit the seeding budget.
pub const FALLBACK_ACTIVE: usize = 200_000;

pub struct Opts {
    pub active: usize,
    pub samples: usize,
    pub seed_budget: Duration,
    /// Active jobs on the R3 cluster's large side (0: no cluster side).
    pub cluster_active: usize,
}

/// One server or cluster with its reaper and worker.
struct Side {
    /// The single node's server (`None` on the cluster, whose nodes have
    /// no monitoring port): its memory is reported.
    s: Option<Server>,
    url: String,
    conn: Conn,
    reaper: Proc,
    worker: Proc,
}

impl Side {
    async fn start(tag: &str) -> anyhow::Result<Side> {
        let (s, conn, reaper, worker) = sleeping_side(&format!("scale-{tag}"), LIVE).await?;
        Ok(Side {
            url: s.url(),
            s: Some(s),
            conn,
            reaper,
            worker,
        })
    }
}

/// Seeds `n` active jobs, then, 2.5 s later, [`LATE`] more: as on a fleet
/// whose jobs come over time rather than in one burst, the newest jobs a
/// while after the rest (`list`'s first page reads back to 2 s, the clock
/// allowance, before its last job was created, which covers these alone).
async fn seed_with_late(
    conn: &Conn,
    tag: &str,
    n: usize,
    budget: Duration,
) -> anyhow::Result<Value> {
    let seeded = seed(conn, tag, n, budget).await?;
    tokio::time::sleep(Duration::from_millis(2500)).await;
    seed(conn, &format!("{tag}-late"), LATE, Duration::from_secs(60)).await?;
    Ok(seeded)
}

fn seeded_jobs(v: &Value) -> usize {
    v["jobs"].as_u64().unwrap_or(0) as usize
}

pub async fn scale(o: &Opts) -> anyhow::Result<Value> {
    let small = Side::start("small").await?;
    let large = Side::start("large").await?;
    let seeded_small = seed_with_late(&small.conn, "act", SMALL, Duration::from_secs(600)).await?;
    let seeded = seed_with_late(&large.conn, "act", o.active.max(SMALL), o.seed_budget).await?;
    let want = [SMALL + LATE + LIVE, seeded_jobs(&seeded) + LATE + LIVE];
    let out = measure(&[&small, &large], &want, o).await?;
    let mut v = compare(&out[0], &out[1]);
    v["method"] = json!("two servers side by side, each with a reaper (--interval 1s) and a worker running 5 sleep jobs; the large one also holds the seeded active jobs (half queued in backoff, half waiting on a timer, each created as it was written), the small one 1,000; 2.5 s later 40 more on both; sweeps over the same seconds on both, CLI runs and starts alternated; then a console on each, one after the other, and one with --index-view off on each; list_reads: what one list read of the index, window by window");
    v["seeded"] = seeded;
    v["seeded_small"] = seeded_small;
    // The twins go before the cluster comes: it is measured alone.
    drop((small, large));
    if o.cluster_active > 0 {
        v["r3_cluster"] = cluster(o).await?;
    }
    Ok(v)
}

/// The same figures on a three-node cluster with the layout at R3: one
/// cluster (six servers at once would be more than this machine's two
/// cores measure well), measured with 1,000 active jobs, then again once
/// the seeding brought it to `o.cluster_active`.
async fn cluster(o: &Opts) -> anyhow::Result<Value> {
    let c = tokio::task::spawn_blocking(leasehold_harness::Cluster::start).await?;
    for n in &c.nodes {
        leasehold_harness::wait_for_jetstream(&n.url(), Duration::from_secs(60)).await;
    }
    let url = c.url();
    let conn = leasehold_store::NatsArgs::local(url.clone(), "lh")
        .connect("bench")
        .await?;
    let setup = leasehold_store::setup::SetupOptions {
        replicas: 3,
        ..Default::default()
    };
    // Right after the cluster forms, creating streams can fail while its
    // meta group settles: a few tries.
    let mut tries = 0;
    while let Err(e) = leasehold_store::setup::ensure(&conn, &setup).await {
        tries += 1;
        anyhow::ensure!(tries < 30, "setup at R3: {e}");
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let (reaper, worker) = sleeping_on(&url, &conn, "scale-r3", LIVE).await?;
    let side = Side {
        s: None,
        url,
        conn,
        reaper,
        worker,
    };
    let seeded_small = seed_with_late(&side.conn, "act", SMALL, Duration::from_secs(600)).await?;
    let small_want = seeded_jobs(&seeded_small) + LATE + LIVE;
    let small = measure(&[&side], &[small_want], o).await?.remove(0);
    let more = o.cluster_active.saturating_sub(SMALL).max(SMALL);
    let seeded = seed_with_late(&side.conn, "big", more, o.seed_budget).await?;
    let large_want = small_want + seeded_jobs(&seeded) + LATE;
    let large = measure(&[&side], &[large_want], o).await?.remove(0);
    drop(side);
    drop(c);
    let mut v = compare(&small, &large);
    v["method"] = json!("one 3-node cluster, every stream and bucket at R3, with a reaper (--interval 1s) and a worker running 5 sleep jobs: measured with 1,000 active jobs (and 40 more 2.5 s later), then again after seeding the rest (and 40 more); the same figures as the single node's but the server's memory (the nodes have no monitoring port here)");
    v["seeded_small"] = seeded_small;
    v["seeded"] = seeded;
    Ok(v)
}

/// The figures of each side, `want[k]` active jobs on side `k`: sweeps
/// that saw them all (over the same seconds on every side), CLI runs and
/// starts alternated between the sides, then a console on each, one after
/// the other (each holds the index).
async fn measure(sides: &[&Side], want: &[usize], o: &Opts) -> anyhow::Result<Vec<Value>> {
    // Only the sweeps logged from now on count (a side measured before).
    let from: Vec<usize> = sides.iter().map(|x| x.reaper.output().len()).collect();
    let n = o.samples.max(10);
    let deadline = Instant::now() + Duration::from_secs(120 + 2 * n as u64);
    let swept: Vec<Vec<(f64, u64)>> = loop {
        let all: Vec<Vec<(f64, u64)>> = sides
            .iter()
            .zip(want)
            .zip(&from)
            .map(|((x, w), f)| {
                let log = x.reaper.output();
                sweeps(log.get(*f..).unwrap_or(""))
                    .into_iter()
                    .filter(|s| s.1 as usize >= *w)
                    .collect()
            })
            .collect();
        if all.iter().all(|a| a.len() > n) {
            // The first full sweep may still be settling: skipped.
            break all.iter().map(|a| a[1..=n].to_vec()).collect();
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the reapers logged {:?} full sweeps (want {n}); the last side's log:\n{}",
            all.iter().map(Vec::len).collect::<Vec<_>>(),
            tail(&sides[sides.len() - 1].reaper.output(), 20)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut m: Vec<Samples> = sides.iter().map(|_| Samples::default()).collect();
    for (k, side) in sides.iter().enumerate() {
        list(side).await?;
        m[k].rows = list(side).await?.1;
        m[k].list_reads = list_reads(side).await?;
    }
    // Alternated: a busy moment of the machine hits every side alike.
    let order = |i: usize| -> Vec<usize> {
        let mut o: Vec<usize> = (0..sides.len()).collect();
        if i % 2 == 1 {
            o.reverse();
        }
        o
    };
    for i in 0..o.samples {
        for k in order(i) {
            m[k].list.push(list(sides[k]).await?.0);
        }
        for k in order(i) {
            let (ts, _) = start_worker(&sides[k].url, &sides[k].conn).await?;
            m[k].worker_start.push(ts);
        }
    }
    // Oldest first reads every entry of the status (the index's order is
    // its writes'), so fewer times as well.
    for i in 0..3.min(o.samples) {
        for k in order(i) {
            m[k].list_oldest.push(list_oldest(sides[k]).await?.0);
        }
    }
    // A second reaper's start, fewer times: it reads the index whole.
    for i in 0..3.min(o.samples) {
        for k in order(i) {
            let (took, rss) = reaper_start(&sides[k].url, want[k]).await?;
            m[k].reaper_start.push(took);
            m[k].second_reaper_rss.push(rss);
        }
    }
    // The console: from its start to the jobs page counting every active
    // job (it follows the index into memory), then that page's time to
    // first byte.
    for (k, side) in sides.iter().enumerate() {
        let t0 = Instant::now();
        let (c, addr) = crate::console::console_with(&side.url, &[]).await?;
        let counted = format!("{} matching", want[k]);
        loop {
            let page = http_get_text(&addr, "/jobs").await?;
            if page.contains(&counted) {
                break;
            }
            anyhow::ensure!(
                t0.elapsed() < Duration::from_secs(600),
                "the console did not count {} active jobs within 600 s; its log:\n{}",
                want[k],
                tail(&c.output(), 20)
            );
            // Often enough to time a small index's load (tens of ms); then
            // less, so the polls (each a read of the index's end while the
            // view loads) do not slow the load they time.
            let poll = if t0.elapsed() < Duration::from_secs(1) {
                20
            } else {
                200
            };
            tokio::time::sleep(Duration::from_millis(poll)).await;
        }
        m[k].console_start.push(ms(t0.elapsed()));
        crate::console::sample(&addr, "/jobs", 3).await?;
        m[k].console_ttfb = crate::console::sample(&addr, "/jobs", o.samples.max(5)).await?;
        m[k].console_rss = rss_mib(c.pid());
    }
    // The same without the console's view of the index (`--index-view
    // off`, also how a console serves pages while its view loads): its
    // start to a first jobs page, a page of 10 (as `list` above) read
    // from the index's end, and its memory.
    for (k, side) in sides.iter().enumerate() {
        let t0 = Instant::now();
        let (c, addr) =
            crate::console::console_with(&side.url, &[("LH_CONSOLE_INDEX_VIEW", "off".into())])
                .await?;
        let page = http_get_text(&addr, OFF_PAGE).await?;
        anyhow::ensure!(
            page.contains("id=\"index-view\""),
            "the console with --index-view off did not answer its page: {}",
            tail(&page, 5)
        );
        m[k].console_off_start.push(ms(t0.elapsed()));
        crate::console::sample(&addr, OFF_PAGE, 3).await?;
        m[k].console_off_ttfb = crate::console::sample(&addr, OFF_PAGE, o.samples.max(5)).await?;
        m[k].console_off_rss = rss_mib(c.pid());
    }
    let mut out = Vec::new();
    for (k, side) in sides.iter().enumerate() {
        let varz = match &side.s {
            Some(s) => s.monitor("/varz").await.unwrap_or(Value::Null),
            None => Value::Null,
        };
        let took: Vec<f64> = swept[k].iter().map(|x| x.0).collect();
        out.push(json!({
            "active": want[k],
            "sweep_ms": med(&took),
            "sweep_jobs_seen": swept[k].iter().map(|x| x.1).collect::<Vec<_>>(),
            "list_queued_limit_10_ms": med(&m[k].list),
            "list_rows": m[k].rows,
            "list_oldest_queued_limit_10_ms": med(&m[k].list_oldest),
            "list_reads": m[k].list_reads,
            "worker_start_to_session_ms": med(&m[k].worker_start),
            "reaper_start_to_first_sweep_ms": med(&m[k].reaper_start),
            "reaper_rss_mib": round1(rss_mib(side.reaper.pid())),
            "second_reaper_rss_mib": med(&m[k].second_reaper_rss),
            "worker_rss_mib": round1(rss_mib(side.worker.pid())),
            "server_mem_mib": varz["mem"].as_f64().map(|b| (b / 1048576.0).round()),
            "console_start_to_counted_ms": med(&m[k].console_start),
            "console_jobs_page_ttfb_ms": med(&m[k].console_ttfb),
            "console_rss_mib": round1(m[k].console_rss),
            "console_off_start_to_page_ms": med(&m[k].console_off_start),
            "console_off_jobs_page_ttfb_ms": med(&m[k].console_off_ttfb),
            "console_off_rss_mib": round1(m[k].console_off_rss),
        }));
    }
    Ok(out)
}

/// The large side's figures against the small side's, with the targets.
fn compare(a: &Value, b: &Value) -> Value {
    let cmp = |k: &str, slack: f64| {
        let (x, y) = (f64_of(&a[k]["median"]), f64_of(&b[k]["median"]));
        json!({
            "small_median": x,
            "large_median": y,
            "ratio": y / x,
            "target": format!("<= {TARGET_RATIO}x{}", if slack > 0.0 { format!(" + {slack} (resolution)") } else { String::new() }),
            "met": y <= TARGET_RATIO * x + slack,
        })
    };
    let plain = |k: &str| {
        let (x, y) = (f64_of(&a[k]), f64_of(&b[k]));
        // Not measured (the cluster's nodes have no monitoring port): no verdict.
        let met = (x.is_finite() && y.is_finite()).then_some(y <= TARGET_RATIO * x);
        json!({"small": x, "large": y, "ratio": y / x, "target": format!("<= {TARGET_RATIO}x"), "met": met})
    };
    let sweep_large = f64_of(&b["sweep_ms"]["median"]);
    json!({
        "small": a,
        "large": b,
        "sweep_ms": cmp("sweep_ms", 1.0),
        "sweep_absolute": {"large_median_ms": sweep_large, "target_ms": TARGET_SWEEP_MS, "met": sweep_large <= TARGET_SWEEP_MS},
        "list_queued_limit_10_ms": cmp("list_queued_limit_10_ms", 0.0),
        "list_oldest_queued_limit_10_ms": cmp("list_oldest_queued_limit_10_ms", 0.0),
        "worker_start_to_session_ms": cmp("worker_start_to_session_ms", 0.0),
        "reaper_start_to_first_sweep_ms": cmp("reaper_start_to_first_sweep_ms", 0.0),
        "console_jobs_page_ttfb_ms": cmp("console_jobs_page_ttfb_ms", 0.0),
        "console_start_to_counted_ms": cmp("console_start_to_counted_ms", 0.0),
        "console_off_start_to_page_ms": cmp("console_off_start_to_page_ms", 0.0),
        "console_off_jobs_page_ttfb_ms": cmp("console_off_jobs_page_ttfb_ms", 0.0),
        "reaper_rss_mib": plain("reaper_rss_mib"),
        "worker_rss_mib": plain("worker_rss_mib"),
        "server_mem_mib": plain("server_mem_mib"),
        "console_rss_mib": plain("console_rss_mib"),
        "console_off_rss_mib": plain("console_off_rss_mib"),
    })
}

fn round1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

#[derive(Default)]
struct Samples {
    list: Vec<f64>,
    list_oldest: Vec<f64>,
    rows: usize,
    list_reads: Vec<Value>,
    worker_start: Vec<f64>,
    reaper_start: Vec<f64>,
    second_reaper_rss: Vec<f64>,
    console_start: Vec<f64>,
    console_ttfb: Vec<f64>,
    console_rss: f64,
    console_off_start: Vec<f64>,
    console_off_ttfb: Vec<f64>,
    console_off_rss: f64,
}

/// One `leasehold list --status queued --limit 10`: wall time (ms) and rows.
async fn list(side: &Side) -> anyhow::Result<(f64, usize)> {
    timed_list(
        side.url.clone(),
        &["list", "--status", "queued", "--limit", "10"],
    )
    .await
}

/// One `leasehold list --status queued --sort oldest --limit 10`.
async fn list_oldest(side: &Side) -> anyhow::Result<(f64, usize)> {
    timed_list(
        side.url.clone(),
        &[
            "list", "--status", "queued", "--sort", "oldest", "--limit", "10",
        ],
    )
    .await
}

/// What one such `list` read of the index, window by window (its debug
/// lines: `read`, `from`, `whole`, `enough`).
async fn list_reads(side: &Side) -> anyhow::Result<Vec<Value>> {
    let url = side.url.clone();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new(leasehold_harness::bin_path("leasehold"))
            .args(["list", "--status", "queued", "--limit", "10"])
            .env("NATS_URL", url)
            .env("RUST_LOG", "leasehold_store::index=debug")
            .env("NO_COLOR", "1")
            .output()
    })
    .await??;
    let field = |l: &str, k: &str| {
        l.split_whitespace()
            .find_map(|t| t.strip_prefix(k))
            .map(str::to_string)
    };
    Ok(String::from_utf8_lossy(&out.stderr)
        .lines()
        .filter(|l| l.contains("newest index entries"))
        .map(|l| {
            json!({
                "read": field(l, "read=").and_then(|v| v.parse::<u64>().ok()),
                "from": field(l, "from=").and_then(|v| v.parse::<u64>().ok()),
                "whole": field(l, "whole=").as_deref() == Some("true"),
                "enough": field(l, "enough=").as_deref() == Some("true"),
            })
        })
        .collect())
}

/// A second reaper: ms from its spawn to its first sweep that saw `jobs`
/// active jobs, and its peak resident memory then (MiB); stopped after.
async fn reaper_start(url: &str, jobs: usize) -> anyhow::Result<(f64, f64)> {
    let t0 = Instant::now();
    let mut p = Proc::spawn(
        "leasehold-reaper",
        &[],
        &[
            [("NATS_URL", url.to_string())].as_slice(),
            reaper_env().as_slice(),
        ]
        .concat(),
    );
    let deadline = t0 + Duration::from_secs(300);
    let took = loop {
        if sweeps(&p.output()).iter().any(|x| x.1 as usize >= jobs) {
            break ms(t0.elapsed());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the second reaper never swept {jobs} jobs:\n{}",
            tail(&p.output(), 20)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let rss = round1(rss_mib(p.pid()));
    p.term();
    anyhow::ensure!(
        p.wait_timeout(Duration::from_secs(30)).is_some(),
        "the second reaper did not stop on SIGTERM"
    );
    Ok((took, rss))
}

/// Writes `n` active jobs (`<prefix>-<i>`) straight into the job bucket
/// and the index, 256 in flight, each created as it is written: even ones queued in backoff (due in an hour), odd ones
/// waiting on a timer. When the first 20,000 say the whole would take
/// longer than `budget`, seeds [`FALLBACK_ACTIVE`] instead and says so.
async fn seed(conn: &Conn, prefix: &str, n: usize, budget: Duration) -> anyhow::Result<Value> {
    let jobs = Jobs::open(conn).await?;
    let active = Active::open(conn).await?;
    let (kv, index) = (jobs.kv().clone(), active.kv().clone());
    let later = rfc3339(SystemTime::now() + Duration::from_secs(3600));
    let seeded = seed_many(n, budget, FALLBACK_ACTIVE, 256, "active jobs", |i| {
        let id = format!("{prefix}-{i}");
        // Created as it is written, as a submitted job is.
        let created = SystemTime::now();
        let mut r =
            leasehold_core::machine::new_record(&id, "sleep", Default::default(), 0, created);
        r.next_run_at = Some(later.clone());
        let key = if i % 2 == 0 {
            Key::Wait { job: id.clone() }
        } else {
            r.status = "waiting".into();
            r.waiting_until = Some(later.clone());
            Key::Hold { job: id.clone() }
        };
        let rec = serde_json::to_vec(&r)?;
        let entry = serde_json::to_vec(&leasehold_store::index::Entry::of(&r))?;
        let (kv, index) = (kv.clone(), index.clone());
        Ok(async move {
            kv.put(id, rec.into()).await?;
            index.put(key.as_string(), entry.into()).await?;
            anyhow::Ok(())
        })
    })
    .await?;
    let (target, note, took) = (seeded.n, seeded.note, seeded.seconds);
    Ok(json!({
        "asked": n,
        "jobs": target,
        "fallback": note,
        "seconds": took,
        "per_s": target as f64 / took,
    }))
}

pub fn rows(r: &mut Report, v: &Value) {
    rows_of(r, v, "");
    if v["r3_cluster"].is_object() {
        rows_of(r, &v["r3_cluster"], ", R3 cluster");
    }
}

fn rows_of(r: &mut Report, v: &Value, on: &str) {
    let n = &v["large"]["active"];
    for (k, name) in [
        ("sweep_ms", "reaper sweep ms"),
        (
            "list_queued_limit_10_ms",
            "`leasehold list --status queued --limit 10` ms",
        ),
        (
            "list_oldest_queued_limit_10_ms",
            "`leasehold list --status queued --sort oldest --limit 10` ms",
        ),
        (
            "worker_start_to_session_ms",
            "worker start (--worker-id) to session ms",
        ),
        (
            "reaper_start_to_first_sweep_ms",
            "reaper start to its first full sweep ms",
        ),
        (
            "console_jobs_page_ttfb_ms",
            "console jobs page time to first byte ms",
        ),
        (
            "console_start_to_counted_ms",
            "console start to its jobs page counting them ms",
        ),
        (
            "console_off_start_to_page_ms",
            "console --index-view off: start to a jobs page ms",
        ),
        (
            "console_off_jobs_page_ttfb_ms",
            "console --index-view off: /jobs?limit=10 time to first byte ms",
        ),
    ] {
        let x = &v[k];
        r.cmp(
            format!("{name}, {n} active jobs{on}"),
            format!("{:.1}", f64_of(&x["large_median"])),
            format!(
                "{:.1} with {}",
                f64_of(&x["small_median"]),
                v["small"]["active"]
            ),
            x["target"].as_str().unwrap_or("").to_string(),
            x["met"].as_bool(),
        );
    }
    let s = &v["sweep_absolute"];
    r.cmp(
        format!("reaper sweep ms, {n} active jobs{on} (absolute)"),
        format!("{:.1}", f64_of(&s["large_median_ms"])),
        "-".to_string(),
        format!("<= {TARGET_SWEEP_MS}"),
        s["met"].as_bool(),
    );
    for (k, name) in [
        ("reaper_rss_mib", "reaper RSS MiB"),
        ("worker_rss_mib", "worker RSS MiB"),
        ("server_mem_mib", "nats-server memory MiB"),
        ("console_rss_mib", "console RSS MiB"),
        ("console_off_rss_mib", "console --index-view off RSS MiB"),
    ] {
        let x = &v[k];
        if !f64_of(&x["small"]).is_finite() {
            continue;
        }
        r.cmp(
            format!("{name}, {n} active jobs{on}"),
            format!("{:.1}", f64_of(&x["large"])),
            format!("{:.1} with {}", f64_of(&x["small"]), v["small"]["active"]),
            x["target"].as_str().unwrap_or("").to_string(),
            x["met"].as_bool(),
        );
    }
    if let Some(f) = v["seeded"]["fallback"].as_str() {
        r.row("scale seeding", f.to_string());
    }
}
