//! Part 6: storage under a sustained mixed load must plateau. Echo, sleep
//! and fail jobs are submitted at a steady rate for several periods of a
//! short retention (reaper `--retention 3s`, `--interval 500ms`); the
//! bytes JetStream stores (the account's storage, and the sum over the
//! streams) are sampled every few seconds.

use std::collections::{BTreeMap, HashSet};
use std::future::IntoFuture;
use std::time::{Duration, Instant};

use futures::StreamExt;
use leasehold_store::setup::SetupOptions;
use leasehold_store::Conn;
use serde_json::{json, Value};

use crate::common::*;

/// The last third's peak within this factor of the middle third's.
pub const TARGET_RATIO: f64 = 1.2;

pub struct Opts {
    pub secs: u64,
    pub rate: u64,
    pub sample: Duration,
}

/// The account's stored bytes, their sum over the streams, and each
/// stream's (bytes, messages).
async fn stored(conn: &Conn) -> anyhow::Result<(u64, u64, BTreeMap<String, (u64, u64)>)> {
    let account = conn.js.query_account().await?.storage;
    let mut by = BTreeMap::new();
    let mut streams = conn.js.streams();
    while let Some(s) = streams.next().await {
        let s = s?;
        by.insert(s.config.name.clone(), (s.state.bytes, s.state.messages));
    }
    Ok((account, by.values().map(|v| v.0).sum(), by))
}

/// The spec of the `i`-th job of the mix: 70% echo (a third with 2 KiB of
/// input), 20% sleep of 0.2-1.5 s, 10% fail (half terminal, half
/// retryable once, then completed).
fn job(i: u64) -> (&'static str, Value) {
    match i % 10 {
        0..=6 if i.is_multiple_of(3) => {
            ("echo", json!({"input": {"i": i, "pad": "x".repeat(2048)}}))
        }
        0..=6 => ("echo", json!({"input": {"i": i}})),
        7 | 8 => ("sleep", json!({"input": {"ms": 200 + (i * 37) % 1300}})),
        _ if i % 20 == 9 => ("fail", json!({"input": {"class": "terminal"}})),
        _ => ("fail", json!({"input": {"class": "retryable", "times": 1}})),
    }
}

