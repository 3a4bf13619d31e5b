//! `leasehold signal ID NAME [--data JSON]`: sends signal NAME to job ID.
//! The job's next `wait_for(NAME)` takes it: at once if the job waits for
//! it now (a worker's signal waker gives it a ticket), else when it gets
//! there (a signal sent before the wait is kept for it). Two signals of one
//! name are two waits' answers, in the order sent.
//!
//! Prints one JSON line (`{"id", "name", "seq", "duplicate", "status",
//! "waited_for"}`). `leasehold signal ID --list` lists the signals kept for
//! the job instead, and which wait took each. Exit codes: 0 sent, 1 not sent (no such job, a finished
//! job, NATS refused it), 2 bad usage (a name that is not a signal name,
//! data that is not JSON).

use leasehold_operate as operate;
use leasehold_store::NatsArgs;
use serde_json::Value;

#[derive(clap::Args, Debug)]
#[command(after_help = "Examples:\n  \
leasehold signal invoice-17 confirmation --data '{\"confirmed\": true}'\n  \
leasehold signal invoice-17 confirmation --data @answer.json --dedupe-id mail-4711\n\n\
The same signal can be published on lh.signal.<ID>.<NAME> (its payload the data, JSON), \
e.g. `nats pub lh.signal.invoice-17.confirmation '{\"confirmed\": true}'`.")]
pub struct Args {
    /// The job id.
    id: String,
    /// The signal's name: 1-64 letters, digits, '-' or '_' (what the job's
    /// `wait_for` names).
    #[arg(value_parser = parse_name, required_unless_present = "list")]
    name: Option<String>,
    /// Instead of sending: list the signals kept for the job, in the order
    /// sent, one JSON line each (`name`, `seq`, `sent_at`, `sender`, `data`,
    /// `taken_by`: the wait step that took it, or null).
    #[arg(long, conflicts_with_all = ["data", "dedupe_id"])]
    list: bool,
    /// The signal's data, as JSON (`@FILE` reads it from a file; default `{}`).
    #[arg(long, value_parser = parse_data)]
    data: Option<Value>,
    /// Sent again with the same dedupe id within an hour, the signal is
    /// stored once (`"duplicate": true`): safe to retry.
    #[arg(long)]
    dedupe_id: Option<String>,
    #[command(flatten)]
    json: super::AlwaysJson,
}

pub async fn run(a: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    let conn = nats.connect("leasehold-cli signal").await?;
    let Some(name) = a.name.as_deref() else {
        return list(&conn, &a.id).await;
    };
    let jobs = super::open_jobs(&conn).await?;
    let data = a.data.unwrap_or_else(|| Value::Object(Default::default()));
    let sender = super::sender();
    let sent = operate::send_signal(
        &conn,
        &jobs,
        &a.id,
        name,
        &data,
        a.dedupe_id.as_deref(),
        Some(&sender),
    )
    .await;
    match sent {
        Ok(sent) => {
            println!("{}", serde_json::to_string(&sent)?);
            if sent.duplicate {
                eprintln!(
                    "signal `{}` with this dedupe id was sent already (seq {}); nothing new stored",
                    sent.name, sent.seq
                );
            } else if !sent.waited_for {
                eprintln!(
                    "job {} is {} and not waiting for `{}`: the signal is kept until a wait takes it",
                    sent.id, sent.status, sent.name
                );
            }
            Ok(0)
        }
        Err(e) => {
            eprintln!("error: {e}");
            Ok(1)
        }
    }
}

/// `--list`: the job's signals, one JSON line each; exit 1 when none is kept.
async fn list(conn: &leasehold_store::Conn, id: &str) -> anyhow::Result<i32> {
    let kept = operate::signals_kept(conn, id, 10_000).await?;
    for s in &kept {
        println!("{}", serde_json::to_string(s)?);
    }
    if kept.is_empty() {
        eprintln!("no signal is kept for job {id}");
        return Ok(1);
    }
    if kept.iter().any(|s| s.taken_by.is_none()) {
        eprintln!("note: which wait took each signal is not shown: this NATS user may not read the job's steps");
    }
    Ok(0)
}

fn parse_name(s: &str) -> Result<String, String> {
    if leasehold_core::spec::valid_signal_name(s) {
        Ok(s.to_string())
    } else {
        Err(format!(
            "a signal name is {} (e.g. confirmation)",
            leasehold_core::spec::SIGNAL_NAME_RULE
        ))
    }
}

/// `--data`: JSON, or `@FILE` holding JSON.
fn parse_data(s: &str) -> Result<Value, String> {
    let text = match s.strip_prefix('@') {
        Some(path) => {
            std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?
        }
        None => s.to_string(),
    };
    serde_json::from_str(&text)
        .map_err(|e| format!("not JSON ({e}); e.g. --data '{{\"confirmed\": true}}'"))
}
