//! The handler trait through which workflows plug in, and the built-in kinds
//! used by tests, the demo and benchmarks.
//!
//! A handler runs one claimed attempt of a job. It never writes the job
//! record's status itself: it returns an [`Outcome`] or a [`HandlerError`],
//! and the runner writes it through the owner-checked gate. It must return
//! promptly when [`JobCtx::cancel`] fires (ownership lost, cancellation, or
//! shutdown handoff).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use leasehold_core::JobRecord;
use leasehold_proto::JobResult;
use leasehold_store::events::{Events, Fence, FenceError};
use leasehold_store::{Conn, Gate};
use serde_json::{json, Value};
use tokio::sync::Mutex;
use tokio_util::sync::CancellationToken;

/// What one attempt ended with.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    Completed(JobResult),
    /// Stop for a person: a refusal, an uncertain external effect, a loop.
    Parked {
        reason: String,
        message: String,
        /// The step that asked the person (an SDK kind's `ctx.park`, a
        /// remote kind's `park` op), written into the `parked` event: an
        /// answer (`review resume --answer`) names it, and only that step
        /// takes it. `None`: a park no step asked for an answer.
        step: Option<String>,
    },
}

/// Error classes of a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorClass {
    /// Worth another attempt (with backoff) while the retry budget lasts.
    Retryable,
    /// Never retried.
    Terminal,
    /// A budget of the job (cost, tokens, deadline) ran out: never retried.
    BudgetExhausted,
    /// The attempt stopped because its cancel token fired.
    Cancelled,
}

/// A failed attempt.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{message}")]
pub struct HandlerError {
    pub class: ErrorClass,
    pub message: String,
    /// What the attempt produced before it stopped (a cancelled or
    /// budget-exhausted research job's partial report): kept as the
    /// record's `result` (with `partial: true`) of the job that ends.
    pub partial: Option<Box<JobResult>>,
    /// The least delay before the next attempt of a retryable error (the
    /// retry policy's backoff when longer): the job waits queued.
    pub retry_after: Option<std::time::Duration>,
}

impl HandlerError {
    fn of(class: ErrorClass, m: impl Into<String>) -> Self {
        HandlerError {
            class,
            message: m.into(),
            partial: None,
            retry_after: None,
        }
    }
    pub fn retryable(m: impl Into<String>) -> Self {
        Self::of(ErrorClass::Retryable, m)
    }
    pub fn terminal(m: impl Into<String>) -> Self {
        Self::of(ErrorClass::Terminal, m)
    }
    pub fn budget_exhausted(m: impl Into<String>) -> Self {
        Self::of(ErrorClass::BudgetExhausted, m)
    }
    pub fn cancelled() -> Self {
        Self::of(ErrorClass::Cancelled, "cancelled")
    }
    /// The same error, carrying what the attempt produced before it stopped.
    pub fn with_partial(mut self, partial: Option<Box<JobResult>>) -> Self {
        self.partial = partial;
        self
    }
    /// The same error, retried not before `after`.
    pub fn with_retry_after(mut self, after: std::time::Duration) -> Self {
        self.retry_after = Some(after);
        self
    }
    pub fn class_name(&self) -> &'static str {
        match self.class {
            ErrorClass::Retryable => "retryable",
            ErrorClass::Terminal => "terminal",
            ErrorClass::BudgetExhausted => "budget_exhausted",
            ErrorClass::Cancelled => "cancelled",
        }
    }
}

/// Everything a handler may use for one attempt.
#[derive(Clone)]
pub struct JobCtx {
    /// The record as claimed (epoch, attempts, spec, ...).
    pub record: JobRecord,
    /// The spec's input object.
    pub input: Value,
    /// Fires when the attempt must stop (ownership lost, cancel, handoff).
    pub cancel: CancellationToken,
    /// Set before `cancel` fires when the stop is a cancel someone asked
    /// for (not a lost claim, a hand-back or the deadline): the attempt's
    /// stop watcher decides it, once, for every handler.
    pub cancel_asked: Arc<std::sync::atomic::AtomicBool>,
    /// Owner-checked writes of this claim.
    pub gate: Gate,
    /// This owner's fenced event publisher.
    pub fence: Arc<Mutex<Fence>>,
    pub conn: Conn,
}

