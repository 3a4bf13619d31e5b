//! Part 4: the active paths must not pay for history. With a handful of
//! running jobs, the reaper's sweep time, `leasehold list --status running`
//! and the start of a worker with a stable `--worker-id` are measured on
//! an empty history and again after N finished records were written
//! straight into the job bucket (pipelined puts, as the liveness tests
//! seed them).

use std::process::Command;
use std::time::{Duration, Instant};

use futures::StreamExt;
use leasehold_harness::{bin_path, Proc};
use leasehold_store::setup::SetupOptions;
use leasehold_store::work::Work;
use leasehold_store::{Conn, Jobs};
use serde_json::{json, Value};

use crate::common::*;

/// Within this factor of the empty case.
pub const TARGET_RATIO: f64 = 1.2;
/// Running jobs present in both cases.
const LIVE: usize = 5;
/// Seeding falls back to this many records when the asked-for number
/// would not fit the seeding budget.
pub const FALLBACK_RECORDS: usize = 200_000;

pub struct Opts {
    pub records: usize,
    pub samples: usize,
    pub seed_budget: Duration,
}

/// One server with a reaper, a worker holding a handful of running jobs,
/// and (for one of the two) the seeded history.
struct Side {
    s: Server,
    conn: Conn,
    reaper: Proc,
    _bg: Proc,
}

impl Side {
    async fn start() -> anyhow::Result<Side> {
        let (s, conn, reaper, bg) = sleeping_side("hist-bg", LIVE).await?;
        Ok(Side {
            s,
            conn,
            reaper,
            _bg: bg,
        })
    }
}

