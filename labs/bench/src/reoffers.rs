//! Part `reoffers`: false re-offers (a job taken from an owner whose
//! process stayed alive) with about 100 long jobs in flight, over a rolling
//! restart of a 3-node cluster and over single-node NATS restarts that
//! keep the server down two to three session timeouts. Each is a run of
//! `leasehold-soak` (its `rolling` and `nats-restart` profiles) on a fleet
//! of 4 workers x 34 slots, whose long jobs fill 75% of the slots; the
//! figure is the soak's own false re-offer count, so the bench and the
//! soak judge a re-offer by the same rule.

use std::path::Path;
use std::time::Instant;

use leasehold_harness::Proc;
use serde_json::{json, Value};

/// Workers and slots each: 4 x 34 slots, 75% long jobs = 102 in flight.
const WORKERS: usize = 4;
const CONCURRENCY: usize = 34;

/// One soak run of `profile` for `seconds`; its report's figures.
async fn run(profile: &str, seconds: u64, seed: u64, out: &Path) -> anyhow::Result<Value> {
    let dir = out.join(format!("reoffers-{profile}"));
    std::fs::create_dir_all(&dir)?;
    let args = [
        "--profile".to_string(),
        profile.to_string(),
        "--seed".into(),
        seed.to_string(),
        "--seconds".into(),
        seconds.to_string(),
        "--workers".into(),
        WORKERS.to_string(),
        "--concurrency".into(),
        CONCURRENCY.to_string(),
        "--out".into(),
        dir.display().to_string(),
    ];
    let t0 = Instant::now();
    let status = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let mut p = Proc::spawn("leasehold-soak", &args, &[("RUST_LOG", "warn".into())]);
        let st = p.wait_timeout(std::time::Duration::from_secs(seconds + 900));
        (st, p.output())
    })
    .await?;
    let (st, output) = status;
    let report = dir.join(format!("soak-{seed}.json"));
    let r: Value = serde_json::from_slice(&std::fs::read(&report).map_err(|e| {
        anyhow::anyhow!(
            "no soak report {} ({e}); exit {st:?}; output:\n{}",
            report.display(),
            crate::common::tail(&output, 30)
        )
    })?)?;
    let slots = r["settings"]["slots"].as_u64().unwrap_or(0);
    let per_slot = r["settings"]["long_jobs"]["per_slot"]
        .as_f64()
        .unwrap_or(0.0);
    let false_reoffers = r["invariants"]["false_reoffers"]["count"]
        .as_u64()
        .unwrap_or(u64::MAX);
    Ok(json!({
        "profile": profile,
        "seed": seed,
        "seconds": seconds,
        "wall_s": t0.elapsed().as_secs_f64(),
        "slots": slots,
        "long_jobs_in_flight": (slots as f64 * per_slot).round(),
        "faults": r["faults"],
        "false_reoffers": false_reoffers,
        "false_reoffer_jobs": r["invariants"]["false_reoffers"]["jobs"],
        "reoffers_by_judgement": r["reoffers"]["by_judgement"],
        "soak_passed": r["passed"],
        "report": report.display().to_string(),
        "met": false_reoffers == 0,
    }))
}

/// Both runs.
pub async fn false_reoffers(seconds: u64, seed: u64, out: &Path) -> anyhow::Result<Value> {
    let rolling = run("rolling", seconds, seed, out).await?;
    let restart = run("nats-restart", seconds, seed, out).await?;
    Ok(json!({"rolling": rolling, "nats_restart": restart}))
}

pub fn rows(r: &mut crate::common::Report, v: &Value) {
    for (k, what) in [
        ("rolling", "rolling restart of 3 nodes"),
        (
            "nats_restart",
            "single-node NATS restarts, 2-3x session down",
        ),
    ] {
        let x = &v[k];
        r.cmp(
            format!("false re-offers, {what}"),
            x["false_reoffers"].to_string(),
            format!(
                "{} long jobs in flight, {} s, soak passed: {}",
                x["long_jobs_in_flight"], x["seconds"], x["soak_passed"]
            ),
            "0",
            x["met"].as_bool(),
        );
    }
}
