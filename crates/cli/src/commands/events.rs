//! `leasehold events ID [--json] [--follow]`: a job's history as its events
//! tell it (claims, checkpoints, retries, tool calls, its end), oldest
//! first; `--follow` keeps printing new ones until the job ends.

use std::time::Duration;

use leasehold_core::Status;
use leasehold_proto::JobEvent;
use leasehold_store::events::Events;
use leasehold_store::NatsArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The job id.
    id: String,
    /// One JSON object per event (its data parsed) instead of a line of text.
    #[arg(long)]
    json: bool,
    /// Keep printing new events until the job ends (or is parked).
    #[arg(long)]
    follow: bool,
}

/// How often `--follow` looks for new events.
const FOLLOW_EVERY: Duration = Duration::from_millis(500);

pub async fn run(a: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    let conn = nats.connect("leasehold-cli events").await?;
    let jobs = super::open_jobs(&conn).await?;
    let events = Events::new(&conn);
    let mut seen = events.read(&a.id).await?;
    if seen.is_empty() && jobs.get(&a.id).await?.is_none() {
        eprintln!(
            "error: no job {} (`leasehold list` shows the active jobs)",
            a.id
        );
        return Ok(1);
    }
    let mut last = 0;
    for (seq, ev) in seen.drain(..) {
        print(&ev, a.json)?;
        last = seq;
    }
    if !a.follow {
        return Ok(0);
    }
    loop {
        let ended = jobs.get(&a.id).await?.is_some_and(|v| {
            v.value
                .status
                .parse::<Status>()
                .is_ok_and(|s| s.is_terminal() || s == Status::Parked)
        });
        for (seq, ev) in events.read_from(&a.id, last + 1).await? {
            print(&ev, a.json)?;
            last = seq;
        }
        tokio::time::sleep(FOLLOW_EVERY).await;
        if ended {
            // The end's event follows the record's last write: one more look.
            for (_, ev) in events.read_from(&a.id, last + 1).await? {
                print(&ev, a.json)?;
            }
            break;
        }
    }
    Ok(0)
}

fn print(ev: &JobEvent, json: bool) -> anyhow::Result<()> {
    if json {
        let data: serde_json::Value =
            serde_json::from_str(&ev.data).unwrap_or(serde_json::Value::String(ev.data.clone()));
        println!(
            "{}",
            serde_json::json!({"at": ev.at, "epoch": ev.epoch, "type": ev.r#type, "worker_id": ev.worker_id, "data": data})
        );
    } else {
        let mut data: String = ev.data.chars().take(160).collect();
        if ev.data.chars().count() > 160 {
            data.push('…');
        }
        println!(
            "{}  e{}  {:<14} {:<16} {}",
            ev.at,
            ev.epoch,
            ev.r#type,
            ev.worker_id.as_deref().unwrap_or("-"),
            data
        );
    }
    Ok(())
}
