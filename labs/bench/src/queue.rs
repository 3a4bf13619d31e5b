//! Part 8: submitting into a full queue. The work stream is set up with a
//! small `work_max_msgs`, filled with no worker running, and then: how long
//! a refused submission takes to fail (against an accepted one, measured in
//! the same run), that it fails as "full" (JetStream err code 10077, the
//! CLI's exit 75), and that every accepted job completes once a worker runs.

use std::collections::{BTreeMap, HashSet};
use std::future::IntoFuture;
use std::process::Command;
use std::time::{Duration, Instant};

use futures::StreamExt;
use leasehold_harness::bin_path;
use leasehold_store::setup::SetupOptions;
use leasehold_store::work::Work;
use leasehold_store::{Jobs, StoreError};
use serde_json::{json, Value};

use crate::common::*;

pub async fn queue_full(max: usize, probes: usize) -> anyhow::Result<Value> {
    let (s, conn) = server(SetupOptions {
        work_max_msgs: max as i64,
        ..SetupOptions::default()
    })
    .await?;
    let work = Work::new(&conn);
    let spec = r#"{"input":{}}"#;
    // Accepted submissions, one at a time: the baseline.
    let k = probes.min(max);
    let mut accepted = Vec::new();
    for i in 0..k {
        let t0 = Instant::now();
        work.submit("echo", spec.into(), Some(&format!("q-{i}")), None)
            .await?;
        accepted.push(ms(t0.elapsed()));
    }
    let mut acks = futures::stream::FuturesUnordered::new();
    let subject = conn.layout.submit_subject("echo");
    for i in k..max {
        let m = async_nats::jetstream::message::PublishMessage::build()
            .payload(spec.into())
            .message_id(format!("q-{i}"));
        acks.push(
            conn.js
                .send_publish(subject.clone(), m)
                .await?
                .into_future(),
        );
        while acks.len() >= 256 {
            acks.next().await.transpose()?;
        }
    }
    while acks.next().await.transpose()?.is_some() {}
    let stream = conn.layout.work_stream();
    let held = conn
        .js
        .get_stream(&stream)
        .await?
        .info()
        .await?
        .state
        .messages;
    anyhow::ensure!(
        held == max as u64,
        "the work stream holds {held} tickets, not {max}"
    );

    // Refused: through the product's submit path, then raw for the code.
    let (mut refused, mut wrongly_accepted, mut other) = (Vec::new(), 0, Vec::new());
    for j in 0..probes {
        let t0 = Instant::now();
        match work
            .submit("echo", spec.into(), Some(&format!("q-over-{j}")), None)
            .await
        {
            Err(StoreError::QueueFull(_)) => refused.push(ms(t0.elapsed())),
            Ok(_) => wrongly_accepted += 1,
            Err(e) => other.push(e.to_string()),
        }
    }
    let m = async_nats::jetstream::message::PublishMessage::build()
        .payload(spec.into())
        .message_id("q-over-raw");
    let code = match conn.js.send_publish(subject.clone(), m).await {
        Ok(f) => match f.await {
            Ok(_) => None,
            Err(e) => leasehold_store::server_error_code(&e),
        },
        Err(e) => leasehold_store::server_error_code(&e),
    };
    let url = s.url();
    let t0 = Instant::now();
    let cli = tokio::task::spawn_blocking(move || {
        Command::new(bin_path("leasehold"))
            .args(["submit", "echo", "--input", "{}", "--id", "q-over-cli"])
            .env("NATS_URL", url)
            .output()
    })
    .await??;
    let cli_ms = ms(t0.elapsed());
    let cli_code = cli.status.code();
    let cli_err = String::from_utf8_lossy(&cli.stderr).trim().to_string();

    // Nothing accepted is lost: a worker completes every one.
    let jobs = Jobs::open(&conn).await?;
    let mut watch = jobs.watch_all().await?;
    let t_drain = Instant::now();
    let _w = worker(&s.url(), &[("LH_CONCURRENCY", "64".into())]);
    let mut done = HashSet::new();
    let mut statuses: BTreeMap<String, u64> = BTreeMap::new();
    while done.len() < max {
        let e = tokio::time::timeout(Duration::from_secs(60), watch.next())
            .await
            .map_err(|_| {
                anyhow::anyhow!("{} of {max} accepted jobs finished after 60 s", done.len())
            })?
            .ok_or_else(|| anyhow::anyhow!("watch ended"))??;
        if let Ok(r) = leasehold_store::jobs::decode(&e.key, &e.value) {
            if terminal(&r.status) && done.insert(r.id.clone()) {
                *statuses.entry(r.status.clone()).or_default() += 1;
            }
        }
    }
    let drain_s = t_drain.elapsed().as_secs_f64();
    let mut refused_with_record = 0;
    for j in 0..probes {
        refused_with_record += usize::from(jobs.get(&format!("q-over-{j}")).await?.is_some());
    }
    refused_with_record += usize::from(jobs.get("q-over-raw").await?.is_some());
    refused_with_record += usize::from(jobs.get("q-over-cli").await?.is_some());
    let completed = statuses.get("completed").copied().unwrap_or(0);
    let lost = max as u64 - completed;
    Ok(json!({
        "work_max_msgs": max,
        "accepted_submit_ms": summary(&accepted),
        "refused_submit_ms": summary(&refused),
        "refused_as_full": refused.len(),
        "refusals_wrongly_accepted": wrongly_accepted,
        "refusals_with_other_errors": other,
        "raw_publish_err_code": code,
        "err_code_met": code == Some(leasehold_store::STREAM_FULL_MSGS),
        "cli_exit_code": cli_code,
        "cli_stderr": cli_err,
        "cli_ms": cli_ms,
        "cli_met": cli_code == Some(75),
        "accepted_jobs": max,
        "finished_by_status": statuses,
        "drain_s": drain_s,
        "accepted_lost": lost,
        "refused_with_a_record": refused_with_record,
        "none_lost_met": lost == 0 && refused_with_record == 0 && wrongly_accepted == 0,
    }))
}

pub fn rows(r: &mut Report, v: &Value) {
    let a = &v["accepted_submit_ms"];
    let f = &v["refused_submit_ms"];
    r.cmp(
        format!(
            "full queue ({}): refused submit p50/p95 ms",
            v["work_max_msgs"]
        ),
        format!("{}/{}", f["p50"], f["p95"]),
        format!("accepted {}/{}", a["p50"], a["p95"]),
        "err 10077",
        v["err_code_met"].as_bool(),
    );
    r.cmp(
        "full queue: `leasehold submit` exit code",
        v["cli_exit_code"].to_string(),
        format!("{:.0} ms", f64_of(&v["cli_ms"])),
        "75",
        v["cli_met"].as_bool(),
    );
    r.cmp(
        "full queue: accepted jobs lost",
        v["accepted_lost"].to_string(),
        format!("{} accepted", v["accepted_jobs"]),
        "0",
        v["none_lost_met"].as_bool(),
    );
}
