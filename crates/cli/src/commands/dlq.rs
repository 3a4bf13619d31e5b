//! `leasehold dlq list|show SEQ|replay SEQ|purge [--yes]`: dead letters.
//!
//! A dead letter is either a dead job (poison, max deliveries: its last
//! record, recent events and ticket as JSON) or a rejected submission (the
//! raw bytes as they came, the reason in headers). Replay puts the job back:
//! a dead job is queued again under the same id with a fresh attempt budget
//! (its history stays in the record's revisions and its events) and gets a
//! new ticket; a rejected submission's raw bytes are published again after
//! the reason is shown. A replayed letter is deleted unless `--keep`.

use std::io::{BufRead, IsTerminal, Write};
use std::time::SystemTime;

use anyhow::Context as _;
use leasehold_core::machine::{self, status_of, TransitionError};
use leasehold_core::spec::{self, Kinds, Submission};
use leasehold_core::{JobRecord, Status};
use leasehold_store::dlq::{DeadJob, Dlq, Letter};
use leasehold_store::events::{self, Events};
use leasehold_store::work::{self, Work};
use leasehold_store::{Conn, Jobs, JobsError, NatsArgs};
use serde_json::{json, Value};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Subcommand, Debug)]
enum Cmd {
    /// List dead letters, oldest first (a table, or one JSON object per
    /// line), a page at a time; payloads stay on the server (`dlq show`).
    List {
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
        /// Only letters of this kind (filtered on the server).
        #[arg(long)]
        kind: Option<String>,
        /// Only letters of this class (poison, max_deliveries, rejected, id_conflict).
        #[arg(long)]
        class: Option<String>,
        /// At most this many letters.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Start after this sequence (the last one of the previous page).
        #[arg(long, default_value_t = 0)]
        after: u64,
    },
    /// Show one dead letter in full, as JSON.
    Show {
        /// The letter's sequence (from `leasehold dlq list`).
        seq: u64,
    },
    /// Resubmit a dead letter: same job id, fresh attempt budget, history kept.
    Replay {
        /// The letter's sequence (from `leasehold dlq list`).
        seq: u64,
        /// Keep the letter in the DLQ after replaying it.
        #[arg(long)]
        keep: bool,
    },
    /// Delete every dead letter (asks for confirmation on a terminal).
    Purge {
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
    },
}

pub async fn run(args: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    let conn = nats.connect("leasehold-cli dlq").await?;
    let dlq = Dlq::new(&conn);
    match args.cmd {
        Cmd::List {
            json,
            kind,
            class,
            limit,
            after,
        } => list(&dlq, json, kind, class, limit, after).await,
        Cmd::Show { seq } => show(&dlq, seq).await,
        Cmd::Replay { seq, keep } => replay(&conn, &dlq, seq, keep).await,
        Cmd::Purge { yes } => purge(&dlq, yes).await,
    }
}

async fn list(
    dlq: &Dlq,
    as_json: bool,
    kind: Option<String>,
    class: Option<String>,
    limit: usize,
    after: u64,
) -> anyhow::Result<i32> {
    let (letters, more): (Vec<Letter>, bool) = dlq
        .page(kind.as_deref(), class.as_deref(), after, limit)
        .await?;
    if as_json {
        for l in &letters {
            println!("{}", serde_json::to_string(l)?);
        }
    } else {
        println!(
            "{:>6}  {:<10} {:<15} {:<28} {:<24}  REASON",
            "SEQ", "KIND", "CLASS", "JOB", "AT"
        );
        for l in &letters {
            println!(
                "{:>6}  {:<10} {:<15} {:<28} {:<24}  {}",
                l.seq,
                l.kind,
                l.class,
                l.job_id.as_deref().unwrap_or("-"),
                l.at,
                l.reason
            );
        }
    }
    match (more, letters.last()) {
        (true, Some(last)) => eprintln!(
            "{} dead letter(s) shown; more follow: add --after {}",
            letters.len(),
            last.seq
        ),
        _ => eprintln!("{} dead letter(s)", letters.len()),
    }
    Ok(0)
}

async fn letter(dlq: &Dlq, seq: u64) -> anyhow::Result<Letter> {
    dlq.get(seq)
        .await?
        .with_context(|| format!("no dead letter {seq}; `leasehold dlq list` shows the sequences"))
}

fn is_rejection(l: &Letter) -> bool {
    l.class == "rejected"
}

