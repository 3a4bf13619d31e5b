//! [`Error`]: how an attempt of a kind ends when it does not complete.

use leasehold_agent::SectionOutcome;
use leasehold_core::End;
use leasehold_proto::JobResult;

/// An attempt that did not complete, and what the runtime does about it.
///
/// ```
/// use leasehold::Error;
/// let e = Error::retryable("the supplier API answered 503");
/// assert!(e.to_string().contains("503"));
/// ```
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Error {
    /// Worth another attempt, with the job's backoff, while its attempts last.
    #[error("{0}")]
    Retryable(String),
    /// Worth another attempt, not before `after` (the job's backoff may
    /// make it later): the attempt ends now and the job waits queued,
    /// holding no slot, however long `after` is.
    #[error("{message}")]
    RetryAfter {
        /// Why the attempt ends.
        message: String,
        /// The least time until the next attempt.
        after: std::time::Duration,
    },
    /// Never retried: the job fails with this message.
    #[error("{0}")]
    Terminal(String),
    /// Stop for a person: `leasehold review list` shows the job with the
    /// reason and the message; `review resume` (with `--answer`) or
    /// `review fail` ends the wait.
    #[error("parked ({reason}): {message}")]
    Park {
        /// A short word (`approval`, `uncertain_effect`): the record's `parked_reason`.
        reason: String,
        /// What a person needs to know (and, for `ctx.park`, the question).
        message: String,
    },
    /// Wait, holding no worker: what [`crate::Ctx::sleep`] and
    /// [`crate::Ctx::wait_for`] return the first time (let it propagate
    /// with `?`). The attempt ends, the job is `waiting`, and when its time
    /// or its signal comes it runs again on any worker, where the same step
    /// returns.
    #[error("waiting ({})", .0.step())]
    Wait(crate::Wait),
    /// A budget of the job (steps, tokens, wall time, cost) ran out: never
    /// retried; a [`crate::Report`] set by the attempt is kept as partial.
    #[error("{0}")]
    BudgetExhausted(String),
    /// The attempt must stop: cancelled, its claim lost, or the worker
    /// shutting down. Nothing is written for it.
    #[error("cancelled")]
    Cancelled,
}

impl Error {
    /// A failure worth another attempt.
    pub fn retryable(m: impl Into<String>) -> Error {
        Error::Retryable(m.into())
    }
    /// A failure worth another attempt after `after` at least (no slot
    /// is held meanwhile).
    pub fn retry_after(m: impl Into<String>, after: std::time::Duration) -> Error {
        Error::RetryAfter {
            message: m.into(),
            after,
        }
    }
    /// A failure retrying cannot fix.
    pub fn terminal(m: impl Into<String>) -> Error {
        Error::Terminal(m.into())
    }
    /// A budget ran out.
    pub fn budget_exhausted(m: impl Into<String>) -> Error {
        Error::BudgetExhausted(m.into())
    }
    /// A stop for a person.
    pub fn park(reason: impl Into<String>, message: impl Into<String>) -> Error {
        Error::Park {
            reason: reason.into(),
            message: message.into(),
        }
    }
    /// The class as one low-cardinality word, for a span's `error.type` or
    /// a log: `retryable` (with or without a delay), `terminal`, `parked`,
    /// `waiting`, `budget_exhausted`, `cancelled`.
    ///
    /// ```
    /// assert_eq!(leasehold::Error::park("approval", "ok?").class(), "parked");
    /// ```
    pub fn class(&self) -> &'static str {
        match self {
            Error::Retryable(_) | Error::RetryAfter { .. } => "retryable",
            Error::Terminal(_) => "terminal",
            Error::Park { .. } => "parked",
            Error::Wait(_) => "waiting",
            Error::BudgetExhausted(_) => "budget_exhausted",
            Error::Cancelled => "cancelled",
        }
    }
    /// This attempt may no longer act (its record or event write was
    /// refused): it stops, writing nothing.
    pub(crate) fn stopped(why: impl Into<String>) -> Error {
        tracing::info!("attempt stops: {}", why.into());
        Error::Cancelled
    }
}

impl Error {
    /// How a model section that did not complete ends its attempt: the one
    /// mapping from the agent runtime's [`SectionOutcome`] to an [`Error`],
    /// used by `ctx.agent` and by the research kind alike, so an exhausted
    /// budget (say) ends the job with the same class whichever path ran
    /// it. `what` names the section in the message. A completed section
    /// gives its text.
    ///
    /// ```
    /// use leasehold::runtime::{BudgetKind, SectionOutcome};
    /// use leasehold::Error;
    /// let e = Error::of_section(SectionOutcome::BudgetExhausted { kind: BudgetKind::Tokens }, "agent `plan`");
    /// assert!(matches!(e, Err(Error::BudgetExhausted(_))));
    /// ```
    pub fn of_section(outcome: SectionOutcome, what: &str) -> Result<String, Error> {
        match outcome {
            SectionOutcome::Completed { text } => Ok(text),
            SectionOutcome::Skipped { reason } => Err(Error::retryable(format!(
                "{what} could not be generated: {reason}"
            ))),
            SectionOutcome::Parked { class, reason } => {
                Err(Error::park(class.to_string(), format!("{what}: {reason}")))
            }
            SectionOutcome::Failed { reason, .. } => {
                Err(Error::terminal(format!("{what}: {reason}")))
            }
            SectionOutcome::BudgetExhausted { kind } => Err(Error::budget_exhausted(format!(
                "{what}: budget exhausted ({kind:?})"
            ))),
            SectionOutcome::Cancelled => Err(Error::Cancelled),
        }
    }
}

impl Error {
    /// The attempt's [`End`]: the one place a kind's error becomes one.
    /// `report` is what the attempt set before it stopped (kept as partial
    /// by a budget's end and a cancel), `step` the step a park asked its
    /// question from.
    pub(crate) fn into_end(self, report: Option<crate::Report>, step: Option<String>) -> End {
        let partial = || {
            report.map(|r| {
                Box::new(JobResult {
                    partial: true,
                    ..r.into_result(String::new())
                })
            })
        };
        match self {
            Error::Retryable(m) => End::retryable(m),
            Error::RetryAfter { message, after } => End::retryable(message).with_retry_after(after),
            Error::Terminal(m) => End::terminal(m),
            Error::Park { reason, message } => End::Parked {
                reason,
                message,
                step,
            },
            Error::Wait(w) => End::Waiting(w),
            Error::BudgetExhausted(m) => End::budget_exhausted(m).with_partial(partial()),
            Error::Cancelled => End::Cancelled { partial: partial() },
        }
    }
}

impl From<serde_json::Error> for Error {
    fn from(e: serde_json::Error) -> Error {
        Error::terminal(format!("JSON: {e}"))
    }
}
