//! `leasehold transcript repair`: the warm-retry sanitation of a tool-calling
//! transcript, as a filter.
//!
//! Input: an OpenAI-format message array on stdin (or `--input FILE`).
//! Output: the repaired messages on stdout, the same format; a report of what
//! was kept and dropped, and why, on stderr (`--report-json` makes it JSON).
//! Exit codes: 0 a warm retry can continue the thread, 3 only a cold retry
//! can, 2 the input is unreadable.

use std::io::Read;
use std::path::PathBuf;

use leasehold_store::NatsArgs;
use leasehold_transcript::{last_user_prompt, parse_messages, sanitize, Verdict};

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Subcommand, Debug)]
enum Cmd {
    /// Keep the longest valid prefix for a warm retry (stdin → stdout).
    ///
    /// Keeps everything through the latest exact section prompt, then only
    /// complete assistant-tool-call + all-results groups; stops at the first
    /// incomplete or unexpected message. Exit 0: warm retry possible; 3: only
    /// a cold retry; 2: unreadable input.
    Repair(RepairArgs),
}

#[derive(clap::Args, Debug)]
struct RepairArgs {
    /// The section prompt (default: the last user message).
    #[arg(long)]
    section_prompt: Option<String>,
    /// Print the report on stderr as JSON instead of text.
    #[arg(long, visible_alias = "json")]
    report_json: bool,
    /// Read the messages from this file instead of stdin.
    #[arg(long, short)]
    input: Option<PathBuf>,
}

pub async fn run(args: Args, _nats: &NatsArgs) -> anyhow::Result<i32> {
    match args.cmd {
        Cmd::Repair(a) => repair(a),
    }
}

fn repair(a: RepairArgs) -> anyhow::Result<i32> {
    let mut text = String::new();
    let read = match &a.input {
        Some(p) => std::fs::read_to_string(p).map(|t| text = t),
        None => std::io::stdin().read_to_string(&mut text).map(|_| ()),
    };
    if let Err(e) = read {
        eprintln!("error: cannot read the transcript: {e}");
        return Ok(2);
    }
    let messages = match parse_messages(&text) {
        Ok(m) => m,
        Err(e) => {
            eprintln!("error: {e}\nhint: the input must be a JSON array of OpenAI chat messages");
            return Ok(2);
        }
    };
    let prompt = a
        .section_prompt
        .clone()
        .or_else(|| last_user_prompt(&messages).map(str::to_string))
        .unwrap_or_default();
    let repair = sanitize(&messages, &prompt);
    println!("{}", serde_json::to_string_pretty(&repair.messages)?);
    if a.report_json {
        eprintln!("{}", serde_json::to_string_pretty(&repair.report)?);
    } else {
        eprint!("{}", repair.report.human());
    }
    Ok(match repair.report.verdict {
        Verdict::Warm => 0,
        Verdict::ColdOnly => 3,
    })
}
