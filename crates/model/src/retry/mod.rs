//! The one retry layer: the generation retry loop, its backoff, restart
//! eligibility and retry reports.
//!
//! A failed attempt is retried only when its class is retryable, the attempt
//! is still *eligible* (seed 002: no visible output reached a watcher, the
//! generation did not complete, no unknown or hosted-tool event arrived, not
//! cancelled), attempts remain, and the wait fits before the deadline. The
//! wait is capped exponential backoff with full jitter, never shorter than a
//! server-stated `Retry-After`, and cancellation or the deadline interrupt
//! it. Every decision to retry or not is a [`RetryReport`].

use leasehold_flow::Flow;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::budget::{Budget, BudgetLeft};
use crate::client::{AttemptState, Completion, Watcher};
use crate::error::{FailureClass, ModelError};

mod generator;

pub use generator::Generator;

/// Which unit a retry repeats.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RetryScope {
    /// The current model request, same input.
    Generation,
    /// The same thread, repaired (valid prefix kept).
    Warm,
    /// A new thread generation from the section prompt.
    Cold,
    /// The whole job, from its last checkpoint (the workflow layer's).
    Job,
}

/// One retry decision, as published in `retry` events.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RetryReport {
    pub scope: RetryScope,
    /// Why a retry was considered (the failure) and, if refused, why not.
    pub reason: String,
    /// Whether the retry happens.
    pub eligible: bool,
    /// What the retry keeps (input, messages, tool results).
    pub retained: String,
    /// The attempt number the retry would be (1 = the first try).
    pub attempt: u32,
    pub budget_left: BudgetLeft,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub class: Option<FailureClass>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay_ms: Option<u64>,
    /// The fallback model, when this retry switches to it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_model: Option<String>,
}

impl RetryReport {
    /// A report of the generation's scope, with no delay and no fallback
    /// (set them where they apply).
    pub fn generation(
        reason: String,
        eligible: bool,
        retained: String,
        attempt: u32,
        budget_left: BudgetLeft,
        class: FailureClass,
    ) -> Self {
        let r = (reason, eligible, retained);
        Self::scoped(RetryScope::Generation, r, attempt, budget_left, class)
    }

    /// A report of `scope`: (reason, eligible, retained), with no delay and
    /// no fallback.
    pub fn scoped(
        scope: RetryScope,
        (reason, eligible, retained): (String, bool, String),
        attempt: u32,
        budget_left: BudgetLeft,
        class: FailureClass,
    ) -> Self {
        RetryReport {
            scope,
            reason,
            eligible,
            retained,
            attempt,
            budget_left,
            class: Some(class),
            delay_ms: None,
            fallback_model: None,
        }
    }

    fn at_once(mut self) -> Self {
        self.delay_ms = Some(0);
        self
    }
}

/// Where retry reports go; the workflow layer publishes them as events.
pub trait RetryReporter: Send + Sync {
    fn report(&self, r: RetryReport);
}

/// Drops reports.
pub struct NoopReporter;

impl RetryReporter for NoopReporter {
    fn report(&self, _r: RetryReport) {}
}

/// Keeps reports in memory (tests, `leasehold model check`).
#[derive(Default)]
pub struct CollectingReporter(pub Mutex<Vec<RetryReport>>);

impl CollectingReporter {
    pub fn take(&self) -> Vec<RetryReport> {
        std::mem::take(&mut *self.0.lock().expect("reporter lock"))
    }
}

impl RetryReporter for CollectingReporter {
    fn report(&self, r: RetryReport) {
        self.0.lock().expect("reporter lock").push(r);
    }
}

/// Why a fresh generation retry is refused (seed 002).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Ineligible {
    VisibleOutput,
    Completed,
    UnknownEvent,
    Cancelled,
}

impl std::fmt::Display for Ineligible {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Ineligible::VisibleOutput => "visible output already reached a watcher",
            Ineligible::Completed => "the generation had completed",
            Ineligible::UnknownEvent => "an unknown or hosted-tool event arrived",
            Ineligible::Cancelled => "cancelled",
        })
    }
}

