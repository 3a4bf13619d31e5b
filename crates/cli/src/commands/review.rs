//! `leasehold review list|resume ID|fail ID --reason TEXT`: the queue of
//! parked jobs waiting for a person (a policy refusal, an external effect
//! whose outcome is uncertain, a loop).
//!
//! A parked job keeps its full state (checkpoints, progress, budget used).
//! `resume` queues it again with a fresh attempt budget and a new ticket
//! (published first: a failure at any step leaves the job parked, or queued
//! with its ticket, and the command can be run again); the
//! workflow continues from its checkpoints. `fail` ends it as `failed` with
//! the reviewer's reason (error class `review`).

use leasehold_core::{JobRecord, Status};
use leasehold_operate as operate;
use leasehold_store::index::{Active, Filter};
use leasehold_store::{Jobs, NatsArgs};
use serde_json::{json, Value};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Subcommand, Debug)]
enum Cmd {
    /// Parked jobs with their reason and state, oldest first.
    List {
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Queue a parked job again (fresh attempt budget; its checkpoints are kept).
    ///
    /// With --answer, a person's answer goes back to the step that asked
    /// (`ctx.park` of the SDK returns it in the resumed attempt).
    Resume {
        /// The job id.
        id: String,
        /// The answer, as JSON (e.g. '{"approve": true}'); recorded as the
        /// job's `answer` event before the job is queued again.
        #[arg(long, value_parser = parse_answer)]
        answer: Option<Value>,
        #[command(flatten)]
        json: super::AlwaysJson,
    },
    /// End a parked job as failed.
    Fail {
        /// The job id.
        id: String,
        /// Why (recorded as the job's error message).
        #[arg(long)]
        reason: String,
        #[command(flatten)]
        json: super::AlwaysJson,
    },
}

pub async fn run(args: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    let conn = nats.connect("leasehold-cli review").await?;
    let jobs = super::open_jobs(&conn).await?;
    match args.cmd {
        Cmd::List { json } => list(&jobs, &super::open_active(&conn).await?, json).await,
        Cmd::Resume { id, answer, .. } => {
            let sender = super::sender();
            let ticket =
                operate::review_resume(&conn, &jobs, &id, answer.as_ref(), Some(&sender)).await?;
            eprintln!(
                "job {id} queued again (ticket {ticket}); follow it with `leasehold watch {id}`"
            );
            println!(
                "{}",
                json!({"id": id, "status": "queued", "ticket_seq": ticket})
            );
            Ok(0)
        }
        Cmd::Fail { id, reason, .. } => {
            let rec = operate::review_fail(&conn, &jobs, &id, &reason).await?;
            eprintln!("job {id} failed: {reason}");
            println!("{}", json!({"id": id, "status": rec.status}));
            Ok(0)
        }
    }
}

/// `--answer` must be JSON.
fn parse_answer(s: &str) -> Result<Value, String> {
    serde_json::from_str(s)
        .map_err(|e| format!("not JSON ({e}); e.g. --answer '{{\"approve\": true}}'"))
}

fn summary(r: &JobRecord) -> Value {
    json!({
        "id": r.id,
        "kind": r.kind,
        "reason": r.parked_reason.clone().or_else(|| r.error.as_ref().map(|e| e.class.clone())),
        "message": r.error.as_ref().map(|e| e.message.clone()),
        "parked_at": r.error.as_ref().map(|e| e.at.clone()).unwrap_or_else(|| r.updated_at.clone()),
        "epoch": r.epoch,
        "attempts": r.attempts,
        "resume_from": r.resume_from,
        "progress": r.progress,
        "budget_used": r.budget_used,
    })
}

async fn list(jobs: &Jobs, active: &Active, as_json: bool) -> anyhow::Result<i32> {
    // The index lists the parked jobs; the records say what they are now.
    let mut parked: Vec<JobRecord> = Vec::new();
    for (_, e) in active.list(Filter::Parked).await? {
        if let Some(v) = jobs.get(&e.job).await? {
            if v.value.status == Status::Parked.as_str() {
                parked.push(v.value);
            }
        }
    }
    parked.sort_by(|a, b| a.updated_at.cmp(&b.updated_at));
    if as_json {
        for r in &parked {
            println!("{}", summary(r));
        }
    } else {
        println!(
            "{:<28} {:<10} {:<18} {:<24} {:>5} {:<14}  MESSAGE",
            "ID", "KIND", "REASON", "PARKED AT", "EPOCH", "PROGRESS"
        );
        for r in &parked {
            let s = summary(r);
            let progress = r
                .progress
                .as_ref()
                .map(|p| format!("{} {}/{}", p.phase, p.sections_done, p.sections_total))
                .unwrap_or_else(|| "-".into());
            println!(
                "{:<28} {:<10} {:<18} {:<24} {:>5} {:<14}  {}",
                r.id,
                r.kind,
                s["reason"].as_str().unwrap_or("-"),
                s["parked_at"].as_str().unwrap_or("-"),
                r.epoch,
                progress,
                s["message"].as_str().unwrap_or("")
            );
        }
    }
    eprintln!("{} parked job(s); `leasehold review resume ID` or `leasehold review fail ID --reason TEXT`", parked.len());
    Ok(0)
}
