//! `leasehold watch ID [--json] [--timeout D] [--wait-for-id]`: follow a
//! job live until it is terminal (or parked); an unknown id is refused
//! (exit 1) unless `--wait-for-id`.
//!
//! It says why the job waits (queued behind N tickets of its kind, in
//! backoff until a time, a model retry or an open breaker, parked with its
//! reason), its failed attempts and last error, and a research job's
//! sections. On a terminal the current state is one live line (a progress
//! bar only for jobs that report sections); off a terminal (CI logs, a
//! pipe) it prints one plain, timestamped line per change, without spinner
//! or escape codes. It ends with one summary line saying how the job ended,
//! how long it took and what to run next. Exit 0 when it completed, 1 when
//! it ended otherwise, 124 when the timeout passed first, 130 on Ctrl-C
//! (the terminal restored); the job goes on in both of the last cases.

use std::io::{IsTerminal, Write};
use std::time::{Duration, SystemTime};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use leasehold_core::retry::Backoff;
use leasehold_core::time::{human_duration, parse_rfc3339, rfc3339};
use leasehold_core::{JobRecord, Status};
use leasehold_store::events::Events;
use leasehold_store::{Conn, Jobs, NatsArgs};
use serde_json::Value;

#[derive(clap::Args, Debug)]
pub struct Args {
    /// The job id.
    id: String,
    /// Print every revision of the record as one JSON line (for scripts).
    #[arg(long)]
    json: bool,
    /// Stop waiting after this long (e.g. 30s, 10m); the job is not affected.
    #[arg(long, value_parser = leasehold_core::time::parse_duration)]
    timeout: Option<std::time::Duration>,
    /// Wait for a job that has no record yet (one about to be submitted)
    /// instead of refusing an unknown id.
    #[arg(long)]
    wait_for_id: bool,
}

/// Exit code when a wait's timeout passed before the job ended (as timeout(1)).
pub const TIMED_OUT: i32 = 124;

/// Exit code after Ctrl-C (SIGINT), as shells report it: 128 + 2.
pub const INTERRUPTED: i32 = 130;

/// How often the job's last `retry` event and its queue are looked at
/// while it is followed (the record itself is followed revision by
/// revision).
const LOOK_EVERY: Duration = Duration::from_millis(500);

/// How long one look at the work queue may take: a user that may not read
/// the work stream's info (a submitter) is refused by a timeout, and the
/// queue is then left out of the lines.
const QUEUE_PATIENCE: Duration = Duration::from_millis(800);

pub async fn run(a: Args, nats: &NatsArgs) -> anyhow::Result<i32> {
    let conn = nats.connect("leasehold-cli watch").await?;
    let jobs = super::open_jobs(&conn).await?;
    if !a.wait_for_id && jobs.get(&a.id).await?.is_none() {
        eprintln!(
            "error: no job {}; `leasehold list` shows the active jobs (a job submitted while no worker runs, by a user that may not write records, gets its record when a worker takes it: `--wait-for-id` waits for it)",
            a.id
        );
        return Ok(1);
    }
    if a.json {
        let Some(rec) = follow_for(&jobs, &a.id, true, a.timeout).await? else {
            return Ok(TIMED_OUT);
        };
        return Ok(exit_code(&rec));
    }
    let mut screen = Screen::new(std::io::stdout().is_terminal());
    let live = live(&conn, &jobs, &a.id, &mut screen);
    let ended = tokio::select! {
        r = with_timeout(a.timeout, live) => r?,
        _ = tokio::signal::ctrl_c() => Ended::Interrupted,
    };
    screen.restore();
    match ended {
        Ended::Done(rec) => {
            println!("{}", summary(&rec));
            Ok(exit_code(&rec))
        }
        Ended::TimedOut(t) => {
            timed_out(&jobs, &a.id, t).await?;
            Ok(TIMED_OUT)
        }
        Ended::Interrupted => {
            eprintln!(
                "interrupted; job {} goes on: follow it again with `leasehold watch {}`",
                a.id, a.id
            );
            Ok(INTERRUPTED)
        }
    }
}

/// How a live watch stopped.
enum Ended {
    Done(Box<JobRecord>),
    TimedOut(Duration),
    Interrupted,
}