impl JobCtx {
    /// Publishes an event of this owner under the server-side fence.
    pub async fn emit(&self, ty: &str, data: Value) -> Result<u64, FenceError> {
        self.fence.lock().await.publish(ty, data).await
    }
}

/// A kind of job.
#[async_trait]
pub trait Handler: Send + Sync + 'static {
    async fn run(&self, ctx: JobCtx) -> Result<Outcome, HandlerError>;
}

/// `echo`: the result is the input.
pub struct Echo;

#[async_trait]
impl Handler for Echo {
    async fn run(&self, ctx: JobCtx) -> Result<Outcome, HandlerError> {
        Ok(Outcome::Completed(JobResult {
            output: ctx.input.to_string(),
            ..Default::default()
        }))
    }
}

/// `sleep`: input `{"ms": N}`; sleeps (the runner heartbeats meanwhile).
pub struct Sleep;

#[async_trait]
impl Handler for Sleep {
    async fn run(&self, ctx: JobCtx) -> Result<Outcome, HandlerError> {
        let ms = ctx.input.get("ms").and_then(Value::as_u64).unwrap_or(0);
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(ms)) => {
                Ok(Outcome::Completed(JobResult { output: json!({"slept_ms": ms}).to_string(), ..Default::default() }))
            }
            _ = ctx.cancel.cancelled() => Err(HandlerError::cancelled()),
        }
    }
}

/// `fail`: input `{"class": "retryable"|"terminal", "times": N, "ms": M}`:
/// runs for M milliseconds (default 0), then fails while fewer than N
/// attempts have failed, then succeeds. `{"class": "park"}` parks the job
/// for a person instead, and completes once resumed (when the job already
/// has a `parked` event).
pub struct Fail;

#[async_trait]
impl Handler for Fail {
    async fn run(&self, ctx: JobCtx) -> Result<Outcome, HandlerError> {
        let ms = ctx.input.get("ms").and_then(Value::as_u64).unwrap_or(0);
        if ms > 0 {
            tokio::select! {
                _ = tokio::time::sleep(Duration::from_millis(ms)) => {}
                _ = ctx.cancel.cancelled() => return Err(HandlerError::cancelled()),
            }
        }
        let times = ctx
            .input
            .get("times")
            .and_then(Value::as_u64)
            .unwrap_or(u64::MAX);
        let failed = u64::from(ctx.record.attempts);
        if ctx.input.get("class").and_then(Value::as_str) == Some("park") {
            let parked_before = Events::new(&ctx.conn)
                .last_of_type(&ctx.record.id, "parked")
                .await
                .map_err(|e| HandlerError::retryable(format!("reading the job's events: {e}")))?
                .is_some();
            if !parked_before {
                return Ok(Outcome::Parked {
                    reason: "injected".into(),
                    message: "a park for review (test kind)".into(),
                    step: None,
                });
            }
            return Ok(Outcome::Completed(JobResult {
                output: json!({"resumed": true}).to_string(),
                ..Default::default()
            }));
        }
        if failed < times {
            let m = format!("injected failure {} of {times}", failed + 1);
            return Err(match ctx.input.get("class").and_then(Value::as_str) {
                Some("terminal") => HandlerError::terminal(m),
                _ => HandlerError::retryable(m),
            });
        }
        Ok(Outcome::Completed(JobResult {
            output: json!({"failed_attempts": failed}).to_string(),
            ..Default::default()
        }))
    }
}

/// `crash`: aborts the worker process (for poison-job and crash tests).
pub struct Crash;

#[async_trait]
impl Handler for Crash {
    async fn run(&self, ctx: JobCtx) -> Result<Outcome, HandlerError> {
        tracing::warn!(job = %ctx.record.id, "crash job: aborting this worker process");
        std::process::abort();
    }
}

/// The built-in handlers by kind.
pub fn builtins() -> Vec<(String, Arc<dyn Handler>)> {
    vec![
        ("echo".into(), Arc::new(Echo) as Arc<dyn Handler>),
        ("sleep".into(), Arc::new(Sleep)),
        ("fail".into(), Arc::new(Fail)),
        ("crash".into(), Arc::new(Crash)),
        (
            "deliver".into(),
            Arc::new(crate::deliver::Deliver::default()),
        ),
    ]
}
