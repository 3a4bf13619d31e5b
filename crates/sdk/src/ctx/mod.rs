//! [`Ctx`]: what one attempt of a job may do: read its input, run durable
//! steps, call tools through the effects ledger, and ask a person.

use std::future::Future;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex as StdMutex, OnceLock};
use std::time::Duration;

use leasehold_core::machine::check_owner;
use leasehold_core::JobRecord;
use leasehold_proto::Versions;
use leasehold_store::artifacts::Artifacts;
use leasehold_store::events::Events;
use leasehold_tools::EffectsLedger;
use leasehold_tools::{OwnerGuard, Toolbox};
use leasehold_worker::checkpoint::Flusher;
use leasehold_worker::JobCtx;
use serde::de::DeserializeOwned;
use serde::Serialize;
use serde_json::Value;
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;
use tokio_util::task::AbortOnDropHandle;

use crate::journal::{Journal, Next, Recorded};
use crate::records::{ArtifactStore, EventLog, Report};
use crate::Error;

mod children;
mod shared;
#[cfg(test)]
mod tests;

pub(crate) use children::{join_children, spawn_children, spawned};
pub use children::{Child, SpawnOptions, MAX_DEPTH, MAX_FAN_OUT};

pub use leasehold_store::signals::Signal;
use shared::signal_step;
pub(crate) use shared::{answer_for, call_tool, emit_once, record_step, timer};
pub(crate) use shared::{signal_taken, signal_wait};

/// The checkpoint flusher of an attempt: queue fenced events and progress
/// without waiting, wait for durability when it matters
/// ([`Checkpoints::barrier`]). See [`Ctx::checkpoints`].
pub use leasehold_worker::checkpoint::Flusher as Checkpoints;

/// Event types the runtime writes; a kind's own checkpoints use other names.
const RESERVED: &[&str] = &[
    "submitted",
    "claimed",
    "released",
    "completed",
    "failed",
    "parked",
    "waiting",
    "cancelled",
    "progress",
    "step",
    "answer",
    "action",
    "agent",
    "superseded",
    "end",
    "reclaimed",
];

tokio::task_local! {
    /// The id of the step whose closure this task is running: a step asked
    /// for inside it would wait for the journal it holds for ever.
    static IN_STEP: String;
}

/// One attempt of one job, as a kind sees it.
///
/// Every method takes `&self`, so a step's closure may read the context
/// (its input, its id) while the step runs.
///
/// ```no_run
/// # async fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
/// let n: u64 = ctx.step("count", || async { Ok(42) }).await?;
/// # Ok(()) }
/// ```
pub struct Ctx {
    job: JobCtx,
    version: String,
    tools: Option<Arc<Toolbox>>,
    models: Arc<crate::Models>,
    journal: Mutex<Option<Journal>>,
    checkpoints: OnceLock<(Flusher, AbortOnDropHandle<()>)>,
    report: StdMutex<Option<Report>>,
    /// The park this attempt ends with, if a step asked (its step id, the
    /// reason and the question): the `parked` event names the step.
    park: StdMutex<Option<(String, String, String)>>,
    /// The agents' journaled conversations, read once per attempt.
    threads: crate::agent::Threads,
    /// A journal check (`Worker::journal_check`): steps replay from the
    /// journal, and the first step past it stops the run, never run.
    dry: bool,
    /// The step a journal check stopped at (the one the job runs next).
    dry_next: StdMutex<Option<String>>,
}

impl Ctx {
    pub(crate) fn new(
        job: JobCtx,
        version: String,
        tools: Option<Arc<Toolbox>>,
        models: Arc<crate::Models>,
    ) -> Ctx {
        Ctx {
            job,
            version,
            tools,
            models,
            journal: Mutex::new(None),
            checkpoints: OnceLock::new(),
            report: StdMutex::new(None),
            park: StdMutex::new(None),
            threads: Default::default(),
            dry: false,
            dry_next: StdMutex::new(None),
        }
    }

    /// A context that runs nothing and writes nothing: recorded steps
    /// replay from the journal, and the first step past it ends the run
    /// ([`Ctx::dry_stopped_at`]). What a journal check runs a kind in.
    pub(crate) fn dry(
        job: JobCtx,
        version: String,
        tools: Option<Arc<Toolbox>>,
        models: Arc<crate::Models>,
    ) -> Ctx {
        let mut c = Ctx::new(job, version, tools, models);
        c.dry = true;
        c
    }

