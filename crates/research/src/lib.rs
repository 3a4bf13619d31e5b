//! The `research` workload: outline → perspectives → expert content → final
//! document → delivery, surviving any crash with the least rework.
//!
//! - Checkpoints are events on the job's subjects, published through the
//!   owner's server-side fence by one background [`flusher::Flusher`] per job
//!   (`phase`, `section`, `journal`, `retry`, `tool`, `progress`).
//! - Every run starts with a semantic resume ([`state::State::rebuild`]):
//!   typed, validated state from the events; `resume_from` is advisory; the
//!   run walks back to the earliest phase it can run safely.
//! - In-flight sections continue from their journaled transcript (repaired
//!   by the section runner's sanitizer), so recorded model responses are not
//!   asked again and recorded tool results are not run again.
//! - Terminal publication is idempotent: the artifact is created once under
//!   the job id, never overwritten (an existing one, whichever attempt made
//!   it, is adopted); the delivery goes through the `publish` tool, whose
//!   idempotency key is the job's publish step (not the document) in the
//!   effects ledger, so another attempt's different document is refused and
//!   parks the job instead of being sent; ownership is proven with a fenced
//!   write right before the artifact write and before the delivery; and the
//!   result carries the artifact's digest.
//!
//! Architecture invariant: this crate never writes a job's status; the
//! worker's runner does, through the gate, from the returned outcome.

mod artifact;
mod config;
mod expert_jobs;
mod experts;
pub mod hooks;
pub mod report;
pub mod state;

pub use config::{ResearchConfig, ENV_VARS};
pub use expert_jobs::EXPERT_KIND;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use leasehold::runtime::{
    Budget, BudgetLimits, Generator, ModelClient, NoTools, OwnerGuard, PriceTable, ProgressUpdate,
    RunContext, SectionInput, SectionOutcome, SectionPolicy, SectionResult, SectionRunner,
    ToolExecutor, Toolbox, TranscriptHook,
};
use leasehold::telemetry::spans;
use leasehold::{BudgetUsed, Checkpoints, Ctx, Error, JobResult, Report, Versions};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

type Flusher = Checkpoints;
use crate::hooks::{Crash, PhaseCalls, Reporter, ToolSink};
use crate::report::{Input, Recovery};
use crate::state::{
    validate_experts, validate_outline, Expert, FinalCk, Outline, Resume, SectionCk, State,
};

/// The workflow version: bump when checkpoint meaning changes.
pub const WORKFLOW_VERSION: &str = "research/1";

/// Runs `fut` as the phase `name`: a `phase` span around it, marked failed
/// when the phase stops the run.
async fn in_phase<T>(
    name: &str,
    fut: impl std::future::Future<Output = Result<T, Error>>,
) -> Result<T, Error> {
    let span = spans::phase(name);
    let r = fut.instrument(span.clone()).await;
    if let Err(e) = &r {
        spans::record_error(&span, e.class());
    }
    r
}

/// How a section that did not complete stops the run: the SDK's one
/// mapping ([`Error::of_section`]).
fn stop_of(outcome: SectionOutcome, what: &str) -> Error {
    // A completed section is never a stop: the callers match it first.
    Error::of_section(outcome, what)
        .err()
        .unwrap_or(Error::Cancelled)
}

/// Runs one attempt of a research job: its result, or how it stopped
/// (a park, a retry, a cancel, a budget). The report (the document, or a
/// cancelled or budget-exhausted job's partial one) is set on `ctx`.
pub async fn run(ctx: &Ctx, cfg: &ResearchConfig) -> Result<Value, Error> {
    let input = Input::parse(ctx.input_json()).map_err(Error::terminal)?;
    if input.task.is_some() {
        return Err(Error::terminal(format!(
            "input.expert_job: only a `{EXPERT_KIND}` job has one (a research job given `\"expert_jobs\": true` spawns them)"
        )));
    }
    run_input(ctx, cfg, input).await
}

/// Runs one attempt of an expert job (kind [`EXPERT_KIND`]): one expert's
/// sections of a research job run with `"expert_jobs": true`, its output
/// every one of them.
pub async fn run_expert(ctx: &Ctx, cfg: &ResearchConfig) -> Result<Value, Error> {
    let input = Input::parse(ctx.input_json()).map_err(Error::terminal)?;
    if input.task.is_none() {
        return Err(Error::terminal(format!(
            "input.expert_job: required (a `{EXPERT_KIND}` job is one expert of a research job run with `\"expert_jobs\": true`; submit that instead)"
        )));
    }
    run_input(ctx, cfg, input).await
}

