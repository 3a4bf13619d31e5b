//! `leasehold schedule add NAME --cron EXPR KIND SPEC | list | pause NAME |
//! resume NAME | remove NAME`: recurring schedules, kept in the KV bucket
//! `lh_schedules` and fired by every reaper at each tick's time (exactly
//! once per tick: see `leasehold_store::schedules`).
//!
//! The cron expression is standard 5-field cron in UTC (or 6 fields with
//! seconds first); SPEC is what `leasehold submit` takes (inline JSON,
//! `@FILE` or `-`) and is validated here with the workers' rules, so a bad
//! schedule is refused (exit 2) before it is stored.

use std::io::Read;
use std::time::SystemTime;

use anyhow::Context as _;
use leasehold_core::schedule::{self, Schedule};
use leasehold_core::spec::{self, Kinds, Submission};
use leasehold_core::time::rfc3339;
use leasehold_store::schedules::{Entry, ScheduleError, Schedules};
use leasehold_store::NatsArgs;

#[derive(clap::Args, Debug)]
pub struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Subcommand, Debug)]
enum Cmd {
    /// Add a schedule: every tick of --cron submits KIND SPEC as job `<NAME>-<tick unix seconds>`.
    Add {
        /// The schedule's name: 1-64 letters, digits, '-' or '_'.
        name: String,
        /// When: 5-field cron in UTC (`minute hour day-of-month month day-of-week`), or 6 fields with seconds first.
        #[arg(long)]
        cron: String,
        /// The job kind.
        kind: String,
        /// The spec: inline JSON, @FILE, or - for stdin.
        spec: String,
        #[command(flatten)]
        json: super::AlwaysJson,
    },
    /// The schedules, their next tick and the tick fired last.
    List {
        /// One JSON object per line instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Stop firing a schedule (kept; `resume` starts it again).
    Pause {
        name: String,
        #[command(flatten)]
        json: super::AlwaysJson,
    },
    /// Fire a paused schedule again, from its next tick.
    Resume {
        name: String,
        #[command(flatten)]
        json: super::AlwaysJson,
    },
    /// Remove a schedule.
    Remove {
        name: String,
        #[command(flatten)]
        json: super::AlwaysJson,
    },
}

fn read_spec(s: &str) -> anyhow::Result<Vec<u8>> {
    match s {
        "-" => {
            let mut b = Vec::new();
            std::io::stdin()
                .read_to_end(&mut b)
                .context("reading the spec from stdin")?;
            Ok(b)
        }
        s if s.starts_with('@') => {
            std::fs::read(&s[1..]).with_context(|| format!("reading {}", &s[1..]))
        }
        s => Ok(s.as_bytes().to_vec()),
    }
}

/// The schedule to store, or the one-line reason it is refused.
fn validate(name: &str, cron: &str, kind: &str, raw: &[u8]) -> Result<Entry, String> {
    if !schedule::valid_name(name) {
        return Err(format!(
            "invalid schedule name {name:?}: use 1-{} letters, digits, '-' or '_'",
            schedule::MAX_NAME_LEN
        ));
    }
    let now = SystemTime::now();
    Schedule::parse(cron, now)?;
    let sub = Submission {
        kind,
        payload: raw,
        // The id every tick's job will have (the same length for any tick).
        msg_id: Some(&schedule::job_id(name, now)),
        content_type: None,
        stream_seq: 0,
        received_at: now,
    };
    spec::decode(
        sub,
        &Kinds::default().with_open(kind),
        spec::DEFAULT_MAX_BYTES,
    )
    .map_err(|r| r.error.to_string())?;
    let value: serde_json::Value = serde_json::from_slice(raw).map_err(|e| e.to_string())?;
    if value.get("run_at").is_some_and(|v| !v.is_null()) {
        return Err(
            "run_at: a schedule's spec cannot name one time (use delay, or the cron)".into(),
        );
    }
    if value.get("id").is_some_and(|v| !v.is_null()) {
        return Err("id: a schedule names its jobs `<name>-<tick>`; leave id out".into());
    }
    let at = rfc3339(now);
    Ok(Entry {
        name: name.into(),
        cron: cron.trim().into(),
        kind: kind.into(),
        spec: value,
        paused: false,
        created_at: at.clone(),
        last_fired: None,
        last_job: None,
        skipped_through: None,
        updated_at: at,
    })
}

pub async fn run(args: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    // Bad input is refused before anything is asked of NATS.
    let entry = match &args.cmd {
        Cmd::Add {
            name,
            cron,
            kind,
            spec,
            ..
        } => {
            let raw = match read_spec(spec) {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("error: {e:#} (nothing was stored)");
                    return Ok(2);
                }
            };
            match validate(name, cron, kind, &raw) {
                Ok(e) => Some(e),
                Err(why) => {
                    eprintln!("error: {why} (nothing was stored)");
                    return Ok(2);
                }
            }
        }
        _ => None,
    };
    let conn = nats.connect("leasehold-cli schedule").await?;
    // A schedule of a kind that is not set up would fail at every tick.
    if let Some(e) = &entry {
        if let Ok(Some(set_up)) = leasehold_store::setup::kinds_set_up(&conn).await {
            if !set_up.contains(&e.kind) {
                eprintln!(
                    "error: kind {:?} is not set up (set up: {}); `leasehold setup --kinds {},{}` adds it (nothing was stored)",
                    e.kind,
                    set_up.join(", "),
                    set_up.join(","),
                    e.kind
                );
                return Ok(1);
            }
        }
    }
    let schedules = Schedules::open(&conn).await?;
    let done = |r: Result<(), ScheduleError>| -> anyhow::Result<i32> {
        match r {
            Ok(()) => Ok(0),
            Err(e @ (ScheduleError::NotFound(_) | ScheduleError::Exists(_))) => {
                eprintln!("error: {e}");
                Ok(1)
            }
            Err(e) => Err(e.into()),
        }
    };
    match args.cmd {
        Cmd::Add { name, .. } => {
            let e = entry.expect("validated");
            let r = schedules.create(&e).await.map(|_| ());
            if r.is_ok() {
                let next = Schedule::parse(&e.cron, SystemTime::now())
                    .ok()
                    .and_then(|s| s.next_after(SystemTime::now()))
                    .map(rfc3339)
                    .unwrap_or_default();
                eprintln!("schedule {name} added; next tick {next}");
                println!(
                    "{}",
                    serde_json::json!({"name": name, "state": "added", "next": next})
                );
            }
            done(r)
        }
        Cmd::Pause { name, .. } => done(
            schedules
                .modify(&name, |e| e.paused = true)
                .await
                .map(|_| said(&name, "paused")),
        ),
        Cmd::Resume { name, .. } => done(
            schedules
                .modify(&name, |e| {
                    // From its next tick: the ticks missed while paused
                    // are not fired.
                    e.paused = false;
                    e.last_fired = Some(rfc3339(SystemTime::now()));
                })
                .await
                .map(|_| said(&name, "resumed")),
        ),
        Cmd::Remove { name, .. } => done(
            schedules
                .remove(&name)
                .await
                .map(|_| said(&name, "removed")),
        ),
        Cmd::List { json } => {
            let now = SystemTime::now();
            let all = schedules.list().await?;
            if !json {
                println!(
                    "{:<24} {:<20} {:<10} {:<7} {:<24} LAST FIRED",
                    "NAME", "CRON", "KIND", "STATE", "NEXT"
                );
            }
            for (e, _) in all {
                let next = Schedule::parse(&e.cron, now)
                    .ok()
                    .and_then(|s| s.next_after(now))
                    .map(rfc3339);
                if json {
                    let mut v = serde_json::to_value(&e)?;
                    v["next"] = next.into();
                    println!("{v}");
                } else {
                    println!(
                        "{:<24} {:<20} {:<10} {:<7} {:<24} {}",
                        e.name,
                        e.cron,
                        e.kind,
                        if e.paused { "paused" } else { "active" },
                        if e.paused {
                            "-".into()
                        } else {
                            next.unwrap_or_default()
                        },
                        e.last_fired.as_deref().unwrap_or("-")
                    );
                }
            }
            Ok(0)
        }
    }
}

/// What a schedule command did: a message on stderr, the data on stdout.
fn said(name: &str, state: &str) {
    eprintln!("schedule {name} {state}");
    println!("{}", serde_json::json!({"name": name, "state": state}));
}
