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

pub mod hooks;
pub mod report;
pub mod state;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex as StdMutex};
use std::time::Duration;

use futures::StreamExt;
use leasehold::runtime::{
    format_duration, step_id, AgentTools, BreakerConfig, Budget, BudgetLimits, CallCtx,
    Disposition, GenerationPolicy, Generator, Message, ModelClient, ModelConfig, NoTools,
    OwnerGuard, PriceTable, ProgressUpdate, RunContext, SectionInput, SectionOutcome,
    SectionPolicy, SectionResult, SectionRunner, Thread, ToolError, ToolExecutor, Toolbox,
    ToolboxConfig, TranscriptHook,
};
use leasehold::telemetry::spans;
use leasehold::{BudgetUsed, Checkpoints, Ctx, JobResult, NewDocument, Report, Versions};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

type Flusher = Checkpoints;
use crate::hooks::{Crash, CrashPoint, Journal, PhaseCalls, Reporter, ToolSink};
use crate::report::{Input, Recovery};
use crate::state::{
    validate_experts, validate_outline, Expert, FinalCk, Outline, Resume, SectionCk, State,
};

/// The workflow version: bump when checkpoint meaning changes.
pub const WORKFLOW_VERSION: &str = "research/1";

/// Artifact metadata keys: the version fingerprint it was made under, and the
/// result facts (title, skipped sections) a later attempt needs to finish.
const META_VERSION: &str = "lh-version";
const META_TITLE: &str = "lh-title";
const META_SKIPPED: &str = "lh-skipped";
/// The incarnation of the job that stored the document (its record's
/// `created_at`): an id reused after retention starts a new incarnation,
/// and never adopts an earlier one's document.
const META_INCARNATION: &str = "lh-incarnation";

/// How an attempt ended, when it did not fail.
#[derive(Debug, Clone, PartialEq)]
pub enum ResearchOutcome {
    Completed(JobResult),
    /// Needs a person (a refusal, an uncertain delivery, a loop).
    Parked {
        reason: String,
        message: String,
    },
}

/// Error classes, mapped one to one onto the worker's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    Retryable,
    Terminal,
    /// A budget (cost, tokens, deadline) ran out: never retried.
    BudgetExhausted,
    Cancelled,
}

/// A failed attempt.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct ResearchError {
    pub class: ErrorClass,
    pub message: String,
    /// A cancelled or budget-exhausted job's partial report (the sections
    /// written so far, stored as `<id>/partial.md`), when it has any.
    pub partial: Option<Box<JobResult>>,
}

impl ResearchError {
    fn of(class: ErrorClass, m: impl Into<String>) -> Self {
        ResearchError {
            class,
            message: m.into(),
            partial: None,
        }
    }
    pub fn retryable(m: impl Into<String>) -> Self {
        Self::of(ErrorClass::Retryable, m)
    }
    pub fn terminal(m: impl Into<String>) -> Self {
        Self::of(ErrorClass::Terminal, m)
    }
    pub fn cancelled() -> Self {
        Self::of(ErrorClass::Cancelled, "cancelled")
    }
    pub fn budget_exhausted(m: impl Into<String>) -> Self {
        Self::of(ErrorClass::BudgetExhausted, m)
    }
}

/// Every variable of the workload itself that [`ResearchConfig::from_env`]
/// reads (the model's and the tools' are in `leasehold::runtime::MODEL_ENV_VARS`
/// and `leasehold::runtime::TOOL_ENV_VARS`), with what it means and its default.
pub const ENV_VARS: &[(&str, &str)] = &[
    (
        "LH_RESEARCH_EXPERT_CONCURRENCY",
        "experts written at once per job [default: 3]",
    ),
    (
        "LH_RESEARCH_RETRY_BASE",
        "first generation retry delay ceiling (doubles per retry, full jitter) [default: 500ms]",
    ),
    (
        "LH_RESEARCH_RETRY_CAP",
        "cap of the generation retry delay [default: 20s]",
    ),
    (
        "LH_RESEARCH_BREAKER_COOL_DOWN",
        "how long the model circuit breaker stays open [default: 15s]",
    ),
    (
        "LH_RESEARCH_BREAKER_MIN_CALLS",
        "calls before the breaker may open [default: 10]",
    ),
    (
        "LH_RESEARCH_CRASH_AT",
        "tests only, needs --dev-kinds: abort the worker at a checkpoint (after_phase:P, after_section:K, ...) [default: none]",
    ),
];

