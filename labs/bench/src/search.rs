//! Part `search`: the history of finished jobs answers its first page fast
//! however long it is. N history entries (default 1,000,000) are published
//! straight onto `LH_HISTORY` (async publishes, 1024 in flight, as the
//! historian would write them but without message ids), then the first
//! page of a few searches is timed, each over `runs` runs: status, tenant
//! and a time range; a kind alone; an id prefix that matches near the
//! start; and one that matches nothing (the page reads up to its scan
//! bound, the worst case).

use std::time::{Instant, SystemTime};

use futures::StreamExt;
use leasehold_store::history::{self, Entry, Query, QueryText};
use leasehold_store::setup::SetupOptions;
use serde_json::{json, Value};

use crate::common::*;

/// First page within this, p95.
pub const TARGET_P95_MS: f64 = 100.0;

pub struct Opts {
    pub entries: usize,
    pub runs: usize,
}

const STATUSES: [&str; 5] = ["completed", "completed", "completed", "failed", "cancelled"];
const KINDS: [&str; 5] = ["echo", "research", "invoice", "sleep", "deliver"];

/// The `i`th seeded entry: 20 tenants, 5 kinds, mostly completed.
fn entry(i: usize, now: &str) -> Entry {
    let status = STATUSES[i % STATUSES.len()];
    Entry {
        id: format!("job-{i:07}"),
        kind: KINDS[(i / 5) % KINDS.len()].into(),
        tenant: format!("t{}", (i / 25) % 20),
        status: status.into(),
        class: if status == "failed" {
            "terminal".into()
        } else {
            String::new()
        },
        message: if status == "failed" {
            "the input was refused".into()
        } else {
            String::new()
        },
        created_at: now.into(),
        ended_at: now.into(),
        attempts: 1,
        epoch: 1,
    }
}

/// Publishes `n` entries; the times at half and three quarters of them.
async fn seed(
    conn: &leasehold_store::Conn,
    n: usize,
) -> anyhow::Result<(f64, SystemTime, SystemTime)> {
    let now = leasehold_core::time::rfc3339(SystemTime::now());
    let t0 = Instant::now();
    let mut pending = futures::stream::FuturesUnordered::new();
    let (mut half, mut three_q) = (SystemTime::now(), SystemTime::now());
    for i in 0..n {
        if i == n / 2 {
            while pending.next().await.transpose()?.is_some() {}
            half = SystemTime::now();
        }
        if i == n * 3 / 4 {
            while pending.next().await.transpose()?.is_some() {}
            three_q = SystemTime::now();
        }
        let e = entry(i, &now);
        let ack = conn
            .js
            .publish(e.subject(&conn.layout), serde_json::to_vec(&e)?.into())
            .await?;
        pending.push(std::future::IntoFuture::into_future(ack));
        while pending.len() >= 1024 {
            pending.next().await.transpose()?;
        }
    }
    while pending.next().await.transpose()?.is_some() {}
    Ok((t0.elapsed().as_secs_f64(), half, three_q))
}

/// `runs` first pages of `t`: the milliseconds of each, and the last page.
async fn time(
    conn: &leasehold_store::Conn,
    t: &QueryText,
    runs: usize,
) -> anyhow::Result<(Vec<f64>, history::Page)> {
    let q = Query::parse(t, SystemTime::now()).map_err(anyhow::Error::msg)?;
    let mut ms = Vec::with_capacity(runs);
    let mut last = history::Page::default();
    for _ in 0..runs {
        let t0 = Instant::now();
        last = history::search(conn, &q).await?;
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    Ok((ms, last))
}

pub async fn search(o: &Opts) -> anyhow::Result<Value> {
    let (s, conn) = server(SetupOptions {
        history_max_bytes: 4 << 30,
        ..SetupOptions::default()
    })
    .await?;
    let (seed_s, half, three_q) = seed(&conn, o.entries).await?;
    eprintln!("search: {} entries seeded in {seed_s:.0} s", o.entries);
    let at = |t| Some(leasehold_core::time::rfc3339(t));
    let queries = [
        (
            "status + tenant + time range",
            QueryText {
                status: Some("failed".into()),
                tenant: Some("t3".into()),
                since: at(half),
                until: at(three_q),
                ..Default::default()
            },
        ),
        (
            "kind only",
            QueryText {
                kind: Some("research".into()),
                ..Default::default()
            },
        ),
        (
            "id prefix, found early",
            QueryText {
                id_prefix: Some("job-00012".into()),
                ..Default::default()
            },
        ),
        (
            "id prefix, no match (scan bound)",
            QueryText {
                id_prefix: Some("nope-".into()),
                ..Default::default()
            },
        ),
    ];
    let mut out = Vec::new();
    for (name, t) in queries {
        let (ms, page) = time(&conn, &t, o.runs).await?;
        let p95 = pct(&ms, 0.95);
        out.push(json!({
            "query": name,
            "p50_ms": pct(&ms, 0.5),
            "p95_ms": p95,
            "matched": page.matched,
            "upper_bound": page.matched_is_upper_bound,
            "shown": page.entries.len(),
            "scanned": page.scanned,
            "met": p95 <= TARGET_P95_MS,
        }));
    }
    let info = conn
        .js
        .get_stream(conn.layout.history_stream())
        .await?
        .info()
        .await?
        .state
        .clone();
    drop(s);
    Ok(json!({
        "entries": o.entries,
        "runs": o.runs,
        "seed_seconds": seed_s,
        "stream_bytes": info.bytes,
        "stream_messages": info.messages,
        "queries": out,
        "target_p95_ms": TARGET_P95_MS,
        "build": if cfg!(debug_assertions) { "debug" } else { "release" },
    }))
}

pub fn rows(r: &mut Report, v: &Value) {
    let n = &v["entries"];
    for q in v["queries"].as_array().into_iter().flatten() {
        r.cmp(
            format!(
                "history search first page, {} ({n} entries), p95 ms",
                q["query"].as_str().unwrap_or("")
            ),
            format!(
                "{:.1} (p50 {:.1}; {} matched, {} read)",
                f64_of(&q["p95_ms"]),
                f64_of(&q["p50_ms"]),
                q["matched"],
                q["scanned"]
            ),
            String::new(),
            format!("<= {TARGET_P95_MS} ms"),
            q["met"].as_bool(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::entry;

    #[test]
    fn seeded_entries_spread_over_tenants_kinds_and_statuses() {
        let e = entry(3, "t");
        assert_eq!(
            (e.status.as_str(), e.class.as_str()),
            ("failed", "terminal")
        );
        assert_eq!(entry(25 * 7, "t").tenant, "t7");
        assert_eq!(entry(5, "t").kind, "research");
    }
}