async fn run_input(ctx: &Ctx, cfg: &ResearchConfig, input: Input) -> Result<Value, Error> {
    let flusher = ctx.checkpoints().clone();
    let (res, partial) = match Job::prepare(ctx, cfg, input, flusher.clone()).await {
        Ok(job) => job.run().await,
        Err(e) => (Err(e), None),
    };
    // Whatever happened, persist what is queued (retry reports above all)
    // before the runner writes the outcome; bounded, the outcome matters more.
    let flushed = tokio::time::timeout(Duration::from_secs(5), flusher.barrier()).await;
    let st = &flusher.stats;
    let summary = st.summary();
    let lat = &summary["flush_latency_us"];
    tracing::info!(
        job = %ctx.id(),
        events = st.events.load(Ordering::Relaxed),
        batches = st.batches.load(Ordering::Relaxed),
        progress_updates = st.progress_updates.load(Ordering::Relaxed),
        progress_writes = st.progress_writes.load(Ordering::Relaxed),
        flush_p50_us = lat["p50"].as_u64(),
        flush_p99_us = lat["p99"].as_u64(),
        "research: checkpoints flushed"
    );
    if flusher.is_lost() {
        return Err(Error::Cancelled);
    }
    if let Some(why) = flusher.refused() {
        return Err(Error::retryable(format!(
            "a checkpoint was refused by the event stream ({why}); the job is retried from its last checkpoint"
        )));
    }
    let mut r = match res {
        Ok(r) => r,
        Err(e) => {
            if let Some(rep) = partial {
                ctx.set_report(rep);
            }
            return Err(e);
        }
    };
    if !matches!(flushed, Ok(Ok(()))) {
        return Err(Error::retryable("checkpoints could not be flushed"));
    }
    // The completing attempt's flusher figures ride along in the output so
    // `make bench` reads them from the record, not logs.
    if let Ok(Value::Object(mut o)) = serde_json::from_str::<Value>(&r.output) {
        o.insert("checkpoints".into(), summary);
        r.output = Value::Object(o).to_string();
    }
    if let Some(rep) = report_of(&r) {
        ctx.set_report(rep);
    }
    Ok(serde_json::from_str(&r.output)?)
}

/// One attempt's working set.
struct Job<'a> {
    ctx: &'a Ctx,
    cfg: &'a ResearchConfig,
    input: Input,
    fp: String,
    flusher: Flusher,
    toolbox: Arc<Toolbox>,
    /// Proves this attempt still owns the job (a fenced write) right before
    /// each write effect: the artifact and every write tool call.
    owner: Arc<OwnerGuard>,
    generator: Arc<Generator>,
    budget: Arc<StdMutex<Budget>>,
    crash: Arc<Crash>,
    /// Child of the job's token: a failing expert stops its siblings.
    work: CancellationToken,
    state: State,
    notes: Vec<String>,
    /// Claims and retries of earlier attempts, counted from what the resume
    /// read (the recovery appendix does not read the log again).
    history: report::Recovery,
    done: AtomicU32,
    skipped: AtomicU32,
    /// Expert sections written by this attempt, as each is (the experts
    /// phase returns them only when every expert finished; a partial
    /// report needs them when it did not).
    fresh: StdMutex<Vec<SectionCk>>,
}

fn digest12(v: &str) -> String {
    report::sha256_hex(v)[..12].to_string()
}

