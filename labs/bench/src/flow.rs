//! `flow`: what fleet-wide flow control costs, and whether it keeps a
//! fleet at its limit: 4 "workers" (each its own NATS connection, flow
//! control and coordinator, as in 4 processes) × 16 concurrent model
//! requests of 20 ms each against one provider key.
//!
//! - Under the limit: coordination writes per second (the `lh_flow`
//!   stream's sequence over the window, per worker per limit: all three
//!   limits are in one lease write) and the added latency of an admitted
//!   request (`try_admit`), p50/p99.
//! - Over it (an RPM limit the requests could exceed 16×): the requests
//!   admitted per minute, against the limit.
//! - Slices below one request a second: the sim limited to 120 rpm with
//!   one second of burst (a bucket of 2 requests), the fleet's limit the
//!   same, over 4 and 16 workers (0.5 and 0.125 requests a second each),
//!   each with 2 requests always waiting and a 429 pausing the fleet as
//!   the model client does: the share of 429s and of the limit used.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold_flow::Limits;
use leasehold_flow::{Flow, ProviderKey, Wait};
use leasehold_store::flow::{FlowStore, LimitEntry};
use leasehold_store::setup::SetupOptions;
use leasehold_store::NatsArgs;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::common::{pct, server, Report};

const WORKERS: usize = 4;
const CONCURRENT: usize = 16;
const REQUEST: Duration = Duration::from_millis(20);

async fn flow_seq(conn: &leasehold_store::Conn) -> anyhow::Result<u64> {
    let mut s = conn
        .js
        .get_stream(format!("KV_{}", conn.layout.flow_bucket()))
        .await?;
    Ok(s.info().await?.state.last_sequence)
}

/// One run: `limits` on the key, `window` measured after `warm`.
async fn run(limits: Limits, warm: Duration, window: Duration) -> anyhow::Result<Value> {
    let (srv, conn) = server(SetupOptions::default()).await?;
    let key = ProviderKey::new("http://bench.invalid/v1", "bench-1", None);
    FlowStore::open(&conn)
        .await?
        .set_limits(
            &key.id,
            &LimitEntry {
                limits,
                provider: Some(key.info.clone()),
                weight: None,
                updated_at: String::new(),
            },
        )
        .await?;
    let stop = CancellationToken::new();
    let measuring = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let lat = Arc::new(Mutex::new(Vec::<f64>::new()));
    let admitted = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut tasks = Vec::new();
    for w in 0..WORKERS {
        let c = NatsArgs::local(srv.url(), "lh")
            .connect(&format!("bench flow {w}"))
            .await?;
        let flow = Arc::new(Flow::new());
        tasks.push(leasehold_worker::flow::start_with(
            flow.clone(),
            c,
            format!("bench-w{w}"),
            stop.clone(),
        ));
        for _ in 0..CONCURRENT {
            let (flow, key, stop) = (flow.clone(), key.clone(), stop.clone());
            let (lat, admitted, measuring) = (lat.clone(), admitted.clone(), measuring.clone());
            tasks.push(tokio::spawn(async move {
                while !stop.is_cancelled() {
                    let t = Instant::now();
                    let mut waited = false;
                    let mut permit = loop {
                        match flow.try_admit(&key, 500) {
                            Ok(p) => break p,
                            Err(w) => {
                                waited = true;
                                let wake = match w {
                                    Wait::Paused { at, .. } => at,
                                    Wait::Limited { retry, .. } => retry,
                                };
                                tokio::select! {
                                    _ = stop.cancelled() => return,
                                    _ = tokio::time::sleep_until(wake) => {}
                                    _ = flow.changed() => {}
                                }
                            }
                        }
                    };
                    let took = t.elapsed();
                    if measuring.load(std::sync::atomic::Ordering::Relaxed) {
                        admitted.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        if !waited {
                            lat.lock().unwrap().push(took.as_secs_f64() * 1000.0);
                        }
                    }
                    tokio::time::sleep(REQUEST).await;
                    permit.reconcile(450);
                }
            }));
        }
    }
    tokio::time::sleep(warm).await;
    let seq0 = flow_seq(&conn).await?;
    admitted.store(0, std::sync::atomic::Ordering::Relaxed);
    measuring.store(true, std::sync::atomic::Ordering::Relaxed);
    let t0 = Instant::now();
    tokio::time::sleep(window).await;
    measuring.store(false, std::sync::atomic::Ordering::Relaxed);
    let secs = t0.elapsed().as_secs_f64();
    let writes = flow_seq(&conn).await? - seq0;
    stop.cancel();
    for t in tasks {
        let _ = t.await;
    }
    let lat = lat.lock().unwrap().clone();
    let writes_per_s = writes as f64 / secs;
    Ok(json!({
        "workers": WORKERS,
        "concurrent_per_worker": CONCURRENT,
        "request_ms": REQUEST.as_millis() as u64,
        "window_s": secs,
        "coordination_writes": writes,
        "writes_per_s": writes_per_s,
        "writes_per_worker_per_limit_per_s": writes_per_s / WORKERS as f64,
        "admitted_per_min": admitted.load(std::sync::atomic::Ordering::Relaxed) as f64 / secs * 60.0,
        "admission_ms_p50": pct(&lat, 0.5),
        "admission_ms_p99": pct(&lat, 0.99),
        "admitted_without_waiting": lat.len(),
    }))
}

