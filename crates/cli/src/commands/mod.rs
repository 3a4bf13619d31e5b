//! The subcommands, one module per noun.

pub mod cancel;
pub mod dlq;
pub mod events;
pub mod finished;
pub mod journal;
pub mod limits;
pub mod list;
pub mod model;
pub mod result;
pub mod review;
pub mod schedule;
pub mod setup;
pub mod signal;
pub mod stats;
pub mod status;
pub mod submit;
pub mod tool;
pub mod transcript;
pub mod watch;
pub mod workers;

use std::time::Duration;

use leasehold_store::index::Active;
use leasehold_store::{retry_unavailable, Conn, Jobs, StoreError};

use crate::{Cli, Command};

/// `--json` on a command whose output is JSON already: accepted, so a
/// script may pass `--json` to every command.
#[derive(clap::Args, Debug, Clone, Copy)]
pub struct AlwaysJson {
    /// Output is JSON already (accepted so scripts may pass --json everywhere).
    #[arg(long = "json", id = "json")]
    _json: bool,
}

/// What a bulk action by filter is about to act on, and how it was asked.
pub(crate) struct Bulk<'a> {
    /// `job`, `letter`: what one item is.
    pub noun: &'a str,
    /// `cancel`, `replay`, `delete`, and what the items become.
    pub verb: &'a str,
    pub done: &'a str,
    /// Where to see them (for "nothing matches").
    pub hint: &'a str,
    pub dry_run: bool,
    pub yes: bool,
}

impl Bulk<'_> {
    /// The one gate of every bulk action: `None` to act on `items` (each
    /// a JSON object describing one); `Some(code)` when the command ends
    /// here: nothing matches (1; 0 for a dry run: a listing of nothing is
    /// a listing), a dry run (0, the items listed as JSON lines with
    /// `"would"`), or neither `--dry-run` nor `--yes` (2).
    pub fn gate(&self, mut items: Vec<serde_json::Value>) -> Option<i32> {
        let (noun, verb, done) = (self.noun, self.verb, self.done);
        if items.is_empty() {
            if self.dry_run {
                eprintln!("no {noun} matches (dry run: nothing changed)");
                return Some(0);
            }
            eprintln!("error: no {noun} matches ({})", self.hint);
            return Some(1);
        }
        if self.dry_run {
            for it in &mut items {
                it["would"] = serde_json::json!(verb);
                println!("{it}");
            }
            eprintln!(
                "{} {noun}(s) would be {done} (dry run: nothing changed)",
                items.len()
            );
            return Some(0);
        }
        if !self.yes {
            eprintln!(
                "error: {} {noun}(s) match; pass --yes to {verb} them, or --dry-run to list them",
                items.len()
            );
            return Some(2);
        }
        None
    }
}

/// How long a command waits for JetStream when it opens the buckets it
/// reads and the server does not answer (a leader election, a node
/// restarting), as the worker and the reaper do at start; a missing layout
/// fails at once.
const OPEN_DEADLINE: Duration = Duration::from_secs(120);

/// Who sends what this command sends (a signal, a park's answer), as its
/// `Lh-Sender` says: `<user> via cli`.
pub(crate) fn sender() -> String {
    format!(
        "{} via cli",
        std::env::var("USER").unwrap_or_else(|_| "someone".into())
    )
}

/// The job records, waiting out an unavailable server.
pub(crate) async fn open_jobs(conn: &Conn) -> Result<Jobs, StoreError> {
    retry_unavailable("jobs bucket", OPEN_DEADLINE, || Jobs::open(conn)).await
}

/// The index of active jobs, waiting out an unavailable server.
pub(crate) async fn open_active(conn: &Conn) -> Result<Active, StoreError> {
    retry_unavailable("index of active jobs", OPEN_DEADLINE, || Active::open(conn)).await
}

/// Runs one command and returns the process exit code. Errors are printed
/// to stderr here, once.
pub async fn run(cli: Cli) -> i32 {
    let nats = cli.nats;
    let out = match cli.cmd {
        Command::Setup(a) => setup::run(*a, &nats).await,
        Command::Submit(a) => submit::run(a, &nats).await,
        Command::Status(a) => status::run(a, &nats).await,
        Command::List(a) => list::run(a, &nats).await,
        Command::Watch(a) => watch::run(a, &nats).await,
        Command::Events(a) => events::run(a, &nats).await,
        Command::Workers(a) => workers::run(a, &nats).await,
        Command::Stats(a) => stats::run(a, &nats).await,
        Command::Cancel(a) => cancel::run(a, &nats).await,
        Command::Signal(a) => signal::run(a, &nats).await,
        Command::Journal(a) => journal::run(a, &nats).await,
        Command::Result(a) => result::run(a, &nats).await,
        Command::Dlq(a) => dlq::run(a, &nats).await,
        Command::Review(a) => review::run(a, &nats).await,
        Command::Schedule(a) => schedule::run(a, &nats).await,
        Command::Limits(a) => limits::run(a, &nats).await,
        Command::Transcript(a) => transcript::run(a, &nats).await,
        Command::Model(a) => model::run(a, &nats).await,
        Command::Tool(a) => tool::run(a, &nats).await,
    };
    match out {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    }
}
