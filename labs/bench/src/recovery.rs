//! Parts 1 and 2: how fast a job runs again after its owner dies (kill -9,
//! with and without a reaper, with the default and a short session
//! timeout, before and after the job was indexed), the SIGTERM handoff, and
//! a SIGSTOPped owner: the re-offer after its session timed out, and no
//! write of the paused owner accepted after the new owner's claim.

use std::time::{Duration, Instant};

use leasehold_store::events::Events;
use leasehold_store::setup::SetupOptions;
use leasehold_store::work::Work;
use leasehold_store::Jobs;
use serde_json::{json, Value};

use crate::common::*;

/// One recovery case.
pub struct Case {
    pub key: &'static str,
    pub name: &'static str,
    /// `LH_SESSION_TIMEOUT` of both workers; `None`: the default (10 s).
    pub session_timeout: Option<&'static str>,
    pub reaper: bool,
    /// Kill as soon as the claim is seen, before the job is indexed.
    pub before_index: bool,
    pub target_p95_ms: Option<f64>,
}

pub const CASES: &[Case] = &[
    Case {
        key: "a",
        name: "kill -9, default session (10 s), no reaper",
        session_timeout: None,
        reaper: false,
        before_index: false,
        target_p95_ms: Some(11_000.0),
    },
    Case {
        key: "b",
        name: "kill -9, default session, reaper probing",
        session_timeout: None,
        reaper: true,
        before_index: false,
        // The probe ends the session in about a second; the jobs move once
        // the process still does not answer a settle time (4 s) later.
        target_p95_ms: Some(6_000.0),
    },
    Case {
        key: "c",
        name: "kill -9, session 2 s, no reaper",
        session_timeout: Some("2s"),
        reaper: false,
        before_index: false,
        target_p95_ms: Some(3_000.0),
    },
    Case {
        key: "d",
        name: "kill -9 before indexing, default session, no reaper",
        session_timeout: None,
        reaper: false,
        before_index: true,
        target_p95_ms: None,
    },
];

fn env_of(id: &str, session: Option<&str>, log: &str) -> Vec<(&'static str, String)> {
    // LH_BENCH_LOG overrides the workers' log filter (to look into a run).
    let log = std::env::var("LH_BENCH_LOG").unwrap_or_else(|_| log.to_string());
    let mut e = vec![
        ("LH_WORKER_ID", id.to_string()),
        ("LH_KINDS", "sleep".to_string()),
        ("RUST_LOG", log),
        // The product's default pull lifetime (the other parts use 250 ms).
        ("LH_PULL_EXPIRES", "1s".to_string()),
    ];
    if let Ok(p) = std::env::var("LH_BENCH_PULL_EXPIRES") {
        e.push(("LH_PULL_EXPIRES", p));
    }
    if let Some(t) = session {
        e.push(("LH_SESSION_TIMEOUT", t.to_string()));
    }
    e
}

