//! How the simulated model plays a research agent: search, fetch, write.

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// One tool call the model makes.
#[derive(Debug, Clone, PartialEq)]
pub struct Call {
    pub id: String,
    pub name: String,
    /// The arguments as JSON text (not necessarily valid: `malformed_args`).
    pub arguments: String,
}

/// What the model says this turn.
#[derive(Debug, Clone, PartialEq)]
pub enum Turn {
    Text(String),
    /// Native tool calls (`tool_calls`, finish_reason `tool_calls`).
    Tools(Vec<Call>),
    /// Tool calls through the text protocol: content lines
    /// `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, finish_reason `stop`.
    TextTools(Vec<Call>),
    Refusal(String),
}

impl Turn {
    pub fn size(&self) -> usize {
        match self {
            Turn::Text(t) | Turn::Refusal(t) => t.len(),
            Turn::Tools(calls) => calls.iter().map(|c| c.name.len() + c.arguments.len()).sum(),
            Turn::TextTools(calls) => text_calls(calls).len(),
        }
    }

    /// The calls this turn makes, native or through the text protocol.
    pub fn calls_mut(&mut self) -> Option<&mut Vec<Call>> {
        match self {
            Turn::Tools(c) | Turn::TextTools(c) => Some(c),
            _ => None,
        }
    }
}

/// The line that marks a system message as the text tool protocol's block.
pub const TEXT_PROTOCOL_MARK: &str = "<tool_call>{\"name\": ";

