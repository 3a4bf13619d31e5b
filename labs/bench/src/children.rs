//! `children`: child jobs on one worker with 16 slots (the built-in
//! `fanout` and `echo` kinds, an in-process `leasehold::Worker`).
//!
//! - Fan-out: one parent spawning `n` echo children and joining them, from
//!   its submission to its result with every child's outcome, against `n`
//!   independent echo jobs submitted by a client in the same run, from the
//!   first submission to the last completion (target <= 1.5x). [`ROUNDS`]
//!   rounds, each the independent jobs then the fan-out; the figure is the
//!   median round's ratio (one round moves with the machine's noise).
//! - Wake latency after the last child ends: parents of 3 children (each
//!   a 50 ms `sleep`, so the parent waits for them), one at a time; from the last child's end (its record's last write) to the
//!   parent's next claim (its `claimed` event), p50/p95 (target <= 50 ms).
//! - The parent's wakes: how many times each parent was claimed (2: its
//!   first attempt and one wake, whatever its number of children).

use std::time::{Duration, Instant};

use leasehold::{AttemptOutcome, Count, Options};
use leasehold_core::time::parse_rfc3339;
use leasehold_store::events::Events;
use leasehold_store::setup::SetupOptions;
use leasehold_store::Jobs;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::common::*;

const SLOTS: usize = 16;
/// Rounds of the fan-out against independent jobs.
const ROUNDS: usize = 3;
/// The fan-out's target against independent jobs.
pub const TARGET_RATIO: f64 = 1.5;
/// Wake latency target, one node.
pub const TARGET_WAKE_P95_MS: f64 = 50.0;

/// Publishes `n` echo jobs `<prefix>-<i>`.
async fn submit_echo(
    js: &async_nats::jetstream::Context,
    subject: &str,
    n: usize,
    prefix: &str,
) -> anyhow::Result<()> {
    publish_many(js, subject, 0..n, prefix, |i| json!({"input": {"i": i}})).await
}