/// Kill -9 of the owner of a running `sleep` job, `reps` times, on a server
/// set up with `leasehold setup`'s defaults (consumer ack wait 30 s).
/// Measured from the kill to the record's epoch bump (the job running
/// again on the other worker); the first record write after the kill (the
/// re-offer) is reported too.
pub async fn kill9(c: &Case, reps: usize) -> anyhow::Result<Value> {
    let (s, conn) = server(SetupOptions::default()).await?;
    let url = s.url();
    let jobs = Jobs::open(&conn).await?;
    let work = Work::new(&conn);
    let _reaper = match c.reaper {
        true => Some(reaper(&url, &[]).await?),
        false => None,
    };
    let (mut running, mut reoffer, mut ran_before_kill) = (Vec::new(), Vec::new(), Vec::new());
    let mut indexed_at_kill = 0;
    for i in 0..reps {
        let victim_id = format!("victim-{}-{i}", c.key);
        let rescuer_id = format!("rescuer-{}-{i}", c.key);
        let mut victim = worker(&url, &env_of(&victim_id, c.session_timeout, "warn"));
        wait_session(&conn, &victim_id).await?;
        let id = format!("k9-{}-{i}", c.key);
        let (mut w, claimed_at, first) = sleep_held_by(&work, &jobs, &id, 600_000, &victim_id)
            .await
            .map_err(|e| anyhow::anyhow!("{e}; victim log:\n{}", tail(&victim.output(), 30)))?;
        let mut rescuer = None;
        if !c.before_index {
            wait_indexed(&conn, &id).await?;
            // The rescuer starts only once the victim holds the job, and is
            // connected before the fault.
            rescuer = Some(worker(
                &url,
                &env_of(&rescuer_id, c.session_timeout, "warn"),
            ));
            wait_session(&conn, &rescuer_id).await?;
        }
        let before = revision(&jobs, &id).await?;
        let t0 = Instant::now();
        victim.kill9();
        ran_before_kill.push(ms(t0 - claimed_at));
        let active = leasehold_store::index::Active::open(&conn).await?;
        if !active.keys_of(&id).await?.is_empty() {
            indexed_at_kill += 1;
        }
        if c.before_index {
            // Started after the kill: it is connected within a fraction of
            // a second, long before the ticket's wake-up (one session
            // timeout after the claim).
            rescuer = Some(worker(
                &url,
                &env_of(&rescuer_id, c.session_timeout, "warn"),
            ));
        }
        let rescuer = rescuer.expect("started");
        let moved = first_then(&mut w, &id, Duration::from_secs(60), before, |r| {
            r.epoch > first.epoch && r.status == "running"
        })
        .await;
        let (t1, t2, moved) = match moved {
            Ok(x) => x,
            Err(e) => {
                let now = jobs.get(&id).await?.map(|v| v.value);
                let mut consumer = conn
                    .js
                    .get_stream(conn.layout.work_stream())
                    .await?
                    .get_consumer::<async_nats::jetstream::consumer::pull::Config>(
                        &conn.layout.work_consumer("sleep"),
                    )
                    .await
                    .map_err(|e| anyhow::anyhow!("work consumer: {e}"))?;
                let consumer = consumer.info().await?.clone();
                anyhow::bail!(
                    "{e}; record now: {}; work consumer: pending {} ack pending {} redelivered {}; victim log:\n{}\nrescuer log:\n{}",
                    serde_json::to_string(&now)?,
                    consumer.num_pending,
                    consumer.num_ack_pending,
                    consumer.num_redelivered,
                    tail(&victim.output(), 15),
                    tail(&rescuer.output(), 30)
                )
            }
        };
        anyhow::ensure!(
            moved.worker_id.as_deref() == Some(rescuer_id.as_str()),
            "{id} moved to {:?}, not the rescuer",
            moved.worker_id
        );
        reoffer.push(ms(t1 - t0));
        running.push(ms(t2 - t0));
        // Leave nothing running for the next repetition.
        finish(&conn, &id).await?;
        drop(rescuer);
    }
    let p95 = pct(&running, 0.95);
    Ok(json!({
        "case": c.name,
        "session_timeout": c.session_timeout.unwrap_or("10s (default)"),
        "reaper": c.reaper,
        "setup": "leasehold setup defaults (consumer ack wait 30 s)",
        "killed": if c.before_index { "right after the claim, before --index-after (1 s)" } else { "after the job was indexed" },
        "indexed_at_kill": indexed_at_kill,
        "kill_to_running_again_ms": summary(&running),
        "kill_to_first_record_write_ms": summary(&reoffer),
        "claim_to_kill_ms": summary(&ran_before_kill),
        "target_p95_ms": c.target_p95_ms,
        "met": c.target_p95_ms.map(|t| p95 <= t),
    }))
}

