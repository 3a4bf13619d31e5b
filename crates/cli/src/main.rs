//! `leasehold`: the command-line interface.
//!
//! One module per noun under `commands/`. Data goes to stdout, messages and
//! errors to stderr; every error says what to do next. Exit codes: 0 success,
//! 1 failure, 2 bad usage or unreadable input, other codes as each command
//! documents.

use clap::{Parser, Subcommand};
use leasehold_store::NatsArgs;

mod commands;

#[derive(Parser, Debug)]
#[command(
    name = "leasehold",
    version,
    about = "Run and operate long AI-agent jobs on NATS JetStream",
    long_about = "Run and operate long AI-agent jobs on NATS JetStream.\n\n\
Every command reads NATS_URL (default nats://127.0.0.1:4222), NATS credentials \
(NATS_CREDS, or NATS_USER/NATS_PASSWORD, or NATS_TOKEN), TLS (NATS_CA, NATS_CERT, \
NATS_KEY) and LH_PREFIX (namespace, default lh)."
)]
pub struct Cli {
    #[command(flatten)]
    pub nats: NatsArgs,
    #[command(subcommand)]
    pub cmd: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Create the streams, buckets and consumers (idempotent).
    ///
    /// A setting not given keeps what is set up; the defaults shown are for
    /// a new layout. Durations are written `10s`, `15m`, `1h`, `7d`; sizes
    /// `4GiB`, `512MiB`, `64KiB` or in bytes (`1000000`).
    Setup(Box<commands::setup::Args>),
    /// Submit a job (a JSON spec from a file, inline, or stdin).
    Submit(commands::submit::Args),
    /// Show one job's record.
    Status(commands::status::Args),
    /// List jobs, optionally filtered by status and kind.
    List(commands::list::Args),
    /// Follow a job live until it reaches a terminal state.
    Watch(commands::watch::Args),
    /// A job's history, event by event (`--follow` for new ones).
    Events(commands::events::Args),
    /// The live worker processes and the jobs each runs.
    Workers(commands::workers::Args),
    /// Counts of active jobs by kind and status, tickets per kind, the oldest in flight.
    Stats(commands::stats::Args),
    /// Ask for a job's cancellation.
    Cancel(commands::cancel::Args),
    /// Send a signal to a job (what its `wait_for` waits for).
    Signal(commands::signal::Args),
    /// Check recorded journals against a new build of a kind before rolling it out.
    Journal(commands::journal::Args),
    /// Print a finished job's result (the report, for research jobs).
    Result(commands::result::Args),
    /// Dead letters: list, show, replay, purge.
    Dlq(commands::dlq::Args),
    /// Parked jobs waiting for a person: list, resume, fail.
    Review(commands::review::Args),
    /// Recurring schedules (cron, UTC), fired by the reapers: add, list, pause, resume, remove.
    Schedule(commands::schedule::Args),
    /// Provider limits shared by the fleet (RPM, TPM, concurrency per provider key): list, set, clear.
    Limits(commands::limits::Args),
    /// Repair a tool-calling transcript for a warm retry (OpenAI message format).
    Transcript(commands::transcript::Args),
    /// Talk to the configured model provider through the workers' client.
    Model(commands::model::Args),
    /// Run or list tools through the same layer and effects ledger the workers use.
    Tool(commands::tool::Args),
}

/// Restores the default SIGPIPE action, so `leasehold list | head` ends
/// quietly like any Unix tool instead of panicking on the closed pipe.
#[allow(unsafe_code)]
fn restore_sigpipe() {
    // SAFETY: called first in main, before any other thread exists; setting
    // a signal's disposition to its default has no other precondition.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Subcommands that never connect to NATS: their `--help` leaves the
/// connection options out (they are still accepted, and ignored).
const OFFLINE: &[[&str; 2]] = &[
    ["transcript", "repair"],
    ["model", "check"],
    ["tool", "list"],
];

/// The command line. An offline subcommand gets hidden copies of the
/// connection options: a global option is not copied into a subcommand
/// that has an argument of its id, so they stay out of its help.
fn command() -> clap::Command {
    use clap::{Args, CommandFactory};
    let nats: Vec<clap::Arg> = NatsArgs::augment_args(clap::Command::new("nats"))
        .get_arguments()
        .map(|a| a.clone().global(false).hide(true))
        .collect();
    let mut cmd = Cli::command();
    for [group, leaf] in OFFLINE {
        cmd = cmd.mut_subcommand(group, |g| {
            g.mut_subcommand(leaf, |l| l.args(nats.iter().cloned()))
        });
    }
    cmd
}

fn main() {
    restore_sigpipe();
    let matches = command().get_matches();
    let cli =
        <Cli as clap::FromArgMatches>::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let rt = tokio::runtime::Runtime::new().expect("tokio runtime");
    let code = rt.block_on(commands::run(cli));
    std::process::exit(code);
}
