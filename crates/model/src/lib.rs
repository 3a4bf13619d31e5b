//! `leasehold-model`: the agent runtime's model side.
//!
//! - [`ModelClient`]: an OpenAI-compatible Chat Completions client, streaming
//!   (SSE via `eventsource-stream`) and not, with completion decided at the
//!   protocol layer.
//! - [`ModelError`] / [`FailureClass`]: the one error and its classifier.
//! - [`Generator`]: the one retry layer (generation retries with capped
//!   exponential backoff and full jitter, restart eligibility, circuit
//!   breaker, optional fallback model), reporting [`RetryReport`]s.
//! - [`Budget`]: per-job steps, tokens, wall time and cost.
//! - Every request is admitted first by `leasehold_flow::Flow` against the
//!   fleet's provider limits and pauses (cooldowns, open breakers).
//! - [`adapt`]: what a provider accepts (structured-output and tool-calling
//!   forms, learned from its refusals or forced) and requests shaped for it.
//!
//! Architecture Invariant: nothing below the [`Generator`] retries. reqwest's
//! retries are off and the client returns every failure as it found it.

pub mod adapt;
mod breaker;
mod budget;
mod client;
mod config;
mod error;
pub mod metrics;
mod retry;
mod wire;

pub use adapt::{Provider, Providers, StructuredForm, StructuredMode, ToolsForm, ToolsMode};
pub use breaker::{BreakerConfig, BreakerState, CircuitBreaker};
pub use budget::{Budget, BudgetKind, BudgetLeft, BudgetLimits, BudgetUsed, Price, PriceTable};
pub use client::{AttemptState, Completion, Delta, ModelClient, Watcher};
pub use config::{ModelConfig, Quirks, ENV_VARS as MODEL_ENV_VARS};
pub use error::{parse_retry_after, Action, FailureClass, ModelError};
pub use retry::{
    eligibility, CollectingReporter, Generated, GenerationFailure, GenerationPolicy, Generator,
    Ineligible, NoopReporter, RetryReport, RetryReporter, RetryScope, RunContext,
};
pub use wire::{function_tool, ChatRequest, Usage};
