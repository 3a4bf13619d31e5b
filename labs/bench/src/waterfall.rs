//! A job's waterfall (`GET /jobs/{id}/waterfall`) with 10,000 events:
//! server time plus transfer (connect to the last byte) and the bytes,
//! cold (a console with its waterfall cache off, so every request reads
//! and models all 10,000 events) and warm (the cache on: a request reads
//! only what landed since the last one, here nothing).

use std::time::{Duration, Instant, SystemTime};

use leasehold_core::machine::new_record;
use leasehold_store::events::{self, Events};
use leasehold_store::setup::SetupOptions;
use leasehold_store::Jobs;
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::common::{self, server, summary};
use crate::console::console_with;

/// Events of the measured job.
const EVENTS: usize = 10_000;

/// `n` events of a research-like job spread over an hour: a claim, then
/// model calls (300 ms each) and journal entries in 2 experts' sections,
/// a section checkpoint every 1000 calls, then its completion.
pub fn job_events(id: &str, n: usize) -> Vec<leasehold::JobEvent> {
    let t0 = SystemTime::now() - Duration::from_secs(3600);
    let at = |ms: u64| leasehold_core::time::rfc3339(t0 + Duration::from_millis(ms));
    let mut evs = Vec::with_capacity(n);
    let mut push = |ms: u64, ty: &str, data: Value| {
        let mut e = events::event(id, 1, ty, Some("bench-worker"), data);
        e.at = at(ms);
        evs.push(e);
    };
    push(0, "claimed", json!({"attempts": 0, "stale_reclaims": 0}));
    let calls = (n.saturating_sub(2)) / 2;
    for k in 0..calls as u64 {
        let (e, i, ms) = (k % 2, k / 1000, 1000 + k * 700);
        push(
            ms,
            "model",
            json!({"model": "sim-1", "tokens_in": 900, "tokens_out": 200, "duration_ms": 300, "first_token_ms": 40, "attempts": 1, "outcome": "ok", "generation": 0, "v": "fp", "expert": e, "index": i}),
        );
        if k % 1000 == 999 {
            push(
                ms + 1,
                "section",
                json!({"v": "fp", "payload": {"expert": e, "index": i, "title": "A section", "status": "done"}}),
            );
        } else {
            push(
                ms + 1,
                "journal",
                json!({"v": "fp", "expert": e, "index": i, "entry": {"op": "message", "generation": 0, "message": {"role": "assistant", "content": "text"}}}),
            );
        }
    }
    // Whatever is left to make `n`: progress notes (calls make 2 each).
    for _ in (1 + 2 * calls + 1)..n {
        push(
            1000 + calls as u64 * 700,
            "progress",
            json!({"phase": "sections"}),
        );
    }
    push(1000 + calls as u64 * 700 + 10, "completed", json!({}));
    evs
}

/// One GET, connect to the last byte: (ms, status line, body bytes).
async fn get(addr: &str, path: &str) -> anyhow::Result<(f64, String, usize)> {
    let t0 = Instant::now();
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut buf = Vec::new();
    s.read_to_end(&mut buf).await?;
    let ms = t0.elapsed().as_secs_f64() * 1000.0;
    let text = String::from_utf8_lossy(&buf);
    let status = text.lines().next().unwrap_or("").to_string();
    let body = text.split_once("\r\n\r\n").map_or(0, |(_, b)| b.len());
    Ok((ms, status, body))
}

async fn samples(addr: &str, path: &str, n: usize) -> anyhow::Result<(Vec<f64>, usize)> {
    let mut v = Vec::with_capacity(n);
    let mut bytes = 0;
    for _ in 0..n {
        let (ms, status, b) = get(addr, path).await?;
        anyhow::ensure!(status.contains(" 200"), "GET {path}: {status}");
        v.push(ms);
        bytes = b;
    }
    Ok((v, bytes))
}

/// The part: 50 cold and 50 warm requests of one 10,000-event job.
pub async fn waterfall(n: usize) -> anyhow::Result<Value> {
    let (s, conn) = server(SetupOptions::default()).await?;
    let id = "wf-bench";
    let mut r = new_record(id, "research", Default::default(), 0, SystemTime::now());
    r.status = "completed".into();
    Jobs::open(&conn).await?.create(&r).await?;
    let ev = Events::new(&conn);
    // In batches: the client holds a bounded number of unacknowledged publishes.
    for batch in job_events(id, EVENTS).chunks(1000) {
        ev.seed(batch).await?;
    }
    let path = format!("/jobs/{id}/waterfall");
    let mut out = serde_json::Map::new();
    for (name, cache) in [("cold", "0"), ("warm", "32MiB")] {
        let (c, addr) = console_with(
            &s.url(),
            &[("LH_CONSOLE_WATERFALL_CACHE_BYTES", cache.into())],
        )
        .await?;
        // One first request (connections set up; the warm cache filled).
        samples(&addr, &path, 1).await?;
        let (v, bytes) = samples(&addr, &path, n).await?;
        out.insert(name.into(), json!({"ms": summary(&v), "bytes": bytes}));
        drop(c);
    }
    let p95 = |k: &str| common::f64_of(&out[k]["ms"]["p95"]);
    let met = p95("cold").max(p95("warm")) <= 200.0;
    out.insert("events".into(), json!(EVENTS));
    out.insert("met".into(), json!(met));
    drop(s);
    Ok(Value::Object(out))
}

pub fn rows(r: &mut common::Report, v: &Value) {
    for k in ["cold", "warm"] {
        r.cmp(
            format!(
                "waterfall: {} events, {k}: server+transfer p50/p95 ms",
                v["events"]
            ),
            format!(
                "{}/{} ({} bytes)",
                v[k]["ms"]["p50"], v[k]["ms"]["p95"], v[k]["bytes"]
            ),
            if k == "cold" {
                "cache off: every request reads and models every event"
            } else {
                "cache on: nothing new to read"
            },
            "p95 <= 200 ms",
            Some(common::f64_of(&v[k]["ms"]["p95"]) <= 200.0),
        );
    }
}
