//! The fleet's charts: latency of `GET /fleet/charts` (the HTML fragment)
//! and `GET /v1/fleet/charts` (the ring as JSON) with 1,000 and then
//! 100,000 active jobs in the index, the same console in the same run, and
//! the store requests per sample of its sampler in both. The charts read
//! only their ring: the target is ~1x.

use std::time::{Duration, Instant};

use leasehold_store::setup::SetupOptions;
use leasehold_store::Conn;
use serde_json::{json, Value};

use crate::common::{self, server, summary};

/// Running jobs `from..to` in the index only: what the charts could grow
/// with if they counted jobs.
async fn seed(conn: &Conn, from: usize, to: usize) -> anyhow::Result<()> {
    crate::console::seed_running(conn, from..to, false).await
}

/// Waits until the charts' newest sample counts `n` running jobs.
async fn caught_up(addr: &str, n: usize) -> anyhow::Result<()> {
    let t0 = Instant::now();
    loop {
        let v = common::http_get_json(addr, "/v1/fleet/charts")
            .await
            .unwrap_or(Value::Null);
        let running = v["samples"]
            .as_array()
            .and_then(|s| s.iter().rev().find(|s| !s["gauges"].is_null()))
            .and_then(|s| s["gauges"]["index_by_status"]["running"].as_u64())
            .unwrap_or(0);
        if running as usize == n {
            return Ok(());
        }
        anyhow::ensure!(
            t0.elapsed() < Duration::from_secs(600),
            "the charts did not count {n} running jobs within 600 s (they say {running})"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// `n` whole requests of `path`, in ms each.
async fn latency(addr: &str, path: &str, n: usize) -> anyhow::Result<Vec<f64>> {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let t0 = Instant::now();
        let body = common::http_get_text(addr, path).await?;
        anyhow::ensure!(
            body.starts_with("HTTP/1.1 200") || body.starts_with("HTTP/1.0 200"),
            "GET {path}: {}",
            body.lines().next().unwrap_or("")
        );
        v.push(t0.elapsed().as_secs_f64() * 1000.0);
    }
    Ok(v)
}

/// A counter of the console's `/metrics`.
async fn metric(addr: &str, name: &str) -> anyhow::Result<f64> {
    let body = common::http_get_text(addr, "/metrics").await?;
    Ok(body
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0))
}

/// Store requests per sample over the next few samples.
async fn reads_per_sample(addr: &str) -> anyhow::Result<f64> {
    let (r0, s0) = (
        metric(addr, "leasehold_console_chart_reads_total").await?,
        metric(addr, "leasehold_console_chart_samples_total").await?,
    );
    tokio::time::sleep(Duration::from_secs(4)).await;
    let (r1, s1) = (
        metric(addr, "leasehold_console_chart_reads_total").await?,
        metric(addr, "leasehold_console_chart_samples_total").await?,
    );
    Ok((r1 - r0) / (s1 - s0).max(1.0))
}

/// The part: (small, large) active jobs, `samples` requests of each route.
pub async fn run(small: usize, large: usize, samples: usize) -> anyhow::Result<Value> {
    let (s, conn) = server(SetupOptions::default()).await?;
    let (_c, addr) =
        crate::console::console_with(&s.url(), &[("LH_CONSOLE_CHART_INTERVAL", "1s".into())])
            .await?;
    let mut out = serde_json::Map::new();
    let mut seeded = 0;
    for (name, n) in [("small", small), ("large", large)] {
        let t0 = Instant::now();
        seed(&conn, seeded, n).await?;
        seeded = n;
        caught_up(&addr, n).await?;
        eprintln!(
            "charts bench: {n} active jobs seeded and counted in {:.0} s",
            t0.elapsed().as_secs_f64()
        );
        latency(&addr, "/v1/fleet/charts", 3).await?;
        let html = latency(&addr, "/fleet/charts", samples).await?;
        let api = latency(&addr, "/v1/fleet/charts", samples).await?;
        out.insert(
            name.into(),
            json!({
                "active": n,
                "fleet_charts_ms": summary(&html),
                "v1_fleet_charts_ms": summary(&api),
                "store_requests_per_sample": reads_per_sample(&addr).await?,
            }),
        );
    }
    let ratio = |k: &str| {
        common::f64_of(&out["large"][k]["p50"]) / common::f64_of(&out["small"][k]["p50"]).max(0.001)
    };
    let (rh, ra) = (ratio("fleet_charts_ms"), ratio("v1_fleet_charts_ms"));
    out.insert("fleet_charts_ratio".into(), json!(rh));
    out.insert("v1_fleet_charts_ratio".into(), json!(ra));
    out.insert("met".into(), json!(rh <= 1.2 && ra <= 1.2));
    drop(s);
    Ok(Value::Object(out))
}
