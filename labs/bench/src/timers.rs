//! `timers`: durable timers (`ctx.sleep`) on one worker with 16 slots.
//!
//! - Cost of sleeping jobs: 1,000 then 10,000 jobs each asleep for an hour.
//!   With each, the slots the worker holds (its in-flight gauge), the `$KV`
//!   writes per second in a steady window (counted by a core subscription)
//!   and the process's resident memory; the 10,000 figures against the
//!   1,000 ones of the same run (flat: no slot, no periodic write, no
//!   memory per sleeping job beyond its wake-up entry).
//! - Wake latency: jobs sleeping two seconds and more, due 100 ms apart;
//!   from the time a job's wait
//!   names to the step after its `sleep` running again (the wake-up's
//!   ticket, the claim, the replay), p50/p95.
//! - Signal wake latency: jobs waiting for a signal (`ctx.wait_for`), sent
//!   one at a time once the job is `waiting`; from just before the send to
//!   the step after its `wait_for` running (the shared waker's look, the
//!   ticket, the claim, the replay), p50/p95.
//!
//! The kind runs in an in-process worker built with `leasehold::Worker`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime};

use futures::StreamExt;
use leasehold::{AttemptOutcome, Count, Ctx, Error, Kind, Options};
use leasehold_store::index::{Active, Filter};
use leasehold_store::setup::SetupOptions;
use leasehold_store::Jobs;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::common::*;

const KIND: &str = "bench-nap";
const HARK: &str = "bench-hark";
const SLOTS: usize = 16;
/// Wake latency target, one node.
pub const TARGET_WAKE_P95_MS: f64 = 50.0;

/// One durable sleep of `input.ms`, then a step saying when it ran.
struct Nap;

#[leasehold::async_trait]
impl Kind for Nap {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        let ms = ctx.input_json()["ms"].as_u64().unwrap_or(1000);
        ctx.sleep(Duration::from_millis(ms)).await?;
        let woke: u64 = ctx.step("woke", || async { Ok(epoch_ms()) }).await?;
        Ok(json!({"woke_ms": woke}))
    }
}

/// Waits for the signal `go`, then a step saying when it ran.
struct Hark;

#[leasehold::async_trait]
impl Kind for Hark {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        ctx.wait_for("go", None).await?;
        let woke: u64 = ctx.step("woke", || async { Ok(epoch_ms()) }).await?;
        Ok(json!({"woke_ms": woke}))
    }
}

fn epoch_ms() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis() as u64
}

/// Resident memory (VmRSS) of this process now, MiB.
fn rss_now_mib() -> f64 {
    let s = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    s.lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kb| kb.parse::<f64>().ok())
        .map_or(0.0, |kb| kb / 1024.0)
}

async fn submit(
    js: &async_nats::jetstream::Context,
    subject: &str,
    ids: std::ops::Range<usize>,
    prefix: &str,
    ms: u64,
) -> anyhow::Result<()> {
    publish_many(js, subject, ids, prefix, |_| json!({"input": {"ms": ms}})).await
}

