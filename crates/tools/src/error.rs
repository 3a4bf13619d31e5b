//! The one error type of the tool layer and its classifier.
//!
//! [`ToolError::disposition`] is the single place that decides what the
//! workflow does with a failed call: give it back to the model, retry the
//! step, park the job for a person, or fail the job.

use std::time::Duration;

/// What the workflow should do with a failed tool call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Disposition {
    /// Hand the error text to the model as the tool result (bad arguments,
    /// a page that is not text, a 404): the model can do something else.
    ReturnToModel,
    /// A transient failure: retrying the step later may succeed.
    Retry,
    /// The outcome of a side effect is unknown or contradictory: stop and
    /// park the job for human review with the reason; never guess.
    Park,
    /// A configuration or ledger fault that retrying will not fix.
    Fail,
    /// This caller may no longer act for the job (a newer owner holds it):
    /// stop the attempt, write nothing. Nothing ran.
    Stop,
}

/// Every way a tool call can fail.
#[derive(Debug, thiserror::Error)]
pub enum ToolError {
    #[error("unknown tool `{0}`")]
    UnknownTool(String),
    #[error("invalid arguments for `{tool}`: {message}")]
    InvalidArgs { tool: String, message: String },
    /// `fetch` refused a destination (private address, not allow-listed, bad scheme).
    #[error("refused: {0}")]
    Refused(String),
    #[error("timed out after {0:?}")]
    Timeout(Duration),
    /// The destination answered with an error status.
    #[error("upstream answered HTTP {status}: {message}")]
    Upstream { status: u16, message: String },
    /// A transport failure after the request may have left (reset, broken
    /// body, DNS of a redirect).
    #[error("transport error: {0}")]
    Transport(String),
    /// The destination could not be reached at all (connection refused or
    /// failed before anything was sent), or could not answer a
    /// reconciliation lookup for now: retry later.
    #[error("unreachable: {0}")]
    Unreachable(String),
    /// A success status with nothing in it: not a result (seed: "a tool that
    /// returns success with an empty body").
    #[error("the destination answered success with an empty body")]
    EmptySuccess,
    /// The answer was not what the tool expects (not JSON, wrong content type).
    #[error("unexpected response: {0}")]
    BadResponse(String),
    /// The same idempotency key was used with different arguments (as Stripe does).
    #[error("idempotency key {key} was first used with different arguments (digest {stored}, now {given}): a step makes one effect")]
    KeyReuse {
        key: String,
        stored: String,
        given: String,
    },
    /// The outcome of an earlier attempt of this write is unknown and cannot be
    /// found out: the job must be parked for review with this reason.
    #[error("uncertain effect for key {key}: {reason}")]
    UncertainEffect { key: String, reason: String },
    /// Another executor took this key over (a newer owner after a reclaim);
    /// this executor must stop.
    #[error("effect key {key} was taken over by another executor: {reason}")]
    Superseded { key: String, reason: String },
    /// The caller's proof of ownership, made right before the effect, was
    /// refused: a newer owner holds the job. The effect did not run.
    #[error("not the job's owner any more: {0}")]
    OwnershipLost(String),
    /// Ownership could not be proven right now (NATS unavailable, the
    /// worker's session not confirmed lately): the effect did not run;
    /// retry later.
    #[error("ownership could not be proven: {0}")]
    OwnershipUnproven(String),
    /// The effects ledger (NATS KV) failed.
    #[error("effects ledger: {0}")]
    Ledger(String),
    #[error("configuration: {0}")]
    Config(String),
}

impl ToolError {
    /// The single classifier: what the workflow does with this error.
    pub fn disposition(&self) -> Disposition {
        match self {
            ToolError::UnknownTool(_)
            | ToolError::InvalidArgs { .. }
            | ToolError::Refused(_)
            | ToolError::BadResponse(_) => Disposition::ReturnToModel,
            ToolError::Upstream { status, .. } => {
                if *status == 429 || *status == 408 || *status >= 500 {
                    Disposition::Retry
                } else {
                    Disposition::ReturnToModel
                }
            }
            ToolError::Timeout(_)
            | ToolError::Transport(_)
            | ToolError::Unreachable(_)
            | ToolError::EmptySuccess
            | ToolError::OwnershipUnproven(_)
            | ToolError::Ledger(_) => Disposition::Retry,
            ToolError::KeyReuse { .. } | ToolError::UncertainEffect { .. } => Disposition::Park,
            ToolError::Superseded { .. } | ToolError::Config(_) => Disposition::Fail,
            ToolError::OwnershipLost(_) => Disposition::Stop,
        }
    }

