//! The `research` kind: an adapter from the worker's [`Handler`] to
//! [`leasehold_research::run`]. The workflow lives in its own crate; this
//! file only maps the context in and the outcome and error classes out.

use async_trait::async_trait;
use leasehold_research::{ErrorClass as RClass, ResearchConfig, ResearchCtx, ResearchOutcome};

use crate::handler::{Handler, HandlerError, JobCtx, Outcome};

/// Serves `research` jobs.
///
/// The `leasehold-worker` binary reads and validates the configuration once
/// at start ([`ResearchHandler::with_config`]) and refuses to start with a
/// bad variable. A handler made with [`Default`] (the in-process workers of
/// tests) reads the environment at each attempt instead.
#[derive(Default)]
pub struct ResearchHandler {
    config: Option<ResearchConfig>,
}

impl ResearchHandler {
    /// A handler that runs every attempt with this configuration.
    pub fn with_config(config: ResearchConfig) -> Self {
        ResearchHandler {
            config: Some(config),
        }
    }
}

#[async_trait]
impl Handler for ResearchHandler {
    async fn run(&self, ctx: JobCtx) -> Result<Outcome, HandlerError> {
        let cfg = match &self.config {
            Some(c) => c.clone(),
            None => ResearchConfig::from_env().map_err(|e| HandlerError::terminal(e.message))?,
        };
        let rctx = ResearchCtx {
            job_id: ctx.record.id.clone(),
            epoch: ctx.record.epoch,
            worker_id: ctx.gate.owner.worker_id.clone(),
            record: ctx.record.clone(),
            input: ctx.input.clone(),
            cancel: ctx.cancel.clone(),
            cancel_asked: ctx.cancel_asked.clone(),
            gate: ctx.gate.clone(),
            fence: ctx.fence.clone(),
            conn: ctx.conn.clone(),
        };
        match leasehold_research::run(rctx, &cfg).await {
            Ok(ResearchOutcome::Completed(r)) => Ok(Outcome::Completed(r)),
            Ok(ResearchOutcome::Parked { reason, message }) => {
                Ok(Outcome::Parked { reason, message })
            }
            Err(e) => Err(match e.class {
                RClass::Retryable => HandlerError::retryable(e.message),
                RClass::Terminal => HandlerError::terminal(e.message),
                RClass::BudgetExhausted => HandlerError::budget_exhausted(e.message),
                RClass::Cancelled => HandlerError::cancelled(),
            }
            .with_partial(e.partial)),
        }
    }
}
