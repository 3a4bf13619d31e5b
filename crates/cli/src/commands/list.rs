//! `leasehold list [--status S] [--kind K] [--json]`: list jobs.

use leasehold_core::Status;
use leasehold_store::{Jobs, NatsArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Only jobs in this status (queued, running, completed, failed, cancelled, rejected, parked, dead).
    #[arg(long)]
    status: Option<String>,
    /// Only jobs of this kind.
    #[arg(long)]
    kind: Option<String>,
    /// One JSON record per line instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(a: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    if let Some(s) = &a.status {
        s.parse::<Status>().map_err(anyhow::Error::msg)?;
    }
    let conn = nats.connect("leasehold-cli list").await?;
    let jobs = Jobs::open(&conn).await?;
    let mut recs: Vec<_> = jobs
        .all()
        .await?
        .into_iter()
        .map(|v| v.value)
        .filter(|r| a.status.as_ref().is_none_or(|s| &r.status == s))
        .filter(|r| a.kind.as_ref().is_none_or(|k| &r.kind == k))
        .collect();
    recs.sort_by(|x, y| x.created_at.cmp(&y.created_at));
    if a.json {
        for r in &recs {
            println!("{}", serde_json::to_string(r)?);
        }
        return Ok(0);
    }
    println!(
        "{:<28} {:<10} {:<10} {:>8} {:>6} {:>7}  UPDATED",
        "ID", "KIND", "STATUS", "ATTEMPTS", "EPOCH", "RECLAIM"
    );
    for r in &recs {
        println!(
            "{:<28} {:<10} {:<10} {:>8} {:>6} {:>7}  {}",
            r.id, r.kind, r.status, r.attempts, r.epoch, r.stale_reclaims, r.updated_at
        );
    }
    eprintln!("{} job(s)", recs.len());
    Ok(0)
}