/// Requests per minute of the fractional runs, and their measured window.
const FRACTIONAL_RPM: u64 = 120;
const FRACTIONAL_WARM: Duration = Duration::from_secs(10);
const FRACTIONAL_WINDOW: Duration = Duration::from_secs(40);

/// One fractional run over `workers` (module docs).
async fn fractional(workers: usize) -> anyhow::Result<Value> {
    use crate::research::Sim;
    let (srv, conn) = server(SetupOptions::default()).await?;
    let spec = format!("sim-1:rpm={FRACTIONAL_RPM},burst=1");
    let sim = Sim::start_with(0, &["--limit", &spec]).await?;
    let base = format!("http://{}/v1", sim.addr);
    let key = ProviderKey::new(&base, "sim-1", None);
    FlowStore::open(&conn)
        .await?
        .set_limits(
            &key.id,
            &LimitEntry {
                limits: Limits {
                    rpm: Some(FRACTIONAL_RPM),
                    tpm: None,
                    concurrency: None,
                },
                provider: Some(key.info.clone()),
                weight: None,
                updated_at: String::new(),
            },
        )
        .await?;
    let stop = CancellationToken::new();
    let http = reqwest::Client::new();
    let mut tasks = Vec::new();
    for w in 0..workers {
        let c = NatsArgs::local(srv.url(), "lh")
            .connect(&format!("bench flow fractional {w}"))
            .await?;
        let flow = Arc::new(Flow::new());
        tasks.push(leasehold_worker::flow::start_with(
            flow.clone(),
            c,
            format!("bench-f{w:02}"),
            stop.clone(),
        ));
        for _ in 0..2 {
            let (flow, key, stop, http) = (flow.clone(), key.clone(), stop.clone(), http.clone());
            let url = format!("{base}/chat/completions");
            tasks.push(tokio::spawn(async move {
                while !stop.is_cancelled() {
                    let permit = match flow.try_admit(&key, 10) {
                        Ok(p) => p,
                        Err(w) => {
                            let wake = match w {
                                Wait::Paused { at, .. } => at,
                                Wait::Limited { retry, .. } => retry,
                            };
                            tokio::select! {
                                _ = stop.cancelled() => return,
                                _ = tokio::time::sleep_until(wake) => {}
                                _ = flow.changed() => {}
                            }
                            continue;
                        }
                    };
                    let body = json!({"model": "sim-1", "max_tokens": 8,
                        "messages": [{"role": "user", "content": "flow"}]});
                    let Ok(r) = http.post(&url).json(&body).send().await else {
                        continue;
                    };
                    let retry = r
                        .headers()
                        .get("retry-after")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.trim().parse::<u64>().ok());
                    let limited = r.status().as_u16() == 429;
                    let _ = r.bytes().await;
                    drop(permit);
                    if limited {
                        let secs = retry.unwrap_or(1).max(1);
                        flow.cooldown(
                            &key,
                            std::time::SystemTime::now() + Duration::from_secs(secs),
                            "rate_limited",
                        );
                    }
                }
            }));
        }
    }
    tokio::time::sleep(FRACTIONAL_WARM).await;
    let count = |v: &Value| {
        (
            v["chat_requests"].as_u64().unwrap_or(0),
            v["rate_limited_total"].as_u64().unwrap_or(0),
        )
    };
    let (r0, l0) = count(&sim.get("/stats").await?);
    let t0 = Instant::now();
    tokio::time::sleep(FRACTIONAL_WINDOW).await;
    let (r1, l1) = count(&sim.get("/stats").await?);
    let secs = t0.elapsed().as_secs_f64();
    stop.cancel();
    for t in tasks {
        let _ = t.await;
    }
    let (requests, refused) = (r1 - r0, l1 - l0);
    let per_min = (requests - refused) as f64 / secs * 60.0;
    let share_429 = refused as f64 / requests.max(1) as f64;
    let achieved = per_min / FRACTIONAL_RPM as f64;
    Ok(json!({
        "workers": workers,
        "rpm_limit": FRACTIONAL_RPM,
        "slice_per_worker_per_s": FRACTIONAL_RPM as f64 / 60.0 / workers as f64,
        "window_s": secs,
        "requests": requests,
        "refused_429": refused,
        "share_429": share_429,
        "answered_per_min": per_min,
        "achieved_share_of_limit": achieved,
        "share_429_met": share_429 <= 0.01,
        "achieved_met": achieved >= 0.9,
    }))
}

