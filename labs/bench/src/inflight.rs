//! Part 3: what liveness costs with 1,000 jobs in flight on one worker
//! process: writes to the sessions and job buckets per second in steady
//! state (counted by core subscriptions on the same server), the worker's
//! peak RSS against its budget, and no job reclaimed from a live worker.

use std::collections::BTreeMap;
use std::future::IntoFuture;
use std::time::{Duration, Instant};

use futures::StreamExt;
use leasehold_store::index::{Active, Filter};
use leasehold_store::setup::SetupOptions;
use leasehold_store::Jobs;
use serde_json::{json, Value};

use crate::common::*;

/// Steady-state writes per second of the whole process (session renewals
/// only: one per `--session-renew`, 2 s by default).
pub const TARGET_WRITES_PER_S: f64 = 1.0;

pub async fn inflight(n: usize, window: Duration) -> anyhow::Result<Value> {
    let (s, conn) = server(SetupOptions::default()).await?;
    // Sleep jobs that outlast the ramp, the indexing and the window.
    let job_ms = (window + Duration::from_secs(40)).as_millis() as u64;
    let w = worker(
        &s.url(),
        &[
            ("LH_WORKER_ID", "inflight".into()),
            ("LH_CONCURRENCY", n.to_string()),
            ("LH_KINDS", "sleep".into()),
        ],
    );
    wait_session(&conn, "inflight").await?;
    let js = conn.js.clone();
    let subject = conn.layout.submit_subject("sleep");
    let t_submit = Instant::now();
    let mut acks = futures::stream::FuturesUnordered::new();
    for i in 0..n {
        let m = async_nats::jetstream::message::PublishMessage::build()
            .payload(json!({"input": {"ms": job_ms}}).to_string().into())
            .message_id(format!("inf-{i}"));
        acks.push(js.send_publish(subject.clone(), m).await?.into_future());
    }
    while acks.next().await.transpose()?.is_some() {}
    // Steady state: every job indexed (its claim and its ticket settled).
    let active = Active::open(&conn).await?;
    let mut peak_running = 0;
    loop {
        let running = active.list(Filter::Running).await?.len();
        peak_running = peak_running.max(running);
        if running >= n {
            break;
        }
        anyhow::ensure!(
            t_submit.elapsed() < Duration::from_secs(35),
            "only {running} of {n} jobs indexed as running after 35 s; worker log:\n{}",
            tail(&w.output(), 20)
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    let ramp = t_submit.elapsed();
    tokio::time::sleep(Duration::from_secs(1)).await;
    // Count each second of the window.
    let client = async_nats::connect(s.url()).await?;
    let mut sub = client.subscribe("$KV.>").await?;
    let mut ev = client.subscribe("lh.events.>").await?;
    let mut ack = client.subscribe("$JS.ACK.>").await?;
    client.flush().await?;
    let t0 = tokio::time::Instant::now();
    let secs = window.as_secs().max(1) as usize;
    let mut per_sec: Vec<BTreeMap<String, u64>> = vec![BTreeMap::new(); secs];
    let end = t0 + Duration::from_secs(secs as u64);
    loop {
        let (subject, at) = tokio::select! {
            m = sub.next() => (m.map(|m| by_bucket(&m).unwrap_or_default()), tokio::time::Instant::now()),
            m = ev.next() => (m.map(|_| "lh.events".to_string()), tokio::time::Instant::now()),
            m = ack.next() => (m.map(|m| format!("$JS.ACK {}", by_ack(&m).unwrap_or_default())), tokio::time::Instant::now()),
            _ = tokio::time::sleep_until(end) => break,
        };
        let Some(subject) = subject else { break };
        let i = ((at - t0).as_secs() as usize).min(secs - 1);
        *per_sec[i].entry(subject).or_default() += 1;
    }
    drop((sub, ev, ack));
    let liveness: Vec<u64> = per_sec
        .iter()
        .map(|m| {
            m.get("$KV.lh_sessions").copied().unwrap_or(0)
                + m.get("$KV.lh_jobs").copied().unwrap_or(0)
        })
        .collect();
    let mut totals: BTreeMap<String, u64> = BTreeMap::new();
    for m in &per_sec {
        for (k, v) in m {
            *totals.entry(k.clone()).or_default() += v;
        }
    }
    let per_s = |k: &str| totals.get(k).copied().unwrap_or(0) as f64 / secs as f64;
    let rate = per_s("$KV.lh_sessions") + per_s("$KV.lh_jobs");
    let still_running = active.list(Filter::Running).await?.len();
    // Every job ran to the end on its first claim.
    let jobs = Jobs::open(&conn).await?;
    let deadline = Instant::now() + Duration::from_millis(job_ms) + Duration::from_secs(60);
    while !active.list(Filter::All).await?.is_empty() {
        anyhow::ensure!(
            Instant::now() < deadline,
            "jobs still active long after their end"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    let (mut completed, mut reclaimed) = (0, 0);
    for i in 0..n {
        if let Some(v) = jobs.get(&format!("inf-{i}")).await? {
            completed += usize::from(v.value.status == "completed");
            reclaimed += usize::from(v.value.epoch > 1 || v.value.stale_reclaims > 0);
        }
    }
    let rss = rss_mib(w.pid());
    let budget = 64.0 + 64.0 * n as f64 / 1024.0;
    Ok(json!({
        "jobs": n,
        "job_ms": job_ms,
        "ramp_to_all_indexed_s": ramp.as_secs_f64(),
        "window_s": secs,
        "running_at_window_end": still_running,
        "liveness_writes_per_s": rate,
        "liveness_writes_per_s_series": liveness,
        "target_max_per_s": TARGET_WRITES_PER_S,
        "met": rate <= TARGET_WRITES_PER_S,
        "writes_per_s_by_subject": totals.keys().map(|k| (k.clone(), json!(per_s(k)))).collect::<serde_json::Map<_, _>>(),
        "completed": completed,
        "reclaimed_from_a_live_worker": reclaimed,
        "peak_rss_mib": (rss * 10.0).round() / 10.0,
        "rss_budget_mib": budget,
        "rss_met": rss <= budget,
    }))
}

pub fn rows(r: &mut Report, v: &Value) {
    let n = &v["jobs"];
    r.cmp(
        format!("liveness writes/s ($KV sessions+jobs), {n} in flight"),
        format!("{:.2}", f64_of(&v["liveness_writes_per_s"])),
        format!("{}s window", v["window_s"]),
        format!("<= {TARGET_WRITES_PER_S}/s per process"),
        v["met"].as_bool(),
    );
    r.cmp(
        format!("jobs reclaimed from the live worker, {n} in flight"),
        v["reclaimed_from_a_live_worker"].to_string(),
        format!("{} completed", v["completed"]),
        "0",
        Some(v["reclaimed_from_a_live_worker"] == 0),
    );
    r.cmp(
        format!("worker peak RSS MiB, {n} in flight"),
        format!("{}", v["peak_rss_mib"]),
        "",
        format!("<= {} MiB", v["rss_budget_mib"]),
        v["rss_met"].as_bool(),
    );
}
