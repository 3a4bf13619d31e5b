//! Part "busy": the promise on a busy fleet.
//!
//! - Bystanders: three workers of 4 slots run 11 long jobs (92% of the
//!   slots), a reaper probes; the worker holding 4 of them is killed -9 and
//!   started again under its identity at once (as a supervisor would).
//!   Measured from the kill until each of its jobs runs again; the other
//!   jobs must not be disturbed. Target: p95 within the session timeout
//!   plus one second.
//! - Poison: one `crash` job on a fleet of enough workers, reapers probing;
//!   measured from its submission until it is `dead` (class `poison`).
//!   Target: (max stale reclaims + 1) × (session timeout + 1 s).

use std::time::{Duration, Instant};

use leasehold_store::setup::SetupOptions;
use leasehold_store::work::Work;
use leasehold_store::Jobs;
use serde_json::{json, Value};

use crate::common::*;

/// The product's default session timeout and stale-reclaim limit.
const SESSION: Duration = Duration::from_secs(10);
const MAX_STALE_RECLAIMS: u32 = 3;

fn env_of(id: &str) -> Vec<(&'static str, String)> {
    vec![
        ("LH_WORKER_ID", id.to_string()),
        ("LH_KINDS", "sleep,crash".into()),
        ("LH_CONCURRENCY", "4".into()),
        // The product's default pull lifetime.
        ("LH_PULL_EXPIRES", "1s".into()),
    ]
}

/// Submits `n` long sleep jobs and waits until `owner` runs each of them.
async fn fill(
    work: &Work,
    jobs: &Jobs,
    owner: &str,
    prefix: &str,
    n: usize,
) -> anyhow::Result<Vec<String>> {
    let mut ids = Vec::new();
    for i in 0..n {
        let id = format!("{prefix}-{i}");
        crate::recovery::sleep_held_by(work, jobs, &id, 600_000, owner)
            .await
            .map_err(|e| anyhow::anyhow!("{e} (every slot of {owner} should take one)"))?;
        ids.push(id);
    }
    Ok(ids)
}

pub async fn bystanders(reps: usize) -> anyhow::Result<Value> {
    let mut samples = Vec::new();
    let mut disturbed = 0;
    for rep in 0..reps {
        let (s, conn) = server(SetupOptions::default()).await?;
        let url = s.url();
        let jobs = Jobs::open(&conn).await?;
        let work = Work::new(&conn);
        let _reaper = reaper(&url, &[]).await?;
        let ids = ["bv", "bb", "bc"].map(|w| format!("{w}-{rep}"));
        let mut victim = worker(&url, &env_of(&ids[0]));
        wait_session(&conn, &ids[0]).await?;
        let victims = fill(&work, &jobs, &ids[0], &format!("v{rep}"), 4).await?;
        let b = worker(&url, &env_of(&ids[1]));
        wait_session(&conn, &ids[1]).await?;
        let mut others = fill(&work, &jobs, &ids[1], &format!("b{rep}"), 4).await?;
        let c = worker(&url, &env_of(&ids[2]));
        wait_session(&conn, &ids[2]).await?;
        others.extend(fill(&work, &jobs, &ids[2], &format!("c{rep}"), 3).await?);
        for id in &victims {
            wait_indexed(&conn, id).await?;
        }
        let mut watches = Vec::new();
        for id in &victims {
            watches.push((id.clone(), jobs.watch(id).await?));
        }
        let t0 = Instant::now();
        victim.kill9();
        let back = worker(&url, &env_of(&ids[0]));
        for (id, w) in &mut watches {
            let (at, _) = next_rec(w, id, Duration::from_secs(60), |r| {
                r.epoch >= 2 && r.status == "running"
            })
            .await
            .map_err(|e| {
                anyhow::anyhow!("{e}; restarted worker's log:\n{}", tail(&back.output(), 20))
            })?;
            samples.push(ms(at - t0));
        }
        for id in &others {
            let r = jobs.get(id).await?.map(|v| v.value);
            if r.is_none_or(|r| r.epoch != 1 || r.status != "running") {
                disturbed += 1;
            }
        }
        drop((b, c, back));
    }
    let target = ms(SESSION + Duration::from_secs(1));
    Ok(json!({
        "fleet": "3 workers x 4 slots, 11 long jobs (92% of the slots), a reaper probing, default session (10 s)",
        "fault": "kill -9 of the worker holding 4 jobs, started again at once under its identity",
        "kill_to_running_again_ms": summary(&samples),
        "other_jobs_disturbed": disturbed,
        "target_p95_ms": target,
        "met": pct(&samples, 0.95) <= target && disturbed == 0,
    }))
}

pub async fn poison(reps: usize) -> anyhow::Result<Value> {
    let mut samples = Vec::new();
    let mut wrong = Vec::new();
    for rep in 0..reps {
        let (s, conn) = server(SetupOptions::default()).await?;
        let url = s.url();
        let jobs = Jobs::open(&conn).await?;
        let work = Work::new(&conn);
        let _r1 = reaper(&url, &[]).await?;
        let _r2 = reaper(&url, &[]).await?;
        // One worker per crash it causes; the last crash's session end
        // dead-letters it.
        let mut fleet = Vec::new();
        for i in 0..=MAX_STALE_RECLAIMS {
            let id = format!("pw-{rep}-{i}");
            fleet.push(worker(&url, &env_of(&id)));
            wait_session(&conn, &id).await?;
        }
        let id = format!("poison-{rep}");
        let mut w = jobs.watch(&id).await?;
        let t0 = Instant::now();
        work.submit(
            "crash",
            json!({"input": {}}).to_string().into(),
            Some(&id),
            None,
        )
        .await?;
        let (at, r) = match next_rec(&mut w, &id, Duration::from_secs(120), |r| {
            r.status == "dead"
        })
        .await
        {
            Ok(x) => x,
            Err(e) => {
                let now = jobs.get(&id).await?.map(|v| v.value);
                let logs: Vec<String> = fleet.iter().map(|p| tail(&p.output(), 8)).collect();
                anyhow::bail!(
                    "{e}; record now: {}; workers' logs:\n{}",
                    serde_json::to_string(&now)?,
                    logs.join("\n--\n")
                )
            }
        };
        samples.push(ms(at - t0));
        let class = r.error.map(|e| e.class).unwrap_or_default();
        if class != "poison" {
            wrong.push(class);
        }
    }
    let target = ms((SESSION + Duration::from_secs(1)) * (MAX_STALE_RECLAIMS + 1));
    Ok(json!({
        "fleet": format!("{} workers, two reapers probing, default session (10 s), --max-stale-reclaims {MAX_STALE_RECLAIMS}", MAX_STALE_RECLAIMS + 1),
        "submit_to_dead_ms": summary(&samples),
        "not_poison": wrong,
        "target_max_ms": target,
        "met": samples.iter().all(|s| *s <= target) && wrong.is_empty(),
    }))
}
