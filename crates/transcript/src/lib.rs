//! The tool-calling transcript state machine: typed messages, warm-retry
//! sanitation, context-window compaction and the cold rebuild.
//!
//! Architecture Invariant: this crate is pure. It has no async runtime, no
//! NATS and no HTTP; everything here is a function of its inputs, which is
//! what lets the table and property tests pin it down exactly.
//!
//! - [`Message`]: OpenAI Chat Completions messages (system, user, assistant
//!   with tool calls, tool results by call id).
//! - [`sanitize`]: the warm-retry repair with its [`SanitizeReport`].
//! - [`compact`]: compaction of a valid transcript after a context failure.
//! - [`Thread`]: thread generations; [`Thread::cold_rebuild`] starts the next.

mod compact;
mod message;
mod sanitize;
mod thread;

pub use compact::{compact, CompactionError, CompactionPolicy, CompactionReport};
pub use message::{size_chars, FunctionCall, Message, ToolCall};
pub use sanitize::{
    check, last_user_prompt, sanitize, DropReason, Entry, Repair, SanitizeReport, Verdict,
    Violation,
};
pub use thread::{build_messages, Thread};

/// The one error of this crate.
#[derive(Debug, thiserror::Error)]
pub enum TranscriptError {
    /// The input is not a JSON array of OpenAI messages.
    #[error("not a JSON array of chat messages: {0}")]
    Json(#[from] serde_json::Error),
    /// Compaction could not produce a sound transcript within its target.
    #[error(transparent)]
    Compaction(#[from] CompactionError),
}

/// Parses an OpenAI-format message array.
pub fn parse_messages(json: &str) -> Result<Vec<Message>, TranscriptError> {
    Ok(serde_json::from_str(json)?)
}