/// SIGTERM of the owner: time until another worker runs the job (drain
/// timeout 0: handed back at once).
pub async fn handoff(reps: usize) -> anyhow::Result<Value> {
    let (s, conn) = server(SetupOptions::default()).await?;
    let url = s.url();
    let jobs = Jobs::open(&conn).await?;
    let work = Work::new(&conn);
    let mut samples = Vec::new();
    for i in 0..reps {
        let (vid, rid) = (format!("term-victim-{i}"), format!("term-rescuer-{i}"));
        let mut a = worker(&url, &env_of(&vid, None, "warn"));
        wait_session(&conn, &vid).await?;
        let id = format!("term-{i}");
        work.submit(
            "sleep",
            json!({"input": {"ms": 600_000}}).to_string().into(),
            Some(&id),
            None,
        )
        .await?;
        wait_record(&jobs, &id, |r| {
            r.status == "running" && r.worker_id.as_deref() == Some(vid.as_str())
        })
        .await?;
        wait_indexed(&conn, &id).await?;
        let c = worker(&url, &env_of(&rid, None, "warn"));
        wait_session(&conn, &rid).await?;
        let mut w = jobs.watch(&id).await?;
        let t0 = Instant::now();
        a.term();
        let (t1, _) = next_rec(&mut w, &id, Duration::from_secs(60), |r| {
            r.status == "running" && r.worker_id.as_deref() == Some(rid.as_str())
        })
        .await
        .map_err(|e| anyhow::anyhow!("{e}: rescuer log:\n{}", tail(&c.output(), 30)))?;
        samples.push(ms(t1 - t0));
        finish(&conn, &id).await?;
        drop(c);
        let _ = a.wait_timeout(Duration::from_secs(5));
    }
    Ok(json!({"sigterm_to_running_elsewhere_ms": summary(&samples)}))
}

