//! `leasehold list`: the jobs that are not finished, from the index of
//! active jobs (the cost follows the active jobs, not the history); `--all`
//! scans every record instead.

use anyhow::bail;
use leasehold_core::{JobRecord, Status};
use leasehold_store::index::Filter;
use leasehold_store::NatsArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// Only jobs in this status. `queued`, `running` and `parked` are read
    /// from the index of active jobs; a finished status needs `--all`.
    #[arg(long)]
    status: Option<String>,
    /// Only jobs of this kind.
    #[arg(long)]
    kind: Option<String>,
    /// Only running jobs of this worker.
    #[arg(long)]
    worker: Option<String>,
    /// At most this many jobs (sorted by id); `--after` continues.
    #[arg(long, default_value_t = 100)]
    limit: usize,
    /// Start after this job id (the last id of the previous page).
    #[arg(long)]
    after: Option<String>,
    /// Every record ever kept, finished ones too (a scan of the whole
    /// bucket: slow on a long history).
    #[arg(long)]
    all: bool,
    /// With `--all`: list the records that cannot be read instead.
    #[arg(long, requires = "all")]
    corrupt: bool,
    /// One JSON record per line instead of a table.
    #[arg(long)]
    json: bool,
}

pub async fn run(a: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    let status = match &a.status {
        Some(s) => Some(s.parse::<Status>().map_err(anyhow::Error::msg)?),
        None => None,
    };
    if let Some(s) = status.filter(|s| s.is_terminal() && !a.all) {
        bail!("finished jobs ({s}) are not in the index of active jobs; add --all to scan every record");
    }
    let conn = nats.connect("leasehold-cli list").await?;
    let jobs = super::open_jobs(&conn).await?;
    let keep = |r: &JobRecord| {
        status.is_none_or(|s| r.status == s.as_str())
            && a.kind.as_ref().is_none_or(|k| &r.kind == k)
            && a.worker
                .as_ref()
                .is_none_or(|w| r.worker_id.as_deref() == Some(w.as_str()))
    };
    let mut recs: Vec<JobRecord>;
    let mut more = false;
    if a.all {
        let listing = jobs.all().await?;
        if a.corrupt {
            for (id, err) in &listing.corrupt {
                println!("{id}\t{err}");
            }
            eprintln!("{} unreadable record(s)", listing.corrupt.len());
            return Ok(if listing.corrupt.is_empty() { 0 } else { 1 });
        }
        if !listing.corrupt.is_empty() {
            eprintln!(
                "{} unreadable record(s) skipped (`leasehold list --all --corrupt` lists them)",
                listing.corrupt.len()
            );
        }
        recs = listing
            .records
            .into_iter()
            .map(|v| v.value)
            .filter(|r| keep(r))
            .collect();
        recs.sort_by(|x, y| x.id.cmp(&y.id));
        recs.retain(|r| a.after.as_ref().is_none_or(|after| &r.id > after));
        if recs.len() > a.limit {
            recs.truncate(a.limit);
            more = true;
        }
    } else {
        let active = super::open_active(&conn).await?;
        let filter = match (status, &a.worker) {
            (_, Some(w)) => Filter::RunningBy(w),
            (Some(Status::Running), None) => Filter::Running,
            (Some(Status::Queued), None) => Filter::Waiting,
            (Some(Status::Parked), None) => Filter::Parked,
            _ => Filter::All,
        };
        let mut entries = active.list(filter).await?;
        entries.retain(|(_, e)| a.after.as_ref().is_none_or(|after| &e.job > after));
        entries.retain(|(_, e)| a.kind.as_ref().is_none_or(|k| &e.kind == k));
        entries.dedup_by(|x, y| x.1.job == y.1.job);
        recs = Vec::new();
        for (_, e) in entries {
            if recs.len() == a.limit {
                more = true;
                break;
            }
            // The index may be a moment behind: the record decides.
            if let Some(v) = jobs.get(&e.job).await? {
                if keep(&v.value)
                    && !Status::is_terminal(v.value.status.parse().unwrap_or(Status::Completed))
                {
                    recs.push(v.value);
                }
            }
        }
    }
    if a.json {
        for r in &recs {
            println!("{}", serde_json::to_string(r)?);
        }
    } else {
        println!(
            "{:<28} {:<10} {:<10} {:>8} {:>6} {:>7}  {:<16} UPDATED",
            "ID", "KIND", "STATUS", "ATTEMPTS", "EPOCH", "RECLAIM", "WORKER"
        );
        for r in &recs {
            println!(
                "{:<28} {:<10} {:<10} {:>8} {:>6} {:>7}  {:<16} {}",
                r.id,
                r.kind,
                r.status,
                r.attempts,
                r.epoch,
                r.stale_reclaims,
                r.worker_id.as_deref().unwrap_or("-"),
                r.updated_at
            );
        }
    }
    match (more, recs.last()) {
        (true, Some(last)) => eprintln!(
            "{} job(s) shown; more follow: add --after {}",
            recs.len(),
            last.id
        ),
        _ => eprintln!("{} job(s)", recs.len()),
    }
    Ok(0)
}
