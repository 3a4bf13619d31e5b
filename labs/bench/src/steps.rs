//! `steps`: what a durable step of the public SDK costs, against one raw
//! JetStream publish ack on the same server in the same run, and what a
//! resume costs: claim -> first new step of a job with 10 / 1,000 / 10,000
//! recorded steps.
//!
//! The kinds run in an in-process worker built with `leasehold::Worker`, as
//! a user's worker is, and time themselves (the step call from inside the
//! kind; the resume from the attempt's start, which follows the claim).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use leasehold::{Ctx, Error, Kind, Options};
use leasehold_store::setup::SetupOptions;
use leasehold_store::work::Work;
use leasehold_store::Jobs;
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

use crate::common::{ms, next_rec, pct, server, summary, terminal, Report};

/// Empty steps, each timed.
struct Empty {
    n: usize,
    times: Arc<Mutex<Vec<f64>>>,
}

#[leasehold::async_trait]
impl Kind for Empty {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        for _ in 0..self.n {
            let t = Instant::now();
            ctx.step("empty", || async { Ok(()) }).await?;
            self.times.lock().unwrap().push(ms(t.elapsed()));
        }
        Ok(json!({}))
    }
}

/// Records `n` steps, fails once, then resumes them and takes one more:
/// the second attempt times its start -> that new step recorded.
struct Resume {
    n: usize,
    resumed_ms: Arc<Mutex<Option<f64>>>,
}

#[leasehold::async_trait]
impl Kind for Resume {
    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        let t = Instant::now();
        for i in 0..self.n {
            let _: usize = ctx.step("s", || async move { Ok(i) }).await?;
        }
        if ctx.failed_attempts() == 0 {
            return Err(Error::retryable("first attempt ends after its steps"));
        }
        ctx.step("new", || async { Ok(()) }).await?;
        *self.resumed_ms.lock().unwrap() = Some(ms(t.elapsed()));
        Ok(json!({}))
    }
}

fn options(url: &str, kind: &str) -> Options {
    let mut o = Options::local(url, "lh");
    o.kinds = vec![kind.into()];
    o.retry_base = Duration::from_millis(1);
    o.retry_cap = Duration::from_millis(2);
    o
}

/// The part: step overhead and resume cost.
pub async fn steps(n: usize, sizes: &[usize]) -> anyhow::Result<Value> {
    let mut setup = SetupOptions::default();
    setup
        .kinds
        .extend(["bench-empty".to_string(), "bench-resume".to_string()]);
    let (srv, conn) = server(setup).await?;
    let jobs = Jobs::open(&conn).await?;
    let work = Work::new(&conn);

    // The baseline: raw publish acks to the events stream, same payload size.
    let mut raw = Vec::with_capacity(n);
    let payload = json!({"i": 0, "id": "empty#0", "v": "1", "result": null}).to_string();
    for i in 0..n {
        let t = Instant::now();
        conn.js
            .publish(
                conn.layout
                    .event_subject(&format!("raw-{}", i % 16), "step"),
                payload.clone().into(),
            )
            .await?
            .await?;
        raw.push(ms(t.elapsed()));
    }

    let times = Arc::new(Mutex::new(Vec::new()));
    let stop = CancellationToken::new();
    let h = leasehold::Worker::new(options(&srv.url(), "bench-empty"))
        .kind(
            "bench-empty",
            Empty {
                n,
                times: times.clone(),
            },
        )
        .start(stop.clone())
        .await?;
    let mut w = jobs.watch("empty-1").await?;
    work.submit(
        "bench-empty",
        json!({"input": {}}).to_string().into(),
        Some("empty-1"),
        None,
    )
    .await?;
    let (_, rec) = next_rec(&mut w, "empty-1", Duration::from_secs(600), |r| {
        terminal(&r.status)
    })
    .await?;
    anyhow::ensure!(rec.status == "completed", "bench-empty: {rec:?}");
    stop.cancel();
    h.wait().await?;
    let step = times.lock().unwrap().clone();

    let mut resume = serde_json::Map::new();
    for &m in sizes {
        let out = Arc::new(Mutex::new(None));
        let stop = CancellationToken::new();
        let h = leasehold::Worker::new(options(&srv.url(), "bench-resume"))
            .kind(
                "bench-resume",
                Resume {
                    n: m,
                    resumed_ms: out.clone(),
                },
            )
            .start(stop.clone())
            .await?;
        let id = format!("resume-{m}");
        let mut w = jobs.watch(&id).await?;
        work.submit(
            "bench-resume",
            json!({"input": {}}).to_string().into(),
            Some(&id),
            None,
        )
        .await?;
        let (_, rec) = next_rec(&mut w, &id, Duration::from_secs(1200), |r| {
            terminal(&r.status)
        })
        .await?;
        anyhow::ensure!(rec.status == "completed", "bench-resume {m}: {rec:?}");
        stop.cancel();
        h.wait().await?;
        let v = out.lock().unwrap().unwrap_or(f64::NAN);
        resume.insert(m.to_string(), json!((v * 100.0).round() / 100.0));
    }
    let (s50, r50) = (pct(&step, 0.5), pct(&raw, 0.5));
    let at_1000 = resume.get("1000").and_then(Value::as_f64);
    Ok(json!({
        "step_ms": summary(&step),
        "step_p99_ms": pct(&step, 0.99),
        "raw_publish_ms": summary(&raw),
        "raw_publish_p99_ms": pct(&raw, 0.99),
        "step_over_raw_p50": (s50 / r50 * 100.0).round() / 100.0,
        "step_met": s50 <= 2.0 * r50,
        "resume_ms_by_recorded_steps": resume,
        "resume_met": at_1000.map(|v| v <= 100.0),
    }))
}

pub fn rows(r: &mut Report, v: &Value) {
    r.cmp(
        "SDK durable step (empty) p50/p99 ms",
        format!(
            "{}/{:.2}",
            v["step_ms"]["p50"],
            v["step_p99_ms"].as_f64().unwrap_or(f64::NAN)
        ),
        format!(
            "raw publish ack {}/{:.2}",
            v["raw_publish_ms"]["p50"],
            v["raw_publish_p99_ms"].as_f64().unwrap_or(f64::NAN)
        ),
        "p50 <= 2x the raw publish",
        v["step_met"].as_bool(),
    );
    let res = &v["resume_ms_by_recorded_steps"];
    r.cmp(
        "SDK resume: attempt start -> first new step, ms by recorded steps",
        res.as_object()
            .map(|o| {
                o.iter()
                    .map(|(k, v)| format!("{k}: {v}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            })
            .unwrap_or_default(),
        "",
        "linear; <= 100 ms at 1,000",
        v["resume_met"].as_bool(),
    );
}