/// The text protocol's rendering of `calls`: one
/// `<tool_call>{"name": "NAME", "arguments": {...}}</tool_call>` line each, in
/// Python's `json.dumps` spacing. Arguments that are not JSON are kept as text.
pub fn text_calls(calls: &[Call]) -> String {
    calls
        .iter()
        .map(|c| {
            let args = serde_json::from_str::<Value>(&c.arguments)
                .map(|v| spaced(&v))
                .unwrap_or_else(|_| c.arguments.clone());
            format!(
                "<tool_call>{{\"name\": {}, \"arguments\": {args}}}</tool_call>",
                Value::String(c.name.clone())
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// JSON on one line with `", "` and `": "` separators.
fn spaced(v: &Value) -> String {
    match v {
        Value::Object(map) => {
            let items: Vec<String> = map
                .iter()
                .map(|(k, v)| format!("{}: {}", Value::String(k.clone()), spaced(v)))
                .collect();
            format!("{{{}}}", items.join(", "))
        }
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(spaced).collect();
            format!("[{}]", items.join(", "))
        }
        other => other.to_string(),
    }
}

/// Whether `m` is a tool result of the text protocol (a user message), and
/// if so the tool's name and the result's body.
fn text_result(m: &Value) -> Option<(String, String)> {
    if m["role"] != "user" {
        return None;
    }
    let text = content_of(m);
    let rest = text.trim_start().strip_prefix("<tool_result name=\"")?;
    let (name, rest) = rest.split_once("\">")?;
    let body = rest.trim_end();
    let body = body.strip_suffix("</tool_result>").unwrap_or(body);
    Some((name.to_string(), body.trim().to_string()))
}

/// The calls in an assistant message of the text protocol.
fn text_calls_in(m: &Value) -> Vec<(String, String)> {
    let text = content_of(m);
    let mut out = Vec::new();
    let mut rest = text.as_str();
    while let Some(start) = rest.find("<tool_call>") {
        rest = &rest[start + "<tool_call>".len()..];
        let Some(end) = rest.find("</tool_call>") else {
            break;
        };
        if let Ok(v) = serde_json::from_str::<Value>(rest[..end].trim()) {
            if let Some(name) = v["name"].as_str() {
                out.push((name.to_string(), v["arguments"].to_string()));
            }
        }
        rest = &rest[end..];
    }
    out
}

/// The tool names a text protocol block offers (of those the sim plays).
fn text_protocol_tools(messages: &[Value]) -> Option<Vec<String>> {
    let block: String = messages
        .iter()
        .filter(|m| m["role"] == "system" || m["role"] == "developer")
        .map(content_of)
        .filter(|t| t.contains(TEXT_PROTOCOL_MARK))
        .collect::<Vec<_>>()
        .join("\n");
    if block.is_empty() {
        return None;
    }
    let named: Vec<String> = block
        .split(|c: char| !c.is_alphanumeric() && c != '_')
        .map(str::to_string)
        .collect();
    Some(
        ["search", "fetch"]
            .into_iter()
            .filter(|t| named.iter().any(|w| w == t))
            .map(str::to_string)
            .collect(),
    )
}

/// SplitMix64: a cheap, well-mixed deterministic hash step.
pub fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

pub fn hash64(bytes: &[u8]) -> u64 {
    let d = Sha256::digest(bytes);
    u64::from_be_bytes(d[..8].try_into().expect("8 bytes"))
}

fn content_of(m: &Value) -> String {
    match m.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect(),
        _ => String::new(),
    }
}

/// Whether `m` is a user message that is the prompt (not a text protocol
/// tool result).
fn is_prompt(m: &Value) -> bool {
    m["role"] == "user" && text_result(m).is_none()
}

/// The last user message's text (text protocol tool results are not the user's).
pub fn last_user(messages: &[Value]) -> String {
    messages
        .iter()
        .rev()
        .find(|m| is_prompt(m))
        .map(content_of)
        .unwrap_or_default()
}

fn words(text: &str, n: usize) -> Vec<String> {
    text.split(|c: char| !c.is_alphanumeric() && c != '-')
        .filter(|w| !w.is_empty())
        .take(n)
        .map(str::to_lowercase)
        .collect()
}

/// The first `"url"` string anywhere in a JSON value (search results).
fn first_url(v: &Value) -> Option<String> {
    match v {
        Value::Object(map) => {
            if let Some(Value::String(u)) = map.get("url") {
                return Some(u.clone());
            }
            // Look at `results` first so a top-level list wins over nested data.
            map.get("results")
                .and_then(first_url)
                .or_else(|| map.values().find_map(first_url))
        }
        Value::Array(items) => items.iter().find_map(first_url),
        _ => None,
    }
}

/// A call made earlier in the turn: (id, name, arguments).
type Made = (String, String, String);

/// Decides the next turn from the request, as `provider` would.
pub fn decide(
    req: &Value,
    messages: &[Value],
    host: &str,
    seed: u64,
    provider: super::provider::Provider,
) -> Turn {
    let prompt = last_user(messages);
    let topic = || {
        // The topic is the first quoted phrase, when the prompt has one.
        prompt
            .split('"')
            .nth(1)
            .filter(|t| !t.trim().is_empty())
            .map(str::to_string)
            .unwrap_or_else(|| words(&prompt, 4).join(" "))
    };
    if let Some(fmt) = req.get("response_format") {
        match fmt.get("type").and_then(Value::as_str) {
            Some("json_schema") => {
                let schema = fmt
                    .pointer("/json_schema/schema")
                    .cloned()
                    .unwrap_or(json!({"type": "object"}));
                return Turn::Text(
                    super::schema::instance(&schema, &schema, &topic(), 0).to_string(),
                );
            }
            Some("json_object") => {
                if let Some(schema) = fmt.get("schema").filter(|_| provider.json_object_schema()) {
                    return Turn::Text(
                        super::schema::instance(schema, schema, &topic(), 0).to_string(),
                    );
                }
                return Turn::Text(
                    json!({"answer": words(&prompt, 8).join(" "), "ok": true}).to_string(),
                );
            }
            _ => {}
        }
    }
    let text_tools = text_protocol_tools(messages);
    let tools: Vec<String> = match &text_tools {
        Some(t) => t.clone(),
        None if provider.takes_tools() => req
            .get("tools")
            .and_then(Value::as_array)
            .map(|ts| {
                ts.iter()
                    .filter_map(|t| {
                        t.pointer("/function/name")
                            .and_then(Value::as_str)
                            .map(str::to_string)
                    })
                    .collect()
            })
            .unwrap_or_default(),
        None => Vec::new(),
    };
    let query = words(&prompt, 10).join(" ");
    let slug = words(&prompt, 4).join("-");
    let fallback = format!("http://{host}/page/{slug}");
    let start = messages.iter().rposition(is_prompt).map_or(0, |i| i + 1);
    let after = &messages[start..];
    // The calls since the prompt as (id, name, arguments), and the last
    // result as (name, body).
    let (names, last_result): (Vec<Made>, Option<(String, String)>) = if text_tools.is_some() {
        let calls = after
            .iter()
            .filter(|m| m["role"] == "assistant")
            .flat_map(text_calls_in)
            .map(|(n, a)| (String::new(), n, a))
            .collect();
        (calls, after.iter().rev().find_map(text_result))
    } else {
        let calls: Vec<Made> = after
            .iter()
            .filter(|m| m["role"] == "assistant")
            .flat_map(|m| m["tool_calls"].as_array().cloned().unwrap_or_default())
            .map(|c| {
                (
                    c["id"].as_str().unwrap_or("").to_string(),
                    c.pointer("/function/name")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string(),
                    c.pointer("/function/arguments")
                        .and_then(Value::as_str)
                        .unwrap_or("")
                        .to_string(),
                )
            })
            .collect();
        let last = after.iter().rev().find(|m| m["role"] == "tool").map(|res| {
            let id = res["tool_call_id"].as_str().unwrap_or("");
            let name = calls
                .iter()
                .find(|(i, _, _)| i == id)
                .map(|(_, n, _)| n.clone())
                .unwrap_or_default();
            (name, content_of(res))
        });
        (calls, last)
    };
    let call_id = format!("call_{:016x}", mix(seed ^ messages.len() as u64));
    let tool = |name: &str, args: Value| {
        let call = Call {
            id: call_id.clone(),
            name: name.to_string(),
            arguments: args.to_string(),
        };
        if text_tools.is_some() {
            Turn::TextTools(vec![call])
        } else {
            Turn::Tools(vec![call])
        }
    };
    let has = |n: &str| tools.iter().any(|t| t == n);
    if !tools.is_empty() {
        match &last_result {
            None if has("search") => return tool("search", json!({"q": query})),
            None if has("fetch") => return tool("fetch", json!({"url": fallback})),
            Some((name, body)) if name == "search" && has("fetch") => {
                let url = serde_json::from_str::<Value>(body)
                    .ok()
                    .as_ref()
                    .and_then(first_url)
                    .unwrap_or(fallback.clone());
                return tool("fetch", json!({"url": url}));
            }
            _ => {}
        }
    }
    // Cite what was fetched, if anything.
    let cited = names
        .iter()
        .rev()
        .find(|(_, n, _)| n == "fetch")
        .and_then(|(_, _, a)| serde_json::from_str::<Value>(a).ok())
        .and_then(|a| a["url"].as_str().map(str::to_string))
        .unwrap_or(fallback);
    Turn::Text(write_section(&prompt, &cited, seed))
}

const OPENERS: &[&str] = &[
    "A lease is a promise with an expiry date, and that expiry is what lets a system move on without the holder's consent.",
    "Ownership in a distributed system is never observed directly; it is inferred from records that may already be stale.",
    "Every retry begins with a question about which state is still trustworthy after the failure.",
    "Timeouts tell the caller that it stopped waiting, not that the callee stopped working.",
];
const MIDDLES: &[&str] = &[
    "Fencing tokens turn that inference into a check: a write carries the epoch it was granted under, and the store refuses anything older.",
    "A revision-conditioned write makes the check and the update one step, so a reclaim between them cannot slip through.",
    "Checkpoints bound the work that can be lost, but only if they record a coherent unit that the next owner is allowed to trust.",
    "Heartbeats extend the lease while the holder is healthy; when they stop, the lease lapses and another worker may take over.",
];
const CLOSERS: &[&str] = &[
    "The guarantee is narrow and honest: only the current recorded owner may advance the durable state.",
    "What remains is at-least-once computation with owner-checked transitions and reconciled external effects.",
    "Recovery code is made of these interleavings, which is why it must be tested under injected faults.",
];

/// A few paragraphs of Markdown for the section, citing `url`.
pub fn write_section(prompt: &str, url: &str, seed: u64) -> String {
    let title: String = {
        // Prompts that lead with "Title: ..." name their section.
        if let Some((head, _)) = prompt
            .split_once(':')
            .filter(|(h, _)| !h.trim().is_empty() && h.len() <= 120)
        {
            return write_body(head.trim(), url, seed);
        }
        let w = words(prompt, 8);
        let t = if w.is_empty() {
            "Section".to_string()
        } else {
            w.join(" ")
        };
        let mut c = t.chars();
        c.next()
            .map(|f| f.to_uppercase().collect::<String>() + c.as_str())
            .unwrap_or_default()
    };
    write_body(&title, url, seed)
}

fn write_body(title: &str, url: &str, seed: u64) -> String {
    let pick =
        |bank: &[&'static str], salt: u64| bank[(mix(seed ^ salt) % bank.len() as u64) as usize];
    format!(
        "## {title}\n\n{} {}\n\n{} {}\n\n{}\n\nSource: [{url}]({url})\n",
        pick(OPENERS, 1),
        pick(MIDDLES, 2),
        pick(MIDDLES, 3),
        pick(OPENERS, 4),
        pick(CLOSERS, 5),
    )
}

fn chunk(id: &str, model: &str, delta: Value, finish: Option<&str>) -> String {
    json!({"id": id, "object": "chat.completion.chunk", "created": 0, "model": model,
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    .to_string()
}

/// The streamed chunks of a turn; the last one carries `finish_reason`.
/// With `whole_calls` each tool call arrives in one chunk (as Ollama sends
/// them), otherwise its arguments come in three fragments (as OpenAI's do).
pub fn stream_chunks(id: &str, model: &str, turn: &Turn, whole_calls: bool) -> Vec<String> {
    let mut out = vec![chunk(
        id,
        model,
        json!({"role": "assistant", "content": ""}),
        None,
    )];
    match turn {
        Turn::Text(text) => {
            for token in text.split_inclusive(' ') {
                out.push(chunk(id, model, json!({"content": token}), None));
            }
            out.push(chunk(id, model, json!({}), Some("stop")));
        }
        Turn::TextTools(calls) => {
            for token in text_calls(calls).split_inclusive(' ') {
                out.push(chunk(id, model, json!({"content": token}), None));
            }
            out.push(chunk(id, model, json!({}), Some("stop")));
        }
        Turn::Refusal(text) => {
            out.push(chunk(id, model, json!({"refusal": text}), None));
            out.push(chunk(id, model, json!({}), Some("stop")));
        }
        Turn::Tools(calls) => {
            for (index, call) in calls.iter().enumerate() {
                if whole_calls {
                    out.push(chunk(
                        id,
                        model,
                        json!({"tool_calls": [{"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]}),
                        None,
                    ));
                    continue;
                }
                out.push(chunk(
                    id,
                    model,
                    json!({"tool_calls": [{"index": index, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}]}),
                    None,
                ));
                // Arguments in three fragments, split on character boundaries.
                let chars: Vec<char> = call.arguments.chars().collect();
                let third = chars.len().div_ceil(3).max(1);
                for part in chars.chunks(third) {
                    let frag: String = part.iter().collect();
                    out.push(chunk(
                        id,
                        model,
                        json!({"tool_calls": [{"index": index, "function": {"arguments": frag}}]}),
                        None,
                    ));
                }
            }
            out.push(chunk(id, model, json!({}), Some("tool_calls")));
        }
    }
    out
}

/// The non-streaming response of a turn.
pub fn full_response(id: &str, model: &str, turn: &Turn, usage: Value) -> Value {
    let (message, finish) = match turn {
        Turn::Text(t) => (json!({"role": "assistant", "content": t}), "stop"),
        Turn::TextTools(calls) => (
            json!({"role": "assistant", "content": text_calls(calls)}),
            "stop",
        ),
        Turn::Refusal(r) => (
            json!({"role": "assistant", "content": null, "refusal": r}),
            "stop",
        ),
        Turn::Tools(calls) => {
            let calls: Vec<Value> = calls
                .iter()
                .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
                .collect();
            (
                json!({"role": "assistant", "content": null, "tool_calls": calls}),
                "tool_calls",
            )
        }
    };
    json!({"id": id, "object": "chat.completion", "created": 0, "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage})
}

#[cfg(test)]
mod tests {
    use super::*;

    fn calls() -> Vec<Call> {
        ["search", "fetch"]
            .iter()
            .enumerate()
            .map(|(i, n)| Call {
                id: format!("call_{i}"),
                name: n.to_string(),
                arguments: json!({"q": format!("{n} leases"), "n": [1, 2]}).to_string(),
            })
            .collect()
    }

    fn parsed(chunks: &[String]) -> Vec<Value> {
        chunks
            .iter()
            .map(|c| serde_json::from_str(c).unwrap())
            .collect()
    }

    #[test]
    fn several_calls_stream_by_index_fragmented_or_whole() {
        let turn = Turn::Tools(calls());
        for whole in [false, true] {
            let chunks = parsed(&stream_chunks("id", "m", &turn, whole));
            let mut args = [String::new(), String::new()];
            let mut heads = 0;
            for c in &chunks {
                if let Some(tc) = c.pointer("/choices/0/delta/tool_calls/0") {
                    let i = tc["index"].as_u64().unwrap() as usize;
                    heads += usize::from(tc.get("id").is_some());
                    args[i] += tc["function"]["arguments"].as_str().unwrap();
                }
            }
            assert_eq!(heads, 2);
            for (i, a) in args.iter().enumerate() {
                assert_eq!(a, &calls()[i].arguments, "whole: {whole}");
            }
            let with_calls = chunks
                .iter()
                .filter(|c| c.pointer("/choices/0/delta/tool_calls").is_some())
                .count();
            assert_eq!(with_calls, if whole { 2 } else { 8 });
            assert_eq!(
                chunks.last().unwrap()["choices"][0]["finish_reason"],
                "tool_calls"
            );
        }
        let full = full_response("id", "m", &turn, json!({}));
        assert_eq!(
            full["choices"][0]["message"]["tool_calls"][1]["function"]["name"],
            "fetch"
        );
    }

    #[test]
    fn text_calls_render_one_line_each_and_read_back() {
        let text = text_calls(&calls());
        assert_eq!(
            text,
            "<tool_call>{\"name\": \"search\", \"arguments\": {\"n\": [1, 2], \"q\": \"search leases\"}}</tool_call>\n\
             <tool_call>{\"name\": \"fetch\", \"arguments\": {\"n\": [1, 2], \"q\": \"fetch leases\"}}</tool_call>"
        );
        let back = text_calls_in(&json!({"role": "assistant", "content": text}));
        assert_eq!(back.len(), 2);
        assert_eq!(back[1].0, "fetch");
        assert_eq!(
            serde_json::from_str::<Value>(&back[1].1).unwrap(),
            serde_json::from_str::<Value>(&calls()[1].arguments).unwrap()
        );
        let res = json!({"role": "user", "content": "<tool_result name=\"search\">{\"url\": \"u\"}</tool_result>"});
        assert_eq!(
            text_result(&res),
            Some(("search".into(), "{\"url\": \"u\"}".into()))
        );
        assert_eq!(
            last_user(&[json!({"role": "user", "content": "the prompt"}), res]),
            "the prompt"
        );
    }
}