/// SIGSTOP of the owner past its 2 s session timeout, SIGCONT once the job
/// completed elsewhere; then every write the paused owner made after the
/// new owner's claim is looked for in the record's KV history and the
/// job's events.
pub async fn sigstop(reps: usize) -> anyhow::Result<Value> {
    let (s, conn) = server(SetupOptions::default()).await?;
    let url = s.url();
    let jobs = Jobs::open(&conn).await?;
    let events = Events::new(&conn);
    let work = Work::new(&conn);
    let (mut reoffer, mut running, mut completed) = (Vec::new(), Vec::new(), Vec::new());
    let mut runs = Vec::new();
    let (mut stale_total, mut notices_total) = (0u64, 0u64);
    for i in 0..reps {
        let (vid, rid) = (format!("stop-victim-{i}"), format!("stop-rescuer-{i}"));
        let victim = worker(&url, &env_of(&vid, Some("2s"), "info"));
        wait_session(&conn, &vid).await?;
        let id = format!("stop-{i}");
        // Long enough to be indexed before the stop, short enough that the
        // paused owner's handler has finished when it is continued (its
        // completion is then its first write attempt).
        let (mut w, _, first) = sleep_held_by(&work, &jobs, &id, 2500, &vid).await?;
        wait_indexed(&conn, &id).await?;
        let rescuer = worker(&url, &env_of(&rid, Some("2s"), "warn"));
        wait_session(&conn, &rid).await?;
        let before = revision(&jobs, &id).await?;
        let t0 = Instant::now();
        victim.stop();
        let (t1, t2, claim) = first_then(&mut w, &id, Duration::from_secs(30), before, |r| {
            r.epoch > first.epoch && r.status == "running"
        })
        .await?;
        let (t3, done) = next_rec(&mut w, &id, Duration::from_secs(30), |r| {
            terminal(&r.status)
        })
        .await?;
        reoffer.push(ms(t1 - t0));
        running.push(ms(t2 - t0));
        completed.push(ms(t3 - t0));
        victim.cont();
        // The paused owner renews, finds its session gone, writes it again
        // and re-checks its job; its completion attempt is refused.
        let noticed = wait_log(
            &victim,
            "re-offered while this process was away",
            Duration::from_secs(15),
        )
        .await
        .is_ok();
        let session_restored = victim.output().contains("the session key was gone");
        // A fixed window for any late write of the paused owner to land.
        tokio::time::sleep(Duration::from_secs(2)).await;
        let history = jobs.history(&id).await?;
        let new_epoch = claim.epoch;
        let claim_at = history.iter().position(|v| v.value.epoch >= new_epoch);
        let stale_kv = match claim_at {
            Some(p) => history[p..]
                .iter()
                .filter(|v| {
                    v.value.epoch < new_epoch || v.value.worker_id.as_deref() == Some(vid.as_str())
                })
                .count() as u64,
            None => u64::MAX,
        };
        let evs = events.read(&id).await?;
        let claim_seq = evs
            .iter()
            .find(|(_, e)| e.r#type == "claimed" && e.epoch == new_epoch)
            .map(|(s, _)| *s);
        let late: Vec<Value> = match claim_seq {
            Some(cs) => evs
                .iter()
                .filter(|(s, e)| {
                    *s > cs && (e.epoch < new_epoch || e.worker_id.as_deref() == Some(vid.as_str()))
                })
                .map(|(s, e)| json!({"seq": s, "type": e.r#type, "epoch": e.epoch, "worker_id": e.worker_id, "data": e.data}))
                .collect(),
            None => vec![json!("the new owner's claimed marker is missing")],
        };
        // The lost owner's `heartbeat_lost` notice is published without a
        // fence by design (readers drop events older than the latest claim
        // marker); any other old-epoch event after the new claim would have
        // passed the fence.
        let notices = late
            .iter()
            .filter(|e| e["type"] == "heartbeat_lost")
            .count() as u64;
        let stale_events = late.len() as u64 - notices;
        let now = jobs.get(&id).await?.map(|v| v.value);
        stale_total = stale_total
            .saturating_add(stale_kv)
            .saturating_add(stale_events);
        notices_total += notices;
        runs.push(json!({
            "job": id,
            "outcome": done.status,
            "final_owner": done.worker_id,
            "final_record_unchanged": now.as_ref() == Some(&done),
            "kv_history_revisions": history.len(),
            "new_claim_in_history": claim_at.is_some(),
            "stale_kv_writes_after_new_claim": stale_kv,
            "stale_fenced_events_after_new_claim": stale_events,
            "unfenced_notices_after_new_claim": notices,
            "stale_events": late,
            "paused_owner_saw_its_job_reoffered": noticed,
            "paused_owner_restored_its_session": session_restored,
        }));
        drop(rescuer);
        drop(victim);
    }
    let p95 = pct(&reoffer, 0.95);
    Ok(json!({
        "session_timeout": "2s",
        "stop_to_reoffer_ms": summary(&reoffer),
        "stop_to_running_elsewhere_ms": summary(&running),
        "stop_to_completed_elsewhere_ms": summary(&completed),
        "job_ms": 2500,
        "reoffer_target_p95_ms": 3000,
        "reoffer_met": p95 <= 3000.0,
        "stale_writes_accepted": stale_total,
        "stale_met": stale_total == 0,
        "old_epoch_events_after_new_claim_incl_notices": stale_total + notices_total,
        "strict_met": stale_total + notices_total == 0,
        "runs": runs,
    }))
}

pub fn rows(r: &mut Report, key: &str, v: &Value) {
    let k = &v["kill_to_running_again_ms"];
    let t = v["target_p95_ms"].as_f64();
    r.cmp(
        format!(
            "recovery ({key}) {}: p50/p95 ms",
            v["case"].as_str().unwrap_or("")
        ),
        format!("{}/{}", k["p50"], k["p95"]),
        format!(
            "session {}",
            v["session_timeout"]
                .as_str()
                .unwrap_or("")
                .split(' ')
                .next()
                .unwrap_or("")
        ),
        t.map_or("none".into(), |t| format!("p95 <= {t:.0} ms")),
        v["met"].as_bool(),
    );
}

/// Submits a `sleep` job of `ms` as `id` and waits until `owner` runs it;
/// the record's watch (to follow it further), when and what was claimed.
pub(crate) async fn sleep_held_by(
    work: &Work,
    jobs: &Jobs,
    id: &str,
    ms: u64,
    owner: &str,
) -> anyhow::Result<(
    async_nats::jetstream::kv::Watch,
    Instant,
    leasehold_core::JobRecord,
)> {
    let mut w = jobs.watch(id).await?;
    work.submit(
        "sleep",
        json!({"input": {"ms": ms}}).to_string().into(),
        Some(id),
        None,
    )
    .await?;
    let (at, first) = next_rec(&mut w, id, Duration::from_secs(30), |r| {
        r.status == "running" && r.worker_id.as_deref() == Some(owner)
    })
    .await?;
    Ok((w, at, first))
}