/// The reaper's environment: a sweep every second (a handful are quick to
/// collect), each sweep logged.
pub(crate) fn reaper_env() -> [(&'static str, String); 2] {
    [
        ("LH_INTERVAL", "1s".into()),
        (
            "RUST_LOG",
            "info,leasehold_reaper::service::sweep=debug".into(),
        ),
    ]
}

/// A fresh server with a reaper ([`reaper_env`]) and a worker `worker_id`
/// running `live` sleep jobs of an hour (indexed): the server, a
/// connection, the reaper and the worker.
pub(crate) async fn sleeping_side(
    worker_id: &str,
    live: usize,
) -> anyhow::Result<(Server, Conn, Proc, Proc)> {
    let (s, conn) = server(SetupOptions::default()).await?;
    let (reaper, worker) = sleeping_on(&s.url(), &conn, worker_id, live).await?;
    Ok((s, conn, reaper, worker))
}

/// On the server (or cluster) at `url`: a reaper ([`reaper_env`]) and a
/// worker `worker_id` running `live` sleep jobs of an hour (indexed).
pub(crate) async fn sleeping_on(
    url: &str,
    conn: &Conn,
    worker_id: &str,
    live: usize,
) -> anyhow::Result<(Proc, Proc)> {
    let reaper = reaper(url, &reaper_env()).await?;
    let worker = worker(
        url,
        &[
            ("LH_WORKER_ID", worker_id.into()),
            ("LH_KINDS", "sleep".into()),
        ],
    );
    wait_session(conn, worker_id).await?;
    let work = Work::new(conn);
    for i in 0..live {
        work.submit(
            "sleep",
            json!({"input": {"ms": 3_600_000}}).to_string().into(),
            Some(&format!("live-{i}")),
            None,
        )
        .await?;
    }
    for i in 0..live {
        wait_indexed(conn, &format!("live-{i}")).await?;
    }
    Ok((reaper, worker))
}

/// Two servers side by side, one empty and one with the history, measured
/// in alternation (so a busy moment of the machine hits both alike).
pub async fn history(o: &Opts) -> anyhow::Result<Value> {
    let empty = Side::start().await?;
    let full = Side::start().await?;
    let seeded = seed(&full.s, &full.conn, o.records, o.seed_budget).await?;
    let sides = [&empty, &full];
    // Sweeps over the same stretch of time on both.
    let sweeps_n = o.samples.max(10);
    let seen: Vec<usize> = sides
        .iter()
        .map(|x| sweeps(&x.reaper.output()).len() + 1)
        .collect();
    let deadline = Instant::now() + Duration::from_secs(30 + 2 * sweeps_n as u64);
    let swept: Vec<Vec<(f64, u64)>> = loop {
        let all: Vec<Vec<(f64, u64)>> = sides.iter().map(|x| sweeps(&x.reaper.output())).collect();
        if all.iter().zip(&seen).all(|(a, s)| a.len() >= s + sweeps_n) {
            break all
                .iter()
                .zip(&seen)
                .map(|(a, s)| a[*s..s + sweeps_n].to_vec())
                .collect();
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the reapers logged {:?} sweeps; log:\n{}",
            all.iter().map(Vec::len).collect::<Vec<_>>(),
            tail(&full.reaper.output(), 20)
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let mut m = [Samples::default(), Samples::default()];
    // One warm-up each, then the samples in alternating order.
    for (k, side) in sides.iter().enumerate() {
        list(side).await?;
        m[k].rows = list(side).await?.1;
    }
    for i in 0..o.samples {
        let order = if i % 2 == 0 { [0, 1] } else { [1, 0] };
        for k in order {
            m[k].list.push(list(sides[k]).await?.0);
        }
        for k in order {
            let (ts, tl) = start(sides[k]).await?;
            m[k].to_session.push(ts);
            m[k].to_log.push(tl);
        }
    }
    let mut out = Vec::new();
    for (k, side) in sides.iter().enumerate() {
        let metrics: Value = match side
            .conn
            .client
            .request(side.conn.layout.reaper_metrics_subject(), "".into())
            .await
        {
            Ok(m) => serde_json::from_slice(&m.payload).unwrap_or(Value::Null),
            Err(_) => Value::Null,
        };
        let varz = side.s.monitor("/varz").await.unwrap_or(Value::Null);
        let took: Vec<f64> = swept[k].iter().map(|x| x.0).collect();
        out.push(json!({
            "sweep_ms": med(&took),
            "sweep_jobs_seen": swept[k].iter().map(|x| x.1).collect::<Vec<_>>(),
            "reaper_metrics_jobs": metrics["jobs"],
            "list_running_ms": med(&m[k].list),
            "list_running_rows": m[k].rows,
            "worker_start_to_session_ms": med(&m[k].to_session),
            "worker_start_to_log_ms": med(&m[k].to_log),
            "server_mem_mib": varz["mem"].as_f64().map(|b| (b / 1048576.0).round()),
        }));
    }
    let (e, f) = (&out[0], &out[1]);
    let cmp = |k: &str, slack: f64| {
        let (e, f) = (f64_of(&e[k]["median"]), f64_of(&f[k]["median"]));
        json!({
            "empty_median": e,
            "history_median": f,
            "ratio": f / e,
            "target": format!("<= {TARGET_RATIO} x empty{}", if slack > 0.0 { format!(" + {slack} (resolution)") } else { String::new() }),
            "met": f <= TARGET_RATIO * e + slack,
        })
    };
    Ok(json!({
        "method": "two servers side by side, each with a reaper (--interval 1s) and a worker holding 5 running sleep jobs; one also holds the seeded finished records; sweeps collected over the same seconds on both, CLI runs and worker starts alternated between them",
        "running_jobs": LIVE,
        "seeded": seeded,
        "empty": e,
        "with_history": f,
        // The reaper logs whole milliseconds: one of them is its resolution.
        "sweep_ms": cmp("sweep_ms", 1.0),
        "list_running_ms": cmp("list_running_ms", 0.0),
        "worker_start_to_session_ms": cmp("worker_start_to_session_ms", 0.0),
        "worker_start_to_log_ms": cmp("worker_start_to_log_ms", 0.0),
    }))
}

#[derive(Default)]
struct Samples {
    list: Vec<f64>,
    rows: usize,
    to_session: Vec<f64>,
    to_log: Vec<f64>,
}

/// How long a sweep took (ms) and its `jobs` for every `sweep` line the
/// reaper logged so far: `took=7ms` / `took=1.2s` (human units), or
/// `took_ms=7` from a baseline release.
pub(crate) fn sweeps(log: &str) -> Vec<(f64, u64)> {
    let raw = |l: &str, k: &str| {
        l.split_whitespace()
            .find_map(|t| t.strip_prefix(k))
            .map(|v| v.trim_matches('"').to_string())
    };
    let field = |l: &str, k: &str| {
        raw(l, k).map(|v| v.trim_matches(|c: char| !c.is_ascii_digit()).to_string())
    };
    let took_ms = |l: &str| -> Option<f64> {
        if let Some(v) = field(l, "took_ms=") {
            return v.parse().ok();
        }
        let v = raw(l, "took=")?;
        if let Some(ms) = v.strip_suffix("ms") {
            return ms.parse().ok();
        }
        if let Some(s) = v.strip_suffix('s').filter(|s| !s.contains(' ')) {
            if let Ok(s) = s.parse::<f64>() {
                return Some(s * 1000.0);
            }
        }
        leasehold_core::time::parse_duration(&v)
            .ok()
            .map(|d| d.as_secs_f64() * 1000.0)
    };
    log.lines()
        .filter(|l| l.contains("took_ms=") || (l.contains(" sweep ") && l.contains("took=")))
        .filter_map(|l| {
            let took = took_ms(l)?;
            let jobs = field(l, "jobs=").and_then(|j| j.parse().ok()).unwrap_or(0);
            Some((took, jobs))
        })
        .collect()
}

/// One `leasehold list --status running`: wall time (ms) and rows listed.
async fn list(side: &Side) -> anyhow::Result<(f64, usize)> {
    timed_list(side.s.url(), &["list", "--status", "running"]).await
}

/// One `leasehold` command listing jobs (`args`) against `url`: wall time
/// (ms) and the rows printed (the header line aside).
pub(crate) async fn timed_list(url: String, args: &[&str]) -> anyhow::Result<(f64, usize)> {
    let args: Vec<String> = args.iter().map(|a| a.to_string()).collect();
    let t0 = Instant::now();
    let out = tokio::task::spawn_blocking(move || {
        Command::new(bin_path("leasehold"))
            .args(&args)
            .env("NATS_URL", url)
            .output()
    })
    .await??;
    let took = ms(t0.elapsed());
    anyhow::ensure!(
        out.status.success(),
        "leasehold list failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows = String::from_utf8_lossy(&out.stdout)
        .lines()
        .count()
        .saturating_sub(1);
    Ok((took, rows))
}

/// A figure's samples: their median, their minimum and the samples.
pub(crate) fn med(v: &[f64]) -> Value {
    json!({"median": median(v), "min": v.iter().copied().fold(f64::NAN, f64::min), "samples": v})
}

/// A worker with a stable identity, started, then stopped with SIGTERM:
/// ms from the spawn to its session key, and to its `worker starting` line.
async fn start(side: &Side) -> anyhow::Result<(f64, f64)> {
    start_worker(&side.s.url(), &side.conn).await
}

/// [`start`] against server `s` (connected as `conn`).
pub(crate) async fn start_worker(url: &str, conn: &Conn) -> anyhow::Result<(f64, f64)> {
    let sessions = leasehold_store::sessions::Sessions::open(conn).await?;
    let mut w = sessions.kv().watch("hist-start").await?;
    let t0 = Instant::now();
    let mut p = Proc::spawn(
        "leasehold-worker",
        &["--worker-id", "hist-start"],
        &worker_env(
            url,
            &[("LH_KINDS", "sleep".into()), ("RUST_LOG", "info".into())],
        ),
    );
    let session = async {
        loop {
            match w.next().await {
                Some(Ok(e)) if e.operation == async_nats::jetstream::kv::Operation::Put => {
                    return Ok(Instant::now())
                }
                Some(Ok(_)) => continue,
                Some(Err(e)) => return Err(anyhow::anyhow!("session watch: {e}")),
                None => return Err(anyhow::anyhow!("session watch ended")),
            }
        }
    };
    let (ts, tl) = tokio::join!(
        tokio::time::timeout(Duration::from_secs(30), session),
        wait_log(&p, "worker starting", Duration::from_secs(30))
    );
    let ts = ts.map_err(|_| anyhow::anyhow!("no session of hist-start within 30 s"))??;
    let tl = tl?;
    p.term();
    anyhow::ensure!(
        p.wait_timeout(Duration::from_secs(20)).is_some(),
        "the worker did not stop on SIGTERM"
    );
    Ok((ms(ts - t0), ms(tl - t0)))
}

/// Writes `n` completed records straight into the job bucket, 512 puts in
/// flight. When the first 20,000 say the whole would take longer than
/// `budget`, seeds [`FALLBACK_RECORDS`] instead and says so.
async fn seed(s: &Server, conn: &Conn, n: usize, budget: Duration) -> anyhow::Result<Value> {
    let jobs = Jobs::open(conn).await?;
    let kv = jobs.kv().clone();
    let now = std::time::SystemTime::now();
    let seeded = seed_many(n, budget, FALLBACK_RECORDS, 512, "records", |i| {
        let mut r = leasehold_core::machine::new_record(
            &format!("old-{i}"),
            "echo",
            Default::default(),
            0,
            now,
        );
        r.status = "completed".into();
        let kv = kv.clone();
        let bytes = serde_json::to_vec(&r)?;
        Ok(async move {
            kv.put(r.id, bytes.into()).await?;
            anyhow::Ok(())
        })
    })
    .await?;
    let (target, note, took) = (seeded.n, seeded.note, seeded.seconds);
    let info = conn
        .js
        .get_stream(format!("KV_{}", conn.layout.jobs_bucket()))
        .await?
        .info()
        .await?
        .state
        .clone();
    let varz = s.monitor("/varz").await.unwrap_or(Value::Null);
    Ok(json!({
        "asked": n,
        "records": target,
        "fallback": note,
        "seconds": took,
        "per_s": target as f64 / took,
        "jobs_bucket_bytes": info.bytes,
        "jobs_bucket_messages": info.messages,
        "store_disk_mib": (s.disk_bytes() as f64 / 1048576.0).round(),
        "server_mem_mib": varz["mem"].as_f64().map(|b| (b / 1048576.0).round()),
    }))
}

pub fn rows(r: &mut Report, v: &Value) {
    let n = &v["seeded"]["records"];
    for (k, name) in [
        ("sweep_ms", "reaper sweep ms"),
        ("list_running_ms", "`leasehold list --status running` ms"),
        (
            "worker_start_to_session_ms",
            "worker start (--worker-id) to session ms",
        ),
        (
            "worker_start_to_log_ms",
            "worker start to `worker starting` ms",
        ),
    ] {
        let x = &v[k];
        r.cmp(
            format!("{name}, {n} finished records"),
            format!("{:.1}", f64_of(&x["history_median"])),
            format!("empty {:.1}", f64_of(&x["empty_median"])),
            x["target"].as_str().unwrap_or("").replace(" x empty", "x"),
            x["met"].as_bool(),
        );
    }
    if let Some(f) = v["seeded"]["fallback"].as_str() {
        r.row("history seeding", f.to_string());
    }
}

#[cfg(test)]
mod tests {
    use super::sweeps;

    #[test]
    fn sweep_lines_are_read_in_human_units_and_the_baselines_milliseconds() {
        let log = "\
2026-12-01T15:15:54Z  INFO leasehold_reaper::service: sweep reaper_id=r jobs=3 took=7ms
2026-12-01T15:15:55Z  INFO leasehold_reaper::service: sweep reaper_id=r jobs=4 took=1.5s
2026-12-01T15:15:56Z  INFO leasehold_reaper::service: sweep reaper_id=r jobs=5 took_ms=12
2026-12-01T15:15:57Z  INFO leasehold_worker::service::attempt: attempt ended took=9ms";
        assert_eq!(sweeps(log), vec![(7.0, 3), (1500.0, 4), (12.0, 5)]);
    }
}
