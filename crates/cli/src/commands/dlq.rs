//! `leasehold dlq list|show SEQ|replay SEQ|purge [--yes]`: dead letters.
//!
//! A dead letter is either a dead job (poison, max deliveries: its last
//! record, recent events and ticket as JSON) or a rejected submission (the
//! raw bytes as they came, the reason in headers). Replay puts the job back:
//! a dead job is queued again under the same id with a fresh attempt budget
//! (its history stays in the record's revisions and its events) and gets a
//! new ticket (published first); a rejected submission's raw bytes (or a
//! corrected submission, `--spec FILE`) are published again after the
//! reason is shown, and bytes still refused only with `--force`. A letter
//! is deleted only once its replay was accepted as a job (and not with
//! `--keep`): the raw submission is never lost.

use std::io::{BufRead, IsTerminal, Write};

use anyhow::Context as _;
use leasehold_core::spec;
use leasehold_operate as operate;
use leasehold_store::dlq::{DeadJob, Dlq, Letter};
use leasehold_store::{Conn, Jobs, NatsArgs};
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
        #[command(flatten)]
        json: super::AlwaysJson,
    },
    /// Resubmit a dead letter: same job id, fresh attempt budget, history
    /// kept. The letter leaves only once its replay was accepted as a job
    /// (a dead job queued again with its new ticket; a rejected
    /// submission's bytes taken by a worker); until then it stays, and
    /// running this again is safe (the resubmission is recognised).
    Replay {
        /// The letter's sequence (from `leasehold dlq list`); or filters
        /// (`--kind`, `--class`) to replay every matching letter.
        #[arg(required_unless_present_any = ["kind", "class"])]
        seq: Option<u64>,
        /// Instead of SEQ: every letter of this kind.
        #[arg(long, conflicts_with_all = ["seq", "spec"])]
        kind: Option<String>,
        /// Instead of SEQ: every letter of this class (poison,
        /// max_deliveries, rejected, id_conflict).
        #[arg(long, conflicts_with_all = ["seq", "spec"])]
        class: Option<String>,
        /// With filters: list the letters that would be replayed (JSON
        /// lines), replay nothing.
        #[arg(long)]
        dry_run: bool,
        /// With filters: replay every matching letter without asking.
        #[arg(long)]
        yes: bool,
        /// Keep the letter in the DLQ even after the replay was accepted.
        #[arg(long)]
        keep: bool,
        /// Replay this corrected submission (a file, `-` for standard
        /// input) instead of the letter's own bytes or spec: same kind,
        /// same id.
        #[arg(long, value_name = "FILE")]
        spec: Option<std::path::PathBuf>,
        /// Replay bytes the built-in validation refuses (they are refused
        /// again unless the workers' configuration differs); the letter
        /// is kept.
        #[arg(long)]
        force: bool,
        /// How long to wait for a worker to accept a replayed submission
        /// before leaving its letter in place.
        #[arg(long, default_value = "15s", value_parser = leasehold_core::time::parse_duration)]
        wait: std::time::Duration,
        #[command(flatten)]
        json: super::AlwaysJson,
    },
    /// Delete every dead letter, or those matching `--kind`/`--class`
    /// (asks for confirmation on a terminal).
    Purge {
        /// Only letters of this kind.
        #[arg(long)]
        kind: Option<String>,
        /// Only letters of this class.
        #[arg(long)]
        class: Option<String>,
        /// List the letters that would be deleted (JSON lines), delete nothing.
        #[arg(long)]
        dry_run: bool,
        /// Do not ask for confirmation.
        #[arg(long)]
        yes: bool,
        #[command(flatten)]
        json: super::AlwaysJson,
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
        Cmd::Show { seq, .. } => show(&dlq, seq).await,
        Cmd::Replay {
            seq,
            kind,
            class,
            dry_run,
            yes,
            keep,
            spec,
            force,
            wait,
            ..
        } => {
            let o = ReplayOpts {
                keep,
                spec,
                force,
                wait,
            };
            match seq {
                Some(seq) => replay(&conn, &dlq, seq, &o).await,
                None => {
                    let f = Matching {
                        kind,
                        class,
                        dry_run,
                        yes,
                    };
                    replay_matching(&conn, &dlq, &f, &o).await
                }
            }
        }
        Cmd::Purge {
            kind,
            class,
            dry_run,
            yes,
            ..
        } if kind.is_some() || class.is_some() || dry_run => {
            let f = Matching {
                kind,
                class,
                dry_run,
                yes,
            };
            purge_matching(&dlq, &f).await
        }
        Cmd::Purge { yes, .. } => purge(&dlq, yes).await,
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

/// What `dlq replay` was asked besides the letter.
struct ReplayOpts {
    keep: bool,
    spec: Option<std::path::PathBuf>,
    force: bool,
    wait: std::time::Duration,
}

async fn replay(conn: &Conn, dlq: &Dlq, seq: u64, o: &ReplayOpts) -> anyhow::Result<i32> {
    let l = letter(dlq, seq).await?;
    let corrected = o.spec.as_deref().map(read_spec).transpose()?;
    let jobs = super::open_jobs(conn).await?;
    let (mut out, accepted) = if is_rejection(&l) {
        replay_rejected(conn, &jobs, &l, corrected, o).await?
    } else {
        (replay_dead(conn, &jobs, &l, corrected).await?, true)
    };
    let deleted = accepted && !o.keep;
    if deleted {
        dlq.delete(seq).await.with_context(|| format!("the job was replayed, but letter {seq} could not be deleted; delete it later or ignore it"))?;
        eprintln!("letter {seq} deleted: its replay was accepted as a job");
    } else if !accepted {
        eprintln!("letter {seq} kept: its replay was not accepted as a job (yet); `leasehold dlq replay {seq}` again is safe");
    }
    out["letter_deleted"] = json!(deleted);
    println!("{out}");
    Ok(0)
}

/// The bytes of a corrected submission (`-`: standard input).
fn read_spec(path: &std::path::Path) -> anyhow::Result<Vec<u8>> {
    if path.as_os_str() == "-" {
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut std::io::stdin(), &mut b)
            .context("cannot read the corrected submission from standard input")?;
        return Ok(b);
    }
    std::fs::read(path)
        .with_context(|| format!("cannot read the corrected submission {}", path.display()))
}

