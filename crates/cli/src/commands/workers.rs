//! `leasehold workers [--json]`: the live worker processes (their sessions:
//! host, pid, kinds, when they started and last renewed) and how many jobs
//! each runs, from the sessions bucket and the index of active jobs.

use futures::StreamExt;
use leasehold_store::index::Filter;
use leasehold_store::sessions::{Current, Sessions};
use leasehold_store::{NatsArgs, StoreError};
use serde_json::json;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// One JSON object per worker instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(a: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    let conn = nats.connect("leasehold-cli workers").await?;
    let sessions = Sessions::open(&conn).await?;
    let active = super::open_active(&conn).await?;
    let mut ids: Vec<String> = Vec::new();
    let mut keys = sessions
        .kv()
        .keys()
        .await
        .map_err(|e| StoreError::nats("sessions", e))?;
    while let Some(k) = keys.next().await {
        ids.push(k.map_err(|e| StoreError::nats("sessions", e))?);
    }
    ids.sort();
    let mut rows = Vec::new();
    for id in ids {
        if let Current::Live { info, .. } = sessions.current(&id).await? {
            let jobs = active.list(Filter::RunningBy(&id)).await?.len();
            rows.push((info, jobs));
        }
    }
    if a.json {
        for (i, jobs) in &rows {
            println!(
                "{}",
                json!({"worker_id": i.worker_id, "session": i.session, "host": i.host, "pid": i.pid, "kinds": i.kinds, "version": i.version, "started_at": i.started_at, "renewed_at": i.renewed_at, "session_timeout_ms": i.timeout_ms, "running": jobs})
            );
        }
    } else {
        let w = rows
            .iter()
            .map(|(i, _)| i.worker_id.len())
            .max()
            .unwrap_or(0)
            .max(6);
        println!(
            "{:<w$} {:<8} {:<16} {:>7} {:>7}  {:<24} {:<24} KINDS",
            "WORKER", "SESSION", "HOST", "PID", "RUNNING", "STARTED", "RENEWED"
        );
        for (i, jobs) in &rows {
            println!(
                "{:<w$} {:<8} {:<16} {:>7} {:>7}  {:<24} {:<24} {}",
                i.worker_id,
                i.session.chars().take(8).collect::<String>(),
                i.host,
                i.pid,
                jobs,
                i.started_at,
                i.renewed_at,
                i.kinds.join(",")
            );
        }
    }
    eprintln!("{} live worker(s)", rows.len());
    Ok(0)
}