    /// Whether this is a journal check's run.
    pub(crate) fn is_dry(&self) -> bool {
        self.dry
    }

    /// In a journal check, the error that ends the run at step `step`, the
    /// first past the journal (remembered for [`Ctx::dry_stopped_at`]).
    pub(crate) fn dry_stop(&self, step: &str) -> Error {
        if let Ok(mut g) = self.dry_next.lock() {
            *g = Some(step.to_string());
        }
        Error::Cancelled
    }

    /// The step a journal check's run stopped at, if it did.
    pub(crate) fn dry_stopped_at(&self) -> Option<String> {
        self.dry_next.lock().ok().and_then(|g| g.clone())
    }

    /// The park of step `step`: the error that ends the attempt, and the
    /// step remembered for its `parked` event ([`Ctx::parked_step`]).
    pub(crate) fn park_at(&self, step: &str, reason: &str, question: &str) -> Error {
        if let Ok(mut g) = self.park.lock() {
            *g = Some((step.into(), reason.into(), question.into()));
        }
        Error::park(reason, question)
    }

    /// The step that asked for the park the attempt ended with (the same
    /// reason and message as its [`Ctx::park_at`]), or `None` when the park
    /// came from elsewhere (an uncertain effect, a journal mismatch).
    pub(crate) fn parked_step(&self, reason: &str, message: &str) -> Option<String> {
        let g = self.park.lock().ok()?;
        g.as_ref()
            .filter(|(_, r, m)| r == reason && m == message)
            .map(|(s, _, _)| s.clone())
    }

    /// The attempt as the worker gave it (for [`crate::RemoteKind`], which
    /// records steps itself).
    pub(crate) fn job(&self) -> &JobCtx {
        &self.job
    }

    /// The agents' journaled conversations as this attempt read them.
    pub(crate) fn threads(&self) -> &crate::agent::Threads {
        &self.threads
    }

    /// The generator of the registered model `name` (for
    /// [`crate::RemoteKind`]'s `generate` op).
    pub(crate) fn generator(&self, name: &str) -> Result<Arc<leasehold_model::Generator>, Error> {
        self.models.get(name).ok_or_else(|| {
            Error::terminal(format!(
                "no model `{name}`: register it with Worker::model, or set LH_MODEL_BASE_URL for a worker serving remote kinds (registered: {:?})",
                self.models.names()
            ))
        })
    }

    /// Ends the attempt's checkpoints: what was queued is made durable
    /// (bounded: the outcome matters more). A checkpoint refused by a newer
    /// owner makes the attempt a stop; one refused by the stream (full) a
    /// retry from the last checkpoint.
    pub(crate) async fn finish(
        &self,
        r: Result<Value, Error>,
    ) -> (Result<Value, Error>, Option<Report>) {
        let report = self.report.lock().ok().and_then(|mut g| g.take());
        let Some((flusher, _task)) = self.checkpoints.get() else {
            return (r, report);
        };
        let flushed = tokio::time::timeout(Duration::from_secs(5), flusher.barrier()).await;
        if flusher.is_lost() {
            return (Err(Error::Cancelled), report);
        }
        if let Some(why) = flusher.refused() {
            return (
                Err(Error::retryable(format!(
                    "a checkpoint was refused by the event stream ({why}); the job is retried from its last checkpoint"
                ))),
                report,
            );
        }
        match (r, flushed) {
            (Ok(v), Ok(Ok(()))) => (Ok(v), report),
            (Ok(_), _) => (
                Err(Error::retryable("checkpoints could not be flushed")),
                report,
            ),
            (e, _) => (e, report),
        }
    }

    /// The job's record as this attempt claimed it: its spec (model,
    /// budget), `budget_used`, `versions`, `resume_from`, `attempts`,
    /// `stale_reclaims`, `created_at` (the incarnation of a reused id).
    ///
    /// ```no_run
    /// # fn f(ctx: &leasehold::Ctx) {
    /// let reclaimed = ctx.record().stale_reclaims > 0;
    /// # }
    /// ```
    pub fn record(&self) -> &JobRecord {
        &self.job.record
    }