async fn show(dlq: &Dlq, seq: u64) -> anyhow::Result<i32> {
    let l = letter(dlq, seq).await?;
    let headers: serde_json::Map<String, Value> = l
        .headers
        .iter()
        .map(|(k, v)| {
            (
                k.to_string(),
                json!(v.iter().map(|x| x.as_str()).collect::<Vec<_>>().join(", ")),
            )
        })
        .collect();
    let mut out = json!({
        "seq": l.seq, "kind": l.kind, "class": l.class, "job_id": l.job_id,
        "reason": l.reason, "at": l.at, "headers": headers, "size": l.payload.len(),
    });
    match serde_json::from_slice::<Value>(&l.payload) {
        Ok(v) if !is_rejection(&l) => out["letter"] = v,
        _ => match std::str::from_utf8(&l.payload) {
            Ok(text) => out["payload"] = json!(text),
            Err(_) => {
                out["payload_hex"] = json!(l
                    .payload
                    .iter()
                    .map(|b| format!("{b:02x}"))
                    .collect::<String>())
            }
        },
    }
    println!("{}", serde_json::to_string_pretty(&out)?);
    Ok(0)
}

async fn replay(conn: &Conn, dlq: &Dlq, seq: u64, keep: bool) -> anyhow::Result<i32> {
    let l = letter(dlq, seq).await?;
    let jobs = super::open_jobs(conn).await?;
    let out = if is_rejection(&l) {
        replay_rejected(conn, &jobs, &l).await?
    } else {
        replay_dead(conn, &jobs, &l).await?
    };
    if !keep {
        dlq.delete(seq).await.with_context(|| format!("the job was replayed, but letter {seq} could not be deleted; delete it later or ignore it"))?;
    }
    println!("{out}");
    Ok(0)
}

/// Requeues the dead job with a fresh budget, gives it a new ticket, and
/// points the record at it.
async fn replay_dead(conn: &Conn, jobs: &Jobs, l: &Letter) -> anyhow::Result<Value> {
    let body: DeadJob = serde_json::from_slice(&l.payload).with_context(|| {
        format!(
            "letter {} is not a dead job's letter (class {:?}); `leasehold dlq show {}` shows it",
            l.seq, l.class, l.seq
        )
    })?;
    let id = body.record.id.clone();
    let refuse = |rec: &JobRecord| -> Result<(), TransitionError> {
        match status_of(rec) {
            Some(Status::Dead | Status::Failed | Status::Rejected | Status::Cancelled) => Ok(()),
            _ => Err(TransitionError::NotAllowed {
                status: rec.status.clone(),
                action: "replay",
                allowed: "dead, failed, rejected or cancelled",
            }),
        }
    };
    let queued = match jobs.get(&id).await? {
        Some(_) => jobs
            .transition(&id, |cur| {
                refuse(cur)?;
                machine::requeue_fresh(cur, SystemTime::now(), 0).map(Some)
            })
            .await
            .map_err(|e| explain(e, &id))?,
        None => {
            // The record is gone (purged bucket): recreate it from the letter.
            let rec = machine::requeue_fresh(&body.record, SystemTime::now(), 0)?;
            let revision = jobs.create(&rec).await.map_err(|e| explain(e, &id))?;
            leasehold_store::Versioned {
                value: rec,
                revision,
            }
        }
    };
    let ticket = requeue_ticket(
        conn,
        jobs,
        &queued.value,
        "replay",
        &format!("{}-{}", l.seq, queued.revision),
    )
    .await?;
    let ev = events::event(
        &id,
        queued.value.epoch,
        "progress",
        None,
        json!({"phase": "replayed", "dlq_seq": l.seq, "ticket_seq": ticket}),
    );
    let _ = Events::new(conn)
        .publish(&ev, Some(&format!("{id}:replayed:{ticket}")))
        .await;
    eprintln!("job {id} queued again with a fresh attempt budget (ticket {ticket}); follow it with `leasehold watch {id}`");
    Ok(json!({"id": id, "status": "queued", "ticket_seq": ticket, "replayed_from": l.seq}))
}