/// The restart-eligibility rule. Partial tool-call fragments do not make an
/// attempt ineligible: they are never executed, so repeating is safe.
pub fn eligibility(state: &AttemptState, cancelled: bool) -> Result<(), Ineligible> {
    if cancelled {
        Err(Ineligible::Cancelled)
    } else if state.completed {
        Err(Ineligible::Completed)
    } else if state.visible_output {
        Err(Ineligible::VisibleOutput)
    } else if state.unknown_event {
        Err(Ineligible::UnknownEvent)
    } else {
        Ok(())
    }
}

/// Tuning of the generation loop.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GenerationPolicy {
    /// Attempts per model, including the first.
    pub max_attempts: u32,
    pub base: Duration,
    pub cap: Duration,
    /// A server asking for a longer wait than this is not retried (the
    /// OpenAI SDK uses two minutes).
    pub max_server_delay: Duration,
}

impl Default for GenerationPolicy {
    fn default() -> Self {
        GenerationPolicy {
            max_attempts: 3,
            base: Duration::from_millis(500),
            cap: Duration::from_secs(20),
            max_server_delay: Duration::from_secs(120),
        }
    }
}

impl GenerationPolicy {
    /// Full jitter: uniform in `[0, min(cap, base * 2^(attempt-1))]`.
    pub fn backoff(&self, attempt: u32) -> Duration {
        use leasehold_time::backoff::{capped_exponential, full_jitter};
        let ceiling = capped_exponential(self.base, self.cap, attempt.saturating_sub(1));
        full_jitter(ceiling, &mut rand::thread_rng())
    }
}

/// Everything a run shares: cancellation, deadline, budget, reporting.
#[derive(Clone)]
pub struct RunContext {
    pub cancel: CancellationToken,
    /// The job's deadline; the budget's wall time also bounds waits.
    pub deadline: Option<Instant>,
    pub budget: Arc<Mutex<Budget>>,
    pub reporter: Arc<dyn RetryReporter>,
    pub watcher: Option<Watcher>,
    /// The flow control every request of this run is admitted by: the
    /// worker's (`JobCtx::flow`) for a job's runs, so the fleet's limits
    /// and pauses apply; [`RunContext::new`] makes one of the run's own.
    pub flow: Arc<Flow>,
}

impl RunContext {
    /// A run with `budget`, no deadline, no reporter, and a flow control of
    /// its own (set [`RunContext::flow`] to the worker's inside a job).
    pub fn new(budget: Budget) -> Self {
        RunContext {
            cancel: CancellationToken::new(),
            deadline: None,
            budget: Arc::new(Mutex::new(budget)),
            reporter: Arc::new(NoopReporter),
            watcher: None,
            flow: Arc::new(Flow::new()),
        }
    }

    pub fn budget_left(&self) -> BudgetLeft {
        self.budget.lock().expect("budget lock").left()
    }

    /// The earlier of the job deadline and the wall-time budget.
    pub fn effective_deadline(&self) -> Option<Instant> {
        let wall = self.budget.lock().expect("budget lock").wall_deadline();
        match (self.deadline, wall) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Reports a retry decision to the run's reporter and keeps it in `into`.
    pub fn emit(&self, r: RetryReport, into: &mut Vec<RetryReport>) {
        // Debug: the decision is also a `retry` event, and the attempt's end
        // (one WARN when it fails) carries the cause.
        tracing::debug!(scope = ?r.scope, eligible = r.eligible, attempt = r.attempt, reason = %r.reason, "retry decision");
        self.reporter.report(r.clone());
        into.push(r);
    }

    /// Waits `delay` unless cancellation or the deadline comes first.
    pub async fn wait(&self, delay: Duration) -> Result<(), ModelError> {
        let until = Instant::now() + delay;
        if self.effective_deadline().is_some_and(|d| d < until) {
            return Err(ModelError::Deadline);
        }
        tokio::select! {
            biased;
            _ = self.cancel.cancelled() => Err(ModelError::Cancelled),
            _ = tokio::time::sleep_until(until) => Ok(()),
        }
    }
}

/// A successful generation.
#[derive(Debug, Clone)]
pub struct Generated {
    pub completion: Completion,
    /// Attempts made, including the successful one.
    pub attempts: u32,
    pub fallback_used: Option<String>,
}

/// A generation that could not be completed, with why.
#[derive(Debug, Clone)]
pub struct GenerationFailure {
    pub error: ModelError,
    pub attempts: u32,
    /// Set when a retryable failure was refused by the eligibility rule.
    pub ineligible: Option<Ineligible>,
}