    /// Whether the step may be retried (the read retry loop uses this).
    pub fn is_retryable(&self) -> bool {
        self.disposition() == Disposition::Retry
    }

    /// A short stable name for events, records and metrics.
    pub fn class(&self) -> &'static str {
        match self {
            ToolError::UnknownTool(_) => "unknown_tool",
            ToolError::InvalidArgs { .. } => "validation",
            ToolError::Refused(_) => "refused",
            ToolError::Timeout(_) => "timeout",
            ToolError::Upstream { .. } => "upstream",
            ToolError::Transport(_) => "transport",
            ToolError::Unreachable(_) => "unreachable",
            ToolError::EmptySuccess => "empty_success",
            ToolError::BadResponse(_) => "bad_response",
            ToolError::KeyReuse { .. } => "key_reuse",
            ToolError::UncertainEffect { .. } => "uncertain_effect",
            ToolError::Superseded { .. } => "superseded",
            ToolError::OwnershipLost(_) => "ownership_lost",
            ToolError::OwnershipUnproven(_) => "ownership_unproven",
            ToolError::Ledger(_) => "ledger",
            ToolError::Config(_) => "config",
        }
    }

    /// Whether the call was refused before the tool ran (bad name or
    /// arguments, a refused destination, a key reused, no ownership).
    pub fn is_refusal(&self) -> bool {
        matches!(
            self,
            ToolError::UnknownTool(_)
                | ToolError::InvalidArgs { .. }
                | ToolError::Refused(_)
                | ToolError::KeyReuse { .. }
                | ToolError::Superseded { .. }
                | ToolError::OwnershipLost(_)
                | ToolError::OwnershipUnproven(_)
                | ToolError::Config(_)
        )
    }

    /// The JSON to hand to the model as the tool result when
    /// [`Disposition::ReturnToModel`] applies.
    pub fn to_tool_result(&self) -> serde_json::Value {
        serde_json::json!({ "error": { "class": self.class(), "message": self.to_string() } })
    }

    /// True when the request certainly did not reach the destination, so an
    /// `in_flight` ledger entry can be withdrawn instead of reconciled.
    pub(crate) fn certainly_not_committed(&self) -> bool {
        matches!(
            self,
            ToolError::InvalidArgs { .. }
                | ToolError::Refused(_)
                | ToolError::Config(_)
                | ToolError::Unreachable(_)
                | ToolError::OwnershipLost(_)
                | ToolError::OwnershipUnproven(_)
        )
    }
}

/// The one rule for "may this request have reached the destination?",
/// decided by the HTTP client's own error kind, never by its message: only
/// a failure to connect (refused, no route, DNS, the TLS handshake: the
/// connector failed, so not one byte of the request was written) or to
/// build the request says "never sent". Everything else (a reset or a
/// closed connection after the request was written, a timeout, a broken
/// answer) may have reached it, and its effect may have happened.
///
/// Built-in tools, the SDK's tools and remote kinds' tools all decide with
/// it, through [`ToolError::from_reqwest`].
///
/// ```
/// # async fn f() {
/// let e = reqwest::Client::new().post("http://127.0.0.1:1/").send().await.unwrap_err();
/// assert!(!leasehold_tools::request_may_have_been_sent(&e));
/// # }
/// ```
pub fn request_may_have_been_sent(e: &reqwest::Error) -> bool {
    !(e.is_connect() || e.is_builder())
}

impl ToolError {
    /// The tool error that says what a failed HTTP call means: a request
    /// that was certainly never sent ([`request_may_have_been_sent`]) is
    /// [`ToolError::Unreachable`] (the only transport failure after which a
    /// write's `in_flight` key is withdrawn); a timeout, a reset after
    /// sending, a broken answer may have had an effect (reconciled with
    /// `find_existing` before any retry). Keep using it for your own
    /// tools' HTTP calls: the decision is then the same everywhere.
    pub fn from_reqwest(e: reqwest::Error, timeout: Duration) -> ToolError {
        if !request_may_have_been_sent(&e) {
            ToolError::Unreachable(chain(&e))
        } else if e.is_timeout() {
            ToolError::Timeout(timeout)
        } else if let Some(s) = e.status() {
            ToolError::Upstream {
                status: s.as_u16(),
                message: e.to_string(),
            }
        } else {
            ToolError::Transport(chain(&e))
        }
    }
}

/// Maps a reqwest error to the tool error that says what happened
/// ([`ToolError::from_reqwest`]).
pub(crate) fn from_reqwest(e: reqwest::Error, timeout: Duration) -> ToolError {
    ToolError::from_reqwest(e, timeout)
}

/// The error with its sources: reqwest's Display alone hides the cause.
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut msg = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        src = s.source();
    }
    msg
}
