//! Thread generations and the cold rebuild.
//!
//! A warm retry continues the same generation; a cold retry abandons the
//! failed thread's history and starts the next generation from the section
//! prompt plus the rolling context of completed work. The generation number
//! lets a journal tell the two apart.

use serde::{Deserialize, Serialize};

use crate::message::Message;

/// One thread generation of a section: its number and its messages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Thread {
    pub generation: u32,
    pub messages: Vec<Message>,
}

impl Thread {
    /// Generation 0 of a section.
    pub fn first(system: &str, rolling_context: &str, section_prompt: &str) -> Thread {
        Thread {
            generation: 0,
            messages: build_messages(system, rolling_context, section_prompt),
        }
    }

    /// The next generation, built clean: nothing of this thread's history is
    /// carried over except what `rolling_context` says about completed work.
    pub fn cold_rebuild(
        &self,
        system: &str,
        rolling_context: &str,
        section_prompt: &str,
    ) -> Thread {
        Thread {
            generation: self.generation + 1,
            messages: build_messages(system, rolling_context, section_prompt),
        }
    }
}

/// The opening messages of a thread generation. The rolling context joins the
/// system message rather than becoming a user turn, so the section prompt is
/// the only user message and stays findable by exact match.
pub fn build_messages(system: &str, rolling_context: &str, section_prompt: &str) -> Vec<Message> {
    let system = if rolling_context.trim().is_empty() {
        system.to_string()
    } else {
        format!("{system}\n\n## Completed work so far\n{rolling_context}")
    };
    vec![Message::system(system), Message::user(section_prompt)]
}