/// The built-in validation of `payload` as a submission of `kind` under `id`.
fn validate(
    kind: &str,
    payload: &[u8],
    id: Option<&str>,
    content_type: Option<&str>,
) -> Result<spec::Accepted, spec::Rejected> {
    operate::validate_submission(kind, payload, id, content_type)
}

/// Requeues the dead job with a fresh budget ([`operate::replay_dead`]:
/// its ticket first), after validating a corrected submission.
async fn replay_dead(
    conn: &Conn,
    jobs: &Jobs,
    l: &Letter,
    corrected: Option<Vec<u8>>,
) -> anyhow::Result<Value> {
    let new_spec = match corrected {
        Some(bytes) => {
            let body: DeadJob = serde_json::from_slice(&l.payload).with_context(|| {
                format!(
                    "letter {} is not a dead job's letter (class {:?}); `leasehold dlq show {}` shows it",
                    l.seq, l.class, l.seq
                )
            })?;
            let id = body.record.id.clone();
            Some(
                validate(
                    &body.record.kind,
                    &bytes,
                    Some(&id),
                    Some("application/json"),
                )
                .map_err(|rej| {
                    anyhow::anyhow!(
                        "the corrected submission is refused ({}); letter {} kept",
                        rej.error,
                        l.seq
                    )
                })?
                .spec,
            )
        }
        None => None,
    };
    let out = operate::replay_dead(conn, jobs, l, new_spec).await?;
    let (id, ticket) = (&out["id"], &out["ticket_seq"]);
    let id = id.as_str().unwrap_or_default();
    eprintln!("job {id} queued again with a fresh attempt budget (ticket {ticket}); follow it with `leasehold watch {id}`");
    Ok(out)
}

