//! The `real-model` part: research jobs on a real local model
//! (SmolLM2-135M-Instruct served by llama-cpp-python from the virtualenv of
//! `make test-model`) against the same jobs on the simulator with instant
//! answers, which is the orchestration's own cost; and the real server's
//! tokens per second measured in the same run, before and after the jobs,
//! so the job's wall time is read against what the server can generate.
//!
//! Model calls are counted at a recording proxy in front of the server (it
//! has no `/stats`); `refusals` are the requests llama-cpp-python rejects
//! before generating (`json_schema`, once per worker process: the runtime
//! then uses `json_object` with the schema); `cut` the generations whose
//! stream the server ended before a finish reason.
//!
//! The jobs have two experts × two sections with the experts in parallel
//! (research's default): llama-cpp-python's server serves one generation
//! at a time and cuts the one in flight for a newcomer, so the worker
//! learns the provider's concurrency of 1 from the first cuts (issue 37);
//! each job reports its sections skipped, its `retry` events and whether
//! that was learned.
//!
//! Runs only where the virtualenv is installed (`LH_MODEL_VENV`, default
//! `~/.cache/leasehold/model-venv`); elsewhere the part is reported as
//! skipped, with why.

use std::time::{Duration, Instant};

use leasehold_harness::llama::{ChatRecorder, LlamaServer, ModelVenv, MODEL_ALIAS};
use leasehold_harness::Proc;
use leasehold_store::events::Events;
use leasehold_store::setup::SetupOptions;
use leasehold_store::work::Work;
use leasehold_store::Jobs;
use serde_json::{json, Value};

use crate::common::*;

/// Two experts in parallel, two sections each (about a dozen model calls).
const EXPERTS: u64 = 2;
const SECTIONS: u64 = 2;
const MAX_TOKENS: u32 = 200;
/// Completions timed for the server's tokens per second, each time.
const PROBES: usize = 3;

/// The virtualenv, or why the part cannot run.
pub fn venv() -> Result<ModelVenv, String> {
    match std::env::var_os("LH_MODEL_VENV") {
        Some(_) => ModelVenv::from_env(),
        None => {
            let home = std::env::var_os("HOME").ok_or("HOME is not set")?;
            ModelVenv::at(&std::path::Path::new(&home).join(".cache/leasehold/model-venv"))
        }
    }
}

/// Tokens per second of `PROBES` non-streaming completions.
async fn tokens_per_s(llama: &LlamaServer) -> anyhow::Result<Value> {
    let (mut tokens, mut secs) = (0u64, 0f64);
    for i in 0..PROBES {
        let (n, took) = llama
            .complete(
                &format!(
                    "Write {} sentences about leases in distributed systems.",
                    i + 3
                ),
                128,
            )
            .await
            .map_err(anyhow::Error::msg)?;
        tokens += n;
        secs += took.as_secs_f64();
    }
    Ok(json!({
        "completions": PROBES,
        "completion_tokens": tokens,
        "seconds": secs,
        "tokens_per_s": tokens as f64 / secs,
    }))
}