/// Waits until `n` jobs wait (held by nobody), then checks the index lists
/// them (`hold.<job>`). It watches the worker's own counter of attempts
/// that ended waiting (a scan of the index this often would be the load
/// measured); when the counter has not moved for 10 s, it counts the index
/// once instead, since an attempt may end another way (a transient error
/// retried, an ownership lost under load) while its job still goes to
/// sleep on its next attempt. Past `within`, the error says how the
/// worker's attempts ended.
async fn held(
    h: &leasehold::Handle,
    active: &Active,
    n: usize,
    within: Duration,
) -> anyhow::Result<Duration> {
    let t0 = Instant::now();
    let mut said = Instant::now();
    let mut last = 0;
    let mut moved = Instant::now();
    loop {
        let got = h.metrics.total(Count::Ended(AttemptOutcome::Waited)) as usize;
        if got >= n {
            break;
        }
        if got != last {
            (last, moved) = (got, Instant::now());
        } else if moved.elapsed() > Duration::from_secs(10) {
            let listed = active.list(Filter::Held).await?.len();
            eprintln!("   {got} attempts ended waiting, stalled; the index lists {listed} waiting");
            if listed >= n {
                break;
            }
            for (k, e) in active
                .list(Filter::All)
                .await?
                .iter()
                .filter(|(k, _)| !matches!(k, leasehold_store::index::Key::Hold { .. }))
                .take(5)
            {
                eprintln!(
                    "   not asleep: {} {} {:?}",
                    k.as_string(),
                    e.status,
                    e.next_run_at
                );
            }
            moved = Instant::now();
        }
        if t0.elapsed() >= within {
            let ended: Vec<String> = [
                AttemptOutcome::Completed,
                AttemptOutcome::Retried,
                AttemptOutcome::Failed,
                AttemptOutcome::Cancelled,
                AttemptOutcome::Parked,
                AttemptOutcome::HandedBack,
                AttemptOutcome::OwnershipLost,
            ]
            .into_iter()
            .map(|o| format!("{} {}", h.metrics.total(Count::Ended(o)), o.as_str()))
            .collect();
            anyhow::bail!(
                "only {got} of {n} jobs waiting after {within:?}; the worker's other attempts ended: {}",
                ended.join(", ")
            );
        }
        if said.elapsed() > Duration::from_secs(10) {
            eprintln!(
                "   {got} of {n} asleep after {:.0} s",
                t0.elapsed().as_secs_f64()
            );
            said = Instant::now();
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let took = t0.elapsed();
    let listed = active.list(Filter::Held).await?.len();
    anyhow::ensure!(
        listed >= n,
        "{n} asleep, but the index lists {listed} waiting"
    );
    Ok(took)
}

/// Job `id`'s record once it is `want`, read every 20 ms until `deadline`.
async fn status(
    jobs: &Jobs,
    id: &str,
    want: &str,
    deadline: Instant,
) -> anyhow::Result<leasehold_core::JobRecord> {
    loop {
        match jobs.get(id).await? {
            Some(v) if v.value.status == want => return Ok(v.value),
            r => {
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "{id} never {want}: {}",
                    serde_json::to_string(&r.map(|v| v.value))?
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// `$KV` writes per second, by bucket, over `window`.
async fn kv_writes(url: &str, window: Duration) -> anyhow::Result<BTreeMap<String, f64>> {
    let client = async_nats::connect(url).await?;
    let mut sub = client.subscribe("$KV.>").await?;
    client.flush().await?;
    let end = tokio::time::Instant::now() + window;
    let mut counts: BTreeMap<String, u64> = BTreeMap::new();
    loop {
        tokio::select! {
            m = sub.next() => match m {
                Some(m) => *counts.entry(by_bucket(&m).unwrap_or_default()).or_default() += 1,
                None => break,
            },
            _ = tokio::time::sleep_until(end) => break,
        }
    }
    let secs = window.as_secs_f64();
    Ok(counts
        .into_iter()
        .map(|(k, v)| (k, v as f64 / secs))
        .collect())
}

/// One steady look at `n` sleeping jobs.
async fn look(
    h: &leasehold::Handle,
    url: &str,
    n: usize,
    ramp: Duration,
    window: Duration,
) -> anyhow::Result<Value> {
    tokio::time::sleep(Duration::from_secs(1)).await;
    let writes = kv_writes(url, window).await?;
    let total: f64 = writes.values().sum();
    let scrape = h.metrics.encode();
    let slots_held: f64 = scrape
        .lines()
        .filter(|l| l.starts_with("leasehold_jobs_in_flight{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    Ok(json!({
        "sleeping": n,
        "ramp_to_all_waiting_s": ramp.as_secs_f64(),
        "slots_held": slots_held,
        "kv_writes_per_s": total,
        "kv_writes_per_s_by_bucket": writes,
        "rss_mib": (rss_now_mib() * 10.0).round() / 10.0,
    }))
}

pub async fn timers(many: usize, wakes: usize, window: Duration) -> anyhow::Result<Value> {
    let mut setup = SetupOptions::default();
    setup.kinds.extend([KIND.into(), HARK.into()]);
    let (srv, conn) = server(setup).await?;
    let mut o = Options::local(&srv.url(), "lh");
    o.kinds = vec![KIND.into(), HARK.into()];
    o.concurrency = SLOTS;
    let stop = CancellationToken::new();
    let h = leasehold::Worker::new(o)
        .kind(KIND, Nap)
        .kind(HARK, Hark)
        .start(stop.clone())
        .await?;
    let active = Active::open(&conn).await?;
    let subject = conn.layout.submit_subject(KIND);
    let hour = 3_600_000;

    // The cost of sleeping: a tenth of them, then all of them.
    let few = (many / 10).max(1);
    let t0 = Instant::now();
    submit(&conn.js, &subject, 0..few, "zz", hour).await?;
    let ramp_few = held(&h, &active, few, Duration::from_secs(600)).await?;
    let at_few = look(&h, &srv.url(), few, ramp_few, window).await?;
    submit(&conn.js, &subject, few..many, "zz", hour).await?;
    held(&h, &active, many, Duration::from_secs(1800)).await?;
    let at_many = look(&h, &srv.url(), many, t0.elapsed(), window).await?;

    // Wake latency: short sleeps, due 100 ms apart (one wake at a time:
    // the latency of a wake-up, not of a queue for the slots).
    let jobs = Jobs::open(&conn).await?;
    for i in 0..wakes {
        submit(&conn.js, &subject, i..i + 1, "wake", 2000 + 100 * i as u64).await?;
    }
    let deadline =
        Instant::now() + Duration::from_secs(120) + Duration::from_millis(100 * wakes as u64);
    let mut latencies = Vec::with_capacity(wakes);
    for i in 0..wakes {
        let id = format!("wake-{i}");
        let rec = status(&jobs, &id, "completed", deadline).await?;
        let until = rec
            .waiting_until
            .as_deref()
            .and_then(leasehold_core::time::parse_rfc3339)
            .ok_or_else(|| anyhow::anyhow!("{id}: no recorded wait"))?;
        let out: Value = serde_json::from_str(&rec.result.unwrap_or_default().output)?;
        let woke = out["woke_ms"].as_u64().unwrap_or(0) as f64;
        let due = until.duration_since(SystemTime::UNIX_EPOCH)?.as_millis() as f64;
        latencies.push(woke - due);
    }

    // Signal wake latency: one job at a time, signalled once it waits.
    let signals = leasehold_store::signals::Signals::new(&conn);
    let hark_subject = conn.layout.submit_subject(HARK);
    let mut signal_latencies = Vec::with_capacity(wakes);
    for i in 0..wakes {
        let id = format!("hark-{i}");
        submit(&conn.js, &hark_subject, i..i + 1, "hark", 0).await?;
        let deadline = Instant::now() + Duration::from_secs(30);
        status(&jobs, &id, "waiting", deadline).await?;
        let sent = epoch_ms() as f64;
        signals.send(&id, "go", &json!({}), None, None).await?;
        let rec = status(&jobs, &id, "completed", deadline).await?;
        let out: Value = serde_json::from_str(&rec.result.unwrap_or_default().output)?;
        signal_latencies.push(out["woke_ms"].as_u64().unwrap_or(0) as f64 - sent);
    }
    stop.cancel();
    let _ = h.wait().await;

    let ratio = |k: &str| {
        let (a, b) = (f64_of(&at_few[k]), f64_of(&at_many[k]));
        if a > 0.0 {
            b / a
        } else {
            b
        }
    };
    let p95 = pct(&latencies, 0.95);
    let signal_p95 = pct(&signal_latencies, 0.95);
    Ok(json!({
        "slots": SLOTS,
        "few": at_few,
        "many": at_many,
        "kv_writes_ratio": ratio("kv_writes_per_s"),
        "rss_ratio": ratio("rss_mib"),
        "flat_met": f64_of(&at_many["slots_held"]) == 0.0
            && f64_of(&at_many["kv_writes_per_s"]) <= f64_of(&at_few["kv_writes_per_s"]) + 1.0
            && ratio("rss_mib") <= 1.5,
        "wakes": wakes,
        "wake_latency_ms": summary(&latencies),
        "wake_target_p95_ms": TARGET_WAKE_P95_MS,
        "wake_met": p95 <= TARGET_WAKE_P95_MS,
        "signal_wake_latency_ms": summary(&signal_latencies),
        "signal_wake_met": signal_p95 <= TARGET_WAKE_P95_MS,
    }))
}

pub fn rows(r: &mut Report, v: &Value) {
    let (few, many) = (&v["few"], &v["many"]);
    r.cmp(
        format!(
            "slots held by {} sleeping jobs (1 worker, {} slots)",
            many["sleeping"], v["slots"]
        ),
        many["slots_held"].to_string(),
        format!("{} with {}", few["slots_held"], few["sleeping"]),
        "0",
        Some(f64_of(&many["slots_held"]) == 0.0),
    );
    r.cmp(
        format!("$KV writes/s, {} sleeping", many["sleeping"]),
        format!("{:.2}", f64_of(&many["kv_writes_per_s"])),
        format!(
            "{:.2} with {}",
            f64_of(&few["kv_writes_per_s"]),
            few["sleeping"]
        ),
        "flat (<= +1/s)",
        v["flat_met"].as_bool(),
    );
    r.cmp(
        format!("process RSS MiB, {} sleeping", many["sleeping"]),
        format!("{}", many["rss_mib"]),
        format!("{} with {}", few["rss_mib"], few["sleeping"]),
        "<= 1.5x",
        Some(f64_of(&v["rss_ratio"]) <= 1.5),
    );
    let w = &v["wake_latency_ms"];
    r.cmp(
        format!(
            "wake latency after a timer's due time, {} jobs, p50/p95 ms",
            v["wakes"]
        ),
        format!("{:.1}/{:.1}", f64_of(&w["p50"]), f64_of(&w["p95"])),
        "",
        format!("p95 <= {TARGET_WAKE_P95_MS} ms"),
        v["wake_met"].as_bool(),
    );
    let w = &v["signal_wake_latency_ms"];
    r.cmp(
        format!(
            "wake latency after a signal's send, {} jobs, p50/p95 ms",
            v["wakes"]
        ),
        format!("{:.1}/{:.1}", f64_of(&w["p50"]), f64_of(&w["p95"])),
        "",
        format!("p95 <= {TARGET_WAKE_P95_MS} ms"),
        v["signal_wake_met"].as_bool(),
    );
}