/// Publishes a rejected submission's raw bytes (or a corrected
/// submission) again, after saying why they were rejected
/// ([`operate::replay_rejected`]: bytes the built-in validation still
/// refuses are not sent unless forced; a `rejected` record of the same id
/// is queued again first). Returns whether a worker accepted the replay
/// within `--wait`: only then may the letter go.
async fn replay_rejected(
    conn: &Conn,
    jobs: &Jobs,
    l: &Letter,
    corrected: Option<Vec<u8>>,
    o: &ReplayOpts,
) -> anyhow::Result<(Value, bool)> {
    eprintln!(
        "letter {} is a rejected submission of kind {:?}: {}",
        l.seq, l.kind, l.reason
    );
    let is_corrected = corrected.is_some();
    let size = corrected.as_ref().map_or(l.payload.len(), Vec::len);
    let p = operate::replay_rejected(conn, jobs, l, corrected, o.force)
        .await
        .map_err(|e| {
            anyhow::anyhow!(if o.force {
                e.to_string()
            } else {
                format!("{e} with `--spec FILE`, or send them anyway with `--force`")
            })
        })?;
    if let Some(why) = &p.forced {
        eprintln!("warning: sent bytes the built-in validation refuses ({why}), as --force asks; the letter is kept");
    }
    eprintln!(
        "replayed {} ({size} bytes)",
        if is_corrected {
            "the corrected submission"
        } else {
            "its raw bytes as they came"
        },
    );
    if p.duplicate {
        eprintln!("note: this letter was already replayed recently (the stream recognised the resubmission)");
    }
    let accepted = match (&l.job_id, p.forced.is_some()) {
        (Some(id), false) => {
            match operate::accepted_by_a_worker(jobs, id, p.sent_at, o.wait).await {
                Ok(true) => true,
                Ok(false) => {
                    eprintln!(
                        "no worker took job {id} within {:?}; `leasehold status {id}` follows it",
                        o.wait
                    );
                    false
                }
                Err(e) => {
                    eprintln!("{e}");
                    false
                }
            }
        }
        (None, _) => {
            eprintln!("the letter names no job id: whether a worker accepts it cannot be told");
            false
        }
        (_, true) => false,
    };
    Ok((
        json!({"id": l.job_id, "kind": l.kind, "ticket_seq": p.ticket_seq, "replayed_from": l.seq, "duplicate": p.duplicate, "accepted": accepted}),
        accepted,
    ))
}

/// Which letters a bulk replay or purge acts on, and how.
struct Matching {
    kind: Option<String>,
    class: Option<String>,
    dry_run: bool,
    yes: bool,
}

impl Matching {
    /// Every letter matching the filters, oldest first (a page at a time).
    async fn letters(&self, dlq: &Dlq) -> anyhow::Result<Vec<Letter>> {
        let mut out = Vec::new();
        let mut after = 0;
        loop {
            let (page, more) = dlq
                .page(self.kind.as_deref(), self.class.as_deref(), after, 500)
                .await?;
            after = page.last().map_or(after, |l| l.seq);
            out.extend(page);
            if !more {
                return Ok(out);
            }
        }
    }

    /// The bulk gate ([`super::Bulk::gate`]) over `letters`.
    fn gate(&self, letters: &[Letter], verb: &str, done: &str) -> Option<i32> {
        let gate = super::Bulk {
            noun: "dead letter",
            verb,
            done,
            hint: "`leasehold dlq list` shows them",
            dry_run: self.dry_run,
            yes: self.yes,
        };
        gate.gate(
            letters
                .iter()
                .map(|l| json!({"seq": l.seq, "kind": l.kind, "class": l.class, "job_id": l.job_id, "reason": l.reason}))
                .collect(),
        )
    }
}

/// Replays every letter `f` matches, one by one as `dlq replay SEQ` does;
/// one that fails is reported and the others go on.
async fn replay_matching(
    conn: &Conn,
    dlq: &Dlq,
    f: &Matching,
    o: &ReplayOpts,
) -> anyhow::Result<i32> {
    let letters = f.letters(dlq).await?;
    if let Some(code) = f.gate(&letters, "replay", "replayed") {
        return Ok(code);
    }
    let mut failed = 0;
    for l in &letters {
        if let Err(e) = replay(conn, dlq, l.seq, o).await {
            eprintln!("error: letter {}: {e:#}", l.seq);
            failed += 1;
        }
    }
    eprintln!(
        "{} letter(s) replayed, {failed} not (each said why above)",
        letters.len() - failed
    );
    Ok(if failed == 0 { 0 } else { 1 })
}

/// Deletes every letter `f` matches.
async fn purge_matching(dlq: &Dlq, f: &Matching) -> anyhow::Result<i32> {
    let letters = f.letters(dlq).await?;
    if let Some(code) = f.gate(&letters, "delete", "deleted") {
        return Ok(code);
    }
    let mut deleted = 0u64;
    for l in &letters {
        if dlq.delete(l.seq).await? {
            deleted += 1;
        }
    }
    eprintln!("deleted {deleted} dead letter(s)");
    println!("{}", json!({"purged": deleted}));
    Ok(0)
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