/// Publishes the raw bytes of a rejected submission again, after saying why
/// they were rejected. A `rejected` record of the same id is queued again
/// when the bytes now decode, so the worker runs it instead of dropping it.
async fn replay_rejected(conn: &Conn, jobs: &Jobs, l: &Letter) -> anyhow::Result<Value> {
    eprintln!(
        "letter {} is a rejected submission of kind {:?}: {}",
        l.seq, l.kind, l.reason
    );
    let ct = work::content_type(Some(&l.headers));
    let sub = Submission {
        kind: &l.kind,
        payload: &l.payload,
        msg_id: l.job_id.as_deref(),
        content_type: ct.as_deref(),
        stream_seq: 0,
    };
    match spec::decode(sub, &Kinds::default(), spec::DEFAULT_MAX_BYTES) {
        Ok(accepted) => {
            if jobs.get(&accepted.id).await?.is_some_and(|v| v.value.status == Status::Rejected.as_str()) {
                jobs.transition(&accepted.id, |cur| {
                    if cur.status != Status::Rejected.as_str() {
                        return Ok(None);
                    }
                    let mut r = machine::requeue_fresh(cur, SystemTime::now(), 0)?;
                    r.spec = Some(accepted.spec.clone());
                    r.error = None;
                    Ok(Some(r))
                })
                .await
                .map_err(|e| explain(e, &accepted.id))?;
            }
        }
        Err(rej) => eprintln!("warning: these bytes are still refused by the built-in validation ({}); a worker will reject them again unless its configuration differs", rej.error),
    }
    eprintln!(
        "replaying its raw bytes ({} bytes) as they came",
        l.payload.len()
    );
    let msg_id = l.job_id.as_ref().map(|id| format!("{id}:replay:{}", l.seq));
    let p = Work::new(conn)
        .resubmit_raw(
            &l.kind,
            l.payload.clone(),
            Some(&l.headers),
            l.job_id.as_deref(),
            msg_id.as_deref(),
        )
        .await?;
    if p.duplicate {
        eprintln!("note: this letter was already replayed recently (the stream recognised the resubmission)");
    }
    Ok(
        json!({"id": l.job_id, "kind": l.kind, "ticket_seq": p.seq, "replayed_from": l.seq, "duplicate": p.duplicate}),
    )
}

/// Publishes a fresh ticket for a queued record and points the record at it
/// (a worker claiming the ticket first adopts it itself). Shared with `review resume`.
pub(crate) async fn requeue_ticket(
    conn: &Conn,
    jobs: &Jobs,
    rec: &JobRecord,
    reason: &str,
    nonce: &str,
) -> anyhow::Result<u64> {
    let p = Work::new(conn)
        .reissue(rec, reason, nonce)
        .await
        .with_context(|| format!("job {} is queued but its ticket could not be published; the reaper re-enqueues it after its stranded grace, or run this again", rec.id))?;
    let epoch = rec.epoch;
    let res = jobs
        .transition(&rec.id, |cur| {
            if cur.status != Status::Queued.as_str()
                || cur.epoch != epoch
                || cur.ticket_seq >= p.seq
            {
                return Ok(None);
            }
            let mut r = cur.clone();
            r.ticket_seq = p.seq;
            Ok(Some(r))
        })
        .await;
    match res {
        Ok(v) => {
            // The job is waiting again: the index lists it (and no longer as parked).
            let active = super::open_active(conn).await?;
            active.reconcile(&v.value).await?;
        }
        Err(e) => {
            tracing::debug!(job = %rec.id, error = %e, "ticket_seq not recorded; the claiming worker adopts it")
        }
    }
    Ok(p.seq)
}

/// A job-record error with what to do about it.
pub(crate) fn explain(e: JobsError, id: &str) -> anyhow::Error {
    match e {
        JobsError::NotFound(_) => anyhow::anyhow!("no job {id}; `leasehold list` shows the jobs"),
        JobsError::Transition(t) => {
            anyhow::anyhow!("job {id}: {t}; `leasehold status {id}` shows its record")
        }
        JobsError::Conflict(_) => {
            anyhow::anyhow!("job {id} kept changing while this ran; run the command again")
        }
        other => anyhow::Error::new(other)
            .context(format!("job {id}: check NATS and run the command again")),
    }
}

async fn purge(dlq: &Dlq, yes: bool) -> anyhow::Result<i32> {
    let n = dlq.count().await?;
    if n == 0 {
        eprintln!("the DLQ is empty");
        println!("{}", json!({"purged": 0}));
        return Ok(0);
    }
    if !yes {
        anyhow::ensure!(
            std::io::stdin().is_terminal(),
            "refusing to delete {n} dead letter(s) without confirmation: pass --yes"
        );
        eprint!("delete all {n} dead letter(s)? this cannot be undone; type 'yes' to confirm: ");
        std::io::stderr().flush()?;
        let mut answer = String::new();
        std::io::stdin().lock().read_line(&mut answer)?;
        if answer.trim() != "yes" {
            eprintln!("aborted; nothing deleted");
            return Ok(1);
        }
    }
    let purged = dlq.purge().await?;
    eprintln!("deleted {purged} dead letter(s)");
    println!("{}", json!({"purged": purged}));
    Ok(0)
}
