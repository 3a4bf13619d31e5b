//! Tool events: what the tool layer reports about every call, with its key.
//!
//! The workflow layer implements [`ToolEvents`] to publish them as
//! `lh.events.<job_id>.tool`; tests use [`CollectEvents`].

use std::sync::Mutex;

/// What happened to a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolEventKind {
    /// The tool is about to run (for a write: after `in_flight` was recorded).
    Started,
    /// The tool ran; `ok` says whether it succeeded, `error` why not.
    Finished,
    /// A stored result was returned instead of running again.
    Replayed,
    /// An `in_flight` key was resolved by asking the destination.
    Reconciled,
    /// The call was not run: invalid arguments, a refused destination, key
    /// reuse, or an uncertain effect that parks the job.
    Refused,
}

/// One tool event. Serialized as the payload of a `tool` job event.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ToolEvent {
    pub kind: ToolEventKind,
    pub tool: String,
    /// The idempotency key of the call.
    pub key: String,
    pub job_id: String,
    pub step_id: String,
    pub epoch: u64,
    /// RFC 3339 UTC.
    pub at: String,
    /// For `finished`: whether the call succeeded.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ok: Option<bool>,
    /// Error class (`ToolError::class`) when something failed or was refused.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// A human-readable detail (reason, attempt number, which key was replayed).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
}

/// A sink for tool events. Emitting must not block for long; implementations
/// that publish to NATS should hand the event to a task.
pub trait ToolEvents: Send + Sync {
    fn emit(&self, ev: ToolEvent);
}

/// Drops every event (the CLI without `--job`).
#[derive(Debug, Default)]
pub struct NoEvents;

impl ToolEvents for NoEvents {
    fn emit(&self, _ev: ToolEvent) {}
}

/// Keeps every event in memory (tests).
#[derive(Debug, Default)]
pub struct CollectEvents {
    events: Mutex<Vec<ToolEvent>>,
}

impl CollectEvents {
    pub fn new() -> Self {
        Self::default()
    }

    /// A copy of the events so far.
    pub fn events(&self) -> Vec<ToolEvent> {
        self.events.lock().expect("events lock").clone()
    }

    /// The kinds of the events so far, in order.
    pub fn kinds(&self) -> Vec<ToolEventKind> {
        self.events().iter().map(|e| e.kind).collect()
    }
}

impl ToolEvents for CollectEvents {
    fn emit(&self, ev: ToolEvent) {
        self.events.lock().expect("events lock").push(ev);
    }
}

impl<T: ToolEvents + ?Sized> ToolEvents for std::sync::Arc<T> {
    fn emit(&self, ev: ToolEvent) {
        (**self).emit(ev)
    }
}
