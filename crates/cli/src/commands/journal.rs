//! `leasehold journal check --kind K`: before a rollout, replays the
//! recorded journals of K's active jobs against the new build of K, writing
//! nothing, and lists the jobs that would park with `journal_mismatch`.
//!
//! The kind's code is in a worker binary (a Rust kind) or behind a service
//! (a remote kind), not in this command: it runs that build's worker with
//! `--journal-check K` (`leasehold-worker` beside this command, or
//! `--worker PATH` for your own binary built on `leasehold::Worker`), with
//! this command's NATS settings, and passes its lines and exit code on.

use std::path::PathBuf;

use leasehold_store::NatsArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Subcommand, Debug)]
enum Cmd {
    /// Replay the journals of a kind's active jobs against a new build.
    ///
    /// Prints one JSON line per job with recorded steps: `{"id", "status",
    /// "steps", "verdict": "matches" | "mismatch" | "error", "next"?,
    /// "why"?}`. Exit 0: every journal matches; 1: a job would park with
    /// `journal_mismatch` (or its replay failed); 2: bad usage. Examples:
    ///
    ///   leasehold journal check --kind invoice --worker ./target/release/invoice-worker
    ///
    ///   leasehold journal check --kind invoice -- --remote-kind invoice=http://staging:8000
    Check(CheckArgs),
}

#[derive(clap::Args, Debug)]
struct CheckArgs {
    /// The kind whose jobs are checked.
    #[arg(long)]
    kind: String,
    /// The worker binary of the new build (default: `leasehold-worker`
    /// beside this command, for built-in and remote kinds).
    #[arg(long)]
    worker: Option<PathBuf>,
    /// More arguments for that worker (`--remote-kind K=URL` naming the
    /// new build's service), after `--`.
    #[arg(last = true)]
    worker_args: Vec<String>,
}

pub async fn run(args: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    match args.cmd {
        Cmd::Check(a) => check(a, nats).await,
    }
}

async fn check(a: CheckArgs, nats: &NatsArgs) -> anyhow::Result<i32> {
    let worker = match a.worker {
        Some(p) => p,
        None => {
            let me = std::env::current_exe()?;
            me.with_file_name("leasehold-worker")
        }
    };
    let mut cmd = tokio::process::Command::new(&worker);
    cmd.arg("--journal-check")
        .arg(&a.kind)
        .args(&a.worker_args)
        .env("NATS_URL", &nats.url)
        .env("LH_PREFIX", &nats.prefix);
    for (var, value) in [
        (
            "NATS_CREDS",
            nats.creds.as_ref().map(|p| p.display().to_string()),
        ),
        ("NATS_USER", nats.user.clone()),
        ("NATS_PASSWORD", nats.password.clone()),
        ("NATS_TOKEN", nats.token.clone()),
        ("NATS_CA", nats.ca.as_ref().map(|p| p.display().to_string())),
        (
            "NATS_CERT",
            nats.cert.as_ref().map(|p| p.display().to_string()),
        ),
        (
            "NATS_KEY",
            nats.key.as_ref().map(|p| p.display().to_string()),
        ),
    ] {
        if let Some(v) = value {
            cmd.env(var, v);
        }
    }
    let status = match cmd.status().await {
        Ok(s) => s,
        Err(e) => {
            eprintln!(
                "error: cannot run the worker {} ({e}); name your build's binary with --worker PATH",
                worker.display()
            );
            return Ok(2);
        }
    };
    Ok(status.code().unwrap_or(1))
}