/// Configuration of the workload.
///
/// | field | default | env |
/// |---|---|---|
/// | `model` | see `ModelConfig` | `LH_MODEL_*` |
/// | `toolbox` | see `ToolboxConfig` | `LH_SEARCH_URL`, `LH_FETCH_ALLOW`, `LH_PUBLISH_URL`, ... |
/// | `expert_concurrency` | 3 | `LH_RESEARCH_EXPERT_CONCURRENCY` |
/// | `generation.base` / `.cap` | 500 ms / 20 s | `LH_RESEARCH_RETRY_BASE` / `LH_RESEARCH_RETRY_CAP` |
/// | `breaker.cool_down` / `.min_calls` | 15 s / 10 | `LH_RESEARCH_BREAKER_COOL_DOWN` / `LH_RESEARCH_BREAKER_MIN_CALLS` |
/// | `crash_at` | none | `LH_RESEARCH_CRASH_AT` (tests: `after_phase:outline`, `after_section:K`, `after_tool_result:K`, `after_model_response:K`, `mid_final:K`, `after_artifact`, `after_delivery`) |
///
/// Durations need a unit (`500ms`, `3s`, `2m`). The worker reads this once
/// at start and refuses to run when a value is bad, so no job fails later
/// for a configuration error.
#[derive(Debug, Clone)]
pub struct ResearchConfig {
    pub model: ModelConfig,
    pub toolbox: ToolboxConfig,
    pub expert_concurrency: usize,
    pub section_policy: SectionPolicy,
    pub generation: GenerationPolicy,
    pub breaker: BreakerConfig,
    pub crash_at: Option<CrashPoint>,
}

impl ResearchConfig {
    pub fn from_env() -> Result<Self, ResearchError> {
        Self::from_lookup(&|k| std::env::var(k).ok())
    }

    /// Like [`ResearchConfig::from_env`] with an explicit variable source
    /// (tests). Every error names the variable.
    pub fn from_lookup(get: &dyn Fn(&str) -> Option<String>) -> Result<Self, ResearchError> {
        let var = |k: &str| get(k).filter(|v| !v.trim().is_empty());
        let bad = |k: &str, v: &str, e: &dyn std::fmt::Display| {
            ResearchError::terminal(format!("{k}={v}: {e}"))
        };
        let dur =
            |k: &str| leasehold::runtime::env_duration(get, k).map_err(ResearchError::terminal);
        let mut generation = GenerationPolicy::default();
        if let Some(d) = dur("LH_RESEARCH_RETRY_BASE")? {
            generation.base = d;
        }
        if let Some(d) = dur("LH_RESEARCH_RETRY_CAP")? {
            generation.cap = d;
        }
        if generation.cap < generation.base {
            return Err(ResearchError::terminal(format!(
                "LH_RESEARCH_RETRY_CAP ({}) is below LH_RESEARCH_RETRY_BASE ({})",
                format_duration(generation.cap),
                format_duration(generation.base)
            )));
        }
        let mut breaker = BreakerConfig::default();
        if let Some(d) = dur("LH_RESEARCH_BREAKER_COOL_DOWN")? {
            breaker.cool_down = d;
        }
        if let Some(v) = var("LH_RESEARCH_BREAKER_MIN_CALLS") {
            breaker.min_calls = v
                .trim()
                .parse()
                .map_err(|e| bad("LH_RESEARCH_BREAKER_MIN_CALLS", &v, &e))?;
        }
        let expert_concurrency = match var("LH_RESEARCH_EXPERT_CONCURRENCY") {
            Some(v) => v
                .trim()
                .parse::<usize>()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| {
                    bad(
                        "LH_RESEARCH_EXPERT_CONCURRENCY",
                        &v,
                        &"expected a positive integer",
                    )
                })?,
            None => 3,
        };
        let crash_at = match var("LH_RESEARCH_CRASH_AT") {
            Some(v) => Some(
                CrashPoint::parse(v.trim())
                    .ok_or_else(|| bad("LH_RESEARCH_CRASH_AT", &v, &"unknown crash point"))?,
            ),
            None => None,
        };
        Ok(ResearchConfig {
            model: ModelConfig::from_lookup(get)
                .map_err(|e| ResearchError::terminal(e.to_string()))?,
            toolbox: ToolboxConfig::from_lookup(get)
                .map_err(|e| ResearchError::terminal(e.to_string()))?,
            expert_concurrency,
            section_policy: SectionPolicy::default(),
            generation,
            breaker,
            crash_at,
        })
    }
}

/// Why a phase stopped the run.
enum Stop {
    Park { reason: String, message: String },
    Err(ResearchError),
}

