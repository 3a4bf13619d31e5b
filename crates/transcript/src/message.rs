//! Typed chat messages in the OpenAI Chat Completions message format.
//!
//! The transcript crate speaks the wire format directly so that a transcript
//! read from a journal or from `leasehold transcript repair` round-trips byte
//! for byte in meaning: `{"role":"assistant","content":null,"tool_calls":[...]}`
//! in, the same out. Content given as an array of text parts (newer OpenAI
//! clients do this) is accepted and flattened to one string.

use serde::{Deserialize, Deserializer, Serialize};

/// One message of a tool-calling conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "lowercase")]
pub enum Message {
    /// Instructions. `developer` (OpenAI's newer name) is read as `system`.
    #[serde(alias = "developer")]
    System {
        #[serde(deserialize_with = "text_content")]
        content: String,
    },
    /// A user turn; the section prompt is one of these.
    User {
        #[serde(deserialize_with = "text_content")]
        content: String,
    },
    /// A model turn: text, tool-call proposals, or both.
    Assistant {
        #[serde(default, deserialize_with = "opt_text_content")]
        content: Option<String>,
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        tool_calls: Vec<ToolCall>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        refusal: Option<String>,
        /// Set by leasehold when it journals a response that never reached its
        /// terminal signal. Such a message is never sent to a provider: the
        /// sanitizer drops it, which is why this extension field is safe.
        #[serde(default, rename = "lh_partial", skip_serializing_if = "is_false")]
        partial: bool,
    },
    /// The result of one tool call, matched to it by `tool_call_id`.
    Tool {
        tool_call_id: String,
        #[serde(deserialize_with = "text_content")]
        content: String,
    },
}

/// A tool call proposed by the model.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type", default = "function_kind")]
    pub kind: String,
    pub function: FunctionCall,
}

/// The function part of a tool call. `arguments` is the JSON text exactly as
/// the model produced it; it may not parse, which is the tool layer's problem.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    #[serde(default)]
    pub arguments: String,
}

fn function_kind() -> String {
    "function".to_string()
}

fn is_false(b: &bool) -> bool {
    !*b
}

impl ToolCall {
    /// A function tool call.
    pub fn new(
        id: impl Into<String>,
        name: impl Into<String>,
        arguments: impl Into<String>,
    ) -> Self {
        ToolCall {
            id: id.into(),
            kind: function_kind(),
            function: FunctionCall {
                name: name.into(),
                arguments: arguments.into(),
            },
        }
    }
}

impl Message {
    /// A system message.
    pub fn system(content: impl Into<String>) -> Self {
        Message::System {
            content: content.into(),
        }
    }
    /// A user message.
    pub fn user(content: impl Into<String>) -> Self {
        Message::User {
            content: content.into(),
        }
    }
    /// A complete assistant text answer.
    pub fn assistant(content: impl Into<String>) -> Self {
        Message::Assistant {
            content: Some(content.into()),
            tool_calls: Vec::new(),
            refusal: None,
            partial: false,
        }
    }
    /// A complete assistant message proposing tool calls.
    pub fn assistant_calls(calls: Vec<ToolCall>) -> Self {
        Message::Assistant {
            content: None,
            tool_calls: calls,
            refusal: None,
            partial: false,
        }
    }
    /// A tool result.
    pub fn tool(tool_call_id: impl Into<String>, content: impl Into<String>) -> Self {
        Message::Tool {
            tool_call_id: tool_call_id.into(),
            content: content.into(),
        }
    }

    /// The role as the wire format spells it.
    pub fn role(&self) -> &'static str {
        match self {
            Message::System { .. } => "system",
            Message::User { .. } => "user",
            Message::Assistant { .. } => "assistant",
            Message::Tool { .. } => "tool",
        }
    }

    /// The tool calls of an assistant message (empty for other roles).
    pub fn tool_calls(&self) -> &[ToolCall] {
        match self {
            Message::Assistant { tool_calls, .. } => tool_calls,
            _ => &[],
        }
    }

    /// A rough size in characters, used for context-window accounting.
    pub fn size_chars(&self) -> usize {
        match self {
            Message::System { content } | Message::User { content } => content.len(),
            Message::Assistant {
                content,
                tool_calls,
                refusal,
                ..
            } => {
                content.as_deref().map_or(0, str::len)
                    + refusal.as_deref().map_or(0, str::len)
                    + tool_calls
                        .iter()
                        .map(|c| c.id.len() + c.function.name.len() + c.function.arguments.len())
                        .sum::<usize>()
            }
            Message::Tool {
                tool_call_id,
                content,
            } => tool_call_id.len() + content.len(),
        }
    }
}

/// Total size of a transcript in characters.
pub fn size_chars(messages: &[Message]) -> usize {
    messages.iter().map(Message::size_chars).sum()
}

/// Content may be a string, null, or an array of `{type:"text", text}` parts.
#[derive(Deserialize)]
#[serde(untagged)]
enum RawContent {
    Text(String),
    Parts(Vec<RawPart>),
}

#[derive(Deserialize)]
struct RawPart {
    #[serde(default)]
    text: Option<String>,
}

fn flatten(raw: RawContent) -> String {
    match raw {
        RawContent::Text(s) => s,
        RawContent::Parts(parts) => parts
            .into_iter()
            .filter_map(|p| p.text)
            .collect::<Vec<_>>()
            .join(""),
    }
}

fn text_content<'de, D: Deserializer<'de>>(d: D) -> Result<String, D::Error> {
    Ok(Option::<RawContent>::deserialize(d)?
        .map(flatten)
        .unwrap_or_default())
}

fn opt_text_content<'de, D: Deserializer<'de>>(d: D) -> Result<Option<String>, D::Error> {
    Ok(Option::<RawContent>::deserialize(d)?.map(flatten))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_openai_shapes() {
        let raw = r#"[
            {"role":"system","content":"s"},
            {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]},
            {"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"search","arguments":"{\"q\":1}"}}]},
            {"role":"tool","tool_call_id":"c1","content":"r"},
            {"role":"developer","content":"d"}
        ]"#;
        let msgs: Vec<Message> = serde_json::from_str(raw).unwrap();
        assert_eq!(msgs[1], Message::user("ab"));
        assert_eq!(msgs[2].tool_calls()[0].function.name, "search");
        assert_eq!(msgs[4], Message::system("d"));
        let out = serde_json::to_value(&msgs[2]).unwrap();
        assert_eq!(out["content"], serde_json::Value::Null);
        assert!(out.get("lh_partial").is_none());
    }
}
