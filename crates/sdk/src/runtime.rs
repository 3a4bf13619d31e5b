//! The building blocks under [`crate::Ctx::agent`], for a kind that drives
//! its conversations itself, as the research workload does: several
//! conversations in parallel, each journaled into the kind's own
//! checkpoints ([`crate::Ctx::checkpoints`]), sharing one budget and one
//! generator, with the built-in `search`, `fetch` and `publish` tools.
//!
//! A [`SectionRunner`] runs one conversation with everything `ctx.agent`
//! has (generation retries, warm then cold retries, context sanitation and
//! compaction, budgets, the breaker, the fallback model, loop detection,
//! schema validation with one repair round). Its [`TranscriptHook`] sees
//! every message as it is added (journal it, and the conversation resumes
//! warm after a crash), its [`RetryReporter`] every retry decision.
//!
//! ```no_run
//! use std::sync::{Arc, Mutex};
//! use leasehold::runtime::*;
//! # async fn f(ctx: &leasehold::Ctx) -> Result<(), leasehold::Error> {
//! let client = ModelClient::new(ModelConfig::from_env().map_err(|e| leasehold::Error::terminal(e.to_string()))?)
//!     .map_err(|e| leasehold::Error::terminal(e.to_string()))?;
//! let generator = Arc::new(Generator::new(client, GenerationPolicy::default(), BreakerConfig::default()));
//! let runner = SectionRunner {
//!     generator,
//!     tools: Arc::new(NoTools),
//!     hook: Arc::new(NoHook),
//!     policy: SectionPolicy::default(),
//! };
//! let run = RunContext {
//!     cancel: ctx.cancelled().child_token(),
//!     deadline: None,
//!     budget: Arc::new(Mutex::new(Budget::new(BudgetLimits::default(), PriceTable::default()))),
//!     reporter: Arc::new(NoReports),
//!     watcher: None,
//!     // The worker's flow control: the fleet's limits and pauses apply.
//!     flow: ctx.flow(),
//! };
//! let input = SectionInput { system: "You write.".into(), section_prompt: "Write a haiku.".into(), ..Default::default() };
//! let result = runner.run(input, &run).await;
//! if let SectionOutcome::Completed { text } = result.outcome {
//!     println!("{text}");
//! }
//! # Ok(()) }
//! ```

pub use leasehold_agent::{
    AgentTools, ModelCall, NoHook, NoTools, SectionInput, SectionOutcome, SectionPolicy,
    SectionResult, SectionRunner, ToolExecutor, TranscriptHook,
};
pub use leasehold_core::time::{env_duration, format_duration};
/// A worker's flow control (`RunContext::flow`; a job's is `Ctx::flow`).
pub use leasehold_flow::Flow;
/// What a [`Budget`] has used (the model layer's; the record's is
/// [`crate::BudgetUsed`]).
pub use leasehold_model::BudgetUsed as Spent;
pub use leasehold_model::{
    BreakerConfig, Budget, BudgetKind, BudgetLimits, GenerationPolicy, Generator, ModelClient,
    ModelConfig, PriceTable, Providers, RetryReport, RetryReporter, RunContext, MODEL_ENV_VARS,
};
pub use leasehold_tools::{
    step_id, CallCtx, Disposition, EffectsLedger, OwnerGuard, ToolError, ToolEvent, ToolEvents,
    Toolbox, ToolboxConfig, TOOL_ENV_VARS,
};
pub use leasehold_transcript::{Message, Thread};
pub use leasehold_worker::checkpoint::{FlushStats, Lost, ProgressUpdate, Retries};

/// A [`RetryReporter`] that keeps nothing (retries are still logged).
///
/// ```
/// use leasehold::runtime::{NoReports, RetryReporter};
/// let r: &dyn RetryReporter = &NoReports;
/// ```
pub struct NoReports;

impl RetryReporter for NoReports {
    fn report(&self, r: RetryReport) {
        tracing::debug!(scope = ?r.scope, "retry (not recorded)");
    }
}
