//! What a provider accepts, and the request rewritten to fit it.
//!
//! OpenAI-compatible servers differ exactly where agent workloads lean on
//! them. Structured output is `json_schema` at OpenAI, vLLM and LM Studio,
//! `json_object` plus a `schema` at llama-cpp-python, and absent elsewhere;
//! tool calling is native, missing, or refused. Requests are written in the
//! canonical form (`json_schema`, native `tools`, tool messages) and
//! [`shape`] rewrites each one, just before it is sent, into the form this
//! provider takes:
//!
//! | structured form | what is sent |
//! |---|---|
//! | `json_schema` | as written |
//! | `json_object` | `{"type":"json_object","schema":S}`, and the schema in the system message |
//! | `prompt` | no `response_format`; the schema in the system message (validated, one repair round, by the section runner) |
//!
//! | tools form | what is sent |
//! |---|---|
//! | `native` | as written |
//! | `text` | no `tools`; the [text tool protocol](TEXT_TOOL_LINE) in the system message, earlier calls and results as text |
//! | `none` | no `tools`: the model answers without them (the section's report shows no tool calls) |
//!
//! In `auto` mode (the default) a provider starts at the richest form and is
//! moved down once, for the whole process, when it refuses a request's shape
//! (see [`Provider::downgrade`]); `LH_MODEL_STRUCTURED` and `LH_MODEL_TOOLS`
//! force a form instead, and a refusal of a forced form is terminal with
//! the setting to change.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use leasehold_transcript::{Message, ToolCall};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use crate::wire::ChatRequest;

/// How structured output is asked for (`LH_MODEL_STRUCTURED`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StructuredMode {
    /// Learned: `json_schema`, then `json_object`, then `prompt`.
    Auto,
    JsonSchema,
    JsonObject,
    Prompt,
}

/// How tools are offered (`LH_MODEL_TOOLS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolsMode {
    /// Learned: `native`, then `text` once `tools` are refused.
    Auto,
    Native,
    Text,
    None,
}

/// A structured-output form actually sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StructuredForm {
    JsonSchema,
    JsonObject,
    Prompt,
}

/// A tools form actually sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolsForm {
    Native,
    Text,
    None,
}

impl StructuredMode {
    pub fn parse(v: &str) -> Result<Self, String> {
        match v.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "json_schema" => Ok(Self::JsonSchema),
            "json_object" => Ok(Self::JsonObject),
            "prompt" => Ok(Self::Prompt),
            _ => Err(format!(
                "{v:?}: expected auto, json_schema, json_object or prompt"
            )),
        }
    }
    fn first(self) -> StructuredForm {
        match self {
            Self::Auto | Self::JsonSchema => StructuredForm::JsonSchema,
            Self::JsonObject => StructuredForm::JsonObject,
            Self::Prompt => StructuredForm::Prompt,
        }
    }
}

impl ToolsMode {
    pub fn parse(v: &str) -> Result<Self, String> {
        match v.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(Self::Auto),
            "native" => Ok(Self::Native),
            "text" => Ok(Self::Text),
            "none" => Ok(Self::None),
            _ => Err(format!("{v:?}: expected auto, native, text or none")),
        }
    }
    fn first(self) -> ToolsForm {
        match self {
            Self::Auto | Self::Native => ToolsForm::Native,
            Self::Text => ToolsForm::Text,
            Self::None => ToolsForm::None,
        }
    }
}

impl StructuredForm {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::JsonSchema => "json_schema",
            Self::JsonObject => "json_object",
            Self::Prompt => "prompt",
        }
    }
    fn next(self) -> Option<Self> {
        match self {
            Self::JsonSchema => Some(Self::JsonObject),
            Self::JsonObject => Some(Self::Prompt),
            Self::Prompt => None,
        }
    }
}

impl ToolsForm {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Native => "native",
            Self::Text => "text",
            Self::None => "none",
        }
    }
}

/// What the process knows of one provider (base URL + model + modes),
/// shared by every client of it: the forms in use, and whether it ever
/// answered.
#[derive(Debug)]
pub struct Provider {
    key: String,
    structured_mode: StructuredMode,
    tools_mode: ToolsMode,
    forms: Mutex<(StructuredForm, ToolsForm)>,
    answered: AtomicBool,
}

