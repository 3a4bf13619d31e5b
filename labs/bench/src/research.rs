//! The research figures: sections per second, the flusher's checkpoint
//! latency and coalescing, rework per crash against the seed's baseline,
//! and (part 7) what one research job reads from the server while 0, 1,
//! 100 and 1,000 other research jobs' records and events sit beside it.

use std::collections::{BTreeMap, HashMap};
use std::future::IntoFuture;
use std::time::{Duration, Instant};

use futures::StreamExt;
use leasehold_core::JobRecord;
use leasehold_harness::Proc;
use leasehold_store::events::Events;
use leasehold_store::setup::SetupOptions;
use leasehold_store::work::Work;
use leasehold_store::Jobs;
use serde_json::{json, Value};

use crate::common::*;
use crate::Args;

/// The research input of every research job here: small, so a crash run
/// stays a few seconds, but with several sections per expert so a crash can
/// land mid-expert.
pub const EXPERTS: u64 = 3;
pub const SECTIONS: u64 = 4;

/// `leasehold-sim` (model, search, pages, effects sink on one address).
pub(crate) struct Sim {
    _proc: Proc,
    pub(crate) addr: String,
}

impl Sim {
    /// `token_ms` 0 is an instant model: the figures are then leasehold's.
    pub(crate) async fn start(token_ms: u64) -> anyhow::Result<Sim> {
        Self::start_with(token_ms, &[]).await
    }