async fn with_timeout(
    timeout: Option<Duration>,
    fut: impl std::future::Future<Output = anyhow::Result<JobRecord>>,
) -> anyhow::Result<Ended> {
    match timeout {
        None => fut.await.map(|r| Ended::Done(Box::new(r))),
        Some(t) => match tokio::time::timeout(t, fut).await {
            Ok(r) => r.map(|r| Ended::Done(Box::new(r))),
            Err(_) => Ok(Ended::TimedOut(t)),
        },
    }
}

/// 0 for a completed job, 1 for any other end.
fn exit_code(rec: &JobRecord) -> i32 {
    if rec.status == "completed" {
        0
    } else {
        1
    }
}

fn terminal(r: &JobRecord) -> bool {
    r.status
        .parse::<Status>()
        .is_ok_and(|s| s.is_terminal() || s == Status::Parked)
}

/// Like [`follow`], giving up after `timeout` (then `None`, with a message
/// saying how to keep following).
pub async fn follow_for(
    jobs: &Jobs,
    id: &str,
    json: bool,
    timeout: Option<std::time::Duration>,
) -> anyhow::Result<Option<JobRecord>> {
    let Some(t) = timeout else {
        return follow(jobs, id, json).await.map(Some);
    };
    match tokio::time::timeout(t, follow(jobs, id, json)).await {
        Ok(rec) => rec.map(Some),
        Err(_) => {
            timed_out(jobs, id, t).await?;
            Ok(None)
        }
    }
}

/// Says that the wait ended before the job, and how to keep following it.
async fn timed_out(jobs: &Jobs, id: &str, t: Duration) -> anyhow::Result<()> {
    let status = jobs
        .get(id)
        .await?
        .map(|v| v.value.status)
        .unwrap_or_else(|| "not picked up yet".into());
    eprintln!(
        "job {id} is still {status} after {}; it goes on: follow it with `leasehold watch {id}`",
        leasehold_core::time::format_duration(t)
    );
    Ok(())
}

/// Follows the record until it is terminal (or parked) and returns it,
/// printing each revision as one JSON line when `json`, else nothing.
///
/// Each revision is read with a direct get of the next one after the last
/// seen, polling while there is none: no consumer is created, so a
/// submitter's NATS user (which may create none) can follow a job. A job
/// that has no record yet is waited for.
pub async fn follow(jobs: &Jobs, id: &str, json: bool) -> anyhow::Result<JobRecord> {
    let mut revisions = Revisions::start(jobs, id).await?;
    loop {
        let rec = revisions.next(jobs).await?;
        if json {
            println!("{}", serde_json::to_string(&rec)?);
        }
        if terminal(&rec) {
            return Ok(rec);
        }
    }
}

/// The record's revisions one after another, from the current one on
/// (older ones are history), polled with a growing pause while there is
/// no newer one.
struct Revisions {
    id: String,
    after: u64,
}

impl Revisions {
    const FIRST_POLL: Duration = Duration::from_millis(20);
    const LAST_POLL: Duration = Duration::from_millis(500);

    async fn start(jobs: &Jobs, id: &str) -> anyhow::Result<Self> {
        let after = match jobs.get(id).await? {
            Some(v) => v.revision - 1,
            None => jobs.opened_at(),
        };
        Ok(Revisions {
            id: id.to_string(),
            after,
        })
    }

    /// The next revision, waiting for it.
    async fn next(&mut self, jobs: &Jobs) -> anyhow::Result<JobRecord> {
        let mut pause = Backoff::new(Self::FIRST_POLL, Self::LAST_POLL);
        loop {
            if let Some(rec) = self.poll(jobs).await? {
                return Ok(rec);
            }
            tokio::time::sleep(pause.pause()).await;
        }
    }

    /// The next revision if there is one now.
    async fn poll(&mut self, jobs: &Jobs) -> anyhow::Result<Option<JobRecord>> {
        loop {
            let Some((seq, rec)) = jobs.revision_after(&self.id, self.after).await? else {
                return Ok(None);
            };
            self.after = seq;
            // A removal marker (a reused id's earlier job): look further.
            if let Some(rec) = rec {
                return Ok(Some(rec));
            }
        }
    }
}