/// One research job through `worker`: wall time, status, whether partial,
/// sections skipped, `retry` events (and how many say the provider serves
/// one request at a time).
async fn job(work: &Work, jobs: &Jobs, events: &Events, id: &str) -> anyhow::Result<(f64, Value)> {
    let spec = json!({"input": {"topic": "lease-based ownership in distributed systems", "experts": EXPERTS, "sections": SECTIONS}});
    let t0 = Instant::now();
    let mut w = jobs.watch(id).await?;
    work.submit("research", spec.to_string().into(), Some(id), None)
        .await?;
    let (_, r) = next_rec(&mut w, id, Duration::from_secs(600), |r| {
        terminal(&r.status)
    })
    .await?;
    let secs = t0.elapsed().as_secs_f64();
    let res = r.result.as_ref();
    // The record is written before its terminal event: read once it landed.
    let deadline = Instant::now() + Duration::from_secs(10);
    let evs = loop {
        let evs: Vec<_> = events.read(id).await?.into_iter().map(|(_, e)| e).collect();
        if !terminal(&r.status)
            || evs.iter().any(|e| e.r#type == r.status)
            || Instant::now() > deadline
        {
            break evs;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let reasons: Vec<String> = evs
        .iter()
        .filter(|e| e.r#type == "retry")
        .map(|e| e.data_map()["reason"].as_str().unwrap_or("").to_string())
        .collect();
    Ok((
        secs,
        json!({
            "id": id,
            "status": r.status,
            "partial": res.map(|x| x.partial),
            "skipped_sections": res.map_or(0, |x| x.skipped_sections.len()),
            "retries": reasons.len(),
            "learned_one_at_a_time": reasons.iter().any(|r| r.contains("serves one request at a time; concurrency 1 from now on")),
            "attempts": r.attempts,
            "error": r.error.as_ref().map(|e| json!({"class": e.class, "message": e.message})),
            "seconds": secs,
        }),
    ))
}

fn research_env(model_url: &str, model: &str, sim: &str) -> Vec<(&'static str, String)> {
    vec![
        ("LH_KINDS", "research".into()),
        ("LH_MODEL_BASE_URL", model_url.into()),
        ("LH_MODEL", model.into()),
        ("LH_MODEL_MAX_TOKENS", MAX_TOKENS.to_string()),
        ("LH_SEARCH_URL", format!("http://{sim}")),
        ("LH_PUBLISH_URL", format!("http://{sim}/effects")),
        ("LH_FETCH_ALLOW", "127.0.0.1".into()),
    ]
}

async fn sim() -> anyhow::Result<(Proc, String)> {
    let p = Proc::spawn(
        "leasehold-sim",
        &["--listen", "127.0.0.1:0"],
        &[("LH_SIM_TOKEN_DELAY_MS", "0".to_string())],
    );
    wait_log(&p, "listening on ", Duration::from_secs(10)).await?;
    let addr = p
        .output()
        .split("listening on ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .unwrap_or("")
        .trim_start_matches("http://")
        .to_string();
    Ok((p, addr))
}

/// The part: `jobs` research jobs on each model, one worker each, in turn.
pub async fn real_model(venv: &ModelVenv, jobs_n: usize) -> anyhow::Result<Value> {
    let (s, conn) = server(SetupOptions::default()).await?;
    let (jobs, work, events) = (
        Jobs::open(&conn).await?,
        Work::new(&conn),
        Events::new(&conn),
    );
    let (_sim, sim_addr) = sim().await?;
    let llama = LlamaServer::start(venv, Duration::from_secs(120))
        .await
        .map_err(anyhow::Error::msg)?;
    let rec = ChatRecorder::start(&llama.addr()).await;
    let before = tokens_per_s(&llama).await?;

    // The real model.
    let w = Proc::spawn(
        "leasehold-worker",
        &[],
        &worker_env(
            &s.url(),
            &research_env(&rec.base_url(), MODEL_ALIAS, &sim_addr),
        ),
    );
    let (mut real, mut real_secs, mut calls, mut refusals) = (Vec::new(), Vec::new(), 0, 0);
    for i in 0..jobs_n {
        let n0 = rec.requests().len();
        let (secs, mut v) = job(&work, &jobs, &events, &format!("rm-real-{i}")).await?;
        let reqs = rec.requests()[n0..].to_vec();
        let refused = reqs
            .iter()
            .filter(|r| r.structured() == Some("json_schema"))
            .count();
        v["model_calls"] = json!(reqs.len() - refused);
        v["refusals"] = json!(refused);
        v["cut"] = json!(reqs
            .iter()
            .filter(|r| r.structured() != Some("json_schema") && r.ended.is_some() && !r.finished)
            .count());
        calls += reqs.len() - refused;
        refusals += refused;
        real_secs.push(secs);
        real.push(v);
    }
    drop(w);
    let after = tokens_per_s(&llama).await?;

    // The same jobs on the simulator with instant answers.
    let w = Proc::spawn(
        "leasehold-worker",
        &[],
        &worker_env(
            &s.url(),
            &research_env(&format!("http://{sim_addr}/v1"), "sim-1", &sim_addr),
        ),
    );
    let sim_calls = |v: Value| v["chat_requests"].as_u64().unwrap_or(0);
    let (mut simmed, mut sim_secs, mut sim_total) = (Vec::new(), Vec::new(), 0);
    for i in 0..jobs_n {
        let c0 = sim_calls(http_get_json(&sim_addr, "/stats").await?);
        let (secs, mut v) = job(&work, &jobs, &events, &format!("rm-sim-{i}")).await?;
        let c = sim_calls(http_get_json(&sim_addr, "/stats").await?) - c0;
        v["model_calls"] = json!(c);
        sim_total += c;
        sim_secs.push(secs);
        simmed.push(v);
    }
    drop(w);

    let tps = |v: &Value| v["tokens_per_s"].as_f64().unwrap_or(0.0);
    let (real_med, sim_med) = (median(&real_secs), median(&sim_secs));
    Ok(json!({
        "input": {"experts": EXPERTS, "sections": SECTIONS, "max_tokens": MAX_TOKENS},
        "model": {"server": "llama-cpp-python", "gguf": venv.gguf.file_name().map(|n| n.to_string_lossy().to_string())},
        "server_tokens_per_s": {
            "before_jobs": before,
            "after_jobs": after,
            "mean": (tps(&before) + tps(&after)) / 2.0,
        },
        "real": {
            "completed": real.iter().filter(|j| j["status"] == "completed").count(),
            "skipped_sections": real.iter().map(|j| j["skipped_sections"].as_u64().unwrap_or(0)).sum::<u64>(),
            "retries": real.iter().map(|j| j["retries"].as_u64().unwrap_or(0)).sum::<u64>(),
            "cut": real.iter().map(|j| j["cut"].as_u64().unwrap_or(0)).sum::<u64>(),
            "jobs": real,
            "wall_s_median": real_med,
            "model_calls_per_job": calls as f64 / jobs_n as f64,
            "refusals_per_job": refusals as f64 / jobs_n as f64,
        },
        "sim_instant": {
            "jobs": simmed,
            "wall_s_median": sim_med,
            "model_calls_per_job": sim_total as f64 / jobs_n as f64,
        },
        "wall_ratio_real_to_sim": if sim_med > 0.0 { real_med / sim_med } else { 0.0 },
    }))
}

pub fn rows(r: &mut Report, v: &Value) {
    let f = |x: &Value| x.as_f64().unwrap_or(0.0);
    r.cmp(
        "real model research job (2x2): wall s median",
        format!("{:.1}", f(&v["real"]["wall_s_median"])),
        format!("sim instant {:.2} s", f(&v["sim_instant"]["wall_s_median"])),
        "",
        None,
    );
    r.cmp(
        "real model research job: model calls per job",
        format!("{:.1}", f(&v["real"]["model_calls_per_job"])),
        format!("sim {:.1}", f(&v["sim_instant"]["model_calls_per_job"])),
        "",
        None,
    );
    r.row(
        "real model research jobs completed",
        format!(
            "{}/{}",
            v["real"]["completed"],
            v["real"]["jobs"].as_array().map_or(0, Vec::len)
        ),
    );
    r.row(
        "real model research jobs: sections skipped, retries, streams cut",
        format!(
            "{}, {}, {}",
            v["real"]["skipped_sections"], v["real"]["retries"], v["real"]["cut"]
        ),
    );
    r.row(
        "real model server: tokens/s (same run)",
        format!("{:.1}", f(&v["server_tokens_per_s"]["mean"])),
    );
}