impl Stop {
    /// A low-cardinality name for spans (`error.type`).
    fn class(&self) -> &'static str {
        match self {
            Stop::Park { .. } => "parked",
            Stop::Err(e) => match e.class {
                ErrorClass::Retryable => "retryable",
                ErrorClass::Terminal => "terminal",
                ErrorClass::BudgetExhausted => "budget_exhausted",
                ErrorClass::Cancelled => "cancelled",
            },
        }
    }
}

/// Runs `fut` as the phase `name`: a `phase` span around it, marked failed
/// when the phase stops the run.
async fn in_phase<T>(
    name: &str,
    fut: impl std::future::Future<Output = Result<T, Stop>>,
) -> Result<T, Stop> {
    let span = spans::phase(name);
    let r = fut.instrument(span.clone()).await;
    if let Err(stop) = &r {
        spans::record_error(&span, stop.class());
    }
    r
}

/// How a section that did not complete stops the run: the SDK's one
/// mapping ([`leasehold::Error::of_section`]), a park kept a park.
fn stop_of(outcome: SectionOutcome, what: &str) -> Stop {
    match leasehold::Error::of_section(outcome, what) {
        Err(leasehold::Error::Park { reason, message }) => Stop::Park { reason, message },
        Err(e) => Stop::Err(e.into()),
        // A completed section is never a stop: the callers match it first.
        Ok(_) => Stop::Err(ResearchError::cancelled()),
    }
}