/// Follows the job, showing each change on `screen`, until it is terminal
/// or parked; returns its last record.
async fn live(
    conn: &Conn,
    jobs: &Jobs,
    id: &str,
    screen: &mut Screen,
) -> anyhow::Result<JobRecord> {
    let events = Events::new(conn);
    let mut revisions = Revisions::start(jobs, id).await?;
    let mut seen = Seen::default();
    let mut queue_readable = true;
    let mut signals_readable = true;
    let polls = || Backoff::new(Revisions::FIRST_POLL, Revisions::LAST_POLL);
    let mut pause = polls();
    let mut next_look = tokio::time::Instant::now();
    loop {
        if let Some(rec) = revisions.poll(jobs).await? {
            pause = polls();
            if terminal(&rec) {
                return Ok(rec);
            }
            seen.rec = Some(rec);
        } else if tokio::time::Instant::now() >= next_look {
            next_look = tokio::time::Instant::now() + LOOK_EVERY;
            // What the record does not say: best effort, as the user may
            // read it (a submitter may not read the work stream's info).
            if let Ok(Some((_, ev))) = events.last_of_type(id, "retry").await {
                seen.model_retry =
                    ModelRetry::of(&ev.data, &ev.at).filter(|r| r.is_current(SystemTime::now()));
            }
            seen.queue = None;
            seen.children_left = None;
            if let Some((rec, ends)) = seen.rec.as_ref().and_then(|r| {
                leasehold_core::machine::children_of(r)
                    .filter(|_| r.status == "waiting" && signals_readable)
                    .map(|e| (r, e))
            }) {
                let signals = leasehold_store::signals::Signals::new(conn);
                match tokio::time::timeout(
                    QUEUE_PATIENCE,
                    leasehold_store::children::announced(&signals, &rec.id),
                )
                .await
                {
                    Ok(Ok(n)) => seen.children_left = Some(ends.saturating_sub(n)),
                    _ => signals_readable = false,
                }
            }
            if let Some(rec) = seen
                .rec
                .as_ref()
                .filter(|r| queue_readable && waits_its_turn(r))
            {
                match tokio::time::timeout(
                    QUEUE_PATIENCE,
                    leasehold_store::setup::tickets_of_kind(conn, &rec.kind),
                )
                .await
                {
                    Ok(Ok(n)) => seen.queue = Some(n),
                    _ => queue_readable = false,
                }
            }
        } else {
            tokio::time::sleep(pause.pause()).await;
        }
        if let Some(rec) = &seen.rec {
            screen.show(rec, &describe(&seen));
        }
    }
}

/// What the watch knows of the job besides its record.
#[derive(Default)]
struct Seen {
    rec: Option<JobRecord>,
    /// The job's last generation-level retry (`retry` event of scope
    /// `generation`, `warm` or `cold`), when its events say one.
    model_retry: Option<ModelRetry>,
    /// Tickets of the job's kind in the work queue, when it waits its
    /// turn and the user may read the work stream's info.
    queue: Option<u64>,
    /// How many of the children a waiting parent joins have still to end,
    /// when the user may read the signal stream's info.
    children_left: Option<u64>,
}

/// A model (generation) retry as its `retry` event tells it.
#[derive(Debug, Clone, PartialEq)]
struct ModelRetry {
    scope: String,
    class: Option<String>,
    reason: String,
    attempt: u64,
    delay_ms: Option<u64>,
    /// When the event was written.
    at: Option<SystemTime>,
}

/// How long past its wait a model retry is still shown: the call it
/// retried is then under way again, or done.
const RETRY_SHOWN_FOR: Duration = Duration::from_secs(2);

impl ModelRetry {
    /// The retry in a `retry` event's data; `None` for a job-level retry
    /// (the record says it better) or unreadable data.
    fn of(data: &str, at: &str) -> Option<ModelRetry> {
        let v: Value = serde_json::from_str(data).ok()?;
        let scope = v.get("scope")?.as_str()?.to_string();
        if scope == "job" {
            return None;
        }
        Some(ModelRetry {
            scope,
            class: v.get("class").and_then(Value::as_str).map(str::to_string),
            reason: v
                .get("reason")
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_string(),
            attempt: v.get("attempt").and_then(Value::as_u64).unwrap_or(0),
            delay_ms: v.get("delay_ms").and_then(Value::as_u64),
            at: parse_rfc3339(at),
        })
    }

