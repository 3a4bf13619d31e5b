//! What every part shares: a nats-server with its monitoring port, the
//! processes under test, core-NATS message counters, waiting on records,
//! percentiles, and the report (JSON plus the printed table).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Child;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use leasehold_core::JobRecord;
use leasehold_harness::{free_port, spawn_nats_server, wait_for_jetstream, Proc};
use leasehold_store::setup::{self, SetupOptions};
use leasehold_store::{Conn, Jobs, NatsArgs};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

// ------------------------------------------------------------------ server

/// One JetStream nats-server on free loopback ports, with its HTTP
/// monitoring port on (`/connz`, `/varz`, `/jsz`): the bench reads
/// per-connection byte counts there. Killed when dropped.
pub struct Server {
    child: Option<Child>,
    port: u16,
    http: u16,
    dir: PathBuf,
}

impl Server {
    pub fn start() -> Server {
        let (port, http) = (free_port(), free_port());
        let dir = std::env::temp_dir().join(format!("lh-bench-nats-{}-{port}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp dir");
        let conf = dir.join("nats.conf");
        std::fs::write(
            &conf,
            format!(
                "server_name: lh-bench\nlisten: 127.0.0.1:{port}\nhttp: 127.0.0.1:{http}\n\
                 jetstream {{\n  store_dir: \"{}\"\n  max_memory_store: 256MB\n  max_file_store: 64GB\n}}\n",
                dir.join("js").display()
            ),
        )
        .expect("write nats.conf");
        let child = spawn_nats_server(&conf, &[], &dir.join("server.log"));
        Server {
            child: Some(child),
            port,
            http,
            dir,
        }
    }

    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// A monitoring endpoint's JSON (`/varz`, `/jsz`, `/connz?...`).
    pub async fn monitor(&self, path: &str) -> anyhow::Result<Value> {
        http_get_json(&format!("127.0.0.1:{}", self.http), path).await
    }

    /// The server's counters of the client connection named `name`
    /// (`in_msgs`/`in_bytes`: what the client published; `out_msgs`/
    /// `out_bytes`: what the server delivered to it).
    pub async fn connection(&self, name: &str) -> anyhow::Result<Value> {
        let c = self.monitor("/connz?limit=4096").await?;
        c["connections"]
            .as_array()
            .and_then(|a| a.iter().find(|c| c["name"] == name).cloned())
            .ok_or_else(|| anyhow::anyhow!("no connection named {name:?} on the server"))
    }

    /// Bytes of the JetStream store directory on disk.
    pub fn disk_bytes(&self) -> u64 {
        dir_bytes(&self.dir.join("js"))
    }
}

fn dir_bytes(p: &std::path::Path) -> u64 {
    let Ok(rd) = std::fs::read_dir(p) else {
        return 0;
    };
    rd.filter_map(Result::ok)
        .map(|e| match e.metadata() {
            Ok(m) if m.is_dir() => dir_bytes(&e.path()),
            Ok(m) => m.len(),
            Err(_) => 0,
        })
        .sum()
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Publishes the submissions `<prefix>-<i>` (their `Nats-Msg-Id`), `i` in
/// `ids`, each `spec(i)`, on `subject`, with at most 512 awaiting their
/// acks (the server's pending acks stay small).
pub async fn publish_many(
    js: &async_nats::jetstream::Context,
    subject: &str,
    ids: std::ops::Range<usize>,
    prefix: &str,
    spec: impl Fn(usize) -> Value,
) -> anyhow::Result<()> {
    use std::future::IntoFuture;
    let mut acks = futures::stream::FuturesUnordered::new();
    for i in ids {
        let m = async_nats::jetstream::message::PublishMessage::build()
            .payload(spec(i).to_string().into())
            .message_id(format!("{prefix}-{i}"));
        acks.push(js.send_publish(subject.to_string(), m).await?.into_future());
        if acks.len() >= 512 {
            acks.next().await.transpose()?;
        }
    }
    while acks.next().await.transpose()?.is_some() {}
    Ok(())
}

/// A fresh server with `leasehold setup`'s layout (`o`) and a connection.
pub async fn server(o: SetupOptions) -> anyhow::Result<(Server, Conn)> {
    let s = Server::start();
    wait_for_jetstream(&s.url(), Duration::from_secs(10)).await;
    let conn = NatsArgs::local(s.url(), "lh").connect("bench").await?;
    setup::ensure(&conn, &o).await?;
    Ok((s, conn))
}

/// GET over plain HTTP/1.0: the whole answer, headers and body.
pub async fn http_get_text(addr: &str, path: &str) -> anyhow::Result<String> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await?;
    Ok(String::from_utf8_lossy(&buf).into_owned())
}

/// GET over plain HTTP/1.0, the body parsed as JSON.
pub async fn http_get_json(addr: &str, path: &str) -> anyhow::Result<Value> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await?;
    let buf = String::from_utf8_lossy(&buf);
    let body = buf.split_once("\r\n\r\n").map_or("", |(_, b)| b);
    serde_json::from_str(body).map_err(|e| anyhow::anyhow!("GET {path}: {e}"))
}

