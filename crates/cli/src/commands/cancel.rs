//! `leasehold cancel ID...`: ask for cancellation on `lh.cancel.<ID>`; or,
//! with filters instead of ids, of every active job that matches them
//! (`--dry-run` lists them, `--yes` cancels them).
//! A queued job is cancelled at once; a running job's owner is told and
//! stops at once (or, if it cannot be reached, at its next write; a retry,
//! hand-back or reclaim never undoes the request).
//!
//! A worker records the request. When no worker answers, the CLI records
//! it itself if its NATS user may write job records (an operator's); a
//! submitter's may not, and NATS refuses the write: then nothing was
//! recorded, and the command says so and exits 1.

use leasehold_operate as operate;
use leasehold_store::index::Filter;
use leasehold_store::NatsArgs;
use serde_json::json;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The job id(s).
    #[arg(required_unless_present_any = ["kind", "status", "id_prefix"])]
    ids: Vec<String>,
    /// Instead of ids: every active job (queued, running or parked) of this kind.
    #[arg(long, conflicts_with = "ids")]
    kind: Option<String>,
    /// Instead of ids: every active job in this status (queued, running or parked).
    #[arg(long, conflicts_with = "ids", value_parser = ["queued", "running", "parked"])]
    status: Option<String>,
    /// Instead of ids: every active job whose id starts with this.
    #[arg(long, conflicts_with = "ids")]
    id_prefix: Option<String>,
    /// With filters: list the jobs that would be cancelled (JSON lines), cancel nothing.
    #[arg(long)]
    dry_run: bool,
    /// With filters: cancel every matching job without asking.
    #[arg(long)]
    yes: bool,
    #[command(flatten)]
    json: super::AlwaysJson,
}

pub async fn run(a: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    let conn = nats.connect("leasehold-cli cancel").await?;
    if !a.ids.is_empty() {
        let mut code = 0;
        for id in &a.ids {
            code = code.max(cancel_one(&conn, id).await?);
        }
        return Ok(code);
    }
    // Filters: the index of active jobs says which.
    let active = super::open_active(&conn).await?;
    let mut matched: Vec<(String, String, String)> = active
        .list(Filter::All)
        .await?
        .into_iter()
        .map(|(_, e)| (e.job, e.kind, e.status))
        .filter(|(job, kind, status)| {
            a.kind.as_ref().is_none_or(|k| k == kind)
                && a.status.as_ref().is_none_or(|s| s == status)
                && a.id_prefix
                    .as_ref()
                    .is_none_or(|p| job.starts_with(p.as_str()))
        })
        .collect();
    matched.sort();
    matched.dedup_by(|x, y| x.0 == y.0);
    let gate = super::Bulk {
        noun: "active job",
        verb: "cancel",
        done: "cancelled",
        hint: "`leasehold list` shows the active jobs",
        dry_run: a.dry_run,
        yes: a.yes,
    };
    let items = matched
        .iter()
        .map(|(id, kind, status)| json!({"id": id, "kind": kind, "status": status}))
        .collect();
    if let Some(code) = gate.gate(items) {
        return Ok(code);
    }
    let (mut done, mut not) = (0, 0);
    for (id, _, _) in &matched {
        match cancel_one(&conn, id).await? {
            0 => done += 1,
            _ => not += 1,
        }
    }
    eprintln!("{done} job(s) cancelled, {not} not (each said why above)");
    Ok(if not == 0 { 0 } else { 1 })
}

/// Asks for the cancellation of `id` ([`operate::request_cancel`]);
/// prints the answer as one JSON line (and, when nothing was recorded, why
/// on stderr). Returns the exit code.
async fn cancel_one(conn: &leasehold_store::Conn, id: &str) -> anyhow::Result<i32> {
    let answer = operate::request_cancel(conn, id).await?;
    if let Some(why) = &answer.refused {
        eprintln!("error: {why}");
    }
    let reply = answer.reply;
    println!("{reply}");
    if reply["recorded"].as_bool() == Some(true) {
        return Ok(0);
    }
    // Nothing recorded: say why on stderr, as every command does.
    match reply["outcome"].as_str().unwrap_or_default() {
        "not_found" => eprintln!("error: no job {id} (`leasehold list` shows the active jobs)"),
        "unchanged" => eprintln!(
            "error: job {id} is {}: nothing to cancel",
            reply["status"].as_str().unwrap_or("finished")
        ),
        "refused" => {}
        other => eprintln!(
            "error: the cancellation of job {id} was not recorded ({other}: {})",
            reply["error"].as_str().unwrap_or("no reason given")
        ),
    }
    Ok(1)
}