    /// Whether the retry still explains the job's state at `now`: its wait
    /// (`delay_ms`) and [`RETRY_SHOWN_FOR`] have not passed since it was
    /// written (a retry without a time is not shown).
    fn is_current(&self, now: SystemTime) -> bool {
        let wait = Duration::from_millis(self.delay_ms.unwrap_or(0)) + RETRY_SHOWN_FOR;
        self.at.is_some_and(|at| at + wait > now)
    }

    /// `model breaker open (circuit open for ...)`, `provider cooldown
    /// 3s (rate_limited: ...)`, or `model retry 2 (server_error: ...)`.
    fn describe(&self) -> String {
        let class = self.class.as_deref().unwrap_or(&self.scope);
        let why = if self.reason.is_empty() {
            class.to_string()
        } else if self.reason.starts_with(class) {
            self.reason.clone()
        } else {
            format!("{class}: {}", self.reason)
        };
        if self.reason.starts_with("waiting for provider ") {
            // Flow control's pause: the fleet's cooldown or open breaker.
            return self.reason.clone();
        }
        match (class, self.delay_ms) {
            ("circuit_open", _) => format!("model breaker open ({})", self.reason),
            ("rate_limited" | "quota_exhausted" | "overloaded", Some(ms)) => format!(
                "provider cooldown {} ({why})",
                human_duration(Duration::from_millis(ms))
            ),
            _ => format!("model retry {} ({why})", self.attempt),
        }
    }
}

/// Whether the job waits for a worker to take its ticket: queued and due.
fn waits_its_turn(rec: &JobRecord) -> bool {
    rec.status == "queued" && in_backoff(rec, SystemTime::now()).is_none()
}

/// When a queued job's backoff ends, if it is still to come at `now`.
fn in_backoff(rec: &JobRecord, now: SystemTime) -> Option<SystemTime> {
    if rec.status != "queued" {
        return None;
    }
    rec.next_run_at
        .as_deref()
        .and_then(parse_rfc3339)
        .filter(|t| *t > now)
}

/// The job's state in one line, without the time (so the line changes only
/// when the job does): why it waits or where it runs, its failed attempts,
/// the last error, a model retry in progress.
fn describe(seen: &Seen) -> String {
    let Some(rec) = &seen.rec else {
        return "no record yet".into();
    };
    let mut parts = vec![state_of(rec, seen.queue)];
    if let Some(n) = seen.children_left.filter(|_| rec.status == "waiting") {
        parts.push(format!(
            "{n} child{} still to end",
            if n == 1 { "" } else { "ren" }
        ));
    }
    if let Some(p) = rec.progress.as_ref().filter(|p| p.sections_total > 0) {
        parts.push(format!(
            "{}/{} sections{}",
            p.sections_done,
            p.sections_total,
            if p.skipped > 0 {
                format!(", {} skipped", p.skipped)
            } else {
                String::new()
            }
        ));
    }
    if rec.attempts > 0 {
        parts.push(format!(
            "{} failed attempt{}",
            rec.attempts,
            if rec.attempts == 1 { "" } else { "s" }
        ));
    }
    if rec.stale_reclaims > 0 {
        parts.push(format!("owner lost {}x", rec.stale_reclaims));
    }
    if let Some(e) = rec.error.as_ref().filter(|_| rec.status != "parked") {
        parts.push(format!("last error {}: {}", e.class, e.message));
    }
    if rec.status == "running" {
        if let Some(r) = &seen.model_retry {
            parts.push(r.describe());
        }
    }
    parts.join("; ")
}

