//! The fleet's charts against a real fleet (nats-server, a worker process,
//! the console binary): waves of echo, sleep and failing jobs move the
//! ring's completed, failures by class and queue depth
//! (`/v1/fleet/charts`); the fleet page in Chromium shows the charts move
//! without a reload; and a sample costs the store the same with 0 and
//! with 20,000 active jobs (`leasehold_console_chart_reads_total`).

use std::time::Duration;

use futures::StreamExt;
use leasehold::JobRecord;
use leasehold_testkit::doors::index::Key;
use serde_json::{json, Value};

use crate::console::{http, spawn_console, Browser};
use leasehold_testkit::{wait_log, Fleet};

/// The console's chart JSON.
async fn charts(base: &str) -> Value {
    http()
        .get(format!("{base}/v1/fleet/charts"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

/// The sum over the ring's samples of what `f` reads of each.
fn total(v: &Value, f: impl Fn(&Value) -> u64) -> u64 {
    v["samples"].as_array().unwrap().iter().map(f).sum()
}

/// The newest sample with gauges.
fn gauges(v: &Value) -> Value {
    v["samples"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|s| !s["gauges"].is_null())
        .map(|s| s["gauges"].clone())
        .unwrap_or(Value::Null)
}

/// Asks `/v1/fleet/charts` until `ok` holds of it (each sample is a
/// second: the charts move at that pace), for at most `timeout`.
async fn until(base: &str, timeout: Duration, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let v = charts(base).await;
        if ok(&v) {
            return v;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "waited {timeout:?} for {what}; the charts say:\n{v:#}"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn chart_env() -> Vec<(&'static str, String)> {
    vec![("LH_CONSOLE_CHART_INTERVAL", "1s".into())]
}

/// Waves of jobs: completed and failures by class count up, the queue
/// depth of `sleep` rises while its jobs wait and falls when they ran, the
/// worker's slots are in use.
#[tokio::test]
async fn charts_count_completed_failures_by_class_and_queue_depth_as_waves_run() {
    let env = Fleet::start().await;
    let w = env.worker_proc(
        &[],
        &[
            ("LH_WORKER_ID", "charts-w".into()),
            ("LH_CONCURRENCY", "2".into()),
        ],
    );
    wait_log(&w, "worker starting", Duration::from_secs(20)).await;
    let console = spawn_console(&env, &chart_env()).await;
    let v = until(
        &console.base,
        Duration::from_secs(20),
        "a sample of one worker with 2 slots",
        |v| {
            let g = gauges(v);
            g["workers"] == 1 && g["slots_total"] == 2
        },
    )
    .await;
    assert_eq!(v["interval_s"], 1);
    assert_eq!(v["capacity"], 360);
    // A wave of sleeps longer than the slots: tickets wait.
    for i in 0..8 {
        env.submit("sleep", json!({"input": {"ms": 1500}}), &format!("nap-{i}"))
            .await;
    }
    until(
        &console.base,
        Duration::from_secs(20),
        "sleep tickets waiting and both slots in use",
        |v| {
            let g = gauges(v);
            g["queue_by_kind"]["sleep"].as_u64().unwrap_or(0) >= 2 && g["slots_in_use"] == 2
        },
    )
    .await;
    // Then echoes and terminal failures.
    for i in 0..10 {
        env.submit("echo", json!({"input": {"n": i}}), &format!("echo-{i}"))
            .await;
    }
    for i in 0..3 {
        env.submit(
            "fail",
            json!({"input": {"class": "terminal"}}),
            &format!("boom-{i}"),
        )
        .await;
    }
    let v = until(
        &console.base,
        Duration::from_secs(60),
        "18 completed and 3 terminal failures",
        |v| {
            total(v, |s| s["completed"].as_u64().unwrap_or(0)) >= 18
                && total(v, |s| {
                    s["failures_by_class"]["terminal"].as_u64().unwrap_or(0)
                }) >= 3
        },
    )
    .await;
    assert_eq!(total(&v, |s| s["failed"].as_u64().unwrap_or(0)), 3, "{v:#}");
    let run = v["samples"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|s| s["run_time"]["p95_s"].as_f64())
        .fold(0.0f64, f64::max);
    assert!(run >= 1.4, "a 1.5 s sleep's run time shows: {run}");
    assert!(
        v["samples"]
            .as_array()
            .unwrap()
            .iter()
            .any(|s| s["submit_to_start"]["n"].as_u64().unwrap_or(0) > 0),
        "submit-to-start is sampled: {v:#}"
    );
    until(
        &console.base,
        Duration::from_secs(20),
        "the queue drained",
        |v| gauges(v)["queue_by_kind"]["sleep"].as_u64().unwrap_or(0) == 0,
    )
    .await;
    // The fragment draws them.
    let html = http()
        .get(format!("{}/fleet/charts", console.base))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    for c in [
        "throughput",
        "queue",
        "submit_to_start",
        "run_time",
        "failures",
        "rate_limits",
        "workers",
    ] {
        assert!(
            html.contains(&format!("data-chart=\"{c}\"")),
            "no {c} chart:\n{html}"
        );
    }
    assert!(
        html.contains("terminal <b>"),
        "the failures' legend and caption name the class:\n{html}"
    );
}

/// The fleet page in Chromium under load: the throughput chart's total
/// and its caption change without a reload (the page's live fragment).
#[tokio::test]
async fn charts_move_on_the_fleet_page_in_a_browser_under_load() {
    let env = Fleet::start().await;
    let w = env.worker_proc(&[], &[("LH_CONCURRENCY", "4".into())]);
    wait_log(&w, "worker starting", Duration::from_secs(20)).await;
    let console = spawn_console(&env, &chart_env()).await;
    let mut b = Browser::start().await;
    b.goto(&format!("{}/fleet", console.base)).await;
    let sum = "Number((document.querySelector('#fleet figure[data-chart=throughput]') || {dataset: {sum: -1}}).dataset.sum)";
    b.wait(
        &format!("{sum} >= 0"),
        Duration::from_secs(20),
        "the throughput chart",
    )
    .await;
    b.eval("window.__loaded = true").await;
    let before = b.eval(sum).await.as_f64().unwrap();
    // Load: echo jobs in waves while the page is open.
    for wave in 0..3 {
        for i in 0..10 {
            env.submit("echo", json!({"input": {}}), &format!("w{wave}-{i}"))
                .await;
        }
        env.wait_status(&format!("w{wave}-9"), "completed", Duration::from_secs(30))
            .await;
    }
    b.wait(
        &format!("{sum} >= {} + 30", before),
        Duration::from_secs(30),
        "the throughput chart to count the 30 jobs",
    )
    .await;
    assert_eq!(
        b.eval("window.__loaded === true").await,
        json!(true),
        "the page was not reloaded"
    );
    let caption = b
        .eval("document.querySelector('#fleet figure[data-chart=throughput] figcaption').innerText")
        .await;
    assert!(caption.as_str().unwrap().contains("completed"), "{caption}");
    let points = b
        .eval("document.querySelectorAll('#fleet figure[data-chart=throughput] polyline, #fleet figure[data-chart=throughput] .fc-dot').length")
        .await;
    assert!(
        points.as_u64().unwrap() >= 1,
        "the completed series is drawn: {points}"
    );
}

/// The charts cost O(window): a sample's store requests are the same with
/// no active job and with 20,000 in the index, and the endpoint's answer
/// is the ring's size.
#[tokio::test]
async fn charts_sample_costs_the_same_with_0_and_20000_active_jobs() {
    let env = Fleet::start().await;
    let console = spawn_console(&env, &chart_env()).await;
    let per_sample = || async {
        // Three samples' worth of reads, measured between two metric reads.
        let m = |name: &'static str| crate::console_cost::metric(&console.base, None, name);
        let (r0, s0) = (
            m("leasehold_console_chart_reads_total").await,
            m("leasehold_console_chart_samples_total").await,
        );
        let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
        loop {
            tokio::time::sleep(Duration::from_millis(500)).await;
            let (r1, s1) = (
                m("leasehold_console_chart_reads_total").await,
                m("leasehold_console_chart_samples_total").await,
            );
            if s1 - s0 >= 3.0 {
                return (r1 - r0) / (s1 - s0);
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "the sampler took no 3 samples in 20 s"
            );
        }
    };
    until(
        &console.base,
        Duration::from_secs(20),
        "a first sample",
        |v| !gauges(v).is_null(),
    )
    .await;
    let empty = per_sample().await;
    let size_empty = charts(&console.base).await["samples"]
        .as_array()
        .unwrap()
        .len();
    // 20,000 running jobs in the index, written 256 at a time.
    const N: usize = 20_000;
    let active = env.active().await;
    let mut pending = futures::stream::FuturesUnordered::new();
    for i in 0..N {
        let active = active.clone();
        pending.push(async move {
            let r = JobRecord {
                id: format!("seed-{i}"),
                kind: "echo".into(),
                status: "running".into(),
                worker_id: Some(format!("w-{}", i % 8)),
                epoch: 1,
                created_at: leasehold_testkit::record::now(),
                ..Default::default()
            };
            active.put(&Key::of(&r).unwrap(), &r).await.unwrap();
        });
        while pending.len() >= 256 {
            pending.next().await;
        }
    }
    while pending.next().await.is_some() {}
    until(
        &console.base,
        Duration::from_secs(120),
        "the sampler to count 20,000 running",
        |v| gauges(v)["index_by_status"]["running"].as_u64() == Some(N as u64),
    )
    .await;
    let busy = per_sample().await;
    eprintln!("store requests per sample: {empty} with no job, {busy} with {N} active");
    assert_eq!(empty, busy, "a sample's cost grew with the jobs");
    assert!(
        busy <= 4.0,
        "a sample costs a few requests, not the jobs': {busy}"
    );
    let size_busy = charts(&console.base).await["samples"]
        .as_array()
        .unwrap()
        .len();
    assert!(size_busy <= 360 && size_empty <= 360);
}
