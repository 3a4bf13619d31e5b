//! Context-window compaction of a *valid* transcript.
//!
//! Compacting a broken transcript only yields a smaller broken transcript, so
//! [`compact`] refuses anything [`check`](crate::check) rejects. It shortens
//! the tool results (and the text of the tool-call messages) of older complete
//! exchanges, keeping every call/result pair so the structure stays the same,
//! then inspects the result again. The section prompt, system messages and
//! the most recent exchanges are never touched.

use serde::{Deserialize, Serialize};

use crate::message::{size_chars, Message};
use crate::sanitize::{check, Violation};

/// How hard to compact.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CompactionPolicy {
    /// Target size of the whole transcript in characters.
    pub max_chars: usize,
    /// Tool-call groups at the end left untouched on the first pass.
    pub keep_recent_groups: usize,
    /// Length an older tool result is cut to.
    pub truncate_to: usize,
}

impl Default for CompactionPolicy {
    fn default() -> Self {
        CompactionPolicy {
            max_chars: 48_000,
            keep_recent_groups: 1,
            truncate_to: 400,
        }
    }
}

/// What compaction did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CompactionReport {
    pub before_chars: usize,
    pub after_chars: usize,
    /// Tool results shortened.
    pub truncated: usize,
}

/// Why compaction could not produce a sound transcript within the target.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CompactionError {
    #[error("refusing to compact an unsound transcript: {0}")]
    Unsound(#[from] Violation),
    #[error("still {chars} chars after compaction (target {max_chars})")]
    DoesNotFit { chars: usize, max_chars: usize },
}

/// Compacts `messages` to at most `policy.max_chars` characters, or says why
/// it cannot. The output passes [`check`] again before it is returned.
pub fn compact(
    messages: &[Message],
    policy: &CompactionPolicy,
) -> Result<(Vec<Message>, CompactionReport), CompactionError> {
    check(messages)?;
    let before = size_chars(messages);
    if before <= policy.max_chars {
        return Ok((
            messages.to_vec(),
            CompactionReport {
                before_chars: before,
                after_chars: before,
                truncated: 0,
            },
        ));
    }
    // First spare the most recent exchanges; if that is not enough, compact
    // every exchange.
    let mut last = (messages.to_vec(), 0);
    for keep in [policy.keep_recent_groups, 0] {
        let (out, truncated) = truncate_older(messages, keep, policy.truncate_to);
        check(&out)?; // inspect again: compaction must not break the structure
        let after = size_chars(&out);
        if after <= policy.max_chars {
            return Ok((
                out,
                CompactionReport {
                    before_chars: before,
                    after_chars: after,
                    truncated,
                },
            ));
        }
        last = (out, truncated);
    }
    Err(CompactionError::DoesNotFit {
        chars: size_chars(&last.0),
        max_chars: policy.max_chars,
    })
}

fn truncate_older(
    messages: &[Message],
    keep_recent_groups: usize,
    truncate_to: usize,
) -> (Vec<Message>, usize) {
    let group_starts: Vec<usize> = messages
        .iter()
        .enumerate()
        .filter(|(_, m)| !m.tool_calls().is_empty())
        .map(|(i, _)| i)
        .collect();
    let boundary = if keep_recent_groups == 0 {
        messages.len()
    } else {
        group_starts
            .len()
            .checked_sub(keep_recent_groups)
            .map_or(0, |k| group_starts[k])
    };
    let mut truncated = 0;
    let out = messages
        .iter()
        .enumerate()
        .map(|(i, m)| match m {
            Message::Tool {
                tool_call_id,
                content,
            } if i < boundary && content.len() > truncate_to => {
                truncated += 1;
                Message::Tool {
                    tool_call_id: tool_call_id.clone(),
                    content: shorten(content, truncate_to),
                }
            }
            Message::Assistant {
                content: Some(text),
                tool_calls,
                refusal,
                partial,
            } if i < boundary && !tool_calls.is_empty() && text.len() > truncate_to => {
                Message::Assistant {
                    content: Some(shorten(text, truncate_to)),
                    tool_calls: tool_calls.clone(),
                    refusal: refusal.clone(),
                    partial: *partial,
                }
            }
            other => other.clone(),
        })
        .collect();
    (out, truncated)
}

fn shorten(text: &str, to: usize) -> String {
    let mut cut = to.min(text.len());
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!(
        "{} [compacted: {} chars elided]",
        &text[..cut],
        text.len() - cut
    )
}