/// Why the job waits, or where it runs.
fn state_of(rec: &JobRecord, queue: Option<u64>) -> String {
    match rec.status.as_str() {
        "queued" => {
            if let Some(t) = in_backoff(rec, SystemTime::now()) {
                return format!("queued: backoff until {}", rfc3339(t));
            }
            match queue {
                // Its own ticket is one of them.
                Some(n) => format!(
                    "queued behind {} ticket{} of kind {}",
                    n.saturating_sub(1),
                    if n == 2 { "" } else { "s" },
                    rec.kind
                ),
                None => format!("queued (kind {})", rec.kind),
            }
        }
        "running" => {
            let mut s = format!(
                "running on {} (epoch {})",
                rec.worker_id.as_deref().unwrap_or("?"),
                rec.epoch
            );
            if let Some(p) = rec.progress.as_ref().filter(|p| !p.phase.is_empty()) {
                s.push_str(&format!(", phase {}", p.phase));
            }
            if rec.cancel_requested {
                s.push_str(", cancel requested");
            }
            s
        }
        "parked" => parked_line(rec),
        "waiting" => waiting_line(rec),
        other => other.to_string(),
    }
}

/// `waiting for time until <t> (<step>), held by no worker`.
fn waiting_line(rec: &JobRecord) -> String {
    let line = format!(
        "waiting {}, held by no worker",
        leasehold_core::machine::waits_for(rec)
    );
    if let Some((name, _)) = leasehold_core::machine::signal_of(rec) {
        return format!("{line}; `leasehold signal {} {name}` sends it", rec.id);
    }
    if leasehold_core::machine::children_of(rec).is_some() {
        return format!(
            "{line}; `leasehold events {} --children` lists them",
            rec.id
        );
    }
    line
}

/// `parked: <reason>: <message>`.
fn parked_line(rec: &JobRecord) -> String {
    let reason = rec.parked_reason.as_deref().unwrap_or("no reason recorded");
    match &rec.error {
        Some(e) if !e.message.is_empty() => format!("parked: {reason}: {}", e.message),
        _ => format!("parked: {reason}"),
    }
}

/// How long the job took, from its submission to its last write.
fn took(rec: &JobRecord) -> Option<Duration> {
    let start = parse_rfc3339(&rec.created_at)?;
    let end = parse_rfc3339(&rec.updated_at)?;
    end.duration_since(start).ok()
}

/// What to run next for a job that ended this way.
fn hint(rec: &JobRecord) -> String {
    match rec.status.as_str() {
        "parked" => "leasehold review list".into(),
        "dead" | "rejected" => "leasehold dlq list".into(),
        _ => format!("leasehold result {}", rec.id),
    }
}

/// The closing line: `r1 completed in 3.2s: 16/16 sections, 0 skipped →
/// leasehold result r1`, or for another end its class, message, duration
/// and what to run next.
fn summary(rec: &JobRecord) -> String {
    let when = took(rec)
        .map(|d| format!(" in {}", human_duration(d)))
        .unwrap_or_default();
    let mut s = match rec.status.as_str() {
        "completed" => {
            let mut s = format!("{} completed{when}", rec.id);
            if let Some(p) = rec.progress.as_ref().filter(|p| p.sections_total > 0) {
                s.push_str(&format!(
                    ": {}/{} sections, {} skipped",
                    p.sections_done, p.sections_total, p.skipped
                ));
            }
            if rec.attempts > 0 {
                s.push_str(&format!(
                    " after {} failed attempt{}",
                    rec.attempts,
                    if rec.attempts == 1 { "" } else { "s" }
                ));
            }
            s
        }
        "parked" => match took(rec) {
            Some(d) => format!(
                "{} {} (after {})",
                rec.id,
                parked_line(rec),
                human_duration(d)
            ),
            None => format!("{} {}", rec.id, parked_line(rec)),
        },
        status => match &rec.error {
            Some(e) => format!("{} {status}{when}: {}: {}", rec.id, e.class, e.message),
            None => format!("{} {status}{when}", rec.id),
        },
    };
    s.push_str(&format!(" → {}", hint(rec)));
    s
}

/// Where the live lines go: one redrawn line on a terminal, plain
/// timestamped lines otherwise.
struct Screen {
    bar: Option<ProgressBar>,
    sections: bool,
    last: String,
}