/// What was refused, and what is used from now on.
#[derive(Debug, Clone, PartialEq)]
pub enum Downgrade {
    Structured {
        from: StructuredForm,
        to: StructuredForm,
    },
    Tools {
        from: ToolsForm,
        to: ToolsForm,
    },
}

impl std::fmt::Display for Downgrade {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Downgrade::Structured { from, to } => write!(
                f,
                "structured output {} refused; {} from now on (force with LH_MODEL_STRUCTURED)",
                from.as_str(),
                to.as_str()
            ),
            Downgrade::Tools { from, to } => write!(
                f,
                "tools {} refused; {} from now on (force with LH_MODEL_TOOLS)",
                from.as_str(),
                to.as_str()
            ),
        }
    }
}

/// What the clients that share it know of each provider (by base URL,
/// model and modes): one per worker, shared by every client of its kinds
/// ([`crate::ModelClient::sharing`]), so a form learned from one job's
/// refusal, or an answer seen once, holds for the next job. No process
/// global: a [`crate::ModelClient::new`] has one of its own.
#[derive(Default)]
pub struct Providers(Mutex<HashMap<String, Arc<Provider>>>);

impl std::fmt::Debug for Providers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map_or(0, |m| m.len());
        write!(f, "Providers({n} known)")
    }
}

impl Providers {
    /// The record of this provider.
    pub fn get(
        &self,
        base_url: &str,
        model: &str,
        structured: StructuredMode,
        tools: ToolsMode,
    ) -> Arc<Provider> {
        let key = format!(
            "{} {model} {structured:?} {tools:?}",
            base_url.trim_end_matches('/')
        );
        let mut all = self.0.lock().expect("providers");
        all.entry(key.clone())
            .or_insert_with(|| Arc::new(Provider::new(key, structured, tools)))
            .clone()
    }
}

