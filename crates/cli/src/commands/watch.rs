//! `leasehold watch ID [--json] [--timeout D] [--wait-for-id]`: follow a
//! job live until it is terminal; an unknown id is refused (exit 1) unless
//! `--wait-for-id`. Shows status, attempts, epoch and a progress bar of sections
//! for long work. Exit 0 when it completed, 1 when it ended otherwise, 124
//! when the timeout passed first (the job goes on).

use std::time::Duration;

use indicatif::{ProgressBar, ProgressStyle};
use leasehold_core::{JobRecord, Status};
use leasehold_store::{Jobs, NatsArgs};

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The job id.
    id: String,
    /// Print every revision of the record as one JSON line (for scripts).
    #[arg(long)]
    json: bool,
    /// Stop waiting after this long (e.g. 30s, 10m); the job is not affected.
    #[arg(long, value_parser = leasehold_core::time::parse_duration)]
    timeout: Option<std::time::Duration>,
    /// Wait for a job that has no record yet (one about to be submitted)
    /// instead of refusing an unknown id.
    #[arg(long)]
    wait_for_id: bool,
}

/// Exit code when a wait's timeout passed before the job ended (as timeout(1)).
pub const TIMED_OUT: i32 = 124;

pub async fn run(a: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    let conn = nats.connect("leasehold-cli watch").await?;
    let jobs = super::open_jobs(&conn).await?;
    if !a.wait_for_id && jobs.get(&a.id).await?.is_none() {
        eprintln!(
            "error: no job {}; `leasehold list` shows the active jobs (a job submitted while no worker runs, by a user that may not write records, gets its record when a worker takes it: `--wait-for-id` waits for it)",
            a.id
        );
        return Ok(1);
    }
    let Some(rec) = follow_for(&jobs, &a.id, a.json, a.json, a.timeout).await? else {
        return Ok(TIMED_OUT);
    };
    if !a.json {
        println!("{}: {}", rec.id, rec.status);
    }
    Ok(if rec.status == "completed" { 0 } else { 1 })
}

fn terminal(r: &JobRecord) -> bool {
    r.status
        .parse::<Status>()
        .is_ok_and(|s| s.is_terminal() || s == Status::Parked)
}

/// Like [`follow`], giving up after `timeout` (then `None`, with a message
/// saying how to keep following).
pub async fn follow_for(
    jobs: &Jobs,
    id: &str,
    json: bool,
    quiet: bool,
    timeout: Option<std::time::Duration>,
) -> anyhow::Result<Option<JobRecord>> {
    let Some(t) = timeout else {
        return follow(jobs, id, json, quiet).await.map(Some);
    };
    match tokio::time::timeout(t, follow(jobs, id, json, quiet)).await {
        Ok(rec) => rec.map(Some),
        Err(_) => {
            let status = jobs
                .get(id)
                .await?
                .map(|v| v.value.status)
                .unwrap_or_else(|| "not picked up yet".into());
            eprintln!(
                "job {id} is still {status} after {}; it goes on: follow it with `leasehold watch {id}`",
                leasehold_core::time::format_duration(t)
            );
            Ok(None)
        }
    }
}

/// Follows the record until it is terminal (or parked) and returns it.
///
/// Each revision is read with a direct get of the next one after the last
/// seen, polling while there is none: no consumer is created, so a
/// submitter's NATS user (which may create none) can follow a job. A job
/// that has no record yet is waited for.
pub async fn follow(jobs: &Jobs, id: &str, json: bool, quiet: bool) -> anyhow::Result<JobRecord> {
    const FIRST_POLL: Duration = Duration::from_millis(20);
    const LAST_POLL: Duration = Duration::from_millis(500);
    let bar = if quiet {
        ProgressBar::hidden()
    } else {
        ProgressBar::new_spinner()
    };
    bar.set_style(
        ProgressStyle::with_template("{spinner} {msg} [{bar:30}] {pos}/{len}")
            .expect("template")
            .progress_chars("=> "),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    // From the current revision on (older ones are history).
    let mut after = match jobs.get(id).await? {
        Some(v) => v.revision - 1,
        None => jobs.opened_at(),
    };
    let mut pause = FIRST_POLL;
    loop {
        let Some((seq, rec)) = jobs.revision_after(id, after).await? else {
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(LAST_POLL);
            continue;
        };
        after = seq;
        pause = FIRST_POLL;
        let Some(rec) = rec else { continue };
        if json {
            println!("{}", serde_json::to_string(&rec)?);
        }
        let p = rec.progress.clone().unwrap_or_default();
        bar.set_length(u64::from(p.sections_total.max(1)));
        bar.set_position(u64::from(p.sections_done));
        bar.set_message(format!(
            "{} {} attempts={} epoch={} reclaims={}{}",
            rec.id,
            rec.status,
            rec.attempts,
            rec.epoch,
            rec.stale_reclaims,
            if p.phase.is_empty() {
                String::new()
            } else {
                format!(" phase={}", p.phase)
            }
        ));
        if terminal(&rec) {
            bar.finish_and_clear();
            return Ok(rec);
        }
    }
}