impl Screen {
    fn new(tty: bool) -> Screen {
        let bar = tty.then(|| {
            let b = ProgressBar::with_draw_target(None, ProgressDrawTarget::stdout());
            b.set_style(Self::style(false));
            b.enable_steady_tick(Duration::from_millis(200));
            b
        });
        Screen {
            bar,
            sections: false,
            last: String::new(),
        }
    }

    fn style(sections: bool) -> ProgressStyle {
        let t = if sections {
            "{spinner} {msg} [{bar:30}]"
        } else {
            "{spinner} {msg}"
        };
        ProgressStyle::with_template(t)
            .expect("template")
            .progress_chars("=> ")
    }

    /// Shows `line` for `rec` if it differs from the last one shown.
    fn show(&mut self, rec: &JobRecord, line: &str) {
        let line = format!("{} {line}", rec.id);
        if line == self.last {
            return;
        }
        match &self.bar {
            None => {
                println!("{} {line}", rfc3339(SystemTime::now()));
                let _ = std::io::stdout().flush();
            }
            Some(bar) => {
                // A bar only for jobs that report sections.
                let p = rec.progress.clone().unwrap_or_default();
                let sections = p.sections_total > 0;
                if sections != self.sections {
                    self.sections = sections;
                    bar.set_style(Self::style(sections));
                }
                if sections {
                    bar.set_length(u64::from(p.sections_total));
                    bar.set_position(u64::from(p.sections_done));
                }
                bar.set_message(line.clone());
            }
        }
        self.last = line;
    }

    /// Clears the live line and shows the cursor again.
    fn restore(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
            let mut out = std::io::stdout();
            let _ = out.write_all(b"\x1b[?25h");
            let _ = out.flush();
        }
    }
}