/// The part.
pub async fn flow() -> anyhow::Result<Value> {
    let under = run(
        Limits {
            rpm: Some(10_000_000),
            tpm: Some(10_000_000_000),
            concurrency: Some(100_000),
        },
        Duration::from_secs(3),
        Duration::from_secs(10),
    )
    .await?;
    // 64 requests of 20 ms could do 3,200/s = 192,000/min: the limit is 16x less.
    let rpm = 12_000u64;
    let over = run(
        Limits {
            rpm: Some(rpm),
            tpm: None,
            concurrency: None,
        },
        Duration::from_secs(3),
        Duration::from_secs(10),
    )
    .await?;
    let achieved = over["admitted_per_min"].as_f64().unwrap_or(0.0) / rpm as f64;
    let fractional_4 = fractional(4).await?;
    let fractional_16 = fractional(16).await?;
    Ok(json!({
        "fractional_4": fractional_4,
        "fractional_16": fractional_16,
        "under_limit": under,
        "over_limit": over,
        "rpm_limit": rpm,
        "achieved_share_of_limit": achieved,
        "writes_met": under["writes_per_worker_per_limit_per_s"].as_f64().is_some_and(|w| w <= 1.05)
            && over["writes_per_worker_per_limit_per_s"].as_f64().is_some_and(|w| w <= 1.05),
        "latency_met": under["admission_ms_p50"].as_f64().is_some_and(|p| p <= 1.0),
        "achieved_met": (0.9..=1.05).contains(&achieved),
    }))
}

pub fn rows(r: &mut Report, v: &Value) {
    let u = &v["under_limit"];
    let o = &v["over_limit"];
    r.cmp(
        "flow control: coordination writes per worker per limit per s (4 workers x 16 requests)",
        format!(
            "{:.2} under the limit, {:.2} at it",
            u["writes_per_worker_per_limit_per_s"]
                .as_f64()
                .unwrap_or(f64::NAN),
            o["writes_per_worker_per_limit_per_s"]
                .as_f64()
                .unwrap_or(f64::NAN)
        ),
        "one KV write per request would be ~800/s per worker".to_string(),
        "<= 1",
        v["writes_met"].as_bool(),
    );
    r.cmp(
        "flow control: added latency per admitted request p50/p99 ms (under the limit)",
        format!(
            "{:.4}/{:.4}",
            u["admission_ms_p50"].as_f64().unwrap_or(f64::NAN),
            u["admission_ms_p99"].as_f64().unwrap_or(f64::NAN)
        ),
        format!("request {} ms", u["request_ms"]),
        "p50 <= 1 ms",
        v["latency_met"].as_bool(),
    );
    r.cmp(
        "flow control: requests admitted per min at an RPM limit 16x below demand",
        format!(
            "{:.0} ({:.1}% of the limit)",
            o["admitted_per_min"].as_f64().unwrap_or(f64::NAN),
            v["achieved_share_of_limit"].as_f64().unwrap_or(f64::NAN) * 100.0
        ),
        format!("limit {}", v["rpm_limit"]),
        ">= 90% and never above",
        v["achieved_met"].as_bool(),
    );
    for f in [&v["fractional_4"], &v["fractional_16"]] {
        r.cmp(
            format!(
                "flow control: 429s and share of the limit, {} workers at {} rpm ({:.3} requests/s each), sim bucket of 1 s",
                f["workers"], f["rpm_limit"], f["slice_per_worker_per_s"].as_f64().unwrap_or(f64::NAN)
            ),
            format!(
                "{:.2}% 429 ({} of {}), {:.1}% of the limit",
                f["share_429"].as_f64().unwrap_or(f64::NAN) * 100.0,
                f["refused_429"],
                f["requests"],
                f["achieved_share_of_limit"].as_f64().unwrap_or(f64::NAN) * 100.0
            ),
            "before the grid: 9.6% 429, 75% of the limit (4 workers)".to_string(),
            "<= 1% and >= 90%",
            Some(
                f["share_429_met"].as_bool() == Some(true)
                    && f["achieved_met"].as_bool() == Some(true),
            ),
        );
    }
}