impl<'a> Job<'a> {
    async fn prepare(
        ctx: &'a Ctx,
        cfg: &'a ResearchConfig,
        input: Input,
        flusher: Flusher,
    ) -> Result<Job<'a>, Error> {
        let spec = ctx.record().spec.clone().unwrap_or_default();
        let mut model = cfg.model.clone();
        if let Some(m) = spec.model.as_ref().and_then(|m| m.model.clone()) {
            model.model = m;
        }
        let ledger = ctx.effects_ledger().await?;
        let toolbox = Toolbox::builtin(
            &cfg.toolbox,
            Some(ledger),
            Arc::new(ToolSink(flusher.clone())),
        )
        .map_err(|e| Error::terminal(e.to_string()))?
        .observed(ctx.observer());
        let versions = Versions {
            workflow: WORKFLOW_VERSION.into(),
            prompt: report::prompt_version(),
            model: model.model.clone(),
            tools: digest12(&toolbox.openai_tools().to_string()),
        };
        let fp = format!(
            "{}|{}|{}|{}",
            versions.workflow, versions.prompt, versions.model, versions.tools
        );
        let client = ModelClient::new(model)
            .map_err(|e| Error::terminal(e.to_string()))?
            .sharing(cfg.providers.clone());
        let generator = Arc::new(Generator::new(
            client,
            cfg.generation.clone(),
            cfg.breaker.clone(),
        ));
        // An expert job's budget is its share of the report's.
        let b = expert_jobs::Limits::of_job(ctx)
            .or(input.task.as_ref().and_then(|t| t.budget))
            .unwrap_or_default();
        let limits = BudgetLimits {
            max_steps: b.max_steps,
            max_tokens: b.max_tokens,
            max_wall: b.max_wall_s.map(Duration::from_secs_f64),
            max_cost_usd: b.max_cost_usd,
        };
        let carried = ctx.record().budget_used.unwrap_or_default();
        let budget = Budget::resume(
            limits,
            PriceTable::default(),
            leasehold::runtime::Spent {
                steps: carried.steps,
                tokens: carried.tokens,
                wall_s: carried.wall_s,
                cost_usd: carried.cost_usd,
            },
        );
        // The versions this attempt runs under, on the record before any work.
        ctx.set_versions(versions.clone()).await?;
        if let Some(old) = ctx.record().versions.as_ref().filter(|o| **o != versions) {
            tracing::info!(
                job = %ctx.id(),
                old = %format_args!("workflow={} prompt={} model={} tools={}", old.workflow, old.prompt, old.model, old.tools),
                new = %format_args!("workflow={} prompt={} model={} tools={}", versions.workflow, versions.prompt, versions.model, versions.tools),
                "versions changed: incompatible checkpoints are not reused"
            );
        }
        // The checkpoints first, without the journal; then the journal only
        // from where the sections still in flight began: a resume reads what
        // it needs, not every transcript entry of the job's history.
        let reader = ctx.events();
        let mut events = reader
            .read(&["claimed", "phase", "section", "retry"])
            .await?;
        let draft = State::rebuild(&events, &fp, input.experts, input.sections);
        if let Some(from) = draft.journal_from(input.experts, input.sections) {
            let mut journal = reader.read_from("journal", from).await?;
            events.append(&mut journal);
            events.sort_by_key(|(seq, _)| *seq);
        }
        let history = report::Recovery::counted(&events);
        flusher
            .stats
            .events_read_bytes
            .store(reader.bytes_read(), Ordering::Relaxed);
        let state = State::rebuild(&events, &fp, input.experts, input.sections);
        let point = state.resume_point(input.experts, input.sections);
        let mut notes = state.notes.clone();
        if let Some(adv) = ctx.record().resume_from.as_deref().and_then(Resume::parse) {
            if adv > point {
                notes.push(format!(
                    "resume_from said `{}` but the checkpoints support only `{}`: walked back",
                    adv.as_str(),
                    point.as_str()
                ));
            }
        }
        if ctx.epoch() > 1 {
            notes.push(format!(
                "attempt at epoch {} resumed at `{}` with {} expert sections, {} final sections and {} journaled transcripts reused",
                ctx.epoch(),
                point.as_str(),
                state.sections.len(),
                state.finals.len(),
                state.journals.len()
            ));
        }
        tracing::info!(job = %ctx.id(), epoch = ctx.epoch(), resume = point.as_str(), sections = state.sections.len(), journals = state.journals.len(), "research: resuming");
        let crash = Arc::new(Crash::new(
            cfg.crash_at.clone(),
            ctx.record().stale_reclaims,
        ));
        let done = state.sections.len() + state.finals.len();
        let skipped = state.sections.values().filter(|s| !s.completed()).count();
        Ok(Job {
            ctx,
            cfg,
            input,
            fp,
            flusher,
            toolbox: Arc::new(toolbox),
            owner: ctx.owner_guard(),
            generator,
            budget: Arc::new(StdMutex::new(budget)),
            crash,
            work: ctx.cancelled().child_token(),
            state,
            notes,
            history,
            done: AtomicU32::new(done as u32),
            skipped: AtomicU32::new(skipped as u32),
            fresh: StdMutex::new(Vec::new()),
        })
    }

    fn total(&self) -> u32 {
        if self.input.task.is_some() {
            return self.input.sections as u32;
        }
        (self.input.experts * self.input.sections + self.input.sections) as u32
    }

    fn progress(&self, phase: Resume) {
        let used = self.budget.lock().expect("budget lock").used();
        self.flusher.progress(ProgressUpdate {
            phase: phase.as_str().into(),
            sections_done: self.done.load(Ordering::SeqCst),
            sections_total: self.total(),
            skipped: self.skipped.load(Ordering::SeqCst),
            resume_from: phase.as_str().into(),
            budget: BudgetUsed {
                steps: used.steps,
                tokens: used.tokens,
                wall_s: used.wall_s,
                cost_usd: used.cost_usd,
            },
        });
    }

    fn run_ctx(&self, tags: Value) -> RunContext {
        RunContext {
            cancel: self.work.clone(),
            deadline: None,
            budget: self.budget.clone(),
            reporter: Arc::new(Reporter {
                flusher: self.flusher.clone(),
                tags,
            }),
            watcher: None,
            flow: self.ctx.flow(),
        }
    }

    async fn section(
        &self,
        tools: Arc<dyn ToolExecutor>,
        hook: Arc<dyn TranscriptHook>,
        policy: SectionPolicy,
        input: SectionInput,
        tags: Value,
    ) -> SectionResult {
        let runner = SectionRunner {
            generator: self.generator.clone(),
            tools,
            hook,
            policy,
        };
        runner.run(input, &self.run_ctx(tags)).await
    }

    fn cancelled(&self) -> Result<(), Error> {
        if self.work.is_cancelled() {
            Err(Error::Cancelled)
        } else {
            Ok(())
        }
    }

    /// The attempt's result, and the partial report of a job cancelled by
    /// a request or out of budget.
    async fn run(mut self) -> (Result<JobResult, Error>, Option<Report>) {
        if let Some(task) = self.input.task.clone() {
            // An expert job keeps no report: its sections are its output.
            let r = self.expert_job(&task).await.map(|v| JobResult {
                output: v.to_string(),
                ..JobResult::default()
            });
            return (r, None);
        }
        match self.run_phases().await {
            Err(e @ (Error::Cancelled | Error::BudgetExhausted(_))) => {
                let partial = self.partial_report(&e).await;
                (Err(e), partial)
            }
            r => (r, None),
        }
    }

    /// What the report of this job is made of.
    fn report_doc<'d>(
        &'d self,
        outline: &'d Outline,
        experts: &'d [Expert],
        sections: &'d BTreeMap<(usize, usize), SectionCk>,
        skipped: &'d [String],
        recovery: &'d Recovery,
    ) -> report::Doc<'d> {
        report::Doc {
            input: &self.input,
            outline,
            experts,
            sections,
            finals: &self.state.finals,
            skipped,
            recovery,
        }
    }

    async fn run_phases(&mut self) -> Result<JobResult, Error> {
        let (ne, ns) = (self.input.experts, self.input.sections);
        if let Some(art) = self.stored_artifact().await? {
            tracing::info!(job = %self.ctx.id(), "research: artifact already stored; delivering it");
            return in_phase("deliver", self.deliver(art)).await;
        }
        if self.state.outline.is_none() {
            self.progress(Resume::Outline);
            let prompt = self.input.outline_prompt();
            let v = in_phase(
                "outline",
                self.structured("outline", prompt, report::outline_format(ns), |v| {
                    // A small model fills the schema's `title` with "" (a
                    // real 135M one does): the report is then headed by
                    // nothing. The topic is the honest stand-in.
                    validate_outline(v, ns).map(|mut o| {
                        if o.title.trim().is_empty() {
                            o.title = self.input.topic.clone();
                        }
                        json!(o)
                    })
                }),
            )
            .await?;
            self.state.outline = validate_outline(&v, ns).ok();
            self.checkpoint_phase("outline", v).await;
        }
        if self.state.experts.is_none() {
            self.progress(Resume::Perspectives);
            let prompt = self.input.perspectives_prompt();
            let v = in_phase(
                "perspectives",
                self.structured(
                    "perspectives",
                    prompt,
                    report::perspectives_format(ne),
                    |v| {
                        validate_experts(v.get("experts").unwrap_or(&Value::Null), ne)
                            .map(|e| json!(e))
                    },
                ),
            )
            .await?;
            self.state.experts = validate_experts(&v, ne).ok();
            self.checkpoint_phase("perspectives", v).await;
        }
        self.cancelled()?;
        self.progress(Resume::Experts);
        let fresh = if self.input.expert_jobs {
            self.notes.push(format!(
                "each expert's sections were written by a `{EXPERT_KIND}` job of its own: their claims and retries are theirs (`leasehold status ID`)"
            ));
            in_phase("experts", self.expert_jobs_phase()).await?
        } else {
            in_phase("experts", self.experts_phase()).await?
        };
        for s in fresh {
            self.state.sections.insert((s.expert, s.index), s);
        }
        self.cancelled()?;
        self.progress(Resume::Final);
        in_phase("final", self.final_phase()).await?;
        self.cancelled()?;
        let art = in_phase("artifact", self.write_artifact()).await?;
        in_phase("deliver", self.deliver(art)).await
    }

    async fn checkpoint_phase(&self, phase: &'static str, payload: Value) {
        self.flusher.event(
            "phase",
            json!({"v": self.fp, "phase": phase, "payload": payload}),
        );
        self.crash.phase(&self.flusher, phase).await;
    }

    /// A validated JSON phase (outline, perspectives): two tries, then a
    /// job-level retry.
    async fn structured(
        &self,
        what: &str,
        prompt: String,
        format: Value,
        validate: impl Fn(&Value) -> Result<Value, String>,
    ) -> Result<Value, Error> {
        let mut why = String::new();
        for _ in 0..2 {
            self.cancelled()?;
            let policy = SectionPolicy {
                response_format: Some(format.clone()),
                ..self.cfg.section_policy.clone()
            };
            let r = self
                .section(
                    Arc::new(NoTools),
                    Arc::new(PhaseCalls {
                        flusher: self.flusher.clone(),
                        tags: json!({"v": self.fp, "phase": what}),
                    }),
                    policy,
                    SectionInput {
                        system: report::SYSTEM.into(),
                        section_prompt: prompt.clone(),
                        ..Default::default()
                    },
                    json!({"phase": what}),
                )
                .await;
            match r.outcome {
                SectionOutcome::Completed { text } => {
                    match serde_json::from_str::<Value>(text.trim())
                        .map_err(|e| e.to_string())
                        .and_then(|v| validate(&v))
                    {
                        Ok(v) => return Ok(v),
                        Err(e) => why = e,
                    }
                }
                other => return Err(stop_of(other, what)),
            }
        }
        Err(Error::retryable(format!("{what}: no valid answer ({why})")))
    }

    /// The final document's sections, in order, from the first unrecorded one.
    async fn final_phase(&mut self) -> Result<(), Error> {
        let outline = self.state.outline.clone().expect("outline");
        let experts = self.state.experts.clone().expect("experts");
        for i in 0..self.input.sections {
            if self.state.finals.contains_key(&i) {
                continue;
            }
            self.cancelled()?;
            let secs: Vec<&SectionCk> = (0..self.input.experts)
                .filter_map(|e| self.state.sections.get(&(e, i)))
                .collect();
            let title = &outline.sections[i].title;
            let ck = if !secs.iter().any(|s| s.completed()) {
                FinalCk {
                    index: i,
                    content: report::missing_section(title, &secs, &experts),
                    missing: true,
                    unsynthesized: false,
                }
            } else {
                let r = self
                    .section(
                        Arc::new(NoTools),
                        Arc::new(PhaseCalls {
                            flusher: self.flusher.clone(),
                            tags: json!({"v": self.fp, "phase": "final", "index": i}),
                        }),
                        self.cfg.section_policy.clone(),
                        SectionInput {
                            system: report::SYSTEM.into(),
                            section_prompt: self.input.final_prompt(&outline, i),
                            rolling_context: report::contributions(&experts, &secs),
                            initial: None,
                        },
                        json!({"phase": "final", "index": i}),
                    )
                    .await;
                match r.outcome {
                    SectionOutcome::Completed { text } => FinalCk {
                        index: i,
                        content: text,
                        missing: false,
                        unsynthesized: false,
                    },
                    SectionOutcome::Skipped { reason } => FinalCk {
                        index: i,
                        content: report::unsynthesized(&experts, &secs, &reason),
                        missing: false,
                        unsynthesized: true,
                    },
                    other => return Err(stop_of(other, &format!("final section {}", i + 1))),
                }
            };
            self.flusher.event(
                "phase",
                json!({"v": self.fp, "phase": "final", "payload": ck}),
            );
            self.state.finals.insert(i, ck);
            self.done.fetch_add(1, Ordering::SeqCst);
            self.progress(Resume::Final);
            self.crash.final_section(&self.flusher).await;
        }
        Ok(())
    }

    fn skipped_sections(&self) -> Vec<String> {
        let experts = self.state.experts.as_deref().unwrap_or_default();
        let mut v: Vec<_> = self
            .state
            .sections
            .values()
            .filter(|s| !s.completed())
            .collect();
        v.sort_by_key(|s| (s.index, s.expert));
        v.iter()
            .map(|s| {
                format!(
                    "{}. {} ({})",
                    s.index + 1,
                    s.title,
                    experts.get(s.expert).map_or("?", |e| e.name.as_str())
                )
            })
            .collect()
    }

    /// The recovery facts: what the resume read of earlier attempts (all
    /// epochs: what earlier owners did happened, even if fenced off now)
    /// plus this attempt's own retries, as its flusher queued them. No
    /// second read of the job's log.
    async fn recovery(&self) -> Recovery {
        let mut r = Recovery {
            stale_reclaims: self.ctx.record().stale_reclaims,
            attempts: self.ctx.record().attempts,
            notes: self.notes.clone(),
            claims: self.history.claims,
            retries: self.history.retries.clone(),
            refused_retries: self.history.refused_retries,
        };
        let own = self.flusher.stats.retries();
        for (scope, n) in own.by_scope {
            *r.retries.entry(scope).or_default() += n;
        }
        r.refused_retries += own.refused;
        r
    }
}