impl Drop for Screen {
    fn drop(&mut self) {
        self.restore();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use leasehold_proto::{JobError, Progress};

    fn rec(status: &str) -> JobRecord {
        JobRecord {
            id: "r1".into(),
            kind: "fail".into(),
            status: status.into(),
            created_at: "2026-12-01T10:00:00.000Z".into(),
            updated_at: "2026-12-01T10:00:03.200Z".into(),
            ..Default::default()
        }
    }

    #[test]
    fn a_completed_research_job_sums_up_its_sections() {
        let mut r = rec("completed");
        r.progress = Some(Progress {
            phase: "delivered".into(),
            sections_done: 16,
            sections_total: 16,
            skipped: 0,
        });
        assert_eq!(
            summary(&r),
            "r1 completed in 3.2s: 16/16 sections, 0 skipped → leasehold result r1"
        );
    }

    #[test]
    fn a_job_without_sections_shows_no_section_count() {
        let r = rec("completed");
        assert_eq!(summary(&r), "r1 completed in 3.2s → leasehold result r1");
        let mut r = rec("running");
        r.worker_id = Some("w1".into());
        r.epoch = 1;
        r.progress = Some(Progress::default());
        let line = describe(&Seen {
            rec: Some(r),
            ..Default::default()
        });
        assert_eq!(line, "running on w1 (epoch 1)");
    }

    #[test]
    fn a_failure_names_class_message_duration_and_next_step() {
        let mut r = rec("failed");
        r.attempts = 3;
        r.error = Some(JobError {
            class: "exhausted".into(),
            message: "boom".into(),
            at: String::new(),
        });
        assert_eq!(
            summary(&r),
            "r1 failed in 3.2s: exhausted: boom → leasehold result r1"
        );
        r.status = "dead".into();
        assert!(summary(&r).ends_with("→ leasehold dlq list"));
    }

    #[test]
    fn a_waiting_job_says_for_what_until_when_and_which_step() {
        let mut r = rec("waiting");
        r.waiting_for = Some("time".into());
        r.next_run_at = Some("2026-12-06T10:00:00Z".into());
        r.waiting_step = Some("sleep#0".into());
        assert_eq!(
            state_of(&r, Some(3)),
            "waiting for time until 2026-12-06T10:00:00Z (sleep#0), held by no worker"
        );
    }

    #[test]
    fn a_parked_job_says_why() {
        let mut r = rec("parked");
        r.parked_reason = Some("refusal".into());
        r.error = Some(JobError {
            class: "parked".into(),
            message: "the model refused".into(),
            at: String::new(),
        });
        assert_eq!(
            summary(&r),
            "r1 parked: refusal: the model refused (after 3.2s) → leasehold review list"
        );
    }

    #[test]
    fn a_waiting_job_says_what_it_waits_for() {
        let mut r = rec("queued");
        assert_eq!(
            state_of(&r, Some(4)),
            "queued behind 3 tickets of kind fail"
        );
        assert_eq!(state_of(&r, Some(2)), "queued behind 1 ticket of kind fail");
        assert_eq!(state_of(&r, None), "queued (kind fail)");
        r.next_run_at = Some(rfc3339(SystemTime::now() + Duration::from_secs(60)));
        assert!(state_of(&r, Some(4)).starts_with("queued: backoff until "));
        r.attempts = 1;
        r.error = Some(JobError {
            class: "retryable".into(),
            message: "injected failure 1 of 2".into(),
            at: String::new(),
        });
        let line = describe(&Seen {
            rec: Some(r),
            ..Default::default()
        });
        assert!(
            line.ends_with("; 1 failed attempt; last error retryable: injected failure 1 of 2"),
            "{line}"
        );
    }

    #[test]
    fn a_parent_waiting_for_its_children_says_so() {
        let mut r = rec("waiting");
        r.waiting_for = Some("children".into());
        r.waiting_step = Some("join#0".into());
        r.waiting_after = 3;
        assert_eq!(
            waiting_line(&r),
            format!(
                "waiting for its children (join#0), held by no worker; `leasehold events {} --children` lists them",
                r.id
            )
        );
    }

    #[test]
    fn model_retries_read_from_retry_events() {
        let at = "2026-12-01T10:00:00.000Z";
        let job = ModelRetry::of(r#"{"scope":"job","reason":"x","attempt":1}"#, at);
        assert_eq!(job, None, "a job retry is the record's to tell");
        let cool = ModelRetry::of(
            r#"{"scope":"generation","reason":"HTTP 429","class":"rate_limited","attempt":2,"delay_ms":3000}"#,
            at,
        )
        .unwrap();
        assert_eq!(
            cool.describe(),
            "provider cooldown 3s (rate_limited: HTTP 429)"
        );
        let open = ModelRetry::of(
            r#"{"scope":"generation","reason":"circuit open for model","class":"circuit_open","attempt":1}"#,
            at,
        )
        .unwrap();
        assert_eq!(
            open.describe(),
            "model breaker open (circuit open for model)"
        );
        let other = ModelRetry::of(
            r#"{"scope":"warm","reason":"reset","class":"connection_reset","attempt":2}"#,
            at,
        )
        .unwrap();
        assert_eq!(other.describe(), "model retry 2 (connection_reset: reset)");
        let t0 = parse_rfc3339(at).unwrap();
        // Shown during its 3 s wait and 2 s after, then no longer.
        assert!(cool.is_current(t0 + Duration::from_secs(4)));
        assert!(!cool.is_current(t0 + Duration::from_secs(6)));
        assert!(!other.is_current(t0 + Duration::from_secs(3)));
        let dup = ModelRetry::of(
            r#"{"scope":"generation","reason":"rate_limited: HTTP 429","class":"rate_limited","attempt":1,"delay_ms":1000}"#,
            at,
        )
        .unwrap();
        assert_eq!(
            dup.describe(),
            "provider cooldown 1s (rate_limited: HTTP 429)"
        );
        // Flow control's pause says which provider and until when.
        let fleet = ModelRetry::of(
            r#"{"scope":"generation","reason":"waiting for provider http://127.0.0.1:8089/v1 sim-1 until 2026-12-01T10:00:03.000Z (cooldown: rate_limited: HTTP 429)","class":"rate_limited","attempt":1,"delay_ms":3000}"#,
            at,
        )
        .unwrap();
        assert_eq!(
            fleet.describe(),
            "waiting for provider http://127.0.0.1:8089/v1 sim-1 until 2026-12-01T10:00:03.000Z (cooldown: rate_limited: HTTP 429)"
        );
        assert!(fleet.is_current(t0 + Duration::from_secs(4)));
    }
}