impl Provider {
    /// A record of its own (tests, `model check`'s probes).
    pub fn new(key: String, structured: StructuredMode, tools: ToolsMode) -> Provider {
        Provider {
            key,
            structured_mode: structured,
            tools_mode: tools,
            forms: Mutex::new((structured.first(), tools.first())),
            answered: AtomicBool::new(false),
        }
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn forms(&self) -> (StructuredForm, ToolsForm) {
        *self.forms.lock().expect("provider forms")
    }

    pub fn modes(&self) -> (StructuredMode, ToolsMode) {
        (self.structured_mode, self.tools_mode)
    }

    /// The provider answered with a well-formed response at least once.
    pub fn has_answered(&self) -> bool {
        self.answered.load(Ordering::Relaxed)
    }

    pub fn mark_answered(&self) {
        self.answered.store(true, Ordering::Relaxed);
    }

    /// After a refusal of `req`'s shape (a bad request) whose message is
    /// `message`: the next form down, when the mode is `auto` and the
    /// refusal can be about the shape that was sent. The tools form moves
    /// when the message names tools; otherwise the structured form does.
    /// `None`: nothing left to try (or the form is forced), the refusal
    /// stands.
    pub fn downgrade(
        &self,
        req: &ChatRequest,
        sent: (StructuredForm, ToolsForm),
        message: &str,
    ) -> Option<Downgrade> {
        let m = message.to_ascii_lowercase();
        let mut forms = self.forms.lock().expect("provider forms");
        let tools_sent = !req.tools.is_empty() && sent.1 == ToolsForm::Native;
        let structured_sent = structured_schema(req).is_some() && sent.0 != StructuredForm::Prompt;
        let about_tools = m.contains("tool") || m.contains("function");
        if tools_sent && self.tools_mode == ToolsMode::Auto && (about_tools || !structured_sent) {
            if forms.1 == ToolsForm::Native {
                forms.1 = ToolsForm::Text;
            }
            return Some(Downgrade::Tools {
                from: sent.1,
                to: forms.1,
            });
        }
        if structured_sent && self.structured_mode == StructuredMode::Auto {
            // Another request may have moved it down already.
            if forms.0 == sent.0 {
                forms.0 = sent.0.next()?;
            }
            return Some(Downgrade::Structured {
                from: sent.0,
                to: forms.0,
            });
        }
        None
    }

    /// What to set when a forced form is refused.
    pub fn forced_hint(
        &self,
        req: &ChatRequest,
        sent: (StructuredForm, ToolsForm),
    ) -> Option<String> {
        if structured_schema(req).is_some() && self.structured_mode != StructuredMode::Auto {
            return Some(format!(
                "the provider refused structured output as {} (LH_MODEL_STRUCTURED={}): set LH_MODEL_STRUCTURED=auto, or a form it accepts (`leasehold model check` lists them)",
                sent.0.as_str(),
                sent.0.as_str()
            ));
        }
        if !req.tools.is_empty() && self.tools_mode == ToolsMode::Native {
            return Some(
                "the provider refused native tools (LH_MODEL_TOOLS=native): set LH_MODEL_TOOLS=auto or text".into(),
            );
        }
        None
    }
}

/// The JSON Schema a request asks its answer to follow, from its canonical
/// `response_format` (`json_schema` form); `Some(None)` for a plain
/// `json_object` request without a schema.
fn structured_schema(req: &ChatRequest) -> Option<Option<Value>> {
    let f = req.response_format.as_ref()?;
    match f.get("type").and_then(Value::as_str) {
        Some("json_schema") => Some(f.pointer("/json_schema/schema").cloned()),
        Some("json_object") => Some(f.get("schema").cloned()),
        _ => None,
    }
}

/// The exact line that introduces the text tool protocol.
pub const TEXT_TOOL_LINE: &str = "To call a tool, reply with only lines of the form <tool_call>{\"name\": \"TOOL\", \"arguments\": {...}}</tool_call> and nothing else.";

fn text_tool_block(tools: &[Value]) -> String {
    let mut s = format!(
        "You have tools. {TEXT_TOOL_LINE} Each result comes back as <tool_result name=\"TOOL\">...</tool_result>. When you have what you need, reply with your answer and no <tool_call>.\nTools (name: description; JSON Schema of the arguments):\n"
    );
    for t in tools {
        let f = t.get("function").unwrap_or(t);
        let name = f.get("name").and_then(Value::as_str).unwrap_or("?");
        let what = f.get("description").and_then(Value::as_str).unwrap_or("");
        let params = f.get("parameters").cloned().unwrap_or(json!({}));
        s.push_str(&format!("- {name}: {what} {params}\n"));
    }
    s
}

fn schema_instruction(schema: &Option<Value>) -> String {
    match schema {
        Some(s) => format!(
            "Reply with only a JSON object (no prose, no code fences) that matches this JSON Schema: {s}"
        ),
        None => "Reply with only a JSON object (no prose, no code fences).".into(),
    }
}

/// Appends `text` to the request's system message (or adds one first).
fn add_system(messages: &mut Vec<Message>, text: &str) {
    if let Some(Message::System { content }) = messages.first_mut() {
        content.push_str("\n\n");
        content.push_str(text);
    } else {
        messages.insert(
            0,
            Message::System {
                content: text.to_string(),
            },
        );
    }
}

/// `req` rewritten in the given forms, ready to send.
pub fn shape(req: &ChatRequest, forms: (StructuredForm, ToolsForm)) -> ChatRequest {
    let mut out = req.clone();
    if let Some(schema) = structured_schema(req) {
        match forms.0 {
            StructuredForm::JsonSchema => {}
            StructuredForm::JsonObject => {
                let mut f = json!({"type": "json_object"});
                if let Some(s) = &schema {
                    f["schema"] = s.clone();
                }
                out.response_format = Some(f);
                add_system(&mut out.messages, &schema_instruction(&schema));
            }
            StructuredForm::Prompt => {
                out.response_format = None;
                add_system(&mut out.messages, &schema_instruction(&schema));
            }
        }
    }
    let has_tool_messages = req.messages.iter().any(|m| {
        matches!(m, Message::Tool { .. })
            || matches!(m, Message::Assistant { tool_calls, .. } if !tool_calls.is_empty())
    });
    if forms.1 != ToolsForm::Native && (!req.tools.is_empty() || has_tool_messages) {
        out.tools.clear();
        out.messages = as_text_messages(&out.messages);
        if forms.1 == ToolsForm::Text && !req.tools.is_empty() {
            add_system(&mut out.messages, &text_tool_block(&req.tools));
        }
    }
    out
}

/// Tool calls and results written as text, for a provider that takes no
/// tool messages.
fn as_text_messages(messages: &[Message]) -> Vec<Message> {
    let mut names: HashMap<String, String> = HashMap::new();
    messages
        .iter()
        .map(|m| match m {
            Message::Assistant {
                content,
                tool_calls,
                ..
            } if !tool_calls.is_empty() => {
                let mut text = content.clone().unwrap_or_default();
                for c in tool_calls {
                    names.insert(c.id.clone(), c.function.name.clone());
                    let args = serde_json::from_str::<Value>(&c.function.arguments)
                        .unwrap_or(Value::String(c.function.arguments.clone()));
                    if !text.is_empty() {
                        text.push('\n');
                    }
                    text.push_str(&format!(
                        "<tool_call>{}</tool_call>",
                        json!({"name": c.function.name, "arguments": args})
                    ));
                }
                Message::assistant(text)
            }
            Message::Tool {
                tool_call_id,
                content,
            } => {
                let name = names
                    .get(tool_call_id)
                    .map(String::as_str)
                    .unwrap_or("tool");
                Message::user(format!(
                    "<tool_result name=\"{name}\">{content}</tool_result>"
                ))
            }
            other => other.clone(),
        })
        .collect()
}

/// Tool calls written in the text protocol, taken out of `content`: the
/// calls (ids `call_<n>`) and the text that is left. Each call's arguments
/// are kept as written, so invalid ones reach the section runner's usual
/// "invalid arguments" answer to the model.
pub fn parse_text_tool_calls(content: &str) -> (Vec<ToolCall>, String) {
    let mut calls = Vec::new();
    let mut rest = String::new();
    let mut s = content;
    while let Some(start) = s.find("<tool_call>") {
        rest.push_str(&s[..start]);
        let after = &s[start + "<tool_call>".len()..];
        let (inner, next) = match after.find("</tool_call>") {
            Some(end) => (&after[..end], &after[end + "</tool_call>".len()..]),
            None => (after, ""),
        };
        let (name, args) = match serde_json::from_str::<Value>(inner.trim()) {
            Ok(v) => (
                v.get("name")
                    .and_then(Value::as_str)
                    .unwrap_or("")
                    .to_string(),
                v.get("arguments")
                    .map(|a| match a {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    })
                    .unwrap_or_else(|| "{}".into()),
            ),
            Err(_) => (String::new(), inner.trim().to_string()),
        };
        calls.push(ToolCall::new(format!("call_{}", calls.len()), name, args));
        s = next;
    }
    rest.push_str(s);
    (calls, rest.trim().to_string())
}

/// A structured answer's JSON, as a model in `prompt` form may wrap it
/// (code fences, a sentence before): the outermost object, when the text
/// is not JSON as it is.
pub fn extract_json(content: &str) -> String {
    let t = content.trim();
    if serde_json::from_str::<Value>(t).is_ok() {
        return t.to_string();
    }
    match (t.find('{'), t.rfind('}')) {
        (Some(a), Some(b)) if a < b && serde_json::from_str::<Value>(&t[a..=b]).is_ok() => {
            t[a..=b].to_string()
        }
        _ => t.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema_req() -> ChatRequest {
        ChatRequest {
            messages: vec![Message::system("sys"), Message::user("go")],
            response_format: Some(
                json!({"type":"json_schema","json_schema":{"name":"o","schema":{"type":"object","required":["title"]}}}),
            ),
            ..Default::default()
        }
    }

    #[test]
    fn structured_forms_are_written_as_each_provider_takes_them() {
        let r = schema_req();
        let same = shape(&r, (StructuredForm::JsonSchema, ToolsForm::Native));
        assert_eq!(same.response_format, r.response_format);
        let obj = shape(&r, (StructuredForm::JsonObject, ToolsForm::Native));
        assert_eq!(
            obj.response_format,
            Some(json!({"type":"json_object","schema":{"type":"object","required":["title"]}}))
        );
        let p = shape(&r, (StructuredForm::Prompt, ToolsForm::Native));
        assert_eq!(p.response_format, None);
        let Message::System { content } = &p.messages[0] else {
            panic!("system first")
        };
        assert!(content.starts_with("sys") && content.contains("\"required\":[\"title\"]"));
    }

    #[test]
    fn text_tools_round_trip_through_the_protocol() {
        let req = ChatRequest {
            messages: vec![
                Message::system("sys"),
                Message::user("go"),
                Message::Assistant {
                    content: None,
                    tool_calls: vec![ToolCall::new("c1", "search", r#"{"q":"x"}"#)],
                    refusal: None,
                    partial: false,
                },
                Message::tool("c1", "results"),
            ],
            tools: vec![crate::function_tool(
                "search",
                "Search.",
                json!({"type":"object"}),
            )],
            ..Default::default()
        };
        let t = shape(&req, (StructuredForm::JsonSchema, ToolsForm::Text));
        assert!(t.tools.is_empty());
        let Message::System { content } = &t.messages[0] else {
            panic!()
        };
        assert!(content.contains(TEXT_TOOL_LINE) && content.contains("- search: Search."));
        assert!(
            matches!(&t.messages[2], Message::Assistant { content: Some(c), tool_calls, .. }
            if tool_calls.is_empty() && c == r#"<tool_call>{"arguments":{"q":"x"},"name":"search"}</tool_call>"#)
        );
        assert!(
            matches!(&t.messages[3], Message::User { content } if content == "<tool_result name=\"search\">results</tool_result>")
        );
        let none = shape(&req, (StructuredForm::JsonSchema, ToolsForm::None));
        assert!(none.tools.is_empty());
        assert!(matches!(&none.messages[0], Message::System { content } if content == "sys"));

        let (calls, rest) = parse_text_tool_calls(
            "Let me look.\n<tool_call>{\"name\": \"search\", \"arguments\": {\"q\": \"leases\"}}</tool_call>\n<tool_call>not json</tool_call>",
        );
        assert_eq!(rest, "Let me look.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].function.name, "search");
        assert_eq!(calls[0].function.arguments, r#"{"q":"leases"}"#);
        assert_eq!(calls[1].function.name, "");
        assert_eq!(parse_text_tool_calls("plain").0.len(), 0);
    }

    #[test]
    fn a_refusal_moves_an_auto_provider_down_once_and_a_forced_one_never() {
        let p = Provider::new("k".into(), StructuredMode::Auto, ToolsMode::Auto);
        let r = schema_req();
        let d = p.downgrade(&r, p.forms(), "Input should be 'text' or 'json_object'");
        assert_eq!(
            d,
            Some(Downgrade::Structured {
                from: StructuredForm::JsonSchema,
                to: StructuredForm::JsonObject
            })
        );
        assert_eq!(p.forms().0, StructuredForm::JsonObject);
        // A second request sent before the move learns it without moving further.
        let again = p.downgrade(&r, (StructuredForm::JsonSchema, ToolsForm::Native), "x");
        assert_eq!(p.forms().0, StructuredForm::JsonObject);
        assert!(again.is_some());
        p.downgrade(&r, p.forms(), "x");
        assert_eq!(p.forms().0, StructuredForm::Prompt);
        assert_eq!(p.downgrade(&r, p.forms(), "x"), None);

        let forced = Provider::new("k".into(), StructuredMode::JsonSchema, ToolsMode::Auto);
        assert_eq!(forced.downgrade(&r, forced.forms(), "x"), None);
        assert!(forced
            .forced_hint(&r, forced.forms())
            .unwrap()
            .contains("LH_MODEL_STRUCTURED"));

        let tools = ChatRequest {
            tools: vec![crate::function_tool("search", "", json!({}))],
            ..schema_req()
        };
        let t = Provider::new("t".into(), StructuredMode::Auto, ToolsMode::Auto);
        assert!(matches!(
            t.downgrade(&tools, t.forms(), "this model does not support tools"),
            Some(Downgrade::Tools {
                to: ToolsForm::Text,
                ..
            })
        ));
        assert!(StructuredMode::parse("json-schema").is_err());
        assert!(ToolsMode::parse("TEXT").is_ok());
    }

    #[test]
    fn json_is_taken_out_of_a_wrapped_answer() {
        assert_eq!(extract_json("```json\n{\"a\":1}\n```"), "{\"a\":1}");
        assert_eq!(extract_json(" {\"a\":1} "), "{\"a\":1}");
        assert_eq!(extract_json("no json"), "no json");
    }
}
