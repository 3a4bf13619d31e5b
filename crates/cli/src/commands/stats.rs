//! `leasehold stats [--json]`: the fleet's counts from the index of active
//! jobs (queued, running and parked jobs by kind, the oldest in flight) and
//! the work queue (tickets per kind); finished jobs are not counted here
//! (`leasehold list --all` scans them).

use std::collections::BTreeMap;

use leasehold_store::index::Filter;
use leasehold_store::{NatsArgs, StoreError};
use serde_json::json;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// One JSON document instead of tables.
    #[arg(long)]
    json: bool,
}

pub async fn run(a: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    let conn = nats.connect("leasehold-cli stats").await?;
    let active = super::open_active(&conn).await?;
    let mut by_kind: BTreeMap<String, BTreeMap<String, u64>> = BTreeMap::new();
    let mut oldest_running: Option<(String, String)> = None;
    for (_, e) in active.list(Filter::All).await? {
        *by_kind
            .entry(e.kind.clone())
            .or_default()
            .entry(e.status.clone())
            .or_default() += 1;
        if e.status == "running"
            && oldest_running
                .as_ref()
                .is_none_or(|(_, at)| e.created_at < *at)
        {
            oldest_running = Some((e.job.clone(), e.created_at.clone()));
        }
    }
    // Tickets per kind in the work queue (waiting, or held by a worker).
    let l = &conn.layout;
    let stream = conn
        .js
        .get_stream_no_info(l.work_stream())
        .await
        .map_err(|e| StoreError::nats("work stream", e))?;
    let mut subjects = stream
        .info_with_subjects(l.submit_wildcard())
        .await
        .map_err(|e| StoreError::nats("work stream", e))?;
    let mut tickets: BTreeMap<String, u64> = BTreeMap::new();
    while let Some(x) = futures::StreamExt::next(&mut subjects).await {
        let (subject, n) = x.map_err(|e| StoreError::nats("work stream", e))?;
        if let Some(kind) = l.kind_of_submit_subject(&subject) {
            // Every lane of the kind counts.
            *tickets.entry(kind.to_string()).or_default() += n as u64;
        }
    }
    if a.json {
        println!(
            "{}",
            json!({"active_by_kind": by_kind, "tickets_by_kind": tickets, "oldest_running": oldest_running.map(|(j, at)| json!({"job": j, "created_at": at}))})
        );
        return Ok(0);
    }
    let kinds: std::collections::BTreeSet<&String> = by_kind.keys().chain(tickets.keys()).collect();
    println!(
        "{:<12} {:>8} {:>8} {:>8} {:>8}",
        "KIND", "QUEUED", "RUNNING", "PARKED", "TICKETS"
    );
    for k in kinds {
        let c = by_kind.get(k);
        let n = |s: &str| c.and_then(|c| c.get(s)).copied().unwrap_or(0);
        println!(
            "{:<12} {:>8} {:>8} {:>8} {:>8}",
            k,
            n("queued"),
            n("running"),
            n("parked"),
            tickets.get(k).copied().unwrap_or(0)
        );
    }
    match oldest_running {
        Some((job, at)) => eprintln!("oldest running: {job} (submitted {at})"),
        None => eprintln!("nothing running"),
    }
    eprintln!("queued counts the jobs the index lists as waiting; a fresh job is covered by its ticket until a worker takes it");
    Ok(0)
}
