//! How the simulated model plays a research agent: search, fetch, write.

use serde_json::{json, Value};
use sha2::{Digest, Sha256};

/// What the model says this turn.
#[derive(Debug, Clone, PartialEq)]
pub enum Turn {
    Text(String),
    Tool {
        id: String,
        name: String,
        arguments: String,
    },
    Refusal(String),
}

impl Turn {
    pub fn size(&self) -> usize {
        match self {
            Turn::Text(t) | Turn::Refusal(t) => t.len(),
            Turn::Tool {
                name, arguments, ..
            } => name.len() + arguments.len(),
        }
    }
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

/// The last user message's text.
pub fn last_user(messages: &[Value]) -> String {
    messages
        .iter()
        .rev()
        .find(|m| m["role"] == "user")
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

/// Decides the next turn from the request.
pub fn decide(req: &Value, messages: &[Value], host: &str, seed: u64) -> Turn {
    let prompt = last_user(messages);
    if let Some(fmt) = req.get("response_format") {
        match fmt.get("type").and_then(Value::as_str) {
            Some("json_schema") => {
                let schema = fmt
                    .pointer("/json_schema/schema")
                    .cloned()
                    .unwrap_or(json!({"type": "object"}));
                // The topic is the first quoted phrase, when the prompt has one.
                let hint = prompt
                    .split('"')
                    .nth(1)
                    .filter(|t| !t.trim().is_empty())
                    .map(str::to_string)
                    .unwrap_or_else(|| words(&prompt, 4).join(" "));
                return Turn::Text(super::schema::instance(&schema, &schema, &hint, 0).to_string());
            }
            Some("json_object") => {
                return Turn::Text(
                    json!({"answer": words(&prompt, 8).join(" "), "ok": true}).to_string(),
                );
            }
            _ => {}
        }
    }
    let tools: Vec<String> = req
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
        .unwrap_or_default();
    let query = words(&prompt, 10).join(" ");
    let slug = words(&prompt, 4).join("-");
    let fallback = format!("http://{host}/page/{slug}");
    let start = messages
        .iter()
        .rposition(|m| m["role"] == "user")
        .map_or(0, |i| i + 1);
    let after = &messages[start..];
    // Tool names by call id, from the assistant messages since the prompt.
    let names: Vec<(String, String, String)> = after
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
    let last_result = after.iter().rev().find(|m| m["role"] == "tool");
    let call_id = format!("call_{:016x}", mix(seed ^ messages.len() as u64));
    let tool = |name: &str, args: Value| Turn::Tool {
        id: call_id.clone(),
        name: name.to_string(),
        arguments: args.to_string(),
    };
    let has = |n: &str| tools.iter().any(|t| t == n);
    if !tools.is_empty() {
        match last_result {
            None if has("search") => return tool("search", json!({"q": query})),
            None if has("fetch") => return tool("fetch", json!({"url": fallback})),
            Some(res) => {
                let id = res["tool_call_id"].as_str().unwrap_or("");
                let name = names
                    .iter()
                    .find(|(i, _, _)| i == id)
                    .map(|(_, n, _)| n.as_str())
                    .unwrap_or("");
                if name == "search" && has("fetch") {
                    let url = serde_json::from_str::<Value>(&content_of(res))
                        .ok()
                        .as_ref()
                        .and_then(first_url)
                        .unwrap_or(fallback.clone());
                    return tool("fetch", json!({"url": url}));
                }
            }
            None => {}
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
pub fn stream_chunks(id: &str, model: &str, turn: &Turn) -> Vec<String> {
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
        Turn::Refusal(text) => {
            out.push(chunk(id, model, json!({"refusal": text}), None));
            out.push(chunk(id, model, json!({}), Some("stop")));
        }
        Turn::Tool {
            id: call_id,
            name,
            arguments,
        } => {
            out.push(chunk(
                id,
                model,
                json!({"tool_calls": [{"index": 0, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}]}),
                None,
            ));
            // Arguments in three fragments, split on character boundaries.
            let chars: Vec<char> = arguments.chars().collect();
            let third = chars.len().div_ceil(3).max(1);
            for part in chars.chunks(third) {
                let frag: String = part.iter().collect();
                out.push(chunk(
                    id,
                    model,
                    json!({"tool_calls": [{"index": 0, "function": {"arguments": frag}}]}),
                    None,
                ));
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
        Turn::Refusal(r) => (
            json!({"role": "assistant", "content": null, "refusal": r}),
            "stop",
        ),
        Turn::Tool {
            id,
            name,
            arguments,
        } => (
            json!({"role": "assistant", "content": null, "tool_calls": [{"id": id, "type": "function", "function": {"name": name, "arguments": arguments}}]}),
            "tool_calls",
        ),
    };
    json!({"id": id, "object": "chat.completion", "created": 0, "model": model,
        "choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage})
}