/// Runs one attempt of a research job.
pub async fn run(ctx: &Ctx, cfg: &ResearchConfig) -> Result<ResearchOutcome, ResearchError> {
    let input = Input::parse(ctx.input_json()).map_err(ResearchError::terminal)?;
    let flusher = ctx.checkpoints().clone();
    let res = Job::prepare(ctx, cfg, input, flusher.clone()).await;
    let res = match res {
        Ok(job) => job.run().await,
        Err(e) => Err(Stop::Err(e)),
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
        return Err(ResearchError::cancelled());
    }
    if let Some(why) = flusher.refused() {
        return Err(ResearchError::retryable(format!(
            "a checkpoint was refused by the event stream ({why}); the job is retried from its last checkpoint"
        )));
    }
    match res {
        Ok(mut r) => match flushed {
            Ok(Ok(())) => {
                // The completing attempt's flusher figures ride along in the
                // output so `make bench` reads them from the record, not logs.
                if let Ok(Value::Object(mut o)) = serde_json::from_str::<Value>(&r.output) {
                    o.insert("checkpoints".into(), summary);
                    r.output = Value::Object(o).to_string();
                }
                Ok(ResearchOutcome::Completed(r))
            }
            _ => Err(ResearchError::retryable("checkpoints could not be flushed")),
        },
        Err(Stop::Park { reason, message }) => Ok(ResearchOutcome::Parked { reason, message }),
        Err(Stop::Err(e)) => Err(e),
    }
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
    ) -> Result<Job<'a>, ResearchError> {
        let spec = ctx.record().spec.clone().unwrap_or_default();
        let mut model = cfg.model.clone();
        if let Some(m) = spec.model.as_ref().and_then(|m| m.model.clone()) {
            model.model = m;
        }
        let ledger = ctx.effects_ledger().await.map_err(ResearchError::from)?;
        let toolbox = Toolbox::builtin(
            &cfg.toolbox,
            Some(ledger),
            Arc::new(ToolSink(flusher.clone())),
        )
        .map_err(|e| ResearchError::terminal(e.to_string()))?;
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
        let client = ModelClient::new(model).map_err(|e| ResearchError::terminal(e.to_string()))?;
        let generator = Arc::new(Generator::new(
            client,
            cfg.generation.clone(),
            cfg.breaker.clone(),
        ));
        let b = spec.budget.unwrap_or_default();
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
        ctx.set_versions(versions.clone())
            .await
            .map_err(ResearchError::from)?;
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
            .await
            .map_err(ResearchError::from)?;
        let draft = State::rebuild(&events, &fp, input.experts, input.sections);
        if let Some(from) = draft.journal_from(input.experts, input.sections) {
            let mut journal = reader
                .read_from("journal", from)
                .await
                .map_err(ResearchError::from)?;
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

    fn cancelled(&self) -> Result<(), Stop> {
        if self.work.is_cancelled() {
            Err(Stop::Err(ResearchError::cancelled()))
        } else {
            Ok(())
        }
    }

    async fn run(mut self) -> Result<JobResult, Stop> {
        match self.run_phases().await {
            Err(Stop::Err(e))
                if matches!(e.class, ErrorClass::Cancelled | ErrorClass::BudgetExhausted) =>
            {
                let partial = self.partial_report(&e).await;
                Err(Stop::Err(ResearchError { partial, ..e }))
            }
            r => r,
        }
    }

    /// A cancelled or budget-exhausted job's partial report, stored as
    /// `<id>/partial.md` (overwritten by a later attempt's: it is never
    /// delivered, so no key depends on its digest), when the outline and
    /// the experts are known and at least one section was written. `None`
    /// otherwise, or when it cannot be stored (the job's end matters more).
    async fn partial_report(&self, e: &ResearchError) -> Option<Box<JobResult>> {
        // A stop that is not the job's end (ownership lost, a hand-back at
        // shutdown) keeps nothing: only a cancel someone asked for, of the
        // job as this attempt still holds it, or the budget.
        if e.class == ErrorClass::Cancelled && !self.ctx.cancel_requested() {
            return None;
        }
        let outline = self.state.outline.as_ref()?;
        let experts = self.state.experts.as_deref()?;
        let mut sections: BTreeMap<(usize, usize), SectionCk> = self
            .state
            .sections
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        for s in self.fresh.lock().expect("fresh sections").iter() {
            sections.insert((s.expert, s.index), s.clone());
        }
        if !sections.values().any(|s| s.completed()) && self.state.finals.is_empty() {
            return None;
        }
        let why = match e.class {
            ErrorClass::BudgetExhausted => format!("its budget ran out ({})", e.message),
            _ => "the job was cancelled".to_string(),
        };
        let skipped: Vec<String> = outline
            .sections
            .iter()
            .enumerate()
            .flat_map(|(i, o)| {
                let sections = &sections;
                experts
                    .iter()
                    .enumerate()
                    .filter(move |(x, _)| !sections.get(&(*x, i)).is_some_and(|s| s.completed()))
                    .map(move |(_, ex)| format!("{}. {} ({})", i + 1, o.title, ex.name))
            })
            .collect();
        let recovery = self.recovery().await;
        let doc = report::partial_document(
            &self.report_doc(outline, experts, &sections, &skipped, &recovery),
            &why,
        );
        let name = format!("{}/partial.md", self.ctx.id());
        let store = self.ctx.artifacts().await.ok()?;
        let _ = store.delete(&name).await;
        let new = NewDocument {
            name: name.clone(),
            description: Some(format!("partial research report of job {}", self.ctx.id())),
            metadata: [
                (META_VERSION.to_string(), self.fp.clone()),
                (
                    META_INCARNATION.to_string(),
                    self.ctx.record().created_at.clone(),
                ),
            ]
            .into(),
        };
        match store.create(new, doc.as_bytes()).await {
            Ok(_) => Some(Box::new(JobResult {
                artifact: Some(name),
                digest: Some(report::sha256_hex(&doc)),
                partial: true,
                skipped_sections: skipped,
                ..Default::default()
            })),
            Err(err) => {
                tracing::warn!(job = %self.ctx.id(), error = %err, "the partial report could not be stored");
                None
            }
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

    async fn run_phases(&mut self) -> Result<JobResult, Stop> {
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
        let fresh = in_phase("experts", self.experts_phase()).await?;
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
    ) -> Result<Value, Stop> {
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
        Err(Stop::Err(ResearchError::retryable(format!(
            "{what}: no valid answer ({why})"
        ))))
    }

    async fn experts_phase(&self) -> Result<Vec<SectionCk>, Stop> {
        let ne = self.input.experts;
        let results: Vec<Result<Vec<SectionCk>, Stop>> = futures::stream::iter(0..ne)
            .map(|e| async move {
                let r = self.expert(e).await;
                if r.is_err() {
                    self.work.cancel();
                }
                r
            })
            .buffer_unordered(self.cfg.expert_concurrency.max(1))
            .collect()
            .await;
        let mut out = Vec::new();
        let mut first: Option<Stop> = None;
        for r in results {
            match r {
                Ok(v) => out.extend(v),
                // Prefer the real cause over the siblings' cancellations.
                Err(Stop::Err(e)) if e.class == ErrorClass::Cancelled => {
                    first.get_or_insert(Stop::Err(e));
                }
                Err(s) => {
                    if matches!(
                        &first,
                        None | Some(Stop::Err(ResearchError {
                            class: ErrorClass::Cancelled,
                            ..
                        }))
                    ) {
                        first = Some(s);
                    }
                }
            }
        }
        match first {
            Some(s) => Err(s),
            None => Ok(out),
        }
    }

    /// One expert's sections, in order, from its first unrecorded one.
    async fn expert(&self, e: usize) -> Result<Vec<SectionCk>, Stop> {
        let outline = self.state.outline.as_ref().expect("outline");
        let experts = self.state.experts.as_ref().expect("experts");
        let expert = &experts[e];
        let mut summary = String::new();
        let mut out = Vec::new();
        for i in 0..self.input.sections {
            if let Some(s) = self.state.sections.get(&(e, i)) {
                summary = s.summary.clone();
                continue;
            }
            self.cancelled()?;
            let title = outline.sections[i].title.clone();
            let prompt = self.input.section_prompt(outline, expert, i);
            let journal = self.state.journals.get(&(e, i)).cloned();
            let (outcome, thread, model_calls, tool_calls) = match journal
                .as_ref()
                .and_then(|t| finished_answer(t, &prompt))
            {
                // The answer was journaled but its checkpoint was not: no call.
                Some(text) => (
                    SectionOutcome::Completed { text },
                    journal.clone().unwrap_or(Thread {
                        generation: 0,
                        messages: vec![],
                    }),
                    0,
                    0,
                ),
                None => {
                    let span = spans::section(i, &expert.name);
                    let tools = Arc::new(AgentTools {
                        toolbox: self.toolbox.clone(),
                        job_id: self.ctx.id().to_string(),
                        incarnation: self.ctx.record().created_at.clone(),
                        epoch: self.ctx.epoch(),
                        conversation: format!("e{e}.s{i}"),
                        offered: vec!["search".into(), "fetch".into()],
                        guard: self.owner.clone(),
                        events: Arc::new(ToolSink(self.flusher.clone())),
                    });
                    let hook = Arc::new(Journal {
                        flusher: self.flusher.clone(),
                        fp: self.fp.clone(),
                        expert: e,
                        index: i,
                        crash: self.crash.clone(),
                    });
                    let r = self
                        .section(
                            tools,
                            hook,
                            self.cfg.section_policy.clone(),
                            SectionInput {
                                system: report::SYSTEM.into(),
                                section_prompt: prompt,
                                rolling_context: summary.clone(),
                                initial: journal,
                            },
                            json!({"expert": e, "index": i}),
                        )
                        .instrument(span.clone())
                        .await;
                    match &r.outcome {
                        SectionOutcome::Completed { .. } => {
                            spans::record_outcome(&span, "completed")
                        }
                        SectionOutcome::Skipped { .. } => spans::record_outcome(&span, "skipped"),
                        _ => spans::record_error(&span, "stopped"),
                    }
                    (r.outcome, r.thread, r.model_calls, r.tool_calls)
                }
            };
            let ck = match outcome {
                SectionOutcome::Completed { text } => {
                    let mut sources = report::urls_in(&text);
                    for u in fetched_urls(&thread) {
                        if !sources.contains(&u) {
                            sources.push(u);
                        }
                    }
                    SectionCk {
                        expert: e,
                        index: i,
                        title: title.clone(),
                        status: "completed".into(),
                        summary: report::roll_summary(&summary, &title, Some(&text)),
                        content: text,
                        sources,
                        reason: None,
                        model_calls,
                        tool_calls,
                    }
                }
                SectionOutcome::Skipped { reason } => {
                    self.skipped.fetch_add(1, Ordering::SeqCst);
                    SectionCk {
                        expert: e,
                        index: i,
                        title: title.clone(),
                        status: "skipped".into(),
                        content: String::new(),
                        summary: report::roll_summary(&summary, &title, None),
                        sources: vec![],
                        reason: Some(reason),
                        model_calls,
                        tool_calls,
                    }
                }
                other => {
                    return Err(stop_of(
                        other,
                        &format!("section {} of {}", i + 1, expert.name),
                    ))
                }
            };
            summary = ck.summary.clone();
            self.flusher
                .event("section", json!({"v": self.fp, "payload": ck}));
            self.done.fetch_add(1, Ordering::SeqCst);
            self.progress(Resume::Experts);
            self.crash.section(&self.flusher).await;
            self.fresh.lock().expect("fresh sections").push(ck.clone());
            out.push(ck);
        }
        Ok(out)
    }

    /// The final document's sections, in order, from the first unrecorded one.
    async fn final_phase(&mut self) -> Result<(), Stop> {
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

    fn artifact_name(&self) -> String {
        format!("{}/report.md", self.ctx.id())
    }

    /// The job's stored artifact, if any. Once it exists it *is* the job's
    /// document, whatever version made it: only the delivery and the
    /// completion remain, and rewriting it would change its digest and so
    /// the delivery's idempotency key.
    /// Whether a stored document's metadata names this job's incarnation
    /// (documents stored before the stamp existed count as this job's).
    fn ours(&self, meta: &std::collections::HashMap<String, String>) -> bool {
        meta.get(META_INCARNATION)
            .is_none_or(|c| *c == self.ctx.record().created_at)
    }

    async fn stored_artifact(&self) -> Result<Option<Artifact>, Stop> {
        let artifacts = self.ctx.artifacts().await.map_err(ResearchError::from)?;
        let name = self.artifact_name();
        match artifacts.get(&name).await.map_err(ResearchError::from)? {
            Some(obj) if !self.ours(&obj.metadata) => {
                // An earlier job of this id left it (its retention did not
                // remove it): not this job's document. It goes, so this
                // job stores its own.
                tracing::warn!(job = %self.ctx.id(), "a stored report of an earlier job with this id is removed, not adopted");
                artifacts.delete(&name).await.map_err(ResearchError::from)?;
                Ok(None)
            }
            Some(obj) => {
                let doc = obj.text();
                let meta = &obj.metadata;
                Ok(Some(Artifact {
                    title: meta.get(META_TITLE).cloned().unwrap_or_default(),
                    skipped: meta
                        .get(META_SKIPPED)
                        .and_then(|s| serde_json::from_str(s).ok())
                        .unwrap_or_default(),
                    version: meta.get(META_VERSION).cloned().unwrap_or_default(),
                    name,
                    doc,
                }))
            }
            None => Ok(None),
        }
    }

    /// Assembles the document and stores it under the job id.
    async fn write_artifact(&self) -> Result<Artifact, Stop> {
        let outline = self.state.outline.as_ref().expect("outline");
        let experts = self.state.experts.as_deref().expect("experts");
        let skipped = self.skipped_sections();
        // Everything before this point durable, so the appendix can count it.
        self.flusher
            .barrier()
            .await
            .map_err(|_| Stop::Err(ResearchError::cancelled()))?;
        let recovery = self.recovery().await;
        let sections: BTreeMap<_, _> = self
            .state
            .sections
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        let doc =
            report::document(&self.report_doc(outline, experts, &sections, &skipped, &recovery));
        let art = Artifact {
            name: self.artifact_name(),
            title: outline.title.trim().to_string(),
            skipped,
            version: self.fp.clone(),
            doc,
        };
        // The result's facts travel with the document, so a later attempt
        // can deliver and complete from the artifact alone.
        let new = NewDocument {
            name: art.name.clone(),
            description: Some(format!("research report of job {}", self.ctx.id())),
            metadata: [
                (META_VERSION.to_string(), art.version.clone()),
                (META_TITLE.to_string(), art.title.clone()),
                (META_SKIPPED.to_string(), json!(art.skipped).to_string()),
                (
                    META_INCARNATION.to_string(),
                    self.ctx.record().created_at.clone(),
                ),
            ]
            .into(),
        };
        // Still the owner, proven by a write. The create below is
        // conditional anyway: an owner that pauses after this proof can
        // still never overwrite another attempt's document.
        self.prove_owner().await?;
        let created = self
            .ctx
            .artifacts()
            .await
            .map_err(ResearchError::from)?
            .create(new, art.doc.as_bytes())
            .await
            .map_err(ResearchError::from)?;
        if created {
            self.crash.at(CrashPoint::AfterArtifact);
            return Ok(art);
        }
        // Another attempt stored the job's document first: it is the
        // job's document, and this one is dropped (one of an earlier
        // job with this id is removed instead, and this attempt's
        // retry stores its own).
        tracing::warn!(job = %self.ctx.id(), "artifact already stored by another attempt: not overwritten, adopting the stored one");
        self.stored_artifact().await?.ok_or_else(|| {
            Stop::Err(ResearchError::retryable(
                "the stored artifact was an earlier job's (removed) or could not be read back",
            ))
        })
    }

    /// Proves ownership with a fenced write of the record, right before a
    /// write effect; lost ownership stops the attempt.
    async fn prove_owner(&self) -> Result<(), Stop> {
        self.owner.prove_now().await.map_err(|e| match e {
            ToolError::OwnershipLost(_) => {
                tracing::warn!(job = %self.ctx.id(), error = %e, "ownership lost before a write effect; stopping");
                Stop::Err(ResearchError::cancelled())
            }
            e => Stop::Err(ResearchError::retryable(e.to_string())),
        })
    }

    /// The delivery (once, by its key) and the result.
    async fn deliver(&self, art: Artifact) -> Result<JobResult, Stop> {
        let digest = report::sha256_hex(&art.doc);
        self.flusher.event(
            "phase",
            json!({"v": self.fp, "phase": "artifact", "payload": {"name": art.name, "digest": digest, "version": art.version}}),
        );
        self.progress(Resume::Publish);
        self.cancelled()?;
        // The delivery's identity is the job's publish step: an attempt with
        // another document is refused (and parks), never sent.
        let call = CallCtx::new(self.ctx.id(), step_id("publish", 0), self.ctx.epoch())
            .of_incarnation(&self.ctx.record().created_at)
            .guarded(self.owner.clone());
        let title = clip_title(if art.title.trim().is_empty() {
            &self.input.topic
        } else {
            &art.title
        });
        let args = json!({"title": title, "document": art.doc, "format": "markdown"});
        let out = match self.toolbox.call(&call, "publish", &args).await {
            Ok(o) => o,
            Err(e) => {
                return Err(match e.disposition() {
                    Disposition::Retry => Stop::Err(ResearchError::retryable(e.to_string())),
                    Disposition::Stop => {
                        tracing::warn!(job = %self.ctx.id(), error = %e, "delivery refused: ownership lost");
                        Stop::Err(ResearchError::cancelled())
                    }
                    Disposition::Park => Stop::Park {
                        reason: e.class().into(),
                        message: format!(
                            "delivery of {} (document digest {digest}): {e}",
                            art.name
                        ),
                    },
                    _ => Stop::Err(ResearchError::terminal(format!("delivery: {e}"))),
                })
            }
        };
        self.crash.at(CrashPoint::AfterDelivery);
        self.flusher.event(
            "phase",
            json!({"v": self.fp, "phase": "delivered", "payload": {"key": out.key, "outcome": out.outcome, "digest": digest}}),
        );
        Ok(JobResult {
            artifact: Some(art.name),
            partial: !art.skipped.is_empty(),
            skipped_sections: art.skipped,
            digest: Some(digest),
            output: json!({
                "title": title,
                "delivery": {"key": out.key, "outcome": out.outcome},
                "sections": self.input.sections,
                "experts": self.input.experts,
            })
            .to_string(),
        })
    }
}

impl From<leasehold::Error> for ResearchError {
    fn from(e: leasehold::Error) -> Self {
        match e {
            leasehold::Error::Retryable(m) => ResearchError::retryable(m),
            leasehold::Error::RetryAfter { message, .. } => ResearchError::retryable(message),
            leasehold::Error::Terminal(m) => ResearchError::terminal(m),
            leasehold::Error::BudgetExhausted(m) => ResearchError::budget_exhausted(m),
            leasehold::Error::Park { reason, message } => {
                ResearchError::terminal(format!("parked ({reason}): {message}"))
            }
            leasehold::Error::Cancelled => ResearchError::cancelled(),
        }
    }
}

impl From<ResearchError> for Stop {
    fn from(e: ResearchError) -> Self {
        Stop::Err(e)
    }
}

/// The `research` kind, as the `leasehold-worker` binary registers it on
/// its [`leasehold::Worker`]: a kind like any user's, built on the SDK's
/// public API only (its checkpoints, event log, artifact store, owner
/// proof and the agent runtime's building blocks).
///
/// ```no_run
/// # async fn f() -> anyhow::Result<()> {
/// let cfg = leasehold_research::ResearchConfig::from_env().map_err(|e| anyhow::anyhow!(e.message))?;
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

    async fn run(&self, ctx: &Ctx) -> Result<Value, leasehold::Error> {
        let cfg = match &self.config {
            Some(c) => c.clone(),
            None => {
                ResearchConfig::from_env().map_err(|e| leasehold::Error::terminal(e.message))?
            }
        };
        match run(ctx, &cfg).await {
            Ok(ResearchOutcome::Completed(r)) => {
                if let Some(rep) = report_of(&r) {
                    ctx.set_report(rep);
                }
                Ok(serde_json::from_str(&r.output)?)
            }
            Ok(ResearchOutcome::Parked { reason, message }) => {
                Err(leasehold::Error::park(reason, message))
            }
            Err(e) => {
                if let Some(rep) = e.partial.as_deref().and_then(report_of) {
                    ctx.set_report(rep);
                }
                Err(match e.class {
                    ErrorClass::Retryable => leasehold::Error::Retryable(e.message),
                    ErrorClass::Terminal => leasehold::Error::Terminal(e.message),
                    ErrorClass::BudgetExhausted => leasehold::Error::BudgetExhausted(e.message),
                    ErrorClass::Cancelled => leasehold::Error::Cancelled,
                })
            }
        }
    }
}

/// The stored document and the result facts kept with it.
struct Artifact {
    name: String,
    doc: String,
    title: String,
    skipped: Vec<String>,
    version: String,
}

/// A journaled thread that already ends in the section's final answer.
fn finished_answer(t: &Thread, prompt: &str) -> Option<String> {
    let prompt_at = t
        .messages
        .iter()
        .rposition(|m| matches!(m, Message::User { content } if content == prompt))?;
    match t.messages.last()? {
        Message::Assistant {
            content: Some(c),
            tool_calls,
            refusal: None,
            partial: false,
        } if tool_calls.is_empty() && !c.trim().is_empty() && t.messages.len() > prompt_at + 1 => {
            Some(c.clone())
        }
        _ => None,
    }
}

/// URLs the section fetched (its sources even if the text cites none).
fn fetched_urls(t: &Thread) -> Vec<String> {
    t.messages
        .iter()
        .flat_map(|m| m.tool_calls().to_vec())
        .filter(|c| c.function.name == "fetch")
        .filter_map(|c| {
            serde_json::from_str::<Value>(&c.function.arguments)
                .ok()
                .and_then(|a| a["url"].as_str().map(str::to_string))
        })
        .collect()
}

/// The publish tool's schema bounds a title (`maxLength` 300 characters);
/// a small model's outline title can be a paragraph (SmolLM2-135M wrote
/// 330 characters), which failed the finished job at its delivery. Longer
/// titles are cut at a word where there is one, marked with an ellipsis.
const PUBLISH_TITLE_MAX: usize = 300;

fn clip_title(title: &str) -> String {
    let title = title.trim();
    if title.chars().count() <= PUBLISH_TITLE_MAX {
        return title.to_string();
    }
    let head: String = title.chars().take(PUBLISH_TITLE_MAX - 1).collect();
    let head = match head.rfind(char::is_whitespace) {
        Some(i) if i > PUBLISH_TITLE_MAX / 2 => head[..i].trim_end(),
        _ => head.as_str(),
    };
    format!("{head}…")
}

#[cfg(test)]
mod config_tests {
    use super::*;

    #[test]
    fn a_delivery_title_fits_the_publish_schema() {
        assert_eq!(clip_title("  Leases  "), "Leases");
        let long = "What is this assignment? ".repeat(14);
        let t = clip_title(&long);
        assert!(t.chars().count() <= PUBLISH_TITLE_MAX, "{t}");
        assert!(t.ends_with("assignment?…") || t.ends_with('…'), "{t}");
        assert!(!t.contains("  "));
        // No whitespace to cut at: cut anywhere, on a char boundary.
        let t = clip_title(&"é".repeat(400));
        assert_eq!(t.chars().count(), PUBLISH_TITLE_MAX);
    }

    #[test]
    fn every_variable_read_is_listed_for_help() {
        let read = StdMutex::new(Vec::new());
        ResearchConfig::from_lookup(&|k| {
            read.lock().unwrap().push(k.to_string());
            None
        })
        .unwrap();
        let listed: Vec<&str> = ENV_VARS
            .iter()
            .chain(leasehold::runtime::MODEL_ENV_VARS)
            .chain(leasehold::runtime::TOOL_ENV_VARS)
            .map(|(k, _)| *k)
            .collect();
        let read = read.into_inner().unwrap();
        assert!(read.len() > 10, "{read:?}");
        for k in read {
            assert!(listed.contains(&k.as_str()), "{k} is read but not listed");
        }
    }

    #[test]
    fn a_bad_value_names_its_variable() {
        for (k, v) in [
            ("LH_RESEARCH_RETRY_BASE", "500"),
            ("LH_RESEARCH_BREAKER_COOL_DOWN", "a while"),
            ("LH_RESEARCH_EXPERT_CONCURRENCY", "0"),
            ("LH_RESEARCH_CRASH_AT", "somewhere"),
            ("LH_MODEL_IDLE_TIMEOUT", "30"),
            ("LH_MODEL_BASE_URL", "localhost:8000/v1"),
            ("LH_PUBLISH_URL", "hooks"),
        ] {
            let e = ResearchConfig::from_lookup(&|q| (q == k).then(|| v.to_string())).unwrap_err();
            assert!(e.message.contains(k), "{k}={v}: {}", e.message);
        }
        let e = ResearchConfig::from_lookup(&|q| match q {
            "LH_RESEARCH_RETRY_BASE" => Some("2s".into()),
            "LH_RESEARCH_RETRY_CAP" => Some("1s".into()),
            _ => None,
        })
        .unwrap_err();
        assert!(e.message.contains("LH_RESEARCH_RETRY_CAP"), "{}", e.message);
    }
}