    /// [`Sim::start`] with more of the sim's flags.
    pub(crate) async fn start_with(token_ms: u64, args: &[&str]) -> anyhow::Result<Sim> {
        let mut a = vec!["--listen", "127.0.0.1:0"];
        a.extend_from_slice(args);
        let p = Proc::spawn(
            "leasehold-sim",
            &a,
            &[("LH_SIM_TOKEN_DELAY_MS", token_ms.to_string())],
        );
        // The bound port is only printed: poll the log (start-up, no other signal).
        let deadline = Instant::now() + Duration::from_secs(10);
        let addr = loop {
            let out = p.output();
            if let Some(a) = out
                .split("listening on ")
                .nth(1)
                .and_then(|s| s.split_whitespace().next())
            {
                break a.trim_start_matches("http://").to_string();
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "leasehold-sim did not start:\n{out}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        Ok(Sim { _proc: p, addr })
    }

    pub(crate) async fn get(&self, path: &str) -> anyhow::Result<Value> {
        http_get_json(&self.addr, path).await
    }

    /// Model calls served so far (every attempt's, crashed or not).
    async fn chat_requests(&self) -> anyhow::Result<u64> {
        self.get("/stats").await?["chat_requests"]
            .as_u64()
            .ok_or_else(|| anyhow::anyhow!("sim /stats without chat_requests"))
    }

    /// A research worker against this simulator.
    pub(crate) fn worker(&self, nats: &str, extra: &[(&'static str, String)]) -> Proc {
        let mut e = vec![
            ("LH_KINDS", "research".to_string()),
            ("LH_MODEL_BASE_URL", format!("http://{}/v1", self.addr)),
            ("LH_SEARCH_URL", format!("http://{}", self.addr)),
            ("LH_PUBLISH_URL", format!("http://{}/effects", self.addr)),
            ("LH_FETCH_ALLOW", "127.0.0.1".into()),
            ("LH_RESEARCH_RETRY_BASE", "20ms".into()),
            ("LH_RESEARCH_RETRY_CAP", "200ms".into()),
            // A crashed victim's jobs come back after 2 s.
            ("LH_SESSION_TIMEOUT", "2s".into()),
        ];
        e.extend(extra.iter().cloned());
        Proc::spawn("leasehold-worker", &[], &worker_env(nats, &e))
    }
}

async fn submit_research(work: &Work, id: &str) -> anyhow::Result<()> {
    let spec = json!({"input": {"topic": "lease-based ownership in distributed systems", "experts": EXPERTS, "sections": SECTIONS}});
    work.submit("research", spec.to_string().into(), Some(id), None)
        .await?;
    Ok(())
}

/// Waits for the job's terminal record; anything but `completed` is an error.
pub(crate) async fn completed(jobs: &Jobs, id: &str) -> anyhow::Result<JobRecord> {
    let (_, r) = wait_rec(jobs, id, |r| terminal(&r.status)).await?;
    anyhow::ensure!(r.status == "completed", "research job {id} ended {r:?}");
    Ok(r)
}

/// The payloads of the job's expert-section checkpoints, all epochs.
async fn section_payloads(events: &Events, id: &str) -> anyhow::Result<Vec<Value>> {
    Ok(events
        .read(id)
        .await?
        .into_iter()
        .filter(|(_, e)| e.r#type == "section")
        .filter_map(|(_, e)| serde_json::from_str::<Value>(&e.data).ok())
        .map(|d| d["payload"].clone())
        .collect())
}

/// Runs the research figures on one nats-server and one simulator.
pub async fn research(a: &Args) -> anyhow::Result<Value> {
    let (n, reps) = (a.research_jobs, a.crash_reps);
    // A short ack wait: a crashed worker's ticket comes back to the rescuer soon.
    let mut o = SetupOptions {
        ack_wait: Duration::from_secs(1),
        ..SetupOptions::default()
    };
    // Research's experts as child jobs (`"expert_jobs": true`).
    o.kinds.push("research-expert".into());
    let (s, conn) = server(o).await?;
    let url = s.url();
    let sim = Sim::start(0).await?;
    let jobs = Jobs::open(&conn).await?;
    let work = Work::new(&conn);
    let events = Events::new(&conn);
    let sections_per_job = (EXPERTS * SECTIONS) as f64;

    // Sections per second through one worker, and the flusher's figures of
    // every job of that batch (the flusher under load, not idle).
    let w = sim.worker(&url, &[("LH_WORKER_ID", "rs-tp".into())]);
    // Warm up: the worker is connected and pulling once one job completed.
    submit_research(&work, "rs-warm").await?;
    completed(&jobs, "rs-warm").await?;
    let mut watch = jobs.watch_all().await?;
    let t0 = Instant::now();
    for i in 0..n {
        submit_research(&work, &format!("rs-tp-{i}")).await?;
    }
    let mut recs: BTreeMap<String, JobRecord> = BTreeMap::new();
    while recs.len() < n {
        let e = tokio::time::timeout(Duration::from_secs(120), watch.next())
            .await
            .map_err(|_| anyhow::anyhow!("research batch: no progress within 120 s"))?
            .ok_or_else(|| anyhow::anyhow!("watch ended"))??;
        if !e.key.starts_with("rs-tp-") {
            continue;
        }
        if let Ok(r) = leasehold_store::jobs::decode(&e.key, &e.value) {
            if terminal(&r.status) {
                anyhow::ensure!(r.status == "completed", "research job ended {r:?}");
                recs.insert(e.key.clone(), r);
            }
        }
    }
    let took = t0.elapsed().as_secs_f64();
    drop(w);
    let (mut events_n, mut batches, mut updates, mut writes) = (0u64, 0u64, 0u64, 0u64);
    let (mut p50s, mut p99s, mut max_us) = (Vec::new(), Vec::new(), 0u64);
    for r in recs.values() {
        let out: Value = r
            .result
            .as_ref()
            .map(|x| serde_json::from_str(&x.output))
            .transpose()?
            .unwrap_or(Value::Null);
        let c = &out["checkpoints"];
        anyhow::ensure!(
            c.is_object(),
            "{}: no result.output.checkpoints (worker older than the bench?)",
            r.id
        );
        let u = |k: &str| c[k].as_u64().unwrap_or(0);
        events_n += u("events");
        batches += u("batches");
        updates += u("progress_updates");
        writes += u("progress_writes");
        let l = &c["flush_latency_us"];
        p50s.push(l["p50"].as_f64().unwrap_or(0.0));
        p99s.push(l["p99"].as_f64().unwrap_or(0.0));
        max_us = max_us.max(l["max"].as_u64().unwrap_or(0));
    }
    p50s.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let ms = |us: f64| (us / 100.0).round() / 10.0;
    let throughput = json!({
        "worker_processes": 1,
        "jobs": n,
        "expert_sections": n as f64 * sections_per_job,
        "seconds": took,
        "sections_per_s_per_worker": n as f64 * sections_per_job / took,
        "jobs_per_s": n as f64 / took,
    });
    let checkpoints = json!({
        "jobs": n,
        "events": events_n,
        "batches": batches,
        "events_per_batch": events_n as f64 / batches.max(1) as f64,
        "progress_updates": updates,
        "progress_writes": writes,
        "coalescing_ratio": updates as f64 / writes.max(1) as f64,
        // Queued -> acked by the server, per event. Pooled across jobs from
        // per-job summaries: p50 is the median job's, p99 the worst job's
        // (an upper bound of the pooled p99).
        "flush_latency_ms": {
            "p50": ms(p50s[p50s.len() / 2]),
            "p99": ms(p99s.iter().copied().fold(0.0, f64::max)),
            "max": ms(max_us as f64),
        },
    });

    // Rework: a clean run's model calls, then crashed runs of the same input.
    // One expert at a time, so a crash interrupts at most one section (the
    // unit of the seed's baseline).
    let one = ("LH_RESEARCH_EXPERT_CONCURRENCY", "1".to_string());
    let w = sim.worker(&url, &[("LH_WORKER_ID", "rs-clean".into()), one.clone()]);
    let c0 = sim.chat_requests().await?;
    submit_research(&work, "rs-clean").await?;
    let clean = completed(&jobs, "rs-clean").await?;
    let clean_calls = sim.chat_requests().await? - c0;
    // The same figures for one job alone on its worker (the flusher idle
    // but for it): exact percentiles of that job's events.
    let alone: Value = clean
        .result
        .as_ref()
        .map(|x| serde_json::from_str(&x.output))
        .transpose()?
        .unwrap_or(Value::Null);
    let alone = &alone["checkpoints"];
    drop(w);
    let per_section: Vec<f64> = section_payloads(&events, "rs-clean")
        .await?
        .iter()
        .map(|p| p["model_calls"].as_f64().unwrap_or(0.0))
        .collect();
    // The seed restarts the in-flight section: all its model calls again.
    let baseline = mean(&per_section);

    let summarize = |runs: &[Value]| {
        let crashed: Vec<&Value> = runs.iter().filter(|r| r["crashed"] == true).collect();
        let rep: Vec<f64> = crashed
            .iter()
            .map(|r| r["repeated_calls"].as_f64().unwrap_or(0.0))
            .collect();
        let lost: Vec<f64> = crashed
            .iter()
            .filter_map(|r| r["victim_results_not_durable"].as_f64())
            .collect();
        let max = rep.iter().copied().fold(0.0, f64::max);
        json!({
            "crashes": crashed.len(),
            "repeated_calls_mean": mean(&rep),
            "repeated_calls_max": max,
            // Issue 5's goal: at most one model call repeated per in-flight section.
            "at_most_one_repeated_met": max <= 1.0,
            "results_not_durable_mean": (!lost.is_empty()).then(|| mean(&lost)),
            "sections_repeated": crashed.iter().map(|r| r["sections_repeated"].as_u64().unwrap_or(0)).sum::<u64>(),
            "runs": runs,
        })
    };
    let mut aborts = Vec::new();
    let mut kills = Vec::new();
    for i in 0..reps {
        let k = 1 + (i as u64 * 5) % (EXPERTS * SECTIONS - 1);
        let crash = Crash {
            sim: &sim,
            jobs: &jobs,
            work: &work,
            events: &events,
            url: &url,
            clean_calls,
            kill_delay: Duration::ZERO,
        };
        aborts.push(crash.run(&format!("rs-abort-{i}"), k, false).await?);
        kills.push(crash.run(&format!("rs-kill-{i}"), k, true).await?);
    }
    // The same kill -9 against a model that takes real time per call (the
    // simulator's responses are the same, so is the clean count): the
    // flusher then keeps up, and the kill lands at various points of the
    // section in flight (after its k-th section, plus an offset).
    let mut paced = Vec::new();
    if a.paced_reps > 0 {
        let slow = Sim::start(a.paced_token_ms).await?;
        for i in 0..a.paced_reps {
            let crash = Crash {
                sim: &slow,
                jobs: &jobs,
                work: &work,
                events: &events,
                url: &url,
                clean_calls,
                kill_delay: Duration::from_millis(200 * i as u64),
            };
            let k = 1 + (i as u64 * 5) % (EXPERTS * SECTIONS - 1);
            paced.push(crash.run(&format!("rs-paced-kill-{i}"), k, true).await?);
        }
    }
    let as_jobs = ExpertJobs {
        sim: &sim,
        jobs: &jobs,
        work: &work,
        events: &events,
        conn: &conn,
        url: &url,
        clean_calls,
    }
    .run(reps)
    .await?;
    let lat = &alone["flush_latency_us"];
    let checkpoints_alone = json!({
        "events_per_batch": num(&alone["events"]) / num(&alone["batches"]).max(1.0),
        "coalescing_ratio": num(&alone["progress_updates"]) / num(&alone["progress_writes"]).max(1.0),
        "flush_latency_ms": {"p50": ms(num(&lat["p50"])), "p99": ms(num(&lat["p99"])), "max": ms(num(&lat["max"]))},
        "raw": alone,
    });
    Ok(json!({
        "input": {"experts": EXPERTS, "sections": SECTIONS, "model": "leasehold-sim, LH_SIM_TOKEN_DELAY_MS=0"},
        "throughput": throughput,
        "checkpoints": checkpoints,
        "checkpoints_one_job_alone": checkpoints_alone,
        "rework": {
            "clean_model_calls": clean_calls,
            "model_calls_per_section": baseline,
            "seed_baseline_repeated_calls_per_crash": baseline,
            "abort_after_section_checkpoint": summarize(&aborts),
            "kill9_mid_expert": summarize(&kills),
            "kill9_mid_expert_paced_model": (!paced.is_empty()).then(|| {
                let mut v = summarize(&paced);
                v["token_delay_ms"] = json!(a.paced_token_ms);
                v
            }),
        },
        "expert_jobs": as_jobs,
    }))
}

/// The same research input with its experts as child jobs (issue 33, item
/// 7), against the in-process run of this part: the document, the model
/// calls and the time of a clean job, and the rework of a crash.
struct ExpertJobs<'a> {
    sim: &'a Sim,
    jobs: &'a Jobs,
    work: &'a Work,
    events: &'a Events,
    conn: &'a leasehold_store::Conn,
    url: &'a str,
    clean_calls: u64,
}

impl ExpertJobs<'_> {
    const KINDS: (&'static str, &'static str) = ("LH_KINDS", "research,research-expert");

    async fn submit(&self, id: &str, as_jobs: bool) -> anyhow::Result<()> {
        let spec = json!({"input": {"topic": "lease-based ownership in distributed systems", "experts": EXPERTS, "sections": SECTIONS, "expert_jobs": as_jobs}});
        self.work
            .submit("research", spec.to_string().into(), Some(id), None)
            .await?;
        Ok(())
    }

    /// The report's text up to its recovery appendix (which says how the
    /// sections were written).
    async fn body(&self, rec: &JobRecord) -> anyhow::Result<String> {
        let name = rec.result.as_ref().and_then(|r| r.artifact.clone());
        let name = name.ok_or_else(|| anyhow::anyhow!("{}: no artifact", rec.id))?;
        let store = self
            .conn
            .js
            .get_object_store(self.conn.layout.artifacts_bucket())
            .await?;
        let mut text = String::new();
        tokio::io::AsyncReadExt::read_to_string(&mut store.get(&name).await?, &mut text).await?;
        Ok(text.split("## Appendix B").next().unwrap_or("").to_string())
    }

    /// One clean job: its record, model calls and seconds.
    async fn clean(&self, id: &str, as_jobs: bool) -> anyhow::Result<(JobRecord, u64, f64)> {
        let c0 = self.sim.chat_requests().await?;
        let t0 = Instant::now();
        self.submit(id, as_jobs).await?;
        let rec = completed(self.jobs, id).await?;
        let took = t0.elapsed().as_secs_f64();
        Ok((rec, self.sim.chat_requests().await? - c0, took))
    }

    async fn run(&self, reps: usize) -> anyhow::Result<Value> {
        // Clean: the same worker (one expert at a time in process; the
        // expert jobs take its slots), one job of each, twice, alternated.
        let w = self.sim.worker(
            self.url,
            &[
                ("LH_WORKER_ID", "rs-xj-clean".into()),
                (Self::KINDS.0, Self::KINDS.1.into()),
            ],
        );
        let (mut secs_in, mut secs_jobs) = (Vec::new(), Vec::new());
        let mut same_document = true;
        let mut calls_jobs = Vec::new();
        for i in 0..2 {
            let (a, _, ta) = self.clean(&format!("rs-xj-in-{i}"), false).await?;
            let (b, cb, tb) = self.clean(&format!("rs-xj-jobs-{i}"), true).await?;
            same_document &= self.body(&a).await? == self.body(&b).await?;
            secs_in.push(ta);
            secs_jobs.push(tb);
            calls_jobs.push(cb);
        }
        drop(w);
        // Crashed: the victim runs the report's job and its expert jobs one
        // at a time and aborts once its k-th expert section is durable; the
        // rescuer (no crash point: it is armed for every job not yet
        // reclaimed) finishes.
        let mut runs = Vec::new();
        for i in 0..reps {
            let id = format!("rs-xj-abort-{i}");
            let k = 1 + (i as u64) % SECTIONS;
            let c0 = self.sim.chat_requests().await?;
            let one = ("LH_CONCURRENCY", "1".to_string());
            let kinds = (Self::KINDS.0, Self::KINDS.1.to_string());
            let mut victim = self.sim.worker(
                self.url,
                &[
                    ("LH_WORKER_ID", format!("{id}-victim")),
                    kinds.clone(),
                    one.clone(),
                    ("LH_RESEARCH_CRASH_AT", format!("after_section:{k}")),
                ],
            );
            self.submit(&id, true).await?;
            let deadline = Instant::now() + Duration::from_secs(60);
            while victim.alive() {
                anyhow::ensure!(Instant::now() < deadline, "{id}: the victim did not abort");
                // A process's exit has no event to await here.
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let _ = victim.wait_timeout(Duration::ZERO);
            let rescuer = self.sim.worker(
                self.url,
                &[("LH_WORKER_ID", format!("{id}-rescuer")), kinds, one],
            );
            let rec = completed(self.jobs, &id).await?;
            let calls = self.sim.chat_requests().await? - c0;
            drop(rescuer);
            let mut redone = 0u64;
            let mut reclaims = 0u32;
            let spawn = self
                .events
                .read(&id)
                .await?
                .into_iter()
                .find(|(_, e)| e.r#type == "step" && e.data.contains("spawn:research-expert"))
                .and_then(|(_, e)| serde_json::from_str::<Value>(&e.data).ok())
                .ok_or_else(|| anyhow::anyhow!("{id}: no spawn step"))?;
            for c in spawn["result"]["children"].as_array().into_iter().flatten() {
                let c = c.as_str().unwrap_or_default();
                let mut per: HashMap<u64, u64> = HashMap::new();
                for p in section_payloads(self.events, c).await? {
                    *per.entry(p["index"].as_u64().unwrap_or(0)).or_default() += 1;
                }
                redone += per.values().map(|n| n - 1).sum::<u64>();
                reclaims += completed(self.jobs, c).await?.stale_reclaims;
            }
            runs.push(json!({
                "id": id,
                "after_sections": k,
                "crashed": reclaims > 0,
                "report_stale_reclaims": rec.stale_reclaims,
                "model_calls": calls,
                "repeated_calls": calls as i64 - self.clean_calls as i64,
                "sections_repeated": redone,
            }));
        }
        let rep: Vec<f64> = runs
            .iter()
            .map(|r| r["repeated_calls"].as_f64().unwrap_or(0.0))
            .collect();
        Ok(json!({
            "clean": {
                "same_document": same_document,
                "model_calls": calls_jobs,
                "in_process_model_calls": self.clean_calls,
                "seconds_in_process": secs_in,
                "seconds_expert_jobs": secs_jobs,
            },
            "abort_after_section_checkpoint": {
                "crashes": runs.iter().filter(|r| r["crashed"] == true).count(),
                "repeated_calls_mean": mean(&rep),
                "repeated_calls_max": rep.iter().copied().fold(0.0, f64::max),
                "sections_repeated": runs.iter().map(|r| r["sections_repeated"].as_u64().unwrap_or(0)).sum::<u64>(),
                "runs": runs,
            },
        }))
    }
}

/// One crashed research job: a victim worker runs it alone and dies, a
/// rescuer reclaims it once the victim's session ended and completes it.
struct Crash<'a> {
    sim: &'a Sim,
    jobs: &'a Jobs,
    work: &'a Work,
    events: &'a Events,
    url: &'a str,
    clean_calls: u64,
    /// How long after the `k`-th section's progress a kill -9 lands.
    kill_delay: Duration,
}

impl Crash<'_> {
    /// `kill9`: SIGKILL the victim as soon as its `k`-th section's progress
    /// is durable (the next section is then in flight, an arbitrary point
    /// in it). Otherwise the victim aborts itself right after its `k`-th
    /// section checkpoint is durable (`LH_RESEARCH_CRASH_AT=after_section:k`,
    /// armed only while the job has no stale reclaim, so the rescuer runs on).
    async fn run(&self, id: &str, k: u64, kill9: bool) -> anyhow::Result<Value> {
        let one = ("LH_RESEARCH_EXPERT_CONCURRENCY", "1".to_string());
        let victim_id = format!("{id}-victim");
        let mut env = vec![("LH_WORKER_ID", victim_id.clone()), one.clone()];
        if !kill9 {
            env.push(("LH_RESEARCH_CRASH_AT", format!("after_section:{k}")));
        }
        let c0 = self.sim.chat_requests().await?;
        let mut victim = self.sim.worker(self.url, &env);
        submit_research(self.work, id).await?;
        wait_record(self.jobs, id, |r| {
            r.worker_id.as_deref() == Some(victim_id.as_str()) || terminal(&r.status)
        })
        .await?;
        // Started only once the victim owns the job: it takes over, never starts it.
        let rescuer = self
            .sim
            .worker(self.url, &[("LH_WORKER_ID", format!("{id}-rescuer")), one]);
        if kill9 {
            wait_record(self.jobs, id, |r| {
                r.progress
                    .as_ref()
                    .is_some_and(|p| p.sections_done as u64 >= k)
                    || terminal(&r.status)
            })
            .await?;
            // A chosen fault time, not a wait for a condition.
            tokio::time::sleep(self.kill_delay).await;
            victim.kill9();
        }
        // The sim counts a call when it arrives, so this includes one in flight.
        let victim_calls = match kill9 {
            true => Some(self.sim.chat_requests().await? - c0),
            false => None,
        };
        let rec = completed(self.jobs, id).await?;
        let calls = self.sim.chat_requests().await? - c0;
        drop(rescuer);
        // The abort variant exited long ago (the rescuer waited out its session).
        let _ = victim.wait_timeout(Duration::from_secs(5));
        // What of the victim's work was durable when it died: model results
        // (outline, perspectives and final sections as phase events, one call
        // each; section responses as journal entries) and tool results. Its
        // other calls were in flight or still queued in its flusher.
        let (mut durable, mut tool_results) = (0u64, 0u64);
        for (_, e) in self.events.read(id).await? {
            let Some(d) = (e.epoch == 1)
                .then(|| serde_json::from_str::<Value>(&e.data).ok())
                .flatten()
            else {
                continue;
            };
            let role = (d["entry"]["op"] == "message").then(|| &d["entry"]["message"]["role"]);
            match e.r#type.as_str() {
                "phase" => {
                    durable += u64::from(matches!(
                        d["phase"].as_str(),
                        Some("outline" | "perspectives" | "final")
                    ))
                }
                "journal" if role.is_some_and(|r| r == "assistant") => durable += 1,
                "journal" if role.is_some_and(|r| r == "tool") => tool_results += 1,
                _ => {}
            }
        }
        let mut per: HashMap<(u64, u64), u64> = HashMap::new();
        for p in section_payloads(self.events, id).await? {
            *per.entry((
                p["expert"].as_u64().unwrap_or(0),
                p["index"].as_u64().unwrap_or(0),
            ))
            .or_default() += 1;
        }
        Ok(json!({
            "id": id,
            "kill": if kill9 { "kill -9" } else { "abort after section checkpoint" },
            "after_sections": k,
            "crashed": rec.stale_reclaims > 0,
            "model_calls": calls,
            "repeated_calls": calls as i64 - self.clean_calls as i64,
            "sections_repeated": per.values().map(|n| n - 1).sum::<u64>(),
            "victim_model_calls": victim_calls,
            "victim_durable_model_results": durable,
            "victim_durable_tool_results": tool_results,
            // Calls whose result was not durable at the kill: one in flight
            // at most (one expert at a time), the rest completed but still
            // queued in the flusher. A durable tool proposal whose tool result
            // was not durable is asked again too (the repair drops it).
            "victim_results_not_durable": victim_calls.map(|v| v.saturating_sub(durable)),
        }))
    }
}

pub fn research_rows(r: &Value) -> Vec<(String, String)> {
    let f = |v: &Value| v.as_f64().unwrap_or(f64::NAN);
    let tp = &r["throughput"];
    let ck = &r["checkpoints"];
    let rw = &r["rework"];
    let shape = format!("{EXPERTS}x{SECTIONS}");
    let mut rows = vec![
        (
            format!("research {shape}: expert sections/s, 1 worker (instant model)"),
            format!("{:.1}", f(&tp["sections_per_s_per_worker"])),
        ),
        (
            format!(
                "research: flush latency p50/p99 ms, {} jobs at once",
                tp["jobs"]
            ),
            format!(
                "{}/{}",
                ck["flush_latency_ms"]["p50"], ck["flush_latency_ms"]["p99"]
            ),
        ),
        (
            "research: flush latency p50/p99 ms, one job alone".into(),
            format!(
                "{}/{}",
                r["checkpoints_one_job_alone"]["flush_latency_ms"]["p50"],
                r["checkpoints_one_job_alone"]["flush_latency_ms"]["p99"]
            ),
        ),
        (
            "research: progress updates per durable write".into(),
            format!("{:.1}", f(&ck["coalescing_ratio"])),
        ),
        (
            "research: checkpoint events per flush batch".into(),
            format!("{:.1}", f(&ck["events_per_batch"])),
        ),
        (
            format!("research {shape}: model calls of a clean job"),
            rw["clean_model_calls"].to_string(),
        ),
        (
            "seed baseline: calls repeated per crash (1 section)".into(),
            format!("{:.1}", f(&rw["seed_baseline_repeated_calls_per_crash"])),
        ),
    ];
    let xj = &r["expert_jobs"];
    if !xj.is_null() {
        let c = &xj["clean"];
        let secs = |k: &str| {
            mean(
                &c[k]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(f)
                    .collect::<Vec<_>>(),
            )
        };
        rows.push((
            format!("research {shape}, experts as child jobs: the same document, model calls"),
            format!("{} {}", c["same_document"], c["model_calls"]),
        ));
        rows.push((
            "research, experts as child jobs: seconds per clean job (in process)".into(),
            format!(
                "{:.2} ({:.2})",
                secs("seconds_expert_jobs"),
                secs("seconds_in_process")
            ),
        ));
        let x = &xj["abort_after_section_checkpoint"];
        rows.push((
            format!(
                "research, experts as child jobs: calls repeated per abort at a section checkpoint, mean/max (n={})",
                x["crashes"]
            ),
            format!("{:.1}/{}", f(&x["repeated_calls_mean"]), x["repeated_calls_max"]),
        ));
        rows.push((
            "research, experts as child jobs: sections redone after those aborts".into(),
            x["sections_repeated"].to_string(),
        ));
    }
    for (k, name) in [
        (
            "abort_after_section_checkpoint",
            "abort at a section checkpoint",
        ),
        ("kill9_mid_expert", "kill -9 mid-expert"),
        ("kill9_mid_expert_paced_model", "kill -9, paced model"),
    ] {
        let x = &rw[k];
        if x.is_null() {
            continue;
        }
        rows.push((
            format!("calls repeated per {name}, mean/max (n={})", x["crashes"]),
            format!(
                "{:.1}/{}",
                f(&x["repeated_calls_mean"]),
                x["repeated_calls_max"]
            ),
        ));
        rows.push((
            format!("sections redone after {name} (n={})", x["crashes"]),
            x["sections_repeated"].to_string(),
        ));
        if let Some(lost) = x["results_not_durable_mean"].as_f64() {
            rows.push((
                format!("model results not yet durable at {name}, mean"),
                format!("{lost:.1}"),
            ));
        }
    }
    rows
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or(0.0)
}

// ------------------------------------------------------- part 7: read cost

/// `$JS.API.<family>.<op>.<stream>...` requests by operation and stream.
fn by_api(m: &async_nats::Message) -> Option<String> {
    let t: Vec<&str> = m.subject.as_str().split('.').collect();
    match t.get(2).copied() {
        Some("CONSUMER" | "STREAM" | "DIRECT") => Some(format!(
            "{}.{} {}",
            t[2],
            t.get(3).unwrap_or(&"?"),
            // CONSUMER.MSG.NEXT.<stream> and STREAM.MSG.GET.<stream>
            if t.get(3) == Some(&"MSG") {
                t.get(5)
            } else {
                t.get(4)
            }
            .unwrap_or(&"?")
        )),
        Some(other) => Some(other.to_string()),
        None => None,
    }
}

/// What one research job reads while 0, 1, 100, 1,000 ... other research
/// jobs sit beside it as finished records with all their events.
///
/// Method: one research worker process against an instant simulated model
/// runs a clean template job; its events and record are then copied under
/// other job ids (the background, seeded straight into the event stream and
/// the job bucket). For each background size a fresh job is run through the
/// same worker, and the server's own per-connection counters (monitoring
/// `/connz`: bytes and messages the server delivered to the worker's
/// connection) are read before and after it, together with the JetStream
/// API requests made meanwhile (a core subscription on `$JS.API.>`: consumer
/// creations and direct gets on the event stream). Everything the worker
/// reads from NATS goes through that connection; the model and search are
/// HTTP and not counted. The measured job's own events are reported beside
/// it: that is what it has to read.
pub async fn research_cost(backgrounds: &[usize]) -> anyhow::Result<Value> {
    let (s, conn) = server(SetupOptions::default()).await?;
    let url = s.url();
    let sim = Sim::start(0).await?;
    let jobs = Jobs::open(&conn).await?;
    let work = Work::new(&conn);
    let events = Events::new(&conn);
    let wid = "rc-worker";
    let _w = sim.worker(&url, &[("LH_WORKER_ID", wid.into())]);
    wait_session(&conn, wid).await?;
    submit_research(&work, "rc-template").await?;
    let template = completed(&jobs, "rc-template").await?;
    let template_events = events.read("rc-template").await?;
    let template_bytes: usize = template_events
        .iter()
        .map(|(_, e)| serde_json::to_vec(e).map_or(0, |b| b.len()))
        .sum();
    let client = async_nats::connect(url.clone()).await?;
    let api = Counter::start(&client, "$JS.API.>", by_api).await?;
    let name = format!("leasehold-worker {wid}");
    let events_stream = conn.layout.events_stream();
    let mut seeded = 0usize;
    let mut runs = Vec::new();
    let seed_t0 = Instant::now();
    for (k, &b) in backgrounds.iter().enumerate() {
        let mut pending = futures::stream::FuturesUnordered::new();
        while seeded < b {
            let id = format!("rc-bg-{seeded}");
            let mut rec = template.clone();
            rec.id = id.clone();
            jobs.kv().put(&id, serde_json::to_vec(&rec)?.into()).await?;
            for (_, e) in &template_events {
                let mut e = e.clone();
                e.job_id = id.clone();
                let subject = conn.layout.event_subject(&id, &e.r#type);
                pending.push(
                    conn.js
                        .send_publish(
                            subject,
                            async_nats::jetstream::message::PublishMessage::build()
                                .payload(serde_json::to_vec(&e)?.into()),
                        )
                        .await?
                        .into_future(),
                );
                while pending.len() >= 1024 {
                    pending.next().await.transpose()?;
                }
            }
            seeded += 1;
        }
        while pending.next().await.transpose()?.is_some() {}
        let st = conn
            .js
            .get_stream(&events_stream)
            .await?
            .info()
            .await?
            .state
            .clone();
        tokio::time::sleep(Duration::from_millis(500)).await;
        let id = format!("rc-measured-{k}");
        let before = s.connection(&name).await?;
        api.reset();
        let t0 = Instant::now();
        submit_research(&work, &id).await?;
        completed(&jobs, &id).await?;
        let took = ms(t0.elapsed());
        let after = s.connection(&name).await?;
        let calls = api.snapshot();
        let own = events.read(&id).await?;
        let own_bytes: usize = own
            .iter()
            .map(|(_, e)| serde_json::to_vec(e).map_or(0, |b| b.len()))
            .sum();
        let d = |k: &str| {
            after[k]
                .as_u64()
                .unwrap_or(0)
                .saturating_sub(before[k].as_u64().unwrap_or(0))
        };
        let on_events = |op: &str| {
            calls
                .get(&format!("{op} {events_stream}"))
                .map_or(0, |c| c.0)
        };
        runs.push(json!({
            "background_jobs": b,
            "events_stream_messages": st.messages,
            "events_stream_bytes": st.bytes,
            "job_ms": took,
            "bytes_delivered_to_worker": d("out_bytes"),
            "messages_delivered_to_worker": d("out_msgs"),
            "messages_published_by_worker": d("in_msgs"),
            "event_consumers_created": on_events("CONSUMER.CREATE"),
            "event_direct_gets": on_events("DIRECT.GET"),
            "event_msg_gets": on_events("STREAM.MSG"),
            "own_events": own.len(),
            "own_event_bytes": own_bytes,
            "api_requests": calls.iter().map(|(k, v)| (k.clone(), json!(v.0))).collect::<serde_json::Map<_, _>>(),
        }));
    }
    let base = runs
        .first()
        .map_or(0.0, |r| num(&r["bytes_delivered_to_worker"]));
    let top = runs
        .last()
        .map_or(0.0, |r| num(&r["bytes_delivered_to_worker"]));
    let ratio = top / base.max(1.0);
    Ok(json!({
        "method": "bytes and messages the server delivered to the research worker's connection (nats-server /connz) while one fresh research job ran, with N other research jobs present as finished records with a full copy of a real job's events; plus JetStream API requests on the event stream during the job (core subscription on $JS.API.>)",
        "template_events": template_events.len(),
        "template_event_bytes": template_bytes,
        "seeding_s": seed_t0.elapsed().as_secs_f64(),
        "runs": runs,
        "ratio_largest_to_smallest_background": ratio,
        "target": "bytes delivered with the largest background <= 1.2 x with the smallest",
        "met": ratio <= 1.2,
    }))
}

pub fn cost_rows(r: &mut Report, v: &Value) {
    let runs = v["runs"].as_array().cloned().unwrap_or_default();
    let Some(first) = runs.first() else { return };
    for x in &runs {
        let last = std::ptr::eq(x, runs.last().unwrap());
        r.cmp(
            format!(
                "research job: KiB delivered to worker, {} bg jobs",
                x["background_jobs"]
            ),
            format!("{:.1}", num(&x["bytes_delivered_to_worker"]) / 1024.0),
            format!(
                "{} bg: {:.1}",
                first["background_jobs"],
                num(&first["bytes_delivered_to_worker"]) / 1024.0
            ),
            if last {
                "<= 1.2x".to_string()
            } else {
                String::new()
            },
            if last { v["met"].as_bool() } else { None },
        );
    }
    if let Some(x) = runs.last() {
        r.row(
            format!(
                "research job: event consumers created / own events, {} bg",
                x["background_jobs"]
            ),
            format!("{}/{}", x["event_consumers_created"], x["own_events"]),
        );
    }
}