    /// Whether the stop that fired [`Ctx::cancelled`] is a cancel someone
    /// asked for (`leasehold cancel`), not a lost claim or a hand-back:
    /// only then is a partial result worth keeping.
    ///
    /// ```no_run
    /// # fn f(ctx: &leasehold::Ctx) {
    /// if ctx.cancelled().is_cancelled() && ctx.cancel_requested() {
    ///     tracing::info!("cancelled by a person");
    /// }
    /// # }
    /// ```
    pub fn cancel_requested(&self) -> bool {
        self.job.cancel_asked.load(Ordering::SeqCst)
    }

    /// The attempt's checkpoints (started on first use): events of the
    /// kind's own types, written in order under the owner's fence in
    /// batches by one background task, and progress snapshots coalesced
    /// into one record write per batch. `event` and `progress` never wait;
    /// [`Checkpoints::barrier`] waits until everything queued before it is
    /// durable. A checkpoint refused because a newer owner exists fires
    /// [`Ctx::cancelled`] and nothing more of this attempt lands. What the
    /// attempt queued is flushed when `run` returns.
    ///
    /// Types the runtime writes (`claimed`, `step`, `progress`, ...) are not
    /// for kinds: `event` drops them with an error log.
    ///
    /// ```no_run
    /// # async fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
    /// let cp = ctx.checkpoints();
    /// cp.event("chapter", serde_json::json!({"n": 3, "text": "..."}));
    /// cp.barrier().await.map_err(|_| leasehold::Error::Cancelled)?;
    /// # Ok(()) }
    /// ```
    pub fn checkpoints(&self) -> &Checkpoints {
        &self
            .checkpoints
            .get_or_init(|| {
                Flusher::start_checked(
                    self.job.fence.clone(),
                    self.job.gate.clone(),
                    self.job.cancel.clone(),
                    RESERVED,
                    self.job.observer.clone(),
                )
            })
            .0
    }

    /// The job's own events, every epoch's (see [`EventLog`]).
    ///
    /// ```no_run
    /// # async fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
    /// let chapters = ctx.events().read(&["chapter"]).await?;
    /// # Ok(()) }
    /// ```
    pub fn events(&self) -> EventLog {
        EventLog {
            events: Events::new(&self.job.conn),
            job: self.id().to_string(),
        }
    }

    /// The fleet's artifact store.
    ///
    /// ```no_run
    /// # async fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
    /// let doc = ctx.artifacts().await?.get(&format!("{}/report.md", ctx.id())).await?;
    /// # Ok(()) }
    /// ```
    pub async fn artifacts(&self) -> Result<ArtifactStore, Error> {
        Artifacts::open(&self.job.conn)
            .await
            .map(ArtifactStore)
            .map_err(|e| Error::retryable(format!("artifact store: {e}")))
    }

    /// The fleet's effects ledger, for a [`crate::runtime::Toolbox`] a kind
    /// builds itself (the built-in tools, its own events sink).
    ///
    /// ```no_run
    /// # async fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
    /// let ledger = ctx.effects_ledger().await?;
    /// # Ok(()) }
    /// ```
    pub async fn effects_ledger(&self) -> Result<EffectsLedger, Error> {
        EffectsLedger::open(&self.job.conn.js, &self.job.conn.layout.effects_bucket())
            .await
            .map_err(|e| Error::retryable(format!("effects ledger: {e}")))
    }

    /// The proof of ownership write tools run behind (a fenced write of the
    /// record right before each effect), to hand to tool calls a kind makes
    /// itself ([`crate::runtime::CallCtx::guarded`]).
    ///
    /// ```no_run
    /// # fn f(ctx: &leasehold::Ctx) {
    /// let guard = ctx.owner_guard();
    /// # }
    /// ```
    pub fn owner_guard(&self) -> Arc<OwnerGuard> {
        Arc::new(OwnerGuard::new(self.job.gate.clone()))
    }

    /// Proves this attempt still owns the job, with a fenced write, right
    /// before an effect (storing the result's document, say). Lost
    /// ownership is [`Error::Cancelled`]: stop, write nothing.
    ///
    /// ```no_run
    /// # async fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
    /// ctx.prove_owner().await?;
    /// // ... the effect
    /// # Ok(()) }
    /// ```
    pub async fn prove_owner(&self) -> Result<(), Error> {
        OwnerGuard::new(self.job.gate.clone())
            .prove_now()
            .await
            .map_err(|e| match e {
                leasehold_tools::ToolError::OwnershipLost(_) => {
                    Error::stopped(format!("ownership lost before an effect: {e}"))
                }
                e => Error::retryable(e.to_string()),
            })
    }

