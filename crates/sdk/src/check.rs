//! Safe deploys of changed code: [`Worker::journal_check`] replays the
//! recorded journals of a kind's active jobs against this build, writing
//! nothing, and says which would park with `journal_mismatch`.
//!
//! Each job runs in a dry [`Ctx`]: a recorded step returns its recorded
//! result; the first step past the journal (or the first op a remote
//! kind's service answers past it) ends the run there, never run. Nothing
//! is written on the way: the run's owner is nobody (every owner write is
//! refused by the record, every event by the server's fence), and no step,
//! tool, model call or child is started.

use std::sync::Arc;
use std::time::Duration;

use leasehold_core::machine::Owner;
use leasehold_store::events::{Events, Fence};
use leasehold_store::index::{Active, Filter};
use leasehold_store::{Gate, Jobs};
use leasehold_worker::JobCtx;
use serde::Serialize;
use serde_json::Value;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

use crate::{Ctx, Error, Worker};

/// How long one job's replay may take.
const REPLAY_WITHIN: Duration = Duration::from_secs(30);

/// What replaying one job's journal against this build found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JournalCheck {
    /// The job's id.
    pub id: String,
    /// Its status now.
    pub status: String,
    /// Steps its journal recorded.
    pub steps: usize,
    /// `matches`, `mismatch` or `error`.
    pub verdict: JournalVerdict,
    /// A matching journal: the step this build runs next (`None`: it would
    /// finish without another step).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
    /// Why it does not match (what `journal_mismatch` would say), or why
    /// its replay failed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
}

/// The verdict on one journal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum JournalVerdict {
    /// This build replays the journal as recorded.
    Matches,
    /// This build asks for other steps: the job would park with
    /// `journal_mismatch`.
    Mismatch,
    /// The replay failed otherwise (the code raised an error on recorded
    /// results, or took longer than 30 s to reach its next step).
    Error,
}

impl JournalCheck {
    /// Whether this build may run the job on.
    pub fn matches(&self) -> bool {
        self.verdict == JournalVerdict::Matches
    }
}

impl Worker {
    /// Replays the recorded journals of `kind`'s active jobs (running,
    /// queued, waiting, parked) against this build, writing nothing: one
    /// [`JournalCheck`] per job with recorded steps. What `--journal-check KIND`
    /// prints; call it in a test to know, before a rollout, which jobs the
    /// changed code would park.
    ///
    /// ```no_run
    /// # struct Invoice;
    /// # #[leasehold::async_trait]
    /// # impl leasehold::Kind for Invoice {
    /// #     async fn run(&self, _: &leasehold::Ctx) -> Result<serde_json::Value, leasehold::Error> { todo!() }
    /// # }
    /// # async fn f() -> anyhow::Result<()> {
    /// let checked = leasehold::Worker::from_env()
    ///     .kind("invoice", Invoice)
    ///     .journal_check("invoice")
    ///     .await?;
    /// assert!(checked.iter().all(|c| c.matches()), "{checked:?}");
    /// # Ok(()) }
    /// ```
    pub async fn journal_check(self, kind: &str) -> anyhow::Result<Vec<JournalCheck>> {
        let (opts, kinds) = self.resolve()?;
        let Some((_, handler)) = kinds.into_iter().find(|(n, _)| n == kind) else {
            anyhow::bail!("no kind `{kind}` in this build: register it (Worker::kind) or name its service (--remote-kind {kind}=URL)");
        };
        let conn = opts.nats.connect("journal-check").await?;
        let jobs = Jobs::open(&conn).await?;
        let events = Events::new(&conn);
        let active = Active::open(&conn).await?;
        let mut ids: Vec<String> = active
            .list(Filter::All)
            .await?
            .into_iter()
            .filter(|(_, e)| e.kind == kind)
            .map(|(_, e)| e.job)
            .collect();
        ids.sort();
        ids.dedup();
        let mut out = Vec::new();
        for id in ids {
            let Some(rec) = jobs.get(&id).await?.map(|v| v.value) else {
                continue;
            };
            let steps = events.read_types(&id, &["step"]).await?.len();
            if steps == 0 {
                // Nothing recorded: any build starts it afresh.
                continue;
            }
            let input: Value = rec
                .spec
                .as_ref()
                .and_then(|s| serde_json::from_str(&s.input).ok())
                .unwrap_or(Value::Null);
            let nobody = Owner {
                worker_id: "journal-check".into(),
                claim_token: uuid::Uuid::new_v4().to_string(),
                epoch: 0,
            };
            let job = JobCtx {
                input,
                cancel: CancellationToken::new(),
                cancel_asked: Default::default(),
                gate: Gate::new(jobs.clone(), &id, nobody),
                fence: Arc::new(Mutex::new(Fence::of_nobody(events.clone(), &id))),
                conn: conn.clone(),
                flow: Arc::new(leasehold_flow::Flow::new()),
                observer: Arc::new(leasehold_telemetry::observe::NoObserver),
                // As the job's next claim sees it.
                record: leasehold_core::JobRecord {
                    epoch: rec.epoch + 1,
                    ..rec.clone()
                },
            };
            let ctx = Ctx::dry(
                job,
                handler.kind.version().to_string(),
                None,
                handler.models.clone(),
            );
            let ran = tokio::time::timeout(REPLAY_WITHIN, handler.kind.run(&ctx)).await;
            let (verdict, next, why) = match ran {
                Err(_) => (
                    JournalVerdict::Error,
                    None,
                    Some(format!(
                        "its replay did not reach its next step within {REPLAY_WITHIN:?}"
                    )),
                ),
                Ok(Err(Error::Park { reason, message })) if reason == "journal_mismatch" => {
                    (JournalVerdict::Mismatch, None, Some(message))
                }
                Ok(r) => match (ctx.dry_stopped_at(), r) {
                    (Some(step), _) => (JournalVerdict::Matches, Some(step), None),
                    (None, Ok(_)) => (JournalVerdict::Matches, None, None),
                    (None, Err(e)) => (
                        JournalVerdict::Error,
                        None,
                        Some(format!("its replay ended with: {e}")),
                    ),
                },
            };
            out.push(JournalCheck {
                id,
                status: rec.status,
                steps,
                verdict,
                next,
                why,
            });
        }
        Ok(out)
    }
}