/// Waits until the worker completed `n` attempts in all.
async fn completed(h: &leasehold::Handle, n: u64, within: Duration) -> anyhow::Result<()> {
    let t0 = Instant::now();
    while h.metrics.total(Count::Ended(AttemptOutcome::Completed)) < n {
        anyhow::ensure!(
            t0.elapsed() < within,
            "only {} of {n} completed after {within:?}",
            h.metrics.total(Count::Ended(AttemptOutcome::Completed))
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    Ok(())
}

/// A parent's finished record, read every 5 ms.
async fn finished(
    jobs: &Jobs,
    id: &str,
    within: Duration,
) -> anyhow::Result<leasehold_core::JobRecord> {
    let t0 = Instant::now();
    loop {
        if let Some(v) = jobs.get(id).await? {
            if v.value.status == "completed" {
                return Ok(v.value);
            }
            anyhow::ensure!(
                !matches!(v.value.status.as_str(), "failed" | "dead" | "cancelled"),
                "{id} ended {}: {:?}",
                v.value.status,
                v.value.error
            );
        }
        anyhow::ensure!(t0.elapsed() < within, "{id} not completed after {within:?}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

pub async fn children(n: usize, wakes: usize) -> anyhow::Result<Value> {
    let (srv, conn) = server(SetupOptions::default()).await?;
    let mut o = Options::local(&srv.url(), "lh");
    o.kinds = vec!["fanout".into(), "echo".into(), "sleep".into()];
    o.concurrency = SLOTS;
    let stop = CancellationToken::new();
    let h = leasehold::Worker::new(o).start(stop.clone()).await?;
    let jobs = Jobs::open(&conn).await?;
    let events = Events::new(&conn);
    let echo = conn.layout.submit_subject("echo");
    let fanout = conn.layout.submit_subject("fanout");
    let within = Duration::from_secs(600);

    // Warm-up (connections, consumers), not measured.
    submit_echo(&conn.js, &echo, 50, "warm").await?;
    completed(&h, 50, within).await?;

    let mut rounds = Vec::with_capacity(ROUNDS);
    let mut rec = None;
    for round in 0..ROUNDS {
        // n independent echo jobs from a client.
        let before = h.metrics.total(Count::Ended(AttemptOutcome::Completed));
        let t0 = Instant::now();
        submit_echo(&conn.js, &echo, n, &format!("solo{round}")).await?;
        completed(&h, before + n as u64, within).await?;
        let independent_s = t0.elapsed().as_secs_f64();
        // One parent, n children.
        let id = format!("fan-big-{round}");
        let t0 = Instant::now();
        conn.js
            .publish(
                fanout.clone(),
                json!({"id": id, "input": {"n": n}}).to_string().into(),
            )
            .await?
            .await?;
        let r = finished(&jobs, &id, within).await?;
        let fanout_s = t0.elapsed().as_secs_f64();
        let out: Value = serde_json::from_str(&r.result.clone().unwrap_or_default().output)?;
        anyhow::ensure!(
            out["completed"].as_u64() == Some(n as u64),
            "the fan-out's children did not all complete: {}",
            out["completed"]
        );
        rounds.push(json!({"independent_s": independent_s, "fanout_s": fanout_s, "ratio": fanout_s / independent_s}));
        rec = Some((r, out));
    }
    let mut by_ratio = rounds.clone();
    by_ratio.sort_by(|a, b| f64_of(&a["ratio"]).total_cmp(&f64_of(&b["ratio"])));
    let median = by_ratio[ROUNDS / 2].clone();
    let (independent_s, fanout_s) = (
        f64_of(&median["independent_s"]),
        f64_of(&median["fanout_s"]),
    );
    // The last round's parent: its claims and where its time went.
    let (rec, out) = rec.expect("one round at least");
    let big = rec.id.clone();
    let claims = |id: String| {
        let events = events.clone();
        async move {
            let evs = events.read_types(&id, &["claimed"]).await?;
            anyhow::Ok(evs.into_iter().map(|(_, e)| e).collect::<Vec<_>>())
        }
    };
    let big_claims = claims(big.clone()).await?.len();
    // Where the fan-out's time goes: the spawn recorded, the last child's
    // end, the parent's wake, its join recorded (ms from its submission).
    let at = |e: &leasehold::JobEvent| parse_rfc3339(&e.at);
    let evs: Vec<_> = events
        .read(&big)
        .await?
        .into_iter()
        .map(|(_, e)| e)
        .collect();
    let created = parse_rfc3339(&rec.created_at).unwrap_or(std::time::UNIX_EPOCH);
    let ms = |t: Option<std::time::SystemTime>| {
        t.and_then(|t| t.duration_since(created).ok())
            .map_or(Value::Null, |d| json!(d.as_secs_f64() * 1000.0))
    };
    let step_at = |name: &str| {
        evs.iter()
            .find(|e| e.r#type == "step" && e.data_map()["id"] == name)
            .and_then(at)
    };
    let mut last_child_end = std::time::UNIX_EPOCH;
    for c in out["children"].as_array().into_iter().flatten() {
        if let Some(v) = jobs.get(c.as_str().unwrap_or_default()).await? {
            if let Some(t) = parse_rfc3339(&v.value.updated_at) {
                last_child_end = last_child_end.max(t);
            }
        }
    }
    let breakdown = json!({
        "spawn_recorded_ms": ms(step_at("spawn:echo#0")),
        "last_child_end_ms": ms(Some(last_child_end)),
        "woken_ms": ms(evs.iter().filter(|e| e.r#type == "claimed").nth(1).and_then(at)),
        "join_recorded_ms": ms(step_at("join#0")),
    });

    // Wake latency: small fan-outs one at a time.
    let mut latencies = Vec::with_capacity(wakes);
    let mut woken_once = 0;
    for i in 0..wakes {
        let id = format!("fan-{i}");
        // Children that take 50 ms: the parent waits for them.
        let naps = json!([{"ms": 50}, {"ms": 50}, {"ms": 50}]);
        conn.js
            .publish(
                fanout.clone(),
                json!({"id": id, "input": {"kind": "sleep", "inputs": naps}})
                    .to_string()
                    .into(),
            )
            .await?
            .await?;
        let rec = finished(&jobs, &id, Duration::from_secs(60)).await?;
        let out: Value = serde_json::from_str(&rec.result.unwrap_or_default().output)?;
        let mut last_end = std::time::UNIX_EPOCH;
        for c in out["children"].as_array().into_iter().flatten() {
            let c = jobs
                .get(c.as_str().unwrap_or_default())
                .await?
                .ok_or_else(|| anyhow::anyhow!("child {c} gone"))?;
            if let Some(t) = parse_rfc3339(&c.value.updated_at) {
                last_end = last_end.max(t);
            }
        }
        let cl = claims(id.clone()).await?;
        if cl.len() != 2 {
            continue;
        }
        woken_once += 1;
        if let Some(woke) = cl.last().and_then(|e| parse_rfc3339(&e.at)) {
            let ms = woke
                .duration_since(last_end)
                .map(|d| d.as_secs_f64() * 1000.0)
                .unwrap_or(0.0);
            latencies.push(ms);
        }
    }
    stop.cancel();
    let _ = h.wait().await;
    let ratio = fanout_s / independent_s;
    let p95 = pct(&latencies, 0.95);
    Ok(json!({
        "slots": SLOTS,
        "children": n,
        "independent_s": independent_s,
        "fanout_s": fanout_s,
        "ratio": ratio,
        "rounds": rounds,
        "ratio_target": TARGET_RATIO,
        "ratio_met": ratio <= TARGET_RATIO,
        "fanout_parent_claims": big_claims,
        "fanout_breakdown": breakdown,
        "wakes": wakes,
        "woken_once": woken_once,
        "wake_latency_ms": summary(&latencies),
        "wake_target_p95_ms": TARGET_WAKE_P95_MS,
        "wake_met": p95 <= TARGET_WAKE_P95_MS,
    }))
}

pub fn rows(r: &mut Report, v: &Value) {
    r.cmp(
        format!(
            "fan-out of {} echo children: parent submitted -> resumed with every outcome, s (median of {} rounds)",
            v["children"],
            v["rounds"].as_array().map_or(1, Vec::len)
        ),
        format!("{:.2}", f64_of(&v["fanout_s"])),
        format!(
            "{:.2} for {} independent echo jobs",
            f64_of(&v["independent_s"]),
            v["children"]
        ),
        format!("<= {TARGET_RATIO}x"),
        v["ratio_met"].as_bool(),
    );
    r.cmp(
        format!("claims of the {}-child parent", v["children"]),
        v["fanout_parent_claims"].to_string(),
        "",
        "2 (one wake)",
        Some(v["fanout_parent_claims"] == json!(2)),
    );
    let w = &v["wake_latency_ms"];
    r.cmp(
        format!(
            "wake latency after the last child's end, {} parents of 3, p50/p95 ms",
            v["wakes"]
        ),
        format!("{:.1}/{:.1}", f64_of(&w["p50"]), f64_of(&w["p95"])),
        format!("{} of {} woken once", v["woken_once"], v["wakes"]),
        format!("p95 <= {TARGET_WAKE_P95_MS} ms"),
        v["wake_met"].as_bool(),
    );
}