    /// Writes the versions this attempt runs under on the record (its
    /// `versions`, compared by later attempts: checkpoints of other
    /// versions are not reused). An owner-checked write.
    ///
    /// ```no_run
    /// # async fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
    /// ctx.set_versions(leasehold::Versions { workflow: "mine/2".into(), ..Default::default() }).await?;
    /// # Ok(()) }
    /// ```
    pub async fn set_versions(&self, versions: Versions) -> Result<(), Error> {
        self.job
            .gate
            .write(|rec, owner, _| {
                check_owner(rec, owner)?;
                let mut r = rec.clone();
                r.versions = Some(versions.clone());
                Ok(r)
            })
            .await
            .map(|_| ())
            .map_err(|e| {
                if e.is_ownership_lost() {
                    Error::stopped(format!("recording versions: {e}"))
                } else {
                    Error::retryable(e.to_string())
                }
            })
    }

    /// The document this attempt's result points to ([`Report`]): kept on
    /// the record with the output when `run` returns it, and as the
    /// partial result when the attempt ends cancelled (by a person) or out
    /// of budget.
    ///
    /// ```no_run
    /// # fn f(ctx: &leasehold::Ctx) {
    /// ctx.set_report(leasehold::Report { artifact: format!("{}/report.md", ctx.id()), digest: "...".into(), ..Default::default() });
    /// # }
    /// ```
    pub fn set_report(&self, report: Report) {
        if let Ok(mut g) = self.report.lock() {
            *g = Some(report);
        }
    }

    /// The job's id.
    ///
    /// ```no_run
    /// # fn f(ctx: &leasehold::Ctx) { tracing::info!(job = ctx.id(), "starting"); }
    /// ```
    pub fn id(&self) -> &str {
        &self.job.record.id
    }

    /// The job's kind.
    ///
    /// ```no_run
    /// # fn f(ctx: &leasehold::Ctx) { assert_eq!(ctx.kind(), "invoice"); }
    /// ```
    pub fn kind(&self) -> &str {
        &self.job.record.kind
    }

    /// The attempt's epoch: 1 for the first claim, one more for each claim after it.
    ///
    /// ```no_run
    /// # fn f(ctx: &leasehold::Ctx) { if ctx.epoch() > 1 { tracing::info!("a reclaimed job"); } }
    /// ```
    pub fn epoch(&self) -> u64 {
        self.job.record.epoch
    }

    /// Failed attempts before this one (0 on the first).
    ///
    /// ```no_run
    /// # fn f(ctx: &leasehold::Ctx) { let first_try = ctx.failed_attempts() == 0; }
    /// ```
    pub fn failed_attempts(&self) -> u32 {
        self.job.record.attempts
    }

    /// The submission's `input`, decoded. A bad input is a terminal error
    /// (retrying cannot fix it).
    ///
    /// ```no_run
    /// #[derive(serde::Deserialize)]
    /// struct Email { from: String, body: String }
    /// # fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
    /// let email: Email = ctx.input()?;
    /// # Ok(()) }
    /// ```
    pub fn input<T: DeserializeOwned>(&self) -> Result<T, Error> {
        serde_json::from_value(self.job.input.clone())
            .map_err(|e| Error::terminal(format!("the job's input: {e}")))
    }

    /// The submission's `input` as JSON.
    ///
    /// ```no_run
    /// # fn f(ctx: &leasehold::Ctx) { let urgent = ctx.input_json()["urgent"] == true; }
    /// ```
    pub fn input_json(&self) -> &Value {
        &self.job.input
    }

    /// The worker's flow control, for a [`RunContext`](crate::runtime::RunContext)
    /// of this job (`run.flow = ctx.flow()`): its model requests are then
    /// admitted against the fleet's limits and pauses.
    pub fn flow(&self) -> std::sync::Arc<leasehold_flow::Flow> {
        self.job().flow.clone()
    }

    /// The worker's metrics as an observer, for a toolbox of this job
    /// (`Toolbox::observed`): its calls and effects are counted there.
    pub fn observer(&self) -> std::sync::Arc<dyn leasehold_telemetry::observe::Observer> {
        self.job().observer.clone()
    }