/// The `research` kind, as the `leasehold-worker` binary registers it on
/// its [`leasehold::Worker`]: a kind like any user's, built on the SDK's
/// public API only (its checkpoints, event log, artifact store, owner
/// proof and the agent runtime's building blocks).
///
/// ```no_run
/// # async fn f() -> anyhow::Result<()> {
/// let cfg = leasehold_research::ResearchConfig::from_env()?;
/// leasehold::Worker::from_env()
///     .kind("research", leasehold_research::Research::with_config(cfg))
///     .run()
///     .await
/// # }
/// ```
#[derive(Default)]
pub struct Research {
    config: Option<ResearchConfig>,
}

impl Research {
    /// Runs every attempt with this configuration (read and validated once,
    /// at start). A [`Default`] one reads the environment at each attempt.
    pub fn with_config(config: ResearchConfig) -> Self {
        Research {
            config: Some(config),
        }
    }
}

/// The `research-expert` kind: one expert's sections of a research job
/// run with `"expert_jobs": true`, as its child job. The worker binary
/// serves it beside [`Research`].
#[derive(Default)]
pub struct ResearchExpert {
    config: Option<ResearchConfig>,
}

impl ResearchExpert {
    /// Runs every attempt with this configuration.
    pub fn with_config(config: ResearchConfig) -> Self {
        ResearchExpert {
            config: Some(config),
        }
    }
}

#[leasehold::async_trait]
impl leasehold::Kind for ResearchExpert {
    fn version(&self) -> &str {
        WORKFLOW_VERSION
    }

    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        match &self.config {
            Some(c) => run_expert(ctx, c).await,
            None => run_expert(ctx, &ResearchConfig::from_env()?).await,
        }
    }
}

fn report_of(r: &JobResult) -> Option<Report> {
    Some(Report {
        artifact: r.artifact.clone()?,
        digest: r.digest.clone().unwrap_or_default(),
        partial: r.partial,
        skipped_sections: r.skipped_sections.clone(),
    })
}

#[leasehold::async_trait]
impl leasehold::Kind for Research {
    fn version(&self) -> &str {
        WORKFLOW_VERSION
    }

    async fn run(&self, ctx: &Ctx) -> Result<Value, Error> {
        match &self.config {
            Some(c) => run(ctx, c).await,
            None => run(ctx, &ResearchConfig::from_env()?).await,
        }
    }
}