// --------------------------------------------------------------- processes

/// The environment of a bench worker: the test kinds allowed, the server's
/// defaults for everything liveness-related (session timeout 10 s, renewal
/// every 2 s, index after 1 s) unless `extra` says otherwise.
pub fn worker_env(url: &str, extra: &[(&'static str, String)]) -> Vec<(&'static str, String)> {
    let mut e = vec![
        ("NATS_URL", url.to_string()),
        ("LH_PULL_EXPIRES", "250ms".into()),
        ("LH_DRAIN_TIMEOUT", "0s".into()),
        ("LH_KINDS", "echo,sleep".into()),
        // The bench's kinds are test kinds: served only when allowed.
        ("LH_DEV_KINDS", "1".into()),
        ("RUST_LOG", "warn".into()),
    ];
    for (k, v) in extra {
        e.retain(|(k2, _)| k2 != k);
        e.push((k, v.clone()));
    }
    e
}

pub fn worker(url: &str, extra: &[(&'static str, String)]) -> Proc {
    worker_from(None, url, extra)
}

/// A bench worker from the binaries in `bins` (another build's, a baseline
/// release), or this build's when `None`.
pub fn worker_from(bins: Option<&Path>, url: &str, extra: &[(&'static str, String)]) -> Proc {
    match bins {
        Some(dir) => Proc::spawn_path(
            &dir.join("leasehold-worker"),
            &[],
            &worker_env(url, extra),
            None,
        ),
        None => Proc::spawn("leasehold-worker", &[], &worker_env(url, extra)),
    }
}

/// A reaper process (its defaults unless `extra` says otherwise); returns
/// once it logged that it started.
pub async fn reaper(url: &str, extra: &[(&'static str, String)]) -> anyhow::Result<Proc> {
    let mut env = vec![
        ("NATS_URL", url.to_string()),
        ("RUST_LOG", "info".to_string()),
    ];
    for (k, v) in extra {
        env.retain(|(k2, _)| k2 != k);
        env.push((k, v.clone()));
    }
    let p = Proc::spawn("leasehold-reaper", &[], &env);
    wait_log(&p, "reaper starting", Duration::from_secs(20)).await?;
    Ok(p)
}

/// Polls a process's log for a line (processes give no other signal).
pub async fn wait_log(p: &Proc, needle: &str, timeout: Duration) -> anyhow::Result<Instant> {
    let deadline = Instant::now() + timeout;
    loop {
        if p.output().contains(needle) {
            return Ok(Instant::now());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "{} never logged {needle:?} within {timeout:?}:\n{}",
            p.name(),
            tail(&p.output(), 40)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

pub fn tail(s: &str, lines: usize) -> String {
    let v: Vec<&str> = s.lines().collect();
    v[v.len().saturating_sub(lines)..].join("\n")
}

/// Peak resident set (VmHWM) of a process, MiB.
pub fn rss_mib(pid: u32) -> f64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmHWM:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

/// Waits until `worker_id`'s session key is live (the worker process is
/// connected and its pull loops are starting).
pub async fn wait_session(conn: &Conn, worker_id: &str) -> anyhow::Result<Instant> {
    let s = leasehold_store::sessions::Sessions::open(conn).await?;
    let mut w = s.kv().watch_with_history(worker_id).await?;
    loop {
        let e = tokio::time::timeout(Duration::from_secs(30), w.next())
            .await
            .map_err(|_| anyhow::anyhow!("no session of {worker_id} within 30 s"))?
            .ok_or_else(|| anyhow::anyhow!("session watch ended"))??;
        if e.operation == async_nats::jetstream::kv::Operation::Put {
            return Ok(Instant::now());
        }
    }
}

/// Waits until the index of active jobs lists `job` as running.
pub async fn wait_indexed(conn: &Conn, job: &str) -> anyhow::Result<Instant> {
    let a = leasehold_store::index::Active::open(conn).await?;
    let mut w = a.kv().watch_with_history(format!("run.*.{job}")).await?;
    loop {
        let e = tokio::time::timeout(Duration::from_secs(30), w.next())
            .await
            .map_err(|_| anyhow::anyhow!("{job} not indexed within 30 s"))?
            .ok_or_else(|| anyhow::anyhow!("index watch ended"))??;
        if e.operation == async_nats::jetstream::kv::Operation::Put {
            return Ok(Instant::now());
        }
    }
}

// -------------------------------------------------------------- records

pub fn terminal(status: &str) -> bool {
    matches!(
        status,
        "completed" | "failed" | "parked" | "dead" | "cancelled" | "rejected"
    )
}

/// Waits until the job's record satisfies `pred`; returns when it was seen.
pub async fn wait_record(
    jobs: &Jobs,
    id: &str,
    pred: impl Fn(&JobRecord) -> bool,
) -> anyhow::Result<Instant> {
    Ok(wait_rec(jobs, id, pred).await?.0)
}

/// Like [`wait_record`], also returning the record that satisfied `pred`.
pub async fn wait_rec(
    jobs: &Jobs,
    id: &str,
    pred: impl Fn(&JobRecord) -> bool,
) -> anyhow::Result<(Instant, JobRecord)> {
    let mut w = jobs.watch(id).await?;
    next_rec(&mut w, id, Duration::from_secs(60), pred).await
}

/// The next record on an open watch of one job that satisfies `pred`.
pub async fn next_rec(
    w: &mut async_nats::jetstream::kv::Watch,
    id: &str,
    timeout: Duration,
    pred: impl Fn(&JobRecord) -> bool,
) -> anyhow::Result<(Instant, JobRecord)> {
    next_after(w, id, timeout, 0, pred).await
}

/// Like [`next_rec`], among revisions above `after` only (a watch replays
/// what it buffered before a fault; this skips it).
pub async fn next_after(
    w: &mut async_nats::jetstream::kv::Watch,
    id: &str,
    timeout: Duration,
    after: u64,
    pred: impl Fn(&JobRecord) -> bool,
) -> anyhow::Result<(Instant, JobRecord)> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let e = tokio::time::timeout_at(deadline, w.next())
            .await
            .map_err(|_| anyhow::anyhow!("{id}: no awaited record change within {timeout:?}"))?
            .ok_or_else(|| anyhow::anyhow!("watch ended"))??;
        if e.revision <= after {
            continue;
        }
        if let Ok(r) = leasehold_store::jobs::decode(id, &e.value) {
            if pred(&r) {
                return Ok((Instant::now(), r));
            }
        }
    }
}

/// After a fault: the first record write above revision `after` (when it
/// was seen), then the first that satisfies `pred` (which may be that same
/// write).
pub async fn first_then(
    w: &mut async_nats::jetstream::kv::Watch,
    id: &str,
    timeout: Duration,
    after: u64,
    pred: impl Fn(&JobRecord) -> bool,
) -> anyhow::Result<(Instant, Instant, JobRecord)> {
    let mut first = None;
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let e = tokio::time::timeout_at(deadline, w.next())
            .await
            .map_err(|_| {
                anyhow::anyhow!(
                    "{id}: {} within {timeout:?}",
                    if first.is_some() {
                        "written, but not as awaited,"
                    } else {
                        "no record write"
                    }
                )
            })?
            .ok_or_else(|| anyhow::anyhow!("watch ended"))??;
        if e.revision <= after {
            continue;
        }
        let now = Instant::now();
        let t1 = *first.get_or_insert(now);
        if let Ok(r) = leasehold_store::jobs::decode(id, &e.value) {
            if pred(&r) {
                return Ok((t1, now, r));
            }
        }
    }
}

/// The record's current KV revision (0: none).
pub async fn revision(jobs: &Jobs, id: &str) -> anyhow::Result<u64> {
    Ok(jobs.get(id).await?.map_or(0, |v| v.revision))
}

/// Cancels a job as `leasehold cancel` does (a request on its cancel
/// subject, which the workers answer and pass to the owner) and waits until
/// it is terminal, so nothing is left running between repetitions.
pub async fn finish(conn: &Conn, id: &str) -> anyhow::Result<()> {
    let jobs = Jobs::open(conn).await?;
    let mut w = jobs.watch(id).await?;
    let asked = tokio::time::timeout(
        Duration::from_secs(3),
        conn.client
            .request(conn.layout.cancel_subject(id), "".into()),
    )
    .await;
    if !matches!(asked, Ok(Ok(_))) {
        let events = leasehold_store::events::Events::new(conn);
        let signals = leasehold_store::signals::Signals::new(conn);
        leasehold_store::jobs::cancel(&jobs, &events, &signals, id).await;
    }
    next_rec(&mut w, id, Duration::from_secs(60), |r| terminal(&r.status))
        .await
        .map_err(|e| anyhow::anyhow!("cancelling {id}: {e}"))?;
    Ok(())
}

// -------------------------------------------------------------- counters

/// Counts the messages (and bytes) on a core-NATS subscription, by a key
/// the classifier derives from each message. A core subscription on the
/// same server sees every publish to the subject (a JetStream publish is a
/// core publish the server also stores), whoever sends it.
pub struct Counter {
    counts: Arc<Mutex<BTreeMap<String, (u64, u64)>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Counter {
    pub async fn start(
        client: &async_nats::Client,
        subject: &str,
        classify: fn(&async_nats::Message) -> Option<String>,
    ) -> anyhow::Result<Counter> {
        let mut sub = client.subscribe(subject.to_string()).await?;
        client.flush().await?;
        let counts: Arc<Mutex<BTreeMap<String, (u64, u64)>>> = Arc::default();
        let c2 = counts.clone();
        let task = tokio::spawn(async move {
            while let Some(m) = sub.next().await {
                if let Some(k) = classify(&m) {
                    let mut c = c2.lock().unwrap();
                    let e = c.entry(k).or_default();
                    e.0 += 1;
                    e.1 += m.payload.len() as u64;
                }
            }
        });
        Ok(Counter { counts, task })
    }

    /// Counts so far, by key: (messages, payload bytes).
    pub fn snapshot(&self) -> BTreeMap<String, (u64, u64)> {
        self.counts.lock().unwrap().clone()
    }

    pub fn reset(&self) {
        self.counts.lock().unwrap().clear();
    }
}

impl Drop for Counter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Every message counted under one key.
pub fn all(_: &async_nats::Message) -> Option<String> {
    Some("all".into())
}

/// `$KV.<bucket>.<key>` and other subjects: by their first two tokens.
pub fn by_bucket(m: &async_nats::Message) -> Option<String> {
    let mut it = m.subject.as_str().splitn(3, '.');
    Some(format!(
        "{}.{}",
        it.next().unwrap_or(""),
        it.next().unwrap_or("")
    ))
}

/// Acks on `$JS.ACK.<stream>.<consumer>...`: by stream and ack kind (an
/// empty payload is a plain ack).
pub fn by_ack(m: &async_nats::Message) -> Option<String> {
    let stream = m.subject.as_str().split('.').nth(2).unwrap_or("?");
    let p = &m.payload[..];
    let kind = if p.is_empty() || p.starts_with(b"+ACK") {
        "ack"
    } else if p.starts_with(b"-NAK") {
        "nak"
    } else if p.starts_with(b"+WPI") {
        "progress"
    } else if p.starts_with(b"+TERM") {
        "term"
    } else if p.starts_with(b"+NXT") {
        "next"
    } else {
        "other"
    };
    Some(format!("{stream}:{kind}"))
}

// ----------------------------------------------------------------- stats

pub fn pct(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    // Nearest rank: the smallest sample with at least q of them at or below.
    let rank = (q * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

pub fn median(v: &[f64]) -> f64 {
    pct(v, 0.5)
}

/// p50/p95/max (rounded to 0.01) and the samples.
pub fn summary(v: &[f64]) -> Value {
    let r = |x: f64| (x * 100.0).round() / 100.0;
    json!({
        "n": v.len(),
        "p50": r(pct(v, 0.5)),
        "p95": r(pct(v, 0.95)),
        "max": r(v.iter().copied().fold(f64::NAN, f64::max)),
        "samples": v.iter().map(|x| r(*x)).collect::<Vec<_>>(),
    })
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

pub fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        0.0
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

pub fn f64_of(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

// ---------------------------------------------------------------- report

/// One printed line: the figure, its value, the baseline it is compared
/// with (measured in the same run), and the target with whether it was met.
pub struct Row {
    pub figure: String,
    pub value: String,
    pub baseline: String,
    pub target: String,
    pub met: Option<bool>,
}

#[derive(Default)]
pub struct Report {
    pub json: serde_json::Map<String, Value>,
    pub rows: Vec<Row>,
}

impl Report {
    pub fn row(&mut self, figure: impl Into<String>, value: impl Into<String>) {
        self.rows.push(Row {
            figure: figure.into(),
            value: value.into(),
            baseline: String::new(),
            target: String::new(),
            met: None,
        });
    }

    pub fn cmp(
        &mut self,
        figure: impl Into<String>,
        value: impl Into<String>,
        baseline: impl Into<String>,
        target: impl Into<String>,
        met: Option<bool>,
    ) {
        self.rows.push(Row {
            figure: figure.into(),
            value: value.into(),
            baseline: baseline.into(),
            target: target.into(),
            met,
        });
    }

    pub fn print(&self) {
        let w = self
            .rows
            .iter()
            .map(|r| r.figure.len())
            .max()
            .unwrap_or(0)
            .max(40);
        let wb = self
            .rows
            .iter()
            .map(|r| r.baseline.len())
            .max()
            .unwrap_or(0)
            .max(8);
        let wt = self
            .rows
            .iter()
            .map(|r| r.target.len())
            .max()
            .unwrap_or(0)
            .max(6);
        println!(
            "{:<w$} {:>14}  {:<wb$}  {:<wt$}  met",
            "figure", "value", "baseline", "target"
        );
        for r in &self.rows {
            let met = match r.met {
                Some(true) => "yes",
                Some(false) => "NO",
                None => "",
            };
            println!(
                "{:<w$} {:>14}  {:<wb$}  {:<wt$}  {met}",
                r.figure, r.value, r.baseline, r.target
            );
        }
    }
}

/// What [`seed_many`] wrote.
pub struct Seeded {
    /// How many it wrote (the fallback when the asked-for number would not
    /// fit the budget).
    pub n: usize,
    /// Why it wrote the fallback instead, when it did.
    pub note: Option<String>,
    pub seconds: f64,
}

/// Runs `write(i)` for `i` in `0..n`, `in_flight` at once. When the first
/// 20,000 say the whole would take longer than `budget`, writes `fallback`
/// instead and says so (`what` names the items, on stderr and in the note).
pub async fn seed_many<F>(
    n: usize,
    budget: Duration,
    fallback: usize,
    in_flight: usize,
    what: &str,
    mut write: impl FnMut(usize) -> anyhow::Result<F>,
) -> anyhow::Result<Seeded>
where
    F: std::future::Future<Output = anyhow::Result<()>>,
{
    let t0 = Instant::now();
    let mut target = n;
    let mut note = None;
    let mut pending = futures::stream::FuturesUnordered::new();
    let probe = 20_000.min(n);
    let mut i = 0;
    while i < target {
        pending.push(write(i)?);
        while pending.len() >= in_flight {
            pending.next().await.transpose()?;
        }
        i += 1;
        if i == probe && target > fallback {
            let rate = probe as f64 / t0.elapsed().as_secs_f64();
            let projected = target as f64 / rate;
            if projected > budget.as_secs_f64() {
                note = Some(format!(
                    "{target} {what} would take about {projected:.0} s to seed at {rate:.0}/s (budget {} s): seeded {fallback} instead",
                    budget.as_secs()
                ));
                eprintln!("{}", note.as_deref().unwrap_or(""));
                target = fallback;
            }
        }
    }
    while pending.next().await.transpose()?.is_some() {}
    Ok(Seeded {
        n: target,
        note,
        seconds: t0.elapsed().as_secs_f64(),
    })
}