    /// Fires when the attempt must stop (cancelled, ownership lost, shutdown).
    /// Long work should select on it; steps and tool calls already do.
    ///
    /// ```no_run
    /// # async fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
    /// tokio::select! {
    ///     _ = tokio::time::sleep(std::time::Duration::from_secs(60)) => {}
    ///     _ = ctx.cancelled().cancelled() => return Err(leasehold::Error::Cancelled),
    /// }
    /// # Ok(()) }
    /// ```
    pub fn cancelled(&self) -> &CancellationToken {
        &self.job.cancel
    }

    async fn journal(&self) -> Result<tokio::sync::MutexGuard<'_, Option<Journal>>, Error> {
        let mut g = self.journal.lock().await;
        if g.is_none() {
            let events = Events::new(&self.job.conn)
                .read_types(self.id(), &["step"])
                .await
                .map_err(|e| Error::retryable(format!("reading the job's steps: {e}")))?;
            *g = Some(Journal::new(
                events
                    .iter()
                    .filter_map(|(_, ev)| Recorded::of(&ev.data_map())),
            ));
        }
        Ok(g)
    }

    /// A durable step: `f` runs at most once per attempt boundary. Its
    /// result is written as a fenced `step` event before the next step
    /// starts; an attempt that resumes the job gets the recorded result
    /// without running `f` again.
    ///
    /// Step ids are the name and its occurrence (`fetch#0`, `fetch#1`), so
    /// a loop of steps is stable. A resumed attempt whose code asks for
    /// steps in another order than recorded, or whose recorded result no
    /// longer decodes as `T`, parks the job for a person with the reason
    /// (`journal_mismatch`): it never runs on guessed state.
    ///
    /// Steps do not nest: `f` may read the context, but a `step`, `call`,
    /// `agent` or `park` asked for inside it ends the job with a terminal
    /// error naming both (the journal is one sequence).
    ///
    /// What runs at most once is the recorded step; `f` itself may run
    /// again if the process dies after `f` and before its record landed.
    /// An external effect belongs in a tool call ([`Ctx::call`]), whose
    /// idempotency key and ledger make it happen once ever.
    ///
    /// ```no_run
    /// # async fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
    /// let total: f64 = ctx
    ///     .step("total", || async { Ok(12.5 * 3.0) })
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn step<T, F, Fut>(&self, name: &str, f: F) -> Result<T, Error>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<T, Error>>,
    {
        self.step_with_id(name, |_| f()).await
    }

    /// [`Ctx::step`], giving the step's id to `f`.
    async fn step_with_id<T, F, Fut>(&self, name: &str, f: F) -> Result<T, Error>
    where
        T: Serialize + DeserializeOwned,
        F: FnOnce(String) -> Fut,
        Fut: Future<Output = Result<T, Error>>,
    {
        if let Ok(outer) = IN_STEP.try_with(String::clone) {
            return Err(Error::terminal(format!(
                "`{name}` was asked for inside the closure of step `{outer}`: steps, tool calls, agents and parks do not nest (the journal is one sequence); make it a step of its own, after `{outer}` returns"
            )));
        }
        let mut g = self.journal().await?;
        let journal = g.as_mut().expect("journal loaded");
        let id = journal.id_of(name);
        let index = match journal.next(&id, &self.version) {
            Next::Replay(v) => {
                return serde_json::from_value(v).map_err(|e| {
                    Error::park(
                        "journal_mismatch",
                        format!("step `{id}`'s recorded result no longer decodes: {e}; the kind's code changed while the job ran"),
                    )
                })
            }
            Next::Mismatch(m) => return Err(Error::park("journal_mismatch", m)),
            Next::Run { .. } if self.dry => return Err(self.dry_stop(&id)),
            Next::Run { index } => index,
        };
        // The journal stays locked while the step runs: steps of one job
        // are sequential, and their order is what the journal checks.
        let out = tokio::select! {
            r = IN_STEP.scope(id.clone(), f(id.clone())) => r?,
            _ = self.job.cancel.cancelled() => return Err(Error::Cancelled),
        };
        let result = serde_json::to_value(&out).map_err(|e| {
            Error::terminal(format!("step `{id}`'s result does not serialize: {e}"))
        })?;
        let rec = Recorded {
            index,
            id,
            version: self.version.clone(),
            result,
        };
        record_step(&self.job, &rec).await?;
        journal.recorded(rec);
        Ok(out)
    }

    /// Calls a registered tool as a durable step (`tool:<name>#n`). A write
    /// tool's effect happens at most once ever: its idempotency key is the
    /// job, its incarnation, the step and the tool; the ledger records it;
    /// an unknown earlier outcome is reconciled with the tool's
    /// `find_existing` first; a business key makes a later step asking for
    /// the same effect get the first one's result; the same step with
    /// other arguments is refused; and an outcome nobody can know parks
    /// the job. Ownership is proved by a fenced write right before the
    /// effect.
    ///
    /// ```no_run
    /// # async fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
    /// let invoice = ctx
    ///     .call("create_invoice", serde_json::json!({"supplier": "ACME", "number": "F-17", "amount": 120.0}))
    ///     .await?;
    /// # Ok(()) }
    /// ```
    pub async fn call(&self, tool: &str, args: Value) -> Result<Value, Error> {
        let no_tool = || {
            Error::terminal(format!(
                "no tool `{tool}`: this worker registers no tools (Worker::tool)"
            ))
        };
        let tb = self.tools.clone();
        // A journal check replays a recorded call without its toolbox.
        if tb.is_none() && !self.dry {
            return Err(no_tool());
        }
        let step = format!("tool:{tool}");
        let job = &self.job;
        self.step_with_id(&step, |step_id| async move {
            match tb {
                Some(tb) => call_tool(job, &tb, &step_id, tool, &args).await,
                None => Err(no_tool()),
            }
        })
        .await
    }

    /// Stops for a person and returns their answer. The first time, the
    /// job parks with `reason` and `question` (`leasehold review list`
    /// shows them; the `parked` event names this park's step, `park#n`);
    /// `leasehold review resume ID --answer JSON` queues it again, and the
    /// resumed attempt's `park` returns the answer (then recorded as a
    /// step: later attempts get it without asking again).
    ///
    /// An answer belongs to its question: a park takes only an answer that
    /// names its own step and came after its own `parked` event. A second
    /// park in the same run never gets the first one's answer: it parks
    /// and asks.
    ///
    /// ```no_run
    /// # async fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
    /// let answer = ctx
    ///     .park("approval", "Create an invoice of 12,000 EUR for ACME?")
    ///     .await?;
    /// if answer["approve"] != true {
    ///     return Err(leasehold::Error::terminal("refused by the reviewer"));
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn park(&self, reason: &str, question: &str) -> Result<Value, Error> {
        self.step_with_id("park", |step| async move {
            match answer_for(&self.job, &step).await? {
                Some(answer) => Ok(answer),
                None => Err(self.park_at(&step, reason, question)),
            }
        })
        .await
    }

    /// Waits `d`, holding no worker: a durable timer. The first time, the
    /// attempt ends (this returns [`Error::Wait`]: propagate it with `?`),
    /// the job is `waiting` (`leasehold list --status waiting`), its slot
    /// is free, and its wake-up gives it a ticket at its time, on any
    /// worker: a kill -9 or a restart of the whole fleet meanwhile changes
    /// nothing. The resumed attempt replays the steps before it and this
    /// `sleep` returns `Ok` (recorded as step `sleep#n`, so later attempts
    /// pass it at once). The wait starts when it is recorded; a job
    /// reclaimed before that waits the whole `d` from its new attempt.
    ///
    /// ```no_run
    /// # async fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
    /// ctx.call("send_reminder", serde_json::json!({"to": "ACME"})).await?;
    /// ctx.sleep(std::time::Duration::from_secs(3 * 24 * 3600)).await?;
    /// // Three days later, on whichever worker is free.
    /// # Ok(()) }
    /// ```
    pub async fn sleep(&self, d: std::time::Duration) -> Result<(), Error> {
        self.wait_for_time(|now| now + d).await
    }

    /// Waits until `t`, holding no worker ([`Ctx::sleep`] to a time). A
    /// time already past returns at once (and is recorded as a step).
    ///
    /// ```no_run
    /// # async fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
    /// let at = std::time::SystemTime::now() + std::time::Duration::from_secs(3600);
    /// ctx.sleep_until(at).await?;
    /// # Ok(()) }
    /// ```
    pub async fn sleep_until(&self, t: std::time::SystemTime) -> Result<(), Error> {
        self.wait_for_time(|_| t).await
    }

    /// Waits for the signal `name`, holding no worker, at most `timeout`
    /// (`None`: for as long as it takes). A signal is sent with
    /// `leasehold signal ID NAME --data JSON`, from the console's job page,
    /// or published on `lh.signal.<job>.<name>`. The first time, unless the
    /// signal is already there (one sent before the wait is kept for it),
    /// the attempt ends (this returns [`Error::Wait`]: propagate it with
    /// `?`), the job is `waiting` (`leasehold list --status waiting`) and
    /// its slot is free; the signal, or the timeout, gives it a ticket, and
    /// the resumed attempt's `wait_for` returns the signal (or `None` after
    /// the timeout), recorded as step `wait:<name>#n`. Two signals of one
    /// name are two waits' answers, in the order they were sent; each is
    /// taken once.
    ///
    /// ```no_run
    /// # async fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
    /// let three_days = std::time::Duration::from_secs(3 * 24 * 3600);
    /// match ctx.wait_for("confirmation", Some(three_days)).await? {
    ///     Some(s) => println!("confirmed: {}", s.data),
    ///     None => {
    ///         ctx.call("send_reminder", serde_json::json!({"to": "ACME"})).await?;
    ///     }
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn wait_for(
        &self,
        name: &str,
        timeout: Option<std::time::Duration>,
    ) -> Result<Option<Signal>, Error> {
        let step_name = signal_step(name)?;
        let after = {
            let g = self.journal().await?;
            signal_taken(g.as_ref().expect("journal loaded").steps(), name)
        };
        let job = &self.job;
        let v: Value = self
            .step_with_id(&step_name, |step| async move {
                signal_wait(job, &step, name, after, timeout).await
            })
            .await?;
        serde_json::from_value(v).map_err(|e| {
            Error::park(
                "journal_mismatch",
                format!("the recorded signal of `{name}` no longer decodes: {e}"),
            )
        })
    }

    /// The step of [`Ctx::sleep`] and [`Ctx::sleep_until`]: the time its
    /// recorded wait named (or `due(now)` the first time); done once it
    /// has passed, else the attempt ends to wait for it.
    async fn wait_for_time(
        &self,
        due: impl FnOnce(std::time::SystemTime) -> std::time::SystemTime,
    ) -> Result<(), Error> {
        let rec = &self.job.record;
        let _: String = self
            .step_with_id("sleep", |step| async move { timer(rec, &step, due) })
            .await?;
        Ok(())
    }

    /// A tool-calling conversation with a registered model and tools, as
    /// one durable step (`agent:<name>#n`): once it completed, later
    /// attempts get its answer without a model call. While it runs, its
    /// transcript is journaled (`agent` events) and each model call waits
    /// until what came before is durable, so a kill -9 repeats at most the
    /// call in flight: a resumed attempt continues the conversation (warm),
    /// with every tool result kept, and write tools keep their keys.
    /// Generation retries, warm then cold retries, context compaction, the
    /// breaker, the fallback model, budgets, loop detection and schema
    /// validation with one repair round are the research sections' own.
    ///
    /// ```no_run
    /// # async fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
    /// use leasehold::Agent;
    /// let out = ctx
    ///     .agent(
    ///         "book",
    ///         &Agent::new("main", "You book supplier invoices.", "Book: Invoice F-17 from ACME: 120 EUR")
    ///             .tools(["lookup_supplier", "create_invoice"]),
    ///     )
    ///     .await?;
    /// println!("{}", out.text);
    /// # Ok(()) }
    /// ```
    pub async fn agent(
        &self,
        name: &str,
        spec: &crate::Agent,
    ) -> Result<crate::AgentOutput, Error> {
        let Some(generator) = self.models.get(&spec.model) else {
            return Err(Error::terminal(format!(
                "no model `{}`: register it with Worker::model (registered: {:?})",
                spec.model,
                self.models.names()
            )));
        };
        let (job, threads) = (&self.job, &self.threads);
        let tools = self.tools.clone();
        self.step_with_id(&format!("agent:{name}"), |step| async move {
            crate::agent::run(job, threads, &step, generator, tools, spec).await
        })
        .await
    }
}