/// Research jobs per run of [`research`], and the sim's RPM and TPM
/// limits (the fleet's unthrottled demand is several times more; the run
/// without fleet limits says how much).
const RESEARCH_JOBS: usize = 64;
const SIM_RPM: u64 = 1200;
const SIM_TPM: u64 = 400_000;

/// One run: 4 research workers, [`RESEARCH_JOBS`] jobs, the sim limited to
/// [`SIM_RPM`]; with `limits`, the fleet's limit set to the sim's.
async fn research_run(limits: bool) -> anyhow::Result<Value> {
    use crate::research::Sim;
    let (srv, conn) = server(SetupOptions::default()).await?;
    let spec = format!("sim-1:rpm={SIM_RPM},tpm={SIM_TPM},burst=1");
    let sim = Sim::start_with(0, &["--limit", &spec]).await?;
    let base = format!("http://{}/v1", sim.addr);
    if limits {
        let key = ProviderKey::new(&base, "sim-1", None);
        FlowStore::open(&conn)
            .await?
            .set_limits(
                &key.id,
                &LimitEntry {
                    limits: Limits {
                        rpm: Some(SIM_RPM),
                        tpm: Some(SIM_TPM),
                        concurrency: None,
                    },
                    provider: Some(key.info.clone()),
                    weight: None,
                    updated_at: String::new(),
                },
            )
            .await?;
    }
    let workers: Vec<_> = (0..4).map(|_| sim.worker(&srv.url(), &[])).collect();
    let jobs = leasehold_store::Jobs::open(&conn).await?;
    let work = leasehold_store::work::Work::new(&conn);
    let t = Instant::now();
    let t_sys = std::time::SystemTime::now();
    for i in 0..RESEARCH_JOBS {
        let spec =
            json!({"input": {"topic": format!("flow control {i}"), "experts": 2, "sections": 2}});
        work.submit(
            "research",
            spec.to_string().into(),
            Some(&format!("fr-{i}")),
            None,
        )
        .await?;
    }
    // The sim's counters every half second: the steady rate is measured
    // from 5 s in (the first leases) until the first job ends (until then
    // every job still asks, far beyond the limit).
    let samples = Arc::new(Mutex::new(Vec::<(Instant, u64, u64)>::new()));
    let sampler = {
        let (addr, samples) = (sim.addr.clone(), samples.clone());
        tokio::spawn(async move {
            loop {
                if let Ok(v) = crate::common::http_get_json(&addr, "/stats").await {
                    let ok = v["chat_requests"].as_u64().unwrap_or(0)
                        - v["rate_limited_total"].as_u64().unwrap_or(0);
                    let tokens = v["tokens_admitted"].as_u64().unwrap_or(0);
                    samples.lock().unwrap().push((Instant::now(), ok, tokens));
                }
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        })
    };
    let mut first_done: Option<Instant> = None;
    let mut attempts = 0;
    for i in 0..RESEARCH_JOBS {
        // 64 jobs share the provider's rate: a record may not change for
        // longer than the usual minute.
        let id = format!("fr-{i}");
        let mut w = jobs.watch(&id).await?;
        let (_, r) = crate::common::next_rec(&mut w, &id, Duration::from_secs(600), |r| {
            crate::common::terminal(&r.status)
        })
        .await?;
        anyhow::ensure!(r.status == "completed", "research job {id} ended {r:?}");
        attempts += r.attempts;
        // When it ended, by its record (the server's and this host's clock).
        if let Some(at) = leasehold_core::time::parse_rfc3339(&r.updated_at) {
            let ended = t + at.duration_since(t_sys).unwrap_or_default();
            first_done = Some(first_done.map_or(ended, |f: Instant| f.min(ended)));
        }
    }
    sampler.abort();
    let steady = {
        let s = samples.lock().unwrap();
        let from = t + Duration::from_secs(5);
        let until = first_done.unwrap_or_else(Instant::now);
        let win: Vec<_> = s.iter().filter(|x| x.0 >= from && x.0 <= until).collect();
        match (win.first(), win.last()) {
            (Some(a), Some(b)) if b.0 > a.0 => {
                let secs = (b.0 - a.0).as_secs_f64();
                json!({
                    "seconds": secs,
                    "answered_per_min": (b.1 - a.1) as f64 / secs * 60.0,
                    "tokens_per_min": (b.2 - a.2) as f64 / secs * 60.0,
                })
            }
            _ => json!(null),
        }
    };
    let secs = t.elapsed().as_secs_f64();
    let stats = sim.get("/stats").await?;
    drop(workers);
    let requests = stats["chat_requests"].as_u64().unwrap_or(0);
    let refused = stats["rate_limited_total"].as_u64().unwrap_or(0);
    let tokens = stats["tokens_admitted"].as_u64().unwrap_or(0);
    Ok(json!({
        "steady": steady,
        "tokens_admitted": tokens,
        "tokens_per_min": tokens as f64 / secs * 60.0,
        "fleet_limits": limits,
        "jobs": RESEARCH_JOBS,
        "seconds": secs,
        "requests": requests,
        "refused_429": refused,
        "share_429": refused as f64 / requests.max(1) as f64,
        "answered_per_min": (requests - refused) as f64 / secs * 60.0,
        "failed_attempts": attempts,
    }))
}

/// The part `flow-research`: the same jobs with the shared cooldown only,
/// then with the fleet's limit set to the provider's.
pub async fn research() -> anyhow::Result<Value> {
    let baseline = research_run(false).await?;
    let limited = research_run(true).await?;
    let share = limited["share_429"].as_f64().unwrap_or(1.0);
    // While every job still asks (the steady window), else the whole run.
    let rate = |k: &str| {
        limited["steady"][k]
            .as_f64()
            .or(limited[k].as_f64())
            .unwrap_or(0.0)
    };
    let achieved = rate("answered_per_min") / SIM_RPM as f64;
    let tokens = rate("tokens_per_min") / SIM_TPM as f64;
    // The limit that binds is the one the fleet comes closest to.
    let binding = achieved.max(tokens);
    Ok(json!({
        "sim_rpm": SIM_RPM,
        "sim_tpm": SIM_TPM,
        "achieved_share_of_tpm": tokens,
        "achieved_share_of_binding_limit": binding,
        "binding_met": binding >= 0.9,
        "cooldown_only": baseline,
        "limited": limited,
        "achieved_share_of_limit": achieved,
        "share_429_met": share <= 0.01,
        "achieved_met": achieved >= 0.9,
        "no_attempts_met": limited["failed_attempts"] == 0 && baseline["failed_attempts"] == 0,
    }))
}

pub fn research_rows(r: &mut Report, v: &Value) {
    let (b, l) = (&v["cooldown_only"], &v["limited"]);
    r.cmp(
        format!("flow control: 429s of requests, 4 workers, {RESEARCH_JOBS} research jobs, sim at {SIM_RPM} rpm / {SIM_TPM} tpm"),
        format!(
            "{:.2}% ({} of {})",
            l["share_429"].as_f64().unwrap_or(f64::NAN) * 100.0,
            l["refused_429"],
            l["requests"]
        ),
        format!(
            "cooldown only {:.1}% ({} of {})",
            b["share_429"].as_f64().unwrap_or(f64::NAN) * 100.0,
            b["refused_429"],
            b["requests"]
        ),
        "<= 1%",
        v["share_429_met"].as_bool(),
    );
    r.cmp(
        "flow control: requests answered per min against the provider's RPM (while every job asks)",
        format!(
            "{:.0} ({:.0}%)",
            l["steady"]["answered_per_min"].as_f64().unwrap_or(f64::NAN),
            v["achieved_share_of_limit"].as_f64().unwrap_or(f64::NAN) * 100.0
        ),
        format!(
            "cooldown only {:.0}",
            b["answered_per_min"].as_f64().unwrap_or(f64::NAN)
        ),
        "(reported)",
        None,
    );
    r.cmp(
        "flow control: tokens answered per min against the provider's TPM (while every job asks; whole run)",
        format!(
            "{:.0} ({:.0}%; whole run {:.0})",
            l["steady"]["tokens_per_min"].as_f64().unwrap_or(f64::NAN),
            v["achieved_share_of_tpm"].as_f64().unwrap_or(f64::NAN) * 100.0,
            l["tokens_per_min"].as_f64().unwrap_or(f64::NAN)
        ),
        format!(
            "cooldown only {:.0}",
            b["tokens_per_min"].as_f64().unwrap_or(f64::NAN)
        ),
        ">= 90% of the limit that binds",
        v["binding_met"].as_bool(),
    );
    r.cmp(
        "flow control: failed attempts of research jobs under the limit",
        format!("{}", l["failed_attempts"]),
        format!("cooldown only {}", b["failed_attempts"]),
        "0",
        v["no_attempts_met"].as_bool(),
    );
}