pub async fn plateau(o: &Opts) -> anyhow::Result<Value> {
    let (s, conn) = server(SetupOptions::default()).await?;
    let url = s.url();
    let env = [
        ("LH_KINDS", "echo,sleep,fail".to_string()),
        ("LH_CONCURRENCY", "64".to_string()),
        ("LH_RETRY_BASE", "100ms".to_string()),
        ("LH_RETRY_CAP", "400ms".to_string()),
    ];
    let _w1 = worker(&url, &env);
    let _w2 = worker(&url, &env);
    let r = reaper(
        &url,
        &[
            ("LH_RETENTION", "3s".into()),
            ("LH_INTERVAL", "500ms".into()),
        ],
    )
    .await?;
    // Terminal writes seen per job (the records themselves are removed
    // after the retention, so they are counted as they happen).
    let client = async_nats::connect(url.clone()).await?;
    let mut sub = client
        .subscribe(format!("$KV.{}.>", conn.layout.jobs_bucket()))
        .await?;
    client.flush().await?;
    let finished = std::sync::Arc::new(std::sync::Mutex::new(HashSet::<String>::new()));
    let f2 = finished.clone();
    let counter = tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            if let Ok(r) = serde_json::from_slice::<Value>(&m.payload) {
                if r["status"].as_str().is_some_and(terminal) {
                    if let Some(id) = r["id"].as_str() {
                        f2.lock().unwrap().insert(id.to_string());
                    }
                }
            }
        }
    });
    let (base_account, base_sum, _) = stored(&conn).await?;

    let t0 = Instant::now();
    let load_for = Duration::from_secs(o.secs);
    let drain_for = Duration::from_secs(3 + 5) + o.sample;
    let js = conn.js.clone();
    let mut submitted = 0u64;
    let mut acks = futures::stream::FuturesUnordered::new();
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / o.rate.max(1) as f64));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let mut next_sample = Instant::now();
    let mut samples = Vec::new();
    loop {
        let now = Instant::now();
        if now >= next_sample {
            let (a, sum, by) = stored(&conn).await?;
            samples.push(json!({
                "t_s": (t0.elapsed().as_secs_f64() * 10.0).round() / 10.0,
                "load": now - t0 < load_for,
                "account_bytes": a,
                "streams_bytes": sum,
                "by_stream": by.iter().map(|(k, v)| (k.clone(), json!({"bytes": v.0, "messages": v.1}))).collect::<serde_json::Map<_, _>>(),
                "finished": finished.lock().unwrap().len(),
                "forgotten": forgotten(&r.output()),
                "submitted": submitted,
            }));
            next_sample += o.sample;
        }
        if now - t0 >= load_for + drain_for {
            break;
        }
        if now - t0 < load_for {
            tokio::select! {
                _ = tick.tick() => {
                    let (kind, spec) = job(submitted);
                    let m = async_nats::jetstream::message::PublishMessage::build()
                        .payload(spec.to_string().into())
                        .message_id(format!("mix-{submitted}"));
                    acks.push(js.send_publish(conn.layout.submit_subject(kind), m).await?.into_future());
                    submitted += 1;
                }
                Some(a) = acks.next(), if !acks.is_empty() => { a?; }
            }
        } else {
            while acks.next().await.transpose()?.is_some() {}
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let took = t0.elapsed();
    counter.abort();
    let done = finished.lock().unwrap().len() as u64;
    // Thirds of the load period.
    let load: Vec<&Value> = samples.iter().filter(|v| v["load"] == true).collect();
    let third_max = |k: usize, bytes: &dyn Fn(&Value) -> u64| {
        let lo = o.secs as f64 * k as f64 / 3.0;
        let hi = o.secs as f64 * (k + 1) as f64 / 3.0;
        load.iter()
            .filter(|v| {
                let t = f64_of(&v["t_s"]);
                t >= lo && t < hi
            })
            .map(|v| bytes(v))
            .max()
            .unwrap_or(0)
    };
    let total = |v: &Value| v["account_bytes"].as_u64().unwrap_or(0);
    let (mid, last) = (third_max(1, &total), third_max(2, &total));
    let ratio = last as f64 / mid.max(1) as f64;
    // The same without the job bucket, where removed records leave a
    // marker that outlives the retention (see `by_stream`).
    let jobs_stream = format!("KV_{}", conn.layout.jobs_bucket());
    let stream_bytes = |v: &Value, name: &str| v["by_stream"][name]["bytes"].as_u64().unwrap_or(0);
    let others = |v: &Value| total(v).saturating_sub(stream_bytes(v, &jobs_stream));
    let (mid_o, last_o) = (third_max(1, &others), third_max(2, &others));
    let ratio_o = last_o as f64 / mid_o.max(1) as f64;
    let end = samples.last().cloned().unwrap_or(Value::Null);
    let mut series = serde_json::Map::new();
    let names: Vec<String> = end["by_stream"]
        .as_object()
        .map(|o| o.keys().cloned().collect())
        .unwrap_or_default();
    for n in &names {
        series.insert(
            n.clone(),
            json!(samples
                .iter()
                .map(|v| stream_bytes(v, n))
                .collect::<Vec<_>>()),
        );
    }
    let left_msgs = end["by_stream"][&jobs_stream]["messages"]
        .as_u64()
        .unwrap_or(0);
    let left_bytes = stream_bytes(&end, &jobs_stream);
    Ok(json!({
        "load_s": o.secs,
        "rate_per_s": o.rate,
        "retention": "3s (reaper --retention 3s --interval 500ms)",
        "submitted": submitted,
        "finished_seen": done,
        "all_finished": done == submitted,
        "took_s": took.as_secs_f64(),
        "empty_layout_bytes": {"account": base_account, "streams": base_sum},
        "middle_third_max_bytes": mid,
        "last_third_max_bytes": last,
        "ratio": ratio,
        "target": format!("last third max <= {TARGET_RATIO} x middle third max"),
        "met": ratio <= TARGET_RATIO,
        "without_job_bucket": {
            "middle_third_max_bytes": mid_o,
            "last_third_max_bytes": last_o,
            "ratio": ratio_o,
            "met": ratio_o <= TARGET_RATIO,
        },
        "job_bucket_after_load": {
            "messages": left_msgs,
            "bytes": left_bytes,
            "bytes_per_finished_job": left_bytes as f64 / done.max(1) as f64,
            "note": "records are removed after their retention by a purge whose marker lives the bucket's marker TTL (60 s, store::retention::MARKER_TTL); what is left here is the last minute's markers",
        },
        "after_load_bytes": end["account_bytes"],
        "after_load_by_stream": end["by_stream"],
        "samples": samples.iter().map(|v| json!([v["t_s"], v["account_bytes"], v["streams_bytes"], v["finished"], v["forgotten"]])).collect::<Vec<_>>(),
        "samples_columns": ["t_s", "account_bytes", "streams_bytes", "finished_jobs", "forgotten_by_reaper"],
        "retention_backlog_series": samples.iter().map(|v| {
            // Finished jobs past their retention the reaper has not removed yet.
            v["finished"].as_u64().unwrap_or(0) as i64 - v["forgotten"].as_u64().unwrap_or(0) as i64
        }).collect::<Vec<_>>(),
        "bytes_by_stream_series": series,
    }))
}

/// Jobs the reaper logged as removed so far (`forgotten=N` per pass).
fn forgotten(log: &str) -> u64 {
    log.lines()
        .filter_map(|l| {
            l.split_whitespace()
                .find_map(|t| t.strip_prefix("forgotten="))
                .and_then(|n| n.parse::<u64>().ok())
        })
        .sum()
}

pub fn rows(r: &mut Report, v: &Value) {
    let kib = |x: &Value| format!("{:.0}", f64_of(x) / 1024.0);
    r.cmp(
        format!(
            "storage KiB, last third max ({} s at {}/s, retention 3 s)",
            v["load_s"], v["rate_per_s"]
        ),
        kib(&v["last_third_max_bytes"]),
        format!("mid {} KiB", kib(&v["middle_third_max_bytes"])),
        format!("<= {TARGET_RATIO}x mid"),
        v["met"].as_bool(),
    );
    let o = &v["without_job_bucket"];
    r.cmp(
        "  the same without the job bucket (record markers)",
        kib(&o["last_third_max_bytes"]),
        format!("mid {} KiB", kib(&o["middle_third_max_bytes"])),
        format!("<= {TARGET_RATIO}x mid"),
        o["met"].as_bool(),
    );
    r.row(
        "job bucket bytes left per finished job after retention",
        format!(
            "{:.0}",
            f64_of(&v["job_bucket_after_load"]["bytes_per_finished_job"])
        ),
    );
    r.cmp(
        "storage KiB after the load and one retention",
        kib(&v["after_load_bytes"]),
        format!("empty {} KiB", kib(&v["empty_layout_bytes"]["account"])),
        "",
        None,
    );
    r.cmp(
        "plateau load: jobs finished / submitted",
        format!("{}/{}", v["finished_seen"], v["submitted"]),
        "",
        "all",
        v["all_finished"].as_bool(),
    );
}
